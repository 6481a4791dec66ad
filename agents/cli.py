"""The agents' part of the command line: plugged into :mod:`sae_env.cli` as an extension (see ``train.py``).

It gives ``replay`` the adaptive SAECache (its online learners run after every window unless ``--fixed``), hands a
trained session predictor (``--predictor FILE``) to the policies that take one, and adds the agents' subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from typing import Any

from agents.registry import agent_class, learner_for
from sae_env import cli as core_cli
from sae_env.policies import EvictionPolicy, policy_class


class AgentsExtension:
    """The :class:`sae_env.cli.CliExtension` of this package."""

    def __init__(self) -> None:
        self._predictor = None

    def add_commands(self, sub: Any) -> None:
        from agents.tune import add_cli as add_tune

        add_tune(sub)
        add_predictor_command(sub)
        add_ppo_command(sub)

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
        """The learner registered for the policy (:data:`agents.registry.LEARNERS`), unless ``--fixed``."""
        kind = learner_for(policy.name)
        if getattr(args, "fixed", False) or kind is None:
            return []
        return [agent_class(kind).replay_callback()]

    def cell_runner(self) -> Any:
        from agents.evaluate import CellRunner

        return CellRunner()


def _run(target: str) -> Any:
    """A subcommand handler ``"module:function"`` imported when it runs: the torch-based modules load only for
    their own subcommands, so ``--help`` and the other commands start without torch (~3 s)."""
    def handler(args: argparse.Namespace) -> int:
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name)(args)

    return handler


def add_device_option(p: argparse.ArgumentParser) -> None:
    """``--device``: where a training command's torch model trains (agents/device.py)."""
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees one, else the CPU; default), cpu, "
                   "cuda or cuda:N")


def add_predictor_command(subparsers: Any) -> argparse.ArgumentParser:
    """The ``predictor`` subcommand (agents/session_predictor.py)."""
    p = subparsers.add_parser("predictor", help="train and evaluate the session predictor",
                              description="Train the ~1 M-parameter session predictor on the first requests of one "
                              "or more traces, report held-out accuracy / AUC / throughput, write the checkpoint. "
                              "Text traces need --opt features=ngram for text features.")
    p.add_argument("--train", nargs="+", required=True, metavar="TRACE",
                   help="trace files or embedded trace names (e.g. wildchat taubench mooncake_arxiv)")
    p.add_argument("--source", help="input format of the traces (inferred for embedded traces and .npz)")
    p.add_argument("--opt", action="append", metavar="KEY=VALUE", help="a source option (repeatable), e.g. "
                   "--opt features=ngram")
    p.add_argument("--out", required=True, help="checkpoint file to write (.pt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--val-fraction", type=float, default=0.2, help="share of sessions held out (default 0.2)")
    p.add_argument("--json", help="also write the report as JSON")
    add_device_option(p)
    core_cli.add_wandb_options(p)
    p.set_defaults(func=_run("agents.session_predictor:cmd_predictor"))
    return p


def add_ppo_command(subparsers: Any) -> argparse.ArgumentParser:
    """The ``ppo`` subcommand (agents/ppo.py)."""
    p = subparsers.add_parser("ppo", help="train a PPO agent that sets the policy's parameters",
                              description="Train PPO (actor-critic MLP, Gaussian actions around the policy's "
                              "defaults, GAE, clipped objective) on PrefixCacheEnv and write checkpoint.pt, "
                              "metrics.json, config.json (and eval.json with an 'eval' section) to --out.")
    p.add_argument("--config", default="ppo", help="run configuration: a file, or a shipped config by name "
                   "(default: ppo, i.e. configs/ppo.yaml)")
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/ppo-<date>-<time>)")
    core_cli.add_set_option(p, "--set ppo.num_envs=4 --set env.capacity=0.05")
    p.add_argument("--total-steps", type=int, help="override ppo.total_steps (= --set ppo.total_steps=N)")
    p.add_argument("--seed", type=int, help="override seed (= --set seed=N)")
    add_device_option(p)
    core_cli.add_wandb_options(p)
    p.set_defaults(func=_run("agents.ppo:cmd_ppo"))
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line with the agents' extension (``train.py`` and the ``saecache-gym`` console script)."""
    return core_cli.main(argv, extensions=[AgentsExtension()], prog=prog)
