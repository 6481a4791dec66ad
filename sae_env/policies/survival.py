"""Whether and when a session comes back: log-normal re-access gaps, the posterior that a session is still alive,
and the hit density that SAECache ranks temporal and structural blocks by.

A block was last released ``dt`` seconds ago by a request whose session continues with probability ``p`` (the
continuation model's answer); if it continues, the gap to its next request is log-normal ``LN(mu, sigma)`` with
survival ``S``. Then (a cure-rate model: a session either ended, or comes back after a log-normal gap):

* the posterior that the session is still alive after idling ``dt`` is ``pi = p S(dt) / (1 - p + p S(dt))``: a
  block idle far past its session's typical gap is probably dead;
* its *hit density* over the next ``horizon`` seconds (LHD's measure, Beckmann et al., NSDI 2018) is the expected
  number of hits per block-second of cache it would hold, if kept for at most that long::

      D = pi * P(G <= dt + h | G > dt) / (pi * E[min(G, dt + h) - dt | G > dt] + (1 - pi) * h)

  A block that is a hit it would bring soon scores high; one that is probably dead, or whose reuse would come only
  after a long wait, scores low. Unlike ``S(dt) / dt``, ``D`` is not monotone in ``dt``: the hazard of a
  log-normal rises before it falls, so a session idle for a while can be closer to its next turn than a fresh one.
  Within one set of constants ``D`` rises then falls (quasi-concave: checked on a grid in the tests), so the lowest
  ``D`` over blocks sharing the constants is at the least or the most recently released one.

``horizon`` is how long the cache would keep the block anyway: SAECache uses its own turnover time (capacity over
the rate at which blocks enter the cache).
"""

from __future__ import annotations

import bisect
import math

import numpy as np
from scipy.special import erfc, ndtri

__all__ = ["EMPIRICAL_GRID", "EmpiricalGaps", "ExponentialGaps", "GapCounts", "GridGaps", "LognormalGaps",
           "MixtureGaps", "alive_posterior", "fit_gap_mixture", "hit_density", "lognormal_sf", "mixture_gaps_used"]

_SQRT2 = math.sqrt(2.0)
_TINY = 1e-300
_log, _erfc = math.log, math.erfc  # density's calls, without a module lookup each (Python engine)


def lognormal_sf(dt: float, mu: float, sigma: float) -> float:
    """``P(G > dt)`` for ``G ~ LN(mu, sigma)``; 1 for ``dt <= 0``."""
    if dt <= 0.0:
        return 1.0
    return 0.5 * math.erfc((math.log(dt) - mu) / (sigma * _SQRT2))


def alive_posterior(p: float, survival: float) -> float:
    """``P(alive | no return yet)`` for a prior continuation probability ``p`` and gap survival ``S(dt)``."""
    alive = p * survival
    return alive / (1.0 - p + alive) if alive > 0.0 else 0.0


