"""A slow, obviously-correct reference of the prefix cache, for differential tests (not a test file).

Semantics, written from the docstrings of :mod:`sae_env.cache`, :mod:`sae_env.policies` and :mod:`sae_env.replay`,
without reusing any of their code:

* The cache is a dict ``key -> RefBlock`` (parent key, depth, pins, hits, counters). Children, leaves and the
  evictable set are recomputed from scratch whenever they are needed.
* A request's prompt hits its longest cached prefix; the hit blocks are pinned and counted as hits. The missing
  blocks are inserted in order; while the cache is full, the victim is the argmin of an explicit sort key over ALL
  evictable blocks (unpinned leaves). If nothing is evictable the remaining blocks are counted as bypassed and
  not inserted. On completion, output blocks are inserted after the prompt (only when the whole prompt is cached
  and ``cache_outputs``); an output key that is already cached is shared (pinned; counted as a hit when
  ``shared_output_is_hit``), then the request's blocks are released deepest first.
* Sort keys (lowest evicted first):

  - ``lru``: release counter (a global counter bumped by every pin 1 -> 0 transition);
  - ``lfu``: ``(1 + hits, release counter)``;
  - ``fifo``: insertion counter;
  - ``belady``: ``(-next use, -depth, became-evictable counter)``. In ``"scan"`` mode the next use of a key at
    an eviction during request ``i`` is found by scanning requests ``i, i+1, ...`` for the key in a prompt (an
    output that contains the key is not a use: it cannot hit); in ``"access"`` mode it is fixed when the block is
    touched (hit, insertion or sharing) by request ``i``: the first request after both ``i`` and the latest request
    admitted so far, also found by a forward scan. That is the definition for timed mode, where outputs are inserted
    when their request completes, possibly after later requests were admitted (whose uses are then in the past).

* Evicted keys go to a FIFO ghost record of ``ghost_capacity`` keys; inserting a ghost key counts a miss after
  eviction under the type the block had when evicted. With ``GHOST_LOOKUP_FIRST = True`` (the engine's order) the
  key is looked up when the request misses it, before the eviction that makes room for it; with it unset, after
  that eviction (which can push the key out of a full record: see test_cache.py).

The timed replay (:func:`reference_replay_timed`) drives a real :class:`sae_env.serving.PrefillServer` (tested on
its own in test_serving.py) as the clock, in the event order the replay documents: at each arrival, first tokens
due by then (their completion = first token + decode time is scheduled), then completions due by then, then the
arrival is admitted and submitted with ``new = prompt_tokens - min(hits * block_size, prompt_tokens)``.

:func:`s3fifo_reference` is a classic S3-FIFO over a plain key stream (one block per request), following
:mod:`sae_env.policies.s3fifo`'s docstring.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from sae_env.trace import N_TOKEN_TYPES, Trace

NEVER = 2**63 - 1
# The engine looks a key up among the ghosts only after the eviction that makes room for it, which can push the
# key itself out of a full ghost record (test_cache.py shows it). True = look up first, as a request would; set it
# to True once the engine does so. Until then the differential tests follow the engine's order.
GHOST_LOOKUP_FIRST = True
POLICIES = ("lru", "lfu", "fifo", "belady")


@dataclass
class RefBlock:
    key: int
    parent: int | None
    depth: int
    type: int
    pins: int = 0
    hits: int = 0
    inserted_at: int = 0
    released_at: int = 0
    evictable_at: int = 0
    next_use: int = NEVER  # belady "access" mode: next request after the last one that touched the block


@dataclass
class Counters:
    evictions: int = 0
    bypasses: int = 0
    inserted: int = 0
    miss_after_eviction: list[int] = field(default_factory=lambda: [0] * N_TOKEN_TYPES)
    output_miss_after_eviction: int = 0  # those of the misses after eviction that are output blocks

    def copy(self) -> Counters:
        return Counters(self.evictions, self.bypasses, self.inserted, list(self.miss_after_eviction),
                        self.output_miss_after_eviction)

    def minus(self, other: Counters) -> Counters:
        return Counters(self.evictions - other.evictions, self.bypasses - other.bypasses,
                        self.inserted - other.inserted,
                        [a - b for a, b in zip(self.miss_after_eviction, other.miss_after_eviction, strict=True)],
                        self.output_miss_after_eviction - other.output_miss_after_eviction)


class ReferenceCache:
    def __init__(self, capacity: int, policy: str, trace: Trace, *, cache_outputs: bool = True,
                 ghost_capacity: int | None = None, belady_next: str = "scan", shared_output_is_hit: bool = True,
                 ghost_lookup_first: bool = GHOST_LOOKUP_FIRST):
        if policy not in POLICIES:
            raise ValueError(policy)
        self.capacity = capacity
        self.policy = policy
        self.trace = trace
        self.cache_outputs = cache_outputs
        self.ghost_capacity = capacity if ghost_capacity is None else ghost_capacity
        self.belady_next = belady_next
        self.shared_output_is_hit = shared_output_is_hit
        self.ghost_lookup_first = ghost_lookup_first
        self.blocks: dict[int, RefBlock] = {}
        self.ghosts: OrderedDict[int, int] = OrderedDict()  # key -> type at eviction, oldest first
        self.c = Counters()
        self.clock = 0  # one global counter for insertions, releases and became-evictable events
        self.current = 0  # request being served (belady "scan" mode)
        self.frontier = -1  # latest request admitted (belady "access" mode)
        self._evictable: set[int] = set()
        n = len(trace)
        self._uses: list[set[int]] = []
        for i in range(n):  # a use is a prompt reference: outputs are inserted whatever the cache holds
            self._uses.append(set(trace.prompt_blocks(i)[0].tolist()))

    # -- brute-force structure -----------------------------------------------------------------------------
    def children(self) -> dict[int, int]:
        out = {k: 0 for k in self.blocks}
        for b in self.blocks.values():
            if b.parent is not None:
                out[b.parent] += 1
        return out

    def evictable(self) -> list[RefBlock]:
        ch = self.children()
        return [b for b in self.blocks.values() if b.pins == 0 and ch[b.key] == 0]

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _refresh(self) -> None:
        """Stamp blocks that just became evictable; every primitive operation makes at most one so."""
        now = {b.key for b in self.evictable()}
        new = now - self._evictable
        assert len(new) <= 1, "reference: two blocks became evictable in one step"
        for k in new:
            self.blocks[k].evictable_at = self._tick()
        self._evictable = now

    def next_use_scan(self, key: int, start: int) -> int:
        for r in range(start, len(self.trace)):
            if key in self._uses[r]:
                return r
        return NEVER

    def sort_key(self, b: RefBlock) -> tuple:
        if self.policy == "lru":
            return (b.released_at,)
        if self.policy == "lfu":
            return (1 + b.hits, b.released_at)
        if self.policy == "fifo":
            return (b.inserted_at,)
        nxt = self.next_use_scan(b.key, self.current) if self.belady_next == "scan" else b.next_use
        return (-nxt, -b.depth, b.evictable_at)

    def victim(self) -> RefBlock | None:
        cands = self.evictable()
        return min(cands, key=self.sort_key) if cands else None

    # -- primitive operations ------------------------------------------------------------------------------
    def _touch(self, b: RefBlock, i: int) -> None:
        b.next_use = self.next_use_scan(b.key, max(i, self.frontier) + 1)

    def _evict(self, b: RefBlock) -> None:
        del self.blocks[b.key]
        self.c.evictions += 1
        if self.ghost_capacity > 0:
            self.ghosts[b.key] = b.type
            if len(self.ghosts) > self.ghost_capacity:
                self.ghosts.popitem(last=False)
        self._refresh()

    def _insert_run(self, i: int, path: list[int], keys: list[int], types: list[int], depth: int,
                    output: bool = False) -> None:
        parent = path[-1] if path else None
        for j, k in enumerate(keys):
            if k in self.blocks:  # an output already cached by another request: share it
                b = self.blocks[k]
                assert b.parent == parent, "reference: chained keys never reach a cached key by another parent"
                b.pins += 1
                if self.shared_output_is_hit:
                    b.hits += 1
                self._touch(b, i)
                self._refresh()
            else:
                if self.ghost_lookup_first and k in self.ghosts:
                    self.c.miss_after_eviction[self.ghosts.pop(k)] += 1
                    self.c.output_miss_after_eviction += output
                if len(self.blocks) >= self.capacity:
                    v = self.victim()
                    if v is None:
                        self.c.bypasses += len(keys) - j
                        return
                    self._evict(v)
                if k in self.ghosts:
                    self.c.miss_after_eviction[self.ghosts.pop(k)] += 1
                    self.c.output_miss_after_eviction += output
                b = RefBlock(k, parent, depth + j, types[j], pins=1, inserted_at=self._tick())
                self.blocks[k] = b
                self.c.inserted += 1
                self._touch(b, i)
                self._refresh()
            path.append(k)
            parent = k

    # -- requests ------------------------------------------------------------------------------------------
    def admit(self, i: int) -> tuple[list[int], int]:
        self.current = i
        self.frontier = max(self.frontier, i)
        keys, types = (a.tolist() for a in self.trace.prompt_blocks(i))
        path = []
        for k in keys:
            if k not in self.blocks:
                break
            path.append(k)
        for k in path:
            b = self.blocks[k]
            b.pins += 1
            b.hits += 1
            self._touch(b, i)
            self._refresh()
        h = len(path)
        self._insert_run(i, path, keys[h:], types[h:], h)
        return path, h

    def complete(self, i: int, path: list[int]) -> None:
        self.current = i
        n_prompt = len(self.trace.prompt_blocks(i)[0])
        okeys, otypes = (a.tolist() for a in self.trace.output_blocks(i))
        if self.cache_outputs and okeys and len(path) == n_prompt:
            self._insert_run(i, path, okeys, otypes, n_prompt, output=True)
        for k in reversed(path):
            b = self.blocks[k]
            b.pins -= 1
            if b.pins == 0:
                b.released_at = self._tick()
            self._refresh()

    def check(self) -> None:
        assert len(self.blocks) <= self.capacity
        for b in self.blocks.values():
            assert b.parent is None or b.parent in self.blocks, "reference: prefix closure broken"
            assert b.pins >= 0


@dataclass
class RefResult:
    hits: list[int]  # per request
    counters: list[Counters]  # per request window (what happened between its arrival and the next one)
    ttft_ms: dict[int, float]  # timed mode: request -> TTFT
    ttft_windows: list[list[float]]  # timed mode: TTFTs recorded in each request's window, in emission order
    cached: set[int]  # keys cached at the end

    @property
    def total(self) -> Counters:
        out = Counters()
        for c in self.counters:
            out.evictions += c.evictions
            out.bypasses += c.bypasses
            out.inserted += c.inserted
            out.miss_after_eviction = [a + b for a, b in zip(out.miss_after_eviction, c.miss_after_eviction,
                                                              strict=True)]
        return out


def reference_replay_instant(trace: Trace, policy: str, capacity: int, **kw) -> RefResult:
    """Instant mode: each request is admitted and completed before the next one."""
    ref = ReferenceCache(capacity, policy, trace, **kw)
    hits, counters = [], []
    for i in range(len(trace)):
        before = ref.c.copy()
        path, h = ref.admit(i)
        ref.complete(i, path)
        ref.check()
        hits.append(h)
        counters.append(ref.c.minus(before))
    return RefResult(hits, counters, {}, [[] for _ in hits], set(ref.blocks))


def reference_replay_timed(trace: Trace, policy: str, capacity: int, server, **kw) -> RefResult:
    """Timed mode on ``server`` (a fresh PrefillServer), in the replay's documented event order."""
    kw.setdefault("belady_next", "access")
    ref = ReferenceCache(capacity, policy, trace, **kw)
    bs = trace.block_size
    events: list[tuple[float, int]] = []
    inflight: dict[int, list[int]] = {}
    ttft: dict[int, float] = {}
    hits, counters, windows = [], [], []

    def first_token(c) -> None:
        i = c.req_id
        ttft[i] = (c.t_first_token - trace.t[i]) * 1e3
        windows[-1].append(ttft[i])
        done = c.t_first_token + server.decode_time(int(trace.output_tokens[i]),
                                                    int(trace.prompt_tokens[i] + trace.output_tokens[i]))
        heapq.heappush(events, (done, i))

    for i in range(len(trace)):
        now = float(trace.t[i])
        before = ref.c.copy()
        windows.append([])
        for c in server.advance_to(now):
            first_token(c)
        while events and events[0][0] <= now:
            _, j = heapq.heappop(events)
            ref.complete(j, inflight.pop(j))
        path, h = ref.admit(i)
        inflight[i] = path
        p = int(trace.prompt_tokens[i])
        cached = min(h * bs, p)
        server.submit(i, now, p - cached, cached)
        ref.check()
        hits.append(h)
        if i == len(trace) - 1:
            for c in server.drain():
                first_token(c)
            while events:
                _, j = heapq.heappop(events)
                ref.complete(j, inflight.pop(j))
            assert not inflight
        counters.append(ref.c.minus(before))
    return RefResult(hits, counters, ttft, windows, set(ref.blocks))


