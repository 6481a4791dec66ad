"""The ghost record: the keys a cache evicted, so that a later request for one counts as a miss after eviction.

Bounded (as many keys as the cache holds blocks, by default), the oldest dropped first; each key maps to the
:func:`~sae_env.block.queue_type_code` of the block when it was evicted, so that regrets are counted per token type
and per queue.
"""

from __future__ import annotations

from collections import deque

__all__ = ["GhostRecord"]


class GhostRecord(dict):
    """Evicted keys, at most ``capacity`` of them, the oldest dropped first: key -> its queue-type code.

    A plain dict (``key in ghosts`` runs at C speed on the insertion path; iteration is eviction order, oldest
    first, as keys are only ever added at the end or removed) plus a deque of keys in eviction order, so that the
    oldest is dropped in O(1). This is the ordered record an ``OrderedDict`` would give, at about half its memory
    (no linked-list node per key). A ghost that comes back (:meth:`take`) leaves its deque entry behind, as removing
    it from the middle would cost O(n): ``_stale[key]`` counts such entries, which are always older than the key's
    live entry, so the oldest entry of a key with no stale count left is the live one. The deque is compacted when
    it grows past twice the capacity, so stale entries cost O(1) amortised.
    """

    __slots__ = ("capacity", "_order", "_stale")

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self._order: deque[int] = deque()  # keys in eviction order, oldest first; stale entries included
        self._stale: dict[int, int] = {}  # key -> its entries in _order that are no longer live

    def add(self, key: int, code: int) -> None:
        """Remember an evicted key (a key already remembered keeps its place, as in an OrderedDict)."""
        if self.capacity <= 0:
            return
        if key in self:
            self[key] = code
            return
        self[key] = code
        order = self._order
        order.append(key)
        if len(self) > self.capacity:
            stale = self._stale
            while True:  # drop the oldest live ghost, skipping stale entries on the way
                k = order.popleft()
                n = stale.get(k)
                if n is None:
                    del self[k]
                    break
                if n == 1:
                    del stale[k]
                else:
                    stale[k] = n - 1
        if len(order) > 2 * self.capacity + 16:
            self._order = deque(self)  # iteration order is eviction order: the live entries, oldest first
            self._stale.clear()

    def take(self, key: int) -> int:
        """Forget a ghost that came back; returns its queue-type code."""
        code = self.pop(key)
        self._stale[key] = self._stale.get(key, 0) + 1
        return code

    def check(self) -> None:
        """Raise RuntimeError if the deque's live entries disagree with the dict or the bound is broken."""
        if len(self) > max(0, self.capacity):
            raise RuntimeError("ghost record exceeds its bound")
        stale = dict(self._stale)
        live = []
        for k in self._order:
            n = stale.get(k, 0)
            if n:
                stale[k] = n - 1
            else:
                live.append(k)
        if live != list(self) or any(stale.values()):
            raise RuntimeError("ghost record: its order disagrees with its keys")