class LognormalGaps:
    """The constants of one ``LN(mu, sigma)`` gap distribution, precomputed for :meth:`density` (a hot path)."""

    __slots__ = ("mu", "sigma", "_s2", "_mean", "_shift")

    def __init__(self, mu: float, sigma: float):
        if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"log-normal gaps need a finite mu and sigma > 0, got ({mu}, {sigma})")
        self.mu, self.sigma = float(mu), float(sigma)
        self._s2 = self.sigma * _SQRT2
        self._mean = math.exp(self.mu + 0.5 * self.sigma * self.sigma)  # E[G]
        self._shift = self.mu + self.sigma * self.sigma  # E[G; G > x] = E[G] * Q((ln x - shift) / sigma)

    def constants(self) -> tuple[float, float, float, float]:
        """``(mu, sigma * sqrt 2, E[G], mu + sigma**2)``: what :meth:`density` computes with (a compiled copy of it
        takes these, to compute the same floats)."""
        return self.mu, self._s2, self._mean, self._shift

    def sf(self, dt: float) -> float:
        return 0.5 * math.erfc((math.log(dt) - self.mu) / self._s2) if dt > 0.0 else 1.0

    def sf_array(self, dt: np.ndarray) -> np.ndarray:
        """:meth:`sf` of many idle times at once, the same floats: libm's log and erfc each, as a compiled copy
        computes them (numpy's own log differs from libm's in the last bit on some inputs, scipy's erfc on many)."""
        mu, s2 = self.mu, self._s2
        return np.array([0.5 * _erfc((_log(x) - mu) / s2) if x > 0.0 else 1.0
                         for x in np.asarray(dt, dtype=np.float64).tolist()], dtype=np.float64)

    def upper(self, sigmas: float) -> float:
        """The gap that only ``P(Z > sigmas)`` of gaps exceed (``Z`` standard normal)."""
        return math.exp(self.mu + sigmas * self.sigma)

    def _tail_mean(self, x: float) -> float:
        """``E[G; G > x]``, from the upper tail (no cancellation far out in it)."""
        return self._mean * 0.5 * math.erfc((math.log(x) - self._shift) / self._s2) if x > 0.0 else self._mean

    def _alive_time(self, dt: float, end: float, s_now: float, s_end: float) -> float:
        """``E[min(G, end) - dt | G > dt]`` (``s_now``, ``s_end``: the survival at ``dt`` and ``end``)."""
        return (self._tail_mean(dt) - self._tail_mean(end) + end * s_end) / s_now - dt

    def density(self, p: float, dt: float, horizon: float) -> float:
        """Hit density of a block idle ``dt`` of a session continuing with probability ``p`` (module docstring).

        The hot path of SAECache's ranking: :meth:`sf` and :meth:`_alive_time` written out with one logarithm per
        time (the same expressions, so the same floats as :meth:`_density`, which the exponential gaps use)."""
        if dt <= 0.0 or horizon <= 0.0:
            return self._density(p, dt, horizon)
        s2, mu = self._s2, self.mu
        log_now = _log(dt)
        s_now = 0.5 * _erfc((log_now - mu) / s2)
        if s_now < _TINY:
            return 0.0
        alive = p * s_now
        pi = alive / (1.0 - p + alive) if alive > 0.0 else 0.0
        end = dt + horizon
        log_end = _log(end)
        s_end = 0.5 * _erfc((log_end - mu) / s2)
        hit = pi * (s_now - s_end) / s_now
        mean, shift = self._mean, self._shift
        alive_time = (mean * 0.5 * _erfc((log_now - shift) / s2) - mean * 0.5 * _erfc((log_end - shift) / s2)
                      + end * s_end) / s_now - dt
        held = pi * max(alive_time, 0.0) + (1.0 - pi) * horizon
        return hit / held if held > 0.0 else 0.0

    def _density(self, p: float, dt: float, horizon: float) -> float:
        """:meth:`density` through :meth:`sf` and :meth:`_alive_time` (any gap distribution)."""
        s_now = self.sf(dt)
        if s_now < _TINY:
            return 0.0
        pi = alive_posterior(p, s_now)
        end = dt + horizon
        s_end = self.sf(end)
        hit = pi * (s_now - s_end) / s_now
        held = pi * max(self._alive_time(dt, end, s_now, s_end), 0.0) + (1.0 - pi) * horizon
        return hit / held if held > 0.0 else 0.0


def hit_density(p: float, dt: float, mu: float, sigma: float, horizon: float) -> float:
    """:meth:`LognormalGaps.density` for one-off use."""
    return LognormalGaps(mu, sigma).density(p, dt, horizon)


class ExponentialGaps(LognormalGaps):
    """Exponential gaps of mean ``mean``: memoryless, the ablation of log-normal timing (same interface)."""

    __slots__ = ()

    def __init__(self, mean: float):
        if not (math.isfinite(mean) and mean > 0):
            raise ValueError(f"exponential gaps need a positive finite mean, got {mean}")
        self.mu, self.sigma = math.log(mean), 0.0
        self._mean = float(mean)

    def sf(self, dt: float) -> float:
        return math.exp(-dt / self._mean) if dt > 0.0 else 1.0

    def sf_array(self, dt: np.ndarray) -> np.ndarray:
        dt = np.asarray(dt, dtype=np.float64)
        return np.where(dt > 0, np.exp(-np.maximum(dt, 0.0) / self._mean), 1.0)

    def upper(self, sigmas: float) -> float:
        return -self._mean * math.log(0.5 * math.erfc(sigmas / _SQRT2))

    def _alive_time(self, dt: float, end: float, s_now: float, s_end: float) -> float:
        return self._mean * -math.expm1(-(end - dt) / self._mean)  # memoryless

    def density(self, p: float, dt: float, horizon: float) -> float:
        return self._density(p, dt, horizon)


