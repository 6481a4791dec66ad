"""The eviction-policy interface: a few hooks, like libCacheSim's plugin interface.

The cache (:mod:`sae_env.cache`) owns the generic loop (find -> evict while full -> insert) and calls:

=====================================  ==========================================================================
``attach(cache)``                      once, when the cache is built
``bind(trace)``                        once, before a replay starts (oracles precompute their knowledge here)
``on_request(trace, i, now)``          before request ``i`` is served: the semantic context a real server has
                                       (session, turn, app, block types; features for learned components)
``on_complete(trace, i, now)``         request ``i`` finished decoding; its output blocks are inserted next
``on_insert(block, now)``              a block was inserted (it is pinned by the inserting request)
``on_hit(blocks, now)``                the request hit these cached blocks (its longest cached prefix), in order
``on_acquire(blocks)``                 these blocks' pin counts went 0 -> 1: they are no longer evictable
``on_release(blocks, now)``            these blocks' pin counts went 1 -> 0, listed deepest first (a request's
                                       blocks are released together); each is evictable if also a leaf
``on_leaf(block)``                     the block's last cached child was evicted; evictable if also unpinned
``evict(now) -> Block | None``         choose an evictable block (unpinned leaf), forget it, return it;
                                       ``None`` if nothing is evictable (the cache then counts a bypass)
=====================================  ==========================================================================

Per-block events come in lists, one call per request: on a Python hot path the calls cost more than the work.
A policy sees only what a real server would know at that moment, except *oracle* policies (``oracle = True``,
e.g. Belady), whose extra knowledge is computed in :meth:`bind` and arrives with each request.

Tunable policies expose a named, bounded parameter vector (:class:`~sae_env.policies.params.ParamSpec`, with its map
onto agents' actions in :mod:`sae_env.policies.params`), set by agents through :meth:`set_params`. A policy reads
the cache only through :class:`BlockTable` (its blocks and capacity): this module does not import the cache.

:class:`KeyedPolicy` is the SGLang-style shortcut: a policy that is nothing but a sort key over evictable leaves,
fixed when the block becomes evictable (a lazy-deletion heap keeps them).
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sae_env.block import Block
from sae_env.policies.params import ParamSpec

if TYPE_CHECKING:
    from sae_env.trace import Trace

__all__ = ["BlockTable", "EvictionPolicy", "KeyedPolicy", "ParamSpec"]


class BlockTable(Protocol):
    """What a policy may read of the cache it is attached to (:class:`sae_env.cache.PrefixCache`): its blocks by
    key, its capacity and its size. Everything else reaches a policy through the hooks."""

    blocks: dict[int, Block]
    capacity: int

    def __len__(self) -> int: ...


class EvictionPolicy:
    """Base class: every hook is a no-op; subclasses override what they need and :meth:`evict`."""

    name = "base"
    oracle = False  # True for policies that know the future (Belady)
    param_specs: tuple[ParamSpec, ...] = ()
    queue_names: tuple[str, ...] = ("cache",)  # the name of each queue id the policy puts blocks in (Block.queue)

    def __init__(self) -> None:
        self.cache: BlockTable | None = None
        self._params: dict[str, float] = {p.name: p.default for p in self.param_specs}
        self._params_watcher: Callable[[], None] | None = None

    # -- wiring --------------------------------------------------------------------------------------------
    def attach(self, cache: BlockTable) -> None:
        if self.cache is not None and self.cache is not cache:
            raise RuntimeError(f"policy {self.name!r} is already attached to another cache; build a new one")
        self.cache = cache

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether this policy implements ``hook`` rather than inheriting the no-op: the cache and the replay skip
        a no-op call on their hot paths."""
        return getattr(cls, hook) is not getattr(EvictionPolicy, hook)

    def bind(self, trace: Trace) -> None:
        """Called once before replaying ``trace``."""

    # -- hooks ---------------------------------------------------------------------------------------------
    def on_request(self, trace: Trace, i: int, now: float) -> None:
        pass

    def on_complete(self, trace: Trace, i: int, now: float) -> None:
        pass

    def on_insert(self, block: Block, now: float) -> None:
        pass

    def on_hit(self, blocks: list[Block], now: float) -> None:
        pass

    def on_acquire(self, blocks: list[Block]) -> None:
        pass

    def on_release(self, blocks: list[Block], now: float) -> None:
        pass

    def on_leaf(self, block: Block) -> None:
        pass

    def evict(self, now: float) -> Block | None:
        raise NotImplementedError

    # -- parameters ----------------------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, float]:
        return dict(self._params)

    def set_params(self, values: dict[str, float] | np.ndarray | list[float]) -> int:
        """Set parameters by name (dict) or as a vector in ``param_specs`` order.

        Values outside the bounds are clipped; NaN keeps the current value. Returns how many values were clipped
        or ignored, so that callers can count them. Unknown names raise ValueError.
        """
        specs = {p.name: p for p in self.param_specs}
        if not isinstance(values, dict):
            vec = np.asarray(values, dtype=np.float64).ravel()
            if vec.size != len(self.param_specs):
                raise ValueError(f"policy {self.name!r} has {len(self.param_specs)} parameters, got {vec.size}")
            values = {p.name: float(v) for p, v in zip(self.param_specs, vec, strict=True)}
        unknown = sorted(set(values) - set(specs))
        if unknown:
            raise ValueError(f"policy {self.name!r} has no parameter(s) {unknown}; valid: {sorted(specs)}")
        fixed = 0
        for name, v in values.items():
            v = float(v)
            if math.isnan(v):
                fixed += 1
                continue
            c = specs[name].clip(v)
            fixed += c != v
            self._params[name] = c
        self.params_changed()
        if self._params_watcher is not None:
            self._params_watcher()
        return fixed

    def params_changed(self) -> None:
        """Called after :meth:`set_params`; policies refresh derived values here."""

    def watch_params(self, callback: Callable[[], None] | None) -> None:
        """Have ``callback()`` called after every :meth:`set_params` (None: stop). The compiled engine follows
        parameter changes this way while it holds the policy's state."""
        self._params_watcher = callback

    # -- reporting -----------------------------------------------------------------------------------------
    def window_stats(self) -> dict[str, Any]:
        """Policy-specific statistics for the current window (queues, gaps, ...); reset by :meth:`reset_window`."""
        return {}

    def reset_window(self) -> None:
        pass

    def occupancy_by_queue(self) -> dict[int, int]:
        """Cached blocks per queue id; single-queue policies hold everything in queue 0."""
        return {0: len(self.cache)} if self.cache is not None and len(self.cache) else {}

    def check_invariants(self) -> None:
        """Raise RuntimeError if the policy's structures disagree with the cache (tests call this)."""

    # -- the state contract (sae_env.state) ----------------------------------------------------------------
    def export_state(self, index: dict[int, int]) -> dict[str, Any]:
        """The policy's state as flat arrays and numbers; a block is named by its position ``index[key]`` in the
        cache's exported block order. Policies that run on the compiled engine implement it (and
        :meth:`import_state`); the engine reads and writes nothing else of theirs."""
        raise NotImplementedError(f"policy {self.name!r} does not export its state")

    def import_state(self, state: dict[str, Any], blocks: list[Block]) -> None:
        """Take back a state written by :meth:`export_state` (or by the compiled engine) for a cache whose blocks,
        in position order, are ``blocks``; the policy must be fresh (attached, bound, no block seen)."""
        raise NotImplementedError(f"policy {self.name!r} does not import a state")


