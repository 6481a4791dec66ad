"""The observation: one window's :class:`~sae_env.metrics.WindowStats` as a normalised ``Dict`` of float32 Boxes.

Rates and shares in ``[0, 1]``; gap statistics and parameters in ``[-1, 1]``; latencies squashed with
``x / (1 + x)`` (seconds). Every Box has finite bounds and values are clipped into them, so float rounding can
never leave the space. The keys and their meaning are the table in :class:`sae_env.env.PrefixCacheEnv`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from gymnasium import spaces

from sae_env.metrics import WindowStats
from sae_env.policies.params import ParamSpec, values_to_action
from sae_env.trace import N_APP_TYPES, N_TOKEN_TYPES, AppType, Trace

__all__ = ["N_QUEUES", "ObservationBuilder", "box", "gap_sums"]

N_QUEUES = 4  # observed queue ids 0..3 (SAECache's PE, ST, CH, AG; S3-FIFO's small, main; others: queue 0)


def box(low: float, high: float, n: int) -> spaces.Box:
    """A float32 Box of ``n`` values in ``[low, high]``."""
    return spaces.Box(low=low, high=high, shape=(n,), dtype=np.float32)


def _rates(num: list, den: list) -> list[float]:
    return [x / y if y else 0.0 for x, y in zip(num, den, strict=True)]


def gap_sums(trace: Trace) -> np.ndarray:
    """Cumulative ``[count, sum ln gap, sum ln^2 gap]`` of inter-turn gaps, per app (chat, agent), over requests.

    A request's gap is the time since the previous request of its session in ``trace`` (none for a session's first
    request there, unknown sessions or zero gaps). Row ``i`` sums requests ``< i``, so a window ``[a, b)`` is
    ``sums[b] - sums[a]``: O(1) per step.
    """
    n = len(trace)
    gaps = np.zeros(n)
    if n >= 2:
        order = np.lexsort((np.arange(n), trace.session))
        s = trace.session[order]
        same = (s[1:] == s[:-1]) & (s[1:] >= 0)
        later, earlier = order[1:][same], order[:-1][same]
        gaps[later] = trace.t[later] - trace.t[earlier]
    per = np.zeros((n, 6))
    ok = gaps > 0
    lg = np.log(np.where(ok, gaps, 1.0))
    for k, kind in enumerate((AppType.CHAT, AppType.AGENT)):
        m = ok & (trace.app == kind)
        per[:, 3 * k] = m
        per[:, 3 * k + 1] = np.where(m, lg, 0.0)
        per[:, 3 * k + 2] = np.where(m, lg * lg, 0.0)
    return np.vstack([np.zeros((1, 6)), np.cumsum(per, axis=0)])


class ObservationBuilder:
    """The observation space of a policy with ``param_specs``, and the observation of each window.

    :meth:`reset` takes the episode's trace (its inter-turn gaps are summed once, so a window's are O(1));
    :meth:`build` assembles an observation.
    """

    def __init__(self, param_specs: tuple[ParamSpec, ...]):
        self.param_specs = tuple(param_specs)
        d = len(self.param_specs)
        self.space = spaces.Dict({
            "hit_rate": box(0.0, 1.0, 2),
            "cache": box(0.0, 1.0, 3),
            "queue_hit_share": box(0.0, 1.0, N_QUEUES),
            "queue_occupancy": box(0.0, 1.0, N_QUEUES),
            "type_hit_rate": box(0.0, 1.0, N_TOKEN_TYPES),
            "type_ref_share": box(0.0, 1.0, N_TOKEN_TYPES),
            "miss_after_evict": box(0.0, 1.0, N_TOKEN_TYPES),
            "app_mix": box(0.0, 1.0, N_APP_TYPES),
            "gaps": box(-1.0, 1.0, 6),
            "latency": box(0.0, 1.0, 3),
            "params": box(-1.0, 1.0, max(d, 1)),
            "progress": box(0.0, 1.0, 1),
        })
        self._slices: dict[str, tuple[int, int]] = {}
        lows, highs = [], []
        for key, b in self.space.spaces.items():
            a = sum(len(x) for x in lows)
            self._slices[key] = (a, a + b.shape[0])
            lows.append(b.low.astype(np.float64))
            highs.append(b.high.astype(np.float64))
        self._low, self._high = np.concatenate(lows).tolist(), np.concatenate(highs).tolist()
        self._size = len(self._low)
        self._gap_sums = np.zeros((1, 6))

    def reset(self, trace: Trace) -> None:
        """A new episode replays ``trace``."""
        self._gap_sums = gap_sums(trace)

    def build(self, params: Mapping[str, float], progress: float, w: WindowStats | None,
              latency: tuple | None) -> dict[str, np.ndarray]:
        """The observation after window ``w`` (None: after ``reset``), with the parameters in effect, the share of
        the episode replayed, and :func:`~sae_env.metrics.latency_summary` of ``w``."""
        # Features are assembled as Python floats (the vectors are 1-7 long: numpy calls would cost more than the
        # arithmetic), then clipped into the bounds and converted in one go, and split by key.
        vals = [0.0] * self._size
        sl = self._slices
        if self.param_specs:
            a, b = sl["params"]
            vals[a:b] = values_to_action(self.param_specs, params).tolist()
        vals[sl["progress"][0]] = progress
        if w is not None:
            for key, value in self._window_features(w, latency).items():
                a, b = sl[key]
                vals[a:b] = value
        # Clipped in float64; rounding to float32 is monotone and the bounds (0, +-1) are exact, so it stays inside.
        vals = [lo if x < lo else hi if x > hi else x for x, lo, hi in zip(vals, self._low, self._high, strict=True)]
        vec = np.array(vals, dtype=np.float32)
        return {k: vec[a:b] for k, (a, b) in sl.items()}

    def _window_features(self, w: WindowStats, latency: tuple | None) -> dict[str, list[float]]:
        """The observation's window features by key (before clipping)."""
        refs = w.refs_by_type
        n_refs = sum(refs)
        cap = w.capacity
        occ = [0.0] * N_QUEUES
        for q, n in w.occupancy_by_queue.items():
            if 0 <= q < N_QUEUES:
                occ[q] = n / cap
        qh = [0.0] * N_QUEUES
        reported = w.policy.get("queue_hits") if isinstance(w.policy, dict) else None
        if reported:
            n_hits = sum(reported)
            for q, h in enumerate(reported[:N_QUEUES]):
                qh[q] = h / n_hits if n_hits else 0.0
        offered = w.inserted + w.bypasses
        g = (self._gap_sums[w.start + w.requests] - self._gap_sums[w.start]).tolist()
        gaps = [0.0] * 6
        for k in (0, 3):
            n = g[k]
            if n > 0:
                mean = g[k + 1] / n
                gaps[k] = mean / 10.0
                gaps[k + 1] = math.sqrt(max(g[k + 2] / n - mean * mean, 0.0)) / 5.0
                gaps[k + 2] = n / w.requests
        lat = latency
        if lat is None:
            latency = [0.0, 0.0, 0.0]
        else:
            # seconds squashed into [0, 1)
            latency = [x / 1e3 / (1.0 + x / 1e3) for x in (lat[0], lat[2], lat[3] or 0.0)]
        return {
            "hit_rate": [w.token_hit_rate, w.block_hit_rate],
            "cache": [w.occupancy / cap, w.evictions / w.inserted if w.inserted else 0.0,
                      w.bypasses / offered if offered else 0.0],
            "queue_hit_share": qh,
            "queue_occupancy": occ,
            "type_hit_rate": _rates(w.hits_by_type, refs),
            "type_ref_share": [r / n_refs if n_refs else 0.0 for r in refs],
            "miss_after_evict": _rates(w.miss_after_eviction_by_type, refs),
            "app_mix": [c / w.requests if w.requests else 0.0 for c in w.app_mix],
            "gaps": gaps,
            "latency": latency,
        }
