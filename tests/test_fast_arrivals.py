"""The compiled arrivals (sae_env.fast_engine.arrivals) against SAECache's Python arrivals, request for request.

The engines' differential tests (test_fast_saecache.py) compare whole replays; these compare what the arrivals
return per request and the state they leave, in windows of any size, with the corners a replay rarely reaches: the
labelled buffer trimmed (a small buffer), the pending arrays grown, refits and z @ beta blocks at window edges.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_saecache import session_traces

from sae_env.fast_engine import AVAILABLE
from sae_env.fast_engine.arrivals import REFIT, REFIT_T, STRUCTURAL, CompiledArrivals, compiled
from sae_env.policies.arrivals import Arrivals
from sae_env.policies.continuation import ContinuationModel
from sae_env.policies.saecache import PARAM_SPECS, gap_models
from sae_env.policies.survival import ExponentialGaps
from sae_env.sources import open_trace
from sae_env.trace import Trace

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

DEFAULTS = {s.name: s.default for s in PARAM_SPECS}


def arrivals_for(trace: Trace, buffer: int | None = None, **options) -> Arrivals:
    a = Arrivals(**options)
    if buffer is not None and a.model is not None:
        m = a.model
        a.model = ContinuationModel(features=m.features, censoring=m.censoring, buffer=buffer,
                                    timed_refit=m.timed_refit, end_below=m.end_below)
    gaps = gap_models(DEFAULTS)
    a.gaps = (gaps[2], gaps[3])
    a.bind(trace)
    return a


def python_rows(a: Arrivals, trace: Trace) -> list[tuple]:
    out = []
    for i, now in enumerate(trace.t.tolist()):
        q, slot, refit, structural = a.arrive(trace, i, now)
        out.append((q, slot, REFIT * refit + STRUCTURAL * structural, a.p_structural))
    return out


def compiled_rows(a: Arrivals, trace: Trace, cuts: list[int]) -> tuple[list[tuple], CompiledArrivals]:
    """The compiled arrivals over the windows between ``cuts``, saved into (and reloaded from) the Python objects
    between windows."""
    n = len(trace)
    q, slot, flags, pst = (np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int8),
                           np.zeros(n))
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    c = CompiledArrivals(a)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        c.run(lo, hi, q, slot, flags, pst)
        c = CompiledArrivals(c.save())
    return list(zip(q.tolist(), slot.tolist(), flags.tolist(), pst.tolist(), strict=True)), c


def same_state(x: dict, y: dict) -> None:
    assert x.keys() == y.keys()
    for k in x:
        np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]), err_msg=k)


@pytest.mark.parametrize("name", ["wildchat", "mooncake_arxiv", "mooncake_synthetic", "taubench", "bailian"])
def test_every_embedded_trace_gives_the_same_arrivals(name):
    trace, _ = open_trace(name)
    ref, fast = arrivals_for(trace), arrivals_for(trace)
    want = python_rows(ref, trace)
    got, c = compiled_rows(fast, trace, [len(trace) // 3, len(trace) // 3 + 1, 700])
    assert got == want
    assert sum(f & REFIT for _, _, f, _ in got) >= len(trace) // 64  # refits happened
    same_state(c.save().export_state(), ref.export_state())


def test_small_buffer_and_growth_give_the_same_arrivals():
    """A labelled buffer of 8 is trimmed every few labels; mooncake_synthetic keeps thousands of requests pending
    (more than the pending arrays first hold)."""
    trace, _ = open_trace("mooncake_synthetic")
    ref, fast = arrivals_for(trace, buffer=8), arrivals_for(trace, buffer=8)
    want = python_rows(ref, trace)
    got, c = compiled_rows(fast, trace, [1500])
    assert got == want
    assert c.state.pq_req.size > 1024  # grown
    same_state(c.save().export_state(), ref.export_state())


@settings(max_examples=40, deadline=None)
@given(trace=session_traces(max_requests=80), cuts=st.lists(st.integers(0, 80), max_size=4),
       options=st.fixed_dictionaries({"continuation": st.booleans(), "density": st.booleans(),
                                      "continuation_features": st.booleans(), "censoring": st.booleans(),
                                      "timed_refit": st.booleans(), "posterior_end": st.booleans(),
                                      "pe_routing": st.booleans(),
                                      "multi_queue": st.booleans()}),
       buffer=st.sampled_from([None, 2, 5]))
def test_random_traces_give_the_same_arrivals(trace, cuts, options, buffer):
    ref, fast = arrivals_for(trace, buffer, **options), arrivals_for(trace, buffer, **options)
    want = python_rows(ref, trace)
    got, c = compiled_rows(fast, trace, cuts)
    assert got == want
    same_state(c.save().export_state(), ref.export_state())
    assert c.arrivals.window_stats({}) == ref.window_stats({})


def test_pending_out_of_arrival_order_stays_in_python():
    """The pending arrays are searched by request index, so a state whose pending requests are not in arrival order
    (imported from another trace's replay) keeps the Python arrivals."""
    trace = open_trace("wildchat")[0][:50]
    a = arrivals_for(trace)
    python_rows(a, trace)
    assert compiled(a) is not None
    a.model._pend_t = dict(reversed(list(a.model._pend_t.items())))
    a.model._pend_w = dict(reversed(list(a.model._pend_w.items())))
    assert len(a.model._pend_t) > 1 and compiled(a) is None



def expected_refits(trace: Trace, growth: float, stale_after: float) -> list[float]:
    """When the continuation model refits, by its rule restated: at an update offer (every 64th arrival) that its
    ``refit_growth`` schedule makes due, or at any arrival more than ``stale_after`` after its last refit."""
    schedule, last, out = ContinuationModel(refit_growth=growth), math.nan, []
    for k, now in enumerate(trace.t.tolist(), start=1):
        due = k % 64 == 0 and schedule.update_due()
        if due or now - last > stale_after:
            out.append(now)
            last = now
    return out


def spied_reference(trace: Trace, **options) -> tuple[Arrivals, list[tuple[float, bool]]]:
    """Python arrivals whose model records each refit or refresh: (its time, whether it fits beta)."""
    ref = arrivals_for(trace, **options)
    refits: list[tuple[float, bool]] = []
    update_pending = ContinuationModel.update_pending

    def spy(model, now, *args, fit=True, **kw):
        refits.append((now, fit))
        return update_pending(model, now, *args, fit=fit, **kw)

    ref.model.update_pending = spy.__get__(ref.model)
    return ref, refits


def runs(values: list[float]) -> list[float]:
    """``values`` with each run of equal neighbours kept once (a time recorded after every request)."""
    return [v for k, v in enumerate(values) if k == 0 or v != values[k - 1]]


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("growth", [0.0, 0.5, 1.0])
def test_the_compiled_arrivals_settle_where_the_model_refits_and_hand_back_only_its_fits(growth, timed, monkeypatch):
    """run() counts the update offers itself and settles the pending requests where the model refits: at the offers
    its ``update_due`` says yes to (every offer at growth 0, 10 of mooncake_synthetic's 62 at 0.5) and, with
    ``timed_refit``, at the arrivals that find its last refit more than ``stale_after`` back: the same refits as
    the Python arrivals, at the same requests, and as the rule restated. It settles them in the kernel (a refresh
    never leaves it) and hands back to Python only the due refits' fits of beta."""
    trace, _ = open_trace("mooncake_synthetic")
    ref, ref_refits = spied_reference(trace, refit_growth=growth, timed_refit=timed)
    fast = arrivals_for(trace, refit_growth=growth, timed_refit=timed)
    fits = []
    fit = CompiledArrivals._fit

    def counted_fit(self, now):
        fits.append(now)
        return fit(self, now)

    monkeypatch.setattr(CompiledArrivals, "_fit", counted_fit)
    want = python_rows(ref, trace)
    n = len(trace)
    out = np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int8), np.zeros(n)
    c, settled = CompiledArrivals(fast), []
    for i in range(n):  # one request a call: the time of the last settling after each
        c.run(i, i + 1, *out)
        if not math.isnan(c.state.af[REFIT_T]):
            settled.append(float(c.state.af[REFIT_T]))
    assert list(zip(*[x.tolist() for x in out], strict=True)) == want
    assert runs(settled) == runs([t for t, _ in ref_refits]) == runs(
        expected_refits(trace, growth, ref.model.stale_after(ref.gaps)))
    assert fits == [t for t, due in ref_refits if due]
    schedule = ContinuationModel(refit_growth=growth)
    due = [k for k in range(len(trace) // 64) if schedule.update_due()]
    assert len(due) == (62 if growth == 0 else 10 if growth == 0.5 else 6)
    # refitting at every offer leaves no pause that long here; the sparser schedules' pauses add refits
    assert len(ref_refits) == len(due) + (0 if not timed or growth == 0 else 4 if growth == 0.5 else 6)
    same_state(c.save().export_state(), ref.export_state())


def test_gaps_other_than_log_normal_are_refused():
    """The kernel computes the log-normal survival itself, so the compiled arrivals refuse a model under other gaps
    (SAECache's exponential gaps, lognormal=False, have no compiled twin): a broken invariant, not a wrong number."""
    trace = open_trace("mooncake_synthetic")[0][:300]
    fast = arrivals_for(trace)
    fast.gaps = (ExponentialGaps(40.0), ExponentialGaps(20.0))
    n = len(trace)
    out = np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int8), np.zeros(n)
    with pytest.raises(RuntimeError, match="gaps must be log-normal, got ExponentialGaps"):
        CompiledArrivals(fast).run(0, n, *out)
