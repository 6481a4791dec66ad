"""Compiled twin of ``lpc`` (:class:`~sae_env.policies.lpc.LPCPolicy`): a keyed policy whose key is
``t_last + tau * logit p``, with its online state (the per-turn continuation counts, the learned ``tau``, each
session's last arrival) updated at every arrival in the kernel, by the same arithmetic in the same order.

A block's context ``(logit p, session)`` lives in its row (the logit, the session's dense index, and its kind: 0 a
session, 1 shared, 2 none yet). When ``tau`` drifts by more than 25 % from the value the heap was keyed with, or a
parameter changes, every evictable block is keyed again (:func:`_rekey`, as ``LPCPolicy._rekey``). A predictor's
answers for first requests are computed when the state is loaded (it reads request ``i`` alone), in request order.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from sae_env.fast_engine import heap as hp
from sae_env.fast_engine.jit import implements, inline, jit
from sae_env.fast_engine.loop import FP5, LAST, NCHILD, P1, P4, PARENT, PIN
from sae_env.fast_engine.twin import Twin, register
from sae_env.policies.lpc import LPCPolicy

KIND, LOGIT, SESS = P1, FP5, P4  # in the row: context kind, logit p (float column), session (dense index)
SESSION, SHARED, NONE = 0, 1, 2  # kinds
# Integer scalars: gaps seen, prune threshold, sessions remembered, the latest arrival's session and kind, window
# counts (first requests, predicted), whether a predictor answers first requests, whether tau is fixed, max_turn.
GAPS, PRUNE_AT, N_LAST, CUR_SESS, CUR_KIND, W_FIRST, W_PREDICTED, HAS_PRED, FIXED, MAX_TURN = range(10)
# Float scalars: learned tau, tau the heap is keyed with, tau_scale it was keyed with, the latest arrival, its
# logit, window sum of first-request p, the parameters tau_scale and the shared logit, fixed tau, prior a and b,
# p_clip.
TAU_LEARNED, KEYED_TAU, KEYED_SCALE, NOW, CUR_LOGIT, W_P_FIRST, TAU_SCALE, SHARED_LOGIT, FIXED_TAU, PA, PB, \
    P_CLIP = range(12)
_GAP_WINDOW = 1000
_REKEY_DRIFT = 0.25


class LPCState(NamedTuple):
    heap: hp.Heap
    sess: np.ndarray  # int32 per request: its session's dense index
    turn: np.ndarray  # int32 per request
    p_first: np.ndarray  # float64 per request: the predictor's answer for first requests
    last_t: np.ndarray  # float64 per session: its last arrival
    last_in: np.ndarray  # int8 per session: remembered (LPCPolicy._last holds it)
    reached: np.ndarray  # int64 per turn bucket
    continued: np.ndarray  # int64 per turn bucket
    si: np.ndarray  # int64 scalars
    sf: np.ndarray  # float64 scalars


@inline
def _tau(ps):
    return (ps.sf[FIXED_TAU] if ps.si[FIXED] else ps.sf[TAU_LEARNED]) * ps.sf[TAU_SCALE]


@inline
def _key(ps, c, s):
    """LPCPolicy.priority."""
    x = ps.sf[SHARED_LOGIT] if c.rec[s, KIND] == SHARED else c.recf[s, LOGIT]
    return c.recf[s, LAST] + ps.sf[KEYED_TAU] * x


@jit
def _rekey(ps, c):
    """LPCPolicy._rekey: every evictable block keyed with the current tau. Rare: compiled apart."""
    ps.sf[KEYED_TAU] = _tau(ps)
    e = ps.heap.e
    w = 0
    for i in range(ps.heap.sc[hp.HSIZE]):
        s = np.int64(e[i, hp.SLOT])
        if c.rec[s, hp.STAMP] == e[i, hp.SEQ]:
            e[w, hp.A] = _key(ps, c, s)
            e[w, hp.B] = 0.0
            e[w, hp.SEQ] = e[i, hp.SEQ]
            e[w, hp.SLOT] = s
            w += 1
    hp.heapify(ps.heap, w)


@jit
def _prune(ps, now):
    """LPCPolicy._prune: forget sessions idle for more than 50 tau."""
    horizon = now - 50.0 * _tau(ps)
    n = 0
    for s in range(ps.last_t.size):
        if ps.last_in[s]:
            if ps.last_t[s] >= horizon:
                n += 1
            else:
                ps.last_in[s] = 0
    ps.si[N_LAST] = n
    ps.si[PRUNE_AT] = max(1 << 16, 2 * n)


@implements(LPCState, "on_request")
def _request(ps, c, i, now):
    si, sf = ps.si, ps.sf
    sf[NOW] = now
    s = ps.sess[i]
    k = ps.turn[i]
    max_turn = si[MAX_TURN]
    kb = k if k < max_turn else max_turn
    if ps.last_in[s] and not si[FIXED]:
        si[GAPS] += 1
        sf[TAU_LEARNED] += (now - ps.last_t[s] - sf[TAU_LEARNED]) / min(si[GAPS], _GAP_WINDOW)
    if k == 1 and si[HAS_PRED]:
        p = ps.p_first[i]
        si[W_PREDICTED] += 1
    else:
        p = (ps.continued[kb] + sf[PA]) / (ps.reached[kb] + sf[PA] + sf[PB])
    if k == 1:
        si[W_FIRST] += 1
        sf[W_P_FIRST] += p
    ps.reached[kb] += 1
    if k > 1:
        ps.continued[k - 1 if k - 1 < max_turn else max_turn] += 1
    clip = sf[P_CLIP]
    p = clip if p < clip else (1.0 - clip if p > 1.0 - clip else p)
    sf[CUR_LOGIT] = math.log(p / (1.0 - p))
    si[CUR_SESS] = s
    si[CUR_KIND] = SESSION
    if not ps.last_in[s]:
        ps.last_in[s] = 1
        si[N_LAST] += 1
    ps.last_t[s] = now
    if si[N_LAST] > si[PRUNE_AT]:
        _prune(ps, now)
    tau = _tau(ps)
    if abs(tau - sf[KEYED_TAU]) > _REKEY_DRIFT * sf[KEYED_TAU]:
        _rekey(ps, c)


@inline
def _take_current(ps, rec, recf, s):
    rec[s, KIND] = ps.si[CUR_KIND]
    rec[s, SESS] = ps.si[CUR_SESS]
    recf[s, LOGIT] = ps.sf[CUR_LOGIT]


@implements(LPCState, "on_insert")
def _insert(ps, c, s, now):
    rec, recf = c.rec, c.recf
    p = rec[s, PARENT]
    if p >= 0 and rec[p, KIND] != SHARED:  # its parent's context: the same request's
        rec[s, KIND] = rec[p, KIND]
        rec[s, SESS] = rec[p, SESS]
        recf[s, LOGIT] = recf[p, LOGIT]
    else:
        _take_current(ps, rec, recf, s)
    rec[s, hp.STAMP] = 0


@implements(LPCState, "on_hit")
def _hit(ps, c, path, i0, i1, now):
    rec, recf = c.rec, c.recf
    kind, sess = ps.si[CUR_KIND], ps.si[CUR_SESS]
    for i in range(i0, i1):
        s = path[i]
        if rec[s, KIND] == kind and (kind == NONE or rec[s, SESS] == sess):
            _take_current(ps, rec, recf, s)
        else:  # LPCPolicy._shared: (the shared logit now, shared)
            rec[s, KIND] = SHARED
            recf[s, LOGIT] = ps.sf[SHARED_LOGIT]


@implements(LPCState, "on_release")
def _release(ps, c, path, i0, i1, now):
    rec = c.rec
    for i in range(i1 - 1, i0 - 1, -1):
        s = path[i]
        if rec[s, NCHILD] == 0:
            hp.push(ps.heap, rec, s, _key(ps, c, s), 0.0)


@implements(LPCState, "on_leaf")
def _leaf(ps, c, s):
    if c.rec[s, PIN] == 0:
        hp.push(ps.heap, c.rec, s, _key(ps, c, s), 0.0)


implements(LPCState, "on_acquire")(lambda ps, c, path, i0, i1: hp.acquire(c.rec, path, i0, i1))
implements(LPCState, "evict")(lambda ps, c, now: hp.pop_valid(ps.heap, c.rec))


@register
class LPCTwin(Twin):
    classes = (LPCPolicy,)
    chained = True  # a block inherits its parent's context

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        policy, trace = self.policy, self.trace
        self._core = core
        sid = trace.session_ids()
        self._sessions, sess = np.unique(sid, return_inverse=True)
        m = policy.max_turn + 1
        n_sess = self._sessions.size
        last_t, last_in = np.zeros(n_sess), np.zeros(n_sess, dtype=np.int8)
        known = state["last_sessions"]
        at = np.searchsorted(self._sessions, known)
        if known.size and not np.array_equal(self._sessions[np.minimum(at, n_sess - 1)], known):
            raise ValueError("lpc: the state remembers sessions the trace does not have")
        last_t[at], last_in[at] = state["last_times"], 1
        turn = trace.turn.astype(np.int32)
        p_first = np.zeros(len(trace))
        if policy.predictor is not None:
            for i in np.flatnonzero(turn == 1).tolist():
                p_first[i] = policy.p_first(trace, i)
        params = policy.params
        kind = int(state["cur_kind"])
        cur_sess = 0 if kind else int(np.searchsorted(self._sessions, state["cur_session"]))
        si = np.array([state["gaps"], state["prune_at"], known.size, cur_sess, kind, state["w_first"],
                       state["w_predicted"], policy.predictor is not None, policy.fixed_tau is not None,
                       policy.max_turn], dtype=np.int64)
        a, b = policy.prior
        sf = np.array([state["tau_learned"], state["keyed_tau"], state["keyed_scale"], state["now"],
                       state["cur_logit"], state["w_p_first"], params["tau_scale"], _logit(params["p_shared"]),
                       policy.fixed_tau or 0.0, a, b, policy.p_clip])
        reached, continued = np.zeros(m, np.int64), np.zeros(m, np.int64)
        reached[:], continued[:] = state["reached"], state["continued"]
        self.state = LPCState(hp.new_heap(self.capacity), sess.astype(np.int32), turn, p_first, last_t, last_in,
                              reached, continued, si, sf)
        rec = core.rec
        shared = state["shared"].astype(bool)
        rec[:n, KIND] = np.where(shared, SHARED, SESSION)
        rec[:n, SESS] = np.where(shared, 0, np.searchsorted(self._sessions, state["session"]))
        core.recf[:n, LOGIT] = state["logit"]
        x = np.where(shared, sf[SHARED_LOGIT], state["logit"])
        hp.load_heap(self.state.heap, rec, n, state["stamp"], int(state["seq"]),
                     core.recf[:n, LAST] + sf[KEYED_TAU] * x, np.zeros(n))

    def export(self, n: int, core: Any) -> dict[str, Any]:
        ps, rec = self.state, core.rec
        si, sf = ps.si, ps.sf
        shared = rec[:n, KIND] == SHARED
        live = np.flatnonzero(ps.last_in)
        return {"stamp": rec[:n, hp.STAMP].astype(np.int64), "seq": int(ps.heap.sc[hp.HSEQ]),
                "logit": core.recf[:n, LOGIT].copy(), "session": np.where(shared, 0, self._sessions[rec[:n, SESS]]),
                "shared": shared.astype(np.int64), "tau_learned": float(sf[TAU_LEARNED]), "gaps": int(si[GAPS]),
                "keyed_tau": float(sf[KEYED_TAU]), "keyed_scale": float(sf[KEYED_SCALE]), "now": float(sf[NOW]),
                "prune_at": int(si[PRUNE_AT]), "reached": ps.reached.copy(), "continued": ps.continued.copy(),
                "last_sessions": self._sessions[live], "last_times": ps.last_t[live],
                "cur_logit": float(sf[CUR_LOGIT]), "cur_kind": int(si[CUR_KIND]),
                "cur_session": int(self._sessions[si[CUR_SESS]]) if si[CUR_KIND] == SESSION else 0,
                "w_first": int(si[W_FIRST]), "w_predicted": int(si[W_PREDICTED]), "w_p_first": float(sf[W_P_FIRST])}

    def begin_window(self) -> None:  # LPCPolicy.reset_window
        self.state.si[W_FIRST] = self.state.si[W_PREDICTED] = 0
        self.state.sf[W_P_FIRST] = 0.0

    def params_changed(self) -> None:  # LPCPolicy.params_changed
        sf = self.state.sf
        params = self.policy.params
        old = (float(sf[SHARED_LOGIT]), float(sf[KEYED_SCALE]))
        sf[SHARED_LOGIT] = _logit(params["p_shared"])
        sf[TAU_SCALE] = params["tau_scale"]
        if (float(sf[SHARED_LOGIT]), params["tau_scale"]) != old:
            _rekey(self.state, self._core)
        sf[KEYED_SCALE] = params["tau_scale"]

    def window_stats(self) -> dict[str, Any]:  # LPCPolicy.window_stats
        ps = self.state
        si, sf = ps.si, ps.sf
        a, b = float(sf[PA]), float(sf[PB])
        k = int(si[MAX_TURN])
        reached, continued = ps.reached.tolist(), ps.continued.tolist()
        w_first = int(si[W_FIRST])
        tau = (float(sf[FIXED_TAU]) if si[FIXED] else float(sf[TAU_LEARNED])) * float(sf[TAU_SCALE])
        return {"tau_s": tau, "gaps_seen": int(si[GAPS]), "first_requests": w_first,
                "predicted": int(si[W_PREDICTED]), "mean_p_first": float(sf[W_P_FIRST]) / w_first if w_first else None,
                "p_continue_by_turn": [(continued[t] + a) / (reached[t] + a + b) for t in range(1, k + 1)]}


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))
