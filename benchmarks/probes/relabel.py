"""Probe: a session the continuation model labelled ended (idle past the horizon, or its posterior below
``posterior_end``) that comes back after all is relabelled continued: its turn's counts move from ended to
continued, and its entry in the labelled buffer (if still there) from 0 to 1. The default labels are final.
``relabel=False`` is SAECache itself. docs/saecache-real-traces.md:
"Why the learned rates run high at a trace's end".

    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria \\
        [--halves] --variant r1:policy=probes.relabel:Relabel
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sae_env.policies.continuation import ContinuationModel
from sae_env.policies.saecache import SAECachePolicy


class RelabelModel(ContinuationModel):
    """ContinuationModel whose ended labels are undone when the session returns (``flips`` counts them, of
    ``ended_labels`` ended labels in all)."""

    relabel = True
    flips = 0
    ended_labels = 0

    def _record_many(self, idx: np.ndarray, y: float) -> None:
        super()._record_many(idx, y)
        if not y:  # the requests a refit labelled ended
            ended = self.__dict__.setdefault("_ended_of", set())
            ended.update(idx.tolist())
            self.ended_labels += idx.size

    def arrive(self, i: int, now: float) -> float:
        j = self._last_of.get(self._session[i])
        ended = self.__dict__.setdefault("_ended_of", set())
        if j is not None and j in ended:  # a session's previous request can only come back now
            ended.discard(j)
            if self.relabel:
                k = self._bucket[j]
                self._ended[k] -= 1
                self._continued[k] += 1
                self._refresh_rate(k)
                hit = np.flatnonzero(self._lab_i[:self._lab_n] == j)
                if hit.size:
                    self._lab_y[hit[-1]] = 1.0
                self.flips += 1
        return super().arrive(i, now)


class Relabel(SAECachePolicy):
    """SAECache whose continuation model relabels an ended session that comes back (``relabel=False``: SAECache)."""

    def __init__(self, relabel: bool = True, **options: Any):
        super().__init__(**options)
        model = self.arrivals.model
        if model is not None:
            model.__class__ = RelabelModel  # the same state, the hooks above
            model.relabel = bool(relabel)
