"""The replay loop: trace x cache x policy x server -> one :class:`~sae_env.metrics.WindowStats` per window.

One deterministic event loop, window by window (``window_requests`` requests, or the requests arriving within
``window_seconds`` of trace time). Per request, in arrival order:

1. events due by the arrival time are applied first: first tokens out of the prefill server (TTFT recorded), then
   completions (``t_first_token + decode time``), which insert output blocks and unpin the request's blocks;
2. the policy hears the request (``on_request``: its semantic context);
3. the cache admits it (hit = longest cached prefix; the rest inserted, evicting while full) and pins its blocks;
4. the server is given ``new_tokens = prompt_tokens - hit_tokens`` to prefill after ``hit_tokens`` cached ones.

In ``instant`` mode no time passes: each request completes at its arrival (outputs inserted, blocks unpinned) before
the next one arrives; TTFT is not defined. Time is the trace clock only; ``wall_s`` (decision overhead) is measured
separately and never enters the statistics. Python's cyclic garbage collector is paused while a window replays, as
``timeit`` pauses it: a collection is triggered by the allocations of the whole process so far, so one falling in a
window charged the garbage of earlier work (another policy's replay) to this one's ``wall_s``. The window's own cyclic
garbage is collected after it. No gymnasium here: :mod:`sae_env.env` adapts this loop.

Two engines run the loop with identical results: the generic Python one (any policy, any hooks, the readable
reference) and a compiled one (:mod:`sae_env.fast_engine`, needs numba) for every policy with a compiled twin, in
instant and timed mode. ``engine="auto"`` (the default) takes the compiled one whenever it applies; ``"python"`` and
``"fast"`` force one. The state moves between them only when asked, after any window: :meth:`Replay.to_python`
writes the compiled state into the Python cache and policy (the replay goes on on the Python engine; e.g. to inspect
``replay.cache.blocks``), :meth:`Replay.to_fast` takes it back. While the compiled engine holds the state,
:attr:`Replay.cache` refuses to give the (stale) Python cache.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from sae_env import fast_engine
from sae_env.cache import PrefixCache
from sae_env.metrics import OFFSET_BUCKETS, WindowStats, offset_bucket_edges
from sae_env.policies.base import EvictionPolicy
from sae_env.serving import Server
from sae_env.trace import N_APP_TYPES, N_TOKEN_TYPES, Trace

__all__ = ["ENGINES", "Replay", "WindowCallback", "replay"]

WindowCallback = Callable[[WindowStats, "Replay"], None]

_EDGES = offset_bucket_edges()

ENGINES = ("auto", "python", "fast")


class Replay:
    """Replays ``trace`` through ``cache`` (and its policy) and an optional prefill ``server``.

    Args:
        trace: the requests, in arrival order.
        cache: a fresh :class:`PrefixCache` with its policy.
        server: a server from :func:`sae_env.serving.make_server`; ``None`` or an instant server = instant mode.
        window_requests: requests per window (default 1000 when neither window is given).
        window_seconds: trace seconds per window (windows with no arrival are skipped).
        callbacks: called as ``callback(stats, replay)`` after every window (online learners use this).
        check: call ``cache.check_invariants()`` after every request (slow; for tests; implies the Python engine).
        engine: ``"auto"`` (compiled engine when it applies), ``"python"`` or ``"fast"`` (ValueError saying why if
            it cannot run this replay). :attr:`engine` tells which one runs.
    """

    def __init__(self, trace: Trace, cache: PrefixCache, server: Server | None = None, *,
                 window_requests: int | None = None,
                 window_seconds: float | None = None, callbacks: list[WindowCallback] | tuple = (),
                 check: bool = False, engine: str = "auto"):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")
        if window_requests is not None and window_seconds is not None:
            raise ValueError("give window_requests or window_seconds, not both")
        if window_requests is None and window_seconds is None:
            window_requests = 1000
        if window_requests is not None and (isinstance(window_requests, bool) or int(window_requests) < 1):
            raise ValueError(f"window_requests must be >= 1, got {window_requests}")
        if window_seconds is not None and not (window_seconds > 0 and math.isfinite(window_seconds)):
            raise ValueError(f"window_seconds must be positive, got {window_seconds}")
        self.trace = trace
        self._cache = cache
        self.policy = cache.policy
        self.server = server if server is not None and server.timed else None
        self.window_requests = None if window_requests is None else int(window_requests)
        self.window_seconds = window_seconds
        self.callbacks = list(callbacks)
        self.check = check
        self.block_size = trace.block_size
        self.next_request = 0
        self.windows: list[WindowStats] = []
        # wall-clock seconds spent replaying (decision overhead), never in the statistics; the cyclic garbage
        # collector is paused meanwhile (module docstring)
        self.wall_s = 0.0
        self._events: list[tuple[float, int, int]] = []  # (completion time, request, 0) for in-flight requests
        self._inflight: dict[int, list] = {}  # request -> pinned path
        self._pending_ttft: list[float] = []
        self._pending_queue: list[float] = []
        self._has_ctx = self.policy.overrides("on_request")
        self._has_done = self.policy.overrides("on_complete")
        self.policy.bind(trace)
        self._fast: fast_engine.FastEngine | None = None  # holds the state while set
        self._engine: fast_engine.FastEngine | None = None  # built once, kept for to_fast
        self.fast_reason: str | None = None  # why the compiled engine cannot run this replay (None: it can)
        self.ran_on: str | None = None  # replay(): the engine that ran it (its state is on the Python objects now)
        if engine != "python":
            self.to_fast(required=engine == "fast")

    # -- engines -------------------------------------------------------------------------------------------
    @property
    def prepare_s(self) -> float | None:
        """The part of :attr:`wall_s` the compiled engine spent in its policy's per-window work ahead of the
        compiled loop (the twin's ``prepare``: SAECache's arrivals and continuation model); None where the compiled
        engine never ran (the Python engine does that work inside each request)."""
        return self._engine.prepare_s if self._engine is not None else None

    @property
    def engine(self) -> str:
        """The engine that replays the next window: ``"fast"`` (compiled) or ``"python"``."""
        return "fast" if self._fast is not None else "python"

    def to_python(self) -> PrefixCache:
        """Hand the state to the Python engine (if the compiled one holds it) and return the cache: the rest of the
        replay runs on the Python engine until :meth:`to_fast`."""
        if self._fast is not None:
            timed = self._fast.save(self._cache)
            if timed is not None:
                self.server.import_state(timed.server)
                self._inflight = timed.inflight
                self._events = timed.events
                heapq.heapify(self._events)
            self.policy.watch_params(None)
            self._fast = None
        return self._cache

    def to_fast(self, required: bool = False) -> bool:
        """Hand the state to the compiled engine where it can run this replay; returns whether it holds the state
        now. ``required``: raise ValueError saying why it cannot."""
        if self._fast is None:
            why = self._why_not_fast()
            if why is None and self._engine is None:
                self._engine, why = fast_engine.FastEngine.build(self.trace, self._cache, self.server)
            if why is None:
                timed = None
                if self.server is not None:
                    timed = fast_engine.TimedState(self.server.export_state(), self._inflight, self._events)
                self._engine.load(self._cache, timed)
                self._fast = self._engine
                self.policy.watch_params(self._fast.twin.params_changed)
            self.fast_reason = why
            if why is not None and required:
                raise ValueError(f"engine='fast' cannot run this replay: {why}")
        return self._fast is not None

    def _why_not_fast(self) -> str | None:
        if self.check:
            return "check=True needs the Python cache after every request"
        return fast_engine.unsupported_reason(self._cache, self.server)

    # -- public --------------------------------------------------------------------------------------------
    @property
    def cache(self) -> PrefixCache:
        """The cache, while the Python engine holds the state (:meth:`to_python` hands it over)."""
        if self._fast is not None:
            raise RuntimeError("the compiled engine holds the cache state: call replay.to_python() to hand it to "
                               "the Python cache (the replay then goes on on the Python engine)")
        return self._cache

    @property
    def capacity(self) -> int:
        return self._cache.capacity

    @property
    def engine_nbytes(self) -> int | None:
        """Bytes of the compiled engine's cache state while it holds the state (None otherwise)."""
        return None if self._fast is None else self._fast.nbytes

    @property
    def occupancy(self) -> int:
        """Blocks cached now, on either engine."""
        return len(self._fast) if self._fast is not None else len(self._cache)

    @property
    def done(self) -> bool:
        return self.next_request >= len(self.trace)

    def __iter__(self) -> Iterator[WindowStats]:
        while not self.done:
            yield self.step()

    def run(self, progress: bool = False, desc: str | None = None) -> list[WindowStats]:
        """Replay every remaining window; ``progress`` shows a bar over requests."""
        if not progress:
            for _ in self:
                pass
            return self.windows
        from tqdm import tqdm

        with tqdm(total=len(self.trace), initial=self.next_request, unit="req", desc=desc or self.policy.name,
                  leave=False) as bar:
            for w in self:
                bar.update(w.requests)
        return self.windows

    def step(self) -> WindowStats:
        """Replay the next window and return its statistics."""
        if self.done:
            raise RuntimeError("the replay is finished; build a new one to start again")
        a = self.next_request
        b = self._window_end(a)
        self.policy.reset_window()
        collecting = gc.isenabled()
        gc.disable()  # no cyclic collection inside wall_s (see wall_s)
        try:
            start = time.perf_counter()
            if self._fast is not None:
                fast = self._fast
                # hits: an array, which _stats turns into the list WindowStats keeps
                hits, c, ttft, queue = fast.run_window(a, b)
                self._pending_ttft.extend(ttft)
                self._pending_queue.extend(queue)
                counts = (c.evictions, c.bypasses, c.inserted, c.mae_by_type, c.mae_output, fast.occupancy_by_type,
                          len(fast))
                mae_by_queue, by_queue = c.mae_by_queue, fast.occupancy_by_queue()
            else:
                cache = self._cache
                cache.reset_counters()
                hits = self._replay_timed(a, b) if self.server is not None else self._replay_instant(a, b)
            self.next_request = b
            if self.done and self.server is not None and self._fast is None:
                self._finish()
            self.wall_s += time.perf_counter() - start
        finally:
            if collecting:
                gc.enable()
        if self._fast is None:
            counts = (cache.evictions, cache.bypasses, cache.inserted, list(cache.miss_after_eviction),
                      cache.output_miss_after_eviction, list(cache.occupancy_by_type), len(cache))
            mae_by_queue = dict(cache.miss_after_eviction_queue)
            by_queue = self.policy.occupancy_by_queue()
        stats = self._stats(a, b, hits, counts, mae_by_queue, by_queue)
        self.windows.append(stats)
        for cb in self.callbacks:
            cb(stats, self)
        return stats

    # -- the loops -----------------------------------------------------------------------------------------
    def _window_end(self, a: int) -> int:
        n = len(self.trace)
        if self.window_requests is not None:
            return min(n, a + self.window_requests)
        t = self.trace.t
        edge = t[0] + self.window_seconds * (math.floor((t[a] - t[0]) / self.window_seconds) + 1)
        return max(a + 1, int(np.searchsorted(t, edge, side="left")))

    def _slices(self, a: int, b: int):
        tr = self.trace
        pa, pb = tr.prompt_offsets[a], tr.prompt_offsets[b]
        oa, ob = tr.output_offsets[a], tr.output_offsets[b]
        return ((tr.prompt_offsets[a:b + 1] - pa).tolist(), tr.prompt_keys[pa:pb].tolist(),
                tr.prompt_types[pa:pb].tolist(), (tr.output_offsets[a:b + 1] - oa).tolist(),
                tr.output_keys[oa:ob].tolist(), tr.output_types[oa:ob].tolist(), tr.t[a:b].tolist())

    def _replay_instant(self, a: int, b: int) -> list[int]:
        po, pk, pt, oo, ok, ot, times = self._slices(a, b)
        trace, cache, policy, check = self.trace, self._cache, self.policy, self.check
        serve = cache.serve
        on_request = policy.on_request if self._has_ctx else None
        on_complete = policy.on_complete if self._has_done else None
        hits = [0] * (b - a)
        empty = ()
        for j in range(b - a):
            now = times[j]
            s, e = po[j], po[j + 1]
            if on_request is not None:
                on_request(trace, a + j, now)
            os_, oe = oo[j], oo[j + 1]
            # The policy must hear about the completion before the outputs are inserted: serve calls it between.
            h = serve(pk[s:e], pt[s:e], ok[os_:oe] if oe > os_ else empty, ot[os_:oe] if oe > os_ else empty, now,
                      None if on_complete is None else partial(on_complete, trace, a + j, now))
            hits[j] = h
            if check:
                cache.check_invariants()
        return hits

    def _replay_timed(self, a: int, b: int) -> list[int]:
        po, pk, pt, oo, ok, ot, times = self._slices(a, b)
        trace, cache, policy, server = self.trace, self._cache, self.policy, self.server
        prompt_tokens = trace.prompt_tokens[a:b].tolist()
        bs = self.block_size
        hits = [0] * (b - a)
        for j in range(b - a):
            now = times[j]
            self._apply_events(now)
            i = a + j
            s, e = po[j], po[j + 1]
            if self._has_ctx:
                policy.on_request(trace, i, now)
            path, h = cache.admit(pk[s:e], pt[s:e], now)
            hits[j] = h
            self._inflight[i] = path
            cached = min(h * bs, prompt_tokens[j])
            server.submit(i, now, prompt_tokens[j] - cached, cached)
            if self.check:
                cache.check_invariants()
        return hits

    def _apply_events(self, now: float) -> None:
        """First tokens due by ``now`` (TTFT recorded), then completions due by ``now`` (outputs, unpins)."""
        server, events = self.server, self._events
        for c in server.advance_to(now):
            self._first_token(c)
        while events and events[0][0] <= now:
            t_done, i, _ = heapq.heappop(events)
            self._complete(i, t_done)

    def _first_token(self, c) -> None:
        i = c.req_id
        trace = self.trace
        self._pending_ttft.append((c.t_first_token - trace.t[i]) * 1e3)
        self._pending_queue.append(c.queue_delay * 1e3)
        decode = self.server.decode_time(int(trace.output_tokens[i]),
                                         int(trace.prompt_tokens[i] + trace.output_tokens[i]))
        heapq.heappush(self._events, (c.t_first_token + decode, i, 0))

    def _complete(self, i: int, now: float) -> None:
        trace = self.trace
        if self._has_done:
            self.policy.on_complete(trace, i, now)
        path = self._inflight.pop(i)
        oa, ob = trace.output_offsets[i], trace.output_offsets[i + 1]
        n_prompt = int(trace.prompt_offsets[i + 1] - trace.prompt_offsets[i])
        self._cache.complete(path, n_prompt, trace.output_keys[oa:ob].tolist(), trace.output_types[oa:ob].tolist(),
                            now)

    def _finish(self) -> None:
        """After the last arrival: every queued prefill and decode runs to completion."""
        for c in self.server.drain():
            self._first_token(c)
        while self._events:
            t_done, i, _ = heapq.heappop(self._events)
            self._complete(i, t_done)
        if self._inflight:
            raise RuntimeError(f"{len(self._inflight)} requests never completed")

    # -- statistics ----------------------------------------------------------------------------------------
    def _stats(self, a: int, b: int, hits: list[int] | np.ndarray, counts: tuple, mae_by_queue: dict[int, int],
               occupancy_by_queue: dict[int, int]) -> WindowStats:
        """``counts``: evictions, bypasses, inserted, misses after eviction by type and on outputs, occupancy by type,
        occupancy."""
        tr = self.trace
        evictions, bypasses, inserted, mae_by_type, mae_output, occupancy_by_type, occupancy = counts
        h = np.asarray(hits, dtype=np.int64)
        if isinstance(hits, np.ndarray):
            hits = hits.tolist()
        n_blocks = np.diff(tr.prompt_offsets[a:b + 1])
        prompt_tokens = tr.prompt_tokens[a:b]
        hit_tokens = np.minimum(h * self.block_size, prompt_tokens)
        # per-type hits: the first h blocks of each request are its hits
        pa, pb = tr.prompt_offsets[a], tr.prompt_offsets[b]
        types = tr.prompt_types[pa:pb]
        pos = np.arange(pb - pa, dtype=np.int64) - np.repeat(tr.prompt_offsets[a:b] - pa, n_blocks)
        is_hit = pos < np.repeat(h, n_blocks)
        refs_by_type = np.bincount(types, minlength=N_TOKEN_TYPES)
        hits_by_type = np.bincount(types[is_hit], minlength=N_TOKEN_TYPES)
        bucket = np.searchsorted(_EDGES, pos, side="right") - 1
        refs_by_offset = np.bincount(bucket, minlength=OFFSET_BUCKETS)
        hits_by_offset = np.bincount(bucket[is_hit], minlength=OFFSET_BUCKETS)
        ttft, queue = self._pending_ttft, self._pending_queue
        self._pending_ttft, self._pending_queue = [], []
        return WindowStats(
            index=len(self.windows), start=a, t_start=float(tr.t[a]), t_end=float(tr.t[b - 1]), requests=b - a,
            prompt_tokens=int(prompt_tokens.sum()), hit_tokens=int(hit_tokens.sum()),
            prompt_blocks=int(n_blocks.sum()), hit_blocks=int(h.sum()), evictions=evictions,
            bypasses=bypasses, inserted=inserted, refs_by_type=refs_by_type.tolist(),
            hits_by_type=hits_by_type.tolist(), miss_after_eviction_by_type=mae_by_type,
            miss_after_eviction_by_queue=mae_by_queue, output_miss_after_eviction=mae_output,
            refs_by_offset=refs_by_offset[:OFFSET_BUCKETS].tolist(),
            hits_by_offset=hits_by_offset[:OFFSET_BUCKETS].tolist(),
            app_mix=np.bincount(tr.app[a:b], minlength=N_APP_TYPES).tolist(), occupancy=occupancy,
            capacity=self._cache.capacity, occupancy_by_queue=occupancy_by_queue,
            occupancy_by_type=occupancy_by_type,
            ttft_ms=ttft, queue_ms=queue, hits_per_request=hits,
            policy=self._fast.window_stats() if self._fast is not None else self.policy.window_stats())


def replay(trace: Trace, policy: EvictionPolicy, capacity: int, server: Server | None = None,
           **kwargs: Any) -> Replay:
    """Build a cache for ``policy`` and replay the whole trace; returns the finished :class:`Replay`, its final state
    on the Python objects (``replay.cache``, ``policy``), wherever it ran: a finished replay is inspected, not
    continued (use :class:`Replay` to keep the compiled state, e.g. for speed on large caches).

    ``ghost_capacity`` and ``cache_outputs`` go to :class:`PrefixCache`, ``progress`` to :meth:`Replay.run`, the
    rest (windows, callbacks, ``check``, ``engine``) to :class:`Replay`.
    """
    cache_kw = {k: kwargs.pop(k) for k in ("ghost_capacity", "cache_outputs") if k in kwargs}
    progress = kwargs.pop("progress", False)
    r = Replay(trace, PrefixCache(capacity, policy, **cache_kw), server, **kwargs)
    r.run(progress=progress)
    engine = r.engine
    r.to_python()
    r.ran_on = engine
    return r
