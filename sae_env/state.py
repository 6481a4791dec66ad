"""The state contract: a cache's and its policy's state as flat arrays, so that a replay can move between engines.

A replay runs on the Python engine (:class:`~sae_env.cache.PrefixCache` with :class:`~sae_env.cache.Block` objects
and a policy's Python structures) or on the compiled engine (:mod:`sae_env.fast_engine`: numeric arrays). Between
any two windows either one can hand its state to the other, and the replay goes on with the same decisions. The
two sides meet only here:

* :func:`export_cache` turns a cache into a :class:`CacheState` (one entry per cached block, in a fixed order, and
  the ghost record in eviction order) and the list of its blocks in that order; :func:`import_cache` rebuilds a
  fresh cache's blocks and ghosts from one and returns the blocks in that order.
* every policy that has a compiled twin implements ``export_state(index) -> dict`` and
  ``import_state(state, blocks)`` (:class:`~sae_env.policies.base.EvictionPolicy`): its own state as flat arrays
  (per-block fields by position in the block order, block lists as positions, counters as numbers) and back. The
  compiled engine reads and writes only these dictionaries, never a policy's attributes, so a policy can change
  its internals freely as long as it keeps its dictionary (the round trip is tested for every compiled policy).

Positions, not keys, name blocks inside a state, so that the arrays stay dense and a policy never needs the key
table. ``index`` maps a block's key to its position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from sae_env.block import Block
    from sae_env.cache import PrefixCache

__all__ = ["CacheState", "export_cache", "import_cache"]


class CacheState(NamedTuple):
    """The blocks of a cache (entry ``i`` = the ``i``-th block) and its ghost record, as arrays."""

    keys: np.ndarray  # int64 block keys
    parent: np.ndarray  # int64 position of the parent, -1 for a first block
    depth: np.ndarray  # int64 position of the block in its sequence
    n_children: np.ndarray  # int64 cached children
    pins: np.ndarray  # int64 in-flight requests holding it
    types: np.ndarray  # int64 TokenType
    queue: np.ndarray  # int64 queue id the policy put it in
    hits: np.ndarray  # int64 hits since insertion
    last_access: np.ndarray  # float64 trace time of its last use
    ghost_keys: np.ndarray  # int64 evicted keys still remembered, oldest first
    ghost_codes: np.ndarray  # int64 ``queue * 8 + type`` of each at its eviction

    def __len__(self) -> int:  # type: ignore[override]  # the number of blocks, not of fields
        return int(self.keys.size)


def export_cache(cache: PrefixCache) -> tuple[CacheState, list[Block]]:
    """The cache's blocks and ghosts as a :class:`CacheState`, and the blocks in its order."""
    blocks = list(cache.blocks.values())
    n = len(blocks)
    index = {b.key: i for i, b in enumerate(blocks)}
    ints = np.array([(b.key, -1 if b.parent is None else index[b.parent.key], b.depth, b.n_children, b.pins, b.type,
                      b.queue, b.hits) for b in blocks], dtype=np.int64).reshape(n, 8)
    ghosts = cache.ghosts
    return CacheState(
        keys=ints[:, 0].copy(), parent=ints[:, 1].copy(), depth=ints[:, 2].copy(), n_children=ints[:, 3].copy(),
        pins=ints[:, 4].copy(), types=ints[:, 5].copy(), queue=ints[:, 6].copy(), hits=ints[:, 7].copy(),
        last_access=np.array([b.last_access for b in blocks], dtype=np.float64),
        ghost_keys=np.fromiter(ghosts.keys(), dtype=np.int64, count=len(ghosts)),
        ghost_codes=np.fromiter(ghosts.values(), dtype=np.int64, count=len(ghosts))), blocks


def import_cache(cache: PrefixCache, state: CacheState) -> list[Block]:
    """Rebuild the blocks and ghosts of ``cache`` (which must hold none) from ``state``; returns the blocks in the
    state's order. Counters are not part of the state (they start again at every window)."""
    from sae_env.block import Block
    from sae_env.ghosts import GhostRecord

    if len(cache.blocks) or cache.ghosts:
        raise RuntimeError("import_cache: the cache already holds blocks or ghosts")
    n = len(state)
    parent = state.parent.tolist()
    keys, depth, types = state.keys.tolist(), state.depth.tolist(), state.types.tolist()
    lasts = state.last_access.tolist()
    blocks: list[Block | None] = [None] * n
    for i in _parents_first(parent):
        p = parent[i]
        blocks[i] = Block(keys[i], blocks[p] if p >= 0 else None, depth[i], types[i], lasts[i])
    for b, nc, pins, q, h in zip(blocks, state.n_children.tolist(), state.pins.tolist(), state.queue.tolist(),
                                 state.hits.tolist(), strict=True):
        b.n_children, b.pins, b.queue, b.hits = nc, pins, q, h
    cache.blocks = {b.key: b for b in blocks}
    occupancy = [0] * len(cache.occupancy_by_type)
    for t in types:
        occupancy[t] += 1
    cache.occupancy_by_type = occupancy
    cache.ghosts = GhostRecord(cache.ghost_capacity)
    for k, code in zip(state.ghost_keys.tolist(), state.ghost_codes.tolist(), strict=True):
        cache.ghosts.add(k, code)
    return blocks


def _parents_first(parent: list[int]) -> list[int]:
    """Positions ordered so that every parent comes before its children (``depth`` need not say it: a block hit at
    another position than it was inserted at heads a chain of other depths)."""
    level = [-1] * len(parent)
    for i in range(len(parent)):
        chain = []
        x = i
        while x >= 0 and level[x] < 0:
            chain.append(x)
            x = parent[x]
        d = level[x] if x >= 0 else -1
        for y in reversed(chain):
            d += 1
            level[y] = d
    return sorted(range(len(parent)), key=level.__getitem__)
