"""The compiled engine (sae_env.fast_engine) against the Python engine: hit for hit, field for field, every policy it
runs, instant and timed.

Every WindowStats field of every window must be equal (dataclass equality: hits per request, evictions, bypasses,
insertions, misses after eviction by type and queue, occupancy by type and queue, TTFTs and queueing delays, the
policy's own window statistics, ...), on hypothesis-generated prefix-sharing traces (small capacities, ghost bounds,
outputs on and off, windows by requests or seconds, timed with dense arrivals), on single-block Zipf streams, and on
every embedded real trace. The state contract (sae_env.state) must carry a replay across engines in both directions
after any window: the Python objects rebuilt from the compiled state equal those of a Python-engine replay, and a
replay continued on either engine gives the same windows. Also: which engine ``auto`` picks, and the errors of
``"fast"``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import build_trace, flat_trace, prefix_traces, zipf_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env import data
from sae_env.cache import PrefixCache
from sae_env.policies import make_policy
from sae_env.policies.lru import LRUPolicy
from sae_env.replay import Replay, replay
from sae_env.serving import make_server
from sae_env.sources import open_trace
from sae_env.state import export_cache
from sae_env.trace import Trace

pytest.importorskip("numba")

BASELINES = ("lru", "lfu", "fifo", "s3fifo")
ORACLES = ("belady", "reuse-oracle", "when-oracle", "session-oracle")
COMPILED = (*BASELINES, *ORACLES, "lpc")
SERVER = "qwen2.5-1.5b@a40"


def both(trace: Trace, name: str, capacity: int, server=None, options=None, **kw) -> tuple[Replay, Replay]:
    """The same replay on the Python engine and on the compiled engine (checked to be the one that ran)."""
    cache_kw = {k: kw.pop(k) for k in ("ghost_capacity", "cache_outputs") if k in kw}
    runs = []
    for engine in ("python", "fast"):
        r = Replay(trace, PrefixCache(capacity, make_policy(name, **(options or {})), **cache_kw),
                   make_server(server) if server else None, engine=engine, **kw)
        assert r.engine == engine
        r.run()
        assert r.engine == engine  # nothing moved the state: one engine ran every window
        runs.append(r)
    return runs[0], runs[1]


def assert_same_windows(py: Replay, fast: Replay) -> None:
    assert len(py.windows) == len(fast.windows)
    for wp, wf in zip(py.windows, fast.windows, strict=True):
        assert wp == wf, {k: (v, getattr(wf, k)) for k, v in vars(wp).items() if getattr(wf, k) != v}


# Arrays of an exported policy state that are not one value per block (per request, per occurrence, per turn, keys).
NOT_PER_BLOCK = {"ghost", "reached", "continued", "next_occ", "occ_req", "request_session", "has_next"}


def contract_state(cache: PrefixCache) -> dict:
    """Everything the next decision can depend on, through the state contract, by key (not by position)."""
    state, blocks = export_cache(cache)
    keys = state.keys.tolist()
    pstate = cache.policy.export_state({b.key: i for i, b in enumerate(blocks)})
    out = {"ghosts": list(zip(state.ghost_keys.tolist(), state.ghost_codes.tolist(), strict=True))}
    for name, col in state._asdict().items():
        if name.startswith("ghost") or name == "keys":
            continue
        values = col.tolist()
        if name == "parent":
            values = [keys[p] if p >= 0 else None for p in values]
        out[name] = dict(zip(keys, values, strict=True))
    if "last_sessions" in pstate:  # lpc: each session's last arrival (in no particular order)
        out["last"] = dict(zip(pstate.pop("last_sessions").tolist(), pstate.pop("last_times").tolist(), strict=True))
    for name, v in pstate.items():
        if name in ("free", "small", "main"):
            out[name] = [keys[i] for i in v.tolist()]  # block orders
        elif name == "parked":
            out[name] = sorted(keys[i] for i in v.tolist())
        elif isinstance(v, np.ndarray) and v.size == len(keys) and name not in NOT_PER_BLOCK:
            out[name] = dict(zip(keys, v.tolist(), strict=True))  # per block
        elif isinstance(v, np.ndarray):
            out[name] = v.tolist()
        else:
            out[name] = v
    if isinstance(cache.policy, LRUPolicy):
        out["python free queue"] = list(cache.policy._free)
    return out


# ----------------------------------------------------------------------------------------------------------------
# hit for hit, instant mode


@pytest.mark.parametrize("name", COMPILED)
@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40), capacity=st.integers(1, 25), window=st.integers(1, 7),
       ghosts=st.sampled_from([None, 0, 1, 3]), outputs=st.booleans())
def test_random_prefix_traces_agree(name, trace, capacity, window, ghosts, outputs):
    py, fast = both(trace, name, capacity, window_requests=window, ghost_capacity=ghosts, cache_outputs=outputs)
    assert_same_windows(py, fast)


@pytest.mark.parametrize("name", COMPILED)
@settings(max_examples=15, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=30, timed=True), capacity=st.integers(1, 20),
       seconds=st.sampled_from([0.001, 0.01, 0.5]))
def test_windows_in_seconds_agree(name, trace, capacity, seconds):
    py, fast = both(trace, name, capacity, window_seconds=seconds)
    assert_same_windows(py, fast)


@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40, max_prompt=10), capacity=st.integers(1, 30),
       small_ratio=st.sampled_from([0.1, 0.3, 0.5]), move_to_main=st.integers(0, 2), max_freq=st.integers(0, 3))
def test_s3fifo_parameters_agree(trace, capacity, small_ratio, move_to_main, max_freq):
    options = {"small_ratio": small_ratio, "move_to_main": move_to_main, "max_freq": max_freq}
    py, fast = both(trace, "s3fifo", capacity, options=options, window_requests=5)
    assert_same_windows(py, fast)


@settings(max_examples=30, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40, timed=True), capacity=st.integers(1, 25),
       factor=st.sampled_from([1.0, 1.5, 2.0, 8.0]))
def test_when_oracle_factors_agree(trace, capacity, factor):
    py, fast = both(trace, "when-oracle", capacity, options={"factor": factor}, window_requests=3)
    assert_same_windows(py, fast)


@settings(max_examples=30, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40, timed=True), capacity=st.integers(1, 25),
       tau=st.sampled_from([None, 0.001, 5.0]), predictor=st.booleans(), max_turn=st.integers(1, 3))
def test_lpc_options_agree(trace, capacity, tau, predictor, max_turn):
    session = np.array([i // 3 for i in range(len(trace))])
    trace.session = session
    trace.turn = 1 + np.array([i % 3 for i in range(len(trace))])
    options = {"tau": tau, "max_turn": max_turn,
               "predictor": (lambda tr, i: (0.2 + 0.5 * (i % 2), 0.1)) if predictor else None}
    py, fast = both(trace, "lpc", capacity, options=options, window_requests=4)
    assert_same_windows(py, fast)


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("capacity", [1, 150, 5000])
def test_single_block_zipf_streams_agree(name, capacity):
    trace = flat_trace(zipf_ids(8_000, 3_000, 0.9, seed=capacity))
    py, fast = both(trace, name, capacity, window_requests=997, ghost_capacity=max(1, capacity // 3))
    assert_same_windows(py, fast)
    if capacity < 3000:
        assert sum(w.evictions for w in fast.windows) > 0
        if name in BASELINES:  # (an oracle rarely regrets an eviction within a short ghost record)
            assert sum(sum(w.miss_after_eviction_by_type) for w in fast.windows) > 0


def _real(name: str, requests: int = 1000) -> Trace:
    trace, _ = open_trace(name)
    # The first requests: the Azure and tau-bench traces hold ~1 M references, too many for the Python engine in a
    # unit test (their windows all look alike past that).
    return trace[:requests] if len(trace) > requests else trace


@pytest.mark.parametrize("trace_name", sorted(data.ALL))
def test_embedded_real_traces_agree(trace_name):
    trace = _real(trace_name, 600)
    for name in COMPILED:
        for fraction in (0.02, 0.2):
            capacity = max(1, int(fraction * trace.distinct_blocks()))
            py, fast = both(trace, name, capacity, window_requests=200)
            assert_same_windows(py, fast)


# ----------------------------------------------------------------------------------------------------------------
# hit for hit, timed mode: the compiled prefill server, TTFTs included


@pytest.mark.parametrize("name", COMPILED)
@settings(max_examples=25, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=30, timed=True), capacity=st.integers(1, 20), window=st.integers(1, 6),
       budget=st.sampled_from([16, 64, 8192]), seqs=st.sampled_from([1, 2, 256]), outputs=st.booleans())
def test_timed_replays_agree(name, trace, capacity, window, budget, seqs, outputs):
    server = {"preset": SERVER, "token_budget": budget, "max_num_seqs": seqs}
    py, fast = both(trace, name, capacity, server, window_requests=window, cache_outputs=outputs)
    assert_same_windows(py, fast)
    assert sum(len(w.ttft_ms) for w in fast.windows) == len(trace)


def test_timed_replays_with_a_calibration_table_agree(tmp_path):
    table = tmp_path / "cal.csv"
    table.write_text("new_tokens,cached_tokens,time_ms\n1,0,5\n512,0,20\n4096,0,90\n1,2048,6\n512,2048,30\n"
                     "4096,2048,130\n")
    trace = build_trace([[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5], [6]] * 6, [[7], [8], [], [9], [1]] * 6,
                        times=np.cumsum([0.0, 0.004, 0.0, 0.01, 0.002] * 6), out_extra=[5, 30, 1, 2, 60] * 6)
    for name in ("lru", "belady", "lpc"):
        py, fast = both(trace, name, 5, {"calibration": str(table), "preset": SERVER, "token_budget": 40},
                        window_requests=4)
        assert_same_windows(py, fast)


@pytest.mark.parametrize("trace_name", sorted(data.ALL))
def test_embedded_real_traces_agree_timed(trace_name):
    trace = _real(trace_name, 300)
    for name in ("lru", "s3fifo", "belady", "lpc"):
        capacity = max(1, int(0.05 * trace.distinct_blocks()))
        py, fast = both(trace, name, capacity, SERVER, window_requests=100)
        assert_same_windows(py, fast)


# ----------------------------------------------------------------------------------------------------------------
# the state contract: hand-over in both directions after any window


def hand_over(ref: Replay, moved: Replay, stops: list[int], state=contract_state, timed: bool = False) -> None:
    """Step both replays ``stops[k]`` windows at a time, moving ``moved`` to the other engine after each run (to
    Python: its rebuilt objects, ``state(cache)``, and in timed mode :func:`timed_state`, must equal the reference's),
    then finish both: every window must be equal."""
    for stop in stops:
        for _ in range(stop):
            if ref.done:
                break
            ref.step()
            moved.step()
        if moved.engine == "fast":
            cache = moved.to_python()
            assert moved.engine == "python"
            cache.check_invariants()
            assert state(cache) == state(ref.to_python())
            if timed:
                assert timed_state(moved) == timed_state(ref)
        else:
            assert moved.to_fast()
    ref.run()
    moved.run()
    assert_same_windows(ref, moved)


@pytest.mark.parametrize("name", COMPILED)
@settings(max_examples=25, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=40), capacity=st.integers(1, 25), window=st.integers(1, 6),
       stops=st.lists(st.integers(0, 8), min_size=1, max_size=3), ghosts=st.sampled_from([None, 0, 2]))
def test_hand_over_both_ways_after_any_window(name, trace, capacity, window, stops, ghosts):
    """A replay that moves between the engines at random windows equals one that stays on the Python engine: the
    Python objects rebuilt from the compiled state equal the reference's, and the compiled engine takes a state
    the Python engine built."""
    ref = Replay(trace, PrefixCache(capacity, make_policy(name), ghost_capacity=ghosts), window_requests=window,
                 engine="python")
    moved = Replay(trace, PrefixCache(capacity, make_policy(name), ghost_capacity=ghosts), window_requests=window)
    assert moved.engine == "fast"
    hand_over(ref, moved, stops)
    assert contract_state(moved.to_python()) == contract_state(ref.to_python())


def timed_state(r: Replay) -> dict:
    """A timed replay's state beside its cache: the server's, the requests in flight and the completion events."""
    server = {k: [None if x != x else x for x in v.tolist()] if isinstance(v, np.ndarray) else v  # NaN: None
              for k, v in r.server.export_state().items()}
    return {"server": server, "events": sorted(r._events),
            "inflight": {i: [b.key for b in path] for i, path in r._inflight.items()}}


@pytest.mark.parametrize("name", COMPILED)
@settings(max_examples=20, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=30, timed=True), capacity=st.integers(1, 20), window=st.integers(1, 5),
       stops=st.lists(st.integers(0, 6), min_size=1, max_size=3), budget=st.sampled_from([16, 8192]))
def test_timed_hand_over_both_ways_after_any_window(name, trace, capacity, window, stops, budget):
    """The same with a prefill server: requests in flight, queued prefills and pending completions move too."""
    server = {"preset": SERVER, "token_budget": budget}
    ref = Replay(trace, PrefixCache(capacity, make_policy(name)), make_server(server), window_requests=window,
                 engine="python")
    moved = Replay(trace, PrefixCache(capacity, make_policy(name)), make_server(server), window_requests=window)
    assert moved.engine == "fast"
    hand_over(ref, moved, stops, timed=True)


@pytest.mark.parametrize("name", COMPILED)
def test_hand_over_on_a_real_trace(name):
    trace = _real("taubench", 600)
    capacity = int(0.05 * trace.distinct_blocks())
    ref = Replay(trace, PrefixCache(capacity, make_policy(name)), window_requests=150, engine="python")
    moved = Replay(trace, PrefixCache(capacity, make_policy(name)), window_requests=150, engine="python")
    for _ in range(2):
        ref.step()
        moved.step()
    assert moved.to_fast(required=True)  # a state the Python engine built, taken by the compiled one
    ref.step()
    moved.step()
    assert contract_state(moved.to_python()) == contract_state(ref.to_python())
    moved.to_python().check_invariants()
    ref.run()
    moved.run()
    assert_same_windows(ref, moved)


@pytest.mark.parametrize("name", COMPILED)
def test_the_state_contract_round_trips(name):
    """export_state -> import_state on a fresh policy rebuilds the same exported state (what the engine relies on)."""
    trace = _real("wildchat", 200)
    r = replay(trace, make_policy(name), max(2, int(0.1 * trace.distinct_blocks())), engine="python")
    cache = r.to_python()
    state, blocks = export_cache(cache)
    pstate = cache.policy.export_state({b.key: i for i, b in enumerate(blocks)})
    copy = PrefixCache(cache.capacity, make_policy(name))
    copy.policy.bind(trace)
    from sae_env.state import import_cache

    copy.policy.import_state(pstate, import_cache(copy, state))
    copy.check_invariants()
    assert contract_state(copy) == contract_state(cache)


def test_parameters_set_while_the_compiled_engine_holds_the_state():
    """set_params between windows (as agents do) reaches the compiled twin: same windows as the Python engine."""
    trace = _real("wildchat", 400)
    capacity = int(0.05 * trace.distinct_blocks())
    runs = []
    for engine in ("python", "fast"):
        r = Replay(trace, PrefixCache(capacity, make_policy("lpc")), window_requests=50, engine=engine)
        k = 0
        while not r.done:
            r.step()
            k += 1
            r.policy.set_params({"tau_scale": [0.1, 1.0, 10.0][k % 3], "p_shared": 0.6 + 0.1 * (k % 3)})
            if k % 4 == 0:
                r.policy.set_params(r.policy.params)  # unchanged values: no re-keying
        assert r.engine == engine
        runs.append(r)
    assert_same_windows(*runs)


@settings(max_examples=60, deadline=None)
@given(trace=prefix_traces(max_requests=40))
def test_compiled_next_uses_equal_the_sorted_ones(trace):
    """Belady's knowledge: the compiled backward pass and numpy's sort give the same chains of uses."""
    from sae_env.policies.belady import next_uses, next_uses_sorted

    for a, b in zip(next_uses(trace), next_uses_sorted(trace), strict=True):
        assert np.array_equal(a, b)


def test_compiled_next_uses_on_a_real_trace():
    from sae_env.policies.belady import next_uses, next_uses_sorted

    trace = _real("taubench", 3000)
    for a, b in zip(next_uses(trace), next_uses_sorted(trace), strict=True):
        assert np.array_equal(a, b)


# ----------------------------------------------------------------------------------------------------------------
# which engine runs


def test_auto_takes_the_compiled_engine_where_it_applies():
    trace = build_trace([[0, 1], [0, 2]])
    for name in COMPILED:
        assert Replay(trace, PrefixCache(4, make_policy(name))).engine == "fast"
        assert replay(trace, make_policy(name), 4).ran_on == "fast"
        assert Replay(trace, PrefixCache(4, make_policy(name)), make_server(SERVER)).engine == "fast"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), check=True).engine == "python"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), make_server("instant")).engine == "fast"
    assert Replay(trace, PrefixCache(4, make_policy("lru")), engine="python").engine == "python"


def test_window_callbacks_see_the_compiled_engines_windows():
    trace = build_trace([[0, 1], [0, 2], [0, 1, 3]])
    seen = []
    r = replay(trace, make_policy("lru"), 3, window_requests=1, callbacks=[lambda w, rep: seen.append(w.hit_blocks)])
    assert seen == [0, 1, 2] and r.ran_on == "fast"


def test_the_cache_is_handed_over_only_when_asked():
    trace = build_trace([[0, 1], [0, 2], [0, 1, 3]])
    r = Replay(trace, PrefixCache(3, make_policy("lru")))
    r.run()
    with pytest.raises(RuntimeError, match="to_python"):
        r.cache  # noqa: B018 - the property refuses: the compiled engine holds the state
    assert r.occupancy == 3 and r.capacity == 3 and r.engine == "fast"
    assert len(r.to_python()) == 3 and r.engine == "python" and len(r.cache) == 3


class _MyLRU(LRUPolicy):
    name = "my-lru"


def _unchained() -> Trace:
    """Key 6 follows key 5 in one request and opens the next: not prefix-chained keys."""
    return Trace(t=[0.0, 1.0], session=[0, 1], turn=[1, 1], app=[0, 0], prompt_tokens=[32, 32], output_tokens=[0, 0],
                 prompt_offsets=[0, 2, 4], prompt_keys=[5, 6, 6, 5], prompt_types=[0, 0, 0, 0], block_size=16)


def _cases():
    trace = build_trace([[0, 1], [0, 2]])
    return [
        (trace, PrefixCache(4, make_policy("saecache-paper", lognormal=False)), {}, "exponential"),
        (trace, PrefixCache(4, make_policy("s3fifo", max_freq=2.5)), {}, "whole numbers"),
        (trace, PrefixCache(4, _MyLRU()), {}, "no compiled engine"),
        (trace, PrefixCache(4, make_policy("lru")), {"check": True}, "check=True"),
        (_unchained(), PrefixCache(4, make_policy("belady")), {}, "prefix-chained"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_forcing_the_compiled_engine_says_why_it_cannot(case):
    trace, cache, kw, why = _cases()[case]
    with pytest.raises(ValueError, match=why):
        Replay(trace, cache, engine="fast", **kw)
    r = Replay(trace, cache, **kw)  # auto falls back, and says why
    assert r.engine == "python" and why in r.fast_reason


def test_a_used_cache_is_taken_over():
    trace = build_trace([[0, 1], [0, 2], [0, 1]])
    caches = []
    for engine in ("python", "fast"):
        used = PrefixCache(4, make_policy("lru"))
        used.serve([11, 12], [0, 0], (), (), 0.0)
        r = Replay(trace, used, engine=engine)
        r.run()
        caches.append(r)
    assert_same_windows(*caches)


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
    from sae_env.fast_engine import engine

    monkeypatch.setattr(engine, "AVAILABLE", False)
    trace = build_trace([[0, 1], [0, 2]])
    assert Replay(trace, PrefixCache(4, make_policy("lru"))).engine == "python"
    with pytest.raises(ValueError, match="numba is not installed"):
        Replay(trace, PrefixCache(4, make_policy("lru")), engine="fast")


def test_env_uses_the_compiled_engine_and_render_leaves_it():
    from sae_env.env import PrefixCacheEnv

    env = PrefixCacheEnv(policy="lpc", trace=build_trace([[0, 1], [0, 2], [0, 1, 3]] * 5), capacity=4, window=5,
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
    r = Replay(flat_trace(ids), PrefixCache(1000, make_policy("lru")), window_requests=ids.size)
    r.run()
    assert r.occupancy == 1000
    assert r._fast.nbytes <= 1000 * (16 * 4 + 2 * 5 + 64) + 12 * ids.size + 4096


def test_importing_one_twin_module_first_hides_no_other_twin():
    """The twin registry fills itself on first use; a twin module imported directly before that must not make it
    look full (lru then ran on the Python engine)."""
    import subprocess
    import sys

    code = ("import sae_env.fast_engine.saecache\n"
            "from sae_env.cache import PrefixCache\nfrom sae_env.policies import make_policy\n"
            "from sae_env.replay import Replay\nfrom sae_env.sources import open_trace\n"
            "trace, _ = open_trace('taubench')\n"
            "print(*(Replay(trace[:50], PrefixCache(64, make_policy(n))).engine for n in ('lru', 'lpc', 'saecache')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["fast", "fast", "fast"]


def test_the_kernel_cache_stamp_covers_the_modules_the_package_imports_from(tmp_path):
    """A kernel freezes the globals it reads (constants imported from other modules too) into its cached machine
    code: the cache's stamp changes with the package's files and with the modules they import from, not with others."""
    import sae_env.fast_engine as fast_engine
    from sae_env.fast_engine.jit import package_stamp, stamped_files

    project = tmp_path / "sae_env"
    (project / "fast").mkdir(parents=True)
    (project / "policies").mkdir()
    for f in (project / "__init__.py", project / "policies" / "__init__.py", project / "fast" / "__init__.py"):
        f.write_text("")
    (project / "policies" / "consts.py").write_text("BIN = 0.5\n")
    (project / "other.py").write_text("Y = 1\n")
    kernel = "from sae_env.policies.consts import (\n    BIN,\n)\nfrom .b import Z\n"  # a multi-line import
    (project / "fast" / "kernel.py").write_text(kernel)
    (project / "fast" / "b.py").write_text("Z = 2\n")
    package = project / "fast"
    first = package_stamp(package)
    (project / "other.py").write_text("Y = 2\n")
    assert package_stamp(package) == first
    (project / "policies" / "consts.py").write_text("BIN = 1.0\n")
    second = package_stamp(package)
    assert second != first
    (project / "fast" / "b.py").write_text("Z = 3\n")
    assert package_stamp(package) not in (first, second)
    # the real package: the constants of SAECache's arrivals and the token types are covered
    root = Path(fast_engine.__file__).resolve().parent.parent.parent
    real = {f.relative_to(root).as_posix() for f in stamped_files()}
    assert {"sae_env/policies/arrivals.py", "sae_env/trace.py", "sae_env/fast_engine/loop.py"} <= real


@pytest.mark.parametrize(("name", "value"), [("ENABLE_PROFILING", 1), ("DEBUGINFO_DEFAULT", 1), ("OPT", 0),
                                             ("BOUNDSCHECK", 1)])
def test_the_kernel_cache_stamp_covers_numbas_code_generation_settings(monkeypatch, name, value):
    """A kernel cached under NUMBA_ENABLE_PROFILING=1 (or debug info, another optimisation level, bounds checks)
    is other machine code under the same numba cache key: the package's stamp tells them apart, so such a kernel is
    stale in a process with the default settings, not loaded (a profiling kernel made first replays 9x slower)."""
    from numba.core import config

    from sae_env.fast_engine import jit

    before = jit.cache_stamp()
    assert before.startswith(jit.package_stamp())
    monkeypatch.setattr(config, name, value)
    assert jit.cache_stamp() != before
    assert jit._STAMP == before  # this process's kernels were checked against the default settings


@pytest.mark.parametrize("gone", ["class", "module"])
def test_a_cache_index_naming_a_state_class_that_is_gone_is_a_miss(tmp_path, monkeypatch, gone):
    """numba unpickles a kernel's cache index before comparing stamps (numba issue 6018): an index written by another
    version of the package, naming a state class (or module) that no longer exists, made the kernel's first call
    raise. For the package's own kernels such an index is a miss (the kernel recompiles); for other code numba's
    behaviour is unchanged."""
    import sys
    import types

    from numba.core import caching

    from sae_env.fast_engine.jit import cache_stamp

    module = types.ModuleType("sae_env_gone_states")
    module.OldState = type("OldState", (), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    ours = caching.IndexDataCacheFile(str(tmp_path), "kernel", cache_stamp())
    ours._save_index({(module.OldState(), "sig"): "kernel.1.nbc"})
    foreign = caching.IndexDataCacheFile(str(tmp_path), "kernel", "another stamp")
    assert len(ours._load_index()) == 1  # readable while the class exists
    if gone == "class":
        del module.OldState
    else:
        monkeypatch.delitem(sys.modules, module.__name__)
    assert ours._load_index() == {}
    with pytest.raises((AttributeError, ImportError)):
        foreign._load_index()


def test_a_kernels_first_call_waits_while_another_process_compiles_it(tmp_path):
    """Two processes that need one kernel at once compile it once: the second waits on the kernel's lock file (held
    here, as a process compiling it holds it), then loads it from the cache. A replay that did not wait would finish
    while the lock is held."""
    import fcntl
    import os
    import subprocess
    import sys
    import time

    from sae_env.fast_engine import jit
    from sae_env.fast_engine.baselines import LRUState

    script = ("from sae_env.cache import PrefixCache; from sae_env.policies import make_policy; "
              "from sae_env.replay import Replay; from sae_env.sources import open_trace; "
              "t, _ = open_trace('taubench'); print('ready', flush=True); "
              "Replay(t[:40], PrefixCache(50, make_policy('lru')), None, engine='fast').run(); "
              "print('done', flush=True)")
    # the kernel in the disk cache first: otherwise the other process would take a while to compile it, lock or not
    Replay(_real("taubench", 40), PrefixCache(50, make_policy("lru")), None, engine="fast").run()
    lock = jit.kernel_lock(f"{LRUState.__qualname__}.run_window__TIMED_False", tmp_path)
    lock.parent.mkdir()
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=Path(__file__).resolve().parent.parent)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(4)  # a replay of 40 requests with the kernel cached takes well under a second
            assert proc.poll() is None
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0 and out.strip() == "done"


def test_writable_and_read_only_inputs_share_one_kernel():
    """A trace built from writable arrays and one built from read-only ones (as Ray hands a worker its arrays) replay
    on the same compiled kernels: no second signature, so no second compile (a replay on a Ray worker compiled
    SAECache's kernel again, for 20-40 s, before trace columns were read-only)."""
    from sae_env.fast_engine import jit

    def signatures() -> int:
        return sum(len(getattr(k, "dispatcher", k).signatures) for k in jit._KERNELS.values())

    trace = _real("taubench", 40)
    frozen = {}
    for name in ("t", "session", "turn", "app", "prompt_tokens", "output_tokens", "prompt_offsets", "prompt_keys",
                 "prompt_types", "output_offsets", "output_keys", "output_types"):
        frozen[name] = getattr(trace, name).copy()
        frozen[name].flags.writeable = False
    writable = {name: a.copy() for name, a in frozen.items()}
    Replay(Trace(**writable, block_size=trace.block_size), PrefixCache(50, make_policy("lru")), None,
           engine="fast").run()
    before = signatures()
    Replay(Trace(**frozen, block_size=trace.block_size), PrefixCache(50, make_policy("lru")), None,
           engine="fast").run()
    assert before > 0 and signatures() == before
