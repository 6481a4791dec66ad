"""Settling the continuation model's pending requests at a refit: which of them count as ended now, their new soft
weights and the per-turn counts and rates (the EM steps of :mod:`sae_env.policies.continuation`).

Two forms of one computation, the same floats: :func:`settle_numpy`, whole-array numpy, and :func:`settle_loops`, the
same arithmetic as plain loops, compiled with numba where it is installed. Every operation is one IEEE double
operation in the same order in both (a bucket's sums are added in arrival order, as ``np.bincount`` and
``np.subtract.at`` add them; no fused multiply-add: numba compiles without ``fastmath``), so which one runs never
changes a decision (``tests/test_continuation_refit.py``).

Why two: the Python engine's model settles in numpy, whole arrays at a time; the compiled arrivals
(:mod:`sae_env.fast_engine.arrivals`) settle inside their kernel, where numpy's passes (each a temporary array) would
not run, and a Python round trip per refresh cost more than the settling itself on long traces.
"""

from __future__ import annotations

import numpy as np

# numba is optional, as for the compiled engine: without it (AVAILABLE False, jit the identity) every refit runs numpy
from sae_env.fast_engine.jit import AVAILABLE, jit

__all__ = ["AVAILABLE", "RATES", "ALIVE", "CONTINUED", "ENDED", "settle_loops", "settle_numpy"]

RATES, ALIVE, CONTINUED, ENDED = range(4)  # rows of the per-turn counts (float64 [4, turn bucket])


def settle_numpy(idle: np.ndarray, surv: np.ndarray, w_pend: np.ndarray, agent: np.ndarray, bucket: np.ndarray,
                 horizons: tuple[float, float], counts: np.ndarray, n_pend: np.ndarray, prior: tuple[float, float],
                 end_below: float, censoring: bool, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Settle the pending requests (one entry each, in arrival order): ``idle`` their idle time, ``surv`` its gap
    survival ``S(idle)``, ``w_pend`` their soft weights, ``agent`` whether they are in the agent queue, ``bucket``
    their turn buckets. A request ends when it has idled past its queue's horizon (``horizons``: chat, agent) or,
    with ``censoring`` and ``end_below > 0``, when the posterior that its session is alive, ``r S / (1 - r + r S)``
    with its turn's rate ``r``, is below ``end_below``. The ended requests leave the pending counts (their weights
    subtracted from the alive sums in arrival order) and count as ended; then ``steps`` EM steps (with
    ``censoring``) recompute the kept requests' soft weights and the rates.

    ``counts`` (float64 [4, turn bucket]: the rows ``RATES``, ``ALIVE``, ``CONTINUED``, ``ENDED``) and ``n_pend``
    (int64 per turn bucket) are updated in place. Returns which requests stay pending (a bool mask) and their new
    soft weights."""
    k = n_pend.size
    a, b = prior
    rates, alive, cont, ended = counts[RATES], counts[ALIVE], counts[CONTINUED], counts[ENDED]
    over = idle > np.where(agent, horizons[1], horizons[0])
    if censoring and end_below > 0 and idle.size:
        r = rates[bucket]
        over |= r * surv < end_below * np.maximum(1.0 - r + r * surv, 1e-300)
    keep = ~over
    if over.any():
        gone = bucket[over]
        np.subtract.at(alive, gone, w_pend[over])  # one after another, in arrival order (unbuffered)
        n = np.bincount(gone, minlength=k)
        n_pend -= n
        ended += n
        hit = n > 0
        rates[hit] = ((cont + alive + a) / (cont + ended + n_pend + a + b))[hit]
        bucket, surv = bucket[keep], surv[keep]
    n_pend[:] = np.bincount(bucket, minlength=k)
    soft = np.zeros(bucket.size)
    alive[:] = 0.0  # the soft weights' sum per turn bucket (of the final weights)
    for _ in range(steps if censoring else 0):
        r = rates[bucket]
        soft = r * surv / np.maximum(1.0 - r + r * surv, 1e-300)
        alive[:] = np.bincount(bucket, weights=soft, minlength=k)
        rates[:] = (cont + alive + a) / (cont + ended + n_pend + a + b)
    return keep, soft


@jit
def settle_loops(idle, surv, w_pend, agent, bucket, horizon_chat, horizon_agent, counts, n_pend, a, b, end_below,
                 censoring, steps, keep, soft):
    """:func:`settle_numpy` as loops (compiled where numba is installed): ``keep`` and ``soft`` are filled in (the kept
    requests' weights first); returns how many stay pending."""
    k = n_pend.size
    rows = idle.size
    rates, alive, cont, ended = counts[0], counts[1], counts[2], counts[3]
    posterior = censoring and end_below > 0
    n_end = np.zeros(k, dtype=np.int64)
    for j in range(rows):
        over = idle[j] > (horizon_agent if agent[j] else horizon_chat)
        if not over and posterior:
            r = rates[bucket[j]]
            rs = r * surv[j]
            d = 1.0 - r + rs
            if d < 1e-300:  # np.maximum's result, NaN included
                d = 1e-300
            over = rs < end_below * d
        keep[j] = not over
    for j in range(rows):  # rates move only once every ending is counted: the posterior test read the old ones
        if not keep[j]:
            q = bucket[j]
            alive[q] -= w_pend[j]
            n_end[q] += 1
    for q in range(k):
        if n_end[q] > 0:
            n_pend[q] -= n_end[q]
            ended[q] += n_end[q]
            rates[q] = (cont[q] + alive[q] + a) / (cont[q] + ended[q] + n_pend[q] + a + b)
    m = 0
    for q in range(k):
        n_pend[q] = 0
        alive[q] = 0.0
    for j in range(rows):
        if keep[j]:
            n_pend[bucket[j]] += 1
            soft[m] = 0.0
            m += 1
    for _ in range(steps if censoring else 0):
        for q in range(k):
            alive[q] = 0.0
        m = 0
        for j in range(rows):
            if keep[j]:
                q = bucket[j]
                r = rates[q]
                rs = r * surv[j]
                d = 1.0 - r + rs
                if d < 1e-300:
                    d = 1e-300
                w = rs / d
                soft[m] = w
                alive[q] += w
                m += 1
        for q in range(k):
            rates[q] = (cont[q] + alive[q] + a) / (cont[q] + ended[q] + n_pend[q] + a + b)
    return m
