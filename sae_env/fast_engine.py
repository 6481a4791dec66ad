"""FastEngine: the instant-mode replay of the baselines ``lru``, ``lfu``, ``fifo`` and ``s3fifo``, compiled.

:class:`~sae_env.replay.Replay` uses this engine by itself when it applies (instant mode, one of these four policy
classes exactly (s3fifo with whole-number ``move_to_main`` and ``max_freq``), a fresh cache, no per-request
invariant checks, numba importable); ``engine="python"`` forces the generic loop. The engine is the same algorithm
as :meth:`sae_env.cache.PrefixCache.serve` with the policy's hooks inlined, over numeric arrays instead of
:class:`~sae_env.cache.Block` objects, so that numba can compile it:

* **Dense ids.** Every prompt and output key of the trace is mapped once to a dense id (first-seen order, an
  open-addressing hash table), and a request that names one key twice is detected there (the engine then declines:
  the Python loop's behaviour on such a request is not worth mirroring).
* **Slots.** The cache holds at most ``capacity`` blocks in slots ``0..capacity-1`` (key id, parent slot, number of
  cached children, type, pin, hits, last access, and the policy's fields); ``slot_of[id]`` is the block's slot,
  ``-1`` if the key is not cached, ``-2 - p`` if it is a ghost at position ``p`` of the ghost ring. Memory is
  therefore O(capacity) per cached block plus 12 bytes per distinct key.
* **Per request** (exactly :meth:`PrefixCache.serve`): the hit is the longest run of leading prompt keys that are
  cached (each hit block pinned, ``hits += 1``, ``last_access = now``; the policy's ``on_acquire``); the missing
  prompt blocks are inserted one by one after the hit (a cached key whose parent is not the previous block stops
  the run; a key among the ghosts counts a miss after eviction, by its ghost's type, before any eviction; a full
  cache evicts one victim first; no victim = the rest of the run is bypassed and counted); when ``cache_outputs``
  and the whole prompt is cached, the output blocks follow the same way; finally the request's blocks are released
  deepest first (``on_release``).
* **Eviction** of a victim: forget it, count it, decrement its parent's children (``on_leaf`` when that reaches 0)
  and push its key into the bounded ghost record (oldest dropped first), exactly as ``PrefixCache._evict_one``.
* **Policies**, as in :mod:`sae_env.policies`:
  ``lru`` is vLLM's free queue: a doubly linked list of unpinned blocks in release order (a request's blocks are
  released deepest first); eviction takes the first leaf from the head. ``lfu`` and ``fifo`` are
  :class:`~sae_env.policies.base.KeyedPolicy` heaps with lazy deletion: an entry ``(a, b, seq, slot)`` is valid
  while the slot's ``stamp`` equals ``seq``; the key is ``(1 + hits, release order)`` for ``lfu`` and
  ``(insertion order, 0)`` for ``fifo``, fixed when the block becomes evictable; ``seq`` counts pushes exactly as
  ``KeyedPolicy._seq`` does, so ties break identically. Stale entries are squeezed out when the heap array is full,
  which changes no pop order (pops follow the total order of ``(a, b, seq)``).
  ``s3fifo`` keeps its small and main FIFOs as singly linked lists (they are popped only at the oldest end; a
  block returning from the parked set goes to the oldest end of M), the frequency in ``PDATA``, the queue (S, M or
  parked) in ``QUEUE``, and its own ghost of keys evicted from S as a ring with lazy deletion like the cache's
  ghost record; :func:`_s3fifo_victim` is ``S3FIFOPolicy.evict`` line for line, budget included.

Equivalence: every window's statistics (hits per request, evictions, bypasses, insertions, misses after eviction
by type and queue, occupancy by type and queue) equal the Python engine's exactly, which
``tests/test_fast_engine.py`` checks hit for hit. :meth:`FastEngine.hand_over` rebuilds the Python cache, ghosts
and policy state from the arrays (blocks, parents, depths, pins, hits, last access, stamps, release / insertion
orders, LRU queue order, valid heap entries, S3-FIFO's queues, frequencies, parked set and ghost, ghost order), so
that a replay can continue on the Python engine from any window boundary; only the iteration order of
``PrefixCache.blocks`` (a plain dict, which no decision depends on) differs.

numba is optional (``pip install saecache-gym[fast]``): without it :data:`AVAILABLE` is False and the replay falls
back to the Python engine.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sae_env.trace import N_TOKEN_TYPES, Trace

if TYPE_CHECKING:
    from sae_env.cache import PrefixCache

try:  # an optional dependency: the replay falls back to the Python engine without it
    import numba

    AVAILABLE = True
    _jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    # Helpers are inlined into the kernels: a call that passes arrays costs reference-count updates, which
    # measured here tripled the cost of an LRU update.
    _inline = numba.njit(inline="always", boundscheck=False)
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    AVAILABLE = False

    def _jit(f):
        return f

    _inline = _jit

__all__ = ["AVAILABLE", "FastEngine", "WindowCounts", "policy_code", "unsupported_reason"]

# Policy codes of the kernel.
LRU, LFU, FIFO, S3FIFO = 0, 1, 2, 3

# Columns of a slot's record: one int32 row of 16 (64 bytes, one cache line) holds everything a block needs, so
# that touching a block costs one memory access. Every count fits 32 bits: the engine declines traces of 2**30
# references or more (hits, pushes, releases and insertions are bounded by twice the references).
KEY, PARENT, NCHILD, PREV, NEXT, HITS, STAMP, PDATA, LASTREQ, BTYPE, PIN, QUEUE = range(12)
RECORD = 16
MAX_REFS = 2**30
# Scalars: cached blocks, LRU free-list head and tail, heap size, pushes (KeyedPolicy._seq), the policy's counter
# (LFU releases / FIFO insertions), ghost ring tail (oldest) and head (next free position), live ghosts; then
# S3-FIFO's small queue S and main queue M (head = oldest, tail, length) and its own ghost ring (tail, head, live).
N, HEAD, TAIL, HSIZE, SEQ, COUNTER, GTAIL, GHEAD, GLIVE = range(9)
SHEAD, STAIL, SLEN, MHEAD, MTAIL, MLEN, PGTAIL, PGHEAD, PGLIVE = range(9, 18)
N_SCALARS = 18
# S3-FIFO's parameters (``pp``): S's share in blocks, its ghost's size, the move-to-main threshold, the frequency cap.
SMALL_TARGET, GHOST_SIZE, MOVE_TO_MAIN, MAX_FREQ = range(4)
# A block's QUEUE column under S3-FIFO: S, M, or parked outside the queues (it has cached children; its queue id
# is M's, as in the Python policy).
Q_SMALL, Q_MAIN, Q_PARKED = 0, 1, 2
# Window counters: evictions, bypasses, insertions, misses after eviction per TokenType, then per queue id (the
# ghost record keeps ``queue * 8 + type`` per key, as PrefixCache.ghosts does), then those on output blocks.
EVICTIONS, BYPASSES, INSERTED, MAE = 0, 1, 2, 3
MAEQ = MAE + N_TOKEN_TYPES
N_QUEUE_IDS = 8
MAEO = MAEQ + N_QUEUE_IDS


class WindowCounts(NamedTuple):
    """One window's counters, as :class:`~sae_env.cache.PrefixCache` keeps them."""

    evictions: int
    bypasses: int
    inserted: int
    mae_by_type: list[int]  # misses after eviction per TokenType
    mae_by_queue: dict[int, int]  # misses after eviction per queue id (only the queues that had one)
    mae_output: int  # misses after eviction on output blocks


