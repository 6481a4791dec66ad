"""The request loop, compiled: :meth:`sae_env.cache.PrefixCache.admit` / ``complete`` and the replay's event loop
(:class:`sae_env.replay.Replay`) over numeric arrays, calling a compiled policy's hooks. The functions that reach a
hook are templates (:func:`~sae_env.fast_engine.jit.template`), compiled once per policy by
:func:`~sae_env.fast_engine.jit.kernel`; ``kernel("run_window", StateClass)`` is the entry point.

The Python engine has two loops for instant mode (``PrefixCache.serve``, a faster equivalent of
``complete(*admit(...))`` when nothing else is in flight) and one for timed mode; this module has one: instant mode
is a request admitted and completed at its arrival. Per request, exactly as the Python engine:

* ``admit``: the hit is the longest run of leading prompt keys that are cached (each hit slot pinned, ``hits += 1``,
  last access = now; ``on_acquire`` for the slots no request held, ``on_hit`` for the run); the missing prompt
  blocks are inserted one by one after it (``insert_run``);
* ``insert_run``: a cached key whose parent is not the previous block stops the run (an output key another request
  cached is shared: a hit for the block); a key among the ghosts counts a miss after eviction, by its ghost's type
  and queue, before any eviction; a full cache evicts one victim first (``evict_one``); no victim = the rest of the
  run is bypassed and counted;
* completion (in ``run_window``): ``on_complete``, then when ``cache_outputs`` and the whole prompt is cached the
  output blocks follow the same way (the same call of ``insert_run`` as an admission's), then ``release``: the
  request's blocks are unpinned deepest first and those no request holds any more are released (``on_release``);
* ``evict_one``: the policy's victim is forgotten, counted, its parent loses a child (``on_leaf`` when it has none
  left) and its key goes to the bounded ghost record (oldest dropped first), exactly as ``PrefixCache._evict_one``.

In timed mode each arrival first applies the events due by then (first tokens out of the compiled prefill server,
:mod:`sae_env.fast_engine.server`, then completions), as ``Replay._apply_events`` does, and the request is
submitted to the server after its admission; the last window drains both.

**Slots.** The cache holds at most ``capacity`` blocks in slots ``0 .. N-1`` (an eviction frees the slot the next
insertion reuses), one row each (``rec``: key id, parent slot, cached children, hits, type, pins, depth, queue, the
policy's columns, the last access time). ``slot_of[id]`` is a key's slot, -1 if it is not cached, ``-2 - p``
if it may be the ghost at position ``p`` of the ghost ring (a ring with lazy deletion: an entry is live while it
lies between the ring's tail and head and names the key).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sae_env.block import TYPE_SLOTS
from sae_env.fast_engine import server as srv
from sae_env.fast_engine.jit import (
    borrow,
    evict,
    inline,
    jit,
    on_acquire,
    on_complete,
    on_hit,
    on_insert,
    on_leaf,
    on_release,
    on_request,
    template,
)
from sae_env.trace import N_TOKEN_TYPES

# A slot's row: 16 int32 (64 bytes, one cache line), so that touching a block costs one memory access: the cache's
# columns, six columns for the policy (P0 .. P5; a policy that needs a float uses FP4 .. FP6 of the float64 view of
# the same row, which cover P0-P1, P2-P3, P4-P5), and the last access time (float column LAST = int32 columns 14-15).
KEY, PARENT, NCHILD, HITS, BTYPE, PIN, DEPTH, QUEUE, P0, P1, P2, P3, P4, P5 = range(14)
NCOL = 16
FP4, FP5, FP6, LAST = 4, 5, 6, 7
# Scalars: cached blocks; ghost ring tail (oldest), head (next free position), live ghosts.
N, GTAIL, GHEAD, GLIVE = range(4)
N_SCALARS = 4
# Window counters: evictions, bypasses, insertions, misses after eviction per TokenType, then per queue id (the
# ghost keeps the queue-type code of each key, as PrefixCache.ghosts does), then those on output blocks.
EVICTIONS, BYPASSES, INSERTED, MAE = 0, 1, 2, 3
MAEQ = MAE + N_TOKEN_TYPES
N_QUEUE_IDS = 8
MAEO = MAEQ + N_QUEUE_IDS
N_COUNTERS = MAEO + 1
TIMED = True  # the templates' mode; each kernel is compiled with its own value (jit.kernel)


class Core(NamedTuple):
    """The trace as the loop reads it and the cache's arrays."""

    po: np.ndarray  # int64 prompt offsets
    oo: np.ndarray  # int64 output offsets
    ids: np.ndarray  # int32 dense key id per reference: the prompt references, then the output references
    types: np.ndarray  # int8 TokenType per reference, same order
    t: np.ndarray  # float64 arrival per request
    n_pr: int  # prompt references (request j's outputs start at n_pr + oo[j])
    capacity: int
    ghost_cap: int
    cache_outputs: bool
    rec: np.ndarray  # int32 [capacity, NCOL]
    recf: np.ndarray  # float64 [capacity, NCOL // 2]: the same rows as floats (LAST, FP4 .. FP6)
    slot_of: np.ndarray  # int32 per key id
    gid: np.ndarray  # int32 ghost ring: key ids (-1: dead entry)
    gty: np.ndarray  # uint8 ghost ring: queue * 8 + type
    sc: np.ndarray  # int64 scalars
    occ: np.ndarray  # int64 cached blocks per TokenType
    cnt: np.ndarray  # int64 window counters
    path: np.ndarray  # int32 the current request's slots, root first


