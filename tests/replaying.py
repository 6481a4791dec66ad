"""Replay a built policy as ``train.py replay`` replays it: instant serving, windows of 200 requests, the policy's
online learners (agents.cli.AgentsExtension), the engine ``auto`` picks unless told. For tests that compare a CLI's or
a benchmark's figure with a policy they built (and may inspect after)."""

from __future__ import annotations

import argparse
from typing import Any

from agents.cli import AgentsExtension
from sae_env.cache import PrefixCache
from sae_env.metrics import summarize
from sae_env.replay import Replay
from sae_env.trace import Trace


def replay_like_train(trace: Trace, capacity: int, policy: Any, engine: str = "auto") -> Replay:
    """The finished replay of ``policy`` on ``trace`` with a cache of ``capacity`` blocks."""
    callbacks = AgentsExtension().replay_callbacks(argparse.Namespace(fixed=False), policy)
    rep = Replay(trace, PrefixCache(capacity, policy), None, window_requests=200, callbacks=callbacks, engine=engine)
    rep.run()
    return rep


def token_hit_rate(rep: Replay) -> float:
    return summarize(rep.windows)["token_hit_rate"]
