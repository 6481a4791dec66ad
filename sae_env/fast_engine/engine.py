"""FastEngine: one replay's state on the compiled engine, loaded from and saved to the Python objects through the
state contract (:mod:`sae_env.state`).

:meth:`FastEngine.load` takes a cache (any cache: fresh, or one the Python engine filled) and its policy's exported
state; :meth:`FastEngine.run_window` serves consecutive windows; :meth:`FastEngine.save` writes the state back
into the Python cache and policy, after which the Python engine goes on exactly where this one stopped (and
:meth:`load` may take it again later). Block ``i`` of an exported state lives in slot ``i``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sae_env.fast_engine import loop
from sae_env.fast_engine import server as srv
from sae_env.fast_engine.jit import AVAILABLE, kernel
from sae_env.fast_engine.keys import KeyTable
from sae_env.fast_engine.twin import Twin, twin_class
from sae_env.state import CacheState, export_cache, import_cache
from sae_env.trace import N_TOKEN_TYPES, Trace

if TYPE_CHECKING:
    from sae_env.cache import PrefixCache

__all__ = ["MAX_REFS", "FastEngine", "TimedState", "WindowCounts", "unsupported_reason"]

# Every count fits 32 bits: the engine declines traces of 2**30 references or more (hits, pushes, releases and
# insertions are bounded by twice the references).
MAX_REFS = 2**30


class TimedState(NamedTuple):
    """What a timed replay holds beside its cache: the server's exported state, the requests in flight (request ->
    the blocks it holds, root first) and the completion events (a heap of ``(time, request, 0)``)."""

    server: dict[str, Any]
    inflight: dict[int, list]
    events: list[tuple[float, int, int]]


class WindowCounts(NamedTuple):
    """One window's counters, as :class:`~sae_env.cache.PrefixCache` keeps them."""

    evictions: int
    bypasses: int
    inserted: int
    mae_by_type: list[int]  # misses after eviction per TokenType
    mae_by_queue: dict[int, int]  # misses after eviction per queue id (only the queues that had one)
    mae_output: int  # misses after eviction on output blocks


def unsupported_reason(cache: PrefixCache, server: Any = None) -> str | None:
    """Why the compiled engine cannot run ``cache`` with its policy (and ``server``, if timed), or None if it can
    (the trace is checked when the engine is built)."""
    if not AVAILABLE:
        return "numba is not installed (pip install 'saecache-gym[fast]')"
    policy = cache.policy
    twin = twin_class(policy)
    if twin is None:
        return f"policy {policy.name!r} ({type(policy).__name__}) has no compiled engine"
    why = twin.reason(policy)
    if why is not None:
        return why
    if cache.observer is not None:
        return "the cache has an observer (the compiled engine reports no per-block events)"
    if cache.capacity >= MAX_REFS or cache.ghost_capacity >= MAX_REFS:
        return "the capacity does not fit 32-bit slot numbers"
    if server is not None:
        return srv.server_reason(server)
    return None


def trace_reason(trace: Trace, keys: KeyTable, twin: type[Twin], timed: bool) -> str | None:
    """Why the compiled engine cannot replay ``trace`` (None if it can)."""
    if trace.n_blocks + trace.n_output_blocks >= MAX_REFS or len(trace) >= MAX_REFS:
        return f"the trace has {MAX_REFS} references or more"
    if keys.repeats:
        return "a request of the trace names one key twice"
    if (twin.chained or timed) and not keys.chained:
        return ("a key of the trace follows different keys or sits at different positions in different requests "
                "(not prefix-chained keys)")
    return None


