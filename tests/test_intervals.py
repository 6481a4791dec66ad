"""Tests of the confidence intervals over seeds (sae_env.intervals) against scipy's t-interval and paired t-test."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from sae_env.intervals import mean_interval, paired_difference, paired_ratio

values = st.lists(st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False), min_size=2, max_size=12)


def distinct(xs: list[float]) -> bool:
    return np.ptp(np.asarray(xs)) > 1e-6 * (1 + max(abs(x) for x in xs))


@settings(max_examples=200, deadline=None)
@given(xs=values, level=st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_mean_interval_is_scipys_t_interval(xs, level):
    iv = mean_interval(xs, level)
    assert iv.n == len(xs) and iv.mean == pytest.approx(np.mean(xs), abs=1e-9)
    if not distinct(xs):
        return
    low, high = stats.t.interval(level, len(xs) - 1, loc=np.mean(xs), scale=stats.sem(xs))
    assert iv.low == pytest.approx(low, rel=1e-9, abs=1e-9) and iv.high == pytest.approx(high, rel=1e-9, abs=1e-9)
    assert iv.half == pytest.approx((high - low) / 2, rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.floats(0, 1, allow_nan=False), st.floats(0, 1, allow_nan=False)), min_size=2,
                      max_size=10))
def test_paired_difference_is_scipys_paired_t_test(pairs):
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    iv = paired_difference(a, b)
    d = np.subtract(a, b)
    assert iv.mean == pytest.approx(d.mean(), abs=1e-12)
    if not distinct(d.tolist()):
        return
    ci = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert iv.low == pytest.approx(ci.low, abs=1e-9) and iv.high == pytest.approx(ci.high, abs=1e-9)


def test_paired_ratio_is_the_geometric_mean_with_the_log_interval():
    a = [120.0, 95.0, 300.0, 180.0, 150.0]
    b = [100.0, 90.0, 200.0, 160.0, 140.0]
    iv = paired_ratio(a, b)
    ci = stats.ttest_rel(np.log(a), np.log(b)).confidence_interval(0.95)
    assert iv.mean == pytest.approx(stats.gmean(np.divide(a, b)))
    assert iv.low == pytest.approx(math.exp(ci.low)) and iv.high == pytest.approx(math.exp(ci.high))
    assert iv.half is None and iv.low < iv.mean < iv.high
    assert paired_ratio([0.0, 2.0], [1.0, 1.0]).n == 1  # non-positive values have no log: left out


def test_few_values_missing_values_and_units():
    assert mean_interval([]).mean is None and mean_interval([]).n == 0
    one = mean_interval([3.0])
    assert one.mean == 3.0 and one.half is None and one.low is None and one.n == 1
    mixed = mean_interval([1.0, None, float("nan"), 3.0, float("inf")])
    assert mixed.n == 2 and mixed.mean == 2.0
    low, high = stats.t.interval(0.95, 1, loc=2.0, scale=stats.sem([1.0, 3.0]))
    assert (mixed.low, mixed.high) == pytest.approx((low, high))
    pct = mixed.scaled(100.0)
    assert (pct.mean, pct.low, pct.high, pct.half) == pytest.approx((200.0, 100 * low, 100 * high, 100 * mixed.half))
    neg = mixed.scaled(-1.0)
    assert neg.low == pytest.approx(-high) and neg.high == pytest.approx(-low) and neg.half == mixed.half
    assert paired_difference([1.0, None, 5.0], [0.0, 1.0, 2.0]).n == 2  # a seed one agent lacks is left out
    with pytest.raises(ValueError, match="same length"):
        paired_difference([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="level"):
        mean_interval([1.0, 2.0], level=95)
