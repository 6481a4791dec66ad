"""The fixed-parameter alternative: search a policy's constant parameters on a training workload.

:func:`tune_fixed` evaluates candidate parameter vectors, each as one episode of
``agents.evaluate.evaluate(FixedAgent(params), env_config, seed)``, and returns the best one with every trial's
result. Candidates are points of the env's action box ``[-1, 1]^d`` mapped to parameter values exactly as the env maps
actions (log scale for log parameters, :func:`sae_env.policies.params.action_to_values`):

* trial 0 is always the policy's defaults, so the tuned parameters never score below the defaults on the training
  workload;
* ``method="random"``: the other trials are uniform draws from the box (``numpy.random.default_rng(seed)``);
* ``method="halving"``: successive halving over the same draws. Rung ``r`` scores the survivors on the first
  ``min_steps * eta ** r`` windows (the env's ``max_steps``), keeps the best ``1 / eta`` (at least one), and the last
  rung plays whole episodes. Scores of a rung are compared only within the rung. ``results`` holds every evaluation
  with its ``rung`` and ``max_steps``; the best is taken from the last rung.

Scoring: ``objective`` names a key of the episode summary (default ``token_hit_rate``; ``episode_reward`` for the
env's reward); keys of latencies (``ttft_*``, ``queue_*``) are minimised, everything else maximised. Ties go to the
lower trial index, so the result is a pure function of the arguments.

Execution: with ``ray=True`` every trial is a Ray task (one CPU each) on a private local cluster started as
:mod:`sae_env.ray_local` describes (or on the cluster at ``ray_address``); with ``ray=False`` trials run one after
another in this process. A trial is deterministic (seeded env, constant agent), and results are gathered in trial
order, so both give identical results (a test checks it).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from agents.evaluate import evaluate, make_env
from agents.fixed import FixedAgent, save_params
from sae_env.files import write_json
from sae_env.policies.params import action_to_values

__all__ = ["METHODS", "add_cli", "candidate_params", "lower_is_better", "tune_fixed"]

METHODS = ("random", "halving")
_MAX_TRIALS = 1_000_000  # more is a typo: each trial is at least one episode


def lower_is_better(objective: str) -> bool:
    """Whether smaller values of a summary key are better (latencies)."""
    return objective.startswith(("ttft", "queue"))


def candidate_params(env_config: Mapping[str, Any] | None, n: int, seed: int = 0) -> list[dict[str, float]]:
    """``n`` parameter vectors: the env's defaults first, then uniform draws from the action box."""
    if isinstance(n, bool) or not 1 <= int(n) <= _MAX_TRIALS:
        raise ValueError(f"n_trials must lie in [1, {_MAX_TRIALS:,}], got {str(n)[:40]}")
    env = make_env(env_config)
    specs = env.param_specs
    if not specs:
        raise ValueError(f"policy {env.policy_name!r} has no parameters to tune")
    defaults = dict(env.default_params)
    env.close()
    rng = np.random.default_rng(seed)
    draws = rng.uniform(-1.0, 1.0, size=(int(n) - 1, len(specs)))
    return [defaults] + [action_to_values(specs, a) for a in draws]


def _trial(params: dict[str, float], env_config: Mapping[str, Any] | None, seed: int) -> dict[str, Any]:
    """One trial: the summary of one FixedAgent episode (without its wall-clock timing)."""
    result = evaluate(FixedAgent(params), env_config, seed)
    return {"summary": result["summary"], "replay_s": result["timing"]["replay_s"]}


def _score(summary: Mapping[str, Any], objective: str) -> float:
    if objective not in summary:
        raise ValueError(f"objective {objective!r} is not a summary key; valid: {sorted(summary)}")
    v = summary[objective]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"objective {objective!r} must be a finite number in the episode summary, got {v!r}")
    return float(v)


