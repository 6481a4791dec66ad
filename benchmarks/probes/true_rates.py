"""Probe (hindsight, a bound and not a policy): the continuation model answers with each turn bucket's true rate, the
share of the trace's requests of that bucket whose session comes back within the trace, in place of its learned
rate (the logistic correction on top stays learned), while the replay is between the fractions ``start`` and
``stop`` of the trace's requests; elsewhere, and with ``start = stop``, it is SAECache itself. Its counts, soft
labels and refits are untouched: only the answers that bin the blocks (at arrival, and at rebinning) change.
docs/saecache-real-traces.md: "Where the true rates help, and where they do not".

    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria \\
        [--halves] --variant all:policy=probes.true_rates:TrueRates \\
        --variant first:policy=probes.true_rates:TrueRates,stop=0.5 \\
        --variant second:policy=probes.true_rates:TrueRates,start=0.5
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sae_env.policies.continuation import ContinuationModel
from sae_env.policies.saecache import SAECachePolicy
from sae_env.trace import Trace, session_continues


class TrueRatesModel(ContinuationModel):
    """ContinuationModel whose answers use the hindsight rates from the ``span[0]``-th to the ``span[1]``-th
    arrival (fractions of the trace's requests)."""

    span = (0.0, 1.0)

    def bind(self, trace: Trace, sessions: Any = None) -> None:
        super().bind(trace, sessions)
        n = len(trace)
        comes_back = session_continues(trace)
        bucket = self._bucket_a
        true = np.array(self._rates, dtype=np.float64)
        for k in np.unique(bucket).tolist():
            true[k] = comes_back[bucket == k].mean()
        self._true = true
        self._window = (self.span[0] * n, self.span[1] * n)
        self._arrived = 0

    def _in_window(self) -> bool:
        return self._window[0] <= self._arrived < self._window[1]

    def arrive(self, i: int, now: float) -> float:
        self._arrived = i  # the replay's position: requests arrive in index order
        return super().arrive(i, now)

    def _answer(self, ask):
        if not self._in_window():
            return ask()
        learned = self._rates
        self._rates = self._true.tolist()
        try:
            return ask()
        finally:
            self._rates = learned

    def p(self, i: int) -> float:
        return self._answer(lambda: super(TrueRatesModel, self).p(i))

    def p_many(self, idx: np.ndarray) -> np.ndarray:
        return self._answer(lambda: super(TrueRatesModel, self).p_many(idx))


class TrueRates(SAECachePolicy):
    """SAECache binning by the hindsight rates from ``start`` to ``stop`` (fractions of the trace's requests)."""

    def __init__(self, start: float = 0.0, stop: float = 1.0, **options: Any):
        if not 0.0 <= start <= stop <= 1.0:
            raise ValueError(f"need 0 <= start <= stop <= 1, got start={start!r}, stop={stop!r}")
        super().__init__(**options)
        model = self.arrivals.model
        if model is not None:
            model.__class__ = TrueRatesModel  # the same state, the hooks above
            model.span = (float(start), float(stop))
