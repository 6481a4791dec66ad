"""LFU with a recency tie-break: evict the evictable leaf with the fewest hits; among equals, the one released
longest ago (deepest first among blocks released together), as libCacheSim's LFU (frequency lists, LRU inside).

A block's count starts at 1 on insertion and grows by 1 per hit; it is forgotten on eviction (no ghost frequency).

:mod:`sae_env.fast_engine` replays this policy compiled (instant mode, chosen by the replay by itself); a change here
must be made there too (``tests/test_fast_engine.py`` compares the two hit for hit).
"""

from __future__ import annotations

from typing import Any

from sae_env.block import Block
from sae_env.policies.base import KeyedPolicy, block_array


class LFUPolicy(KeyedPolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._released = 0

    def on_release(self, blocks: list[Block], now: float) -> None:
        for b in blocks:
            self._released += 1
            b.pdata = self._released  # release order, the recency tie-break
        super().on_release(blocks, now)

    def priority(self, block: Block, now: float) -> tuple[int, int]:
        return (1 + block.hits, block.pdata)

    def export_pdata(self, index: dict[int, int]) -> dict[str, Any]:
        # -1: not released since its insertion (a block an in-flight request holds)
        return {"released": block_array(self.cache.blocks.values(), index, lambda b: b.pdata, default=-1),
                "n_released": self._released}

    def import_pdata(self, state: dict[str, Any], blocks: list[Block]) -> None:
        self._released = int(state["n_released"])
        for b, r in zip(blocks, state["released"].tolist(), strict=True):
            b.pdata = None if r < 0 else r
