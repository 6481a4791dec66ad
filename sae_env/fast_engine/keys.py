"""Dense ids: every key of a trace (and of a cache handed over) mapped once to a small integer, so that the compiled
engine indexes arrays instead of hashing keys.

:func:`dense_ids` maps a trace's prompt and output keys in first-seen order with an open-addressing table, and
checks two properties the engine relies on: no request names a key twice (the engine declines such a trace: the
Python loop's behaviour on it is not worth mirroring), and whether every key has one parent key (the key before it in
its request, prompt then outputs) and one position throughout the trace. Prefix-chained keys have both by
construction; the policies that read a block's depth and the timed loop (which finds a request's held blocks by
walking up from its deepest one) need them. :class:`KeyTable` keeps the table for keys that come later (a cache or a
policy state handed over from the Python engine may hold keys the trace does not).
"""

from __future__ import annotations

import numpy as np

from sae_env.fast_engine.jit import inline, jit
from sae_env.trace import Trace

__all__ = ["KeyTable", "dense_ids", "next_prompt_uses", "occurrence_dtype"]


@inline
def _lookup(table, k, uniq, d):
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
            return d, d + 1
        if table[i, 0] == k:
            return t, d
        i = (i + 1) & mask


@jit
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
        for part in range(2):
            keys, off, base = (pk, po, 0) if part == 0 else (ok, oo, n_pr)
            for x in range(off[r], off[r + 1]):
                t, d2 = _lookup(table, keys[x], uniq, d)
                if d2 > d:
                    last_req[t] = -1
                d = d2
                if multi:
                    dup |= last_req[t] == r
                    last_req[t] = r
                ids[base + x] = t
    return d, dup


@jit
def _chained(ids, po, oo, n_pr, parent_of, depth_of):
    """Whether every key id has one parent (the id before it in its request, prompt then outputs; -1 first) and one
    position in all the requests that name it."""
    depth_of[:] = -1
    for r in range(po.size - 1):
        prev = -1
        depth = 0
        for part in range(2):
            off, base = (po, 0) if part == 0 else (oo, n_pr)
            for x in range(off[r], off[r + 1]):
                t = ids[base + x]
                if depth_of[t] < 0:
                    depth_of[t] = depth
                    parent_of[t] = prev
                elif depth_of[t] != depth or parent_of[t] != prev:
                    return False
                prev = t
                depth += 1
    return True


@inline
def _row(table, k):
    """The row of key ``k`` in an open-addressing table of rows (key, value), value -2 = empty row; a new key is
    inserted with the value -1."""
    mask = table.shape[0] - 1
    h = np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)
    i = np.int64(h >> np.uint64(24)) & mask
    while True:
        if table[i, 1] == -2:
            table[i, 0] = k
            table[i, 1] = -1
            return i
        if table[i, 0] == k:
            return i
        i = (i + 1) & mask


@jit
def _next_prompt_uses(pk, po, ok, oo, table, next_occ, occ_req):
    """One backward pass over the requests: each occurrence's first prompt occurrence of its key in a later request
    (-1: none). The table holds, per key, that occurrence for the requests after the current one."""
    n_pr = pk.size
    for r in range(po.size - 2, -1, -1):
        for x in range(oo[r], oo[r + 1]):
            occ_req[n_pr + x] = r
            next_occ[n_pr + x] = table[_row(table, ok[x]), 1]
        for x in range(po[r], po[r + 1]):
            occ_req[x] = r
            next_occ[x] = table[_row(table, pk[x]), 1]
        for x in range(po[r + 1] - 1, po[r] - 1, -1):  # the request's first occurrence of a key is written last
            table[_row(table, pk[x]), 1] = x


def occurrence_dtype(n: int) -> type:
    """int32 for the per-occurrence knowledge of an oracle (half the memory of int64) where ``n`` occurrences fit."""
    return np.int32 if n < 2**31 - 1 else np.int64


def next_prompt_uses(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sae_env.policies.belady.next_uses`, compiled: one pass with a hash table instead of a sort."""
    n = trace.n_blocks + trace.n_output_blocks
    table = np.full((1 << max(4, int(2 * trace.distinct_blocks()).bit_length()), 2), -2, dtype=np.int64)
    dtype = occurrence_dtype(n)
    next_occ = np.empty(n, dtype=dtype)
    occ_req = np.empty(n, dtype=dtype)
    _next_prompt_uses(trace.prompt_keys, trace.prompt_offsets, trace.output_keys, trace.output_offsets, table,
                      next_occ, occ_req)
    return next_occ, occ_req


@jit
def _more_ids(keys, table, uniq, d, out):
    for x in range(keys.size):
        t, d = _lookup(table, keys[x], uniq, d)
        out[x] = t
    return d


def dense_ids(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Each of ``keys`` (int64) as a dense id, in first-seen order, and how many distinct keys there are."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    ids = np.empty(keys.size, dtype=np.int32 if keys.size < 2**31 else np.int64)
    distinct = _more_ids(keys, _empty_table(keys.size), np.empty(keys.size, dtype=np.int64), 0, ids)
    return ids, int(distinct)


class KeyTable:
    """The trace's keys as dense ids (``ids``: one per prompt reference, then one per output reference), the key of
    each id (``uniq``), and what :func:`_dense_ids` found. :meth:`ids_of` maps further keys (new ones get new ids).

    The hash table is dropped once the trace is mapped (it would cost more than the cache state): :meth:`ids_of`,
    which runs only when a state is handed over, builds it again."""

    def __init__(self, trace: Trace):
        n = trace.n_blocks + trace.n_output_blocks
        d = trace.distinct_blocks()  # a sort: sizes the table for the distinct keys, not the references
        table = _empty_table(d)
        self.ids = np.empty(n, dtype=np.int32)
        uniq = np.empty(d, dtype=np.int64)
        found, repeats = _dense_ids(trace.prompt_keys, trace.prompt_offsets, trace.output_keys,
                                    trace.output_offsets, table, self.ids, uniq, np.empty(d, dtype=np.int64))
        if found != d:
            raise RuntimeError(f"dense ids: {found} distinct keys found, the trace counts {d}")
        self.uniq = uniq
        self.repeats = bool(repeats)
        self._trace = trace
        self._chained: bool | None = None

    @property
    def chained(self) -> bool:
        """Whether the trace's keys are chained (computed once, when first asked: one pass over the references)."""
        if self._chained is None:
            d = int(self.uniq.size)
            tr = self._trace
            self._chained = bool(_chained(self.ids, tr.prompt_offsets, tr.output_offsets, int(tr.n_blocks),
                                          np.empty(d, dtype=np.int32), np.empty(d, dtype=np.int32)))
        return self._chained

    def __len__(self) -> int:
        return int(self.uniq.size)

    def ids_of(self, keys: np.ndarray) -> np.ndarray:
        """The dense ids of ``keys`` (int64); keys the table does not hold get new ids (``len`` grows)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.empty(keys.size, dtype=np.int32)
        if not keys.size:
            return out
        d = len(self)
        table = _empty_table(d + keys.size)
        uniq = np.concatenate([self.uniq, np.empty(keys.size, dtype=np.int64)])
        _more_ids(self.uniq, table, uniq, 0, np.empty(d, dtype=np.int32))
        d = _more_ids(keys, table, uniq, d, out)
        self.uniq = uniq[:d]
        return out


def _empty_table(n: int) -> np.ndarray:
    """An open-addressing table for ``n`` keys at a load factor below 1/2: rows (key, id), id -1 = empty."""
    return np.full((1 << max(4, int(2 * n).bit_length()), 2), -1, dtype=np.int64)
