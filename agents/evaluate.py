"""One episode of one agent on one env configuration: the unit of work of every experiment cell.

:func:`evaluate` builds a :class:`~sae_env.env.PrefixCacheEnv` from ``env_config`` (its keyword arguments), runs
the loop of :mod:`agents.base` once from ``env.reset(seed=seed)`` and returns

* ``history``: one dict per window: :meth:`WindowStats.to_dict` plus ``reward``, ``params`` (in effect during the
  window), ``action`` (as received) and ``clipped`` (invalid action components so far);
* ``summary``: :func:`sae_env.metrics.summarize` over the windows plus ``agent``, ``episode_reward``, ``steps``,
  ``terminated``, ``truncated``, ``clipped``, ``final_params`` (in effect during the last window),
  ``distinct_blocks``, ``trace_requests``, ``segment_start``, ``oracle``, ``serving``, ``reward_kind`` and
  ``compulsory_misses`` (prompt blocks served whose key no earlier request holds: misses for every policy,
  :func:`sae_env.explain.first_references`);
* ``ttft_quantiles_ms``: the 0th, 1st, ..., 100th percentiles of every request's TTFT (timed serving only; a
  CDF in 101 numbers);
* ``timing``: wall-clock seconds (``replay_s``, ``total_s``): the only non-deterministic values, kept apart so
  that result files compare equal across runs.

:class:`CellRunner` is what the experiment runner (:mod:`sae_env.experiment`) calls for each cell: it builds the
agent and the env from the cell and returns a compact, JSON-able result.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from agents.base import Agent
from agents.registry import AGENTS, check_agent_options, learner_for, make_agent
from sae_env.env import PrefixCacheEnv
from sae_env.explain import first_references
from sae_env.metrics import percentile, summarize

__all__ = ["CellRunner", "evaluate", "make_env"]

_ENV_KEYS = frozenset(inspect.signature(PrefixCacheEnv.__init__).parameters) - {"self"}


def make_env(env_config: Mapping[str, Any] | None = None) -> PrefixCacheEnv:
    """A :class:`PrefixCacheEnv` from a config dict; unknown keys raise ValueError listing the valid ones."""
    config = dict(env_config or {})
    unknown = sorted(set(config) - _ENV_KEYS)
    if unknown:
        raise ValueError(f"unknown env option(s) {unknown}; valid: {sorted(_ENV_KEYS)}")
    return PrefixCacheEnv(**config)


def evaluate(agent: Agent, env_config: Mapping[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    """Run one episode of ``agent`` on the env built from ``env_config``; see the module docstring."""
    t0 = time.perf_counter()
    env = make_env(env_config)
    obs, info = env.reset(seed=seed)
    agent.reset(env, seed=seed)
    history: list[dict[str, Any]] = []
    total = 0.0
    terminated = truncated = False
    while not (terminated or truncated):
        action = agent.act(obs, info)
        obs, reward, terminated, truncated, info = env.step(action)
        agent.observe(obs, reward, terminated, truncated, info)
        total += reward
        row = env.last_stats.to_dict()
        row.update(reward=reward, params=info["params"], action=np.asarray(action, dtype=np.float64).tolist(),
                   clipped=info["clipped"])
        history.append(row)
    replay = env.replay
    ttft = sorted(x for w in replay.windows for x in w.ttft_ms)
    quantiles = [percentile(ttft, q) for q in range(101)] if ttft else None
    summary = summarize(replay.windows, policy=env.policy_name, block_size=env.trace.block_size, timed=env.timed)
    summary.update(agent=getattr(agent, "name", type(agent).__name__), episode_reward=total, steps=len(history),
                   terminated=bool(terminated), truncated=bool(truncated), clipped=info["clipped"],
                   final_params=env.params, distinct_blocks=env.trace.distinct_blocks(),
                   trace_requests=len(env.trace), segment_start=env.segment_start, oracle=env.policy.oracle,
                   serving=env.serving if isinstance(env.serving, str) else dict(env.serving),
                   reward_kind=env.reward_kind,
                   compulsory_misses=_compulsory(replay, env.cache_outputs))
    env.close()
    return {"history": history, "summary": summary, "ttft_quantiles_ms": quantiles,
            "timing": {"replay_s": replay.wall_s, "total_s": time.perf_counter() - t0}}


def _compulsory(replay: Any, cache_outputs: bool) -> int:
    """First references among the prompt blocks the replay served (all of them unless the episode was cut)."""
    trace = replay.trace
    return int(first_references(trace, cache_outputs)[:trace.prompt_offsets[replay.next_request]].sum())


# Per-window keys kept in an experiment's result files (the rest of WindowStats.to_dict stays in memory).
_HISTORY_KEYS = ("index", "start", "t_start", "t_end", "requests", "prompt_tokens", "hit_tokens", "prompt_blocks",
                 "hit_blocks", "token_hit_rate", "block_hit_rate", "evictions", "bypasses", "ttft_mean_ms",
                 "ttft_p99_ms", "occupancy", "occupancy_by_queue", "hit_rate_by_type", "app_share", "reward",
                 "params")


class CellRunner:
    """Runs an experiment cell (:class:`sae_env.experiment.CellRunner`): one episode of :func:`evaluate`.

    A cell's agent spec names an agent kind of :data:`agents.AGENTS` (or ``"module:Class"``) with its options, and
    a policy with its options; a ``predictor`` policy option given as a path loads a session-predictor checkpoint.
    The trace is handed in (the runner shares it between cells); the env replays all of it (no segments). A cell
    whose task says ``device: cuda`` runs its torch models (PPO agent, session predictor) there.
    Each history row gets ``phase``: the index in ``phases`` of its first request's phase (-1: none), from the
    trace's phase schedule (synthetic and mix traces).
    """

    # Agent shorthands besides the bare policy names (a bare policy name is its policy under ``baseline``): a
    # policy that learns online stands for itself under its learner (agents.registry.LEARNERS).
    presets: dict[str, dict[str, Any]] = {
        "saecache": {"policy": "saecache", "agent": learner_for("saecache")},  # the full adaptive method
        "saecache-fixed": {"policy": "saecache", "agent": "fixed"},  # SAECache's default parameters, no learning
        "saecache-paper": {"policy": "saecache-paper", "agent": learner_for("saecache-paper")},  # the paper's
    }

    # Agent kinds that run a torch model (they take a ``device`` option).
    model_kinds: frozenset[str] = frozenset({"ppo"})

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(AGENTS)

    def uses_model(self, cell: Mapping[str, Any]) -> bool:
        """Whether the cell runs a torch model: a learned agent or the session predictor (``ray.gpus_per_cell``)."""
        spec = cell["agent"]
        return spec["agent"] in self.model_kinds or (spec.get("policy_options") or {}).get("predictor") is not None

    def check_agent(self, spec: Mapping[str, Any], build: bool = False) -> None:
        """Validate an agent spec (ValueError saying what is wrong): a ``module:Class`` agent must be an agent class
        and take the options (nothing of it is called). ``build`` (just before the cells run): a registered agent
        is built once with its options, which checks their values (a params file that exists, ...)."""
        kind, options = spec["agent"], dict(spec.get("options") or {})
        check_agent_options(kind, options)
        if build and kind in AGENTS:
            make_agent(kind, **options)

    def __call__(self, cell: Mapping[str, Any], trace: Any) -> dict[str, Any]:
        spec = cell["agent"]
        device = cell.get("device", "cpu")  # "cuda" when the cell was given a GPU (sae_env.experiment)
        policy_options = dict(spec.get("policy_options") or {})
        if isinstance(policy_options.get("predictor"), str):
            from agents.session_predictor import SessionPredictor

            predictor = SessionPredictor.load(policy_options["predictor"], device=device)
            policy_options["predictor"] = predictor.as_policy_callable()
        options = dict(spec.get("options") or {})
        if spec["agent"] in self.model_kinds:
            options.setdefault("device", device)
        agent = make_agent(spec["agent"], **options)
        agent.name = spec["name"]
        env_config = {"trace": trace, "capacity": cell["capacity"], "policy": spec["policy"],
                      "policy_options": policy_options, "serving": cell["serving"], "window": cell["window"],
                      "reward": cell["reward"], "load": cell.get("load")}
        out = evaluate(agent, env_config, seed=int(cell["seed"]))
        phases, phase_of_request = _phases(trace)
        history = []
        for row in out["history"]:
            kept = {k: row[k] for k in _HISTORY_KEYS if k in row}
            kept["phase"] = int(phase_of_request[row["start"]]) if phase_of_request is not None else -1
            history.append(kept)
        return {"summary": out["summary"], "history": history, "phases": phases,
                "ttft_quantiles_ms": out["ttft_quantiles_ms"], "timing": out["timing"]}


def _phases(trace: Any) -> tuple[list[dict[str, Any]], np.ndarray | None]:
    schedule = trace.meta.get("phases") if isinstance(getattr(trace, "meta", None), dict) else None
    if not schedule:
        return [], None
    from sae_env.sources.synthetic import phase_of

    names = [str(p.get("name", f"phase {i}")) for i, p in enumerate(schedule)]
    return [{"name": n} for n in names], phase_of(trace, by="time")