class _ScriptedReference(ReferenceCache):
    """The reference cache with its victims chosen by a script: choice ``c`` at the ``n``-th eviction is the
    ``c``-th evictable block by key; past the script it takes the first and records how many there were."""

    def __init__(self, capacity: int, trace: Trace, script: list[int], **kw):
        super().__init__(capacity, "lru", trace, **kw)
        self.script = script
        self.evictions_chosen = 0
        self.options: list[int] = []  # evictable blocks at each eviction past the script

    def victim(self) -> RefBlock | None:
        cands = sorted(self.evictable(), key=lambda b: b.key)
        if not cands:
            return None
        n = self.evictions_chosen
        self.evictions_chosen += 1
        if n < len(self.script):
            return cands[self.script[n]]
        self.options.append(len(cands))
        return cands[0]


def optimal_hits_instant(trace: Trace, capacity: int, limit: int = 5000, **kw) -> int | None:
    """The most prompt hits that any sequence of victims gives in instant mode: an exhaustive search over every
    choice among the evictable blocks at every eviction (None if it takes more than ``limit`` replays).

    Each replay follows a script of choices and takes the first block past it; every later choice point then
    spawns one script per other option, so each sequence of choices is replayed exactly once.
    """
    best, todo, runs = -1, [[]], 0
    while todo:
        script = todo.pop()
        runs += 1
        if runs > limit:
            return None
        ref = _ScriptedReference(capacity, trace, script, **kw)
        hits = 0
        for i in range(len(trace)):
            path, h = ref.admit(i)
            ref.complete(i, path)
            hits += h
        best = max(best, hits)
        for at, k in enumerate(ref.options):
            todo += [script + [0] * at + [c] for c in range(1, k)]
    return best


