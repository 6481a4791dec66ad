"""FIFO: evict the evictable leaf that was inserted first. Hits do not change the order.

:mod:`sae_env.fast_engine` replays this policy compiled (instant mode, chosen by the replay by itself); a change here
must be made there too (``tests/test_fast_engine.py`` compares the two hit for hit).
"""

from __future__ import annotations

from typing import Any

from sae_env.block import Block
from sae_env.policies.base import KeyedPolicy, block_array


class FIFOPolicy(KeyedPolicy):
    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._inserted = 0

    def on_insert(self, block: Block, now: float) -> None:
        self._inserted += 1
        block.pdata = self._inserted

    def priority(self, block: Block, now: float) -> int:
        return block.pdata

    def export_pdata(self, index: dict[int, int]) -> dict[str, Any]:
        return {"inserted": block_array(self.cache.blocks.values(), index, lambda b: b.pdata),
                "n_inserted": self._inserted}

    def import_pdata(self, state: dict[str, Any], blocks: list[Block]) -> None:
        self._inserted = int(state["n_inserted"])
        for b, r in zip(blocks, state["inserted"].tolist(), strict=True):
            b.pdata = r
