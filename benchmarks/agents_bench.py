"""Measurements of the agents for the closing note: adaptation under workload shift, PPO, Ray fan-out.

Workload: the synthetic ``shift`` preset (600 s each of a templated-heavy, a chat-heavy and an agent-heavy mix;
sessions run on past the last phase, the "drain"), generator seed 0, SAECache at a fixed cache size of
``--capacity`` x the distinct blocks of that trace (an absolute number of blocks, so every env below has the same
cache whatever the trace it replays), windows of ``--window`` requests.

(a) **Mismatch.** ``tune_fixed`` (random search, ``--trials``, Ray) tunes constant parameters on a training workload
    made of the first phase only (the same generator with only the templated-heavy phase, seed 0, drained), then
    FixedAgent(defaults), FixedAgent(tuned on phase 0) and SAEOnlineAgent replay the whole shift trace. Reported:
    token hit rate overall and per phase, windows assigned to the phase holding their start time (windows that
    start after the last phase form "drain"); per phase = hit tokens / prompt tokens over its windows.
(b) **PPO.** PPO trains on generator seeds ``--ppo-seeds`` (1000-request segments) and PPOAgent (mean action) is
    compared with FixedAgent(defaults) on the held-out seed 0, whole trace.
(c) **Ray.** 8 equal trials (FixedAgent(defaults) on the phase-0 workload) serially, then as Ray tasks on a private
    2-CPU local cluster; wall times and their ratio (cluster start reported apart; workers start cold).

    python benchmarks/agents_bench.py [--parts abc] [--capacity 0.05] [--trials 24] [--ppo-steps 1536] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from agents import FixedAgent, SAEOnlineAgent, evaluate
from agents.tune import tune_fixed
from sae_env.ray_local import ray_cluster
from sae_env.sources.synthetic import PRESETS, generate, make_config

SHIFT = {"source": "synthetic", "preset": "shift", "seed": 0}


def phase_table(trace_meta: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Token hit rate per phase (by window start time) and overall, with window counts."""
    phases = trace_meta["phases"]
    starts = np.array([p["start"] for p in phases])
    end = phases[-1]["end"]
    names = [p["name"] for p in phases] + ["drain"]
    t0 = np.array([w["t_start"] for w in history])
    idx = np.where(t0 >= end, len(phases), np.searchsorted(starts, t0, side="right") - 1)
    hit = np.array([w["hit_tokens"] for w in history], dtype=np.float64)
    tok = np.array([w["prompt_tokens"] for w in history], dtype=np.float64)
    out = {}
    for k, name in enumerate(names):
        m = idx == k
        out[name] = {"token_hit_rate": float(hit[m].sum() / tok[m].sum()) if tok[m].sum() else float("nan"),
                     "windows": int(m.sum()), "prompt_tokens": int(tok[m].sum())}
    out["all"] = {"token_hit_rate": float(hit.sum() / tok.sum()), "windows": len(history),
                  "prompt_tokens": int(tok.sum())}
    return out


def _evaluate_job(agent_name: str, params: dict | None, env: dict, seed: int) -> dict[str, Any]:
    agent = SAEOnlineAgent() if agent_name == "sae_online" else FixedAgent(params, name=agent_name)
    res = evaluate(agent, env, seed)
    keep = ("t_start", "hit_tokens", "prompt_tokens", "params")
    return {"summary": res["summary"], "history": [{k: w[k] for k in keep} for w in res["history"]],
            "total_s": res["timing"]["total_s"]}


