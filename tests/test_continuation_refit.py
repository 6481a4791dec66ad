"""The continuation model's settling of pending requests (sae_env/policies/continuation_refit.py).

* Its three forms give the same bits: numpy, the loops as plain Python, the loops compiled (hypothesis inputs with
  both end reasons, surv at 0 and 1, empty buckets, no censoring, end_below 0).
* They equal a one-request-at-a-time reference written from the model's docstring.

The compiled arrivals' kernel settles with the loops; the engines' differential tests (test_fast_arrivals.py,
test_fast_saecache.py) compare it with the Python model's numpy form on whole traces.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.policies import continuation_refit as refit
from sae_env.policies.continuation_refit import ALIVE, ENDED, RATES, settle_loops, settle_numpy

PRIOR = (1.0, 1.0)


@st.composite
def settle_inputs(draw):
    k = draw(st.integers(2, 9))
    rows = draw(st.integers(0, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bucket = rng.integers(1, k, size=rows).astype(np.int8)
    idle = rng.exponential(100.0, size=rows)
    surv = rng.random(rows)
    surv[rng.random(rows) < 0.1] = 0.0
    surv[rng.random(rows) < 0.1] = 1.0
    w = rng.random(rows)
    agent = rng.random(rows) < 0.3
    counts = np.zeros((4, k))
    counts[2:, 1:] = rng.integers(0, 50, size=(2, k - 1))  # continued, ended
    n_pend = np.bincount(bucket, minlength=k).astype(np.int64) + rng.integers(0, 3, size=k)
    counts[ALIVE] = rng.random(k) * n_pend
    counts[RATES] = rng.random(k)
    horizons = (float(rng.exponential(200.0)), float(rng.exponential(200.0)))
    end_below = draw(st.sampled_from([0.0, 0.01, 0.3]))
    return (idle, surv, w, agent, bucket, horizons, counts, n_pend, PRIOR, end_below, draw(st.booleans()),
            draw(st.integers(1, 4)))


def run_form(form, args):
    idle, surv, w, agent, bucket, horizons, counts, n_pend, prior, end_below, censoring, steps = args
    counts, n_pend = counts.copy(), n_pend.copy()
    if form is settle_numpy:
        keep, soft = settle_numpy(idle, surv, w, agent, bucket, horizons, counts, n_pend, prior, end_below,
                                  censoring, steps)
    else:
        keep, soft = np.empty(idle.size, dtype=np.bool_), np.empty(idle.size)
        m = form(idle, surv, w, agent, bucket, horizons[0], horizons[1], counts, n_pend, prior[0], prior[1],
                 end_below, censoring, steps, keep, soft)
        soft = soft[:m]
    return keep, soft, counts, n_pend


def reference(args):
    """One request at a time, as the model's docstring says: ended (past the horizon, or alive with a posterior below
    end_below under the rates as they were), each ended one unpended and labelled in arrival order with its rate
    refreshed; then the EM steps over the kept ones."""
    idle, surv, w, agent, bucket, horizons, counts, n_pend, (a, b), end_below, censoring, steps = args
    rates, alive, cont, ended = (counts[r].tolist() for r in range(4))
    n = n_pend.tolist()
    r0 = list(rates)
    keep = []
    for j in range(idle.size):
        q = int(bucket[j])
        over = idle[j] > horizons[1 if agent[j] else 0]
        if censoring and end_below > 0:
            r = r0[q]
            over = over or r * surv[j] < end_below * max(1.0 - r + r * surv[j], 1e-300)
        keep.append(not over)
    for j in range(idle.size):
        if not keep[j]:
            q = int(bucket[j])
            alive[q] -= float(w[j])
            n[q] -= 1
            ended[q] += 1
            rates[q] = (cont[q] + alive[q] + a) / (cont[q] + ended[q] + n[q] + a + b)
    kept = [j for j in range(idle.size) if keep[j]]
    n = [0] * len(n)
    for j in kept:
        n[int(bucket[j])] += 1
    alive = [0.0] * len(n)
    soft = [0.0] * len(kept)
    for _ in range(steps if censoring else 0):
        alive = [0.0] * len(n)
        for m, j in enumerate(kept):
            q = int(bucket[j])
            r = rates[q]
            soft[m] = r * surv[j] / max(1.0 - r + r * surv[j], 1e-300)
            alive[q] += soft[m]
        rates = [(cont[q] + alive[q] + a) / (cont[q] + ended[q] + n[q] + a + b) for q in range(len(n))]
    return np.array(keep, dtype=bool), np.array(soft), np.array([rates, alive, cont, ended]), np.array(n)


def assert_bits(x, y):
    for u, v in zip(x, y, strict=True):
        u, v = np.asarray(u), np.asarray(v)
        assert u.shape == v.shape
        assert u.tobytes() == v.tobytes(), (u, v)


@settings(max_examples=300, deadline=None)
@given(args=settle_inputs())
def test_the_forms_give_the_same_bits(args):
    want = run_form(settle_numpy, args)
    assert_bits(run_form(settle_loops.py_func if refit.AVAILABLE else settle_loops, args), want)
    assert_bits(run_form(settle_loops, args), want)
    keep, soft, counts, n_pend = want
    assert soft.size == keep.sum() and n_pend.sum() == keep.sum()


@settings(max_examples=200, deadline=None)
@given(args=settle_inputs())
def test_settling_equals_one_request_at_a_time(args):
    keep, soft, counts, n_pend = run_form(settle_numpy, args)
    r_keep, r_soft, r_counts, r_n = reference(args)
    np.testing.assert_array_equal(keep, r_keep)
    np.testing.assert_array_equal(soft, r_soft)
    np.testing.assert_array_equal(counts, r_counts)
    np.testing.assert_array_equal(n_pend, r_n)


def test_each_end_reason_ends_a_request_and_only_it():
    """Request 0 idled past the chat horizon, 1 is alive with a posterior below 1 %, 2 neither, 3 (agent) is past the
    chat horizon but not its own: only 0 and 1 end; the ended counts move and the alive weights lose theirs."""
    idle = np.array([500.0, 10.0, 10.0, 500.0])
    surv = np.array([0.5, 0.001, 0.9, 0.5])
    w = np.array([0.25, 0.125, 0.5, 0.5])
    agent = np.array([False, False, False, True])
    bucket = np.array([1, 2, 2, 1], dtype=np.int8)
    for form in (settle_numpy, settle_loops):
        counts = np.zeros((4, 3))
        counts[RATES] = [0.5, 0.5, 0.5]
        counts[ALIVE] = [0.0, 0.75, 0.625]
        n_pend = np.array([0, 2, 2])
        args = (idle, surv, w, agent, bucket, (100.0, 1000.0), counts, n_pend, PRIOR, 0.01, True, 1)
        keep, soft, c, n = run_form(form, args)
        assert keep.tolist() == [False, False, True, True]
        assert c[ENDED].tolist() == [0.0, 1.0, 1.0] and n.tolist() == [0, 1, 1]
        assert soft.size == 2 and c[ALIVE][1] == soft[1] and c[ALIVE][2] == soft[0]
        # without censoring only the horizon ends a request, and the soft weights are 0
        keep, soft, c, n = run_form(form, args[:-2] + (False, 1))
        assert keep.tolist() == [False, True, True, True] and soft.tolist() == [0.0, 0.0, 0.0]