class FastEngine:
    """Compiled state of one replay. Build it with :meth:`build`, then :meth:`load` a cache."""

    def __init__(self, trace: Trace, cache: PrefixCache, keys: KeyTable, server: Any = None):
        self.trace = trace
        self.keys = keys
        self.capacity = cache.capacity
        self.ghost_capacity = max(0, cache.ghost_capacity)
        self.cache_outputs = bool(cache.cache_outputs)
        self.timed = server is not None
        self.server = server
        self.twin: Twin = twin_class(cache.policy)(cache.policy, trace, cache.capacity, keys)
        self.types = np.concatenate([trace.prompt_types, trace.output_types])
        lens = np.diff(trace.prompt_offsets) + np.diff(trace.output_offsets)
        self._max_path = int(lens.max()) if lens.size else 0
        self.core: loop.Core | None = None
        self.sv = srv.new_server(server, trace, self.timed)
        # wall-clock seconds of run_window spent in the twin's prepare (a policy's per-window work ahead of the
        # compiled loop: SAECache's arrivals and continuation model), part of the replay's wall_s
        self.prepare_s = 0.0

    @classmethod
    def build(cls, trace: Trace, cache: PrefixCache, server: Any = None) -> tuple[FastEngine | None, str | None]:
        """The engine for ``trace`` through ``cache`` (and ``server`` in timed mode), or None and why not."""
        why = unsupported_reason(cache, server)
        if why is not None:
            return None, why
        if trace.n_blocks + trace.n_output_blocks >= MAX_REFS or len(trace) >= MAX_REFS:
            return None, f"the trace has {MAX_REFS} references or more"
        keys = KeyTable(trace)
        why = trace_reason(trace, keys, twin_class(cache.policy), server is not None)
        if why is not None:
            return None, why
        return cls(trace, cache, keys, server), None

    # -- the state contract --------------------------------------------------------------------------------------
    def load(self, cache: PrefixCache, timed: TimedState | None = None) -> None:
        """Take the state of ``cache`` and its policy (which keep it too, stale, until :meth:`save`) and, in timed
        mode, the replay's in-flight requests, completion events and server state."""
        state, blocks = export_cache(cache)
        index = {b.key: i for i, b in enumerate(blocks)}
        pstate = cache.policy.export_state(index)
        n = len(state)
        if n > self.capacity:
            raise RuntimeError(f"the cache holds {n} blocks, more than its capacity {self.capacity}")
        block_ids = self.keys.ids_of(state.keys)
        ghost_ids = self.keys.ids_of(state.ghost_keys)
        self.twin.map_keys(pstate)
        c = self.capacity
        rec = np.zeros((c, loop.NCOL), dtype=np.int32)
        for col, values in ((loop.KEY, block_ids), (loop.PARENT, state.parent), (loop.NCHILD, state.n_children),
                            (loop.HITS, state.hits), (loop.BTYPE, state.types), (loop.PIN, state.pins),
                            (loop.DEPTH, state.depth), (loop.QUEUE, state.queue)):
            rec[:n, col] = values
        recf = rec.view(np.float64)
        recf[:n, loop.LAST] = state.last_access
        slot_of = np.full(len(self.keys), -1, dtype=np.int32)
        slot_of[block_ids] = np.arange(n, dtype=np.int32)
        g = 2 * self.ghost_capacity + 2 if self.ghost_capacity else 1
        gid = np.full(g, -1, dtype=np.int32)
        gty = np.zeros(g, dtype=np.uint8)
        k = ghost_ids.size
        gid[:k], gty[:k] = ghost_ids, state.ghost_codes
        slot_of[ghost_ids] = -2 - np.arange(k, dtype=np.int32)
        sc = np.zeros(loop.N_SCALARS, dtype=np.int64)
        sc[loop.N], sc[loop.GHEAD], sc[loop.GLIVE] = n, k, k
        tr = self.trace
        self.core = loop.Core(
            po=tr.prompt_offsets, oo=tr.output_offsets, ids=self.keys.ids, types=self.types, t=tr.t,
            n_pr=int(tr.n_blocks), capacity=c, ghost_cap=self.ghost_capacity, cache_outputs=self.cache_outputs,
            rec=rec, recf=recf, slot_of=slot_of, gid=gid, gty=gty, sc=sc,
            occ=np.bincount(state.types, minlength=N_TOKEN_TYPES).astype(np.int64),
            cnt=np.zeros(loop.N_COUNTERS, dtype=np.int64), path=np.zeros(max(1, self._max_path), dtype=np.int32))
        self.twin.load(pstate, n, self.core)
        if self.timed:
            self._load_timed(timed, index)
        elif state.pins.any():
            raise RuntimeError("blocks are pinned between the windows of an instant replay")

    def _load_timed(self, timed: TimedState | None, index: dict[int, int]) -> None:
        sv = self.sv
        srv.reset_server(sv)
        if timed is None:
            return
        srv.load_server(sv, timed.server, self.trace.t)
        for i, path in timed.inflight.items():
            for d, b in enumerate(path):
                if d and b.parent is not path[d - 1]:
                    raise ValueError("a request in flight holds blocks that are not one chain")
            sv.held[i] = index[path[-1].key] if path else -1
            sv.held_len[i] = len(path)
        for t, i, _ in timed.events:
            srv.push_event_py(sv, t, i)

    def save(self, cache: PrefixCache) -> TimedState | None:
        """Write the state back into ``cache`` (emptied first) and its policy; in timed mode, return the replay's
        in-flight requests, events and server state."""
        core = self.core
        n = len(self)
        rec = core.rec[:n]
        lo, hi = int(core.sc[loop.GTAIL]), int(core.sc[loop.GHEAD])
        live = core.gid[lo:hi] >= 0
        i64 = np.int64
        state = CacheState(
            keys=self.keys.uniq[rec[:, loop.KEY]], parent=rec[:, loop.PARENT].astype(i64),
            depth=rec[:, loop.DEPTH].astype(i64), n_children=rec[:, loop.NCHILD].astype(i64),
            pins=rec[:, loop.PIN].astype(i64), types=rec[:, loop.BTYPE].astype(i64),
            queue=rec[:, loop.QUEUE].astype(i64), hits=rec[:, loop.HITS].astype(i64),
            last_access=core.recf[:n, loop.LAST].copy(), ghost_keys=self.keys.uniq[core.gid[lo:hi][live]],
            ghost_codes=core.gty[lo:hi][live].astype(i64))
        cache.blocks = {}
        cache.ghosts.clear()
        blocks = import_cache(cache, state)
        cache.policy.import_state(self.twin.export(n, core), blocks)
        if not self.timed:
            return None
        sv = self.sv
        inflight = {}
        for i in np.flatnonzero(sv.held != srv.NOT_HELD).tolist():
            path, s = [], int(sv.held[i])
            for _ in range(int(sv.held_len[i])):
                path.append(blocks[s])
                s = int(rec[s, loop.PARENT])
            inflight[i] = path[::-1]
        k = int(sv.si[srv.EVSIZE])
        events = [(t, i, 0) for t, i in zip(sv.ev_t[:k].tolist(), sv.ev_i[:k].tolist(), strict=True)]
        return TimedState(srv.save_server(sv, self.trace.t), inflight, events)

    # -- replay ----------------------------------------------------------------------------------------------
    def run_window(self, a: int, b: int) -> tuple[np.ndarray, WindowCounts, list[float], list[float]]:
        """Serve requests ``a .. b-1``; returns the hit blocks per request, the window's counters and (timed mode)
        the TTFTs and queueing delays (ms) recorded during the window."""
        hits = np.empty(b - a, dtype=np.int64)
        core, sv = self.core, self.sv
        core.cnt[:] = 0
        self.twin.begin_window()
        t0 = time.perf_counter()
        self.twin.prepare(a, b)
        self.prepare_s += time.perf_counter() - t0
        if self.timed:
            sv.si[srv.NOUT] = 0
        run = kernel("run_window", type(self.twin.state), TIMED=self.timed)
        run(core, self.twin.state, sv, a, b, hits, b == len(self.trace))
        cnt = core.cnt
        by_queue = cnt[loop.MAEQ:loop.MAEO].tolist()
        counts = WindowCounts(int(cnt[loop.EVICTIONS]), int(cnt[loop.BYPASSES]), int(cnt[loop.INSERTED]),
                              cnt[loop.MAE:loop.MAEQ].tolist(), {q: c for q, c in enumerate(by_queue) if c},
                              int(cnt[loop.MAEO]))
        if not self.timed:
            return hits, counts, [], []
        k = int(sv.si[srv.NOUT])
        return hits, counts, sv.ttft_out[:k].tolist(), sv.queue_out[:k].tolist()

    def __len__(self) -> int:
        return int(self.core.sc[loop.N])

    def occupancy_by_queue(self) -> dict[int, int]:
        return self.twin.occupancy_by_queue(len(self))

    @property
    def occupancy_by_type(self) -> list[int]:
        return self.core.occ.tolist()

    def window_stats(self) -> dict[str, Any]:
        return self.twin.window_stats()

    @property
    def nbytes(self) -> int:
        """Bytes of the cache state (slot rows, ghosts, per-key slots and keys, the policy's arrays; not the
        per-reference ids and types, which belong to the trace)."""
        core = self.core
        own = (core.rec, core.slot_of, core.gid, core.gty, core.sc, core.occ, core.cnt, core.path)
        return sum(a.nbytes for a in own) + self.keys.uniq.nbytes + self.twin.nbytes
