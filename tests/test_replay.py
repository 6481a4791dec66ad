"""Tests of sae_env.replay with the serving model: the timed event loop against the reference (same events, same
hits, same TTFTs), window statistics (sums, time windows, determinism), and TTFT sanity (present only in timed
mode, never below the request's own prefill cost, lower with more hits)."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
from conftest import BS, build_trace, prefix_traces
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_cache import reference_replay_timed

from sae_env.cache import PrefixCache
from sae_env.metrics import summarize
from sae_env.policies import make_policy, policy_names
from sae_env.policies.lru import LRUPolicy
from sae_env.replay import Replay, replay
from sae_env.serving import make_server

SERVER = "qwen2.5-1.5b@a40"
DIFF = ("lru", "lfu", "fifo", "belady")


def timed(trace, name: str, capacity: int, **kw) -> Replay:
    kw.setdefault("window_requests", 1)
    return replay(trace, make_policy(name), capacity, server=make_server(SERVER), check=True, **kw)


def ttfts(r: Replay) -> list[float]:
    """Every TTFT in emission order; the server's FIFO guarantee makes that the arrival order."""
    return [x for w in r.windows for x in w.ttft_ms]


# ----------------------------------------------------------------------------------------------------------------
# The timed loop against the reference (the reference drives its own PrefillServer in the documented order)


@pytest.mark.parametrize("name", DIFF)
@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(timed=True), capacity=st.integers(1, 30))
def test_timed_matches_reference(name, trace, capacity):
    r = timed(trace, name, capacity)
    ref = reference_replay_timed(trace, name, capacity, make_server(SERVER))
    assert [w.hit_blocks for w in r.windows] == ref.hits
    assert [w.evictions for w in r.windows] == [c.evictions for c in ref.counters]
    assert [w.bypasses for w in r.windows] == [c.bypasses for c in ref.counters]
    assert [w.inserted for w in r.windows] == [c.inserted for c in ref.counters]
    assert [w.ttft_ms for w in r.windows] == ref.ttft_windows
    assert ttfts(r) == [ref.ttft_ms[i] for i in range(len(trace))]  # emitted in arrival order
    assert set(r.to_python().blocks) == ref.cached


def test_timed_overlap_pins_blocks_and_bypasses():
    """Two 3-block requests arrive together into a 4-block cache: the second hits nothing of the first (other
    prefix) and finds everything pinned after one insertion; in instant mode it would evict and fit."""
    trace = build_trace([[0, 1, 2], [1, 2, 0]], times=[0.0, 0.0], tails=[1, 1], out_extra=[20, 20])
    r = timed(trace, "lru", 4)
    assert [w.bypasses for w in r.windows] == [0, 2]
    inst = replay(trace, make_policy("lru"), 4, window_requests=1, check=True)
    assert [w.bypasses for w in inst.windows] == [0, 0]


def _belady_overlap_trace():
    # (prompt contents, output contents, gap to the previous arrival, extra output tokens)
    reqs = [([0], [], 0.0, 1), ([0], [0], 0.0, 1), ([0], [0], 0.0, 20), ([1], [], 0.0, 1), ([0, 1], [0, 0], 0.0, 1),
            ([0], [], 0.3, 1), ([0, 0], [], 0.0, 1)]
    return build_trace([r[0] for r in reqs], [r[1] for r in reqs], times=np.cumsum([r[2] for r in reqs]),
                       out_extra=[r[3] for r in reqs])


def test_belady_next_use_past_the_frontier_follows_the_key():
    """Requests 1 and 2 both output AA (= A then 0); request 1 completes after request 4 was admitted, so AA's
    next use must lie after request 4: request 6's prompt A-AA. Belady's skip-ahead reads the next use at
    prompt position (2, depth 1), but request 2 has one prompt block, so it reads request 3's block B instead
    (never used again): AA looks dead and is evicted, and request 6 hits 1 block instead of 2."""
    trace = _belady_overlap_trace()
    ref = reference_replay_timed(trace, "belady", 5, make_server(SERVER))
    assert ref.hits == [0, 1, 1, 0, 1, 1, 2]
    r = timed(trace, "belady", 5)
    assert [w.hit_blocks for w in r.windows] == ref.hits


def test_belady_timed_with_prompts_shorter_than_a_block():
    """Two overlapping requests whose prompts hold no full block and whose (identical) output is one block: the
    output's next use (request 1) is already admitted when request 0 completes; the skip-ahead indexes the
    prompt arrays at (1, depth 0), which do not exist."""
    trace = build_trace([[], []], [[1], [1]], times=[0.0, 0.001], out_extra=[20, 20])
    r = timed(trace, "belady", 4)
    assert [w.hit_blocks for w in r.windows] == [0, 0] and len(r.to_python()) == 1


