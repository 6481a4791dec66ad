"""The compiled engine (sae_env.fast_engine) against the Python engine: hit for hit, field for field.

Every WindowStats field of every window must be equal (dataclass equality: hits per request, evictions, bypasses,
insertions, misses after eviction by type and queue, occupancy by type and queue, ...), on hypothesis-generated
prefix-sharing traces (small capacities, ghost bounds, outputs on and off, windows by requests or seconds), on
single-block Zipf streams, and on every embedded real trace. The hand-over to the Python engine mid-replay must
rebuild exactly the Python engine's state. Also: which engine ``auto`` picks, and the errors of ``"fast"``.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import build_trace, flat_trace, prefix_traces, zipf_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env import data, fast_engine
from sae_env.cache import PrefixCache
from sae_env.policies import make_policy
from sae_env.policies.lru import LRUPolicy
from sae_env.policies.s3fifo import S3FIFOPolicy
from sae_env.replay import Replay, replay
from sae_env.serving import make_server
from sae_env.sources import open_trace
from sae_env.trace import Trace

pytest.importorskip("numba")

FAST = ("lru", "lfu", "fifo", "s3fifo")


def both(trace: Trace, name: str, capacity: int, **kw) -> tuple[Replay, Replay]:
    """The same replay on the Python engine and on the compiled engine (checked to be the one that ran)."""
    py = replay(trace, make_policy(name), capacity, engine="python", **kw)
    fast = Replay(trace, PrefixCache(capacity, make_policy(name),
                                     **{k: kw[k] for k in ("ghost_capacity", "cache_outputs") if k in kw}),
                  engine="fast", **{k: v for k, v in kw.items() if k not in ("ghost_capacity", "cache_outputs")})
    assert fast.engine == "fast" and py.engine == "python"
    fast.run()
    assert fast.engine == "fast"  # nothing read the cache: the compiled engine ran every window
    return py, fast


def assert_same_windows(py: Replay, fast: Replay) -> None:
    assert len(py.windows) == len(fast.windows)
    for wp, wf in zip(py.windows, fast.windows, strict=True):
        assert wp == wf, {k: (v, getattr(wf, k)) for k, v in vars(wp).items() if getattr(wf, k) != v}


def cache_state(cache: PrefixCache) -> dict:
    """Everything the Python engine's next decision can depend on, in comparable form."""
    policy = cache.policy
    state = {
        "blocks": {k: (b.parent.key if b.parent is not None else None, b.depth, b.n_children, b.pins, b.type, b.queue,
                       b.last_access, b.hits) for k, b in cache.blocks.items()},
        "ghosts": list(cache.ghosts.items()),
        "occupancy_by_type": list(cache.occupancy_by_type),
    }
    if isinstance(policy, LRUPolicy):
        state["free"] = list(policy._free)
    elif isinstance(policy, S3FIFOPolicy):
        state["freq"] = {k: b.pdata for k, b in cache.blocks.items()}
        state["queues"] = (list(policy._small), list(policy._main), sorted(policy._parked), list(policy._ghost),
                           policy._small_target, policy._ghost_size)
    else:
        state["stamps"] = {k: (b.stamp, b.pdata) for k, b in cache.blocks.items()}
        state["heap"] = sorted((prio, seq, b.key) for prio, seq, b in policy._heap if b.stamp == seq)
        state["counters"] = (policy._seq, getattr(policy, "_released", None), getattr(policy, "_inserted", None))
    return state


# ----------------------------------------------------------------------------------------------------------------
# hit for hit


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=60, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40), capacity=st.integers(1, 25), window=st.integers(1, 7),
       ghosts=st.sampled_from([None, 0, 1, 3]), outputs=st.booleans())
def test_random_prefix_traces_agree(name, trace, capacity, window, ghosts, outputs):
    py, fast = both(trace, name, capacity, window_requests=window, ghost_capacity=ghosts, cache_outputs=outputs)
    assert_same_windows(py, fast)


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=20, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=30, timed=True), capacity=st.integers(1, 20),
       seconds=st.sampled_from([0.001, 0.01, 0.5]))
def test_windows_in_seconds_agree(name, trace, capacity, seconds):
    py, fast = both(trace, name, capacity, window_seconds=seconds)
    assert_same_windows(py, fast)


