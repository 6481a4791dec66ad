"""Probe: each chat and agent block's hit density reads the gaps after its releasing request's turn bucket (turns 1,
2-3, 4-7, 8-15, 16+), each bucket's log-normal shrunk to the queue's pooled fit by empirical Bayes: no constant.

Sessions that reach later turns are the faster ones on the traces with recorded times (median gaps after turns 1 /
2 / 3 / 4-7 / 8+ of 141 / 86 / 52 / 27 / 10 s on mooncake_synthetic) and alike on WildChat, whose gaps our generator
draws the same at every turn (docs/saecache-real-traces.md, "Gaps that depend on the turn": a fixed prior of 20 or 50
pseudo-gaps moved the wide-cell means within the draws' spread). Here the pull towards the pooled fit is the data's
own: with ``m_k`` the mean log gap after bucket ``k`` over ``n_k`` gaps and ``mu, sigma`` the queue's pooled log-normal
(the learners'), ``m`` the buckets' grand mean and ``v`` their pooled variance within a bucket, the between-bucket
variance is ``tau2 = max(0, mean_k((m_k - m)**2 - v / n_k))`` (method of moments, over the buckets with two gaps or
more) and bucket ``k`` reads ``mu + B_k (m_k - m)`` with ``B_k = tau2 / (tau2 + v / n_k)``, its sigma the same mixture
of its own and the pooled one (the pooled one with ``truncation``). Where the turns' gaps are alike ``tau2`` is about
0 and every bucket reads the pooled fit: SAECache's ranking. With ``truncation`` (the default) a bucket's ``m_k``, and
the grand mean, are maximum-likelihood estimates under right truncation instead (:func:`truncated_mu`): a gap is seen
only once it has ended, so the later turns, which come later in a trace, lose more of their long gaps to its end and
their mean log gap runs short.

    python benchmarks/gap_table.py [--halves [alternate] | --repeat 4 --pause 3600] --capacities 0.02,0.05,0.1,0.2 \\
        --policies lru,lpc,saecache,belady --criteria --variant tr:policy=probes.turn_gaps:TurnGaps \\
        --variant eb:policy=probes.turn_gaps:TurnGaps,truncation=false

Python engine only. ``turn_gaps=False`` is SAECache in every cell. Figures: docs/saecache-real-traces.md, "The turns'
gaps shrunk by empirical Bayes" (level with the default within the draws' spread).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.special import log_ndtr

from sae_env.block import split_queue_type
from sae_env.policies.arrivals import AG, CH
from sae_env.policies.saecache import GROUP_SLOT, VALUE_STRIDE, SAECachePolicy
from sae_env.policies.survival import LognormalGaps
from sae_env.trace import Trace

N_BUCKETS = 5
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
BUCKET_STRIDE = VALUE_STRIDE * 64  # a group id's bucket part: above every continuation and value bin


def turn_bucket(turn: int) -> int:
    """0 for turn 1, 1 for 2-3, 2 for 4-7, 3 for 8-15, 4 for 16 and later."""
    return min(max(int(turn), 1).bit_length() - 1, N_BUCKETS - 1)


def _pull(m: np.ndarray, grand: float, noise: np.ndarray) -> list[float]:
    """Each bucket's ``B_k = tau2 / (tau2 + noise_k)``, ``tau2`` the between-bucket variance of the estimates ``m``
    around ``grand`` by the method of moments."""
    tau2 = max(0.0, float(np.mean((m - grand) ** 2 - noise)))
    return [tau2 / (tau2 + e) for e in noise.tolist()]


def _mills(z: np.ndarray) -> np.ndarray:
    """The inverse Mills ratio ``phi(z) / Phi(z)``."""
    return np.exp(-0.5 * z * z - _HALF_LOG_2PI - log_ndtr(z))


def shrunk(stats: np.ndarray, mu: float, sigma: float) -> list[tuple[float, float]]:
    """Each bucket's ``(mu, sigma)``: the queue's ``(mu, sigma)`` moved by its bucket's deviation from the buckets'
    grand mean, shrunk by empirical Bayes (``stats``: per bucket, the count, sum and sum of squares of its log gaps)."""
    n, s1, s2 = stats[:, 0], stats[:, 1], stats[:, 2]
    out = [(mu, sigma)] * len(stats)
    use = np.flatnonzero(n >= 2)
    if use.size < 2:
        return out
    nk = n[use]
    m = s1[use] / nk
    v = np.maximum(s2[use] / nk - m * m, 1e-12)
    grand = float(s1[use].sum() / nk.sum())
    within = float((nk * v).sum() / nk.sum())  # the pooled variance within a bucket
    for k, mk, vk, b in zip(use.tolist(), m.tolist(), v.tolist(), _pull(m, grand, within / nk), strict=True):
        out[k] = (mu + b * (mk - grand), math.sqrt(b * vk + (1.0 - b) * sigma * sigma))
    return out


def truncated_mu(lg: np.ndarray, log_t: np.ndarray, sigma: float) -> float:
    """The maximum-likelihood ``mu`` of log-normal gaps (``sigma`` given) from the gaps completed so far, ``lg`` their
    logs, each observable only because it ended within its request's follow-up so far (``log_t``: the log of the
    time from the request to now). Each gap's likelihood is ``f(g) / F(t)``: a gap of a session that comes back at all
    is seen once it is shorter than the follow-up, whatever share of the sessions ends, so the estimate needs no cure
    rate, and late requests' short follow-ups do not make their gaps look fast."""
    lo, hi = float(lg.min()) - 10.0 * sigma, float(log_t.max()) + 10.0 * sigma
    s2 = sigma * sigma
    for _ in range(60):  # the score falls with mu: bisection
        mid = 0.5 * (lo + hi)
        z = (log_t - mid) / sigma
        score = float(np.sum(lg - mid) / s2 + np.sum(_mills(z)) / sigma)
        if score > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def shrunk_truncated(buckets: np.ndarray, lg: np.ndarray, log_t: np.ndarray, mu: float, sigma: float,
                     fisher: bool = True) -> list[tuple[float, float]]:
    """:func:`shrunk` with each bucket's mean log gap, and the buckets' grand one, as :func:`truncated_mu` estimates
    them (``sigma`` the queue's), the noise of a bucket's estimate the inverse of its truncated likelihood's Fisher
    information (``sigma**2 / n_k`` where every follow-up is long; without ``fisher``, ``sigma**2 / n_k``)."""
    out = [(mu, sigma)] * N_BUCKETS
    n = np.bincount(buckets, minlength=N_BUCKETS)
    use = np.flatnonzero(n >= 2)
    if use.size < 2:
        return out
    grand = truncated_mu(lg, log_t, sigma)
    m = np.array([truncated_mu(lg[buckets == k], log_t[buckets == k], sigma) for k in use.tolist()])
    # A bucket's estimate is as noisy as its truncated likelihood is flat: the Fisher information of a gap followed up
    # for t is (1 - lam (z + lam)) / sigma**2 at z = (log t - mu) / sigma (lam: the inverse Mills ratio), all of
    # 1 / sigma**2 where t is long and little of it where t is short.
    noise = sigma * sigma / n[use]
    for j, k in enumerate(use.tolist() if fisher else ()):
        z = (log_t[buckets == k] - m[j]) / sigma
        lam = _mills(z)
        noise[j] = sigma * sigma / max(float(np.sum(1.0 - lam * (z + lam))), 1e-12)
    for k, mk, b in zip(use.tolist(), m.tolist(), _pull(m, grand, noise), strict=True):
        out[k] = (mu + b * (mk - grand), sigma)
    return out


