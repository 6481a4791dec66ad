"""Belady's MIN (offline oracle): evict the evictable leaf whose next use lies furthest in the future.

"Next use" of a block accessed by request ``i`` is the index of the next later request whose *prompt* contains the
same key, after the latest request admitted so far; never again = +inf. A later request's output that contains
the key is not a use: outputs are inserted (or shared) whatever the cache holds, and only prompt references count
as hits. Counting them (as this module once did) is MIN on the whole reference stream, which spends room keeping a
block for a reference worth nothing: ``tests/test_policies.py`` has the case where LPC then beats it, and a brute
force over every eviction choice on small traces finds no case where the prompt-only definition is beaten. Next uses
are computed once, by one backward pass (a stable sort by key) over the whole trace in :meth:`bind`, and arrive
with each request through :meth:`on_request` / :meth:`on_complete`: the same interface as every online policy,
with extra knowledge.

A parent's next use is never later than its child's (a request that uses the child uses the parent), so with the
tie-break "deeper first" the furthest-next-use evictable block is always a leaf, and MIN's choice is respected by
the leaf-only rule. Time is counted in requests, so on traces with one block per request this is exactly the
classic MIN on the block reference stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sae_env.block import Block
from sae_env.policies.base import KeyedPolicy, block_array
from sae_env.trace import Trace

NEVER = np.iinfo(np.int64).max


def next_uses(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The chain of uses of every key: ``(next_occ, occ_req)`` over the occurrences of the trace.

    Occurrences are the prompt blocks (positions ``0 .. n_blocks-1``) followed by the output blocks. ``occ_req[j]``
    is the request of occurrence ``j``; ``next_occ[j]`` the first *prompt* occurrence of the same key in a *later*
    request (-1 if none): only a prompt reference can hit, so only a prompt reference is a use. An output
    occurrence is a source (the block it inserts or shares needs a next use) but never a target. With numba, one
    compiled backward pass over the requests (:func:`sae_env.fast_engine.keys.next_prompt_uses`); without, one
    stable sort by (key, request, prompt before output) (:func:`next_uses_sorted`; the two agree, tested).
    """
    from sae_env.fast_engine import AVAILABLE

    if AVAILABLE:
        from sae_env.fast_engine.keys import next_prompt_uses

        return next_prompt_uses(trace)
    return next_uses_sorted(trace)


