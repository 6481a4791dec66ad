"""The agents by name, and the learner each adaptive policy takes.

``AGENTS`` maps an agent kind to ``"module:Class"``, imported when it is used, so that an agent's heavy dependencies
(torch) load only then. ``LEARNERS`` maps a policy that learns online to the agent kind that adapts it: the
experiment's shorthand agents (``saecache`` = the saecache policy under its learner) and ``replay``'s adaptive mode
(the learner's window callback, :meth:`replay_callback`) both ask it, never a policy's name or class.
"""

from __future__ import annotations

import inspect
from typing import Any

from agents.base import Agent, BaseAgent
from sae_env.plugins import registered_class

__all__ = ["AGENTS", "LEARNERS", "agent_class", "agent_names", "check_agent_options", "learner_for", "make_agent"]

AGENTS: dict[str, str] = {
    "fixed": "agents.fixed:FixedAgent",
    "baseline": "agents.fixed:BaselineAgent",
    "sae_online": "agents.sae_online:SAEOnlineAgent",
    "ppo": "agents.ppo:PPOAgent",
}

def agent_names() -> list[str]:
    return list(AGENTS)


def agent_class(name: str) -> type[BaseAgent]:
    """The class of the named agent, or of ``"module:Class"``, checked before anything of it is called.

    A ``module:Class`` name must be a class deriving from :class:`agents.base.BaseAgent` (a config cannot make the
    runner call ``subprocess:run`` or any other callable); ValueError otherwise, or for an unknown name.
    """
    return registered_class("agent", name, AGENTS, BaseAgent, "agents.base.BaseAgent")


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


# The policies that learn online, and the agent kind whose learner adapts them (its class has ``replay_callback()``,
# the same learner as a replay window callback).
LEARNERS: dict[str, str] = {
    "saecache": "sae_online",
    "saecache-paper": "sae_online",
}


def learner_for(policy: str) -> str | None:
    """The agent kind that adapts ``policy`` online, or None for a policy without a learner."""
    return LEARNERS.get(policy)
