"""Confidence intervals over seeds: the mean of a few runs, and the paired difference of two agents on the same seeds.

A study repeats each cell under several seeds (arrival processes, generator draws); what it reports is the mean
with a two-sided Student-t interval, ``mean +- t(1 - (1 - level) / 2, n - 1) * sd / sqrt(n)`` (``sd`` with ``n - 1``
degrees of freedom). Two agents run on the same seeds are compared through their per-seed differences (a paired
interval: the seed's own noise, which both agents see, cancels), and ratios through the mean of per-seed log ratios
(a geometric mean, whose interval is the exponential of the log interval). With one value there is a mean and no
interval (``half`` is None); values that are None or not finite are left out and counted out of ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

__all__ = ["LEVEL", "Interval", "mean_interval", "paired_difference", "paired_ratio"]

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean and its confidence interval ``[low, high]`` (``half`` = half-width; None with fewer than 2 values)."""

    mean: float | None
    half: float | None
    n: int
    low: float | None = None
    high: float | None = None

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (e.g. a rate as a percentage)."""
        f = float(factor)
        def mul(v: float | None) -> float | None:
            return None if v is None else v * f
        low, high = mul(self.low), mul(self.high)
        if f < 0:
            low, high = high, low
        return Interval(mul(self.mean), None if self.half is None else self.half * abs(f), self.n, low, high)


def _finite(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)


def mean_interval(values: Sequence[float | None], level: float = LEVEL) -> Interval:
    """The mean of ``values`` and its Student-t confidence interval at ``level`` (see the module docstring)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    x = _finite(values)
    n = int(x.size)
    if n == 0:
        return Interval(None, None, 0)
    mean = float(x.mean())
    if n == 1:
        return Interval(mean, None, 1)
    half = float(stats.t.ppf(0.5 + level / 2.0, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return Interval(mean, half, n, mean - half, mean + half)


def _pairs(a: Sequence[float | None], b: Sequence[float | None]) -> tuple[np.ndarray, np.ndarray]:
    if len(a) != len(b):
        raise ValueError(f"paired values must have the same length (one per seed), got {len(a)} and {len(b)}")
    keep = [i for i in range(len(a)) if a[i] is not None and b[i] is not None and math.isfinite(a[i])
            and math.isfinite(b[i])]
    return np.asarray([a[i] for i in keep], dtype=np.float64), np.asarray([b[i] for i in keep], dtype=np.float64)


def paired_difference(a: Sequence[float | None], b: Sequence[float | None], level: float = LEVEL) -> Interval:
    """Mean and interval of ``a[i] - b[i]`` over the seeds ``i`` where both are known."""
    x, y = _pairs(a, b)
    return mean_interval((x - y).tolist(), level)


def paired_ratio(a: Sequence[float | None], b: Sequence[float | None], level: float = LEVEL) -> Interval:
    """Geometric mean of ``a[i] / b[i]`` over the seeds where both are known and positive, with the interval of the
    mean log ratio mapped back (``half`` is None: the interval is not symmetric; read ``low`` / ``high``)."""
    x, y = _pairs(a, b)
    keep = (x > 0) & (y > 0)
    logs = mean_interval(np.log(x[keep] / y[keep]).tolist(), level)
    if logs.mean is None:
        return Interval(None, None, 0)
    if logs.half is None:
        return Interval(math.exp(logs.mean), None, logs.n)
    return Interval(math.exp(logs.mean), None, logs.n, math.exp(logs.low), math.exp(logs.high))
