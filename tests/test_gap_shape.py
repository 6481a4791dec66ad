"""gap_select (sae_env/policies/gap_shape.py): the cure model's likelihood against scipy, the sums in whole units, the
choice on gaps drawn from each shape, the switch's bad combinations, what it does on the real traces (golden
figures), and that it never reads a request before it arrives. Its compiled twin is checked hit for hit in
test_fast_saecache.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replaying import replay_like_train, token_hit_rate
from scipy import stats

from sae_env.block import Block
from sae_env.cache import resolve_capacity
from sae_env.policies import make_policy
from sae_env.policies.arrivals import AG, CH, ST
from sae_env.policies.gap_shape import (
    CENSUS,
    LOGLIK_UNIT,
    GapShapeChoice,
    census_on,
    cure_loglik,
    idle_every,
    loglik_units,
)
from sae_env.sources import open_trace
from sae_env.trace import session_halves


@settings(max_examples=200, deadline=None)
@given(mu=st.floats(-3, 8), sigma=st.floats(0.1, 4), p=st.floats(1e-3, 1 - 1e-3), t=st.floats(1e-3, 1e5))
def test_the_likelihood_is_the_cure_models(mu, sigma, p, t):
    """An event: ``log p`` plus the log-density; a censored time: ``log(1 - p + p S(t))``; under the log-normal and
    under the exponential of its mean (scipy's)."""
    mean = math.exp(mu + sigma * sigma / 2)
    ln, ex = cure_loglik(True, t, p, mu, sigma, mean)
    assert ln == pytest.approx(math.log(p) + stats.lognorm.logpdf(t, sigma, scale=math.exp(mu)), rel=1e-9, abs=1e-9)
    assert ex == pytest.approx(math.log(p) + stats.expon.logpdf(t, scale=mean), rel=1e-9, abs=1e-9)
    ln, ex = cure_loglik(False, t, p, mu, sigma, mean)
    assert ln == pytest.approx(math.log(1 - p + p * stats.lognorm.sf(t, sigma, scale=math.exp(mu))), rel=1e-9,
                               abs=1e-12)
    assert ex == pytest.approx(math.log(1 - p + p * stats.expon.sf(t, scale=mean)), rel=1e-9, abs=1e-12)


def test_p_at_its_edges_keeps_every_term_finite():
    for p in (0.0, 1.0):
        for event in (True, False):
            assert all(math.isfinite(x) for x in cure_loglik(event, 1e5, p, 0.0, 0.1, 1.0))


@given(xs=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=200))
def test_units_sum_to_the_float_sum_within_half_a_unit_a_term(xs):
    """Whole units: a sum whatever the order of its terms, within half a unit a term of the float sum."""
    total = sum(loglik_units(x) for x in xs)
    assert abs(total * LOGLIK_UNIT - math.fsum(xs)) <= len(xs) * LOGLIK_UNIT / 2 + 1e-9 * math.fsum(map(abs, xs))
    assert loglik_units(-1e300) == loglik_units(-1e7) == -loglik_units(1e6)  # clamped: int64 sums never wrap


def _blocks(queue: int, n: int) -> list[Block]:
    out = []
    for k in range(n):
        b = Block(k, None, 0, 0, 0.0)
        b.queue = queue
        out.append(b)
    return out