@settings(max_examples=60, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40, max_prompt=10), capacity=st.integers(1, 30),
       small_ratio=st.sampled_from([0.1, 0.3, 0.5]), move_to_main=st.integers(0, 2), max_freq=st.integers(0, 3))
def test_s3fifo_parameters_agree(trace, capacity, small_ratio, move_to_main, max_freq):
    options = {"small_ratio": small_ratio, "move_to_main": move_to_main, "max_freq": max_freq}
    runs = [Replay(trace, PrefixCache(capacity, make_policy("s3fifo", **options)), window_requests=5, engine=engine)
            for engine in ("python", "fast")]
    for r in runs:
        r.run()
    assert runs[1].engine == "fast"
    assert_same_windows(*runs)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("capacity", [1, 7, 150, 5000])
def test_single_block_zipf_streams_agree(name, capacity):
    trace = flat_trace(zipf_ids(20_000, 3_000, 0.9, seed=capacity))
    py, fast = both(trace, name, capacity, window_requests=997, ghost_capacity=max(1, capacity // 3))
    assert_same_windows(py, fast)
    if capacity < 3000:
        assert sum(w.evictions for w in fast.windows) > 0
        assert sum(sum(w.miss_after_eviction_by_type) for w in fast.windows) > 0


def _real(name: str) -> Trace:
    trace, _ = open_trace(name)
    # The first 1,000 requests: the Azure and tau-bench traces hold ~1 M references, too many for the Python engine
    # in a unit test (their windows all look alike past that).
    return trace[:1000] if len(trace) > 1000 else trace


@pytest.mark.parametrize("trace_name", sorted(data.ALL))
def test_embedded_real_traces_agree(trace_name):
    trace = _real(trace_name)
    for name in FAST:
        for fraction in (0.02, 0.2):
            capacity = max(1, int(fraction * trace.distinct_blocks()))
            py, fast = both(trace, name, capacity, window_requests=200)
            assert_same_windows(py, fast)


# ----------------------------------------------------------------------------------------------------------------
# hand-over: reading Replay.cache moves the state to the Python objects, and the replay goes on identically


@pytest.mark.parametrize("name", FAST)
@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40), capacity=st.integers(1, 25), window=st.integers(1, 6),
       stop=st.integers(0, 8), ghosts=st.sampled_from([None, 0, 2]))
def test_hand_over_rebuilds_the_python_state(name, trace, capacity, window, stop, ghosts):
    py = Replay(trace, PrefixCache(capacity, make_policy(name), ghost_capacity=ghosts), window_requests=window,
                engine="python")
    fast = Replay(trace, PrefixCache(capacity, make_policy(name), ghost_capacity=ghosts), window_requests=window,
                  engine="fast")
    for _ in range(stop):
        if py.done:
            break
        py.step()
        fast.step()
    assert fast.engine == "fast"
    cache = fast.cache  # the hand-over
    assert fast.engine == "python"
    cache.check_invariants()
    assert cache_state(cache) == cache_state(py.cache)
    py.run()
    fast.run()
    assert_same_windows(py, fast)
    assert cache_state(fast.cache) == cache_state(py.cache)


def test_hand_over_on_a_real_trace_then_continue():
    trace = _real("taubench")
    capacity = int(0.05 * trace.distinct_blocks())
    for name in FAST:
        py = Replay(trace, PrefixCache(capacity, make_policy(name)), window_requests=150, engine="python")
        fast = Replay(trace, PrefixCache(capacity, make_policy(name)), window_requests=150)
        for _ in range(4):
            py.step()
            fast.step()
        assert cache_state(fast.cache) == cache_state(py.cache)
        fast.cache.check_invariants()
        py.run()
        fast.run()
        assert_same_windows(py, fast)


# ----------------------------------------------------------------------------------------------------------------
# which engine runs


def test_auto_takes_the_compiled_engine_where_it_applies():
    trace = build_trace([[0, 1], [0, 2]])
    for name in FAST:
        assert Replay(trace, PrefixCache(4, make_policy(name))).engine == "fast"
        assert replay(trace, make_policy(name), 4).engine == "fast"
    assert Replay(trace, PrefixCache(4, make_policy("lpc"))).engine == "python"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), check=True).engine == "python"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), make_server("qwen2.5-1.5b@a40")).engine == "python"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), make_server("instant")).engine == "fast"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), engine="python").engine == "python"


