"""The one-pass LRU miss-ratio curve (sae_env.mrc) against separate replays of ``lru``, figure for figure.

The claim is that LRU with leaf-only eviction on the prefix cache is a stack algorithm in instant mode (the module
docstring argues it): then hits per request, hit tokens, insertions, bypasses, evictions and the final occupancy
at every capacity follow from one pass. Each test compares them with a real replay (the default engine, as a user
gets it, and the Python engine on the small traces): on hypothesis traces with shared prefixes, outputs (cached or
not), follow-up turns that hit earlier outputs, prompts and paths longer than the cache (bypasses with the path
pinned), and on every embedded real trace.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import build_trace, flat_trace, prefix_traces, zipf_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env import data
from sae_env.mrc import COLD, MissRatioCurve, lru_curve
from sae_env.policies import make_policy
from sae_env.replay import replay
from sae_env.sources import open_trace
from sae_env.trace import N_TOKEN_TYPES, Trace


def replayed(trace: Trace, capacity: int, **kw) -> dict:
    """What a replay of lru at ``capacity`` reports, as totals plus the hits of every request."""
    r = replay(trace, make_policy("lru"), capacity, **kw)
    w = r.windows
    return {"hits": [h for x in w for h in x.hits_per_request], "hit_blocks": sum(x.hit_blocks for x in w),
            "hit_tokens": sum(x.hit_tokens for x in w), "inserted": sum(x.inserted for x in w),
            "bypasses": sum(x.bypasses for x in w), "evictions": sum(x.evictions for x in w),
            "occupancy": w[-1].occupancy, "hits_by_type": np.sum([x.hits_by_type for x in w], axis=0).tolist()}


def from_curve(curve: MissRatioCurve, capacity: int) -> dict:
    p = curve.point(capacity)
    hits = curve.hits_per_request(capacity)
    tr = curve.trace
    n = np.diff(tr.prompt_offsets)
    is_hit = (np.arange(tr.n_blocks) - np.repeat(tr.prompt_offsets[:-1], n)) < np.repeat(hits, n)
    by_type = np.bincount(tr.prompt_types[is_hit], minlength=N_TOKEN_TYPES).tolist()
    return {"hits": hits.tolist(), "hit_blocks": p.hit_blocks, "hit_tokens": p.hit_tokens, "inserted": p.inserted,
            "bypasses": p.bypasses, "evictions": p.evictions, "occupancy": p.occupancy, "hits_by_type": by_type}


def assert_equal_at(trace: Trace, capacities, cache_outputs: bool = True, engines=("auto",)) -> None:
    curve = MissRatioCurve.build(trace, cache_outputs)
    for c in capacities:
        got = from_curve(curve, c)
        for engine in engines:
            want = replayed(trace, c, cache_outputs=cache_outputs, engine=engine)
            assert got == want, (c, engine, {k: (v, want[k]) for k, v in got.items() if want[k] != v})


# ----------------------------------------------------------------------------------------------------------------
# equal to separate replays


@settings(max_examples=150, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=30, max_prompt=8, max_output=4),
       capacities=st.lists(st.integers(1, 30), min_size=1, max_size=4), outputs=st.booleans())
def test_equal_to_replays_on_prefix_traces(trace, capacities, outputs):
    assert_equal_at(trace, capacities, outputs, engines=("auto", "python"))


@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=20, max_prompt=14, max_output=6), capacity=st.integers(1, 6))
def test_paths_longer_than_the_cache_bypass_exactly(trace, capacity):
    """Prompts and outputs longer than the cache: the path pins everything, the rest is bypassed."""
    assert_equal_at(trace, [capacity], engines=("python",))


def test_the_corner_cases_by_hand():
    # a prompt of 5 in a cache of 3: 2 bypassed, the outputs never tried; then a follow-up hits 3
    long = build_trace([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]], [[7, 8], []])
    assert_equal_at(long, [1, 2, 3, 5, 6, 7, 8, 9], engines=("python",))
    assert MissRatioCurve.build(long).point(3).bypasses == 2 + 3
    # outputs that fill the cache after the prompt fits, and a second turn that finds its outputs cached
    outs = build_trace([[1, 2], [1, 2], [3]], [[4, 5, 6], [4, 5], [1]])
    assert_equal_at(outs, range(1, 9), engines=("python",))
    assert_equal_at(outs, range(1, 9), cache_outputs=False, engines=("python",))
    # an empty prompt with outputs: the outputs are roots
    assert_equal_at(build_trace([[], [1], []], [[1, 2], [], [3]]), range(1, 5), engines=("python",))


@pytest.mark.parametrize("capacity", [1, 10, 300, 2999])
def test_single_block_streams_are_mattson(capacity):
    """No shared prefixes: the classic flat LRU, whose hit count is the number of stack distances <= capacity."""
    ids = zipf_ids(5_000, 3_000, 0.9, seed=1)
    curve = MissRatioCurve.build(flat_trace(ids))
    assert_equal_at(curve.trace, [capacity])
    finite = curve.positions[curve.positions != COLD]
    assert curve.point(capacity).hit_blocks == int(np.count_nonzero(finite <= capacity))


@pytest.mark.parametrize("name", sorted(data.ALL))
def test_equal_to_replays_on_every_embedded_trace(name):
    trace, _ = open_trace(name)
    distinct = trace.distinct_blocks()
    # 60 % on the large traces too would double this file's run time (azure's million distinct blocks) for no new case
    fractions = (0.01, 0.05, 0.2) if trace.n_blocks > 500_000 else (0.01, 0.05, 0.2, 0.6)
    capacities = sorted({max(1, int(f * distinct)) for f in fractions} | {1, 64})
    assert_equal_at(trace, capacities)


@settings(max_examples=60, deadline=None)
@given(trace=prefix_traces(max_requests=30, max_prompt=8, max_output=4), outputs=st.booleans())
def test_positions_increase_along_every_path(trace, outputs):
    """The step of the argument that makes hits a leading run: a parent is always above its child in the stack."""
    curve = MissRatioCurve.build(trace, outputs)
    for r in range(len(trace)):
        p = curve.positions[curve.path_offsets[r]:curve.path_offsets[r + 1]]
        assert np.all(np.diff(p[p != COLD]) > 0) and np.all(p[:np.count_nonzero(p != COLD)] != COLD)
        assert np.all(p[p != COLD] <= curve.sizes[r])


def test_the_curve_is_monotone_and_ends_at_the_compulsory_misses():
    trace, _ = open_trace("wildchat")
    points = lru_curve(trace, [1, 10, 100, 1000, 10_000, 10**6])
    rates = [p.token_hit_rate for p in points]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    # a cache larger than every distinct block misses only the first reference of each key
    curve = MissRatioCurve.build(trace)
    prompt_cold = sum(int(np.count_nonzero(curve.positions[a:a + n] == COLD))
                      for a, n in zip(curve.path_offsets[:-1], np.diff(trace.prompt_offsets), strict=True))
    assert points[-1].hit_blocks == trace.n_blocks - prompt_cold and points[-1].evictions == 0


# ----------------------------------------------------------------------------------------------------------------
# where the argument does not apply: said, not silently wrong


def test_a_request_naming_a_key_twice_is_refused():
    trace = flat_trace([1, 2, 3])
    trace.prompt_offsets = np.array([0, 3, 3, 3])
    trace.prompt_keys = np.array([1, 2, 1])
    with pytest.raises(ValueError, match="names one key twice"):
        MissRatioCurve.build(trace)


def test_a_key_under_two_parents_is_refused():
    # unchained keys: block 2 follows 1 in the first request and is a root in the second
    trace = flat_trace([1, 2, 2])
    trace.prompt_offsets = np.array([0, 2, 3, 3])
    with pytest.raises(ValueError, match="two different parent"):
        MissRatioCurve.build(trace)


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_capacity_must_be_whole_blocks(capacity):
    curve = MissRatioCurve.build(flat_trace([1, 2, 1]))
    with pytest.raises(ValueError, match="whole number of blocks"):
        curve.point(capacity)


# ----------------------------------------------------------------------------------------------------------------
# the command line: `train.py replay --capacity LO:HI[:N]`


def test_replay_over_a_range_gives_each_capacity_what_a_replay_gives(tmp_path, capsys):
    from sae_env.cli import main

    out = tmp_path / "sweep.json"
    assert main(["replay", "--trace", "bailian", "--policy", "lru,fifo", "--capacity", "2%:60%:4",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "one pass (miss-ratio curve) for 4 capacities" in captured.err
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["lru"] * 4 + ["fifo"] * 4
    assert [r["method"] for r in rows] == ["curve"] * 4 + ["replay"] * 4
    capacities = [r["capacity_blocks"] for r in rows[:4]]
    assert capacities == sorted(capacities) and capacities == [r["capacity_blocks"] for r in rows[4:]]
    for row in rows[:4]:  # each lru row equals `replay` at that one capacity
        one = tmp_path / f"{row['capacity_blocks']}.json"
        assert main(["replay", "--trace", "bailian", "--capacity", str(row["capacity_blocks"]),
                     "--json", str(one)]) == 0
        single = json.loads(one.read_text())
        assert single["method"] == "replay"
        for key in ("token_hit_rate", "block_hit_rate", "hit_tokens", "hit_blocks", "prompt_tokens", "evictions",
                    "bypasses", "inserted", "capacity_blocks"):
            assert row[key] == single[key], key


def test_lru_with_timed_serving_over_a_range_replays_each_capacity(tmp_path, capsys):
    from sae_env.cli import main

    out = tmp_path / "timed.json"
    assert main(["replay", "--trace", "bailian", "--capacity", "5%,20%", "--serving", "qwen2.5-1.5b@a40",
                 "--json", str(out)]) == 0
    assert "one pass" not in capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["replay", "replay"] and all(r["ttft_mean_ms"] for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["replay", "--capacity", "40%:1%"], "the low end ("),
    (["replay", "--capacity", "1%:40%:1"], "the count N after the second ':' must be a whole number in [2,"),
    (["replay", "--capacity", "1%:40%:x"], "the count N"),
    (["replay", "--capacity", "1%:"], "the high end is empty"),
    (["replay", "--capacity", "1:2:3:4"], "must be LO:HI or LO:HI:N"),
    (["replay", "--capacity", "1%:lots"], "high end 'lots'"),
    (["replay", "--capacity", "1,2:3"], "not both"),
    (["replay", "--capacity", "1:1000000000"], "more than 100x"),
    (["replay", "--capacity", "1%:2GiB"], "needs the model's KV bytes"),
    (["explain", "--policy", "lfu", "--capacity", "1%:4%"], "give one capacity here"),
])
def test_bad_ranges_exit_2_with_one_clear_line(argv, message, capsys):
    from sae_env.cli import main

    assert main([argv[0], "--trace", "bailian", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------------
# experiments: `lru_curve` in a config (configs/capacity_sweep.yaml)


def _curve_config(tmp_path, **extra) -> dict:
    return {"name": "curve", "workloads": [{"name": "wildchat", "trace": "wildchat"}], "capacities": [0.02, 0.2],
            "agents": ["lru", "fifo"], "serving": "instant", "window": 200, "seeds": [0],
            "output": str(tmp_path / "runs"), "wandb": {"mode": "disabled"}, **extra}


def test_an_experiment_with_lru_curve_writes_it_and_checks_it_against_the_lru_cells(tmp_path):
    from agents import CellRunner
    from sae_env.experiment import load_config, run_experiment

    runner = CellRunner()
    config = load_config(_curve_config(tmp_path, lru_curve=12), runner)
    plain = load_config(_curve_config(tmp_path), runner)
    assert config.results_key() == plain.results_key()  # the curve decides no cell: same run folder, same cells
    assert "lru_curve" not in plain.to_dict()
    logs: list[str] = []
    run = run_experiment(config, runner, serial=True, progress=False, log=logs.append)
    rows = json.loads((run.run_dir / "lru_curve.json").read_text())
    assert 12 <= len(rows) <= 14 and any("equal to the 2 lru cell(s)" in m for m in logs)
    trace, _ = open_trace("wildchat")
    for row in rows:
        assert row["hit_tokens"] == replayed(trace, row["capacity_blocks"])["hit_tokens"]
    lru = {r["capacity"]: r for r in rows if r["capacity"] is not None}
    for cid, result in run.results.items():
        if "__lru__" in cid:
            assert result["summary"]["token_hit_rate"] == lru[result["cell"]["capacity"]]["token_hit_rate"]

    # the check can fail: a finished lru cell that disagrees with the curve (edited here) stops the run
    cell = next(run.run_dir.glob("cells/*__lru__*.json"))
    data = json.loads(cell.read_text())
    data["summary"]["hit_tokens"] += 16
    cell.write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="lru_curve disagrees with the lru cell"):
        run_experiment(config, runner, serial=True, progress=False, log=logs.append)


@pytest.mark.parametrize("extra, message", [
    ({"lru_curve": 1}, "lru_curve: the number of capacities must be a whole number in [2,"),
    ({"lru_curve": "many"}, "lru_curve: the number of capacities"),
    ({"lru_curve": 10, "serving": "qwen2.5-1.5b@a40"}, "exact in instant serving only"),
])
def test_bad_lru_curve_settings_are_config_errors(tmp_path, extra, message):
    from sae_env.experiment import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_curve_config(tmp_path, **extra))


def test_timed_serving_is_not_a_stack_algorithm():
    """Why the curve is for instant serving only: with requests in flight together (pins held until completion,
    outputs inserted later), LRU's hits are not monotone in the capacity, which no stack algorithm allows. Found by
    hypothesis: four requests at t=0, a fifth at t=1 hits its first block at 11 and 13 blocks but not at 12."""
    from sae_env.serving import make_server

    trace = build_trace([[2, 0], [2, 0, 0, 0], [1, 0], [0, 0, 0, 0, 0, 0], [2, 0, 0]],
                        [[0], [], [1, 0, 0], [0], []], [0, 0, 0, 0, 1.0], out_extra=[1] * 5)

    def last_hit(capacity: int) -> int:
        r = replay(trace, make_policy("lru"), capacity, server=make_server("qwen2.5-1.5b@a40"))
        return r.windows[-1].hits_per_request[-1]

    assert (last_hit(11), last_hit(12), last_hit(13)) == (1, 0, 1)
    instant = [p.hit_blocks for p in lru_curve(trace, range(1, 20))]  # instant serving: monotone, as it must be
    assert instant == sorted(instant) and instant[-1] > instant[0]