# The idle times (s) an EmpiricalGaps keeps its survival at: 0, then 4,000 points a factor 1.0046 apart from 10 ms to
# 11.6 days (one per 0.46 % of idle time: interpolating between them moves a score by less than the estimates resolve).
EMPIRICAL_GRID = np.concatenate([[0.0], np.geomspace(0.01, 1e6, 4000)])
_GRID_LIST = EMPIRICAL_GRID.tolist()
_GRID_LOG = np.log(EMPIRICAL_GRID[1:])  # the grid's idle times but 0, in ln g (the log-normals on the grid read them)


class GapCounts:
    """Gaps counted by the cell of :data:`EMPIRICAL_GRID` they fall in (``grid[c - 1] < g <= grid[c]``; the last
    cell: past the grid), so that an :class:`EmpiricalGaps` on gaps that grow by a few at a time costs a pass over the
    grid, not a sort of every gap so far. :meth:`at_most` is what ``searchsorted(sorted gaps, grid, "right")`` gives:
    the same integers."""

    __slots__ = ("n", "_cells")

    def __init__(self) -> None:
        self.n = 0
        self._cells = np.zeros(EMPIRICAL_GRID.size + 1, dtype=np.int64)

    def add(self, gaps: np.ndarray) -> GapCounts:
        """Count ``gaps`` too (returns self)."""
        g = np.asarray(gaps, dtype=np.float64)
        if g.size:
            if not (np.all(g > 0) and np.all(np.isfinite(g))):
                raise ValueError("empirical gaps must be positive and finite")
            np.add.at(self._cells, np.searchsorted(EMPIRICAL_GRID, g, side="left"), 1)
            self.n += g.size
        return self

    def extend_to(self, gaps: np.ndarray) -> GapCounts:
        """Count the gaps of ``gaps`` past the ones counted so far, which must be its first ``n`` (a sequence that
        only grows: the arrivals' raw gaps). Returns self."""
        if len(gaps) < self.n:
            raise ValueError(f"gap counts: {self.n} gaps counted, the sequence holds only {len(gaps)}")
        return self.add(gaps[self.n:])

    def cells(self) -> np.ndarray:
        """The gaps counted in each cell (int64; cell ``c``: ``grid[c - 1] < g <= grid[c]``, the last: past the grid;
        read-only)."""
        return self._cells

    def at_most(self) -> np.ndarray:
        """The gaps counted at most each grid point's idle time (int64, one per grid point)."""
        return np.cumsum(self._cells[:-1])


_LN_ON_GRID: dict[tuple[float, float], np.ndarray] = {}  # (mu, sigma) -> the log-normal's survival on the grid


def _lognormal_sf_past_zero(mu: float, sigma: float) -> np.ndarray:
    """``LN(mu, sigma)``'s survival at the grid's idle times but 0."""
    return 0.5 * erfc((_GRID_LOG - mu) / (sigma * _SQRT2))


def _grid_lognormal_sf(mu: float, sigma: float) -> np.ndarray:
    """``LN(mu, sigma)``'s survival at :data:`EMPIRICAL_GRID` (read-only), kept for the last few constants: a refit
    rebuilds the empirical distributions with the learners' constants of the window, the same until they move."""
    s = _LN_ON_GRID.get((mu, sigma))
    if s is None:
        if len(_LN_ON_GRID) >= 8:
            _LN_ON_GRID.clear()
        s = np.ones(EMPIRICAL_GRID.size)
        s[1:] = _lognormal_sf_past_zero(mu, sigma)
        _LN_ON_GRID[(mu, sigma)] = s
    return s


