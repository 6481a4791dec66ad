"""The lazy-deletion heap of :class:`~sae_env.policies.base.KeyedPolicy`, compiled.

An entry is a float64 row ``(a, b, seq, slot)``, valid while the slot's stamp (its row's column ``STAMP``, which
every keyed twin reserves for it) equals ``seq``; entries are ordered by ``(a, b, seq)``, the order of the Python
heap's ``(priority, seq, block)`` tuples once a priority is written as two numbers ``(a, b)`` (a priority that is
one number has ``b = 0``; integers are exact as floats below 2**53). ``seq`` counts pushes as ``KeyedPolicy._seq``
does, so ties break identically. Stale entries are squeezed out when the array is full, which changes no pop order
(pops follow the total order of ``(a, b, seq)``); nor need the array be laid out as Python's ``heapq`` lays out its
list: only the order of pops is observable.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sae_env.fast_engine.jit import inline, jit
from sae_env.fast_engine.loop import P0

STAMP = P0  # the column of a slot's row that holds the seq of its valid entry (0: none)
A, B, SEQ, SLOT = range(4)
HSIZE, HSEQ = 0, 1  # scalars: entries, pushes


class Heap(NamedTuple):
    e: np.ndarray  # float64 [m, 4] entries
    sc: np.ndarray  # int64 [HSIZE, HSEQ]


def new_heap(capacity: int) -> Heap:
    # Valid entries <= capacity: an eighth more room keeps squeezes to one per capacity / 8 pushes (8 moves per
    # push, amortised), at 36 bytes per cached block.
    return Heap(np.zeros((capacity + capacity // 8 + 16, 4)), np.zeros(2, dtype=np.int64))


@inline
def _less(e, i, j):
    if e[i, A] != e[j, A]:
        return e[i, A] < e[j, A]
    if e[i, B] != e[j, B]:
        return e[i, B] < e[j, B]
    return e[i, SEQ] < e[j, SEQ]


@inline
def _swap(e, i, j):
    for f in range(4):
        x = e[i, f]
        e[i, f] = e[j, f]
        e[j, f] = x


@inline
def _down(e, i, size):
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _less(e, c + 1, c):
            c += 1
        if not _less(e, c, i):
            break
        _swap(e, i, c)
        i = c


@inline
def heapify(h, size):
    h.sc[HSIZE] = size
    for i in range(size // 2 - 1, -1, -1):
        _down(h.e, i, size)


@jit
def squeeze(h, rec):
    """Drop the stale entries (the valid ones keep their order of pops). Rare: compiled apart, not inlined."""
    e = h.e
    w = 0
    for i in range(h.sc[HSIZE]):
        if rec[np.int64(e[i, SLOT]), STAMP] == e[i, SEQ]:
            for f in range(4):
                e[w, f] = e[i, f]
            w += 1
    heapify(h, w)


@inline
def push(h, rec, s, a, b):
    """KeyedPolicy._push: a new entry for slot ``s`` keyed ``(a, b)``."""
    e = h.e
    if h.sc[HSIZE] == e.shape[0]:
        squeeze(h, rec)  # at most one valid entry per slot: a quarter of the array at least is freed
    size = h.sc[HSIZE]
    h.sc[HSEQ] += 1
    seq = h.sc[HSEQ]
    rec[s, STAMP] = seq
    e[size, A] = a
    e[size, B] = b
    e[size, SEQ] = seq
    e[size, SLOT] = s
    i = size
    while i > 0:  # sift up
        p = (i - 1) // 2
        if not _less(e, i, p):
            break
        _swap(e, i, p)
        i = p
    h.sc[HSIZE] = size + 1


@inline
def pop_valid(h, rec):
    """KeyedPolicy.evict: pop until a valid entry; returns its slot (stamp cleared), -1 if the heap runs out."""
    e = h.e
    v = -1
    while v < 0 and h.sc[HSIZE] > 0:
        size = h.sc[HSIZE] - 1
        s = np.int64(e[0, SLOT])
        seq = e[0, SEQ]
        for f in range(4):
            e[0, f] = e[size, f]
        h.sc[HSIZE] = size
        _down(e, 0, size)
        if rec[s, STAMP] == seq:
            rec[s, STAMP] = 0
            v = s
    return v


@inline
def acquire(rec, path, i0, i1):
    """KeyedPolicy.on_acquire."""
    for i in range(i0, i1):
        rec[path[i], STAMP] = 0


@jit
def rekey(h, rec, keys_a, keys_b):
    """New keys for the valid entries (per slot: ``keys_a[slot]``, ``keys_b[slot]``), stale ones dropped."""
    e = h.e
    w = 0
    for i in range(h.sc[HSIZE]):
        s = np.int64(e[i, SLOT])
        if rec[s, STAMP] == e[i, SEQ]:
            e[w, A] = keys_a[s]
            e[w, B] = keys_b[s]
            e[w, SEQ] = e[i, SEQ]
            e[w, SLOT] = s
            w += 1
    heapify(h, w)


def load_heap(h: Heap, rec: np.ndarray, n: int, stamps: np.ndarray, seq: int, keys_a: np.ndarray,
              keys_b: np.ndarray) -> None:
    """The heap of an exported state: one entry per nonzero stamp, keyed ``(keys_a, keys_b)`` (per block)."""
    rec[:n, STAMP] = stamps
    live = np.flatnonzero(stamps)
    k = live.size
    h.e[:k] = np.stack([keys_a[live], keys_b[live], stamps[live], live], axis=1)
    h.sc[HSEQ] = seq
    _heapify(h, k)


@jit
def _heapify(h, k):
    heapify(h, k)
