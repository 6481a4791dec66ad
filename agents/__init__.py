"""Agents that set an eviction policy's parameters through :class:`sae_env.env.PrefixCacheEnv`.

``make_agent(name, **options)`` builds one by name (``agent_names()`` lists them); to add an agent, implement
:class:`agents.base.Agent` and add one line to ``AGENTS`` in :mod:`agents.registry` (``"module:Class"``, imported
lazily, so that an agent's heavy dependencies such as torch load only when it is used). A policy that learns online
names its learner in ``LEARNERS`` there.
"""

from __future__ import annotations

from agents.base import Agent, BaseAgent
from agents.evaluate import CellRunner, evaluate, make_env
from agents.fixed import BaselineAgent, FixedAgent, load_params, save_params
from agents.registry import AGENTS, LEARNERS, agent_class, agent_names, check_agent_options, learner_for, make_agent
from agents.sae_online import SAEOnlineAgent

__all__ = ["AGENTS", "LEARNERS", "Agent", "BaseAgent", "BaselineAgent", "CellRunner", "FixedAgent", "SAEOnlineAgent",
           "agent_class", "agent_names", "check_agent_options", "evaluate", "learner_for", "load_params", "make_agent",
           "make_env", "save_params"]
