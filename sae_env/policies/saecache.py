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

Victim selection, exact where it can be and sampled where it cannot. Unpinned blocks belong to one recency list per
(queue, type) group, in release order (vLLM's free-queue order). Inside a chat, agent or PE group every block shares
``alpha``, ``w`` and the survival curve, and ``S(dt)/dt`` falls with ``dt``, so the group's minimum is its least
recently released leaf: one candidate per group is exact. In a structural group the offset also matters, so the
first ``sample`` leaves from its head are candidates (Redis / LRB-style sampling); tests measure how often this
differs from the exact argmin over all evictable blocks. Only leaves are evictable: an inner node (a shared system
prompt stays one for as long as any session hangs below it) is parked aside, and when its last child goes it returns
to its group through a small heap ordered by its release stamp, so the group's order stays exact.

Cost. A request acquires and releases its whole hit prefix (hundreds of blocks, nearly all inner nodes), so that
path does almost nothing per block: acquiring is free (a pinned block's list entry is just dead until its release
appends a fresh one), releasing stamps each block and lists only what a scan can need (see ``on_release``). Dead
entries are dropped when a scan meets them and by an occasional compaction. Candidates are cached per group while
the clock stands still, so the evictions of one insertion run refresh only the groups they touched.

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
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from sae_env.cache import Block
from sae_env.policies.base import EvictionPolicy, ParamSpec
from sae_env.trace import N_TOKEN_TYPES, AppType, TokenType, Trace

PE, ST, CH, AG = 0, 1, 2, 3
QUEUES = ("priority_eviction", "structural", "chat", "agent")
N_QUEUES = len(QUEUES)
_SQRT2 = math.sqrt(2.0)
_STRUCTURAL_TYPES = (TokenType.SYSTEM, TokenType.TEMPLATE)
_COMPACT_MIN = 1 << 18  # released blocks before the first compaction of the recency lists (a few MB of entries)
_CONSTANT, _LOGNORMAL, _EXPONENTIAL, _POSITION = range(4)  # kinds of survival term p_q
_REASONING, _TEMPLATE = int(TokenType.REASONING), int(TokenType.TEMPLATE)  # plain ints: enum lookups cost more

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


class _RecencyList:
    """One group's released blocks in release order, as parallel deques of (release stamp, block).

    An entry is live while its block still carries that stamp and no request pins it; others are dead (the block
    was acquired since, evicted or parked) and are dropped lazily. Two deques rather than one of tuples: a tuple per
    released block would cost an allocation each and keep the garbage collector busy.
    """

    __slots__ = ("stamps", "blocks")

    def __init__(self, stamps=(), blocks=()) -> None:
        self.stamps: deque[int] = deque(stamps)
        self.blocks: deque[Block] = deque(blocks)

    def live(self) -> list[tuple[int, Block]]:
        return [(s, b) for s, b in zip(self.stamps, self.blocks, strict=True) if b.stamp == s and not b.pins]


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
        self._multi, self._typed = self.switches["multi_queue"], self.switches["type_weights"]  # hot-path copies
        self.predictor: Predictor | None = predictor if callable(predictor) else None
        self.continue_threshold = continue_threshold
        self.sample = int(sample)
        self.min_dt = float(min_dt)
        self._lists: dict[int, _RecencyList] = {}  # group (queue * 8 + type) -> recency list
        self._returned: dict[int, list[tuple[int, int, Block]]] = {}  # group -> heap of (stamp, key, block)
        self._compact_at = _COMPACT_MIN  # the release count at which the lists are compacted next
        # Best candidate per group, valid while no block is acquired or released and the clock stands still: the
        # evictions of one insertion run reuse it and refresh only the groups they touched.
        self._cand: dict[int, tuple[int, float, int, int, Block]] = {}  # see _best
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
        self._facts_of: Trace | None = None  # the trace whose per-request facts are cached (see _learn_trace)
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
        # per queue * 8 + type: (PE flag, survival kind, its two constants, alpha * w), see _survival
        self._consts: dict[int, tuple[int, int, float, float, float]] = {}
        self._cand_now = None

    def _constants(self, q: int, t: int) -> tuple[int, int, float, float, float]:
        c = self._consts.get(q * 8 + t)
        if c is None:
            sw = self.switches
            if q == CH or q == AG:
                mu, sigma = self._ln[q]
                kind, c1, c2 = (_LOGNORMAL, mu, sigma * _SQRT2) if sw["lognormal"] else (_EXPONENTIAL,
                                                                                         self._exp_mean[q], 0.0)
            elif q == ST and sw["position_decay"]:
                kind, c1, c2 = _POSITION, self._gamma, 0.0
            else:
                kind, c1, c2 = _CONSTANT, 0.0, 0.0
            flag = 0 if (q == PE and sw["multi_queue"]) else 1
            c = self._consts[q * 8 + t] = (flag, kind, c1, c2, self._alpha[q] * self._w[t])
        return c

    # -- routing ---------------------------------------------------------------------------------------------
    def bind(self, trace: Trace) -> None:
        self._learn_trace(trace)

    def _learn_trace(self, trace: Trace) -> None:
        """Per-request facts the hooks need, as Python lists: reading them from numpy per request costs more."""
        self._facts_of = trace
        self._app_of = trace.app.tolist()
        self._turn_of = trace.turn.tolist()
        self._session_of = trace.session.tolist()
        self._n_prompt_of = np.maximum(np.diff(trace.prompt_offsets), 1).tolist()
        self._templated_of = _any_per_request(trace.prompt_types == TokenType.TEMPLATE, trace.prompt_offsets)
        self._reasoning_of = _any_per_request(trace.output_types == TokenType.REASONING, trace.output_offsets)

    def _session_queue(self, trace: Trace, i: int) -> int:
        """Queue of a request's temporal blocks: CH / AG for (predicted) multi-turn sessions, else PE."""
        if not self.switches["multi_queue"]:
            return CH
        if trace is not self._facts_of:
            self._learn_trace(trace)
        app, turn = self._app_of[i], self._turn_of[i]
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
        return PE if self._templated_of[i] else CH

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        if trace is not self._facts_of:
            self._learn_trace(trace)
        q = self._session_queue(trace, i)
        self._inflight[i] = q
        self._prompt_queue = self._output_queue = q
        self._n_prompt = self._n_prompt_of[i]
        s = self._session_of[i]
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
        if trace is not self._facts_of:
            self._learn_trace(trace)
        # A generation that opens with reasoning, which the next turn's template drops: every block of this output
        # (the answer too) lies on a branch no later prompt follows.
        self._output_reasoning = self._reasoning_of[i]
        q = self._inflight.pop(i, None)
        self._output_queue = self._session_queue(trace, i) if q is None else q
        self._n_prompt = self._n_prompt_of[i]

    def on_insert(self, block: Block, now: float) -> None:
        t = block.type
        output = block.depth >= self._n_prompt
        if not self._multi:
            q = CH
        elif t == _REASONING or (output and self._output_reasoning):
            q = PE
        elif t <= _TEMPLATE:
            q = ST
            block.pdata = min(block.depth / self._n_prompt, 1.0)  # x_b, the block's relative offset
        else:
            q = self._output_queue if output else self._prompt_queue
        block.queue = q
        self._occupancy[q] += 1

    # -- recency lists -----------------------------------------------------------------------------------------
    def _group(self, b: Block) -> int:
        return b.queue * 8 + (b.type if self._typed else 0)

    def _list(self, g: int) -> _RecencyList:
        lst = self._lists.get(g)
        if lst is None:
            lst = self._lists[g] = _RecencyList()
        return lst

    def on_acquire(self, blocks: list[Block]) -> None:
        # Nothing per block: a pinned block's list or heap entry is dead (pins > 0) and its release appends a new
        # one. Only the cached candidates may be pinned now.
        self._cand_now = None

    def on_release(self, blocks: list[Block], now: float) -> None:
        """Stamp every released block; list only the ones a scan can need.

        * Chat, agent and PE groups (one candidate: the oldest evictable block) list the blocks that are leaves
          when released: in a release only the deepest block can be, as every other one has its path child. The
          others are parked from the start: an unpinned block gains no child, so it becomes evictable only through
          on_leaf, which puts it in the returned-heap. The group's oldest evictable block is the older of the
          list head and the heap top, whichever way the parked blocks were placed, and it is the group's victim
          (its priority falls with idle time), so the victims are the ones of a list holding every block.
        * Structural groups list every released block: their sample is the first ``sample`` leaves of the list,
          and which blocks those are depends on where the inner nodes sit, so an inner node is parked only when a
          scan meets it (see _structural_candidates).
        """
        self._cand_now = None
        tw = self._typed
        seq = self._released
        last_g, stamps, members = -1, None, None
        for b in blocks:
            seq += 1
            b.stamp = seq
            if b.queue == ST or not b.n_children:
                g = b.queue * 8 + (b.type if tw else 0)
                if g != last_g:  # a request's blocks come in long runs of one group: one lookup per run
                    last_g = g
                    lst = self._list(g)
                    stamps, members = lst.stamps, lst.blocks
                stamps.append(seq)
                members.append(b)
        self._released = seq
        if seq > self._compact_at:
            self._compact()

    def on_leaf(self, block: Block) -> None:
        if block.pins:
            return  # listed again when released
        s = block.stamp
        if block.queue == ST:
            if s > 0:
                return  # still in its list, where it is now a leaf
            s = block.stamp = -s  # parked by a scan: it competes again with its release stamp
        g = block.queue * 8 + (block.type if self._typed else 0)
        heap = self._returned.get(g)
        if heap is None:
            heap = self._returned[g] = []
            self._list(g)  # evict's full refresh walks the groups that have a list
        heapq.heappush(heap, (s, block.key, block))
        self._dirty.add(g)

    def on_hit(self, blocks: list[Block], now: float) -> None:
        qh = self._queue_hits
        for b in blocks:
            qh[b.queue] += 1

    def _compact(self) -> None:
        """Drop the dead entries of every list and returned-heap; live ones keep their order, so no decision changes.

        Scans drop dead entries from list heads; this bounds the ones behind long-lived heads. It runs after twice
        as many releases as entries survived the last compaction (at least ``_COMPACT_MIN``): amortised O(1) per
        released block, as each released block appends at most one entry.
        """
        kept = 0
        for g, lst in self._lists.items():
            live = lst.live()
            self._lists[g] = _RecencyList((s for s, _ in live), (b for _, b in live))
            kept += len(live)
        for g, heap in self._returned.items():
            valid = [e for e in heap if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children]
            heapq.heapify(valid)
            self._returned[g] = valid
        self._compact_at = self._released + max(2 * kept, _COMPACT_MIN)

    # -- priority and eviction -----------------------------------------------------------------------------------
    def priority(self, b: Block, now: float) -> float:
        """``alpha_q * w_type * p_q / dt`` at time ``now``."""
        dt = now - b.last_access
        if dt < self.min_dt:
            dt = self.min_dt
        _, kind, c1, c2, coef = self._constants(b.queue, b.type)
        return coef * _survival(kind, c1, c2, dt, b.pdata) / dt

    def _oldest_returned(self, g: int, want: int) -> list[Block]:
        """The ``want`` oldest evictable blocks of group ``g``'s returned-heap (stale entries dropped)."""
        heap = self._returned.get(g)
        while heap and (heap[0][2].stamp != heap[0][0] or heap[0][2].pins or heap[0][2].n_children):
            heapq.heappop(heap)
        if not heap:
            return []
        if want == 1:
            return [heap[0][2]]
        # pop, then push back: O(want log n), where nsmallest would read the whole heap
        taken = []
        while heap and len(taken) < want:
            e = heapq.heappop(heap)
            if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children:
                taken.append(e)
        for e in taken:
            heapq.heappush(heap, e)
        return [e[2] for e in taken]

    def _structural_candidates(self, g: int, want: int) -> list[Block]:
        """Up to ``want`` leaves from the head of a structural list, parking the inner nodes met, plus the
        ``want`` oldest returned blocks.

        The sample is the one the original scan took: it walked from the head counting leaves and, at an inner
        node, parked it and restarted from the head, counting the leaves before it once more; it stopped when its
        count reached ``want``. So after parkings fewer than ``want`` distinct leaves may compete. One walk
        reproduces it, with ``counted`` the original scan's count. A parked block's stamp is negated (dead entry,
        and on_leaf knows it from a structural block still listed); the walk drops it and the dead entries.
        """
        lst = self._lists[g]
        stamps, members = lst.stamps, lst.blocks
        leaves: list[Block] = []
        counted = 0
        while stamps:
            s, b = stamps.popleft(), members.popleft()
            if b.stamp != s or b.pins:
                continue
            if b.n_children:
                b.stamp = -s
                if counted + len(leaves) >= want:
                    break
                counted += len(leaves)
                continue
            leaves.append(b)
            counted += 1
            if counted >= want:
                break
        stamps.extendleft([b.stamp for b in reversed(leaves)])  # the leaves walked over go back in front
        members.extendleft(reversed(leaves))
        return leaves + self._oldest_returned(g, want)

    def _best(self, g: int, now: float) -> tuple[int, float, int, int, Block] | None:
        """Group ``g``'s candidate of least (PE flag, priority, release stamp) at ``now``, as that key + (g, it).

        One flat tuple: ``evict`` takes the least over the groups, and release stamps are unique, so tuples
        compare on the key alone (the block is never compared)."""
        # Without type weights a group holds every type of its queue, all with w = 1: one set of constants.
        flag, kind, c1, c2, coef = self._consts.get(g) or self._constants(g >> 3, g & 7)
        if g >> 3 == ST:
            cands = self._structural_candidates(g, self.sample)
        else:
            # A chat, agent or PE group's oldest evictable block is the older of its list head and its heap top
            # (see on_release); both compete, as the first leaf of a list and its heap top always did.
            cands = []
            lst = self._lists[g]
            stamps, members = lst.stamps, lst.blocks
            while stamps:
                b = members[0]
                if b.stamp == stamps[0] and not b.pins:  # live, hence a leaf
                    cands.append(b)
                    break
                stamps.popleft()
                members.popleft()
            heap = self._returned.get(g)
            while heap:
                s, _, b = heap[0]
                if b.stamp == s and not b.pins and not b.n_children:
                    cands.append(b)
                    break
                heapq.heappop(heap)
        min_dt = self.min_dt
        best = None
        for b in cands:  # the priority() formula, with the group's constants
            dt = now - b.last_access
            if dt < min_dt:
                dt = min_dt
            key = (flag, coef * _survival(kind, c1, c2, dt, b.pdata) / dt, b.stamp, g, b)
            if best is None or key < best:
                best = key
        return best

    def evict(self, now: float) -> Block | None:
        cand = self._cand
        if self._cand_now != now:
            cand.clear()
            for g in self._lists:
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
        best = min(cand.values())
        g, victim = best[3], best[4]
        del cand[g]
        self._occupancy[victim.queue] -= 1
        victim.stamp = 0  # its list or heap entry is dead now
        self._dirty.add(g)
        return victim

    def _evictable(self) -> list[Block]:
        listed = [b for lst in self._lists.values() for _, b in lst.live() if not b.n_children]
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
        """Every unpinned block is in exactly one place: live in its group's list, valid in its group's
        returned-heap, or parked (an inner node: a structural one with its stamp negated by a scan, any other one
        unlisted since its release)."""
        blocks = self.cache.blocks
        placed: set[int] = set()

        def place(g: int, b: Block, where: str) -> None:
            if self._group(b) != g or blocks.get(b.key) is not b:
                raise RuntimeError(f"saecache: {b!r} in the {where} of group {g}")
            if b.key in placed:
                raise RuntimeError(f"saecache: {b!r} is listed twice")
            placed.add(b.key)

        for g, lst in self._lists.items():
            if len(lst.stamps) != len(lst.blocks):
                raise RuntimeError(f"saecache: the list of group {g} lost an entry's stamp or block")
            for _, b in lst.live():
                if b.queue != ST and b.n_children:
                    raise RuntimeError(f"saecache: {b!r} is listed but not a leaf")
                place(g, b, "list")
        for g, heap in self._returned.items():
            for s, _, b in heap:
                if b.stamp == s and not b.pins and not b.n_children:
                    place(g, b, "returned-heap")
        stamps: set[int] = set()
        for k, b in blocks.items():
            if b.pins:
                continue
            if k not in placed:
                if not b.n_children:
                    raise RuntimeError(f"saecache: evictable {b!r} is in no list")
                if (b.stamp < 0) != (b.queue == ST):
                    raise RuntimeError(f"saecache: parked {b!r} has stamp {b.stamp}")
            if not b.stamp or abs(b.stamp) in stamps:
                raise RuntimeError(f"saecache: unpinned {b!r} has stamp {b.stamp}, not a unique release stamp")
            stamps.add(abs(b.stamp))
        occ = [0] * N_QUEUES
        for b in blocks.values():
            occ[b.queue] += 1
        if occ != self._occupancy:
            raise RuntimeError(f"saecache: occupancy {self._occupancy} != {occ}")


def _survival(kind: int, c1: float, c2: float, dt: float, x: float | None) -> float:
    """``p_q(b)`` after ``dt`` idle seconds, from a group's constants (see ``SAECachePolicy._constants``)."""
    if kind == _LOGNORMAL:  # c1 = mu, c2 = sigma * sqrt(2)
        return 0.5 * math.erfc((math.log(dt) - c1) / c2)
    if kind == _EXPONENTIAL:  # c1 = the mean
        return math.exp(-dt / c1)
    if kind == _POSITION:  # c1 = gamma, x = the block's relative offset
        return 1.0 - x ** c1
    return 1.0


def _any_per_request(flags: np.ndarray, offsets: np.ndarray) -> list[bool]:
    """Whether any of each request's blocks (CSR ``offsets``) has its flag set."""
    counts = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return (counts[offsets[1:]] > counts[offsets[:-1]]).tolist()


def gap_fit(stats: list[float]) -> tuple[float, float] | None:
    """Log-normal MLE (mu, sigma) from sufficient statistics [n, sum ln x, sum ln^2 x]; None if n < 2."""
    n, s1, s2 = stats
    if n < 2:
        return None
    mu = s1 / n
    var = max(s2 / n - mu * mu, 0.0)
    return mu, math.sqrt(var)

