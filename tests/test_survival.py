"""Tests of the survival math SAECache ranks blocks by (sae_env/policies/survival.py).

* The log-normal survival against scipy's; the alive posterior's limits.
* The hit density's closed form against a direct numerical computation from its definition: the expected time held
  is the integral of the conditional survival (scipy's quad), the hit probability a difference of survivals; for
  log-normal and exponential gaps, on a grid of parameters.
* Quasi-concavity in idle time (rises, then falls): what lets SAECache take a group's least density from its oldest
  and newest blocks only.
* The empirical gap distribution (``empirical_gaps``): the log-normal's density without gaps, its own definition with
  them (a numerical integral of its survival), the gaps' distribution once they outnumber the prior, and finite,
  non-negative densities for any gaps (hypothesis).
* The two-log-normal mixture (``gap_mixture``): its fit recovers a mixture's components, BIC keeps one log-normal for
  gaps drawn from one, its tabulated survival and density are the mixture's, and the refit schedule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.integrate import quad
from scipy.stats import lognorm, weibull_min

from sae_env.policies.survival import (
    EMPIRICAL_GRID,
    EmpiricalGaps,
    ExponentialGaps,
    GapCounts,
    LognormalGaps,
    MixtureGaps,
    alive_posterior,
    fit_gap_mixture,
    hit_density,
    lognormal_sf,
    mixture_gaps_used,
)


@pytest.mark.parametrize("mu,sigma", [(4.88, 0.98), (0.0, 0.3), (2.0, 2.5), (-1.0, 1.0)])
def test_lognormal_sf_matches_scipy(mu, sigma):
    for dt in (1e-3, 0.1, 1.0, 30.0, 132.0, 1e4):
        want = lognorm.sf(dt, s=sigma, scale=math.exp(mu))
        assert lognormal_sf(dt, mu, sigma) == pytest.approx(want, rel=1e-9, abs=1e-300)
        assert LognormalGaps(mu, sigma).sf(dt) == pytest.approx(want, rel=1e-9, abs=1e-300)
    assert lognormal_sf(0.0, mu, sigma) == 1.0


def test_alive_posterior():
    assert alive_posterior(0.7, 1.0) == pytest.approx(0.7)
    assert alive_posterior(0.7, 0.0) == 0.0
    assert alive_posterior(1.0, 0.01) == pytest.approx(1.0)
    # Bayes: P(alive | no return) = p S / (p S + 1 - p)
    p, s = 0.4, 0.25
    assert alive_posterior(p, s) == pytest.approx(p * s / (p * s + 1 - p))


def reference_density(gaps, p: float, dt: float, h: float) -> float:
    """The definition, computed numerically: hits over block-seconds held within the next ``h`` seconds."""
    s_now = gaps.sf(dt)
    pi = alive_posterior(p, s_now)
    hit = pi * (s_now - gaps.sf(dt + h)) / s_now
    # E[min(G, dt + h) - dt | G > dt] = integral over [dt, dt + h] of S(x) / S(dt)
    alive_time, _ = quad(lambda x: gaps.sf(x) / s_now, dt, dt + h, limit=200, epsabs=0, epsrel=1e-11)
    return hit / (pi * alive_time + (1 - pi) * h)


@pytest.mark.parametrize("mu,sigma", [(4.88, 0.98), (1.0, 0.8), (3.4, 2.0), (0.0, 0.3)])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.99])
def test_lognormal_density_matches_its_definition(mu, sigma, p):
    gaps = LognormalGaps(mu, sigma)
    for dt in (1e-3, 1.0, 30.0, math.exp(mu), 5 * math.exp(mu)):
        for h in (1.0, 70.0, 600.0):
            if gaps.sf(dt) < 1e-12:
                continue
            want = reference_density(gaps, p, dt, h)
            assert gaps.density(p, dt, h) == pytest.approx(want, rel=1e-6), (dt, h)
            assert hit_density(p, dt, mu, sigma, h) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("mean", [0.5, 30.0, 500.0])
def test_exponential_density_matches_its_definition(mean):
    gaps = ExponentialGaps(mean)
    for p in (0.2, 0.9):
        for dt in (0.0, 10.0, 200.0):
            for h in (5.0, 100.0):
                assert gaps.density(p, dt, h) == pytest.approx(reference_density(gaps, p, dt, h), rel=1e-6)
    # memoryless: a certainly-alive session's density does not depend on how long it has been idle
    assert gaps.density(1.0, 0.0, 50.0) == pytest.approx(gaps.density(1.0, 20 * mean, 50.0), rel=1e-9)


def test_upper_quantiles():
    g = LognormalGaps(4.88, 0.98)
    assert g.upper(3.0) == pytest.approx(math.exp(4.88 + 3 * 0.98))
    assert g.sf(g.upper(3.0)) == pytest.approx(0.0013499, rel=1e-3)
    e = ExponentialGaps(10.0)
    assert e.sf(e.upper(3.0)) == pytest.approx(0.0013499, rel=1e-3)


def test_bad_parameters():
    with pytest.raises(ValueError):
        LognormalGaps(1.0, 0.0)
    with pytest.raises(ValueError):
        LognormalGaps(float("nan"), 1.0)
    with pytest.raises(ValueError):
        ExponentialGaps(-1.0)


def test_density_is_quasi_concave_in_idle_time():
    """On a grid over realistic parameters, the density has no interior local minimum (beyond rounding): it rises,
    then falls. Parameters: mu in [-2, 10], sigma in [0.1, 4] (the policy's bounds), p in [0.001, 0.999], horizons
    from 1 s to a day, idle times from 1 ms to 10**6 s."""
    rng = np.random.default_rng(0)
    dts = np.exp(np.linspace(math.log(1e-3), math.log(1e6), 300))
    violations = 0
    for _ in range(400):
        mu, sigma = rng.uniform(-2, 10), rng.uniform(0.1, 4)
        p, h = rng.uniform(0.001, 0.999), math.exp(rng.uniform(0, math.log(86400)))
        g = LognormalGaps(mu, sigma)
        d = np.array([g.density(p, x, h) for x in dts])
        top = int(np.argmax(d))
        tol = 1e-9 * d[top]
        rising = np.all(np.diff(d[:top + 1]) >= -tol)
        falling = np.all(np.diff(d[top:]) <= tol)
        violations += not (rising and falling)
    assert violations == 0


# ----------------------------------------------------------------------------------------------------------------
# The empirical gap distribution (SAECache's empirical_gaps)

@pytest.mark.parametrize("mu,sigma", [(4.88, 0.98), (1.0, 0.8), (3.4, 2.0)])
def test_empirical_gaps_without_gaps_are_the_log_normal(mu, sigma):
    """No gap seen yet: the prior alone, the log-normal, up to the grid's linear interpolation (a factor 1.0046
    between grid points: a horizon shorter than a cell reads the cell's mean slope, hence 1 % at most)."""
    emp, ln = EmpiricalGaps(np.zeros(0), mu, sigma, 50.0), LognormalGaps(mu, sigma)
    for dt in (1e-3, 0.5, 5.0, math.exp(mu), 4 * math.exp(mu)):
        assert emp.sf(dt) == pytest.approx(ln.sf(dt), rel=1e-4, abs=1e-9)
        for p in (0.1, 0.6, 0.99):
            for h in (1.0, 60.0, 900.0):
                assert emp.density(p, dt, h) == pytest.approx(ln.density(p, dt, h), rel=1e-2, abs=1e-12), (dt, p, h)


def test_empirical_gaps_density_matches_its_definition():
    """With gaps: the density against a numerical integral of the survival (the definition, as for the log-normal)."""
    gaps = weibull_min.rvs(0.6, scale=20.0, size=300, random_state=1)
    cases = [(EmpiricalGaps(gaps, 3.0, 1.2, 50.0), dt, h) for dt in (0.0, 0.3, 4.0, 30.0, 400.0)
             for h in (2.0, 45.0, 700.0)]
    # past the grid's end (11.6 days) the survival is flat: a prior of gaps that long reaches it
    cases += [(EmpiricalGaps(gaps, 14.0, 1.0, 50.0), 9e5, 2e5), (EmpiricalGaps(gaps, 14.0, 1.0, 50.0), 2e6, 1e3)]
    for emp, dt, h in cases:
        # the survival is piecewise linear, with a kink at every grid point: a fine trapezoid rule, not quad
        x = np.linspace(dt, dt + h, 20_001)
        sx = np.array([emp.sf(v) for v in x])
        alive_time = float(np.sum(0.5 * (sx[1:] + sx[:-1]) * np.diff(x))) / emp.sf(dt)
        for p in (0.05, 0.5, 0.95):
            pi = alive_posterior(p, emp.sf(dt))
            want = pi * (emp.sf(dt) - emp.sf(dt + h)) / emp.sf(dt) / (pi * alive_time + (1 - pi) * h)
            assert emp.density(p, dt, h) == pytest.approx(want, rel=1e-4, abs=1e-15), (p, dt, h)


def test_empirical_gaps_follow_the_gaps_once_they_outnumber_the_prior():
    """100,000 Weibull gaps (a hazard that falls from the start, which no log-normal has) against a prior of 50: the
    survival is the Weibull's within the prior's weight and the grid's resolution."""
    gaps = weibull_min.rvs(0.5, scale=30.0, size=100_000, random_state=2)
    emp = EmpiricalGaps(gaps, 5.0, 1.0, 50.0)
    for t in (0.5, 3.0, 30.0, 300.0, 3000.0):
        assert emp.sf(t) == pytest.approx(weibull_min.sf(t, 0.5, scale=30.0), abs=0.006), t
    # the density then falls with idle time from the start, as the gaps' hazard does
    d = [emp.density(0.5, dt, 5.0) for dt in (0.1, 1.0, 10.0, 100.0)]
    assert d == sorted(d, reverse=True)
    assert emp.n == gaps.size


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.floats(1e-6, 1e7), max_size=40), mu=st.floats(-2, 10), sigma=st.floats(0.1, 4),
       p=st.floats(0, 1), dt=st.floats(0, 1e7), h=st.floats(0, 1e6))