def _runner(ray: bool, num_cpus: int | None, ray_address: str | None):
    """A context manager yielding ``run(list of (params, env_config, seed)) -> list of trial results``."""
    from contextlib import contextmanager

    @contextmanager
    def serial():
        yield lambda jobs: [_trial(*job) for job in jobs]

    @contextmanager
    def distributed():
        from sae_env.ray_local import ray_cluster

        with ray_cluster(num_cpus=num_cpus, address=ray_address) as r:
            remote = r.remote(num_cpus=1, max_retries=2)(_remote_trial)
            yield lambda jobs: r.get([remote.remote(*job) for job in jobs])

    return distributed() if ray else serial()


def _remote_trial(params: dict[str, float], env_config: Mapping[str, Any] | None, seed: int) -> dict[str, Any]:
    try:  # the env needs no threads; a worker that imported torch would otherwise spin one per core
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    return _trial(params, env_config, seed)


def tune_fixed(env_config: Mapping[str, Any] | None, n_trials: int, seed: int = 0, method: str = "random",
               ray: bool = True, *, objective: str = "token_hit_rate", eta: int = 3, min_steps: int = 2,
               num_cpus: int | None = None, ray_address: str | None = None,
               progress: Callable[[str], None] | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Search constant parameters; returns ``(best_params, results)`` (see the module docstring).

    ``results``: one dict per evaluation, in order: ``trial``, ``rung``, ``max_steps`` (None = whole episode),
    ``params``, ``score``, ``token_hit_rate``, ``episode_reward``, ``steps``, ``replay_s`` (wall clock; the only value
    that differs between runs). The best params are the full parameter vector (every name).
    """
    if method not in METHODS:
        raise ValueError(f"unknown tuning method {method!r}; valid: {list(METHODS)}")
    if isinstance(eta, bool) or int(eta) < 2:
        raise ValueError(f"eta must be an integer >= 2, got {eta!r}")
    if isinstance(min_steps, bool) or int(min_steps) < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps!r}")
    env_config = dict(env_config or {})
    candidates = candidate_params(env_config, n_trials, seed)
    sign = -1.0 if lower_is_better(objective) else 1.0
    say = progress or (lambda _msg: None)

    # rungs: (trial indices, max_steps); random search is one rung of whole episodes
    results: list[dict[str, Any]] = []
    alive = list(range(len(candidates)))
    steps_cap = env_config.get("max_steps")
    rung = 0
    with _runner(ray, num_cpus, ray_address) as run:
        while True:
            last = method == "random" or len(alive) == 1
            max_steps = steps_cap
            if not last:
                max_steps = int(min_steps) * int(eta) ** rung
                if steps_cap is not None and max_steps >= steps_cap:
                    max_steps, last = steps_cap, True
            cfg = dict(env_config, max_steps=max_steps) if max_steps is not None else env_config
            t0 = time.perf_counter()
            out = run([(candidates[i], cfg, seed) for i in alive])
            rows = []
            for i, res in zip(alive, out, strict=True):
                s = res["summary"]
                rows.append({"trial": i, "rung": rung, "max_steps": max_steps, "params": candidates[i],
                             "score": _score(s, objective), "token_hit_rate": s["token_hit_rate"],
                             "episode_reward": s["episode_reward"], "steps": s["steps"],
                             "truncated": s["truncated"], "replay_s": res["replay_s"]})
            results += rows
            say(f"rung {rung}: {len(rows)} trial(s), max_steps {max_steps}, {time.perf_counter() - t0:.1f} s, "
                f"best {objective} {max(sign * r['score'] for r in rows) * sign:.4f}")
            # A rung whose episodes all ended before max_steps already saw whole episodes: it is the last.
            if last or not any(r["truncated"] for r in rows):
                break
            ranked = sorted(rows, key=lambda r: (-sign * r["score"], r["trial"]))
            alive = sorted(r["trial"] for r in ranked[:max(1, len(ranked) // int(eta))])
            rung += 1
    final = [r for r in results if r["rung"] == rung]
    best = min(final, key=lambda r: (-sign * r["score"], r["trial"]))
    return dict(best["params"]), results


# ----------------------------------------------------------------------------------------------------------------
# Command line: python train.py tune ...


def _read_mapping(text: str, what: str) -> dict[str, Any]:
    """A mapping from a YAML / JSON file path or an inline YAML mapping."""
    from sae_env.files import read_mapping

    return read_mapping(text, what, inline=True)[0]


_CONFIG_KEYS = {"env", "trials", "seed", "method", "objective", "eta", "min_steps"}


def cmd_tune(args: argparse.Namespace) -> int:
    from sae_env.cli import config_path, parse_overrides
    from sae_env.files import apply_overrides, resolve_paths

    config: dict[str, Any] = {}
    where = "--set"
    if args.config:
        path = config_path(args.config)
        config, where = resolve_paths(_read_mapping(str(path), "--config"), path.parent), str(path)
    if args.env:
        config["env"] = {**(config.get("env") or {}), **_read_mapping(args.env, "--env")}
    config = apply_overrides(config, parse_overrides(args.set))
    unknown = sorted(set(config) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(_CONFIG_KEYS)}")
    env_config = dict(config.get("env") or {})
    n_trials = args.trials if args.trials is not None else config.get("trials", 16)
    seed = args.seed if args.seed is not None else config.get("seed", 0)
    method = args.method or config.get("method", "random")
    objective = args.objective or config.get("objective", "token_hit_rate")
    t0 = time.perf_counter()
    best, results = tune_fixed(env_config, int(n_trials), int(seed), method, ray=not args.serial,
                               objective=objective, eta=int(config.get("eta", 3)),
                               min_steps=int(config.get("min_steps", 2)), num_cpus=args.num_cpus,
                               ray_address=args.ray_address, progress=lambda m: print(m, file=sys.stderr))
    wall = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_params(out, best)
    trials_path = out.with_name(out.stem + ".trials.json")
    write_json(trials_path, {"env": _jsonable(env_config), "n_trials": int(n_trials), "seed": int(seed),
                             "method": method, "objective": objective, "wall_s": wall, "results": results}, indent=1)
    final = [r for r in results if r["rung"] == results[-1]["rung"]]
    top = next(r for r in final if r["params"] == best)
    default = next((r for r in final if r["trial"] == 0), None)
    print(f"best trial {top['trial']}: {objective} {top['score']:.4f}"
          + (f" (defaults {default['score']:.4f})" if default is not None else "")
          + f"; {len(results)} evaluations in {wall:.1f} s ({'serial' if args.serial else 'ray'})")
    print(f"wrote {out} and {trials_path}")
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand."""
    p = subparsers.add_parser("tune", help="tune a policy's fixed parameters on a training workload",
                              description="Search constant parameters (random search or successive halving over "
                              "the env's action box; trial 0 = the defaults), one FixedAgent episode per trial, as "
                              "Ray tasks on a private local cluster (no off-machine traffic) or serially. Writes "
                              "the best parameters (FixedAgent / --params file) and all trials.")
    p.add_argument("--config", metavar="FILE", help="YAML with 'env' (PrefixCacheEnv options) and optionally "
                   "trials, seed, method, objective, eta, min_steps")
    p.add_argument("--env", metavar="FILE|YAML", help="env options (a YAML / JSON file or an inline mapping, e.g. "
                   "\"{trace: {source: synthetic, preset: tiny}, capacity: 0.05}\"); merged over --config's env")
    p.add_argument("--trials", type=int, help="number of candidates (default 16)")
    p.add_argument("--seed", type=int, help="seed of the draws and of every episode (default 0)")
    p.add_argument("--method", choices=METHODS, help="random (default) or halving (successive halving)")
    p.add_argument("--objective", help="summary key to optimise (default token_hit_rate)")
    from sae_env.cli import add_serial_option, add_set_option, positive_int

    add_serial_option(p, "run the trials one after another in this process (no Ray)")
    add_set_option(p, "--set env.capacity=0.05 --set trials=8")
    p.add_argument("--num-cpus", type=positive_int, help="CPUs of the local Ray cluster (default: all)")
    p.add_argument("--ray-address", help="use an existing Ray cluster (its network setup is its owner's)")
    p.add_argument("--out", required=True, metavar="FILE", help="best parameters (.json); trials go to "
                   "FILE.trials.json")
    p.set_defaults(func=cmd_tune)
    return p

