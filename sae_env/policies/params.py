"""A policy's tunable parameters (:class:`ParamSpec`) and their map onto actions in ``[-1, 1]``.

A component ``a`` in ``[-1, 1]`` maps affinely onto its spec's bounds, in log space when ``spec.log``:
``v = lo + (a + 1) / 2 * (hi - lo)`` (or ``exp`` of that over ``ln lo, ln hi``). :func:`values_to_action` and
:func:`action_to_values` are the two directions; agents that search parameter space (tuning, PPO) and the
environment (:mod:`sae_env.env`) share them.

**Exact round trips** (:class:`ActionCodec`). Actions are float32 (Gymnasium's Box, SB3), so an action made from
parameter values rounds them by ~1e-7 relative, enough to change a replay: an agent that holds SAECache's defaults
would not replay like SAECache at its defaults. The codec remembers the last encodings it made, keyed on the
action's float32 bytes (arrays are not hashable, and bitwise equality is exactly the question "is this the action I
made?"), and decodes a remembered action to exactly the values it was made from.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ActionCodec", "ParamSpec", "action_to_values", "values_to_action"]

MEMORY = 64  # encodings an ActionCodec remembers (an agent's action in use stays: least recently used goes first)


@dataclass(frozen=True)
class ParamSpec:
    """One tunable parameter: a name, bounds, a default, and whether it lives on a log scale."""

    name: str
    low: float
    high: float
    default: float
    log: bool = False
    doc: str = ""

    def __post_init__(self):
        if not (self.low < self.high) or not (self.low <= self.default <= self.high):
            raise ValueError(f"parameter {self.name}: need low < high and low <= default <= high")
        if self.log and self.low <= 0:
            raise ValueError(f"parameter {self.name}: a log-scale parameter needs low > 0")

    def clip(self, value: float) -> float:
        return min(self.high, max(self.low, float(value)))


@functools.lru_cache(maxsize=64)
def _scales(specs: tuple[ParamSpec, ...]) -> tuple[tuple[str, float, float, bool, float, float], ...]:
    """Per spec: name, bounds, log flag, and the affine map's origin and span (in log space for log specs)."""
    out = []
    for p in specs:
        lo, hi = (math.log(p.low), math.log(p.high)) if p.log else (p.low, p.high)
        out.append((p.name, p.low, p.high, p.log, lo, hi - lo))
    return tuple(out)


def values_to_action(specs: tuple[ParamSpec, ...], values: Mapping[str, float]) -> np.ndarray:
    """Each spec's value (clipped to its bounds) mapped into [-1, 1], log-scale where ``spec.log``; float64."""
    out = []
    for name, low, high, log, origin, span in _scales(specs):
        v = min(high, max(low, float(values[name])))
        x = ((math.log(v) if log else v) - origin) / span
        out.append(min(1.0, max(-1.0, 2.0 * x - 1.0)))
    return np.array(out, dtype=np.float64)


def action_to_values(specs: tuple[ParamSpec, ...], action: np.ndarray) -> dict[str, float]:
    """The inverse of :func:`values_to_action` for finite components in [-1, 1] (results clipped to the bounds)."""
    out: dict[str, float] = {}
    for (name, low, high, log, origin, span), a in zip(_scales(specs), np.asarray(action, dtype=np.float64).ravel()
                                                       .tolist(), strict=True):
        if a >= 1.0 or a <= -1.0:  # the bounds themselves, exactly (exp(log(x)) need not be x)
            out[name] = high if a >= 1.0 else low
            continue
        y = origin + (a + 1.0) / 2.0 * span
        out[name] = min(high, max(low, math.exp(y) if log else y))
    return out


class ActionCodec:
    """Parameter values <-> float32 actions for one policy's specs, exact for the last ``memory`` encodings made."""

    def __init__(self, specs: tuple[ParamSpec, ...], memory: int = MEMORY):
        self.specs = tuple(specs)
        self.memory = int(memory)
        self._memo: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        """How many encodings are remembered."""
        return len(self._memo)

    def encode(self, values: Mapping[str, float]) -> np.ndarray:
        """The float32 action for a full set of in-bound values (one per spec), remembered for :meth:`recall`."""
        action = values_to_action(self.specs, values).astype(np.float32)
        key = action.tobytes()
        self._memo[key] = dict(values)
        self._memo.move_to_end(key)
        while len(self._memo) > self.memory:
            self._memo.popitem(last=False)
        return action

    def recall(self, action: Any) -> dict[str, float] | None:
        """The exact values behind an action made by :meth:`encode` (None if not remembered)."""
        key = np.asarray(action, dtype=np.float32).tobytes()
        hit = self._memo.get(key)
        if hit is None:
            return None
        self._memo.move_to_end(key)  # least recently used goes first: an agent's constant action stays
        return dict(hit)

    def decode(self, action: Any) -> dict[str, float]:
        """The values an in-range action stands for: exact when remembered, else :func:`action_to_values`."""
        hit = self.recall(action)
        return hit if hit is not None else action_to_values(self.specs, action)