class TurnGaps(SAECachePolicy):
    """SAECache whose chat and agent blocks read their releasing request's turn bucket's gaps (see the module)."""

    def __init__(self, turn_gaps: bool = True, truncation: bool = True, fisher: bool = True, **options: Any):
        super().__init__(**options)
        self.turn_gaps = bool(turn_gaps)
        self.truncation = bool(truncation)  # each bucket's gaps as truncated_mu estimates them (else their mean)
        self.fisher = bool(fisher)  # under truncation: each bucket's noise from its Fisher information
        if self.turn_gaps and (not self._density or self._valued or self._empirical or self._shape is not None):
            raise ValueError("the turn_gaps probe needs the hit density, without hit_value, empirical_gaps, "
                             "gap_mixture or gap_select")
        self._tg_stats = {q: np.zeros((N_BUCKETS, 3)) for q in (CH, AG)}
        self._tg_last: dict[int, tuple[float, int, int]] = {}  # session -> its last arrival, bucket and queue
        self._tg_gaps: dict[tuple[int, int], LognormalGaps] = {}
        self._tg_sessions: np.ndarray | None = None
        self._tg_done: dict[int, list[tuple[int, float, float]]] = {CH: [], AG: []}  # (bucket, start, log gap)

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        if not self.turn_gaps:
            super().on_request(trace, i, now)
            return
        if self._tg_sessions is None or len(self._tg_sessions) != len(trace):
            self._tg_sessions = trace.session_ids()
        s = int(self._tg_sessions[i])
        prev = self._tg_last.get(s)
        if prev is not None and now > prev[0] and prev[2] in self._tg_stats:
            lg = math.log(now - prev[0])
            self._tg_stats[prev[2]][prev[1]] += (1.0, lg, lg * lg)
            self._tg_done[prev[2]].append((prev[1], prev[0], lg))
        k = turn_bucket(trace.turn[i])
        super().on_request(trace, i, now)
        self._tg_last[s] = (now, k, self._prompt_queue)
        q, slot = self._inflight[i]
        self._slot = slot + (k + 1) * (BUCKET_STRIDE // GROUP_SLOT)  # released blocks' groups carry the bucket
        self._inflight[i] = (q, self._slot)

    def params_changed(self) -> None:
        super().params_changed()
        if getattr(self, "turn_gaps", False):
            self._tg_update()

    def _refit(self, now: float) -> None:
        if self.turn_gaps:
            self._tg_update()
        super()._refit(now)  # (its end clears every group's constants)

    def _tg_update(self) -> None:
        self._tg_gaps = {}
        for q, stats in self._tg_stats.items():
            mu, sigma = self._ln[q]
            done = self._tg_done[q]
            if self.truncation and done:
                a = np.array(done)
                follow = np.log(np.maximum(self._now - a[:, 1], np.exp(a[:, 2])))
                fits = shrunk_truncated(a[:, 0].astype(np.int64), a[:, 2], follow, mu, sigma, self.fisher)
            else:
                fits = shrunk(stats, mu, sigma)
            for k, (mk, sk) in enumerate(fits):
                self._tg_gaps[q, k] = LognormalGaps(mk, sk)
        self._changed()

    def _constants(self, g: int) -> tuple[int, int, Any, Any, float]:
        c = self._consts.get(g)
        if c is not None or g < BUCKET_STRIDE:
            return c if c is not None else super()._constants(g)
        flag, kind, c1, c2, coef = super()._constants(g % BUCKET_STRIDE)
        q, _ = split_queue_type(g % GROUP_SLOT)
        gaps = self._tg_gaps.get((q, g // BUCKET_STRIDE - 1))
        if gaps is not None:
            c1 = gaps
        c = self._consts[g] = (flag, kind, c1, c2, coef)
        return c
