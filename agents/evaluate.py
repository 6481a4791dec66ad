"""One episode of one agent on one env configuration: the unit of work of every experiment cell.

:func:`evaluate` builds a :class:`~sae_env.env.PrefixCacheEnv` from ``env_config`` (its keyword arguments), runs
the loop of :mod:`agents.base` once from ``env.reset(seed=seed)`` and returns

* ``history``: one dict per window: :meth:`WindowStats.to_dict` plus ``reward``, ``params`` (in effect during the
  window), ``action`` (as received) and ``clipped`` (invalid action components so far);
* ``summary``: :func:`sae_env.metrics.summarize` over the windows plus ``agent``, ``episode_reward``, ``steps``,
  ``terminated``, ``truncated``, ``clipped``, ``final_params`` (in effect during the last window),
  ``distinct_blocks``, ``trace_requests``, ``segment_start``, ``oracle``, ``serving``, ``reward_kind``;
* ``timing``: wall-clock seconds (``replay_s``, ``total_s``): the only non-deterministic values, kept apart so
  that result files compare equal across runs.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from agents.base import Agent
from sae_env.env import PrefixCacheEnv
from sae_env.metrics import summarize

__all__ = ["evaluate", "make_env"]

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
    summary = summarize(replay.windows, policy=env.policy_name, block_size=env.trace.block_size, timed=env.timed)
    summary.update(agent=getattr(agent, "name", type(agent).__name__), episode_reward=total, steps=len(history),
                   terminated=bool(terminated), truncated=bool(truncated), clipped=info["clipped"],
                   final_params=env.params, distinct_blocks=env.trace.distinct_blocks(),
                   trace_requests=len(env.trace), segment_start=env.segment_start, oracle=env.policy.oracle,
                   serving=env.serving if isinstance(env.serving, str) else dict(env.serving),
                   reward_kind=env.reward_kind)
    env.close()
    return {"history": history, "summary": summary,
            "timing": {"replay_s": replay.wall_s, "total_s": time.perf_counter() - t0}}
