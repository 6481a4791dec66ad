"""Compiled twins of Belady and the partial oracles (:mod:`sae_env.policies.belady`,
:mod:`sae_env.policies.partial_oracle`): keyed policies over the oracle's knowledge.

The knowledge (each occurrence's next use, Belady's ``next_uses``) is exported by the policy with its state, and
read here in place: a block's next use is that of its occurrence in the request whose hooks run (its depth picks the
occurrence), followed along the key's chain of uses past the latest request admitted (timed mode inserts outputs
after later arrivals). Keys, as the Python priorities: ``belady`` ``(-next use, -depth)``; ``reuse-oracle`` ``(0 if
never used again else 1, release order)``; ``when-oracle`` ``(-bucketed next use, release order)``;
``session-oracle`` ``(0 if its last user ended its session else 1, release order)``. A next use of "never" is
``INT32_MAX`` in a slot's row and ``NEVER`` (int64 max) in the exported state; as a float key it is
``float(NEVER)``, as in Python.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from sae_env.fast_engine import heap as hp
from sae_env.fast_engine.jit import implements, inline, jit, rebind
from sae_env.fast_engine.loop import DEPTH, FP5, NCHILD, P1, P2, PIN
from sae_env.fast_engine.twin import Twin, register
from sae_env.policies.belady import NEVER, BeladyPolicy
from sae_env.policies.partial_oracle import ReuseOraclePolicy, SessionOraclePolicy, WhenOraclePolicy

NU, REL = P1, P2  # a block's next use (belady, reuse-oracle) or last user (session-oracle); its release order
WREL, EST = P1, FP5  # when-oracle: release order, and the bucketed next use (a float)
NONE32 = np.iinfo(np.int32).max  # "never", in a row
FRONTIER, CONTEXT, RELEASED = range(3)  # scalars: latest request admitted, request whose hooks run, releases


class BeladyState(NamedTuple):
    heap: hp.Heap
    ctx: np.ndarray  # int64 scalars
    next_occ: np.ndarray  # int32 (int64 past 2**31 occurrences) per occurrence: its next use (-1: none)
    occ_req: np.ndarray  # same type, per occurrence: its request


class ReuseState(NamedTuple):
    heap: hp.Heap
    ctx: np.ndarray
    next_occ: np.ndarray
    occ_req: np.ndarray


class WhenState(NamedTuple):
    heap: hp.Heap
    ctx: np.ndarray
    next_occ: np.ndarray
    occ_req: np.ndarray
    fp: np.ndarray  # float64 [factor, log factor, sqrt factor]


class SessionState(NamedTuple):
    heap: hp.Heap
    ctx: np.ndarray
    session: np.ndarray  # int64 per request
    has_next: np.ndarray  # bool per request: its session has a later request


@inline
def _context(ps, c):
    """What _next needs of the request whose hooks run: (the latest request admitted, the occurrence of its first
    prompt block, of its first output block minus its prompt length, its prompt length), read once per hook
    call."""
    i = ps.ctx[CONTEXT]
    po = c.po
    n_prompt = po[i + 1] - po[i]
    return ps.ctx[FRONTIER], po[i], c.n_pr + c.oo[i] - n_prompt, n_prompt


@inline
def _next(ps, rec, ctx, s):
    """BeladyPolicy._next: the next use (request index, NEVER if none) of slot ``s`` seen from the context."""
    frontier, prompt_at, output_at, n_prompt = ctx
    d = rec[s, DEPTH]
    occ = ps.next_occ[prompt_at + d if d < n_prompt else output_at + d]
    while occ >= 0 and ps.occ_req[occ] <= frontier:
        # timed mode: outputs inserted after later arrivals; follow the key's chain of uses
        occ = ps.next_occ[occ]
    return NEVER if occ < 0 else np.int64(ps.occ_req[occ])


@inline
def _to_row(nu):
    return NONE32 if nu == NEVER else nu


@inline
def _estimate(ps, nu):
    """WhenOraclePolicy._estimate."""
    if nu == NEVER or ps.fp[1] == 0.0:
        return float(nu)
    frontier = ps.ctx[FRONTIER]
    k = math.floor(math.log(float(nu - frontier)) / ps.fp[1] + 1e-12)
    return frontier + math.pow(ps.fp[0], float(k)) * ps.fp[2]


# Per policy: the key of a slot at the moment it becomes evictable (a, b), and what the oracle learns of a slot on
# insertion and on a hit (its pdata before a release).
@inline
def _belady_key(ps, c, s):
    nu = c.rec[s, NU]
    return -float(NEVER if nu == NONE32 else nu), -float(c.rec[s, DEPTH])


@inline
def _reuse_key(ps, c, s):
    return 0.0 if c.rec[s, NU] == NONE32 else 1.0, float(c.rec[s, REL])


@inline
def _when_key(ps, c, s):
    return -c.recf[s, EST], float(c.rec[s, WREL])


@inline
def _session_key(ps, c, s):
    user = c.rec[s, NU]
    return 0.0 if user >= 0 and not ps.has_next[user] else 1.0, float(c.rec[s, REL])


# _know(ps, rec, recf, ctx, s): what the oracle learns of slot s on a hit (ctx: _context's, for the oracles that
# read next uses); _first: the same on insertion.
@inline
def _next_use(ps, rec, recf, ctx, s):
    rec[s, NU] = _to_row(_next(ps, rec, ctx, s))
    rec[s, REL] = -1


@inline
def _when_know(ps, rec, recf, ctx, s):
    recf[s, EST] = _estimate(ps, _next(ps, rec, ctx, s))
    rec[s, WREL] = -1


@inline
def _session_know(ps, rec, recf, ctx, s):
    cur = ps.ctx[CONTEXT]
    user = rec[s, NU]
    rec[s, NU] = -1 if user < 0 or ps.session[user] != ps.session[cur] else cur
    rec[s, REL] = -1


@inline
def _session_first(ps, rec, recf, ctx, s):
    rec[s, NU] = ps.ctx[CONTEXT]
    rec[s, REL] = -1


@inline
def _no_context(ps, c):
    return -1, 0, 0, 0


# The hooks every oracle shares, written with the names _key, _know, _first (on_insert), _rel (the release order's
# column, -1: none, as belady keeps none) and bound per policy by rebind().
def _request(ps, c, j, now):
    ps.ctx[FRONTIER] = j
    ps.ctx[CONTEXT] = j


def _complete(ps, c, j, now):
    ps.ctx[CONTEXT] = j


def _insert(ps, c, s, now):
    _first(ps, c.rec, c.recf, _ctx(ps, c), s)  # noqa: F821 - bound by rebind


def _hit(ps, c, path, i0, i1, now):
    rec, recf = c.rec, c.recf
    ctx = _ctx(ps, c)  # noqa: F821
    for i in range(i0, i1):
        _know(ps, rec, recf, ctx, path[i])  # noqa: F821


def _release(ps, c, path, i0, i1, now):
    rec = c.rec
    for i in range(i1 - 1, i0 - 1, -1):
        s = path[i]
        if _rel >= 0:  # noqa: F821 - _ReleaseOrder: the release order
            ps.ctx[RELEASED] += 1
            rec[s, _rel] = ps.ctx[RELEASED]  # noqa: F821
        if rec[s, NCHILD] == 0:
            a, b = _key(ps, c, s)  # noqa: F821
            hp.push(ps.heap, rec, s, a, b)


def _leaf(ps, c, s):
    if c.rec[s, PIN] == 0:
        a, b = _key(ps, c, s)  # noqa: F821
        hp.push(ps.heap, c.rec, s, a, b)


def _acquire(ps, c, path, i0, i1):
    hp.acquire(c.rec, path, i0, i1)


def _evict(ps, c, now):
    return hp.pop_valid(ps.heap, c.rec)


def _keys_of(ps, c, slots, a, b):
    for x in range(slots.size):
        a[x], b[x] = _key(ps, c, slots[x])  # noqa: F821


_KEYS_OF = {}
for _cls, _names in ((BeladyState, {"_key": _belady_key, "_know": _next_use, "_first": _next_use, "_rel": -1,
                                    "_ctx": _context}),
                     (ReuseState, {"_key": _reuse_key, "_know": _next_use, "_first": _next_use, "_rel": REL,
                                   "_ctx": _context}),
                     (WhenState, {"_key": _when_key, "_know": _when_know, "_first": _when_know, "_rel": WREL,
                                  "_ctx": _context}),
                     (SessionState, {"_key": _session_key, "_know": _session_know, "_first": _session_first,
                                     "_rel": REL, "_ctx": _no_context})):
    for _hook, _f in (("on_request", _request), ("on_complete", _complete), ("on_insert", _insert),
                      ("on_hit", _hit), ("on_release", _release), ("on_leaf", _leaf), ("on_acquire", _acquire),
                      ("evict", _evict)):
        implements(_cls, _hook)(rebind(_f, **_names))
    _KEYS_OF[_cls] = jit(rebind(_keys_of, _key=_names["_key"]))


class _OracleTwin(Twin):
    chained = True  # a block's depth names its occurrence
    knowledge_fields = ("next_occ", "occ_req")

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        ctx = np.array([state.get("frontier", -1), state["context"], state.get("n_released", 0)], dtype=np.int64)
        self.state = self.state_class(hp.new_heap(self.capacity), ctx, *self.extra(state))
        self.load_rows(state, n, core)
        stamps = state["stamp"]
        live = np.flatnonzero(stamps)  # the evictable blocks: their keys as they were when they became evictable
        a, b = np.zeros(n), np.zeros(n)
        ka, kb = np.zeros(live.size), np.zeros(live.size)
        _KEYS_OF[self.state_class](self.state, core, live.astype(np.int64), ka, kb)
        a[live], b[live] = ka, kb
        hp.load_heap(self.state.heap, core.rec, n, stamps, int(state["seq"]), a, b)

    def extra(self, state: dict[str, Any]) -> tuple:
        return tuple(state[f] for f in self.knowledge_fields)

    def export(self, n: int, core: Any) -> dict[str, Any]:
        ctx = self.state.ctx
        out = {"stamp": core.rec[:n, hp.STAMP].astype(np.int64), "seq": int(self.state.heap.sc[hp.HSEQ]),
               "context": int(ctx[CONTEXT]), "frontier": int(ctx[FRONTIER]),
               **dict(zip(self.knowledge_fields, self.state[2:2 + len(self.knowledge_fields)], strict=True))}
        out.update(self.export_rows(n, core))
        return out


def _never_to_row(nu: np.ndarray) -> np.ndarray:
    return np.where(nu == NEVER, NONE32, nu)


def _row_to_never(nu: np.ndarray) -> np.ndarray:
    nu = nu.astype(np.int64)
    return np.where(nu == NONE32, NEVER, nu)


@register
class BeladyTwin(_OracleTwin):
    classes = (BeladyPolicy,)
    state_class = BeladyState

    def load_rows(self, state: dict[str, Any], n: int, core: Any) -> None:
        core.rec[:n, NU] = _never_to_row(state["next_use"])

    def export_rows(self, n: int, core: Any) -> dict[str, Any]:
        return {"next_use": _row_to_never(core.rec[:n, NU])}


class _ReleaseTwin(_OracleTwin):
    """The partial oracles: knowledge and release order per block (release order -1: not released since its last
    hit, pdata is the bare knowledge)."""

    rel: int

    def export_rows(self, n: int, core: Any) -> dict[str, Any]:
        return {"knowledge": self.knowledge_out(n, core), "released_at": core.rec[:n, self.rel].astype(np.int64),
                "n_released": int(self.state.ctx[RELEASED])}

    def load_rows(self, state: dict[str, Any], n: int, core: Any) -> None:
        core.rec[:n, self.rel] = state["released_at"]
        self.knowledge_in(state["knowledge"], n, core)


@register
class ReuseTwin(_ReleaseTwin):
    classes = (ReuseOraclePolicy,)
    state_class, rel = ReuseState, REL

    def knowledge_in(self, k: np.ndarray, n: int, core: Any) -> None:
        core.rec[:n, NU] = _never_to_row(k)

    def knowledge_out(self, n: int, core: Any) -> np.ndarray:
        return _row_to_never(core.rec[:n, NU])


@register
class WhenTwin(_ReleaseTwin):
    classes = (WhenOraclePolicy,)
    state_class, rel = WhenState, WREL

    def extra(self, state: dict[str, Any]) -> tuple:
        f = float(self.policy.factor)  # the policy's derived constants, by its own expressions
        return (*super().extra(state), np.array([f, math.log(f) if f > 1 else 0.0, math.sqrt(f)]))

    def knowledge_in(self, k: np.ndarray, n: int, core: Any) -> None:
        core.recf[:n, EST] = k

    def knowledge_out(self, n: int, core: Any) -> np.ndarray:
        return core.recf[:n, EST].copy()


@register
class SessionTwin(_ReleaseTwin):
    classes = (SessionOraclePolicy,)
    state_class, rel = SessionState, REL
    knowledge_fields = ("request_session", "has_next")

    def knowledge_in(self, k: np.ndarray, n: int, core: Any) -> None:
        core.rec[:n, NU] = k

    def knowledge_out(self, n: int, core: Any) -> np.ndarray:
        return core.rec[:n, NU].astype(np.int64)
