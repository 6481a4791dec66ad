"""Compiled twins of the baselines ``lru``, ``lfu``, ``fifo`` and ``s3fifo``.

* ``lru`` is vLLM's free queue: a doubly linked list of unpinned slots in release order (a request's blocks are
  released deepest first); eviction takes the first leaf from the head (:class:`~sae_env.policies.lru.LRUPolicy`).
* ``lfu`` and ``fifo`` are keyed policies (:mod:`sae_env.fast_engine.heap`): the key is ``(1 + hits, release
  order)`` for ``lfu`` and ``(insertion order, 0)`` for ``fifo``, fixed when the block becomes evictable.
* ``s3fifo`` keeps its small and main FIFOs as singly linked lists (they are popped only at the oldest end; a block
  returning from the parked set goes to the oldest end of M), each slot's frequency and place (S, M or parked),
  and its own ghost of keys evicted from S as a ring with lazy deletion like the cache's ghost record;
  :func:`_s3fifo_victim` is ``S3FIFOPolicy.evict`` line for line, budget included.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from sae_env.fast_engine import heap as hp
from sae_env.fast_engine.jit import implements, inline, jit
from sae_env.fast_engine.loop import HITS, KEY, NCHILD, P0, P1, P2, PIN, QUEUE, ring_drop_oldest
from sae_env.fast_engine.twin import Twin, register
from sae_env.policies.fifo import FIFOPolicy
from sae_env.policies.lfu import LFUPolicy
from sae_env.policies.lru import LRUPolicy
from sae_env.policies.s3fifo import MAIN, SMALL, S3FIFOPolicy

# -- lru -----------------------------------------------------------------------------------------------------------
PREV, NEXT = P0, P1  # the free queue's links, in the slot's row


class LRUState(NamedTuple):
    sc: np.ndarray  # int64 [head, tail] of the free queue


@inline
def _unlink(rec, ps, s):
    p = rec[s, PREV]
    n = rec[s, NEXT]
    if p >= 0:
        rec[p, NEXT] = n
    else:
        ps.sc[0] = n
    if n >= 0:
        rec[n, PREV] = p
    else:
        ps.sc[1] = p


@inline
def _append(rec, ps, s):
    t = ps.sc[1]
    rec[s, PREV] = t
    rec[s, NEXT] = -1
    if t >= 0:
        rec[t, NEXT] = s
    else:
        ps.sc[0] = s
    ps.sc[1] = s


@implements(LRUState, "on_acquire")
def _lru_acquire(ps, c, path, i0, i1):
    rec = c.rec  # once, not per block (see loop.insert_run)
    for i in range(i0, i1):
        _unlink(rec, ps, path[i])


@implements(LRUState, "on_release")
def _lru_release(ps, c, path, i0, i1, now):
    rec = c.rec
    for i in range(i1 - 1, i0 - 1, -1):
        _append(rec, ps, path[i])


@implements(LRUState, "evict")
def _lru_evict(ps, c, now):
    rec = c.rec
    s = ps.sc[0]
    while s >= 0 and rec[s, NCHILD] != 0:
        s = rec[s, NEXT]
    if s >= 0:
        _unlink(rec, ps, s)
    return s


@register
class LRUTwin(Twin):
    classes = (LRUPolicy,)

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        self.state = LRUState(np.full(2, -1, np.int64))
        rec = core.rec
        rec[:, PREV] = rec[:, NEXT] = -1
        free = state["free"]
        if free.size:
            rec[free[1:], PREV] = free[:-1]
            rec[free[:-1], NEXT] = free[1:]
            self.state.sc[:] = free[0], free[-1]

    def export(self, n: int, core: Any) -> dict[str, Any]:
        order = []
        s = int(self.state.sc[0])
        nxt = core.rec[:, NEXT]
        while s >= 0:
            order.append(s)
            s = int(nxt[s])
        return {"free": np.array(order, dtype=np.int64)}


# -- lfu and fifo ----------------------------------------------------------------------------------------------------
DATA = P1  # the release (lfu) or insertion (fifo) order, in the slot's row; P0 is the heap's stamp


class LFUState(NamedTuple):
    heap: hp.Heap
    counter: np.ndarray  # int64 [releases]


class FIFOState(NamedTuple):
    heap: hp.Heap
    counter: np.ndarray  # int64 [insertions]


@implements(LFUState, "on_release")
def _lfu_release(ps, c, path, i0, i1, now):
    rec = c.rec
    for i in range(i1 - 1, i0 - 1, -1):
        s = path[i]
        ps.counter[0] += 1
        rec[s, DATA] = ps.counter[0]
        if rec[s, NCHILD] == 0:
            hp.push(ps.heap, rec, s, 1 + rec[s, HITS], rec[s, DATA])


@implements(LFUState, "on_leaf")
def _lfu_leaf(ps, c, s):
    rec = c.rec
    if rec[s, PIN] == 0:
        hp.push(ps.heap, rec, s, 1 + rec[s, HITS], rec[s, DATA])


@implements(FIFOState, "on_insert")
def _fifo_insert(ps, c, s, now):
    ps.counter[0] += 1
    c.rec[s, DATA] = ps.counter[0]
    c.rec[s, hp.STAMP] = 0


@implements(FIFOState, "on_release")
def _fifo_release(ps, c, path, i0, i1, now):
    rec = c.rec
    for i in range(i1 - 1, i0 - 1, -1):
        s = path[i]
        if rec[s, NCHILD] == 0:
            hp.push(ps.heap, rec, s, rec[s, DATA], 0)


@implements(FIFOState, "on_leaf")
def _fifo_leaf(ps, c, s):
    rec = c.rec
    if rec[s, PIN] == 0:
        hp.push(ps.heap, rec, s, rec[s, DATA], 0)


@implements(LFUState, "on_insert")
def _lfu_insert(ps, c, s, now):
    c.rec[s, DATA] = -1  # not released yet
    c.rec[s, hp.STAMP] = 0


for _cls in (LFUState, FIFOState):
    implements(_cls, "on_acquire")(lambda ps, c, path, i0, i1: hp.acquire(c.rec, path, i0, i1))  # rec taken once
    implements(_cls, "evict")(lambda ps, c, now: hp.pop_valid(ps.heap, c.rec))


class _KeyedTwin(Twin):
    """A keyed policy: the heap from the stamps, plus one per-block number (in the row) and one counter."""

    state_class: type
    field: str  # the per-block number, as the policy exports it
    count: str  # the counter

    def heap_keys(self, n: int, core: Any) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        self.state = self.state_class(hp.new_heap(self.capacity), np.array([state[self.count]], np.int64))
        core.rec[:n, DATA] = state[self.field]
        a, b = self.heap_keys(n, core)
        hp.load_heap(self.state.heap, core.rec, n, state["stamp"], int(state["seq"]), a, b)

    def export(self, n: int, core: Any) -> dict[str, Any]:
        return {"stamp": core.rec[:n, hp.STAMP].astype(np.int64), "seq": int(self.state.heap.sc[hp.HSEQ]),
                self.field: core.rec[:n, DATA].astype(np.int64), self.count: int(self.state.counter[0])}


@register
class LFUTwin(_KeyedTwin):
    classes = (LFUPolicy,)
    state_class, field, count = LFUState, "released", "n_released"

    def heap_keys(self, n: int, core: Any) -> tuple[np.ndarray, np.ndarray]:
        return 1.0 + core.rec[:n, HITS], core.rec[:n, DATA].astype(np.float64)


@register
class FIFOTwin(_KeyedTwin):
    classes = (FIFOPolicy,)
    state_class, field, count = FIFOState, "inserted", "n_inserted"

    def heap_keys(self, n: int, core: Any) -> tuple[np.ndarray, np.ndarray]:
        return core.rec[:n, DATA].astype(np.float64), np.zeros(n)


# -- s3fifo ----------------------------------------------------------------------------------------------------------
# Scalars: S (head = oldest, tail, length), M (the same), S3-FIFO's ghost ring (tail, head, live).
SHEAD, STAIL, SLEN, MHEAD, MTAIL, MLEN, PGTAIL, PGHEAD, PGLIVE = range(9)
# Parameters: S's share in blocks, its ghost's size, the move-to-main threshold, the frequency cap.
SMALL_TARGET, GHOST_SIZE, MOVE_TO_MAIN, MAX_FREQ = range(4)
IN_S, IN_M, PARKED = 0, 1, 2  # where a slot is
QNEXT, WHERE, FREQ = P0, P1, P2  # in the slot's row: next in its queue, where it is, its frequency


class S3State(NamedTuple):
    sc: np.ndarray  # int64 scalars
    pp: np.ndarray  # int64 parameters
    pgid: np.ndarray  # int32 ghost ring of key ids
    pg_pos: np.ndarray  # int32 per key id: its position in the ring


@inline
def _q_push_back(rec, ps, s, head, tail, length):
    """Append slot ``s`` to a singly linked FIFO (S3-FIFO's queues are only ever popped at the head)."""
    rec[s, QNEXT] = -1
    t = ps.sc[tail]
    if t >= 0:
        rec[t, QNEXT] = s
    else:
        ps.sc[head] = s
    ps.sc[tail] = s
    ps.sc[length] += 1


@inline
def _q_push_front(rec, ps, s, head, tail, length):
    h = ps.sc[head]
    rec[s, QNEXT] = h
    ps.sc[head] = s
    if h < 0:
        ps.sc[tail] = s
    ps.sc[length] += 1


@inline
def _q_pop_front(rec, ps, head, tail, length):
    s = ps.sc[head]
    n = rec[s, QNEXT]
    ps.sc[head] = n
    if n < 0:
        ps.sc[tail] = -1
    ps.sc[length] -= 1
    return s


@inline
def _pg_take(ps, k):
    """S3-FIFO's ghost: if key id ``k`` is in it, remove it and return True (``key in _ghost: del``)."""
    p = ps.pg_pos[k]
    if ps.sc[PGTAIL] <= p < ps.sc[PGHEAD] and ps.pgid[p] == k:
        ps.pgid[p] = -1
        ps.sc[PGLIVE] -= 1
        return True
    return False


@jit
def _pg_squeeze(pgid, pg_pos, sc):
    w = 0
    for i in range(sc[PGTAIL], sc[PGHEAD]):
        g = pgid[i]
        if g >= 0:
            pgid[w] = g
            pg_pos[g] = w
            w += 1
    sc[PGTAIL] = 0
    sc[PGHEAD] = w


@inline
def _pg_add(ps, k):
    """S3-FIFO's ghost: append key id ``k``, dropping the oldest when it holds more than its size."""
    pgid, pg_pos, sc = ps.pgid, ps.pg_pos, ps.sc
    if sc[PGHEAD] == pgid.size:
        _pg_squeeze(pgid, pg_pos, sc)
    h = sc[PGHEAD]
    pgid[h] = k
    pg_pos[k] = h
    sc[PGHEAD] = h + 1
    sc[PGLIVE] += 1
    if sc[PGLIVE] > ps.pp[GHOST_SIZE]:
        ring_drop_oldest(pgid, sc, PGTAIL, PGLIVE)


@implements(S3State, "on_insert")
def _s3_insert(ps, c, s, now):
    rec = c.rec
    rec[s, FREQ] = 0
    if _pg_take(ps, rec[s, KEY]):
        rec[s, QUEUE] = MAIN
        rec[s, WHERE] = IN_M
        _q_push_back(rec, ps, s, MHEAD, MTAIL, MLEN)
    else:
        rec[s, QUEUE] = SMALL
        rec[s, WHERE] = IN_S
        _q_push_back(rec, ps, s, SHEAD, STAIL, SLEN)


@implements(S3State, "on_hit")
def _s3_hit(ps, c, path, i0, i1, now):
    rec = c.rec
    cap = ps.pp[MAX_FREQ]
    for i in range(i0, i1):
        s = path[i]
        if rec[s, FREQ] < cap:
            rec[s, FREQ] += 1


@implements(S3State, "on_leaf")
def _s3_leaf(ps, c, s):
    rec = c.rec
    if rec[s, WHERE] == PARKED:  # back, at M's oldest end
        rec[s, WHERE] = IN_M
        rec[s, QUEUE] = MAIN
        _q_push_front(rec, ps, s, MHEAD, MTAIL, MLEN)


@implements(S3State, "evict")
def _s3fifo_victim(ps, c, now):
    """S3FIFOPolicy.evict: the victim's slot (-1 if none), moving, parking and ageing blocks on the way."""
    rec, sc, pp = c.rec, ps.sc, ps.pp
    small_target = pp[SMALL_TARGET]
    budget = (pp[MAX_FREQ] + 2) * (sc[SLEN] + sc[MLEN]) + 1
    pinned_in_main = 0
    v = -1
    while budget > 0 and (sc[SLEN] > 0 or sc[MLEN] > 0):
        budget -= 1
        if sc[SLEN] > 0 and (sc[SLEN] >= small_target or sc[MLEN] == 0 or pinned_in_main >= sc[MLEN]):
            s = _q_pop_front(rec, ps, SHEAD, STAIL, SLEN)
            if rec[s, NCHILD] > 0:
                rec[s, QUEUE] = MAIN
                rec[s, WHERE] = PARKED
                continue
            if rec[s, FREQ] >= pp[MOVE_TO_MAIN] or rec[s, PIN] > 0:
                rec[s, QUEUE] = MAIN
                rec[s, WHERE] = IN_M
                _q_push_back(rec, ps, s, MHEAD, MTAIL, MLEN)
                continue
            _pg_add(ps, rec[s, KEY])
            v = s
            break
        s = _q_pop_front(rec, ps, MHEAD, MTAIL, MLEN)
        if rec[s, NCHILD] > 0:
            rec[s, WHERE] = PARKED
            continue
        if rec[s, PIN] > 0:
            _q_push_back(rec, ps, s, MHEAD, MTAIL, MLEN)
            pinned_in_main += 1
            continue
        pinned_in_main = 0
        if rec[s, FREQ] > 0:
            rec[s, FREQ] -= 1
            _q_push_back(rec, ps, s, MHEAD, MTAIL, MLEN)
            continue
        v = s
        break
    return v


@register
class S3FIFOTwin(Twin):
    classes = (S3FIFOPolicy,)

    @classmethod
    def reason(cls, policy: Any) -> str | None:
        if not all(float(getattr(policy, a)).is_integer() and getattr(policy, a) >= 0
                   for a in ("move_to_main", "max_freq")):
            return "s3fifo's move_to_main and max_freq must be whole numbers >= 0 for the compiled engine"
        return None

    def map_keys(self, state: dict[str, Any]) -> None:
        self._ghost_ids = self.keys.ids_of(state["ghost"])

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        ghost_ids = self._ghost_ids
        size = int(state["ghost_size"])
        pp = np.array([state["small_target"], size, int(self.policy.move_to_main), int(self.policy.max_freq)],
                      dtype=np.int64)
        ps = S3State(np.zeros(9, np.int64), pp, np.full(2 * size + 2, -1, np.int32),
                     np.full(len(self.keys), -1, np.int32))
        ps.sc[[SHEAD, STAIL, MHEAD, MTAIL]] = -1
        rec = core.rec
        rec[:n, FREQ] = state["freq"]
        for field, where, head, tail, length in (("small", IN_S, SHEAD, STAIL, SLEN),
                                                 ("main", IN_M, MHEAD, MTAIL, MLEN)):
            order = state[field]
            rec[order, WHERE] = where
            if order.size:
                rec[order[:-1], QNEXT] = order[1:]
                rec[order[-1], QNEXT] = -1
                ps.sc[head], ps.sc[tail], ps.sc[length] = order[0], order[-1], order.size
        rec[state["parked"], WHERE] = PARKED
        k = ghost_ids.size
        ps.pgid[:k] = ghost_ids
        ps.pg_pos[ghost_ids] = np.arange(k, dtype=np.int32)
        ps.sc[PGHEAD] = ps.sc[PGLIVE] = k
        self.state = ps

    def export(self, n: int, core: Any) -> dict[str, Any]:
        ps, rec = self.state, core.rec
        out: dict[str, Any] = {}
        for field, head in (("small", SHEAD), ("main", MHEAD)):
            order, s = [], int(ps.sc[head])
            while s >= 0:
                order.append(s)
                s = int(rec[s, QNEXT])
            out[field] = np.array(order, dtype=np.int64)
        g = ps.pgid[ps.sc[PGTAIL]:ps.sc[PGHEAD]]
        out.update(parked=np.flatnonzero(rec[:n, WHERE] == PARKED), freq=rec[:n, FREQ].astype(np.int64),
                   ghost=self.keys.uniq[g[g >= 0]], small_target=int(ps.pp[SMALL_TARGET]),
                   ghost_size=int(ps.pp[GHOST_SIZE]))
        return out

    def occupancy_by_queue(self, n: int) -> dict[int, int]:
        # As S3FIFOPolicy.occupancy_by_queue: S and M (parked blocks count in M), even when empty.
        s = int(self.state.sc[SLEN])
        return {SMALL: s, MAIN: n - s}
