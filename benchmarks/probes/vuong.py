"""Probe: ``gap_select`` with a significance test. The switch reads the exponential wherever its likelihood sum is
above the log-normal's by any margin; here a queue reads the exponential only where Vuong's test for non-nested models
prefers it at level ``z`` (the per-block log-likelihood differences' mean over its standard error), and the learners'
log-normal otherwise. On WildChat, whose gaps our generator draws from a log-normal, every move away from it costs
(docs/saecache-real-traces.md, "The gap shape chosen by the cache's own re-accesses"); a difference within the
sample's noise is no evidence against the model the learners fit.

    python benchmarks/gap_table.py [--halves [alternate]] --capacities 0.02,0.05,0.1,0.2 \\
        --policies lru,lpc,saecache,belady --criteria --variant gs:gap_select=true \\
        --variant vuong:policy=probes.vuong:Vuong,gap_select=true

Python engine only. ``z=0`` chooses as the switch does (a sum ahead by any margin).
"""

from __future__ import annotations

import math
from typing import Any

from sae_env.policies import gap_shape
from sae_env.policies.saecache import SAECachePolicy


class VuongChoice(gap_shape.GapShapeChoice):
    """The switch's sums, with each queue's count of terms and sum of squared differences beside them: ``loglik[q]``
    is ``[log-normal, exponential, terms, squares]`` (the squares in nats squared, weighted as the sums)."""

    __slots__ = ("z",)

    def __init__(self, queues: tuple[int, ...], z: float):
        super().__init__(queues)
        self.z = z
        self.loglik = {q: [0, 0, 0, 0.0] for q in queues}

    def add(self, sums, q, event, t, p, shape, weight=1):
        if q in sums and t > 0.0:
            ln, ex = gap_shape.cure_loglik(event, t, p, *shape)
            s = sums[q]
            s[0] += weight * gap_shape.loglik_units(ln)
            s[1] += weight * gap_shape.loglik_units(ex)
            s[2] += weight
            s[3] += weight * (ex - ln) ** 2

    def choose(self, now, p_of, shape_of, every=1, census=True):
        total = self.totals(now, p_of, shape_of, every, census)
        changed = False
        for q in self.queues:
            ln, ex, n, sq = total[q]
            d = (ex - ln) * gap_shape.LOGLIK_UNIT
            exp_now = False
            if n > 0 and d > 0:
                mean = d / n
                var = max(sq / n - mean * mean, 0.0)
                terms = n / every  # the sampled blocks: each counts ``every`` times in n
                exp_now = var == 0.0 or mean * math.sqrt(terms) > self.z * math.sqrt(var)
            if exp_now != self.exponential[q]:
                self.exponential[q] = exp_now
                self.switches_made += 1
                changed = True
        return changed


class Vuong(SAECachePolicy):
    """SAECache with ``gap_select`` whose exponential needs Vuong's test at level ``z`` (1.96: 5 %, two-sided)."""

    def __init__(self, z: float = 1.96, **options: Any):
        if not z >= 0:
            raise ValueError(f"z must be >= 0, got {z!r}")
        super().__init__(**options)
        if self._shape is None:
            raise ValueError("the Vuong probe needs gap_select=true")
        self._shape = VuongChoice(self._shape.queues, float(z))