def test_window_callbacks_see_the_compiled_engines_windows():
    trace = build_trace([[0, 1], [0, 2], [0, 1, 3]])
    seen = []
    r = replay(trace, make_policy("lru"), 3, window_requests=1, callbacks=[lambda w, rep: seen.append(w.hit_blocks)])
    assert seen == [0, 1, 2] and r.engine == "fast"


class _MyLRU(LRUPolicy):
    name = "my-lru"


def _cases():
    trace = build_trace([[0, 1], [0, 2]])
    used = PrefixCache(4, make_policy("lru"))
    used.serve([1, 2], [0, 0], (), (), 0.0)
    return [
        (trace, PrefixCache(4, make_policy("belady")), {}, "no compiled engine"),
        (trace, PrefixCache(4, make_policy("s3fifo", max_freq=2.5)), {}, "whole numbers"),
        (trace, PrefixCache(4, _MyLRU()), {}, "no compiled engine"),
        (trace, PrefixCache(4, make_policy("lru")), {"check": True}, "check=True"),
        (trace, PrefixCache(4, make_policy("lru")), {"server": make_server("qwen2.5-1.5b@a40")}, "instant mode"),
        (trace, used, {}, "not fresh"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_forcing_the_compiled_engine_says_why_it_cannot(case):
    trace, cache, kw, why = _cases()[case]
    server = kw.pop("server", None)
    with pytest.raises(ValueError, match=why):
        Replay(trace, cache, server, engine="fast", **kw)
    assert Replay(trace, cache, server, **kw).engine == "python"  # auto falls back


def test_a_request_naming_a_key_twice_falls_back():
    trace = Trace(t=[0.0, 1.0], session=[0, 1], turn=[1, 1], app=[0, 0], prompt_tokens=[32, 16],
                  output_tokens=[0, 0], prompt_offsets=[0, 2, 3], prompt_keys=[5, 5, 6], prompt_types=[0, 0, 0],
                  block_size=16)
    with pytest.raises(ValueError, match="names one key twice"):
        Replay(trace, PrefixCache(4, make_policy("lfu")), engine="fast")
    assert Replay(trace, PrefixCache(4, make_policy("lfu"))).engine == "python"


def test_unknown_engine_raises():
    with pytest.raises(ValueError, match="valid engines"):
        Replay(build_trace([[0]]), PrefixCache(4, make_policy("lru")), engine="numba")


def test_without_numba_auto_falls_back(monkeypatch):
    monkeypatch.setattr(fast_engine, "AVAILABLE", False)
    trace = build_trace([[0, 1], [0, 2]])
    assert Replay(trace, PrefixCache(4, make_policy("lru"))).engine == "python"
    with pytest.raises(ValueError, match="numba is not installed"):
        Replay(trace, PrefixCache(4, make_policy("lru")), engine="fast")


def test_env_uses_the_compiled_engine_and_render_leaves_it():
    from sae_env.env import PrefixCacheEnv

    env = PrefixCacheEnv(policy="lru", trace=build_trace([[0, 1], [0, 2], [0, 1, 3]] * 5), capacity=4, window=5,
                         render_mode="ansi")
    env.reset(seed=0)
    assert env.replay.engine == "fast"
    env.step(env.action_space.sample())
    assert "4 blocks" in env.render()
    assert env.replay.engine == "fast"  # render reads the window's statistics, not the cache (issue 14)
    while not env.step(env.noop_action())[2]:
        pass
    env.close()


def test_engine_memory_is_per_capacity():
    """The compiled engine's state is O(capacity) per block plus 12 bytes per distinct key."""
    ids = np.arange(1, 20_001, dtype=np.int64)
    engine = fast_engine.FastEngine.build(flat_trace(ids), PrefixCache(1000, make_policy("lru")))
    engine.run_window(0, ids.size)
    assert len(engine) == 1000
    assert engine.nbytes <= 1000 * (fast_engine.RECORD * 4 + 2 * 5 + 64) + 12 * ids.size + 4096
