"""What SAECache learns from the arrivals alone: each request's queue and continuation bin, the sessions' gaps, the
shared prefixes' reuse rate, and when its ranking constants are refitted.

None of it depends on what the cache holds or decides: given the trace and the policy's parameters (set between
windows), it is the same on every engine. That is why it lives apart from the policy's cache structures
(:mod:`sae_env.policies.saecache`): the compiled twin (:mod:`sae_env.fast_engine.saecache`) runs it ahead of its
request loop, a window at a time, and the loop applies what it says at the same request.

Per arrival (:meth:`Arrivals.arrive`): the request's queue (chat / agent for a (predicted) multi-turn session, else
priority-eviction), its continuation bin (the online continuation model's ``p``, on the logit scale), whether the policy
refits its turnover time and continuation model at this arrival (every ``REFIT_EVERY`` arrivals; the model is offered an
update here and refits by its schedule; it also refreshes at any arrival once its last refit lies a typical chat gap
back: see continuation.py), and whether the request used a shared prefix (the structural queue's reuse rate moved). The
gap statistics the online learners read (:meth:`window_stats`) are counted here too.
"""

from __future__ import annotations

import copy
import math
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from sae_env.policies.base import request_array
from sae_env.policies.continuation import P_CLIP, ContinuationModel
from sae_env.policies.survival import LognormalGaps
from sae_env.trace import AppType, TokenType, Trace

__all__ = ["AG", "CH", "LOGIT_BIN", "LOGIT_MAX", "N_QUEUES", "N_SLOTS", "PE", "QUEUES", "REBIN_MOVE", "REFIT_EVERY",
           "ST", "Arrivals", "model_moved", "rebin_last", "rebin_last_state", "slot_of",
           "slot_p"]

PE, ST, CH, AG = 0, 1, 2, 3
QUEUES = ("priority_eviction", "structural", "chat", "agent")
N_QUEUES = len(QUEUES)
REFIT_EVERY = 64  # arrivals between refits of the turnover time and the continuation model
# A pending request counts as ended once the posterior that its session is alive is below this (continuation.py: the
# error the 3-sigma horizon already accepts for a turn that continues 9 times in 10).
END_BELOW = 0.01
# Continuation probabilities are binned on the logit scale: blocks of one bin share their ranking constants, so a
# group (queue, type, bin) has one score function of the idle time (see SAECachePolicy._best).
LOGIT_BIN = 0.5  # bin width in logit units
LOGIT_MAX = 7.0  # bins cover p in [sigmoid(-7), sigmoid(7)] = [0.0009, 0.9991]
N_SLOTS = int(2 * LOGIT_MAX / LOGIT_BIN) + 1  # slots 1 .. N_SLOTS; slot 0 = no continuation probability (p = 1)
_TEMPLATE = int(TokenType.TEMPLATE)

# SAECache's rebin moves blocks to their requests' current bins only once the continuation model has moved by this much
# since the last rebinning (model_moved): half a bin, the bins' own resolution. A rebinning moves a block only where its
# request's logit crossed a bin's edge, and once a trace's rates have settled most refits move them by a small part of a
# bin: rebinning at each redid the same bins (on mooncake_synthetic made 16 times longer, 998 rebinnings against 61).
REBIN_MOVE = LOGIT_BIN / 2

# A session predictor answers, for a session's first request, (P(continues as chat), P(continues as agent)).
Predictor = Callable[[Trace, int], tuple[float, float]]


def slot_of(p: float) -> int:
    """The logit bin (1 .. N_SLOTS) of a continuation probability."""
    x = math.log(p / (1.0 - p)) if 0.0 < p < 1.0 else (LOGIT_MAX if p >= 1.0 else -LOGIT_MAX)
    x = min(max(x, -LOGIT_MAX), LOGIT_MAX)
    return 1 + int(round((x + LOGIT_MAX) / LOGIT_BIN))


def slot_p(slot: int) -> float:
    """The continuation probability a bin stands for (its centre); slot 0 = 1."""
    if slot == 0:
        return 1.0
    return 1.0 / (1.0 + math.exp(-((slot - 1) * LOGIT_BIN - LOGIT_MAX)))