@pytest.mark.parametrize("drawn", ["exponential", "lognormal"])
def test_the_choice_follows_the_gaps_shape(drawn):
    """Blocks re-used after gaps drawn from one shape (half of them never: p = 0.5), the other half still idle: each
    queue reads the shape its gaps were drawn from; both shapes have the same mean."""
    rng = np.random.default_rng(0)
    mu, sigma = 2.0, 1.2
    mean = math.exp(mu + sigma * sigma / 2)
    shape = GapShapeChoice((CH, AG, ST))
    n = 2000
    for q in (CH, AG):
        blocks = _blocks(q, n)
        shape.released(blocks, 0.0)
        gaps = rng.exponential(mean, n // 2) if drawn == "exponential" else rng.lognormal(mu, sigma, n // 2)
        for b, g in zip(blocks, gaps, strict=False):
            shape.ended(b, float(g), True, lambda b: 0.5, lambda q: (mu, sigma, mean))
    changed = shape.choose(1000.0, lambda b: 0.5, lambda q: (mu, sigma, mean))
    assert changed == (drawn == "exponential")
    assert shape.exponential == {CH: drawn == "exponential", AG: drawn == "exponential", ST: False}
    assert len(shape.idle) == n  # the hit blocks left it; the idle ones counted, not removed
    assert shape.switches_made == (2 if drawn == "exponential" else 0)


def test_the_idle_sample_step():
    """A power of two leaving ``sample`` to twice as many blocks of a full cache; 1 below twice the sample."""
    assert [idle_every(c, 64) for c in (1, 64, 127, 128, 255, 256, 4015, 64 * 1024)] == [1, 1, 1, 2, 2, 4, 32, 1024]
    assert idle_every(4015) == 16  # the default: 251 of a full 4,015-block cache
    for c in (128, 1000, 4015, 99_999):
        assert 64 <= c / idle_every(c, 64) < 128
    with pytest.raises(ValueError, match="idle_sample"):
        make_policy("saecache", gap_select=True, idle_sample=0)


def test_a_sample_of_idle_blocks_counts_every_times():
    """totals(every=k) counts the idle blocks whose release stamp is a multiple of k, k times each: of eight blocks of
    one idle time, stamps 4 and 8 four times each make the sums of all eight; of eight idle times, a different sum."""
    mu, sigma = 1.0, 1.0
    mean = math.exp(mu + sigma * sigma / 2)
    shape = GapShapeChoice((CH, AG, ST))
    blocks = _blocks(CH, 8)
    for k, b in enumerate(blocks):
        b.stamp = k + 1
    shape.released(blocks, 0.0)
    args = (lambda b: 0.9, lambda q: (mu, sigma, mean))
    every, sampled = shape.totals(5.0, *args), shape.totals(5.0, *args, 4)
    assert every == sampled and every[CH][0] < 0 and every[AG] == every[ST] == [0, 0]
    for k, b in enumerate(blocks):
        shape.idle[b] = float(k)
    assert shape.totals(9.0, *args) != shape.totals(9.0, *args, 4)
    assert shape.loglik[CH] == [0, 0]  # the idle blocks are counted, not kept


def test_the_census_counts_the_idle_blocks_until_the_cache_has_turned_over():
    """Every eviction counts towards the census's end, whatever the block (idle or not, of any queue); a choice
    without the census reads the hits and evictions alone: here the idle blocks (long idle under a tight log-normal:
    far in its tail, close to the exponential's mean) alone would choose the exponential."""
    mu, sigma = 0.0, 0.3
    mean = math.exp(mu + sigma * sigma / 2)
    args = (lambda b: 0.9, lambda q: (mu, sigma, mean))
    shape = GapShapeChoice((CH, AG, ST))
    idle = _blocks(CH, 50)
    shape.released(idle, 0.0)
    for b in _blocks(1, 3):  # the PE queue's blocks (queue 1), never idle here: evictions all the same
        shape.ended(b, 1.0, False, *args)
    assert shape.evicted == 3 and shape.loglik[CH] == [0, 0]
    assert not shape.choose(5.0, *args, census=False)
    assert shape.choose(5.0, *args)  # the census: 50 blocks idle five times the median
    assert shape.exponential[CH]
    assert [census_on(e, 10, CENSUS) for e in (0, 39, 40)] == [True, True, False]
    assert census_on(10**12, 1, math.inf)
    for bad in (0, -1.0, math.nan, "4", True):
        with pytest.raises(ValueError, match="census"):
            make_policy("saecache", gap_select=True, census=bad)


@pytest.mark.parametrize("bad", [{"lognormal": False}, {"density": False}, {"empirical_gaps": True},
                                 {"gap_mixture": True}])
def test_gap_select_needs_the_log_normal_density(bad):
    with pytest.raises(ValueError, match="gap_select"):
        make_policy("saecache", gap_select=True, **bad)
    with pytest.raises(ValueError, match="gap_select must be true or false"):
        make_policy("saecache", gap_select="yes")


def _cell(trace, fraction, policy):
    rep = replay_like_train(trace, resolve_capacity(fraction, trace.distinct_blocks()), policy)
    return token_hit_rate(rep), rep


def test_gap_select_on_the_real_traces():
    """Golden figures (docs/saecache-real-traces.md). mooncake_synthetic's late half at 2 %, where the default is
    below LRU: the chat queue chooses the exponential, and the cell rises above LRU (7.01 % against 5.74 % and LRU's
    6.49 %; 7.04 % with the idle blocks counted at every choice, census=inf: its choices part after the census ends,
    at four turnovers); mooncake_arxiv at 10 %, whose tight gaps the log-normal describes: no switch, the default's
    figure."""
    late = session_halves(open_trace("mooncake_synthetic")[0], "start")[1]
    selected, rep = _cell(late, 0.02, make_policy("saecache", gap_select=True))
    rep.to_python()
    assert rep.policy._shape.exponential[CH] and rep.policy._shape.switches_made > 0
    assert rep.policy._shape.evicted > CENSUS * rep.cache.capacity  # the census ended within the replay
    assert round(100 * selected, 2) == 7.01
    assert round(100 * _cell(late, 0.02, make_policy("saecache", gap_select=True, census=math.inf))[0], 2) == 7.04
    assert round(100 * _cell(late, 0.02, make_policy("saecache"))[0], 2) == 5.74
    assert round(100 * _cell(late, 0.02, make_policy("lru"))[0], 2) == 6.49
    arxiv = open_trace("mooncake_arxiv")[0]
    tight, rep = _cell(arxiv, 0.1, make_policy("saecache", gap_select=True))
    rep.to_python()
    assert rep.policy._shape.switches_made == 0
    assert tight == _cell(arxiv, 0.1, make_policy("saecache"))[0]


def test_gap_select_never_reads_the_future():
    """A replay of the first k requests and one of the whole trace, at the same capacity, make the same decisions
    over those k: every window up to there has the same hits, evictions and choices (the sums read only the hits,
    evictions and idle blocks so far)."""
    late = session_halves(open_trace("mooncake_synthetic")[0], "start")[1]
    k = 600
    capacity = resolve_capacity(0.02, late.distinct_blocks())
    whole, cut = _replay(late, capacity), _replay(late[:k], capacity)
    assert len(cut.windows) == k // 200
    assert [(w.hit_blocks, w.evictions, w.policy["gap_exponential"]) for w in cut.windows] == \
        [(w.hit_blocks, w.evictions, w.policy["gap_exponential"]) for w in whole.windows[:k // 200]]
    assert any(w.policy["gap_exponential"][0] for w in cut.windows)  # choices were made within the cut


def _replay(trace, capacity):
    return replay_like_train(trace, capacity, make_policy("saecache", gap_select=True))
