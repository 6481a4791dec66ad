"""Probe: the horizon past which the continuation model counts a quiet session as ended, ``exp(mu + K sigma)`` of
its queue's gaps, at another ``K`` (``horizon_sigmas``; the default's 3 leaves 0.13 % of log-normal gaps longer and
is SAECache itself). docs/saecache-real-traces.md:
"Why the learned rates run high at a trace's end".

    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria \\
        [--halves [alternate] | --repeat 4 --pause 3600] \\
        --variant h2:policy=probes.horizon:Horizon,horizon_sigmas=2 \\
        --variant h15:policy=probes.horizon:Horizon,horizon_sigmas=1.5
"""

from __future__ import annotations

from typing import Any

from sae_env.policies.saecache import SAECachePolicy


class Horizon(SAECachePolicy):
    """SAECache whose continuation model ends a quiet session at ``exp(mu + horizon_sigmas * sigma)``."""

    def __init__(self, horizon_sigmas: float = 3.0, **options: Any):
        if not horizon_sigmas > 0:
            raise ValueError(f"horizon_sigmas must be positive, got {horizon_sigmas!r}")
        super().__init__(**options)
        if self.arrivals.model is not None:
            self.arrivals.model.horizon_sigmas = float(horizon_sigmas)