def model_moved(rates: np.ndarray, beta: np.ndarray, last: tuple[np.ndarray, np.ndarray] | None, move: float) -> bool:
    """Whether the continuation model (its per-turn ``rates``, bucket 0 unused, and ``beta``) has moved from ``last``
    (the same two at the last rebinning; None: none yet) enough to rebin: ``beta`` refitted (any coefficient's bits
    changed), or a turn's rate moved by more than ``move`` on the logit scale (clipped as ``ContinuationModel.p`` clips
    it). Both engines call it on the same floats, so both rebin at the same refits. Scalar arithmetic on a dozen
    floats: numpy's calls on arrays this small cost some 60 us a refit."""
    if last is None or beta.tobytes() != last[1].tobytes():
        return True
    lo, hi = P_CLIP, 1.0 - P_CLIP
    bound = math.exp(move) if move < 700 else math.inf  # |logit a - logit b| > move: the odds ratio past exp(+-move)
    for a, b in zip(rates.tolist()[1:], last[0].tolist()[1:], strict=True):
        a, b = min(max(a, lo), hi), min(max(b, lo), hi)
        if a == b:
            continue
        if move <= 0:  # any move (the odds ratio below may round to 1 for a last-bit one)
            return True
        ratio = a * (1.0 - b) / (b * (1.0 - a))
        if ratio > bound or ratio * bound < 1.0:
            return True
    return False