def test_empirical_gaps_density_is_finite_and_non_negative(gaps, mu, sigma, p, dt, h):
    emp = EmpiricalGaps(np.array(gaps), mu, sigma, 50.0)
    d = emp.density(p, dt, h)
    assert math.isfinite(d) and d >= 0.0
    s = emp.sf(dt)
    assert 0.0 <= s <= 1.0 + 1e-12
    assert emp.sf(dt + 1.0) <= s + 1e-12  # a survival does not rise


def test_empirical_gaps_bad_input():
    for bad in ([0.0], [-1.0], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="positive and finite"):
            EmpiricalGaps(np.array(bad), 3.0, 1.0, 50.0)
    with pytest.raises(ValueError, match="sigma"):
        EmpiricalGaps(np.zeros(0), 3.0, 0.0, 50.0)
    with pytest.raises(ValueError, match="prior"):
        EmpiricalGaps(np.zeros(0), 3.0, 1.0, 0.0)
    assert EMPIRICAL_GRID[0] == 0.0 and np.all(np.diff(EMPIRICAL_GRID) > 0)


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.lists(st.floats(1e-4, 1e7), max_size=30), max_size=6))
def test_gap_counts_are_the_sorted_gaps_search(chunks):
    """Counted a chunk at a time, on the grid's cells: the counts at most each grid point are searchsorted's on all
    the gaps sorted (the same integers, so the same distribution), exactly; and a sequence cannot shrink."""
    counts, seen = GapCounts(), []
    for chunk in chunks:
        seen += chunk
        counts.extend_to(np.array(seen))
        want = np.searchsorted(np.sort(np.array(seen)), EMPIRICAL_GRID, side="right")
        assert counts.n == len(seen) and np.array_equal(counts.at_most(), want)
    a = EmpiricalGaps(counts, 3.0, 1.2, 50.0)
    b = EmpiricalGaps(np.array(seen), 3.0, 1.2, 50.0)
    assert all(np.array_equal(x, y) for x, y in zip(a.table(), b.table(), strict=True)) and a.n == b.n
    if seen:
        with pytest.raises(ValueError, match="counted"):
            counts.extend_to(np.array(seen[:-1]))