# ----------------------------------------------------------------------------------------------------------------
# TTFT


def test_ttft_only_in_timed_mode():
    trace = build_trace([[0, 1], [0, 1, 2], [3]], times=[0.0, 0.01, 0.02])
    inst = replay(trace, make_policy("lru"), 10, window_requests=2)
    assert all(w.ttft_ms == [] and w.ttft_mean_ms is None and w.ttft_percentile(50) is None for w in inst.windows)
    s = summarize(inst.windows)
    assert s["ttft_mean_ms"] is None and s["ttft_p99_ms"] is None
    same = replay(trace, make_policy("lru"), 10, server=make_server("instant"), window_requests=2)
    assert [w.to_dict() for w in same.windows] == [w.to_dict() for w in inst.windows]
    t = replay(trace, make_policy("lru"), 10, server=make_server(SERVER), window_requests=2)
    assert sum(len(w.ttft_ms) for w in t.windows) == 3
    s = summarize(t.windows)
    assert s["ttft_mean_ms"] > 0 and s["ttft_p50_ms"] <= s["ttft_p99_ms"]


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=15, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(timed=True), capacity=st.integers(1, 30))
def test_ttft_never_below_the_requests_own_prefill(name, trace, capacity):
    server = make_server(SERVER)
    r = replay(trace, make_policy(name), capacity, server=server, window_requests=1)
    for i, (w, ttft) in enumerate(zip(r.windows, ttfts(r), strict=True)):
        p = int(trace.prompt_tokens[i])
        cached = min(w.hit_blocks * BS, p)
        new = p - cached
        own = server.prefill_time(new, cached) if new else server.prefill_time(1, max(cached - 1, 0))
        assert ttft >= own * 1e3 * (1 - 1e-9), f"request {i}"
    assert all(q >= 0 for w in r.windows for q in w.queue_ms)


def test_repeated_prompts_get_faster():
    """The same 2,000-token prompt every 10 s (no queueing): the first is a full prefill, the rest full hits."""
    n = 5
    prompts = [list(range(125))] * n  # 125 blocks of 16 = 2,000 tokens
    trace = build_trace(prompts, [[]] * n, times=10.0 * np.arange(n), out_extra=[10] * n)
    r = timed(trace, "lru", 200)
    t = ttfts(r)
    assert [w.hit_blocks for w in r.windows] == [0] + [125] * (n - 1)
    assert all(x < t[0] / 2 for x in t[1:])
    assert len(set(t[1:])) == 1  # identical situations, identical times
    # distinct prompts of the same length (another first block): no hits, every request pays the full prefill
    other = build_trace([[1000 + k] + list(range(124)) for k in range(n)], [[]] * n, times=10.0 * np.arange(n),
                        out_extra=[10] * n)
    r = timed(other, "lru", 200)
    assert [w.hit_blocks for w in r.windows] == [0] * n
    assert ttfts(r) == pytest.approx([t[0]] * n)


def test_more_cache_never_slows_spaced_requests():
    """Requests 1 s apart never queue, so each TTFT is its own prefill: more hits, no higher TTFT, request by
    request. A 50-block cache keeps only the shared 100-block prefix's first half; a large one keeps it all."""
    rng = np.random.default_rng(5)
    prompts = [[0] * 100 + [int(x) for x in rng.integers(0, 3, size=5)] for _ in range(30)]
    trace = build_trace(prompts, [[]] * 30, times=np.arange(30.0), out_extra=[5] * 30)
    small, big = timed(trace, "lru", 50), timed(trace, "lru", 1000)
    hs, hb = [w.hit_blocks for w in small.windows], [w.hit_blocks for w in big.windows]
    assert hs == [0] + [50] * 29 and all(h >= 100 for h in hb[1:])
    for s, b, x, y in zip(hs, hb, ttfts(small), ttfts(big), strict=True):
        assert y <= x * (1 + 1e-12) if b >= s else y >= x
    assert sum(ttfts(big)) < 0.5 * sum(ttfts(small))


# ----------------------------------------------------------------------------------------------------------------
# Windows


SUM_KEYS = ("requests", "prompt_tokens", "hit_tokens", "prompt_blocks", "hit_blocks", "evictions", "bypasses",
            "inserted", "miss_after_eviction", "token_hit_rate", "block_hit_rate", "hit_rate_by_type",
            "miss_after_eviction_by_type", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "queue_mean_ms")


