"""Agents that set an eviction policy's parameters through :class:`sae_env.env.PrefixCacheEnv`.

``make_agent(name, **options)`` builds one by name (``agent_names()`` lists them); to add an agent, implement
:class:`agents.base.Agent` and add one line to ``AGENTS`` (``"module:Class"``, imported lazily, so that an agent's
heavy dependencies such as torch load only when it is used).
"""

from __future__ import annotations

import importlib
from typing import Any

from agents.base import Agent, BaseAgent
from agents.evaluate import CellRunner, evaluate, make_env
from agents.fixed import BaselineAgent, FixedAgent, load_params, save_params
from agents.sae_online import SAEOnlineAgent

AGENTS: dict[str, str] = {
    "fixed": "agents.fixed:FixedAgent",
    "baseline": "agents.fixed:BaselineAgent",
    "sae_online": "agents.sae_online:SAEOnlineAgent",
    "ppo": "agents.ppo:PPOAgent",
}

__all__ = ["AGENTS", "Agent", "CellRunner", "BaseAgent", "BaselineAgent", "FixedAgent", "SAEOnlineAgent", "agent_names",
           "evaluate", "load_params", "make_agent", "make_env", "save_params"]


def agent_names() -> list[str]:
    return list(AGENTS)


def make_agent(name: str, **options: Any) -> Agent:
    """Build the named agent, or the class at ``"module:Class"``; unknown names or options raise ValueError."""
    if name not in AGENTS and ":" not in name:
        raise ValueError(f"unknown agent '{name}'; valid agents: {', '.join(agent_names())} (or 'module:Class')")
    module, cls = AGENTS.get(name, name).split(":", 1)
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"agent '{name}': cannot import {module}:{cls} ({e})") from None
    try:
        return factory(**options)
    except TypeError as e:
        raise ValueError(f"agent '{name}': bad options {sorted(options)} ({e})") from None