# ----------------------------------------------------------------------------------------------------------------
# The two-log-normal mixture (SAECache's gap_mixture)

def _mixture_sample(n: int, seed: int) -> np.ndarray:
    """40 % fast returns LN(1, 0.8) (about 3 s), 60 % slow ones LN(4.5, 0.9) (about 90 s)."""
    rng = np.random.default_rng(seed)
    fast = rng.random(n) < 0.4
    return np.exp(np.where(fast, rng.normal(1.0, 0.8, n), rng.normal(4.5, 0.9, n)))


def test_gap_mixture_recovers_its_components():
    """20,000 gaps of a known mixture, a prior (50 pseudo-gaps) off to one side: the components within the bins'
    width (0.09 in ln g) and sampling error."""
    fit = fit_gap_mixture(GapCounts().add(_mixture_sample(20_000, 0)), 3.0, 1.7, 50.0)
    assert isinstance(fit, MixtureGaps) and fit.n == 20_000
    order = np.argsort(fit.mus)
    assert fit.weights[order] == pytest.approx([0.4, 0.6], abs=0.02)
    assert fit.mus[order] == pytest.approx([1.0, 4.5], abs=0.05)
    assert fit.sigmas[order] == pytest.approx([0.8, 0.9], abs=0.05)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gap_mixture_keeps_one_log_normal_for_log_normal_gaps(seed):
    """Gaps drawn from one log-normal (as WildChat's generator draws them): BIC keeps it, at any number of gaps; from
    a mixture, it takes the mixture once the gaps say so, well before a thousand."""
    rng = np.random.default_rng(seed)
    one = np.exp(rng.normal(4.8, 0.94, 5000))
    for n in (10, 100, 1000, 5000):
        assert fit_gap_mixture(GapCounts().add(one[:n]), 4.8, 0.94, 50.0) is None, n
    assert fit_gap_mixture(GapCounts().add(_mixture_sample(300, seed)), 3.0, 1.7, 50.0) is not None
    assert fit_gap_mixture(GapCounts().add(_mixture_sample(2, seed)), 3.0, 1.7, 50.0) is None  # too few to fit