class GridGaps:
    """A gap distribution kept as its survival and the survival's integral at :data:`EMPIRICAL_GRID`, linear in between;
    beyond the grid, flat. :meth:`density` has the formula of :meth:`LognormalGaps.density` (module docstring) with
    these. Unlike the log-normal's, such a density need not rise then fall with idle time: a scan that scores a group's
    oldest and newest blocks (SAECache's) finds the least of those two, not always the least of the group. Built by
    :class:`EmpiricalGaps` and :class:`MixtureGaps`; ``mu``, ``sigma``: the learners' log-normal it was built with
    (its prior), ``n``: the gaps it rests on."""

    __slots__ = ("mu", "sigma", "n", "_table", "_lists")

    def __init__(self, survival: np.ndarray, mu: float, sigma: float, n: int):
        grid = EMPIRICAL_GRID
        s = np.asarray(survival, dtype=np.float64)
        if s.shape != grid.shape:
            raise ValueError(f"a gap survival on the grid needs {grid.size} points, got shape {s.shape}")
        self.mu, self.sigma, self.n = float(mu), float(sigma), int(n)
        cum = np.zeros(grid.size)
        cum[1:] = np.cumsum(0.5 * (s[1:] + s[:-1]) * np.diff(grid))
        self._table = (s, cum)
        self._lists: tuple[list[float], list[float], list[float]] | None = None  # made when density is first asked

    def _at(self, t: float) -> tuple[float, float]:
        """(survival, its integral from 0) at idle time ``t``."""
        if self._lists is None:  # Python lists: density reads a few entries a call, where numpy scalars cost more
            self._lists = (_GRID_LIST, self._table[0].tolist(), self._table[1].tolist())
        grid, surv, cum = self._lists
        k = bisect.bisect_right(grid, t) - 1
        if k >= len(grid) - 1:
            last = surv[-1]
            return last, cum[-1] + last * (t - grid[-1])
        t0, t1 = grid[k], grid[k + 1]
        s0, s1 = surv[k], surv[k + 1]
        x = t - t0
        s = s0 + (s1 - s0) * x / (t1 - t0)
        return s, cum[k] + 0.5 * (s0 + s) * x

    def sf(self, dt: float) -> float:
        return self._at(dt)[0] if dt > 0.0 else 1.0

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """The survival and its integral at :data:`EMPIRICAL_GRID`, as arrays (read-only; the same floats: a compiled
        copy of :meth:`density` reads them)."""
        return self._table

    def density(self, p: float, dt: float, horizon: float) -> float:
        """Hit density of a block idle ``dt`` of a session continuing with probability ``p`` (module docstring)."""
        if horizon <= 0.0:
            return 0.0
        s_now, c_now = self._at(dt) if dt > 0.0 else (1.0, 0.0)
        if s_now < _TINY:
            return 0.0
        alive = p * s_now
        pi = alive / (1.0 - p + alive) if alive > 0.0 else 0.0
        s_end, c_end = self._at(dt + horizon)
        hit = pi * (s_now - s_end) / s_now
        held = pi * max((c_end - c_now) / s_now, 0.0) + (1.0 - pi) * horizon
        return hit / held if held > 0.0 else 0.0


class EmpiricalGaps(GridGaps):
    """A gap distribution of the shape the gaps completed so far have, with a log-normal prior (the
    ``empirical_gaps`` switch of SAECache): ``F = (n F_n + n0 F_LN) / (n + n0)``, ``F_n`` the empirical distribution
    of the ``n`` gaps, ``F_LN`` the log-normal ``LN(mu, sigma)`` weighed as ``n0`` pseudo-gaps (the online learners
    fit ``(mu, sigma)`` with the same prior size). The log-normal's hazard rises from 0 before it falls; recorded gaps
    need not (on mooncake_synthetic the hazard of a block's reuse falls from the first second), and at a small cache,
    whose turnover is seconds, the short end decides which blocks go."""

    __slots__ = ()

    def __init__(self, gaps: np.ndarray | GapCounts, mu: float, sigma: float, prior: float):
        if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"empirical gaps need a finite mu and sigma > 0 for their prior, got ({mu}, {sigma})")
        if not (prior > 0 and math.isfinite(prior)):
            raise ValueError(f"empirical gaps need a positive prior weight, got {prior}")
        if not isinstance(gaps, GapCounts):
            gaps = GapCounts().add(gaps)
        n, at_most = gaps.n, gaps.at_most()  # the gaps at most each grid point's idle time
        f_emp = at_most / max(n, 1)
        s = 1.0 - (n * f_emp + prior * (1.0 - _grid_lognormal_sf(float(mu), float(sigma)))) / (n + prior)
        super().__init__(s, mu, sigma, n)


