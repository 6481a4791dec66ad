"""Probe: how well the continuation model tells, at each request's arrival, the requests whose session comes back
from those whose session does not, within each turn bucket (where its per-turn rate is one number and only the
logistic correction and the rate's drift over the replay can order the requests). docs/saecache-real-traces.md:
"What the continuation model tells apart".

    python benchmarks/probes/discrimination.py [--traces mooncake_synthetic,mooncake_arxiv,wildchat,taubench]

Replays SAECache as ``train.py replay`` does (window 200, its online learners; Python engine, the same decisions as the
compiled one) and records, at each arrival, the model's answer ``p`` and its turn bucket's rate ``r`` then. Prints, per
trace and turn bucket with both outcomes present: the requests, the share whose session comes back within the trace,
and the area under the ROC curve (0.5: no better than chance) of ``p``, of the correction ``logit p - logit r`` alone,
and of the correction over the requests of the trace's first three quarters (those whose session has the most time
left to come back).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import rankdata

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agents.cli import AgentsExtension  # noqa: E402
from sae_env.cache import PrefixCache, resolve_capacity  # noqa: E402
from sae_env.policies.continuation import P_CLIP, ContinuationModel  # noqa: E402
from sae_env.policies.saecache import SAECachePolicy  # noqa: E402
from sae_env.replay import Replay  # noqa: E402
from sae_env.sources import open_trace  # noqa: E402
from sae_env.trace import session_continues  # noqa: E402


def auc(positive: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve of ``score`` for the labels ``positive`` (ties count half; NaN without both)."""
    positive = np.asarray(positive, dtype=bool)
    n1, n0 = int(positive.sum()), int((~positive).sum())
    if not n1 or not n0:
        return math.nan
    ranks = rankdata(score)
    return float((ranks[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


class RecordingModel(ContinuationModel):
    """ContinuationModel that keeps each answer at arrival and its turn bucket's rate then (``answers``)."""

    def arrive(self, i: int, now: float) -> float:
        p = super().arrive(i, now)
        self.__dict__.setdefault("answers", {})[i] = (p, self._rates[self._bucket[i]])
        return p


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, P_CLIP, 1.0 - P_CLIP)
    return np.log(p / (1.0 - p))


def discrimination(name: str, capacity: float = 0.05) -> list[dict[str, Any]]:
    """One row per turn bucket of trace ``name`` with both outcomes present (the module docstring's columns)."""
    trace, _ = open_trace(name)
    policy = SAECachePolicy()
    model = policy.arrivals.model
    model.__class__ = RecordingModel  # the same state, the hook above
    callbacks = AgentsExtension().replay_callbacks(argparse.Namespace(fixed=False), policy)
    Replay(trace, PrefixCache(resolve_capacity(capacity, trace.distinct_blocks()), policy), None,
           window_requests=200, callbacks=callbacks, engine="python").run()
    n = len(trace)
    comes_back = session_continues(trace)
    answers = np.array([model.answers[i] for i in range(n)])
    p, correction = answers[:, 0], _logit(answers[:, 0]) - _logit(answers[:, 1])
    t = np.asarray(trace.t)
    early = t < t[0] + 0.75 * (t[-1] - t[0])
    bucket = np.asarray(model.turn_buckets)
    rows = []
    for k in np.unique(bucket).tolist():
        sel = bucket == k
        if 0 < comes_back[sel].mean() < 1:
            rows.append({"bucket": k, "requests": int(sel.sum()), "comes_back": float(comes_back[sel].mean()),
                         "auc_p": auc(comes_back[sel], p[sel]), "auc_correction": auc(comes_back[sel], correction[sel]),
                         "auc_correction_early": auc(comes_back[sel & early], correction[sel & early])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="mooncake_synthetic,mooncake_arxiv,wildchat,taubench")
    ap.add_argument("--capacity", type=float, default=0.05)
    args = ap.parse_args(argv)
    print("| trace | turn bucket | requests | comes back | AUC of p | of the correction | of it, first 3/4 |")
    print("|---|---|---|---|---|---|---|")
    for name in args.traces.split(","):
        for r in discrimination(name, args.capacity):
            print(f"| {name} | {r['bucket']} | {r['requests']} | {r['comes_back']:.2f} | {r['auc_p']:.2f} | "
                  f"{r['auc_correction']:.2f} | {r['auc_correction_early']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