def test_gap_mixture_table_is_the_mixture():
    """The tabulated survival is the weighted sum of the components' at the grid points; between them, and in the
    density, the grid's linear interpolation: the density against the closed form from the components' survivals and
    tail means (LognormalGaps), within the interpolation's 1 %."""
    w, m, sd = np.array([0.3, 0.7]), np.array([0.5, 4.0]), np.array([0.7, 1.1])
    mix = MixtureGaps(w, m, sd, 3.0, 1.5, 123)
    parts = [LognormalGaps(a, b) for a, b in zip(m, sd, strict=True)]

    def sf(t: float) -> float:
        return sum(x * c.sf(t) for x, c in zip(w, parts, strict=True))

    def tail(t: float) -> float:  # E[G; G > t]
        return sum(x * c._tail_mean(t) for x, c in zip(w, parts, strict=True))

    surv, _ = mix.table()
    k = np.searchsorted(EMPIRICAL_GRID, [0.1, 2.0, 60.0, 4000.0])
    assert surv[k] == pytest.approx([sf(t) for t in EMPIRICAL_GRID[k]], rel=1e-12)
    for dt in (0.2, 1.5, 20.0, 300.0):
        for h in (1.0, 30.0, 600.0):
            s_now, end = sf(dt), dt + h
            alive_time = (tail(dt) - tail(end) + end * sf(end)) / s_now - dt
            for p in (0.1, 0.7):
                pi = alive_posterior(p, s_now)
                want = pi * (s_now - sf(end)) / s_now / (pi * alive_time + (1 - pi) * h)
                assert mix.density(p, dt, h) == pytest.approx(want, rel=1e-2), (dt, h, p)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 10**7), growth=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]))
def test_mixture_refit_schedule(n, growth):
    """The gaps a mixture rests on: none below the first fit's 10, never more than there are, a point of the schedule
    (each the previous times 1 + growth, rounded up), the last one reached; every count when growth is 0."""
    m = mixture_gaps_used(n, growth)
    if n < 10:
        assert m == 0
        return
    assert 10 <= m <= n
    if growth == 0:
        assert m == n
        return
    points = [10]
    while points[-1] <= n:
        points.append(max(points[-1] + 1, math.ceil(points[-1] * (1 + growth))))
    assert m == points[-2]
    assert mixture_gaps_used(m, growth) == m  # a count the schedule gave is its own


def test_gap_mixture_bad_input():
    counts = GapCounts().add(_mixture_sample(100, 4))
    for mu, sigma, prior in ((float("nan"), 1.0, 50.0), (3.0, 0.0, 50.0), (3.0, 1.0, 0.0)):
        with pytest.raises(ValueError, match="gap mixture"):
            fit_gap_mixture(counts, mu, sigma, prior)
    with pytest.raises(ValueError, match="gap mixture"):
        MixtureGaps(np.array([0.5, 0.6]), np.array([1.0, 2.0]), np.array([1.0, 1.0]), 3.0, 1.0, 10)
    with pytest.raises(ValueError, match="gap mixture"):
        MixtureGaps(np.array([0.5, 0.5]), np.array([1.0, 2.0]), np.array([1.0, -1.0]), 3.0, 1.0, 10)


@settings(max_examples=50, deadline=None)
@given(mu=st.floats(-3, 8), sigma=st.floats(0.05, 4),
       dt=st.lists(st.one_of(st.floats(-10, 1e7), st.sampled_from([0.0, 5e-324, 1e-300, math.inf, math.nan])),
                   max_size=50))
def test_the_survival_of_many_idle_times_is_each_ones_survival_bit_for_bit(mu, sigma, dt):
    """sf_array is sf elementwise, the same floats (libm's log and erfc, as the compiled arrivals compute them)."""
    g = LognormalGaps(mu, sigma)
    got = g.sf_array(np.array(dt, dtype=np.float64))
    assert got.dtype == np.float64 and got.shape == (len(dt),)
    assert got.tobytes() == np.array([g.sf(x) for x in dt], dtype=np.float64).tobytes()
