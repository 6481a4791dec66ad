"""Tests of agents/tune.py and sae_env/ray_local.py: candidates (defaults first, in bounds, seeded), random search
and successive halving against FixedAgent episodes recomputed by hand, serial == Ray results on a real private local
cluster (started with the no-off-machine-traffic settings, which are restored afterwards), bad input, and the
``tune`` command line."""

from __future__ import annotations

import json
import os

import pytest

from agents import FixedAgent, evaluate, load_params, make_env
from agents.cli import main as cli_main
from agents.tune import candidate_params, lower_is_better, tune_fixed
from sae_env.ray_local import LOCAL_ENV, ray_cluster

# ~90 requests, windows of 20: a trial takes ~20 ms.
TINY = {"trace": {"source": "synthetic", "preset": "tiny"}, "capacity": 0.05, "window": 20}


def _strip(results):
    return [{k: v for k, v in r.items() if k != "replay_s"} for r in results]


def test_candidates_defaults_first_in_bounds_and_seeded():
    env = make_env(TINY)
    cands = candidate_params(TINY, 6, seed=1)
    assert cands[0] == env.default_params
    assert len(cands) == 6 and all(set(c) == set(env.default_params) for c in cands)
    for c in cands:
        for p in env.param_specs:
            assert p.low <= c[p.name] <= p.high
    assert cands == candidate_params(TINY, 6, seed=1)
    assert cands[1:] != candidate_params(TINY, 6, seed=2)[1:]
    with pytest.raises(ValueError, match="n_trials"):
        candidate_params(TINY, 0)
    with pytest.raises(ValueError, match="no parameters"):
        candidate_params(dict(TINY, policy="lru"), 3)


def test_random_search_picks_the_best_fixed_episode():
    best, results = tune_fixed(TINY, 5, seed=0, ray=False)
    assert [r["trial"] for r in results] == list(range(5))
    assert all(r["rung"] == 0 and r["max_steps"] is None for r in results)
    top = max(results, key=lambda r: r["score"])
    assert best == top["params"]
    # every score is the episode of FixedAgent(params) recomputed here
    for r in results[:3]:
        s = evaluate(FixedAgent(r["params"]), TINY, 0)["summary"]
        assert r["score"] == s["token_hit_rate"] and r["episode_reward"] == s["episode_reward"]
    # another objective: the env's reward
    best2, results2 = tune_fixed(TINY, 5, seed=0, ray=False, objective="episode_reward")
    assert best2 == max(results2, key=lambda r: r["score"])["params"]
    assert lower_is_better("ttft_mean_ms") and not lower_is_better("token_hit_rate")


def test_successive_halving_rungs():
    best, results = tune_fixed(TINY, 9, seed=0, method="halving", ray=False, eta=3, min_steps=1)
    rungs = sorted({r["rung"] for r in results})
    assert rungs == [0, 1, 2]
    by_rung = {k: [r for r in results if r["rung"] == k] for k in rungs}
    assert [len(by_rung[k]) for k in rungs] == [9, 3, 1]
    assert [by_rung[k][0]["max_steps"] for k in rungs] == [1, 3, None]  # the last rung plays whole episodes
    assert all(r["steps"] == 1 for r in by_rung[0]) and all(r["steps"] == 3 for r in by_rung[1])
    assert by_rung[2][0]["steps"] == evaluate(FixedAgent(), TINY, 0)["summary"]["steps"]
    # survivors are the rung's best third
    top3 = sorted(by_rung[0], key=lambda r: (-r["score"], r["trial"]))[:3]
    assert sorted(r["trial"] for r in top3) == [r["trial"] for r in by_rung[1]]
    assert best == by_rung[2][0]["params"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown tuning method"):
        tune_fixed(TINY, 2, method="grid", ray=False)
    with pytest.raises(ValueError, match="objective 'nope'"):
        tune_fixed(TINY, 2, ray=False, objective="nope")
    with pytest.raises(ValueError, match="eta"):
        tune_fixed(TINY, 2, ray=False, method="halving", eta=1)
    with pytest.raises(ValueError, match="107-byte"):
        with ray_cluster(temp_dir="/tmp/" + "x" * 60):
            pass


def test_serial_equals_ray_on_a_private_local_cluster():
    serial_best, serial = tune_fixed(TINY, 4, seed=5, ray=False)
    before = {k: os.environ.get(k) for k in [*LOCAL_ENV, "HOME"]}
    seen = {}

    def probe(msg):  # runs inside the cluster's lifetime
        seen.update({k: os.environ.get(k) for k in LOCAL_ENV})

    ray_best, ray_results = tune_fixed(TINY, 4, seed=5, ray=True, num_cpus=2, progress=probe)
    assert ray_best == serial_best
    assert _strip(ray_results) == _strip(serial)
    assert seen == LOCAL_ENV  # the no-traffic settings were in force
    assert {k: os.environ.get(k) for k in before} == before  # and restored
    import ray

    assert not ray.is_initialized()


def test_tune_command_line(tmp_path):
    out = tmp_path / "best.json"
    env = json.dumps(TINY)
    assert cli_main(["tune", "--env", env, "--trials", "3", "--no-ray", "--out", str(out)]) == 0
    trials = json.loads((tmp_path / "best.trials.json").read_text())
    assert len(trials["results"]) == 3 and trials["env"] == TINY
    best = max(trials["results"], key=lambda r: r["score"])
    assert load_params(out) == best["params"]
    cfg = tmp_path / "tune.yaml"
    cfg.write_text(json.dumps({"env": TINY, "trials": 2, "method": "random"}))
    assert cli_main(["tune", "--config", str(cfg), "--no-ray", "--out", str(tmp_path / "b2.json")]) == 0
    cfg.write_text(json.dumps({"env": TINY, "n": 2}))
    assert cli_main(["tune", "--config", str(cfg), "--no-ray", "--out", str(tmp_path / "b3.json")]) == 2
