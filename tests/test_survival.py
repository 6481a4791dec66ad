"""Tests of the survival math SAECache ranks blocks by (sae_env/policies/survival.py).

* The log-normal survival against scipy's; the alive posterior's limits.
* The hit density's closed form against a direct numerical computation from its definition: the expected time held
  is the integral of the conditional survival (scipy's quad), the hit probability a difference of survivals; for
  log-normal and exponential gaps, on a grid of parameters.
* Quasi-concavity in idle time (rises, then falls): what lets SAECache take a group's least density from its oldest
  and newest blocks only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import quad
from scipy.stats import lognorm

from sae_env.policies.survival import ExponentialGaps, LognormalGaps, alive_posterior, hit_density, lognormal_sf


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
