"""Rule-driven agents (nothing to train): constant parameters and the no-op baseline.

* :class:`FixedAgent` -- the same parameters every window: the policy's defaults, a dict, or a JSON / YAML file
  (a mapping of parameter values, or a mapping with such a mapping under ``"params"``, e.g. parameters tuned on a
  training workload and saved with :func:`save_params`). Names left out keep the policy's defaults.
* :class:`BaselineAgent` -- the action that changes nothing (:meth:`PrefixCacheEnv.noop_action`): for the
  parameterless policies (lru, lfu, fifo, s3fifo, belady) the trivial action, for tunable ones their defaults.

SAECache's online rule as an agent, :class:`agents.sae_online.SAEOnlineAgent`, lives with its learners.

Every agent converts parameter values to actions with ``env.unwrapped.params_to_action``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from agents.base import BaseAgent
from sae_env.files import parse_document, write_text

__all__ = ["BaselineAgent", "FixedAgent", "load_params", "save_params"]


def load_params(path: str | os.PathLike) -> dict[str, float]:
    """Parameter values from a JSON or YAML file: ``{name: value}`` or ``{"params": {name: value}, ...}``."""
    path = Path(path)
    kind = path.suffix.lower()
    if kind not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{path}: parameter files must be .json, .yaml or .yml")
    data = parse_document(path.read_text(), kind, str(path))
    if isinstance(data, Mapping) and isinstance(data.get("params"), Mapping):
        data = data["params"]
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of parameter values, got {type(data).__name__}")
    return _check_values(data, str(path))


def save_params(path: str | os.PathLike, params: Mapping[str, float]) -> Path:
    """Write parameter values as JSON (``{"params": {...}}``), readable by :func:`load_params`."""
    path = Path(path)
    write_text(path, json.dumps({"params": _check_values(params, "params")}, indent=2, sort_keys=True) + "\n")
    return path


def _check_values(data: Mapping[str, Any], where: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, v in data.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise ValueError(f"{where}: parameter {name!r} must be a finite number, got {v!r}")
        out[str(name)] = float(v)
    return out


class FixedAgent(BaseAgent):
    """Constant parameters: ``params`` = None (the policy's defaults), a dict, or a JSON / YAML file path."""

    name = "fixed"

    def __init__(self, params: Mapping[str, float] | str | os.PathLike | None = None, name: str | None = None):
        super().__init__()
        if params is None:
            self.values: dict[str, float] = {}
        elif isinstance(params, Mapping):
            self.values = _check_values(params, "FixedAgent params")
        else:
            self.values = load_params(params)
        if name is not None:
            self.name = name
        self._action: np.ndarray | None = None

    def reset(self, env: Any = None, *, seed: int | None = None) -> None:
        super().reset(env, seed=seed)
        env = self._env()
        if self.values and not env.param_specs:
            raise ValueError(f"policy {env.policy_name!r} has no parameters; FixedAgent got {sorted(self.values)}")
        full = dict(env.default_params)
        full.update(self.values)
        self._action = env.params_to_action(full)  # unknown names raise ValueError here

    def act(self, observation: dict[str, np.ndarray], info: dict[str, Any]) -> np.ndarray:
        if self._action is None:
            raise RuntimeError(f"agent {self.name!r}: call reset(env) after env.reset() before act()")
        return self._action.copy()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.values)}


class BaselineAgent(BaseAgent):
    """Changes nothing: the trivial action of a parameterless policy, the current parameters of a tunable one."""

    name = "baseline"

    def act(self, observation: dict[str, np.ndarray], info: dict[str, Any]) -> np.ndarray:
        return self._env().noop_action()