def block_array(blocks: Any, index: dict[int, int], value: Any, dtype: Any = np.int64,
                default: Any = 0) -> np.ndarray:
    """One number per block, in position order: ``value(block)`` (``default`` where it gives None)."""
    out = np.full(len(index), default, dtype=dtype)
    for b in blocks:
        v = value(b)
        if v is not None:
            out[index[b.key]] = v
    return out


def request_array(values: Any, code: str) -> array:
    """One number per request as an ``array.array`` of type ``code`` (checked to fit): what a policy reads one
    request at a time, as fast as from a list and in a few bytes per request (numpy scalar reads cost more;
    ``np.frombuffer`` views it without a copy)."""
    values = np.asarray(values)
    out = array(code, values.astype(np.dtype(code)).tobytes())
    if not np.array_equal(np.frombuffer(out, dtype=np.dtype(code)), values):
        raise RuntimeError(f"per-request values do not fit array type {code!r}")
    return out


def positions(blocks: Any, index: dict[int, int]) -> np.ndarray:
    """The positions of ``blocks`` (an iterable of blocks), in its order."""
    return np.fromiter((index[b.key] for b in blocks), dtype=np.int64)


class KeyedPolicy(EvictionPolicy):
    """A policy that is a sort key over evictable leaves (lowest first), like SGLang's radix-cache policies.

    Subclasses implement :meth:`priority`, evaluated when a block becomes evictable (released while a leaf, or
    made a leaf while unpinned). The heap uses lazy deletion: an entry is valid while the block's ``stamp`` still
    names it; blocks of equal priority are evicted in the order they became evictable.
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[Any, int, Block]] = []
        self._seq = 0

    def priority(self, block: Block, now: float) -> Any:
        raise NotImplementedError

    def _push(self, block: Block, now: float) -> None:
        self._seq += 1
        block.stamp = self._seq
        heapq.heappush(self._heap, (self.priority(block, now), self._seq, block))

    def on_release(self, blocks: list[Block], now: float) -> None:
        for b in blocks:
            if not b.n_children:
                self._push(b, now)

    def on_leaf(self, block: Block) -> None:
        if not block.pins:
            self._push(block, block.last_access)

    def on_acquire(self, blocks: list[Block]) -> None:
        for b in blocks:
            b.stamp = 0

    def evict(self, now: float) -> Block | None:
        heap = self._heap
        while heap:
            _, seq, b = heapq.heappop(heap)
            if b.stamp == seq:
                b.stamp = 0
                return b
        return None

    # Every block with a stamp is in the heap under that stamp (and only those are live), so the heap is the stamps:
    # the state is each block's stamp, the push counter and whatever the priority is computed from
    # (:meth:`export_pdata` / :meth:`import_pdata`); the priorities are recomputed on import, as keys were fixed when
    # the blocks became evictable from data that has not changed since.
    def export_state(self, index: dict[int, int]) -> dict[str, Any]:
        blocks = self.cache.blocks.values()
        return {"stamp": block_array(blocks, index, lambda b: b.stamp), "seq": self._seq,
                **self.export_pdata(index)}

    def import_state(self, state: dict[str, Any], blocks: list[Block]) -> None:
        self._seq = int(state["seq"])
        self.import_pdata(state, blocks)
        heap = []
        for b, stamp in zip(blocks, state["stamp"].tolist(), strict=True):
            b.stamp = stamp
        for b in blocks:
            if b.stamp:
                heap.append((self.priority(b, b.last_access), b.stamp, b))
        heapq.heapify(heap)
        self._heap = heap

    def export_pdata(self, index: dict[int, int]) -> dict[str, Any]:
        """The per-block data (``Block.pdata``) and counters the priority needs, as arrays and numbers."""
        raise NotImplementedError(f"policy {self.name!r} does not export its state")

    def import_pdata(self, state: dict[str, Any], blocks: list[Block]) -> None:
        raise NotImplementedError(f"policy {self.name!r} does not import a state")

    def check_invariants(self) -> None:
        live = {b.stamp for b in self.cache.blocks.values() if b.stamp}
        in_heap = {seq for _, seq, b in self._heap if b.stamp == seq}
        if live != in_heap:
            raise RuntimeError(f"{self.name}: {len(live)} blocks marked evictable, {len(in_heap)} valid heap entries")
        for b in self.cache.blocks.values():
            if (b.pins == 0 and b.n_children == 0) != bool(b.stamp):
                raise RuntimeError(f"{self.name}: {b!r} evictability disagrees with its heap entry")
