"""Belady's MIN (offline oracle): evict the evictable leaf whose next use lies furthest in the future.

"Next use" of a block accessed by request ``i`` is the index of the next later request whose prompt (or output,
if it is shared) contains the same key, after the latest request admitted so far; never again = +inf. Next uses
are computed once, by one backward pass (a stable sort by key) over the whole trace in :meth:`bind`, and arrive
with each request through :meth:`on_request` / :meth:`on_complete`: the same interface as every online policy,
with extra knowledge.

A parent's next use is never later than its child's (a request that uses the child uses the parent), so with the
tie-break "deeper first" the furthest-next-use evictable block is always a leaf, and MIN's choice is respected by
the leaf-only rule. Time is counted in requests, so on traces with one block per request this is exactly the
classic MIN on the block reference stream.
"""

from __future__ import annotations

import numpy as np

from sae_env.cache import Block
from sae_env.policies.base import KeyedPolicy
from sae_env.trace import Trace

NEVER = np.iinfo(np.int64).max


def next_uses(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """For every prompt and output occurrence, the index of the next later request using the same key."""
    n = len(trace)
    p_len = np.diff(trace.prompt_offsets)
    o_len = np.diff(trace.output_offsets)
    keys = np.concatenate([trace.prompt_keys, trace.output_keys])
    req = np.concatenate([np.repeat(np.arange(n, dtype=np.int64), p_len),
                          np.repeat(np.arange(n, dtype=np.int64), o_len)])
    kind = np.concatenate([np.zeros(trace.n_blocks, np.int8), np.ones(trace.n_output_blocks, np.int8)])
    # Stream order: by request, its prompt before its outputs, positions in order (stable sorts keep them).
    order = np.lexsort((kind, req, keys))  # grouped by key, then by (request, kind)
    nxt = np.full(keys.size, NEVER, dtype=np.int64)
    if keys.size > 1:
        same = keys[order[1:]] == keys[order[:-1]]
        later = req[order[1:]] > req[order[:-1]]
        # An output occurrence followed by the same key in the same request cannot happen (chained keys).
        take = same & later
        nxt[order[:-1][take]] = req[order[1:][take]]
        # Equal keys in the same request (hash collisions, or a prompt key re-emitted as output): skip ahead.
        if (same & ~later).any():
            for a in np.flatnonzero(same & ~later)[::-1]:
                nxt[order[a]] = nxt[order[a + 1]]
    return nxt[: trace.n_blocks], nxt[trace.n_blocks:]


class BeladyPolicy(KeyedPolicy):
    name = "belady"
    oracle = True

    def __init__(self) -> None:
        super().__init__()
        self._prompt_next: np.ndarray | None = None
        self._output_next: np.ndarray | None = None
        self._trace: Trace | None = None
        self._cur_prompt: list[int] = []
        self._cur_output: list[int] = []
        self._cur_n_prompt = 0
        self._frontier = -1  # the latest request admitted: a "next use" must lie after it

    def bind(self, trace: Trace) -> None:
        self._trace = trace
        self._prompt_next, self._output_next = next_uses(trace)

    def _context(self, trace: Trace, i: int) -> None:
        if trace is not self._trace:
            raise RuntimeError("belady: bind() was called with a different trace than the one being replayed")
        a, b = trace.prompt_offsets[i], trace.prompt_offsets[i + 1]
        self._cur_prompt = self._prompt_next[a:b].tolist()
        a, b = trace.output_offsets[i], trace.output_offsets[i + 1]
        self._cur_output = self._output_next[a:b].tolist()
        self._cur_n_prompt = len(self._cur_prompt)

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        self._frontier = i
        self._context(trace, i)

    def on_complete(self, trace: Trace, i: int, now: float) -> None:
        self._context(trace, i)

    def _next(self, block: Block) -> int:
        d = block.depth
        nu = self._cur_prompt[d] if d < self._cur_n_prompt else self._cur_output[d - self._cur_n_prompt]
        # With a serving model, outputs are inserted when their request completes, possibly after later requests
        # were admitted; a use by one of those is in the past. A key sits at the same depth in every sequence, so
        # its next occurrence after request j is the next use recorded at position (j, depth).
        offsets, prompt_next = self._trace.prompt_offsets, self._prompt_next
        while nu <= self._frontier:
            nu = int(prompt_next[offsets[nu] + d])
        return nu

    def on_insert(self, block: Block, now: float) -> None:
        block.pdata = self._next(block)

    def on_hit(self, blocks: list[Block], now: float) -> None:
        for b in blocks:
            b.pdata = self._next(b)

    def priority(self, block: Block, now: float) -> tuple[int, int]:
        return (-block.pdata, -block.depth)
