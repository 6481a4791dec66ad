"""Agents that set an eviction policy's parameters through :class:`sae_env.env.PrefixCacheEnv`.

``make_agent(name, **options)`` builds one by name (``agent_names()`` lists them); to add an agent, implement
:class:`agents.base.Agent` and add one line to ``AGENTS`` (``"module:Class"``, imported lazily, so that an agent's
heavy dependencies such as torch load only when it is used).
"""

from __future__ import annotations

import importlib
import inspect
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
           "agent_class", "check_agent_options", "evaluate", "load_params", "make_agent", "make_env", "save_params"]


def agent_names() -> list[str]:
    return list(AGENTS)


def agent_class(name: str) -> type[BaseAgent]:
    """The class of the named agent, or of ``"module:Class"``, checked before anything of it is called.

    A ``module:Class`` name must be a class deriving from :class:`agents.base.BaseAgent` (a config cannot make the
    runner call ``subprocess:run`` or any other callable); ValueError otherwise, or for an unknown name.
    """
    if not isinstance(name, str) or (name not in AGENTS and ":" not in name):
        raise ValueError(f"unknown agent {name!r}; valid agents: {', '.join(agent_names())} (or 'module:Class')")
    module, cls = AGENTS.get(name, name).split(":", 1)
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"agent '{name}': cannot import {module}:{cls} ({e})") from None
    if not (inspect.isclass(factory) and issubclass(factory, BaseAgent)):
        raise ValueError(f"agent '{name}': {module}:{cls} is not an agent class (a 'module:Class' agent must be a "
                         f"class deriving from agents.base.BaseAgent, got {type(factory).__name__})")
    return factory


def check_agent_options(name: str, options: dict[str, Any]) -> type[BaseAgent]:
    """:func:`agent_class` plus the options bound to its constructor's signature (nothing is called)."""
    cls = agent_class(name)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(f"agent '{name}': bad options {sorted(options)} ({e})") from None
    return cls


def make_agent(name: str, **options: Any) -> Agent:
    """Build the named agent, or the class at ``"module:Class"`` (see :func:`agent_class`); unknown names or
    options raise ValueError."""
    factory = check_agent_options(name, options)
    try:
        return factory(**options)
    except TypeError as e:
        raise ValueError(f"agent '{name}': bad options {sorted(options)} ({e})") from None