@inline
def ring_drop_oldest(ring, sc, tail, live):
    """Drop the oldest live entry of a ghost ring (entries of keys that came back are -1)."""
    t = sc[tail]
    while ring[t] < 0:
        t += 1
    ring[t] = -1
    sc[tail] = t + 1
    sc[live] -= 1


@jit
def _squeeze_ghosts(sc, gid, gty, slot_of):
    """Squeeze out the entries of keys that came back or were dropped (live ghosts <= ghost_cap, the ring holds
    2 * ghost_cap + 2): amortised O(1). Rare: compiled apart, not inlined into every kernel."""
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


@inline
def _ghost_add(c, key, code):
    """GhostRecord.add of an evicted key (never a ghost already: a ghost that comes back is taken)."""
    sc, gid = c.sc, c.gid
    if sc[GHEAD] == gid.size:
        _squeeze_ghosts(sc, gid, c.gty, c.slot_of)
    h = sc[GHEAD]
    gid[h] = key
    c.gty[h] = code
    c.slot_of[key] = -2 - h
    sc[GHEAD] = h + 1
    sc[GLIVE] += 1
    if sc[GLIVE] > c.ghost_cap:
        # Its key's slot_of still points into the ring, but a ghost is recognised only where the ring entry in the
        # live window names the key: one random write fewer per eviction.
        ring_drop_oldest(gid, sc, GTAIL, GLIVE)


@template
def evict_one(c, ps, now):
    """PrefixCache._evict_one: the policy's victim leaves the cache; returns its (free) slot, -1 if none."""
    v = evict(ps, c, now)
    if v < 0:
        return -1
    rec = c.rec
    if rec[v, PIN] != 0 or rec[v, NCHILD] != 0:
        raise RuntimeError("compiled engine: the policy chose a block that is not an evictable leaf")
    key = rec[v, KEY]
    c.slot_of[key] = -1
    c.sc[N] -= 1
    c.occ[rec[v, BTYPE]] -= 1
    p = rec[v, PARENT]
    if p >= 0:
        rec[p, NCHILD] -= 1
        if rec[p, NCHILD] == 0:
            on_leaf(ps, c, p)
    c.cnt[EVICTIONS] += 1
    if c.ghost_cap > 0:
        _ghost_add(c, key, rec[v, QUEUE] * TYPE_SLOTS + rec[v, BTYPE])  # queue_type_code
    return v


