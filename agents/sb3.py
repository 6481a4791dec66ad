"""Our agents behind Stable-Baselines3's policy interface, so that SB3's tools (``evaluate_policy``) score them.

SB3 evaluates anything with ``predict(observation, state, episode_start, deterministic) -> (actions, state)`` on a
vector env. Our agents act on one env and learn from what it did (:mod:`agents.base`: ``reset`` after the env's
reset, ``observe`` after each step, ``act`` for the next action), so :class:`AgentPolicy` keeps one agent per env
of an SB3 ``DummyVecEnv`` (whose envs live in this process, where the agents can read them) and drives the loop:

* ``episode_start[i]`` (the env was just reset, by SB3's automatic reset or by ``evaluate_policy``): a fresh copy
  of the agent is bound with ``reset(env)``;
* otherwise the env has stepped since the last call: the agent ``observe``\\ s that step (the observation, the
  reward, the episode's end and the info that the vector env recorded);
* then ``act`` gives the env's next action.

This needs no SB3 import; SB3 is the optional ``sb3`` extra (``pip install -e ".[sb3]"``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from agents.base import Agent

__all__ = ["AgentPolicy"]


class AgentPolicy:
    """SB3's ``predict`` for one of our agents on the envs of ``vec_env`` (an SB3 ``DummyVecEnv``)."""

    def __init__(self, agent: Agent, vec_env: Any):
        envs = getattr(vec_env, "envs", None)
        if envs is None:
            raise ValueError("AgentPolicy needs a vector env whose envs live in this process (SB3's DummyVecEnv, "
                             "the default of make_vec_env): our agents read the env they act on")
        self.template = agent
        self.vec_env = vec_env
        self.agents: list[Agent | None] = [None] * len(envs)

    def _agent(self, i: int, start: bool) -> Agent:
        agent = self.agents[i]
        if start or agent is None:
            agent = self.agents[i] = copy.deepcopy(self.template)
            agent.reset(self.vec_env.envs[i])
        return agent

    def predict(self, observation: dict[str, np.ndarray], state: Any = None, episode_start: np.ndarray | None = None,
                deterministic: bool = True) -> tuple[np.ndarray, None]:
        """The next action of every env (``observation`` is the vector env's batch, a dict of arrays)."""
        n = len(self.agents)
        starts = np.ones(n, dtype=bool) if episode_start is None else np.asarray(episode_start, dtype=bool)
        actions = []
        for i in range(n):
            obs = {k: v[i] for k, v in observation.items()}
            started = bool(starts[i]) or self.agents[i] is None
            agent = self._agent(i, started)
            # What the vector env recorded of the reset or of the step just taken (DummyVecEnv's reset_infos and
            # buf_* arrays).
            if started:
                info = self.vec_env.reset_infos[i]
            else:
                info = self.vec_env.buf_infos[i]
                agent.observe(obs, float(self.vec_env.buf_rews[i]), False, False, info)
            actions.append(np.asarray(agent.act(obs, info), dtype=np.float32))
        return np.stack(actions), None
