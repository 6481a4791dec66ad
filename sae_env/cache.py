"""PrefixCache: the block table of an LLM server's prefix (KV) cache.

The cache holds blocks keyed by prefix-chained keys (see :mod:`sae_env.trace`), so the cached blocks form a forest:
a block's parent is the block before it in every prompt that contains it. The cache keeps that forest
*prefix-closed* (a block is cached only if its parent is), as vLLM's lookup recovers only the contiguous leading
run of cached blocks and SGLang's radix tree only ever removes leaves.

The generic loop, as in libCacheSim, lives here and nowhere else:

* :meth:`PrefixCache.admit` -- find the longest cached prefix of a request's blocks (the hit), pin it, then insert
  the missing blocks one by one, asking the policy for a victim while the cache is full (``evict while full ->
  insert``). If nothing is evictable the rest of the request is not cached (a *bypass*, counted).
* :meth:`PrefixCache.complete` -- when the request finishes decoding: insert its output blocks (switchable) and
  unpin everything it pinned.

A block is *evictable* when it is a leaf (no cached child) and no in-flight request pins it. Policies see the
events that change that state through a small hook interface (:class:`sae_env.policies.base.EvictionPolicy`) and
return a victim from :meth:`~sae_env.policies.base.EvictionPolicy.evict`; the cache checks that the victim really
is evictable and raises ``RuntimeError`` if a policy breaks that invariant.

Blocks are :class:`~sae_env.block.Block` objects. Evicted keys go to a bounded *ghost* record
(:class:`~sae_env.ghosts.GhostRecord`: their type and queue) so that a later request for one of
them is counted as a *miss after eviction* (a regretted eviction), per token type and per queue; those on output
blocks (a later request decoding an evicted output again) are also counted apart, so that the prompt's share is
known.

An optional :class:`CacheObserver` (``cache.observer``) hears every run of missing blocks, every ghost hit and every
eviction, with the blocks themselves: :mod:`sae_env.explain` uses it to say why each miss happened. Without one the
loop is the same (one test per run of insertions and per eviction); the compiled engine refuses a cache with one.

:mod:`sae_env.fast_engine.loop` is the same loop compiled (``admit`` and ``complete``, with a policy's compiled
hooks inlined), which the replay uses by itself wherever it applies; a change to the semantics here must be made
there too (``tests/test_fast_engine.py`` compares the two field for field, every policy, instant and timed).
:meth:`PrefixCache.serve` is a second, faster instant-mode loop for the Python engine (one pass fewer per hit
block); ``tests/test_cache.py`` checks it against ``admit`` then ``complete`` for every policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from sae_env.block import Block, queue_type_code, split_queue_type
from sae_env.ghosts import GhostRecord
from sae_env.policies.base import EvictionPolicy
from sae_env.trace import N_TOKEN_TYPES

__all__ = ["Block", "CacheObserver", "GhostRecord", "PrefixCache", "resolve_capacity"]


class CacheObserver(Protocol):
    """What a :class:`PrefixCache` tells an observer (``cache.observer``), in the order it happens.

    * ``on_miss_run(keys, start, prompt, now)``: ``keys[start:]`` are about to be inserted, one by one, for a
      request: its missing prompt blocks at admission (``prompt`` True; one call per request with a miss, in
      admission order) or its output blocks at completion (``prompt`` False). Blocks may still be bypassed.
    * ``on_ghost_hit(j, code, now)``: ``keys[j]`` of the current run was in the ghost record (``code`` is
      its :func:`~sae_env.block.queue_type_code` at its eviction); counted as a miss after eviction.
    * ``on_evict(victim, now)``: ``victim`` left the cache (its fields still hold its last state).
    """

    def on_miss_run(self, keys: Sequence[int], start: int, prompt: bool, now: float) -> None: ...

    def on_ghost_hit(self, j: int, code: int, now: float) -> None: ...

    def on_evict(self, victim: Block, now: float) -> None: ...


def resolve_capacity(capacity: float | int | str, distinct_blocks: int | None = None,
                     kv_bytes_per_token: int | None = None, block_size: int | None = None) -> int:
    """Capacity in blocks from a number of blocks, a fraction of the trace's distinct blocks, or KV bytes.

    Accepted: an int >= 1 (blocks; a whole float above 1 too); a float in (0, 1] (fraction of ``distinct_blocks``,
    so ``1.0`` is all of them; a fraction that rounds to no block at all is an error); a string ``"12%"``
    (percentage of distinct blocks), ``"8GiB"`` / ``"500MB"`` (bytes of KV memory, needs ``kv_bytes_per_token`` and
    ``block_size``) or a plain number.
    """
    if isinstance(capacity, str):
        text = capacity.strip().replace(" ", "")
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                 "b": 1}
        low = text.lower()
        if low.endswith("%"):
            return resolve_capacity(float(low[:-1]) / 100.0, distinct_blocks)
        for unit, mult in units.items():
            if low.endswith(unit):
                try:
                    nbytes = float(low[: -len(unit)]) * mult
                except ValueError:
                    break
                if not kv_bytes_per_token or not block_size:
                    raise ValueError(f"capacity '{capacity}' is in bytes: it needs the model's KV bytes per token "
                                     "and the block size")
                blocks = int(nbytes // (kv_bytes_per_token * block_size))
                if blocks < 1:
                    raise ValueError(f"capacity '{capacity}' holds less than one block of "
                                     f"{kv_bytes_per_token * block_size} bytes")
                return blocks
        try:
            capacity = float(text) if any(c in text for c in ".eE") else int(text)
        except ValueError:
            raise ValueError(f"capacity '{capacity}' is not a number of blocks, a fraction, a percentage or a "
                             "size in bytes (e.g. 4096, 0.15, '15%', '2GiB')") from None
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float, np.integer, np.floating)):
        raise ValueError(f"capacity must be a number or a string, got {capacity!r}")
    if isinstance(capacity, int) and not 0 < capacity < 2**63:  # before numpy, which has no 400-digit integers
        text = str(capacity)
        raise ValueError(f"capacity must be a positive number of blocks below 2**63, got "
                         f"{text if len(text) <= 40 else text[:20] + f'...({len(text)} digits)'}")
    if not np.isfinite(capacity) or capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if isinstance(capacity, (float, np.floating)) and capacity > 1 and not float(capacity).is_integer():
        raise ValueError(f"capacity {capacity} is neither a whole number of blocks nor a fraction in (0, 1]")
    if isinstance(capacity, (float, np.floating)) and capacity <= 1:  # a fraction of the distinct blocks, 1.0 = all
        if distinct_blocks is None:
            raise ValueError("a fractional capacity needs the trace's number of distinct blocks")
        blocks = int(round(capacity * distinct_blocks))
        if blocks < 1:  # not silently one block: the user asked for something else
            raise ValueError(f"capacity {capacity:g} of the trace's {distinct_blocks} distinct blocks is "
                             f"{capacity * distinct_blocks:.3g} blocks, less than one; give a larger fraction or a "
                             "number of blocks")
        return blocks
    return int(capacity)


class PrefixCache:
    """A prefix-closed cache of at most ``capacity`` blocks, evicting leaves chosen by ``policy``.

    Args:
        capacity: maximum number of cached blocks (>= 1).
        policy: the eviction policy; :meth:`EvictionPolicy.attach` is called with this cache.
        ghost_capacity: how many evicted keys to remember for miss-after-eviction accounting (default: capacity).
        cache_outputs: insert decode (output) blocks on completion, as vLLM does for the generated tokens.

    ``observer`` (default None) may be set to a :class:`CacheObserver` before the replay starts.
    """

    def __init__(self, capacity: int, policy: EvictionPolicy, ghost_capacity: int | None = None,
                 cache_outputs: bool = True):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity must be a whole number of blocks >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self.policy = policy
        self.cache_outputs = cache_outputs
        self.blocks: dict[int, Block] = {}  # key -> Block, every cached block
        self.ghost_capacity = self.capacity if ghost_capacity is None else int(ghost_capacity)
        # Evicted keys in eviction order (oldest first), bounded: key -> queue-type code, one small int (a
        # tuple per ghost would cost more memory than the cached block itself).
        self.ghosts = GhostRecord(self.ghost_capacity)
        # Counters since the last reset_counters(); the replay turns them into WindowStats.
        self.evictions = 0
        self.bypasses = 0  # blocks that could not be inserted because nothing was evictable
        self.inserted = 0
        self.miss_after_eviction = [0] * N_TOKEN_TYPES  # per TokenType
        self.miss_after_eviction_queue: dict[int, int] = {}  # per queue id
        self.output_miss_after_eviction = 0  # of those, on output blocks (the rest are prompt blocks)
        self.observer: CacheObserver | None = None
        self.occupancy_by_type = [0] * N_TOKEN_TYPES  # cached blocks per TokenType, kept up to date
        policy.attach(self)
        # Skip the call when the policy keeps the no-op default: one fewer call per request on the hot path.
        self._policy_sees_hits = policy.overrides("on_hit")
        self._policy_sees_inserts = policy.overrides("on_insert")

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: int) -> bool:
        return key in self.blocks

    def reset_counters(self) -> None:
        self.evictions = self.bypasses = self.inserted = 0
        self.miss_after_eviction = [0] * N_TOKEN_TYPES
        self.miss_after_eviction_queue = {}
        self.output_miss_after_eviction = 0

    # -- the generic loop ----------------------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``keys`` (no side effects)."""
        blocks = self.blocks
        n = 0
        for k in keys:
            if k not in blocks:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[int], types: Sequence[int], now: float) -> tuple[list[Block], int]:
        """Serve a request's prompt: hit the cached prefix, insert the rest; returns ``(pinned_path, n_hit)``.

        Every block on the returned path is pinned until :meth:`complete` is called with it. Policy hooks get
        lists (one call per request, not per block): calls dominate the cost of a Python hot path.
        """
        get = self.blocks.get
        path: list[Block] = []
        acquired: list[Block] = []
        for k in keys:
            b = get(k)
            if b is None:
                break
            if not b.pins:
                acquired.append(b)
            b.pins += 1
            b.last_access = now
            b.hits += 1
            path.append(b)
        if acquired:
            self.policy.on_acquire(acquired)
        n_hit = len(path)
        if n_hit and self._policy_sees_hits:
            self.policy.on_hit(path, now)
        if n_hit < len(keys):
            self._insert_run(path, keys, types, n_hit, now)
        return path, n_hit

    def complete(self, path: list[Block], n_prompt: int, out_keys: Sequence[int], out_types: Sequence[int],
                 now: float) -> None:
        """Finish a request: insert its output blocks after its prompt (if enabled), then unpin the whole path.

        ``n_prompt`` is the number of full prompt blocks; outputs extend the prompt, so they are cached only when
        the whole prompt is (``len(path) == n_prompt``). Blocks are released deepest first, so that among blocks
        freed together the deepest is evicted first (vLLM frees a request's blocks in reverse order for this).
        """
        if self.cache_outputs and len(out_keys) and len(path) == n_prompt:
            self._insert_run(path, out_keys, out_types, 0, now, first_depth=n_prompt)
        released: list[Block] = []
        for b in reversed(path):
            b.pins -= 1
            if not b.pins:
                b.last_access = now  # a block is in use until released: idle time counts from here (vLLM)
                released.append(b)
        if released:
            self.policy.on_release(released, now)

    def serve(self, keys: Sequence[int], types: Sequence[int], out_keys: Sequence[int], out_types: Sequence[int],
              now: float, done: Callable[[], object] | None = None) -> int:
        """Instant mode: :meth:`admit` then :meth:`complete` at the same instant; returns the number of hit blocks.

        Equivalent to ``complete(*admit(...))`` when no other request is in flight (every block unpinned), which
        lets the hit path be acquired and released as a whole: one pass fewer per block on the hottest loop.
        ``done``, if given, is called between the two, as the replay calls the policy's ``on_complete`` (the
        request finished decoding; its outputs are inserted next).
        """
        get = self.blocks.get
        path: list[Block] = []
        for k in keys:
            b = get(k)
            if b is None:
                break
            b.pins = 1
            b.last_access = now
            b.hits += 1
            path.append(b)
        n_hit = len(path)
        policy = self.policy
        if n_hit:
            policy.on_acquire(path)
            if self._policy_sees_hits:
                policy.on_hit(path, now)
        n_prompt = len(keys)
        if n_hit < n_prompt:
            self._insert_run(path, keys, types, n_hit, now)
        if done is not None:
            done()
        if self.cache_outputs and len(out_keys) and len(path) == n_prompt:
            self._insert_run(path, out_keys, out_types, 0, now, first_depth=n_prompt)
        if path:
            path.reverse()
            for b in path:
                b.pins = 0
            policy.on_release(path, now)
        return n_hit

    def _insert_run(self, path: list[Block], keys: Sequence[int], types: Sequence[int], start: int, now: float,
                    first_depth: int | None = None) -> None:
        """Insert ``keys[start:]`` after ``path`` (pinned, appended to ``path``) while there is room."""
        blocks = self.blocks
        policy = self.policy
        ghosts = self.ghosts
        parent = path[-1] if path else None
        depth = start if first_depth is None else first_depth
        sees_inserts = self._policy_sees_inserts
        observer = self.observer
        if observer is not None:
            observer.on_miss_run(keys, start, first_depth is None, now)
        for j in range(start, len(keys)):
            k = keys[j]
            if k in blocks:
                # Only possible for output keys that another request already cached: share and pin them.
                b = blocks[k]
                if b.parent is not parent:
                    break  # a different chain reached the same key (hash collision): stop rather than corrupt
                if not b.pins:
                    policy.on_acquire([b])
                b.pins += 1
                b.last_access = now
                b.hits += 1
                if self._policy_sees_hits:
                    policy.on_hit([b], now)
                path.append(b)
                parent = b
                depth += 1
                continue
            if k in ghosts:
                # Looked up before evicting: the eviction that makes room could push this very key out of a full
                # ghost record.
                code = ghosts.take(k)
                queue, btype = split_queue_type(code)
                self.miss_after_eviction[btype] += 1
                self.miss_after_eviction_queue[queue] = self.miss_after_eviction_queue.get(queue, 0) + 1
                if first_depth is not None:
                    self.output_miss_after_eviction += 1
                if observer is not None:
                    observer.on_ghost_hit(j, code, now)
            if len(blocks) >= self.capacity and not self._evict_one(now):
                self.bypasses += len(keys) - j
                return
            b = Block(k, parent, depth, types[j], now)
            b.pins = 1
            blocks[k] = b
            self.occupancy_by_type[b.type] += 1
            if parent is not None:
                parent.n_children += 1
            if sees_inserts:
                policy.on_insert(b, now)
            path.append(b)
            parent = b
            depth += 1
            self.inserted += 1

    def _evict_one(self, now: float) -> bool:
        victim = self.policy.evict(now)
        if victim is None:
            return False
        if victim.pins or victim.n_children or self.blocks.get(victim.key) is not victim:
            raise RuntimeError(f"policy {self.policy.name!r} chose {victim!r}, which is not an evictable cached "
                               "leaf")
        del self.blocks[victim.key]
        self.occupancy_by_type[victim.type] -= 1
        parent = victim.parent
        if parent is not None:
            parent.n_children -= 1
            if not parent.n_children:
                self.policy.on_leaf(parent)
        victim.parent = None
        self.evictions += 1
        self.ghosts.add(victim.key, queue_type_code(victim.queue, victim.type))
        if self.observer is not None:
            self.observer.on_evict(victim, now)
        return True

    # -- inspection ----------------------------------------------------------------------------------------
    def evictable(self) -> list[Block]:
        """Every evictable block (a leaf no request pins), in no particular order. O(size): tests only."""
        return [b for b in self.blocks.values() if b.pins == 0 and b.n_children == 0]

    def occupancy_by_queue(self) -> dict[int, int]:
        """Cached blocks per queue id. O(size): policies with queues report their own counts cheaply."""
        counts: dict[int, int] = {}
        for b in self.blocks.values():
            counts[b.queue] = counts.get(b.queue, 0) + 1
        return counts

    def check_invariants(self) -> None:
        """Raise RuntimeError if the cache is not prefix-closed, over capacity or its counts disagree. O(size)."""
        if len(self.blocks) > self.capacity:
            raise RuntimeError(f"cache holds {len(self.blocks)} blocks, capacity is {self.capacity}")
        children: dict[int, int] = {}
        for k, b in self.blocks.items():
            if b.key != k:
                raise RuntimeError(f"block stored under {k} has key {b.key}")
            if b.parent is not None:
                if self.blocks.get(b.parent.key) is not b.parent:
                    raise RuntimeError(f"{b!r} is cached but its parent is not (prefix-closure broken)")
                if b.depth != b.parent.depth + 1:
                    raise RuntimeError(f"{b!r} has depth {b.depth} under a parent of depth {b.parent.depth}")
                children[b.parent.key] = children.get(b.parent.key, 0) + 1
            if b.pins < 0:
                raise RuntimeError(f"{b!r} has a negative pin count")
            if b.pins and b.parent is not None and b.parent.pins < b.pins:
                raise RuntimeError(f"{b!r} is pinned more often than its parent")
        for k, b in self.blocks.items():
            if b.n_children != children.get(k, 0):
                raise RuntimeError(f"{b!r} counts {b.n_children} children, has {children.get(k, 0)}")
        by_type = [0] * N_TOKEN_TYPES
        for b in self.blocks.values():
            by_type[b.type] += 1
        if by_type != self.occupancy_by_type:
            raise RuntimeError(f"occupancy by type {self.occupancy_by_type} disagrees with the blocks ({by_type})")
        self.ghosts.check()
        self.policy.check_invariants()