def policy_code(policy: object) -> int | None:
    """The kernel's code for ``policy`` if it is exactly one of the supported classes (subclasses may override
    hooks the kernel does not call), else None."""
    from sae_env.policies.fifo import FIFOPolicy
    from sae_env.policies.lfu import LFUPolicy
    from sae_env.policies.lru import LRUPolicy
    from sae_env.policies.s3fifo import S3FIFOPolicy

    return {LRUPolicy: LRU, LFUPolicy: LFU, FIFOPolicy: FIFO, S3FIFOPolicy: S3FIFO}.get(type(policy))


def unsupported_reason(cache: PrefixCache) -> str | None:
    """Why the fast engine cannot run ``cache`` (and its policy), or None if it can (the trace is checked later)."""
    if not AVAILABLE:
        return "numba is not installed (pip install 'saecache-gym[fast]')"
    policy = cache.policy
    if policy_code(policy) is None:
        return (f"policy {policy.name!r} ({type(policy).__name__}) has no compiled engine (only lru, lfu, fifo, "
                "s3fifo)")
    if cache.observer is not None:
        return "the cache has an observer (the compiled engine reports no per-block events)"
    if len(cache.blocks) or cache.ghosts:
        return "the cache is not fresh (it already holds blocks or ghosts)"
    if any(getattr(policy, a, None) for a in ("_seq", "_free", "_small", "_main", "_ghost", "_parked")):
        return "the policy is not fresh"
    if policy_code(policy) == S3FIFO and not all(float(getattr(policy, a)).is_integer() and getattr(policy, a) >= 0
                                                 for a in ("move_to_main", "max_freq")):
        return "s3fifo's move_to_main and max_freq must be whole numbers >= 0 for the compiled engine"
    if cache.capacity >= MAX_REFS or cache.ghost_capacity >= MAX_REFS:
        return "the capacity does not fit 32-bit slot numbers"
    return None