# A gap mixture's EM runs over the gaps binned 20 grid cells wide (0.092 in ln g, a seventh of the narrowest sigma of
# the embedded traces' gaps, mooncake_arxiv's 0.61): about 200 weighted points at most, whatever the number of gaps.
_BIN_CELLS = 20
_LOG_STEP = math.log(EMPIRICAL_GRID[2] / EMPIRICAL_GRID[1])
_CELL_LOG = math.log(EMPIRICAL_GRID[1]) + (np.arange(EMPIRICAL_GRID.size + 1) - 1.5) * _LOG_STEP  # ln g, cell middles
_CELL_BIN = np.minimum(np.maximum(np.arange(EMPIRICAL_GRID.size + 1) - 1, 0) // _BIN_CELLS,
                       (EMPIRICAL_GRID.size - 1) // _BIN_CELLS)
_CELL_BIN[-1] += 1  # past the grid: a bin of its own
# The log-normal prior as pseudo-gaps: 32 equal-weight quantiles of N(0, 1), moved to (mu, sigma).
_QUANTILES = ndtri((np.arange(32) + 0.5) / 32)
MIXTURE_ITERATIONS = 30  # EM steps, a fixed number: the same fit from the same gaps, whichever engine asks
MIXTURE_EXTRA_PARAMETERS = 3  # BIC's count: a weight, a mean and a sigma more than one log-normal
_MIN_SIGMA = 0.1  # a component narrower than this in ln g would fit the bins' width, not the gaps


class MixtureGaps(GridGaps):
    """Two log-normals mixed, ``S = w_1 S_1 + w_2 S_2`` (the ``gap_mixture`` switch of SAECache): gaps of two kinds,
    a fast return (a user who reads and replies, a tool call) and a slow one, which one log-normal cannot hold. Its
    density falls from the first seconds where a fast component sits there. Kept on the grid like
    :class:`EmpiricalGaps` (the same density and compiled scoring); ``weights``, ``mus``, ``sigmas``: the components;
    ``mu``, ``sigma``: the fit's prior."""

    __slots__ = ("weights", "mus", "sigmas")

    def __init__(self, weights: np.ndarray, mus: np.ndarray, sigmas: np.ndarray, mu: float, sigma: float, n: int):
        w, m, sd = (np.asarray(x, dtype=np.float64) for x in (weights, mus, sigmas))
        if not (w.shape == m.shape == sd.shape and w.ndim == 1 and np.all(np.isfinite(m)) and np.all(sd > 0)
                and np.all(w >= 0) and abs(w.sum() - 1.0) < 1e-9):
            raise ValueError(f"a gap mixture needs weights summing to 1, finite mus and positive sigmas, got {w}, {m}, "
                             f"{sd}")
        self.weights, self.mus, self.sigmas = w, m, sd
        surv = np.ones(EMPIRICAL_GRID.size)
        surv[1:] = sum(wk * _lognormal_sf_past_zero(mk, sk) for wk, mk, sk in zip(w, m, sd, strict=True))
        super().__init__(surv, mu, sigma, n)


MIXTURE_MIN_GAPS = 10  # the first fit waits for as many gaps as the online learners' first refit of (mu, sigma)


def mixture_gaps_used(n: int, growth: float) -> int:
    """How many of a queue's first ``n`` gaps its mixture rests on: the largest of ``MIXTURE_MIN_GAPS``, then each
    previous one times ``1 + growth`` rounded up, that is at most ``n`` (0 below the first; ``n`` itself when
    ``growth`` is 0). A fit costs a few hundred microseconds: refitting at geometric steps bounds their number by the
    logarithm of the gaps, as the continuation model's ``refit_growth`` does its refits, and the fit is a function of
    the gaps alone, so that a state's raw gaps and this count give it back."""
    if n < MIXTURE_MIN_GAPS:
        return 0
    if growth <= 0:
        return n
    m = MIXTURE_MIN_GAPS
    while True:
        nxt = max(m + 1, math.ceil(m * (1.0 + growth)))
        if nxt > n:
            return m
        m = nxt


def fit_gap_mixture(gaps: GapCounts, mu: float, sigma: float, prior: float) -> MixtureGaps | None:
    """Two log-normals fitted to ``gaps`` (binned in ln g), with ``LN(mu, sigma)`` (the online learners') as ``prior``
    pseudo-gaps, by :data:`MIXTURE_ITERATIONS` EM steps from components at ``mu -/+ 0.6 sigma`` of width
    ``0.75 sigma``; None unless the gaps choose it over one log-normal by BIC (twice the gain in log-likelihood over
    the single log-normal's maximum, both on the gaps alone, above ``3 ln n``: three parameters more), as they seldom
    do when drawn from one log-normal."""
    if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0 and prior > 0 and math.isfinite(prior)):
        raise ValueError(f"a gap mixture needs a finite mu, sigma > 0 and a positive prior weight, got ({mu}, {sigma}, "
                         f"{prior})")
    n = gaps.n
    if n < 3:
        return None
    cells = gaps.cells()
    count = np.bincount(_CELL_BIN, weights=cells)
    held = count > 0
    c = count[held]
    x = np.bincount(_CELL_BIN, weights=cells * _CELL_LOG)[held] / c  # each bin's mean ln g (its cells' middles)
    xs = np.concatenate([x, mu + sigma * _QUANTILES])
    ws = np.concatenate([c, np.full(_QUANTILES.size, prior / _QUANTILES.size)])
    total, sx, sxx = float(ws.sum()), float(ws @ xs), float(ws @ (xs * xs))
    m1, m2, s1, s2, w1 = mu - 0.6 * sigma, mu + 0.6 * sigma, 0.75 * sigma, 0.75 * sigma, 0.5
    floor = _MIN_SIGMA * _MIN_SIGMA
    for _ in range(MIXTURE_ITERATIONS):
        z1, z2 = (xs - m1) / s1, (xs - m2) / s2
        # each point's share of the first component, 1 / (1 + b / a), from ln(b / a): no underflow far out
        r1 = ws / (1.0 + np.exp(np.minimum(0.5 * (z1 * z1 - z2 * z2) + math.log((1.0 - w1) * s1 / (w1 * s2)), 700.0)))
        n1 = float(r1.sum())
        n2 = total - n1
        if not (n1 > _TINY and n2 > _TINY):  # one component took everything: one log-normal, then
            return None
        a1, a2 = float(r1 @ xs), float(r1 @ (xs * xs))
        m1, m2 = a1 / n1, (sx - a1) / n2
        s1, s2 = math.sqrt(max(a2 / n1 - m1 * m1, floor)), math.sqrt(max((sxx - a2) / n2 - m2 * m2, floor))
        w1 = n1 / total
    z1, z2 = (x - m1) / s1, (x - m2) / s2
    mixed = float(c @ np.log(np.maximum(w1 / s1 * np.exp(-0.5 * z1 * z1) + (1.0 - w1) / s2 * np.exp(-0.5 * z2 * z2),
                                        _TINY)))
    mean = float(c @ x) / n
    sd = max(math.sqrt(max(float(c @ (x * x)) / n - mean * mean, 0.0)), _MIN_SIGMA)
    z = (x - mean) / sd
    single = float(c @ (-math.log(sd) - 0.5 * z * z))
    if 2.0 * (mixed - single) <= MIXTURE_EXTRA_PARAMETERS * math.log(n):
        return None
    return MixtureGaps(np.array([w1, 1.0 - w1]), np.array([m1, m2]), np.array([s1, s2]), mu, sigma, n)