def rebin_last(state: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """The model at the last rebinning, as a policy's exported state holds it (``rebin_rates``, ``rebin_beta``:
    empty before the first rebinning, or absent in a state from before they were kept)."""
    rates = np.asarray(state.get("rebin_rates", ()), dtype=np.float64)
    return None if rates.size == 0 else (rates, np.asarray(state["rebin_beta"], dtype=np.float64))


def rebin_last_state(last: tuple[np.ndarray, np.ndarray] | None) -> dict[str, np.ndarray]:
    """The model at the last rebinning (None: none yet) as a policy's exported state holds it: ``rebin_last`` reads
    it back."""
    return {"rebin_rates": np.zeros(0) if last is None else last[0],
            "rebin_beta": np.zeros(0) if last is None else last[1]}


class Arrivals:
    """SAECache's bookkeeping of arrivals (module docstring), with the switches of the policy it serves.

    ``gaps`` (chat, agent) are the gap distributions the continuation model's horizon and soft labels use: the
    policy sets them whenever its parameters change.
    """

    def __init__(self, *, multi_queue: bool = True, continuation: bool = True, density: bool = True,
                 continuation_features: bool = True, censoring: bool = True, pe_routing: bool = False,
                 continue_threshold: float = 0.5, refit_steps: int = 2, refit_growth: float = 0.5,
                 timed_refit: bool = True, posterior_end: bool = True, predictor: Predictor | None = None,
                 keep_gaps: bool = False) -> None:
        self.multi_queue, self.continuation, self.density = bool(multi_queue), bool(continuation), bool(density)
        self.pe_routing = bool(pe_routing)
        self.continue_threshold = continue_threshold
        self.predictor = predictor
        self.model = (ContinuationModel(features=continuation_features, censoring=censoring, steps=refit_steps,
                                        refit_growth=refit_growth, timed_refit=timed_refit,
                                        end_below=END_BELOW if posterior_end else 0.0, predictor=predictor)
                      if continuation else None)
        self.gaps: tuple[LognormalGaps, LognormalGaps] | None = None
        self.trace: Trace | None = None  # the trace whose per-request facts are cached (see bind)
        self.arrivals = 0
        self._sessions: dict[int, tuple[float, int]] = {}  # session -> (last arrival, queue of its blocks)
        # Shared prefixes (the structural queue under ``density``): when each was last used, how often a use was
        # followed by another one (its continuation rate, counted as LPC counts turns).
        self._prefix_keys = np.zeros(0, dtype=np.int64)  # the bound trace's shared prefixes (their last keys), sorted
        self._prefix_last = np.zeros(0)  # per shared prefix: when it was last used (NaN: not yet)
        self._prefix_uses = 0
        self._prefix_reused = 0
        self.p_structural = 0.5
        # keep_gaps: every session gap of the chat and agent queues so far, in arrival order (SAECache's
        # empirical_gaps); None when off
        self.raw_gaps: dict[int, array] | None = {CH: array("d"), AG: array("d")} if keep_gaps else None
        self.reset_window()

    def bind(self, trace: Trace) -> None:
        """Per-request facts, as compact arrays (``array.array``: a byte or a few per request, and read one at a time
        as fast as a list; numpy scalar reads cost more)."""
        self.trace = trace
        self._session_of = request_array(trace.session, "q")
        self.n_prompt_of = request_array(np.maximum(np.diff(trace.prompt_offsets), 1), "i")  # (at least 1) per request
        self.reasoning_of = request_array(_any_per_request(trace.output_types == TokenType.REASONING,
                                                     trace.output_offsets), "b")
        templated = _any_per_request(trace.prompt_types == TokenType.TEMPLATE, trace.prompt_offsets)
        keys, prefix_of = _structural_prefix(trace)
        # a new trace: the prefixes it shares with the last one keep their last use
        self._prefix_last = _last_uses(keys, self._prefix_keys, self._prefix_last)
        self._prefix_keys = keys
        self._prefix_of = request_array(prefix_of, "i")
        self._queue_of = request_array(self._queues(trace, templated), "b")
        if self.model is not None:
            self.model.bind(trace, self._session_of)

    def fresh(self) -> Arrivals:
        """The same switches and bound trace (its per-request facts shared, read-only), nothing seen yet: a copy to
        :meth:`import_state` into without computing the facts again (the compiled twin's)."""
        a = copy.copy(self)
        a.model = None if self.model is None else self.model.fresh()
        a.arrivals, a._sessions, a._prefix_last = 0, {}, np.full(self._prefix_keys.size, np.nan)
        a._prefix_uses = a._prefix_reused = 0
        a.p_structural = 0.5
        if a.raw_gaps is not None:
            a.raw_gaps = {CH: array("d"), AG: array("d")}
        a.reset_window()
        return a

    def reset_window(self) -> None:
        # per queue: [n, sum ln gap, sum ln^2 gap] of re-access gaps: session inter-turn gaps (chat, agent), gaps
        # between uses of a shared prefix (structural)
        self.gap_stats = {CH: [0, 0.0, 0.0], AG: [0, 0.0, 0.0], ST: [0, 0.0, 0.0]}

    def session_queue(self, trace: Trace, i: int) -> int:
        """Queue of a request's temporal blocks: CH / AG for (predicted) multi-turn sessions, else PE."""
        if trace is not self.trace:
            self.bind(trace)
        return self._queue_of[i]

    def _queues(self, trace: Trace, templated: np.ndarray) -> np.ndarray:
        """:meth:`session_queue` of every request (it depends on the request alone: the predictor, where it routes,
        reads request ``i`` only)."""
        if not self.multi_queue:
            return np.full(len(trace), CH)
        agent = trace.app == AppType.AGENT
        by_app = np.where(agent, AG, CH)
        if self.continuation:
            return by_app
        first = trace.turn <= 1
        if self.predictor is None:
            # By rule, from what the request shows: tool schemas mark an agent call; a templated prompt (TEMPLATE
            # blocks) an API-style single-turn request; anything else may be the start of a conversation.
            return np.where(first & ~agent & templated, PE, by_app)
        out = by_app.copy()
        for i in np.flatnonzero(first).tolist():
            p_chat, p_agent = self.predictor(trace, i)
            out[i] = (AG if p_agent > p_chat else CH) if max(p_chat, p_agent) >= self.continue_threshold else PE
        return out

    def arrive(self, trace: Trace, i: int, now: float) -> tuple[int, int, bool, bool]:
        """Request ``i`` arrived at ``now``: returns its queue, its continuation bin (0: none), whether the policy
        refits at this arrival (its turnover time; the continuation model is offered an update here, first, and may
        refresh at any arrival when stale) and whether it used a shared prefix (``p_structural`` moved)."""
        if trace is not self.trace:
            self.bind(trace)
        self.arrivals += 1
        model = self.model
        refit = (self.density or model is not None) and self.arrivals % REFIT_EVERY == 0
        if model is not None:  # an update offer at a refit; update() also refreshes a stale model
            model.update(now, self.gaps, offer=refit)
        q = self._queue_of[i]
        slot = 0
        if model is not None:
            p = model.arrive(i, now)
            if self.pe_routing and self.multi_queue and p < self.continue_threshold:
                q = PE
            if self.density:
                slot = slot_of(p)
        s = self._session_of[i]
        if s >= 0:  # a known session
            last = self._sessions.get(s)
            if last is not None and (q == CH or q == AG):
                gap = now - last[0]
                if gap > 0:
                    self._add_gap(q, gap)
                    if self.raw_gaps is not None:
                        self.raw_gaps[q].append(gap)
            self._sessions[s] = (now, q)
        structural = False
        if self.density:
            key = self._prefix_of[i]
            if key >= 0:
                structural = True
                self._prefix_uses += 1
                last_use = self._prefix_last[key]
                if last_use == last_use:  # not NaN: used before
                    self._prefix_reused += 1
                    if now > last_use:
                        self._add_gap(ST, now - last_use)
                self._prefix_last[key] = now
                self.p_structural = (self._prefix_reused + 1.0) / (self._prefix_uses + 2.0)
        return q, slot, refit, structural

    def _add_gap(self, q: int, gap: float) -> None:
        lg = math.log(gap)
        st = self.gap_stats[q]
        st[0] += 1
        st[1] += lg
        st[2] += lg * lg

    def window_stats(self, out: dict[str, Any]) -> dict[str, Any]:
        """The policy's window statistics ``out`` with what is counted here added."""
        out["gap_stats"] = {QUEUES[q]: list(v) for q, v in self.gap_stats.items()}
        if self.density:
            out["p_structural"] = self.p_structural
        if self.model is not None:
            out["continuation"] = self.model.stats()
        return out

    # -- for a compiled copy of arrive() (sae_env.fast_engine.arrivals), which takes its state through the contract
    def routes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The bound trace's per-request routing: each request's queue and its shared prefix (-1: none), read-only,
        and each shared prefix's last use (NaN: none yet), the arrivals' own array, which a compiled copy of
        :meth:`arrive` updates in place (ask again after an ``import_state``)."""
        queue_of = np.frombuffer(self._queue_of, dtype=np.int8)
        prefix_of = np.frombuffer(self._prefix_of, dtype=np.int32)
        return queue_of, prefix_of, self._prefix_last

    # -- the state contract (sae_env.state) ----------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        sessions = self._sessions
        prefixes = self._prefix_last
        used = ~np.isnan(prefixes)
        out = {"arrivals": self.arrivals, "prefix_uses": self._prefix_uses, "prefix_reused": self._prefix_reused,
               "p_structural": self.p_structural,
               "gap_stats": np.array([self.gap_stats[q] for q in (CH, AG, ST)], dtype=np.float64),
               "session_ids": np.fromiter(sessions.keys(), dtype=np.int64, count=len(sessions)),
               "session_last": np.array([t for t, _ in sessions.values()], dtype=np.float64),
               "session_queue": np.array([q for _, q in sessions.values()], dtype=np.int64),
               "prefix_keys": self._prefix_keys[used], "prefix_last": prefixes[used]}
        if self.raw_gaps is not None:
            out["raw_gaps_chat"] = np.array(self.raw_gaps[CH], dtype=np.float64)
            out["raw_gaps_agent"] = np.array(self.raw_gaps[AG], dtype=np.float64)
        if self.model is not None:
            out.update({f"model_{k}": v for k, v in self.model.export_state().items()})
        return out

    def import_state(self, state: dict[str, Any]) -> None:
        self.arrivals = int(state["arrivals"])
        self._prefix_uses, self._prefix_reused = int(state["prefix_uses"]), int(state["prefix_reused"])
        self.p_structural = float(state["p_structural"])
        g = state["gap_stats"].tolist()
        self.gap_stats = {q: [int(v[0]), v[1], v[2]] for q, v in zip((CH, AG, ST), g, strict=True)}
        self._sessions = {s: (t, q) for s, t, q in zip(state["session_ids"].tolist(), state["session_last"].tolist(),
                                                        state["session_queue"].tolist(), strict=True)}
        keys, last = np.asarray(state["prefix_keys"], dtype=np.int64), np.asarray(state["prefix_last"], dtype=float)
        order = np.argsort(keys, kind="stable")
        keys, last = keys[order], last[order]
        if self.trace is None:  # bind() maps them onto the trace's prefixes
            self._prefix_keys, self._prefix_last = keys, last
        else:
            self._prefix_last = _last_uses(self._prefix_keys, keys, last)
        if self.raw_gaps is not None:  # a state saved without them (another policy's, or before any gap): none
            self.raw_gaps = {q: array("d", np.asarray(state.get(name, ()), dtype=np.float64).tolist())
                             for q, name in ((CH, "raw_gaps_chat"), (AG, "raw_gaps_agent"))}
        if self.model is not None:
            self.model.import_state({k[6:]: v for k, v in state.items() if k.startswith("model_")})


def _structural_prefix(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The trace's shared prefixes (sorted keys) and, per request, which one it used (an index into them, -1:
    none). A request's shared prefix is the key of the last block of its leading run of SYSTEM / TEMPLATE blocks;
    uses of one shared prefix are the re-accesses the structural queue's gap distribution describes."""
    offsets = trace.prompt_offsets
    starts, lengths = offsets[:-1], np.diff(offsets)
    # the leading run ends at the request's first non-structural block (or at its end)
    other = np.flatnonzero(trace.prompt_types > _TEMPLATE)
    first = np.searchsorted(other, starts)
    first_other = np.append(other, trace.n_blocks)[first]
    run = np.minimum(first_other - starts, lengths)
    has = run > 0
    out = np.full(len(trace), -1, dtype=np.int64)
    keys, out[has] = np.unique(trace.prompt_keys[(starts + run - 1)[has]], return_inverse=True)
    return keys.astype(np.int64), out


def _last_uses(keys: np.ndarray, known_keys: np.ndarray, known_last: np.ndarray) -> np.ndarray:
    """The last use of each prefix of ``keys`` according to ``known_keys`` (sorted) / ``known_last``; NaN for a
    prefix not among them."""
    last = np.full(keys.size, np.nan)
    if known_keys.size:
        at = np.minimum(np.searchsorted(known_keys, keys), known_keys.size - 1)
        found = known_keys[at] == keys
        last[found] = known_last[at[found]]
    return last


def _any_per_request(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Whether any of each request's blocks (CSR ``offsets``) has its flag set."""
    counts = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return counts[offsets[1:]] > counts[offsets[:-1]]