@pytest.mark.parametrize("mode", ["instant", "timed"])
@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=15, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(timed=True), capacity=st.integers(1, 30), window=st.integers(1, 7))
def test_window_sums_equal_whole_run_totals(mode, name, trace, capacity, window):
    def run(w):
        server = make_server(SERVER) if mode == "timed" else None
        return replay(trace, make_policy(name), capacity, server=server, window_requests=w)

    parts, whole = run(window), run(len(trace))
    assert len(parts.windows) == math.ceil(len(trace) / window) and len(whole.windows) == 1
    a, b = summarize(parts.windows), summarize(whole.windows)
    for k in SUM_KEYS:
        assert a[k] == b[k], k
    assert sum(w.requests for w in parts.windows) == len(trace)
    assert parts.windows[-1].occupancy == whole.windows[-1].occupancy == len(whole.to_python())
    for field in ("refs_by_type", "hits_by_type", "refs_by_offset", "hits_by_offset", "app_mix"):
        assert np.sum([getattr(w, field) for w in parts.windows], axis=0).tolist() == getattr(whole.windows[0], field)
    assert [w.index for w in parts.windows] == list(range(len(parts.windows)))
    if mode == "instant":
        assert a["ttft_mean_ms"] is None


def test_window_seconds():
    times = [0.0, 0.5, 0.99, 1.0, 3.2, 3.3, 7.0]
    trace = build_trace([[i] for i in range(7)], times=times)
    r = replay(trace, make_policy("lru"), 10, window_seconds=1.0)
    assert [w.requests for w in r.windows] == [3, 1, 2, 1]  # [0,1) [1,2) [3,4) [7,8); empty windows skipped
    assert [(w.t_start, w.t_end) for w in r.windows] == [(0.0, 0.99), (1.0, 1.0), (3.2, 3.3), (7.0, 7.0)]
    r2 = replay(trace.with_times(np.asarray(times) + 100.0), make_policy("lru"), 10, window_seconds=2.5)
    assert [w.requests for w in r2.windows] == [4, 2, 1]  # windows start at the first arrival


def test_window_callbacks_and_stepping():
    trace = build_trace([[0, 1]] * 5)
    seen = []
    r = Replay(trace, PrefixCache(4, make_policy("lru")), window_requests=2,
               callbacks=[lambda w, rep: seen.append((w.index, w.requests, rep.next_request))])
    first = r.step()
    assert first.requests == 2 and not r.done
    rest = r.run()
    assert r.done and rest == r.windows and len(rest) == 3
    assert seen == [(0, 2, 2), (1, 2, 4), (2, 1, 5)]
    with pytest.raises(RuntimeError):
        r.step()


@pytest.mark.parametrize("collecting", [True, False])
def test_no_garbage_collection_inside_a_window(collecting):
    """wall_s never holds a cyclic collection triggered by earlier work: the collector is paused while a window
    replays and left as it was after, also when the policy raises."""
    seen = []

    class Spy(LRUPolicy):
        def on_request(self, trace, i, now):
            seen.append(gc.isenabled())
            if i == 3:
                raise KeyError("spy")

    was = gc.isenabled()
    try:
        gc.enable() if collecting else gc.disable()
        r = Replay(build_trace([[0, 1]] * 5), PrefixCache(4, Spy()), window_requests=2)
        r.step()
        assert seen == [False, False] and gc.isenabled() is collecting
        with pytest.raises(KeyError, match="spy"):
            r.step()
        assert seen == [False] * 4 and gc.isenabled() is collecting
    finally:
        gc.enable() if was else gc.disable()


@pytest.mark.parametrize("kw", [{"window_requests": 0}, {"window_requests": True}, {"window_seconds": 0.0},
                                {"window_seconds": float("inf")}, {"window_requests": 5, "window_seconds": 1.0}])
def test_bad_windows_raise(kw):
    trace = build_trace([[0]])
    with pytest.raises(ValueError):
        Replay(trace, PrefixCache(4, make_policy("lru")), **kw)


@pytest.mark.parametrize("mode", ["instant", "timed"])
@pytest.mark.parametrize("name", policy_names())
def test_replays_are_deterministic(mode, name):
    rng = np.random.default_rng(11)
    prompts = [[int(x) for x in rng.integers(0, 3, size=rng.integers(0, 8))] for _ in range(150)]
    outputs = [[int(x) for x in rng.integers(0, 3, size=rng.integers(0, 3))] for _ in range(150)]
    times = np.cumsum(rng.exponential(0.02, size=150))
    trace = build_trace(prompts, outputs, times=times, tails=[5] * 150, out_extra=[7] * 150)

    def run():
        server = make_server(SERVER) if mode == "timed" else None
        return replay(trace, make_policy(name), 12, server=server, window_requests=20).windows

    a, b = run(), run()
    assert a == b  # dataclass equality: every count, occupancy, TTFT sample and policy statistic
    assert sum(w.evictions for w in a) > 0
    if mode == "timed":
        assert sum(len(w.ttft_ms) for w in a) == 150