@template
def insert_run(c, ps, x0, x1, plen, depth, output, now):
    """PrefixCache._insert_run of references ``x0 .. x1 - 1`` after ``path[:plen]``; returns the new length."""
    # The arrays as locals: shorter to read (the kernel borrows them, so a read costs no reference count).
    rec, recf, path, slot_of, sc, cnt = c.rec, c.recf, c.path, c.slot_of, c.sc, c.cnt
    ids, types, gid, gty = c.ids, c.types, c.gid, c.gty
    parent = path[plen - 1] if plen > 0 else -1
    for x in range(x0, x1):
        k = ids[x]
        s = slot_of[k]
        if s >= 0:
            # Only possible for an output key that another request cached: share it (a hit for the block).
            if rec[s, PARENT] != parent:
                break  # a different chain reached the same key: stop rather than corrupt
            path[plen] = s
            if rec[s, PIN] == 0:
                on_acquire(ps, c, path, plen, plen + 1)
            rec[s, PIN] += 1
            recf[s, LAST] = now
            rec[s, HITS] += 1
            on_hit(ps, c, path, plen, plen + 1, now)
            plen += 1
            parent = s
            depth += 1
            continue
        if s <= -2:
            g = -2 - s
            if sc[GTAIL] <= g < sc[GHEAD] and gid[g] == k:
                # A ghost: looked up before evicting, which could push it out of a full ghost record.
                code = gty[g]
                cnt[MAE + code % TYPE_SLOTS] += 1  # split_queue_type
                cnt[MAEQ + code // TYPE_SLOTS] += 1
                if output:
                    cnt[MAEO] += 1
                gid[g] = -1
                sc[GLIVE] -= 1
        if sc[N] >= c.capacity:
            s = evict_one(c, ps, now)
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
        rec[s, HITS] = 0
        rec[s, BTYPE] = t
        rec[s, PIN] = 1
        rec[s, DEPTH] = depth
        rec[s, QUEUE] = 0
        recf[s, LAST] = now  # the policy's columns are the policy's to set (on_insert)
        c.occ[t] += 1
        if parent >= 0:
            rec[parent, NCHILD] += 1
        on_insert(ps, c, s, now)
        path[plen] = s
        plen += 1
        parent = s
        depth += 1
        cnt[INSERTED] += 1
    return plen


@template
def admit(c, ps, j, now):
    """PrefixCache.admit of request ``j`` into ``path`` up to its missing blocks (run_window inserts those); returns
    the hit blocks, which are the path's length too."""
    rec, recf, path, slot_of, ids = c.rec, c.recf, c.path, c.slot_of, c.ids
    plen = 0
    free_from = -1  # the slots no request held: a suffix of the hit run (a parent is held at least as often)
    for x in range(c.po[j], c.po[j + 1]):
        s = slot_of[ids[x]]
        if s < 0:
            break
        if rec[s, PIN] == 0 and free_from < 0:
            free_from = plen
        rec[s, PIN] += 1
        recf[s, LAST] = now
        rec[s, HITS] += 1
        path[plen] = s
        plen += 1
    if free_from >= 0:
        on_acquire(ps, c, path, free_from, plen)
    if plen > 0:
        on_hit(ps, c, path, 0, plen, now)
    return plen


@template
def release(c, ps, plen, now):
    """The end of PrefixCache.complete: the request's blocks ``path[:plen]`` are unpinned deepest first, and those no
    request holds any more are released."""
    rec, recf, path = c.rec, c.recf, c.path
    i0 = plen
    for i in range(plen - 1, -1, -1):  # deepest first; the released ones are a suffix, as pins fall with depth
        s = path[i]
        rec[s, PIN] -= 1
        if rec[s, PIN] == 0:
            recf[s, LAST] = now  # a block is in use until released: idle time counts from here (vLLM)
            i0 = i
    if i0 < plen:
        on_release(ps, c, path, i0, plen, now)


@inline
def _first_token(c, sv, i):
    """Replay._first_token: TTFT and queueing delay recorded, the completion scheduled after the decode time."""
    n = sv.si[srv.NOUT]
    sv.ttft_out[n] = (sv.t_first[i] - c.t[i]) * 1e3
    sv.queue_out[n] = sv.qdelay[i] * 1e3
    sv.si[srv.NOUT] = n + 1
    srv.push_event(sv, sv.t_first[i] + sv.decode[i], i)


@inline
def _next_completion(c, sv, now, drain):
    """The next request to complete in timed mode (-1: none before ``now``): first tokens due by ``now`` first
    (Replay._apply_events), then the earliest completion due by ``now``; ``drain``: everything (Replay._finish).
    Returns the request and its completion time."""
    si = sv.si
    if drain:
        srv.drain(sv, c.t)
    else:
        srv.advance_to(sv, c.t, now)
    while si[srv.DHEAD] < si[srv.DTAIL] and (drain or sv.t_first[si[srv.DHEAD]] <= now):
        _first_token(c, sv, si[srv.DHEAD])
        si[srv.DHEAD] += 1
    if si[srv.EVSIZE] > 0 and (drain or sv.ev_t[0] <= now):
        t_done = sv.ev_t[0]
        return srv.pop_event(sv), t_done
    return -1, now


@template
def run_window(c, ps, sv, a, b, hits_out, finish):
    """Serve requests ``a .. b-1``: their hit blocks go to ``hits_out``, the window's counters to ``c.cnt`` and, in
    timed mode, the TTFTs recorded during the window to ``sv.ttft_out`` (``sv.si[NOUT]`` of them). ``finish``: the
    last window (timed mode then drains the server and every completion).

    One step per iteration: complete a request, or admit the next one. Instant mode completes each request right
    after its admission, on the path it holds; timed mode completes the requests whose events are due before the
    next arrival (their paths rebuilt from their deepest held slot). One call site of each template keeps the
    kernel small (they are inlined). ``TIMED`` is a constant of each kernel
    (:func:`~sae_env.fast_engine.jit.kernel`), so an instant-mode kernel holds none of the timed code."""
    c, ps, sv = borrow(c), borrow(ps), borrow(sv)  # no reference counting inside (jit.borrow says why)
    j = a
    due = -1  # instant mode: the request just admitted, to complete now
    plen = 0
    draining = False
    while True:
        i = -1
        now = 0.0
        n_hit = 0
        if due >= 0:
            i = due
            due = -1
            now = c.t[i]
        elif TIMED:
            if j < b or draining:
                i, now = _next_completion(c, sv, c.t[j] if j < b else 0.0, draining)
            if i >= 0:
                plen = sv.held_len[i]
                s = sv.held[i]
                path, rec = c.path, c.rec
                for p in range(plen - 1, -1, -1):
                    path[p] = s
                    s = rec[s, PARENT]
                sv.held[i] = srv.NOT_HELD
                sv.held_len[i] = 0
        # The blocks to insert, x0 .. x1 - 1 after path[:plen] at depth ``depth``: a completion's outputs, or an
        # admission's missing prompt blocks. One call site of insert_run for both: it inlines the policy's eviction,
        # the largest part of a kernel, and every copy costs compile time (two cost SAECache's kernel a third more).
        completing = i >= 0
        if completing:  # PrefixCache.complete: on_complete, the outputs when the whole prompt is cached, release
            on_complete(ps, c, i, now)
            depth = c.po[i + 1] - c.po[i]
            x0 = x1 = 0
            if c.cache_outputs and c.oo[i + 1] > c.oo[i] and plen == depth:
                x0, x1 = c.n_pr + c.oo[i], c.n_pr + c.oo[i + 1]
        elif j < b:
            now = c.t[j]
            on_request(ps, c, j, now)
            plen = admit(c, ps, j, now)
            n_hit = depth = plen
            x0, x1 = c.po[j] + n_hit, c.po[j + 1]
        else:
            if TIMED:
                if finish and not draining:
                    draining = True
                    continue
            break
        if x0 < x1:
            plen = insert_run(c, ps, x0, x1, plen, depth, completing, now)
        if completing:
            release(c, ps, plen, now)
            continue
        hits_out[j - a] = n_hit
        if TIMED:
            sv.held[j] = c.path[plen - 1] if plen > 0 else -1
            sv.held_len[j] = plen
            prompt = sv.ptok[j]
            cached = min(n_hit * sv.block_size, prompt)
            srv.submit(sv, j, now, prompt - cached, cached)
        else:
            due = j
        j += 1