# -- kernels -----------------------------------------------------------------------------------------------------
@_inline
def _dense_id(table, k, uniq, last_req, d):
    """The dense id of key ``k`` (``d`` if new: then stored); returns (id, number of ids)."""
    mask = table.shape[0] - 1
    # Fibonacci hashing (unsigned, wrapping): small consecutive ids spread over the table too.
    h = np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)
    i = np.int64(h >> np.uint64(24)) & mask
    while True:
        t = table[i, 1]
        if t < 0:
            table[i, 0] = k
            table[i, 1] = d
            uniq[d] = k
            last_req[d] = -1
            return d, d + 1
        if table[i, 0] == k:
            return t, d
        i = (i + 1) & mask


@_jit
def _dense_ids(pk, po, ok, oo, table, ids, uniq, last_req):
    """Map keys to dense ids in first-seen order: ``ids`` gets the prompt references' ids, then the outputs'.

    ``table``: open addressing, rows (key, id), id -1 = empty; it must hold the trace's distinct keys at a load
    factor below 1. Returns (distinct keys, whether a request names a key twice).
    """
    d = 0
    dup = False
    n_pr = pk.size
    for r in range(po.size - 1):
        # Only a request of two or more blocks can repeat a key: single-block streams skip that random access.
        multi = po[r + 1] - po[r] + oo[r + 1] - oo[r] > 1
        for x in range(po[r], po[r + 1]):
            t, d = _dense_id(table, pk[x], uniq, last_req, d)
            if multi:
                dup |= last_req[t] == r
                last_req[t] = r
            ids[x] = t
        for x in range(oo[r], oo[r + 1]):
            t, d = _dense_id(table, ok[x], uniq, last_req, d)
            if multi:
                dup |= last_req[t] == r
                last_req[t] = r
            ids[n_pr + x] = t
    return d, dup


@_inline
def _lru_unlink(rec, sc, s):
    p = rec[s, PREV]
    n = rec[s, NEXT]
    if p >= 0:
        rec[p, NEXT] = n
    else:
        sc[HEAD] = n
    if n >= 0:
        rec[n, PREV] = p
    else:
        sc[TAIL] = p


@_inline
def _lru_append(rec, sc, s):
    t = sc[TAIL]
    rec[s, PREV] = t
    rec[s, NEXT] = -1
    if t >= 0:
        rec[t, NEXT] = s
    else:
        sc[HEAD] = s
    sc[TAIL] = s


@_inline
def _q_push_back(rec, sc, s, head, tail, length):
    """Append slot ``s`` to a singly linked FIFO (S3-FIFO's queues are only ever popped at the head)."""
    rec[s, NEXT] = -1
    t = sc[tail]
    if t >= 0:
        rec[t, NEXT] = s
    else:
        sc[head] = s
    sc[tail] = s
    sc[length] += 1


@_inline
def _q_push_front(rec, sc, s, head, tail, length):
    h = sc[head]
    rec[s, NEXT] = h
    sc[head] = s
    if h < 0:
        sc[tail] = s
    sc[length] += 1


@_inline
def _q_pop_front(rec, sc, head, tail, length):
    s = sc[head]
    n = rec[s, NEXT]
    sc[head] = n
    if n < 0:
        sc[tail] = -1
    sc[length] -= 1
    return s


@_inline
def _ring_drop_oldest(ring, sc, tail, live):
    """Drop the oldest live entry of a ghost ring (entries of keys that came back are -1)."""
    t = sc[tail]
    while ring[t] < 0:
        t += 1
    ring[t] = -1
    sc[tail] = t + 1
    sc[live] -= 1


@_inline
def _pg_take(pgid, pg_pos, sc, k):
    """S3-FIFO's ghost: if key id ``k`` is in it, remove it and return True (``key in _ghost: del``)."""
    p = pg_pos[k]
    if sc[PGTAIL] <= p < sc[PGHEAD] and pgid[p] == k:
        pgid[p] = -1
        sc[PGLIVE] -= 1
        return True
    return False


