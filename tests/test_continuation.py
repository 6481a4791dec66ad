"""Tests of SAECache's online continuation model (sae_env/policies/continuation.py).

* Recovery: on generated sessions whose per-turn continuation probabilities and log-normal gaps are known, the
  per-turn rates converge to the truth, and mid-stream (many sessions still pending) the censoring-aware estimate
  is closer to the truth than counting a session that has not come back yet as ended (LPC's counting).
* It never reads the future: the answers for the first k requests are the same on the trace and on the trace cut
  after request k, at every k tried, and the features of a request do not change when later requests change.
* Timed refreshes: a model whose last refit lies a typical gap back refreshes its soft weights, ended labels and rates
  (not beta) at the next arrival, offer or not; at the end of a trace, where arrivals thin out, that keeps the late
  turns' rates near the truth (offers alone let them drift up).
* Ending: a pending request is labelled ended exactly when its posterior to be alive is below ``end_below`` or it has
  idled past the horizon (a reference computed from the exported state); with ``end_below = 0`` or without censoring
  the horizon alone; on sessions that rarely continue far fewer requests stay pending, and the rates stay near the
  truth.
* Invariants under hypothesis: probabilities and rates in (0, 1), the per-turn pending counts and soft weights
  agree with the pending set after any sequence of arrivals and updates.
* Bad options raise ValueError; a predictor's answer is a feature of first requests only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.policies.continuation import MAX_REFIT_GAP, ContinuationModel
from sae_env.policies.survival import LognormalGaps
from sae_env.trace import AppType, TokenType, Trace, TraceBuilder

MU, SIGMA = 4.0, 0.8  # gaps: median ~55 s
TRUE_P = {1: 0.9, 2: 0.4, 3: 0.8, 4: 0.8, 5: 0.8, 6: 0.8, 7: 0.8, 8: 0.8}


def sessions_trace(n_sessions: int, seed: int, rate: float = 0.5, true_p: dict[int, float] = TRUE_P) -> Trace:
    """Sessions starting as a Poisson process; after turn k a session continues with true_p[min(k, 8)], after a
    log-normal gap. One distinct block per request (the model reads no keys)."""
    rng = np.random.default_rng(seed)
    events = []
    start = 0.0
    for s in range(n_sessions):
        start += rng.exponential(1 / rate)
        t, k = start, 1
        while True:
            events.append((t, s, k))
            if rng.random() >= true_p[min(k, 8)] or k >= 30:
                break
            t += math.exp(rng.normal(MU, SIGMA))
            k += 1
    events.sort()
    b = TraceBuilder(block_size=16)
    for j, (t, s, k) in enumerate(events):
        b.add(t=t, session=s, turn=k, app=AppType.CHAT, prompt_tokens=16 * k, output_tokens=8,
              prompt_keys=[j + 1], prompt_types=[TokenType.USER])
    return b.build()


def replay_model(trace: Trace, model: ContinuationModel, until: int | None = None, window: int = 50) -> list[float]:
    """Arrivals in order, an update every ``window`` requests (as SAECache does once a window); returns p_i."""
    gaps = (LognormalGaps(MU, SIGMA), LognormalGaps(MU, SIGMA))
    model.bind(trace)
    out = []
    for i in range(len(trace) if until is None else until):
        if i and i % window == 0:
            model.update(float(trace.t[i - 1]), gaps)
        out.append(model.arrive(i, float(trace.t[i])))
    return out


def test_rates_converge_to_the_truth():
    trace = sessions_trace(3000, seed=1)
    model = ContinuationModel(features=False)
    replay_model(trace, model)
    for k in (1, 2, 3):
        assert model.rates[k] == pytest.approx(TRUE_P[k], abs=0.04), k
    assert model.rates[8] == pytest.approx(TRUE_P[8], abs=0.08)


def test_censoring_correction_beats_counting_pending_as_ended():
    """Early in the stream many sessions have not come back *yet*: counting them as ended (LPC) biases the rate
    down; weighting them by the posterior that they are alive does not (much)."""
    trace = sessions_trace(600, seed=2, rate=2.0)  # fast arrivals: many pending sessions at any time
    cut = 400
    model = ContinuationModel(features=False)
    replay_model(trace, model, until=cut, window=25)
    model.update(float(trace.t[cut - 1]), (LognormalGaps(MU, SIGMA),) * 2)
    # LPC's count at the same point: sessions that reached turn 1, and those of them seen at turn 2 already
    turn, sid = trace.turn[:cut], trace.session[:cut]
    reached = np.sum(turn == 1)
    continued = len(set(sid[turn == 2].tolist()))
    lpc = (continued + 1) / (reached + 2)
    assert abs(model.rates[1] - TRUE_P[1]) < abs(lpc - TRUE_P[1])
    assert lpc < TRUE_P[1] - 0.15  # the bias is real here
    assert model.rates[1] == pytest.approx(TRUE_P[1], abs=0.1)


@pytest.mark.parametrize("growth", [0.0, 0.5])
@pytest.mark.parametrize("features", [False, True])
def test_never_reads_the_future(features, growth):
    trace = sessions_trace(150, seed=3)
    full = replay_model(trace, ContinuationModel(features=features, refit_growth=growth), window=10)
    for k in (1, 37, 50, 101, len(trace) // 2, len(trace) - 1):
        cut = trace.take(np.arange(k))
        assert replay_model(cut, ContinuationModel(features=features, refit_growth=growth), window=10) == full[:k], k


def refit_offers(model: ContinuationModel, offers: int) -> list[int]:
    """Offer ``offers`` updates: the offers (counted from the model's first) at which it refits."""
    return [model._offers for _ in range(offers) if model.update_due()]


def test_refit_schedule():
    """refit_growth=g: refit at an offer once the offers have grown by g since the last refit, at least every
    offer and at most MAX_REFIT_GAP apart; 0 refits at every offer."""
    assert refit_offers(ContinuationModel(), 50) == list(range(1, 51))
    assert refit_offers(ContinuationModel(refit_growth=0.5), 30) == [1, 2, 3, 4, 6, 9, 13, 19, 28]
    assert refit_offers(ContinuationModel(refit_growth=1.0), 40) == [1, 2, 4, 8, 16, 32]
    late = refit_offers(ContinuationModel(refit_growth=0.5), 1000)
    assert np.all(np.diff(late) <= MAX_REFIT_GAP) and np.all(np.diff(late)[-10:] == MAX_REFIT_GAP)


def test_refit_schedule_survives_export_and_import():
    trace = sessions_trace(20, seed=7)
    model = ContinuationModel(refit_growth=0.5)
    model.bind(trace)
    for i in range(len(trace)):
        model.arrive(i, float(trace.t[i]))
    assert refit_offers(model, 5) == [1, 2, 3, 4]
    copy = model.fresh()
    copy.import_state(model.export_state())
    assert refit_offers(copy, 25) == refit_offers(model, 25) == [6, 9, 13, 19, 28]


def test_between_refits_only_the_counts_move():
    """An offer that is not due changes nothing, while the arrivals before it moved the counts (and the rates); a due
    offer refits: the soft weights, the horizon's labels and beta."""
    trace = sessions_trace(120, seed=6)
    gaps = (LognormalGaps(MU, SIGMA),) * 2
    model = ContinuationModel(refit_growth=1.0, timed_refit=False)  # offers only (timed refits: tests below)
    model.bind(trace)
    due = set(refit_offers(ContinuationModel(refit_growth=1.0), len(trace)))  # 1, 2, 4, 8, 16, 32, 48, ...
    last = None
    for i in range(len(trace)):
        model.arrive(i, float(trace.t[i]))
        if i % 10 == 9:
            state = model.export_state()
            if last is not None:  # ten arrivals since the last offer: new pending requests, new rates
                assert not np.array_equal(last["pending"], state["pending"])
            model.update(float(trace.t[i]), gaps)
            last = model.export_state()
            if model._offers in due:
                assert any(not np.array_equal(state[k], last[k]) for k in ("beta", "pending_w")), model._offers
            else:
                for k in ("beta", "pending", "pending_w", "labelled", "rates", "alive"):
                    np.testing.assert_array_equal(state[k], last[k])
    assert model._offers == len(trace) // 10


def replay_as_saecache(trace: Trace, model: ContinuationModel, every: int = 64) -> list[float]:
    """Arrivals as SAECache's (sae_env.policies.arrivals) make them: an update offer every ``every``-th arrival, and
    an update at any arrival that finds the model stale; returns p_i."""
    gaps = (LognormalGaps(MU, SIGMA),) * 2
    model.bind(trace)
    out = []
    for k, now in enumerate(trace.t.tolist(), start=1):
        offer = k % every == 0
        if offer or model.stale(now, gaps):
            model.update(now, gaps, offer=offer)
        out.append(model.arrive(k - 1, now))
    return out


def test_a_stale_model_refreshes_without_an_offer():
    """With timed_refit the model refreshes (soft weights, ended labels, rates; not beta) at an arrival that finds its
    last refit more than exp(mu) back (the chat gaps' median), offer or not, and not before; without it, it moves
    only at the offers its schedule makes due."""
    trace = sessions_trace(60, seed=5)
    gaps = (LognormalGaps(MU, SIGMA),) * 2
    for timed in (True, False):
        model = ContinuationModel(timed_refit=timed)
        model.bind(trace)
        assert math.isnan(model.last_refit) and not model.stale(1e9, gaps)  # no clock before the first refit
        for i in range(40):
            model.arrive(i, float(trace.t[i]))
        t0 = float(trace.t[39])
        model.update(t0, gaps)  # the first offer: due
        assert model.last_refit == t0
        assert model.stale_after(gaps) == (math.exp(MU) if timed else math.inf)
        before = model.export_state()
        model.update(t0 + 0.99 * math.exp(MU), gaps, offer=False)
        after = model.export_state()
        for k in ("pending", "pending_w", "beta", "rates", "refit_t"):
            np.testing.assert_array_equal(before[k], after[k])
        later = t0 + 1.01 * math.exp(MU)
        assert model.stale(later, gaps) == timed
        model.update(later, gaps, offer=False)
        after = model.export_state()
        assert (model.last_refit == later) == timed
        moved = not np.array_equal(before["pending_w"], after["pending_w"])  # the idle ones' weights fell
        assert moved == timed
        np.testing.assert_array_equal(before["beta"], after["beta"])  # a refresh does not fit the correction


@pytest.mark.parametrize("end_below,censoring", [(0.01, True), (0.2, True), (0.0, True), (0.01, False)])
def test_a_pending_request_ends_below_its_posterior_or_past_the_horizon(end_below, censoring):
    trace = sessions_trace(200, seed=7, rate=1.0)
    gaps = (LognormalGaps(MU, SIGMA),) * 2
    model = ContinuationModel(features=False, end_below=end_below, censoring=censoring)
    model.bind(trace)
    for i in range(300):
        model.arrive(i, float(trace.t[i]))
    now = float(trace.t[299]) + 500.0  # the idle times span the horizon (602 s)
    before = model.export_state()
    pend, t_pend = before["pending"], before["pending_t"]
    r = before["rates"][np.minimum(np.maximum(trace.turn[pend], 1), model.max_turn)]
    surv = gaps[0].sf_array(now - t_pend)
    posterior = r * surv / (1.0 - r + r * surv)
    horizon = now - t_pend > gaps[0].upper(3.0)
    # below the bound (1 % where there is none: those stay pending), not yet past the horizon
    low = (posterior < max(end_below, 0.01)) & ~horizon
    want = horizon | low if censoring and end_below else horizon
    model.update(now, gaps)
    ended = ~np.isin(pend, model.export_state()["pending"])
    np.testing.assert_array_equal(ended, want)
    assert horizon.any() and low.any()  # each way of ending is exercised
    assert end_below > 0.1 or not want.all()  # and some stay pending


def test_posterior_end_keeps_fewer_pending_where_sessions_rarely_continue():
    """Sessions that mostly end after one request (a first-turn rate of 0.1): the posterior falls below 1 % long
    before the 3-sigma horizon, so far fewer requests wait there, and the first turn's rate stays near the truth."""
    trace = sessions_trace(1500, seed=8, rate=2.0, true_p={**TRUE_P, 1: 0.1})
    pending, rates = {}, {}
    for end_below in (0.0, 0.01):
        model = ContinuationModel(features=False, end_below=end_below)
        replay_model(trace, model, until=1000, window=25)  # mid-stream: sessions still starting
        model.update(float(trace.t[999]), (LognormalGaps(MU, SIGMA),) * 2)
        pending[end_below] = len(model.export_state()["pending"])
        rates[end_below] = model.rates[1]
    assert pending[0.01] < 0.6 * pending[0.0]
    assert rates[0.01] == pytest.approx(0.1, abs=0.03)
    assert abs(rates[0.01] - rates[0.0]) < 0.02


@pytest.mark.parametrize("seed", [0, 2, 5])
def test_timed_refits_keep_the_late_rates_honest_as_arrivals_thin_out(seed):
    """At the end of a trace no session starts and the open ones wind down: arrivals thin out. Refitting by the
    count of arrivals alone leaves every session that ended since the last refit counted as alive with the weight
    it had then, and the late turns' rates drift up (0.94-0.97 at turn 8+, truth 0.8); refitting on the clock as
    well keeps them near the truth."""
    trace = sessions_trace(200, seed=seed)
    truth = np.array([TRUE_P[k] for k in range(2, 9)])
    error = {}
    for timed in (False, True):
        model = ContinuationModel(features=False, refit_growth=0.5, timed_refit=timed)
        replay_as_saecache(trace, model)
        error[timed] = float(np.abs(model.rates[2:9] - truth).mean())
    assert error[False] > 0.06
    assert error[True] < 0.6 * error[False]


def test_features_of_a_request_ignore_later_requests():
    trace = sessions_trace(80, seed=4)
    model = ContinuationModel()
    model.bind(trace)
    k = len(trace) // 2
    other = ContinuationModel()
    other.bind(trace.take(np.arange(k)))
    np.testing.assert_array_equal(model.feature_rows(np.arange(k)), other.feature_rows(slice(0, k)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 60), window=st.integers(1, 20), features=st.booleans(),
       as_saecache=st.booleans())
def test_invariants(seed, n, window, features, as_saecache):
    """After any sequence of arrivals and updates (every ``window`` arrivals, or as SAECache offers them with its
    timed refreshes in between): probabilities and rates in (0, 1), and the per-turn counts agree with the pending
    set."""
    trace = sessions_trace(n, seed=seed, rate=1.0)
    model = ContinuationModel(features=features, refit_growth=0.5 if as_saecache else 0.0)
    ps = replay_as_saecache(trace, model, every=window) if as_saecache else replay_model(trace, model, window=window)
    assert all(0.0 < p < 1.0 for p in ps)
    assert np.all((model.rates > 0) & (model.rates < 1))
    buckets = [0] * (model.max_turn + 1)
    alive = [0.0] * (model.max_turn + 1)
    assert list(model._pend_t) == list(model._pend_w)
    for i, w in model._pend_w.items():
        k = model._bucket[i]
        buckets[k] += 1
        alive[k] += w
        assert 0.0 <= w <= 1.0
    assert buckets == model._n_pending
    np.testing.assert_allclose(alive, model._alive, atol=1e-9)
    assert sum(model._continued) + sum(model._ended) + len(model._pend_t) == len(trace)


def test_predictor_is_a_feature_of_first_requests():
    trace = sessions_trace(30, seed=5)
    asked = []

    def predictor(tr, i):
        asked.append(i)
        return (0.7, 0.1)

    model = ContinuationModel(predictor=predictor)
    model.bind(trace)
    first = np.flatnonzero(trace.turn == 1)
    assert sorted(asked) == first.tolist()
    z = model.feature_rows(slice(0, len(trace)))
    assert np.allclose(z[first, 8], math.log(0.8 / 0.2) / 5)
    assert not z[trace.turn > 1, 8].any()

    def bad(tr, i):
        return (0.9, 0.9)

    with pytest.raises(ValueError, match="probability"):
        ContinuationModel(predictor=bad).bind(trace)


@pytest.mark.parametrize("kwargs", [{"max_turn": 0}, {"max_turn": 2.5}, {"prior": (1.0, 0.0)},
                                    {"horizon_sigmas": 0.0}, {"l2": 0.0}, {"steps": 0}, {"steps": 1.5},
                                    {"steps": True}, {"refit_growth": -0.1}, {"refit_growth": True},
                                    {"refit_growth": float("nan")}, {"refit_growth": "0.5"}, {"end_below": -0.1},
                                    {"end_below": 0.5}, {"end_below": True}, {"end_below": "0.01"},
                                    {"end_below": float("nan")}])
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        ContinuationModel(**kwargs)


def reference_features(trace: Trace) -> np.ndarray:
    """The whole feature matrix computed at once, column by column, as the model computed it before it kept only
    per-request counts (the model's rows must be these floats, bit for bit: its fits read them)."""
    n = len(trace)
    sid = trace.session_ids()
    order = np.lexsort((np.arange(n), sid))
    prev = np.full(n, -1, dtype=np.int64)
    same = sid[order[1:]] == sid[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    has_prev = prev >= 0
    p_prev = np.where(has_prev, trace.prompt_tokens[np.maximum(prev, 0)], 0)
    gap = np.where(has_prev, trace.t - trace.t[np.maximum(prev, 0)], 0.0)
    offsets = trace.prompt_offsets
    n_blocks = np.maximum(np.diff(offsets), 1)

    def share(*types: TokenType) -> np.ndarray:
        flags = np.isin(trace.prompt_types, [int(t) for t in types])
        counts = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
        return (counts[offsets[1:]] - counts[offsets[:-1]]) / n_blocks

    z = np.zeros((n, 9))
    z[:, 0] = np.log1p(trace.prompt_tokens) / 10.0
    z[:, 1] = np.log1p(np.maximum(trace.prompt_tokens - p_prev, 0)) / 10.0
    z[:, 2] = np.log1p(np.maximum(gap, 0.0)) / 10.0
    z[:, 3] = share(TokenType.USER)
    z[:, 4] = share(TokenType.ASSISTANT)
    z[:, 5] = share(TokenType.TOOL_OUTPUT)
    z[:, 6] = share(TokenType.SYSTEM, TokenType.TEMPLATE)
    z[:, 7] = trace.app == AppType.AGENT
    return z


@pytest.mark.parametrize("name", ["wildchat", "taubench", "mooncake_arxiv", "real_agent", "real_templated"])
def test_feature_rows_equal_the_whole_matrix_bit_for_bit(name):
    from sae_env.sources import open_trace

    trace, _ = open_trace(name)
    model = ContinuationModel()
    model.bind(trace)
    ref = reference_features(trace)
    n = len(trace)
    np.testing.assert_array_equal(model.feature_rows(slice(0, n)), ref)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, n, size=min(n, 3000))  # gathered rows, as a fit asks for them
    np.testing.assert_array_equal(model.feature_rows(idx), ref[idx])
    for i in (0, n // 3, n - 5):  # blocks of rows, as p() asks for them
        np.testing.assert_array_equal(model.feature_rows(slice(i, i + 1024)) @ model.beta, ref[i:i + 1024] @ model.beta)


@settings(max_examples=60, deadline=None)
@given(buffer=st.integers(1, 40), fill=st.integers(0, 80), n_end=st.integers(0, 120))
def test_recording_many_labels_at_once_equals_one_at_a_time(buffer, fill, n_end):
    """The labelled buffer after ``_record_many`` holds what ``_record`` one at a time leaves, through any number of
    its truncations."""
    models = [ContinuationModel(buffer=buffer) for _ in range(2)]
    for m in models:  # an arbitrary fill, written through the one-at-a-time path
        for j in range(fill):
            m._record(j, float(j % 2))
    ended = np.arange(1000, 1000 + n_end, dtype=np.int64)
    for i in ended.tolist():
        models[0]._record(i, 0.0)
    models[1]._record_many(ended, 0.0)
    a, b = models
    assert a._lab_n == b._lab_n
    np.testing.assert_array_equal(a._lab_i[:a._lab_n], b._lab_i[:b._lab_n])
    np.testing.assert_array_equal(a._lab_y[:a._lab_n], b._lab_y[:b._lab_n])