def part_a(env_full: dict, env_phase0: dict, trials: int, meta: dict, ray_mod: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    best, results = tune_fixed(env_phase0, trials, seed=0, ray=True,
                               progress=lambda m: print(f"  tune: {m}", file=sys.stderr))
    t_tune = time.perf_counter() - t0
    default_score = next(r["score"] for r in results if r["trial"] == 0)
    best_score = max(r["score"] for r in results)
    remote = ray_mod.remote(num_cpus=1)(_evaluate_job)
    jobs = {"fixed_default": (None,), "fixed_tuned_phase0": (best,), "sae_online": (None,)}
    t1 = time.perf_counter()
    refs = {name: remote.remote(name, p[0], env_full, 0) for name, p in jobs.items()}
    out = {name: ray_mod.get(ref) for name, ref in refs.items()}
    t_eval = time.perf_counter() - t1
    tables = {name: phase_table(meta, r["history"]) for name, r in out.items()}
    return {"tuned_params": best, "phase0_train_score": {"defaults": default_score, "tuned": best_score},
            "tables": tables, "tune_s": t_tune, "eval_s": t_eval,
            "sae_online_final_params": out["sae_online"]["summary"]["final_params"]}


def part_b(env_full: dict, seeds: list[int], steps: int, capacity: int, window: int) -> dict[str, Any]:
    from agents.ppo import PPOAgent, train

    config = {"seed": 0, "trace_seeds": seeds,
              "env": {"trace": {k: v for k, v in SHIFT.items() if k != "seed"}, "capacity": capacity,
                      "window": window, "segment_requests": 1000},
              "ppo": {"total_steps": steps, "num_envs": 2, "num_steps": 64, "gamma": 0.5, "learning_rate": 1e-3,
                      "init_log_std": -0.5, "update_epochs": 8}}
    t0 = time.perf_counter()
    result = train(config, log=lambda r: print(f"  ppo iter {r['iteration']}: mean reward "
                                               f"{r['charts/mean_reward']:.4f}, std {r['charts/action_std']:.3f}",
                                               file=sys.stderr))
    t_train = time.perf_counter() - t0
    ppo = evaluate(PPOAgent(model=result.model, config=result.config), env_full, 0)
    fixed = evaluate(FixedAgent(), env_full, 0)
    return {"train_s": t_train, "train_seeds": seeds, "total_steps": steps,
            "first_mean_reward": result.metrics[0]["charts/mean_reward"],
            "last_mean_reward": result.metrics[-1]["charts/mean_reward"],
            "heldout_seed0": {"ppo": ppo["summary"]["token_hit_rate"], "fixed_default": fixed["summary"]
                              ["token_hit_rate"]}}


def part_c(env_phase0: dict) -> dict[str, Any]:
    jobs = [(None, env_phase0, 0)] * 8

    def trial(params, env, seed):
        return evaluate(FixedAgent(params), env, seed)["summary"]["token_hit_rate"]

    t0 = time.perf_counter()
    serial = [trial(*j) for j in jobs]
    t_serial = time.perf_counter() - t0
    t1 = time.perf_counter()
    with ray_cluster(num_cpus=2) as ray:
        t_start = time.perf_counter() - t1
        remote = ray.remote(num_cpus=1)(_evaluate_job)
        t2 = time.perf_counter()
        par = [r["summary"]["token_hit_rate"] for r in ray.get([remote.remote("fixed", *j) for j in jobs])]
        t_ray = time.perf_counter() - t2
    if par != serial:
        raise RuntimeError("Ray and serial trials disagree")
    return {"serial_s": t_serial, "ray_s": t_ray, "ray_start_s": t_start, "speedup": t_serial / t_ray,
            "speedup_with_start": t_serial / (t_ray + t_start), "trial_s": t_serial / 8}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--capacity", type=float, default=0.05, help="fraction of the shift trace's distinct blocks")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--ppo-steps", type=int, default=1536)
    ap.add_argument("--ppo-seeds", default="1,2,3")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args(argv)

    trace = generate(make_config("shift", seed=0), preset="shift")
    capacity = int(round(args.capacity * trace.distinct_blocks()))
    phase0 = dict(PRESETS["shift"]["phases"][0])
    env_full = {"trace": SHIFT, "capacity": capacity, "window": args.window}
    env_phase0 = {"trace": {**SHIFT, "phases": [phase0]}, "capacity": capacity, "window": args.window}
    print(f"shift seed 0: {len(trace)} requests, {trace.distinct_blocks()} distinct blocks; cache {capacity} blocks "
          f"({args.capacity:.0%}); windows of {args.window} requests")
    report: dict[str, Any] = {"capacity_blocks": capacity, "capacity_fraction": args.capacity, "window": args.window}

    if "a" in args.parts:
        with ray_cluster(num_cpus=2) as ray:
            a = part_a(env_full, env_phase0, args.trials, trace.meta, ray)
        report["a"] = a
        cols = list(next(iter(a["tables"].values())))
        print(f"\n(a) tuned on phase 0 ({args.trials} trials, {a['tune_s']:.0f} s): phase-0 training hit rate "
              f"defaults {a['phase0_train_score']['defaults']:.4f} -> tuned {a['phase0_train_score']['tuned']:.4f}")
        print("token hit rate on the whole shift trace, by phase (windows by start time):")
        print(f"  {'agent':<20}" + "".join(f"{c:>12}" for c in cols))
        for name, table in a["tables"].items():
            print(f"  {name:<20}" + "".join(f"{table[c]['token_hit_rate']:12.4f}" for c in cols))
        print(f"  {'(windows)':<20}" + "".join(f"{table[c]['windows']:12d}" for c in cols))
        tuned, online = a["tables"]["fixed_tuned_phase0"], a["tables"]["sae_online"]
        later = [c for c in cols if c not in (cols[0], "all")]
        wins = [c for c in later if online[c]["token_hit_rate"] > tuned[c]["token_hit_rate"]]
        print(f"  SAEOnline beats the phase-0-tuned FixedAgent in {len(wins)}/{len(later)} later groups: {wins}")

    if "b" in args.parts:
        seeds = [int(s) for s in args.ppo_seeds.split(",")]
        b = part_b(env_full, seeds, args.ppo_steps, capacity, args.window)
        report["b"] = b
        h = b["heldout_seed0"]
        print(f"\n(b) PPO, {b['total_steps']} steps on seeds {seeds} ({b['train_s']:.0f} s; mean reward "
              f"{b['first_mean_reward']:.4f} -> {b['last_mean_reward']:.4f}); held-out seed 0: PPO "
              f"{h['ppo']:.4f} vs fixed defaults {h['fixed_default']:.4f} (diff {h['ppo'] - h['fixed_default']:+.4f})")

    if "c" in args.parts:
        c = part_c(env_phase0)
        report["c"] = c
        print(f"\n(c) 8 equal trials ({c['trial_s']:.2f} s each): serial {c['serial_s']:.1f} s, Ray on 2 CPUs "
              f"{c['ray_s']:.1f} s (+ {c['ray_start_s']:.1f} s cluster start): speed-up {c['speedup']:.2f}x "
              f"({c['speedup_with_start']:.2f}x with the start)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