@_inline
def _pg_add(pgid, pg_pos, sc, k, size):
    """S3-FIFO's ghost: append key id ``k``, dropping the oldest when it holds more than ``size``. A ring with lazy
    deletion, as the cache's ghost record: an entry is live while ``pg_pos`` of its key names it."""
    if sc[PGHEAD] == pgid.size:
        w = 0
        for i in range(sc[PGTAIL], sc[PGHEAD]):
            g = pgid[i]
            if g >= 0:
                pgid[w] = g
                pg_pos[g] = w
                w += 1
        sc[PGTAIL] = 0
        sc[PGHEAD] = w
    h = sc[PGHEAD]
    pgid[h] = k
    pg_pos[k] = h
    sc[PGHEAD] = h + 1
    sc[PGLIVE] += 1
    if sc[PGLIVE] > size:
        _ring_drop_oldest(pgid, sc, PGTAIL, PGLIVE)


@_inline
def _s3fifo_victim(rec, sc, pp, pgid, pg_pos):
    """S3FIFOPolicy.evict: the victim's slot (-1 if none), moving, parking and ageing blocks on the way."""
    small_target = pp[SMALL_TARGET]
    budget = (pp[MAX_FREQ] + 2) * (sc[SLEN] + sc[MLEN]) + 1
    pinned_in_main = 0
    while budget > 0 and (sc[SLEN] > 0 or sc[MLEN] > 0):
        budget -= 1
        if sc[SLEN] > 0 and (sc[SLEN] >= small_target or sc[MLEN] == 0 or pinned_in_main >= sc[MLEN]):
            s = _q_pop_front(rec, sc, SHEAD, STAIL, SLEN)
            if rec[s, NCHILD] > 0:
                rec[s, QUEUE] = Q_PARKED
                continue
            if rec[s, PDATA] >= pp[MOVE_TO_MAIN] or rec[s, PIN] > 0:
                rec[s, QUEUE] = Q_MAIN
                _q_push_back(rec, sc, s, MHEAD, MTAIL, MLEN)
                continue
            _pg_add(pgid, pg_pos, sc, rec[s, KEY], pp[GHOST_SIZE])
            return s
        s = _q_pop_front(rec, sc, MHEAD, MTAIL, MLEN)
        if rec[s, NCHILD] > 0:
            rec[s, QUEUE] = Q_PARKED
            continue
        if rec[s, PIN] > 0:
            _q_push_back(rec, sc, s, MHEAD, MTAIL, MLEN)
            pinned_in_main += 1
            continue
        pinned_in_main = 0
        if rec[s, PDATA] > 0:
            rec[s, PDATA] -= 1
            _q_push_back(rec, sc, s, MHEAD, MTAIL, MLEN)
            continue
        return s
    return -1


@_inline
def _heap_less(hq, i, j):
    if hq[i, 0] != hq[j, 0]:
        return hq[i, 0] < hq[j, 0]
    if hq[i, 1] != hq[j, 1]:
        return hq[i, 1] < hq[j, 1]
    return hq[i, 2] < hq[j, 2]


@_inline
def _heap_swap(hq, i, j):
    for f in range(4):
        x = hq[i, f]
        hq[i, f] = hq[j, f]
        hq[j, f] = x


@_inline
def _heap_down(hq, i, size):
    while True:
        c = 2 * i + 1
        if c >= size:
            return
        if c + 1 < size and _heap_less(hq, c + 1, c):
            c += 1
        if not _heap_less(hq, c, i):
            return
        _heap_swap(hq, i, c)
        i = c


