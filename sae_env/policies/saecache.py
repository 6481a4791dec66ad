"""SAECache: semantic, self-tuning eviction over four queues (arXiv 2605.18825; restated in SAECACHE.md).

Algorithm. Every block is routed, when it is inserted, to one queue:

* priority-eviction (PE): reasoning / chain-of-thought output blocks (and the rest of an output that holds
  reasoning: the next turn drops the reasoning, so no later prompt follows that branch), and the non-template
  blocks (prompt and output) of requests not expected to continue; emptied first;
* structural (ST): SYSTEM and TEMPLATE blocks (shared prompt structure: system prompts, tool schemas, templates);
* chat (CH) and agent (AG): the other blocks of multi-turn sessions: later turns are known to be multi-turn (their
  ``app`` says chat or agent); a session's first request goes there when the session predictor says it will
  continue; without a predictor, by rule from what the request shows: tool schemas (app = agent) -> agent, a
  templated prompt (TEMPLATE blocks) -> single-turn, anything else -> chat (it may be a conversation's start).

Within a queue, block ``b`` has priority ``P(b) = alpha_q * w_type(b) * p_q(b) / dt_b`` (lowest evicted first) where
``dt_b`` is the time since its last access (floored at ``min_dt``) and ``p_q`` its survival probability:
``1 - F_LN(dt; mu_q, sigma_q)`` for chat and agent (exponential survival of the same mean when ``lognormal`` is
off), ``1 - x_b ** gamma`` for structural (``x_b`` = the block's offset / its prompt's length in blocks), 1 for PE.
Any evictable PE block goes before every other block.

Victim selection, exact where it can be and sampled where it cannot. Unpinned blocks sit in one recency list per
(queue, type) group, in release order (vLLM's free-queue order). Inside a chat, agent or PE group every block shares
``alpha``, ``w`` and the survival curve, and ``S(dt)/dt`` falls with ``dt``, so the group's minimum is its least
recently released leaf: one candidate per group is exact. In a structural group the offset also matters, so the
first ``sample`` leaves from its head are candidates (Redis / LRB-style sampling); tests measure how often this
differs from the exact argmin over all evictable blocks. Only leaves are evictable: a non-leaf met at the head of a
list is parked aside (a shared system prompt stays an inner node for as long as any session hangs below it), and
when its last child goes it returns to its group through a small heap ordered by its release stamp, so the group's
order stays exact.

Parameters (a named, bounded vector agents can set): ``alpha_st, alpha_ch, alpha_ag``, one ``w_<TYPE>`` per token
type, ``mu_chat, sigma_chat, mu_agent, sigma_agent``, ``gamma``. The online learners that set them after every
window live in :mod:`agents.sae_online` (this module only measures what they need, in :meth:`window_stats`).

Switches (ablations): ``type_weights`` (off: w = 1), ``adaptive_alpha`` (off: alpha = 1), ``lognormal`` (off:
exponential survival), ``position_decay`` (off: p_ST = 1), ``multi_queue`` (off: one temporal queue, no PE
priority), ``predictor`` (off: first requests routed by rule only). With every switch off the policy evicts in
LRU order (a test checks it against ``lru``).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sae_env.cache import Block
from sae_env.policies.base import EvictionPolicy, ParamSpec
from sae_env.trace import N_TOKEN_TYPES, AppType, TokenType, Trace

PE, ST, CH, AG = 0, 1, 2, 3
QUEUES = ("priority_eviction", "structural", "chat", "agent")
N_QUEUES = len(QUEUES)
_SQRT2 = math.sqrt(2.0)
_STRUCTURAL_TYPES = (TokenType.SYSTEM, TokenType.TEMPLATE)

# A session predictor answers, for a session's first request, (P(continues as chat), P(continues as agent)).
Predictor = Callable[[Trace, int], tuple[float, float]]

PARAM_SPECS: tuple[ParamSpec, ...] = (
    ParamSpec("alpha_st", 0.05, 20.0, 1.0, log=True, doc="queue weight, structural"),
    ParamSpec("alpha_ch", 0.05, 20.0, 1.0, log=True, doc="queue weight, chat"),
    ParamSpec("alpha_ag", 0.05, 20.0, 1.0, log=True, doc="queue weight, agent"),
    *(ParamSpec(f"w_{t.name.lower()}", 0.05, 20.0, 1.0, log=True, doc=f"token-type weight, {t.name}")
      for t in TokenType),
    ParamSpec("mu_chat", -2.0, 10.0, 4.88, doc="log-normal mu of chat re-access gaps (ln s)"),
    ParamSpec("sigma_chat", 0.1, 4.0, 0.98, doc="log-normal sigma of chat re-access gaps"),
    ParamSpec("mu_agent", -2.0, 10.0, 1.0, doc="log-normal mu of agent re-access gaps (ln s)"),
    ParamSpec("sigma_agent", 0.1, 4.0, 0.8, doc="log-normal sigma of agent re-access gaps"),
    ParamSpec("gamma", 0.05, 20.0, 1.0, log=True, doc="position decay power of structural blocks"),
)


class SAECachePolicy(EvictionPolicy):
    name = "saecache"
    param_specs = PARAM_SPECS

    def __init__(self, *, type_weights: bool = True, adaptive_alpha: bool = True, lognormal: bool = True,
                 position_decay: bool = True, multi_queue: bool = True, predictor: Predictor | bool | None = None,
                 continue_threshold: float = 0.5, sample: int = 8, min_dt: float = 1e-3,
                 params: dict[str, float] | None = None) -> None:
        super().__init__()
        if sample < 1:
            raise ValueError(f"saecache: sample must be >= 1, got {sample}")
        if not min_dt > 0:
            raise ValueError(f"saecache: min_dt must be positive, got {min_dt}")
        self.switches = {"type_weights": bool(type_weights), "adaptive_alpha": bool(adaptive_alpha),
                         "lognormal": bool(lognormal), "position_decay": bool(position_decay),
                         "multi_queue": bool(multi_queue), "predictor": predictor is not False}
        self.predictor: Predictor | None = predictor if callable(predictor) else None
        self.continue_threshold = continue_threshold
        self.sample = int(sample)
        self.min_dt = float(min_dt)
        self._groups: dict[int, OrderedDict[int, Block]] = {}  # (queue * 8 + type) -> unpinned blocks, release order
        self._parked: dict[int, Block] = {}  # unpinned inner nodes taken out of their lists
        self._returned: dict[int, list[tuple[int, int, Block]]] = {}  # group -> heap of (stamp, key, block)
        # Best candidate per group, valid while no block is acquired or released and the clock stands still: the
        # evictions of one insertion run reuse it and refresh only the groups they touched.
        self._cand: dict[int, tuple[tuple, Block]] = {}
        self._cand_now: float | None = None
        self._dirty: set[int] = set()
        self._released = 0
        # request context, set by on_request / on_complete
        self._prompt_queue = PE  # queue of the current request's non-structural prompt blocks
        self._output_queue = PE  # queue of its non-reasoning output blocks
        self._n_prompt = 1
        self._sessions: dict[int, tuple[float, int]] = {}  # session -> (last arrival, queue of its blocks)
        self._inflight: dict[int, int] = {}  # request -> the queue chosen at its arrival (until it completes)
        self._output_reasoning = False  # the completing request's output holds reasoning
        self._occupancy = [0] * N_QUEUES
        self.reset_window()
        if params:
            self.set_params(params)
        else:
            self.params_changed()

    # -- parameters ------------------------------------------------------------------------------------------
    def params_changed(self) -> None:
        p, sw = self._params, self.switches
        ones = [1.0] * N_QUEUES
        self._alpha = ([1.0, p["alpha_st"], p["alpha_ch"], p["alpha_ag"]] if sw["adaptive_alpha"] else ones)
        self._w = ([p[f"w_{t.name.lower()}"] for t in TokenType] if sw["type_weights"] else [1.0] * N_TOKEN_TYPES)
        self._ln = {CH: (p["mu_chat"], p["sigma_chat"]), AG: (p["mu_agent"], p["sigma_agent"])}
        self._exp_mean = {q: math.exp(mu + s * s / 2) for q, (mu, s) in self._ln.items()}
        self._gamma = p["gamma"]
        self._cand_now = None

    # -- routing ---------------------------------------------------------------------------------------------
    def _session_queue(self, trace: Trace, i: int) -> int:
        """Queue of a request's temporal blocks: CH / AG for (predicted) multi-turn sessions, else PE."""
        if not self.switches["multi_queue"]:
            return CH
        app, turn = int(trace.app[i]), int(trace.turn[i])
        if turn > 1:
            return AG if app == AppType.AGENT else CH
        if self.predictor is not None:
            p_chat, p_agent = self.predictor(trace, i)
            if max(p_chat, p_agent) >= self.continue_threshold:
                return AG if p_agent > p_chat else CH
            return PE
        # By rule, from what the request shows: tool schemas mark an agent call; a templated prompt (TEMPLATE
        # blocks) an API-style single-turn request; anything else may be the start of a conversation.
        if app == AppType.AGENT:
            return AG
        a, b = trace.prompt_offsets[i], trace.prompt_offsets[i + 1]
        return PE if (trace.prompt_types[a:b] == TokenType.TEMPLATE).any() else CH

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        q = self._session_queue(trace, i)
        self._inflight[i] = q
        self._prompt_queue = self._output_queue = q
        self._n_prompt = max(1, int(trace.prompt_offsets[i + 1] - trace.prompt_offsets[i]))
        s = int(trace.session[i])
        if s >= 0:
            last = self._sessions.get(s)
            if last is not None and q in (CH, AG):
                gap = now - last[0]
                if gap > 0:
                    lg = math.log(gap)
                    st = self._gap_stats[q]
                    st[0] += 1
                    st[1] += lg
                    st[2] += lg * lg
            self._sessions[s] = (now, q)

    def on_complete(self, trace: Trace, i: int, now: float) -> None:
        a, b = trace.output_offsets[i], trace.output_offsets[i + 1]
        # A generation that opens with reasoning, which the next turn's template drops: every block of this output
        # (the answer too) lies on a branch no later prompt follows.
        self._output_reasoning = bool((trace.output_types[a:b] == TokenType.REASONING).any())
        q = self._inflight.pop(i, None)
        self._output_queue = self._session_queue(trace, i) if q is None else q
        self._n_prompt = max(1, int(trace.prompt_offsets[i + 1] - trace.prompt_offsets[i]))

    def on_insert(self, block: Block, now: float) -> None:
        t = block.type
        output = block.depth >= self._n_prompt
        if not self.switches["multi_queue"]:
            q = CH
        elif t == TokenType.REASONING or (output and self._output_reasoning):
            q = PE
        elif t <= TokenType.TEMPLATE:
            q = ST
            block.pdata = min(block.depth / self._n_prompt, 1.0)  # x_b, the block's relative offset
        else:
            q = self._output_queue if output else self._prompt_queue
        block.queue = q
        self._occupancy[q] += 1

    # -- recency lists -----------------------------------------------------------------------------------------
    def _group(self, b: Block) -> int:
        return b.queue * 8 + (b.type if self.switches["type_weights"] else 0)

    def on_acquire(self, blocks: list[Block]) -> None:
        self._cand_now = None
        groups, parked = self._groups, self._parked
        tw = self.switches["type_weights"]
        last_g, lst = -1, None
        for b in blocks:
            g = b.queue * 8 + (b.type if tw else 0)
            if g != last_g:  # a request's blocks come in long runs of one group: one lookup per run
                last_g, lst = g, groups[g]
            if b.key in lst:
                del lst[b.key]
            elif parked.pop(b.key, None) is None:
                b.stamp = 0  # its entry in a returned-heap is now stale

    def on_release(self, blocks: list[Block], now: float) -> None:
        self._cand_now = None
        groups = self._groups
        tw = self.switches["type_weights"]
        seq = self._released
        last_g, lst = -1, None
        for b in blocks:
            seq += 1
            b.stamp = seq
            g = b.queue * 8 + (b.type if tw else 0)
            if g != last_g:
                last_g = g
                lst = groups.get(g)
                if lst is None:
                    lst = groups[g] = OrderedDict()
            lst[b.key] = b
        self._released = seq

    def on_leaf(self, block: Block) -> None:
        if self._parked.pop(block.key, None) is not None:
            g = self._group(block)
            heapq.heappush(self._returned.setdefault(g, []), (block.stamp, block.key, block))
            self._dirty.add(g)

    def on_hit(self, blocks: list[Block], now: float) -> None:
        qh = self._queue_hits
        for b in blocks:
            qh[b.queue] += 1

    # -- priority and eviction -----------------------------------------------------------------------------------
    def priority(self, b: Block, now: float) -> float:
        """``alpha_q * w_type * p_q / dt`` at time ``now``."""
        dt = now - b.last_access
        if dt < self.min_dt:
            dt = self.min_dt
        q = b.queue
        if q == CH or q == AG:
            mu, sigma = self._ln[q]
            if self.switches["lognormal"]:
                p = 0.5 * math.erfc((math.log(dt) - mu) / (sigma * _SQRT2))
            else:
                p = math.exp(-dt / self._exp_mean[q])
        elif q == ST and self.switches["position_decay"]:
            p = 1.0 - b.pdata ** self._gamma
        else:
            p = 1.0
        return self._alpha[q] * self._w[b.type] * p / dt

    def _candidates(self, g: int, lst: OrderedDict[int, Block], want: int) -> list[Block]:
        """Up to ``want`` evictable leaves of group ``g`` in release order (parking the inner nodes met)."""
        out: list[Block] = []
        parked = self._parked
        if want == 1:  # the common case: the first leaf from the head
            while lst:
                k, b = next(iter(lst.items()))
                if not b.n_children:
                    out.append(b)
                    break
                del lst[k]
                parked[k] = b
        while lst and len(out) < want:
            for k, b in lst.items():
                if b.n_children:
                    del lst[k]
                    parked[k] = b
                    break  # the dict changed size: start the scan again from the head
                out.append(b)
                if len(out) >= want:
                    break
            else:
                break
        heap = self._returned.get(g)
        while heap and (heap[0][2].stamp != heap[0][0] or heap[0][2].pins or heap[0][2].n_children):
            heapq.heappop(heap)
        if heap:
            if want == 1:
                out.append(heap[0][2])
            else:  # a structural group: the oldest ``want`` returned blocks compete too (pop, then push back:
                # O(want log n), where nsmallest would read the whole heap)
                taken = []
                while heap and len(taken) < want:
                    e = heapq.heappop(heap)
                    if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children:
                        taken.append(e)
                for e in taken:
                    heapq.heappush(heap, e)
                out.extend(e[2] for e in taken)
        return out

    def _best(self, g: int, now: float) -> tuple[tuple, Block] | None:
        multi = self.switches["multi_queue"]
        q = g >> 3
        best = None
        for b in self._candidates(g, self._groups[g], self.sample if q == ST else 1):
            key = (0 if (multi and q == PE) else 1, self.priority(b, now), b.stamp)
            if best is None or key < best[0]:
                best = (key, b)
        return best

    def evict(self, now: float) -> Block | None:
        cand = self._cand
        if self._cand_now != now:
            cand.clear()
            for g in self._groups:
                best = self._best(g, now)
                if best is not None:
                    cand[g] = best
            self._cand_now = now
        else:
            for g in self._dirty:
                best = self._best(g, now)
                if best is None:
                    cand.pop(g, None)
                else:
                    cand[g] = best
        self._dirty.clear()
        if not cand:
            return None
        g, best = -1, None
        for k, c in cand.items():
            if best is None or c[0] < best:
                g, best = k, c[0]
        victim = cand.pop(g)[1]
        self._remove(victim)
        self._dirty.add(g)
        return victim

    def _remove(self, b: Block) -> None:
        lst = self._groups[self._group(b)]
        if b.key in lst:
            del lst[b.key]
        # else it came from its group's returned-heap, where the cleared stamp makes its entry stale
        self._occupancy[b.queue] -= 1
        b.stamp = 0

    def _evictable(self) -> list[Block]:
        listed = [b for lst in self._groups.values() for b in lst.values() if not b.n_children]
        returned = [e[2] for heap in self._returned.values() for e in heap
                    if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children]
        return listed + returned

    def exact_victim(self, now: float) -> Block | None:
        """The exact argmin over every evictable block (no side effects; O(cache), for tests)."""
        multi = self.switches["multi_queue"]
        cands = self._evictable()
        if not cands:
            return None
        return min(cands, key=lambda b: (0 if (multi and b.queue == PE) else 1, self.priority(b, now), b.stamp))

    # -- statistics for the learners -----------------------------------------------------------------------------
    def reset_window(self) -> None:
        self._queue_hits = [0] * N_QUEUES
        # per queue: [n, sum ln gap, sum ln^2 gap] of session inter-turn gaps (re-access gaps of its blocks)
        self._gap_stats = {CH: [0, 0.0, 0.0], AG: [0, 0.0, 0.0]}

    def occupancy_by_queue(self) -> dict[int, int]:
        return {q: n for q, n in enumerate(self._occupancy) if n}

    def window_stats(self) -> dict[str, Any]:
        return {"queue_hits": list(self._queue_hits), "queue_occupancy": list(self._occupancy),
                "gap_stats": {QUEUES[q]: list(v) for q, v in self._gap_stats.items()},
                "params": self.params}

    def check_invariants(self) -> None:
        unpinned = {k for k, b in self.cache.blocks.items() if b.pins == 0}
        listed: set[int] = set(self._parked)
        for g, lst in self._groups.items():
            for k, b in lst.items():
                if self._group(b) != g:
                    raise RuntimeError(f"saecache: {b!r} listed in group {g}")
                listed.add(k)
        for heap in self._returned.values():
            listed.update(e[1] for e in heap if e[2].stamp == e[0] and not e[2].pins)
        if listed != unpinned:
            raise RuntimeError("saecache: recency lists differ from the set of unpinned blocks")
        if any(b.n_children == 0 for b in self._parked.values()):
            raise RuntimeError("saecache: a parked block is a leaf")
        occ = [0] * N_QUEUES
        for b in self.cache.blocks.values():
            occ[b.queue] += 1
        if occ != self._occupancy:
            raise RuntimeError(f"saecache: occupancy {self._occupancy} != {occ}")


def gap_fit(stats: list[float]) -> tuple[float, float] | None:
    """Log-normal MLE (mu, sigma) from sufficient statistics [n, sum ln x, sum ln^2 x]; None if n < 2."""
    n, s1, s2 = stats
    if n < 2:
        return None
    mu = s1 / n
    var = max(s2 / n - mu * mu, 0.0)
    return mu, math.sqrt(var)