def next_uses_sorted(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """:func:`next_uses` by sorting (numpy only)."""
    n = len(trace)
    keys = np.concatenate([trace.prompt_keys, trace.output_keys])
    req = np.concatenate([np.repeat(np.arange(n, dtype=np.int64), np.diff(trace.prompt_offsets)),
                          np.repeat(np.arange(n, dtype=np.int64), np.diff(trace.output_offsets))])
    kind = np.concatenate([np.zeros(trace.n_blocks, np.int8), np.ones(trace.n_output_blocks, np.int8)])
    next_occ = np.full(keys.size, -1, dtype=np.int64)
    dtype = np.int32 if keys.size < 2**31 - 1 else np.int64  # as fast_engine.keys.occurrence_dtype
    if keys.size:
        order = np.lexsort((kind, req, keys))
        k, r = keys[order], req[order]
        new_run = np.ones(keys.size, dtype=bool)  # runs of equal (key, request)
        new_run[1:] = (k[1:] != k[:-1]) | (r[1:] != r[:-1])
        run_first = np.flatnonzero(new_run)
        run_of = np.cumsum(new_run) - 1
        # A run holds a prompt occurrence iff its first one is (prompts sort first); the use of a run is the
        # first later run of the same key that holds one.
        prompt_runs = np.flatnonzero(kind[order[run_first]] == 0)
        nxt_first = np.full(run_first.size, -1, dtype=np.int64)
        if prompt_runs.size:
            later = np.searchsorted(prompt_runs, np.arange(run_first.size), side="right")
            runs = np.flatnonzero(later < prompt_runs.size)
            cand = prompt_runs[later[runs]]
            same_key = k[run_first[cand]] == k[run_first[runs]]  # runs of one key are contiguous
            nxt_first[runs[same_key]] = order[run_first[cand[same_key]]]
        next_occ[order] = nxt_first[run_of]
    return next_occ.astype(dtype), req.astype(dtype)


class BeladyPolicy(KeyedPolicy):
    name = "belady"
    oracle = True

    def __init__(self) -> None:
        super().__init__()
        self._next_occ: np.ndarray | None = None
        self._occ_req: np.ndarray | None = None
        self._trace: Trace | None = None
        self._cur_prompt: list[int] = []
        self._cur_output: list[int] = []
        self._cur_n_prompt = 0
        self._frontier = -1  # the latest request admitted: a "next use" must lie after it
        self._context_of = -1  # the request whose hooks are running (its arrival or its completion)

    def bind(self, trace: Trace) -> None:
        self._trace = trace
        self._next_occ, self._occ_req = next_uses(trace)

    def _context(self, trace: Trace, i: int) -> None:
        if trace is not self._trace:
            raise RuntimeError("belady: bind() was called with a different trace than the one being replayed")
        self._context_of = i
        a, b = trace.prompt_offsets[i], trace.prompt_offsets[i + 1]
        self._cur_prompt_at = int(a)
        self._cur_prompt = self._next_requests(a, b)
        a, b = trace.n_blocks + trace.output_offsets[i], trace.n_blocks + trace.output_offsets[i + 1]
        self._cur_output_at = int(a)
        self._cur_output = self._next_requests(a, b)
        self._cur_n_prompt = len(self._cur_prompt)

    def _next_requests(self, a: int, b: int) -> list[int]:
        """The request of each next use of occurrences ``a .. b-1`` (NEVER: none). Not kept per occurrence: the two
        chains are the whole knowledge, at 4 bytes each per occurrence."""
        nxt = self._next_occ[a:b]
        req = self._occ_req[np.maximum(nxt, 0)].astype(np.int64)
        return np.where(nxt >= 0, req, NEVER).tolist()

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        self._frontier = i
        self._context(trace, i)

    def on_complete(self, trace: Trace, i: int, now: float) -> None:
        self._context(trace, i)

    def _next(self, block: Block) -> int:
        d = block.depth
        if d < self._cur_n_prompt:
            nu, occ = self._cur_prompt[d], self._cur_prompt_at + d
        else:
            nu, occ = self._cur_output[d - self._cur_n_prompt], self._cur_output_at + d - self._cur_n_prompt
        if nu <= self._frontier:
            # With a serving model, outputs are inserted when their request completes, possibly after later
            # requests were admitted: a use by one of those is in the past. Follow the key's chain of uses.
            next_occ, occ_req = self._next_occ, self._occ_req
            occ = int(next_occ[occ])
            while occ >= 0 and occ_req[occ] <= self._frontier:
                occ = int(next_occ[occ])
            nu = NEVER if occ < 0 else int(occ_req[occ])
        return nu

    def on_insert(self, block: Block, now: float) -> None:
        block.pdata = self._next(block)

    def on_hit(self, blocks: list[Block], now: float) -> None:
        for b in blocks:
            b.pdata = self._next(b)

    def priority(self, block: Block, now: float) -> tuple[int, int]:
        return (-block.pdata, -block.depth)

    def export_pdata(self, index: dict[int, int]) -> dict[str, Any]:
        return {"next_use": block_array(self.cache.blocks.values(), index, lambda b: b.pdata), **self.export_context()}

    def import_pdata(self, state: dict[str, Any], blocks: list[Block]) -> None:
        for b, nu in zip(blocks, state["next_use"].tolist(), strict=True):
            b.pdata = nu
        self.import_context(state)

    def export_context(self) -> dict[str, Any]:
        """The request being served (whose next uses the hooks read), the latest one admitted, and the knowledge
        (read-only arrays, per occurrence: :func:`next_uses`)."""
        return {"frontier": self._frontier, "context": self._context_of, "next_occ": self._next_occ,
                "occ_req": self._occ_req}

    def import_context(self, state: dict[str, Any]) -> None:
        if state["context"] >= 0:
            self._context(self._trace, int(state["context"]))
        self._frontier = int(state["frontier"])
