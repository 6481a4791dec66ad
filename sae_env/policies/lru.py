"""LRU in vLLM's order: evict the block released longest ago; among blocks released together, the deepest first.

vLLM v1 keeps blocks that no running request uses in a free queue, appended when a request frees them (in reverse
order, so a request's deepest block is evicted first) and removed when a new request hits them; eviction pops the
head. This is that queue. Its head is always a leaf: a block's children are released with it (before it) or earlier,
so the cache's leaf-only rule never has to skip an entry (the cache checks it anyway).

:mod:`sae_env.fast_engine` replays this policy compiled (instant mode, chosen by the replay by itself); a change here
must be made there too (``tests/test_fast_engine.py`` compares the two hit for hit).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from sae_env.block import Block
from sae_env.policies.base import EvictionPolicy, positions


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._free: OrderedDict[int, Block] = OrderedDict()  # unpinned blocks, least recently released first

    def on_acquire(self, blocks: list[Block]) -> None:
        free = self._free
        for b in blocks:
            del free[b.key]

    def on_release(self, blocks: list[Block], now: float) -> None:
        free = self._free
        for b in blocks:
            free[b.key] = b

    def evict(self, now: float) -> Block | None:
        for key, b in self._free.items():
            if b.n_children == 0:
                del self._free[key]
                return b
        return None

    def export_state(self, index: dict[int, int]) -> dict[str, Any]:
        return {"free": positions(self._free.values(), index)}  # the free queue, least recently released first

    def import_state(self, state: dict[str, Any], blocks: list[Block]) -> None:
        self._free = OrderedDict((blocks[i].key, blocks[i]) for i in state["free"].tolist())

    def check_invariants(self) -> None:
        unpinned = {k for k, b in self.cache.blocks.items() if b.pins == 0}
        if unpinned != set(self._free):
            raise RuntimeError("lru: free queue differs from the set of unpinned blocks")