@_inline
def _heap_push(hq, rec, sc, s, code):
    """KeyedPolicy._push: a new entry for slot ``s``, keyed now; squeezes stale entries out when the array is full."""
    size = sc[HSIZE]
    if size == hq.shape[0]:
        # At most one valid entry per cached block and the array holds 2 * capacity + 2: after the squeeze at least
        # half is free, so this costs O(1) per push, amortised.
        w = 0
        for i in range(size):
            if rec[hq[i, 3], STAMP] == hq[i, 2]:
                for f in range(4):
                    hq[w, f] = hq[i, f]
                w += 1
        size = w
        for i in range(size // 2 - 1, -1, -1):
            _heap_down(hq, i, size)
    sc[SEQ] += 1
    seq = sc[SEQ]
    rec[s, STAMP] = seq
    if code == LFU:
        hq[size, 0] = 1 + rec[s, HITS]
        hq[size, 1] = rec[s, PDATA]
    else:
        hq[size, 0] = rec[s, PDATA]
        hq[size, 1] = 0
    hq[size, 2] = seq
    hq[size, 3] = s
    i = size
    size += 1
    while i > 0:  # sift up
        p = (i - 1) // 2
        if not _heap_less(hq, i, p):
            break
        _heap_swap(hq, i, p)
        i = p
    sc[HSIZE] = size


@_inline
def _evict(rec, sc, hq, slot_of, gid, gty, cnt, occ, code, ghost_cap, pp, pgid, pg_pos):
    """Choose and remove a victim (policy.evict + PrefixCache._evict_one); returns its slot, -1 if none."""
    v = -1
    if code == S3FIFO:
        v = _s3fifo_victim(rec, sc, pp, pgid, pg_pos)
    elif code == LRU:
        s = sc[HEAD]
        while s >= 0:
            if rec[s, NCHILD] == 0:
                _lru_unlink(rec, sc, s)
                v = s
                break
            s = rec[s, NEXT]
    else:
        while sc[HSIZE] > 0:
            size = sc[HSIZE] - 1
            s = hq[0, 3]
            seq = hq[0, 2]
            for f in range(4):
                hq[0, f] = hq[size, f]
            sc[HSIZE] = size
            _heap_down(hq, 0, size)
            if rec[s, STAMP] == seq:
                rec[s, STAMP] = 0
                v = s
                break
    if v < 0:
        return -1
    key = rec[v, KEY]
    slot_of[key] = -1
    sc[N] -= 1
    occ[rec[v, BTYPE]] -= 1
    p = rec[v, PARENT]
    if p >= 0:
        rec[p, NCHILD] -= 1
        if rec[p, NCHILD] == 0:
            if code == S3FIFO:
                if rec[p, QUEUE] == Q_PARKED:  # S3FIFOPolicy.on_leaf: back, at M's oldest end
                    rec[p, QUEUE] = Q_MAIN
                    _q_push_front(rec, sc, p, MHEAD, MTAIL, MLEN)
            elif code != LRU and rec[p, PIN] == 0:
                _heap_push(hq, rec, sc, p, code)  # KeyedPolicy.on_leaf (LRU's queue already holds it)
    cnt[EVICTIONS] += 1
    if ghost_cap > 0:
        if sc[GHEAD] == gid.size:
            # Squeeze out the entries of keys that came back or were dropped (live ghosts <= ghost_cap, the ring
            # holds 2 * ghost_cap + 2): amortised O(1).
            w = 0
            for i in range(sc[GTAIL], sc[GHEAD]):
                g = gid[i]
                if g >= 0:
                    gid[w] = g
                    gty[w] = gty[i]
                    slot_of[g] = -2 - w
                    w += 1
            sc[GTAIL] = 0
            sc[GHEAD] = w
        h = sc[GHEAD]
        gid[h] = key
        gty[h] = rec[v, QUEUE] * 8 + rec[v, BTYPE] if code == S3FIFO else rec[v, BTYPE]
        slot_of[key] = -2 - h
        sc[GHEAD] = h + 1
        sc[GLIVE] += 1
        if sc[GLIVE] > ghost_cap:
            # Its key's slot_of still points into the ring, but a ghost is recognised only where the ring entry
            # in the live window names the key: one random write fewer per eviction.
            _ring_drop_oldest(gid, sc, GTAIL, GLIVE)
    return v


@_jit
def _run_window(a, b, po, oo, n_pr, ids, types, cache_outputs, code, capacity, ghost_cap, rec, sc, hq,
                slot_of, gid, gty, occ, cnt, hits_out, path, pp, pgid, pg_pos):
    """Serve requests ``a..b-1`` (PrefixCache.serve each); fills ``hits_out`` and the window counters ``cnt``.

    ``ids`` / ``types``: the prompt references, then the output references (request ``j``'s outputs at
    ``n_pr + oo[j]``), so that one loop body inserts both runs.
    """
    for j in range(a, b):
        s0 = po[j]
        e0 = po[j + 1]
        n_prompt = e0 - s0
        plen = 0
        for x in range(s0, e0):
            s = slot_of[ids[x]]
            if s < 0:
                break
            rec[s, PIN] = 1
            rec[s, LASTREQ] = j
            rec[s, HITS] += 1
            path[plen] = s
            plen += 1
        n_hit = plen
        for i in range(n_hit):
            if code == LRU:  # on_acquire: no longer evictable
                _lru_unlink(rec, sc, path[i])
            elif code == S3FIFO:  # on_hit: frequency + 1, capped (S3-FIFO keeps pinned blocks in their queue)
                if rec[path[i], PDATA] < pp[MAX_FREQ]:
                    rec[path[i], PDATA] += 1
            else:
                rec[path[i], STAMP] = 0
        for part in range(2):  # PrefixCache._insert_run: the missing prompt blocks, then the outputs
            if part == 0:
                x0 = s0 + n_hit
                x1 = e0
            elif cache_outputs and plen == n_prompt:
                x0 = n_pr + oo[j]
                x1 = n_pr + oo[j + 1]
            else:
                break
            parent = path[plen - 1] if plen > 0 else -1
            for x in range(x0, x1):
                k = ids[x]
                s = slot_of[k]
                if s >= 0:
                    # Only possible for an output key that another request cached: share it (a hit for the block).
                    if rec[s, PARENT] != parent:
                        break  # a different chain reached the same key: stop rather than corrupt
                    if code == S3FIFO:
                        if rec[s, PDATA] < pp[MAX_FREQ]:
                            rec[s, PDATA] += 1
                    elif rec[s, PIN] == 0:
                        if code == LRU:
                            _lru_unlink(rec, sc, s)
                        else:
                            rec[s, STAMP] = 0
                    rec[s, PIN] = 1
                    rec[s, LASTREQ] = j
                    rec[s, HITS] += 1
                    path[plen] = s
                    plen += 1
                    parent = s
                    continue
                if s <= -2:
                    g = -2 - s
                    if sc[GTAIL] <= g < sc[GHEAD] and gid[g] == k:
                        # A ghost: looked up before evicting, which could push it out of a full ghost record.
                        cnt[MAE + (gty[g] & 7)] += 1
                        cnt[MAEQ + (gty[g] >> 3)] += 1
                        if part == 1:
                            cnt[MAEO] += 1
                        gid[g] = -1
                        sc[GLIVE] -= 1
                if sc[N] >= capacity:
                    s = _evict(rec, sc, hq, slot_of, gid, gty, cnt, occ, code, ghost_cap, pp, pgid, pg_pos)
                    if s < 0:
                        slot_of[k] = -1
                        cnt[BYPASSES] += x1 - x
                        break
                else:
                    s = sc[N]  # slots 0..N-1 are in use between requests; an eviction frees the slot reused here
                sc[N] += 1
                t = types[x]
                slot_of[k] = s
                rec[s, KEY] = k
                rec[s, PARENT] = parent
                rec[s, NCHILD] = 0
                rec[s, BTYPE] = t
                rec[s, PIN] = 1
                rec[s, HITS] = 0
                rec[s, STAMP] = 0
                rec[s, LASTREQ] = j
                if code == FIFO:
                    sc[COUNTER] += 1
                    rec[s, PDATA] = sc[COUNTER]
                elif code == S3FIFO:  # on_insert: to M if its key is in S3-FIFO's ghost, else to S
                    rec[s, PDATA] = 0
                    if _pg_take(pgid, pg_pos, sc, k):
                        rec[s, QUEUE] = Q_MAIN
                        _q_push_back(rec, sc, s, MHEAD, MTAIL, MLEN)
                    else:
                        rec[s, QUEUE] = Q_SMALL
                        _q_push_back(rec, sc, s, SHEAD, STAIL, SLEN)
                occ[t] += 1
                if parent >= 0:
                    rec[parent, NCHILD] += 1
                path[plen] = s
                plen += 1
                parent = s
                cnt[INSERTED] += 1
        # on_release, deepest first
        for i in range(plen - 1, -1, -1):
            s = path[i]
            rec[s, PIN] = 0
            if code == S3FIFO:
                continue
            if code == LRU:
                _lru_append(rec, sc, s)
            else:
                if code == LFU:
                    sc[COUNTER] += 1
                    rec[s, PDATA] = sc[COUNTER]
                if rec[s, NCHILD] == 0:
                    _heap_push(hq, rec, sc, s, code)
        hits_out[j - a] = n_hit


# -- the engine ----------------------------------------------------------------------------------------------------
class FastEngine:
    """Compiled instant-mode state of one replay: see the module docstring.

    Build it with :meth:`build` (None when the trace names a key twice within a request or is too large), then
    call :meth:`run_window` for consecutive windows.
    """

    def __init__(self, code: int, capacity: int, ghost_capacity: int, cache_outputs: bool, trace: Trace,
                 ids: np.ndarray, uniq: np.ndarray, max_path: int,
                 s3fifo_params: tuple[int, int, int, int] | None = None):
        self.code = code
        self.capacity = capacity
        self.ghost_capacity = max(0, ghost_capacity)
        self.cache_outputs = bool(cache_outputs)
        self.trace = trace
        # Dense ids and types of the prompt references, then of the output references.
        self.ids, self.uniq = ids, uniq
        self.types = np.concatenate([trace.prompt_types, trace.output_types])
        c = capacity
        self.rec = np.zeros((c, RECORD), dtype=np.int32)
        self.sc = np.zeros(N_SCALARS, dtype=np.int64)
        self.sc[HEAD] = self.sc[TAIL] = -1
        # Valid heap entries <= capacity; twice that keeps squeezes rare (lru needs no heap).
        self.hq = np.zeros((2 * c + 2 if code in (LFU, FIFO) else 1, 4), dtype=np.int32)
        self.slot_of = np.full(uniq.size, -1, dtype=np.int32)
        self.sc[[SHEAD, STAIL, MHEAD, MTAIL]] = -1
        # S3-FIFO: its parameters, its ghost ring (twice its size, as the cache's) and each key's position there.
        self.pp = np.array(s3fifo_params if code == S3FIFO else (0, 0, 0, 0), dtype=np.int64)
        self.pgid = np.full(2 * s3fifo_params[GHOST_SIZE] + 2 if code == S3FIFO else 1, -1, dtype=np.int32)
        self.pg_pos = np.full(uniq.size if code == S3FIFO else 1, -1, dtype=np.int32)
        g = 2 * self.ghost_capacity + 2 if self.ghost_capacity else 1
        self.gid = np.full(g, -1, dtype=np.int32)
        self.gty = np.zeros(g, dtype=np.uint8)
        self.occ = np.zeros(N_TOKEN_TYPES, dtype=np.int64)
        self.cnt = np.zeros(MAEO + 1, dtype=np.int64)
        self.path = np.zeros(max(1, max_path), dtype=np.int32)

    @classmethod
    def build(cls, trace: Trace, cache: PrefixCache) -> FastEngine | None:
        """The engine for replaying ``trace`` through ``cache`` (checked by :func:`unsupported_reason` first), or
        None if a request of the trace names one key twice or the trace has ``MAX_REFS`` references or more."""
        code = policy_code(cache.policy)
        if code is None:
            raise ValueError(f"policy {cache.policy.name!r} has no compiled engine")
        n = trace.n_blocks + trace.n_output_blocks
        if n >= MAX_REFS or len(trace) >= MAX_REFS:
            return None
        d = trace.distinct_blocks()  # a sort: sizes the table for the distinct keys, not the references
        table = np.full((1 << max(4, int(2 * d).bit_length()), 2), -1, dtype=np.int64)  # load factor < 1/2
        ids = np.empty(n, dtype=np.int32)
        uniq = np.empty(d, dtype=np.int64)
        found, dup = _dense_ids(trace.prompt_keys, trace.prompt_offsets, trace.output_keys, trace.output_offsets,
                                table, ids, uniq, np.empty(d, dtype=np.int64))
        del table
        if found != d:
            raise RuntimeError(f"dense ids: {found} distinct keys found, the trace counts {d}")
        if dup:
            return None
        lens = np.diff(trace.prompt_offsets) + np.diff(trace.output_offsets)
        max_path = int(lens.max()) if lens.size else 0
        pol = cache.policy
        pp = (pol._small_target, pol._ghost_size, int(pol.move_to_main), int(pol.max_freq)) if code == S3FIFO else None
        return cls(code, cache.capacity, cache.ghost_capacity, cache.cache_outputs, trace, ids, uniq, max_path, pp)

    # -- replay --------------------------------------------------------------------------------------------------
    def run_window(self, a: int, b: int) -> tuple[np.ndarray, WindowCounts]:
        """Serve requests ``a..b-1``; returns the hit blocks per request and the window's counters."""
        tr = self.trace
        hits = np.empty(b - a, dtype=np.int64)
        cnt = self.cnt
        cnt[:] = 0
        _run_window(a, b, tr.prompt_offsets, tr.output_offsets, tr.n_blocks, self.ids, self.types, self.cache_outputs,
                    self.code, self.capacity, self.ghost_capacity, self.rec, self.sc, self.hq, self.slot_of, self.gid,
                    self.gty, self.occ, cnt, hits, self.path, self.pp, self.pgid, self.pg_pos)
        by_queue = cnt[MAEQ:MAEO].tolist()
        return hits, WindowCounts(int(cnt[EVICTIONS]), int(cnt[BYPASSES]), int(cnt[INSERTED]), cnt[MAE:MAEQ].tolist(),
                                  {q: c for q, c in enumerate(by_queue) if c}, int(cnt[MAEO]))

    def occupancy_by_queue(self) -> dict[int, int]:
        """As the policy's ``occupancy_by_queue``: S3-FIFO reports S and M (parked blocks count in M), even when
        empty; the others hold every block in queue 0."""
        n = len(self)
        if self.code == S3FIFO:
            return {Q_SMALL: int(self.sc[SLEN]), Q_MAIN: n - int(self.sc[SLEN])}
        return {0: n} if n else {}

    def __len__(self) -> int:
        return int(self.sc[N])

    @property
    def occupancy_by_type(self) -> list[int]:
        return self.occ.tolist()

    @property
    def nbytes(self) -> int:
        """Bytes of the cache state (slot records, heap, ghosts, per-key slot and key arrays; not the per-reference
        ids and types, which belong to the trace)."""
        return sum(a.nbytes for a in (self.rec, self.sc, self.hq, self.slot_of, self.gid, self.gty, self.occ,
                                      self.cnt, self.path, self.uniq, self.pp, self.pgid, self.pg_pos))

    # -- back to Python ------------------------------------------------------------------------------------------
    def hand_over(self, cache: PrefixCache) -> None:
        """Rebuild ``cache`` (fresh, as given to the replay) and its policy from the arrays, between windows, so
        that the Python engine continues exactly where this one stopped."""
        from sae_env.cache import Block, GhostRecord

        if len(cache.blocks) or cache.ghosts:
            raise RuntimeError("the cache was changed while the fast engine held its state")
        n = len(self)
        rec = self.rec[:n]
        if rec[:, PIN].any():
            raise RuntimeError("a block is pinned between windows")
        parent = rec[:, PARENT].tolist()
        # Depth = distance from the root (PrefixCache inserts a root at depth 0 and a child at its parent's + 1).
        depth = [-1] * n
        for s in range(n):
            chain = []
            x = s
            while x >= 0 and depth[x] < 0:
                chain.append(x)
                x = parent[x]
            d = depth[x] if x >= 0 else -1
            for y in reversed(chain):
                d += 1
                depth[y] = d
        keys = self.uniq[rec[:, KEY]].tolist()
        lasts = self.trace.t[rec[:, LASTREQ]].tolist()
        types, hits, nchild = rec[:, BTYPE].tolist(), rec[:, HITS].tolist(), rec[:, NCHILD].tolist()
        queues = np.minimum(rec[:, QUEUE], Q_MAIN).tolist() if self.code == S3FIFO else [0] * n
        stamps, pdata = rec[:, STAMP].tolist(), rec[:, PDATA].tolist()
        blocks: list[Block | None] = [None] * n
        for s in sorted(range(n), key=depth.__getitem__):  # parents first
            b = Block(keys[s], blocks[parent[s]] if parent[s] >= 0 else None, depth[s], types[s], lasts[s])
            b.n_children = nchild[s]
            b.hits = hits[s]
            b.queue = queues[s]
            if self.code == S3FIFO:
                b.pdata = pdata[s]  # the frequency
            elif self.code != LRU:
                b.stamp = stamps[s]
                b.pdata = pdata[s]  # LFU: every cached block was released at least once
            blocks[s] = b
        cache.blocks = {b.key: b for b in blocks}
        cache.occupancy_by_type = self.occ.tolist()
        lo, hi = int(self.sc[GTAIL]), int(self.sc[GHEAD])
        cache.ghosts = GhostRecord(cache.ghost_capacity)
        for g, t in zip(self.gid[lo:hi].tolist(), self.gty[lo:hi].tolist(), strict=True):
            if g >= 0:
                cache.ghosts.add(int(self.uniq[g]), int(t))
        cache.reset_counters()
        policy = cache.policy
        if self.code == LRU:
            free: OrderedDict[int, Block] = OrderedDict()
            s = int(self.sc[HEAD])
            while s >= 0:
                free[blocks[s].key] = blocks[s]
                s = int(self.rec[s, NEXT])
            policy._free = free
        elif self.code == S3FIFO:
            for head, queue in ((SHEAD, policy._small), (MHEAD, policy._main)):
                s = int(self.sc[head])
                while s >= 0:
                    queue[blocks[s].key] = blocks[s]
                    s = int(self.rec[s, NEXT])
            policy._parked = {blocks[s].key: blocks[s] for s in np.flatnonzero(rec[:, QUEUE] == Q_PARKED).tolist()}
            lo, hi = int(self.sc[PGTAIL]), int(self.sc[PGHEAD])
            policy._ghost = OrderedDict((int(self.uniq[g]), None) for g in self.pgid[lo:hi].tolist() if g >= 0)
        else:
            heap = []
            for a_, b_, seq, s in self.hq[:self.sc[HSIZE]].tolist():
                if stamps[s] == seq:
                    heap.append(((a_, b_) if self.code == LFU else a_, seq, blocks[s]))
            heapq.heapify(heap)
            policy._heap = heap
            policy._seq = int(self.sc[SEQ])
            if self.code == LFU:
                policy._released = int(self.sc[COUNTER])
            else:
                policy._inserted = int(self.sc[COUNTER])
