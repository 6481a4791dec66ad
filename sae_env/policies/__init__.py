"""Eviction policies by name. ``make_policy("lru")`` builds one; ``policy_names()`` lists them.

Policies are imported lazily, so that a learned policy's dependencies (torch) load only when it is used. To add a
policy, write a module with a subclass of :class:`~sae_env.policies.base.EvictionPolicy` and add one line here; an
unregistered one is named ``"module:Class"`` wherever a policy is named by :func:`make_policy`.
"""

from __future__ import annotations

from typing import Any

from sae_env.plugins import registered_class
from sae_env.policies.base import EvictionPolicy, KeyedPolicy, ParamSpec

POLICIES: dict[str, str] = {
    "lru": "sae_env.policies.lru:LRUPolicy",
    "lfu": "sae_env.policies.lfu:LFUPolicy",
    "fifo": "sae_env.policies.fifo:FIFOPolicy",
    "s3fifo": "sae_env.policies.s3fifo:S3FIFOPolicy",
    "belady": "sae_env.policies.belady:BeladyPolicy",
    "reuse-oracle": "sae_env.policies.partial_oracle:ReuseOraclePolicy",
    "session-oracle": "sae_env.policies.partial_oracle:SessionOraclePolicy",
    "when-oracle": "sae_env.policies.partial_oracle:WhenOraclePolicy",
    "lpc": "sae_env.policies.lpc:LPCPolicy",
    "saecache": "sae_env.policies.saecache:SAECachePolicy",
    "saecache-paper": "sae_env.policies.saecache:SAECachePaperPolicy",
}

__all__ = ["POLICIES", "EvictionPolicy", "KeyedPolicy", "ParamSpec", "make_policy", "policy_class", "policy_names"]


def policy_names() -> list[str]:
    return list(POLICIES)


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class of the named policy, or of ``"module:Class"`` (a policy of one's own, importable, not registered:
    an experiment's variant, a probe), checked before anything of it is called: it must be a class deriving from
    :class:`~sae_env.policies.base.EvictionPolicy`. ValueError otherwise, or for an unknown name."""
    return registered_class("policy", name, POLICIES, EvictionPolicy, "sae_env.policies.base.EvictionPolicy")


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """Build the named policy; options go to its constructor (unknown options raise ValueError)."""
    cls = policy_class(name)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"policy '{name}': bad options {sorted(options)} ({e})") from None
