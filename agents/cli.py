"""The agents' part of the command line: plugged into :mod:`sae_env.cli` as an extension (see ``train.py``).

It gives ``replay`` the adaptive SAECache (its online learners run after every window unless ``--fixed``), hands a
trained session predictor (``--predictor FILE``) to the policies that take one, and adds the agents' subcommands.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from sae_env import cli as core_cli
from sae_env.policies import EvictionPolicy, policy_class


class AgentsExtension:
    """The :class:`sae_env.cli.CliExtension` of this package."""

    def __init__(self) -> None:
        self._predictor = None

    def add_commands(self, sub: Any) -> None:
        from agents.tune import add_cli as add_tune

        add_tune(sub)
        try:
            from agents.ppo import add_cli as add_ppo
            from agents.session_predictor import add_cli
        except ImportError:  # the predictor and PPO need torch
            return
        add_cli(sub)
        add_ppo(sub)

    def add_replay_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--fixed", action="store_true", help="keep adaptive policies' parameters fixed (no "
                            "online learning); saecache then runs with its default or --params values")
        parser.add_argument("--predictor", metavar="FILE", help="a session predictor checkpoint (train.py "
                            "predictor) for policies that take one (saecache, lpc)")

    def policy_options(self, args: argparse.Namespace, policy: str) -> dict[str, Any]:
        if not getattr(args, "predictor", None):
            return {}
        if "predictor" not in inspect.signature(policy_class(policy).__init__).parameters:
            return {}
        if self._predictor is None:
            from agents.session_predictor import SessionPredictor

            self._predictor = SessionPredictor.load(args.predictor)
        return {"predictor": self._predictor.as_policy_callable()}

    def replay_callbacks(self, args: argparse.Namespace, policy: EvictionPolicy) -> list:
        if getattr(args, "fixed", False) or policy.name != "saecache":
            return []
        from agents.sae_online import SAEOnlineLearner

        return [SAEOnlineLearner().callback()]


    def cell_runner(self) -> Any:
        from agents.evaluate import CellRunner

        return CellRunner()


def main(argv: list[str] | None = None) -> int:
    return core_cli.main(argv, extensions=[AgentsExtension()])
