"""The Agent protocol: what every tuner (fixed, SAECache-online, PPO, baselines) offers to the one env loop.

The loop (:func:`agents.evaluate.evaluate` runs it; training code may run its own)::

    obs, info = env.reset(seed=seed)
    agent.reset(env, seed=seed)                  # bind to this episode's env (parameter mapping, replay)
    while True:
        action = agent.act(obs, info)            # parameters for the next window, as an action
        obs, reward, terminated, truncated, info = env.step(action)
        agent.observe(obs, reward, terminated, truncated, info)   # learning hook (optional)
        if terminated or truncated:
            break

Timing contract: the action returned by ``act`` after step ``k`` is applied by step ``k + 1``, before its window
is replayed; so a learner that updates in ``observe`` after window ``k`` acts exactly where a replay callback run
after window ``k`` would (the parameters apply to window ``k + 1``).

``reset`` receives the env (possibly wrapped: use ``env.unwrapped`` for ``params_to_action``,
``action_to_params``, ``noop_action``, ``replay``, ``last_stats``, ``policy``). Agents that only map observations
to actions (a trained PPO policy) may ignore it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Agent", "BaseAgent"]


@runtime_checkable
class Agent(Protocol):
    """Anything with ``name``, ``reset``, ``act`` and ``observe`` as below."""

    name: str

    def reset(self, env: Any = None, *, seed: int | None = None) -> None:
        """Start an episode on ``env`` (called after ``env.reset``)."""

    def act(self, observation: dict[str, np.ndarray], info: dict[str, Any]) -> np.ndarray:
        """The action for the next step."""

    def observe(self, observation: dict[str, np.ndarray], reward: float, terminated: bool, truncated: bool,
                info: dict[str, Any]) -> None:
        """Called after every step with what it returned."""


class BaseAgent:
    """Convenience base: keeps the unwrapped env from :meth:`reset`; ``observe`` does nothing."""

    name = "agent"

    def __init__(self) -> None:
        self.env: Any = None

    def reset(self, env: Any = None, *, seed: int | None = None) -> None:
        self.env = None if env is None else env.unwrapped

    def act(self, observation: dict[str, np.ndarray], info: dict[str, Any]) -> np.ndarray:
        raise NotImplementedError

    def observe(self, observation: dict[str, np.ndarray], reward: float, terminated: bool, truncated: bool,
                info: dict[str, Any]) -> None:
        pass

    def _env(self) -> Any:
        if self.env is None:
            raise RuntimeError(f"agent {self.name!r}: call reset(env) after env.reset() before act()")
        return self.env

    def describe(self) -> dict[str, Any]:
        """JSON-able description of the agent's configuration (for result files)."""
        return {"name": self.name}
