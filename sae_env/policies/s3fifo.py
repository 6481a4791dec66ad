"""S3-FIFO (Yang et al., SOSP'23): a small FIFO queue S (10 % of the cache) filters one-hit wonders, a main FIFO M
keeps the rest with CLOCK-style second chances, and a ghost FIFO G remembers keys recently evicted from S.

* insert: a key found in G goes to M, any other to S; every block starts with frequency 0.
* hit: frequency += 1, capped at 3.
* evict: if S holds at least its share, take S's oldest: frequency >= ``move_to_main`` -> moved to M, otherwise
  evicted (its key to G); else take M's oldest: frequency > 0 -> reinserted into M with frequency - 1, otherwise
  evicted.
* prefix caches only evict leaves that no request pins. A block that reaches the end of its queue while pinned is
  moved to the newest end of M, untouched (it is in use); when all of M is pinned, S gives the victim even below
  its share. One that has cached children is parked outside the queues (it cannot be evicted before them, and
  rescanning it on every eviction would cost O(cache)); when its last child goes it returns to the oldest end of
  M, as its subtree has just proved cold. Enough steps per eviction for every block to spend its second chances,
  then a bypass.

Queue ids exposed in ``block.queue``: 0 = S, 1 = M.

:mod:`sae_env.fast_engine` replays this policy compiled (instant mode, chosen by the replay by itself); a change here
must be made there too (``tests/test_fast_engine.py`` compares the two hit for hit).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from sae_env.block import Block
from sae_env.policies.base import EvictionPolicy, block_array, positions

SMALL, MAIN = 0, 1


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    queue_names = ("small", "main")  # SMALL, MAIN

    def __init__(self, small_ratio: float = 0.1, move_to_main: int = 1, max_freq: int = 3) -> None:
        super().__init__()
        if not 0 < small_ratio < 1:
            raise ValueError(f"s3fifo: small_ratio must lie in (0, 1), got {small_ratio}")
        self.small_ratio = small_ratio
        self.move_to_main = move_to_main
        self.max_freq = max_freq
        self._small: OrderedDict[int, Block] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, Block] = OrderedDict()  # oldest first
        self._ghost: OrderedDict[int, None] = OrderedDict()  # keys evicted from S, oldest first
        self._parked: dict[int, Block] = {}  # blocks with cached children, outside the queues
        self._small_target = 1
        self._ghost_size = 1

    def attach(self, cache) -> None:
        super().attach(cache)
        self._small_target = max(1, int(self.small_ratio * cache.capacity))
        self._ghost_size = max(1, cache.capacity - self._small_target)

    def on_insert(self, block: Block, now: float) -> None:
        block.pdata = 0
        if block.key in self._ghost:
            del self._ghost[block.key]
            block.queue = MAIN
            self._main[block.key] = block
        else:
            block.queue = SMALL
            self._small[block.key] = block

    def on_hit(self, blocks: list[Block], now: float) -> None:
        cap = self.max_freq
        for b in blocks:
            if b.pdata < cap:
                b.pdata += 1

    def _to_main(self, block: Block) -> None:
        block.queue = MAIN
        self._main[block.key] = block

    def on_leaf(self, block: Block) -> None:
        if self._parked.pop(block.key, None) is not None:
            block.queue = MAIN
            self._main[block.key] = block
            self._main.move_to_end(block.key, last=False)

    def evict(self, now: float) -> Block | None:
        small, main = self._small, self._main
        # Enough steps for every block to spend its frequency (up to max_freq second chances) and move once.
        budget = (self.max_freq + 2) * (len(small) + len(main)) + 1
        pinned_in_main = 0  # consecutive pinned blocks met in M: once all of M is pinned, S must give a victim
        while budget > 0 and (small or main):
            budget -= 1
            if small and (len(small) >= self._small_target or not main or pinned_in_main >= len(main)):
                key, b = small.popitem(last=False)
                if b.n_children:
                    b.queue = MAIN
                    self._parked[key] = b
                    continue
                if b.pdata >= self.move_to_main or b.pins:
                    self._to_main(b)
                    continue
                self._ghost[key] = None
                if len(self._ghost) > self._ghost_size:
                    self._ghost.popitem(last=False)
                return b
            key, b = main.popitem(last=False)
            if b.n_children:
                self._parked[key] = b
                continue
            if b.pins:
                main[key] = b
                pinned_in_main += 1
                continue
            pinned_in_main = 0
            if b.pdata > 0:
                b.pdata -= 1
                main[key] = b
                continue
            return b
        return None

    def occupancy_by_queue(self) -> dict[int, int]:
        return {SMALL: len(self._small), MAIN: len(self._main) + len(self._parked)}

    def export_state(self, index: dict[int, int]) -> dict[str, Any]:
        return {"small": positions(self._small.values(), index), "main": positions(self._main.values(), index),
                "parked": positions(self._parked.values(), index),
                "freq": block_array(self.cache.blocks.values(), index, lambda b: b.pdata),
                "ghost": np.fromiter(self._ghost, dtype=np.int64, count=len(self._ghost)),  # keys, oldest first
                "small_target": self._small_target, "ghost_size": self._ghost_size}

    def import_state(self, state: dict[str, Any], blocks: list[Block]) -> None:
        for b, f in zip(blocks, state["freq"].tolist(), strict=True):
            b.pdata = f
        self._small = OrderedDict((blocks[i].key, blocks[i]) for i in state["small"].tolist())
        self._main = OrderedDict((blocks[i].key, blocks[i]) for i in state["main"].tolist())
        self._parked = {blocks[i].key: blocks[i] for i in state["parked"].tolist()}
        self._ghost = OrderedDict.fromkeys(state["ghost"].tolist())
        self._small_target, self._ghost_size = int(state["small_target"]), int(state["ghost_size"])

    def check_invariants(self) -> None:
        small, main, parked = set(self._small), set(self._main), set(self._parked)
        if small | main | parked != set(self.cache.blocks) or small & main or parked & (small | main):
            raise RuntimeError("s3fifo: queues differ from the cached blocks")
        if any(not b.n_children for b in self._parked.values()):
            raise RuntimeError("s3fifo: a parked block has no children")
