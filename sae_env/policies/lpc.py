"""LPC-style baseline: Learned Prefix Caching (Yang, Li, Li, Lloyd; NeurIPS 2025), as far as it is published.

What is known of LPC (abstract, OpenReview TL;DR, reviews): a learned model analyses the conversation's content
(recent user prompts) and predicts the probability that the *conversation continues*; that probability, "combined
with last access timestamps", guides eviction of one prefix cache (its Section 3.4 describes four operations in
prose: insertion, promotion, probability update, eviction). It reports 18-47 % smaller caches than LRU for the
same hit ratio on LMSys, ShareGPT and Chatbot Arena. The exact combination rule is not available to us; this
module implements the idea in the following form, one queue, lowest score evicted first.

Score of a block: the posterior odds that its conversation is still alive after being idle ``dt``. With a prior
continuation probability ``p`` and an exponential idle survival ``S(dt) = exp(-dt / tau)``::

    odds(b) = p / (1 - p) * exp(-(now - t_last) / tau)     ->  log odds = logit(p) - (now - t_last) / tau

Ordering blocks by it is ordering by the time-invariant key ``t_last + tau * logit(p)`` (``now`` is common to all
blocks), so the policy is a :class:`~sae_env.policies.base.KeyedPolicy`: the key is fixed when the block becomes
evictable (a leaf nobody pins), ties (the blocks of one request) go deepest first. With equal ``p`` everywhere it
is exactly LRU by last access. ``tau`` changes only the exchange rate between probability and idleness; when it
drifts by more than 25 % from the value the heap's keys were built with, the evictable set is re-keyed
(``O(n)`` heapify; rare, as ``tau`` is a running mean).

The four operations:

* **insertion** (``on_insert``): a new block takes its request's context ``(logit p, session)``: its parent's
  context when the parent carries a session's context (the parent was just inserted or hit by the same request;
  for output blocks, inserted when the request completes, possibly after other requests arrived, the parent is the
  request's last prompt block), else the context of the latest arrival. No ``on_complete`` hook is needed, which
  keeps the cache's fast instant-mode path (25 % faster).
* **promotion** (the cache updates ``last_access`` on a hit) and **probability update** (``on_hit``): a hit block
  of the same session takes the session's new probability; a block hit by a request of *another* session is a
  shared head (system prompt, template) and gets ``p_shared`` (0.95) for good: several conversations use it.
  Shared heads also stay internal nodes (unevictable) while any conversation below them is cached.
* **probability**: at a session's first request (``turn == 1``), ``p = p_chat + p_agent`` from the classifier
  handed over as ``predictor=`` (a callable ``f(trace, i) -> (p_chat, p_agent)``, optionally with
  ``prepare(trace)``, called once in :meth:`bind`; e.g. :meth:`agents.session_predictor.SessionPredictor.
  as_policy_callable`). Without one, and at every later turn ``k``, ``p`` is the continuation rate observed so far:
  ``(sessions that reached turn k+1 + a) / (sessions that reached turn k + a + b)`` with a Beta(1, 1) prior, turns
  pooled from 8 on (counted at arrivals only: a session that has not yet continued counts as ended). ``p`` is
  clipped to ``[1e-3, 1 - 1e-3]``.
* **eviction** (``evict``): the evictable leaf with the lowest key.
* ``tau``: the mean gap between consecutive turns of a session observed so far (running mean over the first 1,000
  gaps, then an exponential moving average with weight 1/1,000), times the parameter ``tau_scale``; 132 s (the
  Mooncake inter-turn median, ``exp(4.88)``) before the first gap. ``tau=`` fixes it instead.

Differences from the paper where its details are unknown or differ on purpose:

* the combination rule above (posterior odds under an exponential idle survival) is ours;
* the paper's predictor embeds recent user prompts with a 118 M-parameter model and predicts at every turn; here
  the classifier sees the first request only (the SAECache session predictor, ~1 M parameters, or anything with
  the same call), and later turns use the online continuation rate per turn;
* the shared-head rule (``p_shared``) is ours: LPC's radix tree keeps shared prefixes by recency alone;
* per-block state is one tuple ``(logit p, session)`` in ``Block.pdata``; per-request work is a few dict updates.

Parameters (``set_params``): ``tau_scale`` in [0.01, 100] (log scale, default 1), ``p_shared`` in [0.5, 0.999]
(default 0.95). Constructor options: ``predictor``, ``tau`` (seconds, fixed), ``tau0`` (132), ``prior`` ((1, 1)),
``max_turn`` (8), ``p_clip`` (1e-3).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from sae_env.block import Block
from sae_env.policies.base import KeyedPolicy, ParamSpec, block_array
from sae_env.trace import Trace

SHARED = object()  # the "session" of blocks shared by several sessions
_GAP_WINDOW = 1000  # running mean over the first gaps, then EMA with weight 1 / _GAP_WINDOW
_REKEY_DRIFT = 0.25  # re-key the heap when tau moved by more than this fraction


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


class LPCPolicy(KeyedPolicy):
    name = "lpc"
    param_specs = (
        ParamSpec("tau_scale", 0.01, 100.0, 1.0, log=True, doc="multiplier on the learned idle time scale tau"),
        ParamSpec("p_shared", 0.5, 0.999, 0.95, doc="continuation probability of blocks shared across sessions"),
    )

    def __init__(self, predictor: Callable[[Trace, int], Any] | None = None, tau: float | None = None,
                 tau0: float = 132.0, prior: tuple[float, float] = (1.0, 1.0), max_turn: int = 8,
                 p_clip: float = 1e-3):
        super().__init__()
        if predictor is not None and not callable(predictor):
            raise ValueError(f"lpc: predictor must be callable f(trace, i) -> (p_chat, p_agent), got {predictor!r}")
        for name, v in (("tau", tau), ("tau0", tau0)):
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"lpc: {name} must be a positive number of seconds, got {v!r}")
        if len(prior) != 2 or min(prior) <= 0:
            raise ValueError(f"lpc: prior must be two positive pseudo-counts (a, b), got {prior!r}")
        if isinstance(max_turn, bool) or not isinstance(max_turn, int) or max_turn < 1:
            raise ValueError(f"lpc: max_turn must be an integer >= 1, got {max_turn!r}")
        if not 0 < p_clip < 0.5:
            raise ValueError(f"lpc: p_clip must lie in (0, 0.5), got {p_clip!r}")
        self.predictor = predictor
        self.fixed_tau = None if tau is None else float(tau)
        self.prior = (float(prior[0]), float(prior[1]))
        self.max_turn = max_turn
        self.p_clip = float(p_clip)
        self._tau_learned = float(tau0)
        self._gaps = 0
        self._reached = [0] * (max_turn + 1)  # sessions that reached turn k (k = max_turn pools the rest)
        self._continued = [0] * (max_turn + 1)  # ... and then reached turn k + 1
        self._last: dict[int, float] = {}  # session -> arrival of its latest request
        self._prune_at = 1 << 16
        # Per request, as arrays (a list of Python ints costs ~40 bytes a request, more than the compiled engine's
        # whole cache row per block): the session (unknown ones unique) and the turn.
        self._sid = np.zeros(0, dtype=np.int64)
        self._turn = np.zeros(0, dtype=np.int64)
        self._trace: Trace | None = None
        self._cur: tuple[float, Any] = (0.0, None)  # context of the latest arrival: (logit p, session)
        self._now = 0.0
        self.params_changed()
        self._keyed_tau = self.tau
        self.reset_window()

    # -- parameters ----------------------------------------------------------------------------------------
    @property
    def tau(self) -> float:
        """The idle time scale in use (seconds)."""
        return (self.fixed_tau if self.fixed_tau is not None else self._tau_learned) * self._params["tau_scale"]

    def params_changed(self) -> None:
        old = (getattr(self, "_shared_logit", None), getattr(self, "_keyed_scale", None))
        self._shared_logit = _logit(self._params["p_shared"])
        self._shared = (self._shared_logit, SHARED)
        # Agents may send the same parameters every window: re-key only when a parameter really changed, so that
        # setting unchanged values is a no-op (tau's own drift is handled where tau is learned).
        if self.cache is not None and (self._shared_logit, self._params["tau_scale"]) != old:
            self._rekey()
        self._keyed_scale = self._params["tau_scale"]

    def _rekey(self) -> None:
        """Rebuild the heap's keys with the current tau (and p_shared)."""
        self._keyed_tau = self.tau
        heap = [(self.priority(b, self._now), seq, b) for _, seq, b in self._heap if b.stamp == seq]
        heapq.heapify(heap)
        self._heap = heap

    # -- the probability -------------------------------------------------------------------------------------
    def p_first(self, trace: Trace, i: int) -> float:
        """The predictor's continuation probability for request ``i`` (a session's first), checked."""
        r = self.predictor(trace, i)
        if isinstance(r, (int, float)):
            p = float(r)
        else:
            p = float(r[0]) + float(r[1])
        if not (0.0 <= p <= 1.0 + 1e-6):
            raise ValueError(f"lpc: predictor gave a continuation probability {p!r} for request {i} (need [0, 1])")
        return p

    def bind(self, trace: Trace) -> None:
        self._trace = trace
        self._sid = trace.session_ids()
        self._turn = trace.turn
        prepare = getattr(self.predictor, "prepare", None)
        if prepare is not None:
            prepare(trace)

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        if trace is not self._trace:
            raise RuntimeError("lpc: bind() was called with a different trace than the one being replayed")
        self._now = now
        s = int(self._sid[i])
        k = int(self._turn[i])
        kb = k if k < self.max_turn else self.max_turn
        last = self._last.get(s)
        if last is not None and self.fixed_tau is None:
            self._gaps += 1
            self._tau_learned += (now - last - self._tau_learned) / min(self._gaps, _GAP_WINDOW)
        if k == 1 and self.predictor is not None:
            p = self.p_first(trace, i)
            self._w_predicted += 1
        else:
            a, b = self.prior
            p = (self._continued[kb] + a) / (self._reached[kb] + a + b)
        if k == 1:
            self._w_first += 1
            self._w_p_first += p
        self._reached[kb] += 1
        if k > 1:
            self._continued[k - 1 if k - 1 < self.max_turn else self.max_turn] += 1
        c = self.p_clip
        p = c if p < c else (1.0 - c if p > 1.0 - c else p)
        self._cur = (_logit(p), s)
        self._last[s] = now
        if len(self._last) > self._prune_at:
            self._prune(now)
        tau = self.tau
        if abs(tau - self._keyed_tau) > _REKEY_DRIFT * self._keyed_tau:
            self._rekey()

    def _prune(self, now: float) -> None:
        """Forget sessions idle for more than 50 tau (only their next gap is lost); amortised O(1)."""
        horizon = now - 50.0 * self.tau
        self._last = {s: t for s, t in self._last.items() if t >= horizon}
        self._prune_at = max(1 << 16, 2 * len(self._last))

    # -- per-block hooks -------------------------------------------------------------------------------------
    def on_insert(self, block: Block, now: float) -> None:
        parent = block.parent
        if parent is not None:
            d = parent.pdata
            if d[1] is not SHARED:
                block.pdata = d
                return
        block.pdata = self._cur

    def on_hit(self, blocks: list[Block], now: float) -> None:
        cur = self._cur
        s = cur[1]
        shared = self._shared
        for b in blocks:
            b.pdata = cur if b.pdata[1] == s else shared

    def priority(self, block: Block, now: float) -> float:
        d = block.pdata
        return block.last_access + self._keyed_tau * (self._shared_logit if d[1] is SHARED else d[0])

    # -- the state contract ------------------------------------------------------------------------------------
    # A context (logit p, session) is stored as its logit, its session and its kind: 0 a session, 1 shared (the
    # session is then 0), 2 none yet (the latest-arrival context before any arrival).
    def export_pdata(self, index: dict[int, int]) -> dict[str, Any]:
        blocks = self.cache.blocks.values()
        cur_kind = 2 if self._cur[1] is None else 0
        return {"logit": block_array(blocks, index, lambda b: b.pdata[0], np.float64),
                "session": block_array(blocks, index, lambda b: None if b.pdata[1] is SHARED else b.pdata[1]),
                "shared": block_array(blocks, index, lambda b: b.pdata[1] is SHARED),
                "tau_learned": self._tau_learned, "gaps": self._gaps, "keyed_tau": self._keyed_tau,
                "keyed_scale": self._keyed_scale, "now": self._now, "prune_at": self._prune_at,
                "reached": np.array(self._reached, dtype=np.int64),
                "continued": np.array(self._continued, dtype=np.int64),
                "last_sessions": np.fromiter(self._last.keys(), dtype=np.int64, count=len(self._last)),
                "last_times": np.fromiter(self._last.values(), dtype=np.float64, count=len(self._last)),
                "cur_logit": self._cur[0], "cur_session": 0 if cur_kind else self._cur[1], "cur_kind": cur_kind,
                "w_first": self._w_first, "w_predicted": self._w_predicted, "w_p_first": self._w_p_first}

    def import_pdata(self, state: dict[str, Any], blocks: list[Block]) -> None:
        for b, x, s, shared in zip(blocks, state["logit"].tolist(), state["session"].tolist(),
                                   state["shared"].tolist(), strict=True):
            b.pdata = (x, SHARED if shared else s)
        self._tau_learned, self._gaps = float(state["tau_learned"]), int(state["gaps"])
        self._keyed_tau, self._keyed_scale = float(state["keyed_tau"]), float(state["keyed_scale"])
        self._now, self._prune_at = float(state["now"]), int(state["prune_at"])
        self._reached, self._continued = state["reached"].tolist(), state["continued"].tolist()
        self._last = dict(zip(state["last_sessions"].tolist(), state["last_times"].tolist(), strict=True))
        kind = int(state["cur_kind"])
        self._cur = (float(state["cur_logit"]), None if kind == 2 else int(state["cur_session"]))
        self._w_first, self._w_predicted = int(state["w_first"]), int(state["w_predicted"])
        self._w_p_first = float(state["w_p_first"])

    # -- reporting -------------------------------------------------------------------------------------------
    def window_stats(self) -> dict[str, Any]:
        k = self.max_turn
        a, b = self.prior
        return {"tau_s": self.tau, "gaps_seen": self._gaps, "first_requests": self._w_first,
                "predicted": self._w_predicted,
                "mean_p_first": self._w_p_first / self._w_first if self._w_first else None,
                "p_continue_by_turn": [(self._continued[t] + a) / (self._reached[t] + a + b) for t in range(1, k + 1)]}

    def reset_window(self) -> None:
        self._w_first = 0
        self._w_predicted = 0
        self._w_p_first = 0.0

    def check_invariants(self) -> None:
        super().check_invariants()
        for b in self.cache.blocks.values():
            d = b.pdata
            if not (isinstance(d, tuple) and len(d) == 2 and math.isfinite(d[0])):
                raise RuntimeError(f"lpc: {b!r} has no (logit, session) context: {d!r}")
