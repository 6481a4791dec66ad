"""Block keys: 64-bit hashing and prefix chaining, so that a key stands for the whole prefix up to its block.

A block's key is ``mix(parent key, content)``: two requests share a key only if they share the whole prefix, as in
vLLM (hash of the parent hash and the block's tokens), so a lookup is "the longest run of leading keys that are
cached". Sources whose ids are per-block content hashes (Bailian) pass them through :func:`chain_keys`; chaining
already-chained ids (Mooncake) is harmless, because the chaining map is injective on (parent, content) pairs up to
64-bit hash collisions, so every equality between keys is kept and none is added.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["chain_keys", "content_hash", "mix64"]


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROOT = np.uint64(0x2545F4914F6CDD1D)  # the "parent" of a prompt's first block


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 with good avalanche (returns a new array)."""
    with np.errstate(over="ignore"):
        x = x.copy()
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def _combine(parent: np.ndarray, content: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(mix64(parent ^ _GOLDEN) + content.astype(np.uint64, copy=False) * _GOLDEN)


def chain_keys(content_ids: np.ndarray, offsets: np.ndarray, salt: int = 0) -> np.ndarray:
    """Turn per-block content ids into prefix-chained keys: ``key[j] = H(key[j-1], content[j])``.

    ``content_ids`` is flat (int64 or uint64), cut into sequences by CSR ``offsets`` (length n_seq + 1).
    ``salt`` separates key spaces (e.g. two sources mixed on one timeline). Keys are returned as int64 (a view of
    the uint64 hashes). Equal prefixes give equal keys; different prefixes give different keys up to 64-bit
    collisions. Vectorised over sequences: one numpy pass per block position.
    """
    content = np.asarray(content_ids).astype(np.uint64, copy=False).ravel()
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0 or offsets[-1] != content.size:
        raise ValueError("offsets must be a CSR offset array starting at 0 and ending at len(content_ids)")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        raise ValueError("offsets must be non-decreasing")
    out = np.empty(content.size, dtype=np.uint64)
    if content.size == 0:
        return out.view(np.int64)
    root = mix64(np.array([_ROOT ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64))[0]
    # Sort sequences by length (descending) so that the ones still alive at position j are a prefix.
    order = np.argsort(-lengths, kind="stable")
    starts = offsets[:-1][order]
    lens = lengths[order]
    parent = np.full(order.size, root, dtype=np.uint64)
    max_len = int(lens[0]) if lens.size else 0
    alive = order.size
    for j in range(max_len):
        while alive and lens[alive - 1] <= j:
            alive -= 1
        if alive < _FEW_ALIVE:
            # A numpy pass per position costs ~20 us whatever its width: with few sequences left (one request of a
            # million blocks), finish each one with a scalar loop instead, so the cost stays linear in the blocks.
            for k in range(alive):
                a, b = int(starts[k]) + j, int(starts[k] + lens[k])
                out[a:b] = _chain_one(int(parent[k]), content[a:b])
            break
        idx = starts[:alive] + j
        parent = _combine(parent[:alive], content[idx])
        out[idx] = parent
    return out.view(np.int64)


_FEW_ALIVE = 16  # sequences: below this, a scalar loop per sequence beats a numpy pass per position
_JIT_MIN = 500_000  # blocks: from here a compiled loop (numba, when installed) pays for its first compilation
_U64 = (1 << 64) - 1
_jitted: Any = None


def _chain_one(parent: int, content: np.ndarray) -> np.ndarray:
    """The chain of one sequence from ``parent``: exactly :func:`_combine` applied block after block."""
    if content.size >= _JIT_MIN:
        kernel = _chain_kernel()
        if kernel is not None:
            return kernel(np.uint64(parent), content)
    g, m1, m2, mask = int(_GOLDEN), int(_M1), int(_M2), _U64
    out = []
    push = out.append
    for c in content.tolist():
        x = parent ^ g
        x ^= x >> 30
        x = (x * m1) & mask
        x ^= x >> 27
        x = (x * m2) & mask
        x ^= x >> 31
        x = (x + c * g) & mask
        x ^= x >> 30
        x = (x * m1) & mask
        x ^= x >> 27
        x = (x * m2) & mask
        parent = x ^ (x >> 31)
        push(parent)
    return np.array(out, dtype=np.uint64)


def _chain_kernel() -> Any:
    """:func:`_chain_one` compiled with numba (None without numba); compiled once, on first use."""
    global _jitted
    if _jitted is None:
        try:
            import numba
        except ImportError:
            _jitted = False
            return None
        g, m1, m2 = _GOLDEN, _M1, _M2
        s27, s30, s31 = np.uint64(27), np.uint64(30), np.uint64(31)

        @numba.njit(cache=True, nogil=True)
        def kernel(parent, content):  # uint64 arithmetic wraps as numpy's does
            out = np.empty(content.size, dtype=np.uint64)
            for i in range(content.size):
                x = parent ^ g
                x ^= x >> s30
                x *= m1
                x ^= x >> s27
                x *= m2
                x ^= x >> s31
                x += content[i] * g
                x ^= x >> s30
                x *= m1
                x ^= x >> s27
                x *= m2
                parent = x ^ (x >> s31)
                out[i] = parent
            return out

        _jitted = kernel
    return _jitted or None


def content_hash(rows: np.ndarray) -> np.ndarray:
    """Hash each row of a 2-D integer array (e.g. the token ids of each block) into one uint64 content id."""
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError("content_hash expects a 2-D array (blocks x tokens)")
    h = np.full(rows.shape[0], np.uint64(rows.shape[1]), dtype=np.uint64)
    cols = rows.astype(np.uint64, copy=False)
    for c in range(rows.shape[1]):
        h = _combine(h, cols[:, c])
    return h
