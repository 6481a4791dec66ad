"""Eviction policies by name. ``make_policy("lru")`` builds one; ``policy_names()`` lists them.

Policies are imported lazily, so that a learned policy's dependencies (torch) load only when it is used. To add a
policy, write a module with a subclass of :class:`~sae_env.policies.base.EvictionPolicy` and add one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

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
    if name not in POLICIES:
        raise ValueError(f"unknown policy '{name}'; valid policies: {', '.join(policy_names())}")
    module, cls = POLICIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """Build the named policy; options go to its constructor (unknown options raise ValueError)."""
    cls = policy_class(name)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"policy '{name}': bad options {sorted(options)} ({e})") from None