def s3fifo_reference(keys: list[int], capacity: int, small_ratio: float = 0.1, move_to_main: int = 1,
                     max_freq: int = 3) -> tuple[list[int], int, dict[int, int]]:
    """Classic S3-FIFO over a key stream (each key one object): per-request hits, evictions, key -> queue (0=S)."""
    small_target = max(1, int(small_ratio * capacity))
    ghost_size = max(1, capacity - small_target)
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}
    queue: dict[int, int] = {}
    hits: list[int] = []
    evictions = 0

    def evict() -> None:
        while True:
            if small and (len(small) >= small_target or not main):
                k = small.popleft()
                if freq[k] >= move_to_main:
                    main.append(k)
                    queue[k] = 1
                    continue
                ghost[k] = None
                if len(ghost) > ghost_size:
                    ghost.popitem(last=False)
            else:
                k = main.popleft()
                if freq[k] > 0:
                    freq[k] -= 1
                    main.append(k)
                    continue
            del freq[k], queue[k]
            return

    for k in keys:
        if k in freq:
            freq[k] = min(freq[k] + 1, max_freq)
            hits.append(1)
            continue
        hits.append(0)
        if len(freq) >= capacity:
            evict()
            evictions += 1
        freq[k] = 0
        if k in ghost:
            del ghost[k]
            main.append(k)
            queue[k] = 1
        else:
            small.append(k)
            queue[k] = 0
    return hits, evictions, queue
