"""Serving model: roofline hand checks, calibration tables, the FIFO chunked-prefill server, the load factor."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.data import MOONCAKE_ARXIV
from sae_env.inputs import iter_json_lines
from sae_env.serving import (
    GPUS,
    MODELS,
    PRESETS,
    CalibrationTable,
    InstantServer,
    PrefillServer,
    RooflineCost,
    make_server,
    scale_to_utilisation,
    simulate,
    utilisation,
)

A40 = make_server("qwen2.5-1.5b@a40").cost
H200 = make_server("qwen2.5-1.5b@h200").cost


# -- presets and the roofline --------------------------------------------------------------------------------------


def test_qwen_preset_matches_its_architecture():
    m = MODELS["qwen2.5-1.5b"]
    # per layer: q (+bias), k, v (+bias, 2 KV heads of 128), o, gate/up/down (8960), two RMSNorms
    per_layer = 1536 * 1536 + 1536 + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert m.linear_params == 28 * per_layer + 1536 == 1_310_340_608
    assert m.params == 1_543_714_304  # "1.54 B" with the 151,936 x 1536 tied embedding
    assert m.kv_bytes_per_token == 28 * 1024 == 2 * m.layers * m.kv_heads * (m.hidden // m.heads) * m.dtype_bytes
    assert m.attn_dim == m.hidden
    assert GPUS["a40"].peak_flops == 149.7e12 and GPUS["a40"].mem_bandwidth == 696e9
    assert set(PRESETS) == {"qwen2.5-1.5b@a40", "qwen2.5-1.5b@h200"}


def test_hand_computed_roofline_a40_1000_tokens():
    # 2 * 1,310,340,608 * 1000 (non-embedding linear) + 4 * 28 * 1536 * (1000 * 1001 / 2) (causal attention)
    flops = 2 * 1_310_340_608 * 1000 + 4 * 28 * 1536 * 500_500
    assert flops == 2_706_783_232_000
    expected = flops / (149.7e12 * 0.5)  # compute-bound: 36.16 ms
    t = A40.prefill_time(1000, 0)
    assert t == pytest.approx(expected, rel=1e-12)
    assert t == pytest.approx(0.036, rel=0.01)  # the paper's "~36 ms"
    # the all-parameters count would not match it: 2 * 1.54e9 * 1000 / 74.85e12 = 41 ms (+ attention = 42.4 ms)
    assert 2 * MODELS["qwen2.5-1.5b"].params * 1000 / 74.85e12 > 1.1 * t
    # the memory side (weights 3.09 GB + KV at 348 GB/s) is 8.95 ms: the max picks compute
    assert A40.bytes_moved(1000, 0) / (696e9 * 0.5) == pytest.approx(0.008954, rel=1e-3)


def test_short_prefill_costs_the_weight_read_and_h200_is_faster():
    weights = 1_543_714_304 * 2 / (696e9 * 0.5)
    assert A40.prefill_time(1, 0) == pytest.approx(weights + 28672 * 1 / 348e9, rel=1e-12)
    assert A40.prefill_time(0, 500) == 0.0
    for n in (1, 100, 1000, 10_000):
        assert H200.prefill_time(n) < A40.prefill_time(n) / 5
    # efficiency scales both roofs
    full = RooflineCost(MODELS["qwen2.5-1.5b"], GPUS["a40"], efficiency=1.0)
    assert full.prefill_time(1000) == pytest.approx(A40.prefill_time(1000) / 2, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 200_000), a=st.integers(0, 200_000), b=st.integers(0, 200_000),
       preset=st.sampled_from(["qwen2.5-1.5b@a40", "qwen2.5-1.5b@h200"]))
def test_longer_cached_prefix_never_increases_prefill_time(total, a, b, preset):
    cost = make_server(preset).cost
    c1, c2 = sorted((min(a, total), min(b, total)))
    assert cost.prefill_time(total - c2, c2) <= cost.prefill_time(total - c1, c1)
    # and through the server, where a full hit is prefilled as one recomputed token
    t1 = simulate([0.0], [total - c1], [c1], server=preset)[0]
    t2 = simulate([0.0], [total - c2], [c2], server=preset)[0]
    assert t2 <= t1


def test_vectorised_prefill_times_match_scalar():
    rng = np.random.default_rng(1)
    n = rng.integers(0, 50_000, 500)
    c = rng.integers(0, 50_000, 500)
    ref = np.array([A40.prefill_time(int(x), int(y)) for x, y in zip(n, c, strict=True)])
    np.testing.assert_allclose(A40.prefill_times(n, c), ref, rtol=1e-12)
    with pytest.raises(ValueError):
        A40.prefill_times([-1], [0])
    with pytest.raises(ValueError):
        A40.prefill_time(-1, 0)


def _decode_loop(cost, out, ctx, batch):
    return sum(cost.decode_step_time(ctx + s, batch) for s in range(1, out))


@settings(max_examples=200, deadline=None)
@given(out=st.integers(0, 3000), ctx=st.integers(0, 200_000), batch=st.integers(1, 2048),
       eff=st.floats(0.05, 1.0))
def test_decode_closed_form_equals_step_loop(out, ctx, batch, eff):
    # large batches cross from memory- to compute-bound inside the sum: the split must be right
    cost = RooflineCost(MODELS["qwen2.5-1.5b"], GPUS["a40"], eff)
    assert cost.decode_time(out, ctx, batch) == pytest.approx(_decode_loop(cost, out, ctx, batch), rel=1e-9)


def test_decode_is_memory_bound_at_batch_one():
    step = A40.decode_step_time(1000)
    assert step == pytest.approx((1_543_714_304 * 2 + 28672 * 1000) / 348e9, rel=1e-12)  # 8.95 ms per token
    assert A40.decode_time(1, 1000) == 0.0  # the first token comes out of the prefill
    assert A40.decode_time(101, 1000) > 100 * step
    # a batch shares the weight read: per-request time drops
    assert A40.decode_time(101, 1000, batch=32) < 2 * A40.decode_time(101, 1000)


# -- the server ----------------------------------------------------------------------------------------------------


def test_chunking_20k_prompt_takes_three_iterations():
    srv = PrefillServer(A40, token_budget=8192)
    srv.submit("r", 0.0, 20_000, 0)
    (comp,) = srv.drain()
    assert srv.iterations == 3
    expected = (A40.batch_time([(8192, 0)]) + A40.batch_time([(8192, 8192)])
                + A40.batch_time([(20_000 - 2 * 8192, 2 * 8192)]))
    assert comp.t_first_token == pytest.approx(expected, rel=1e-12)
    assert comp.queue_delay == 0.0
    # chunking costs more than one pass (weights read three times) but the same FLOPs
    assert comp.t_first_token >= A40.prefill_time(20_000, 0)
    assert simulate([0.0], [20_000], [0], server={"preset": "qwen2.5-1.5b@a40", "token_budget": 20_000})[0] == \
        pytest.approx(A40.prefill_time(20_000, 0), rel=1e-12)


def test_hand_computed_two_requests():
    # both at t=0 share one iteration
    ttft = simulate([0.0, 0.0], [1000, 1000], [0, 0])
    both = A40.batch_time([(1000, 0), (1000, 0)])
    np.testing.assert_allclose(ttft, [both, both], rtol=1e-12)
    assert both == pytest.approx(2 * (2 * 1_310_340_608 * 1000 + 4 * 28 * 1536 * 500_500) / 74.85e12, rel=1e-12)
    # the second arrives 1 ms later, while the first runs: it waits for the end of the first pass
    one = A40.prefill_time(1000, 0)
    ttft = simulate([0.0, 0.001], [1000, 1000], [0, 0])
    np.testing.assert_allclose(ttft, [one, one - 0.001 + one], rtol=1e-12)
    # a budget of 1500 cuts the second request: [1000 + 500], then [500 after 500]
    srv = PrefillServer(A40, token_budget=1500)
    srv.submit(0, 0.0, 1000, 0)
    srv.submit(1, 0.0, 1000, 0)
    c0, c1 = srv.drain()
    e1 = A40.batch_time([(1000, 0), (500, 0)])
    assert (c0.t_first_token, c0.queue_delay) == (pytest.approx(e1, rel=1e-12), 0.0)
    assert c1.t_first_token == pytest.approx(e1 + A40.batch_time([(500, 500)]), rel=1e-12)
    assert c1.queue_delay == 0.0 and srv.iterations == 2


def test_max_num_seqs_limits_a_batch():
    srv = PrefillServer(A40, token_budget=8192, max_num_seqs=2)
    for i in range(5):
        srv.submit(i, 0.0, 10, 0)
    comps = srv.drain()
    assert srv.iterations == 3
    assert [c.req_id for c in comps] == [0, 1, 2, 3, 4]
    assert comps[1].t_first_token == comps[0].t_first_token < comps[2].t_first_token


def _reference_fifo(arr, new, cached, cost, budget, max_seqs):
    """A plain re-statement of chunked FIFO over arrays: returns (first-token time, first-chunk start)."""
    order = sorted(range(len(arr)), key=lambda i: (arr[i], i))
    rem = [max(x, 1) for x in new]
    ctx = [c - 1 if x == 0 and c > 0 else c for x, c in zip(new, cached, strict=True)]
    start = [None] * len(arr)
    ft = [None] * len(arr)
    free, ptr = -math.inf, 0
    while ptr < len(order):
        s = max(free, arr[order[ptr]])
        members, b, j = [], budget, ptr
        while j < len(order) and arr[order[j]] <= s and len(members) < max_seqs and b > 0:
            i = order[j]
            k = min(rem[i], b)
            members.append((i, k))
            b -= k
            j += 1
        e = s + cost.batch_time([(k, ctx[i]) for i, k in members])
        for i, k in members:
            rem[i] -= k
            ctx[i] += k
            start[i] = s if start[i] is None else start[i]
            if rem[i] == 0:
                ft[i] = e
        while ptr < len(order) and rem[order[ptr]] == 0:
            ptr += 1
        free = e
    return ft, start


requests = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5000), st.integers(0, 3000)), min_size=1,
                    max_size=30)


@settings(max_examples=150, deadline=None)
@given(reqs=requests, budget=st.integers(1, 6000), max_seqs=st.integers(1, 8), cuts=st.lists(st.integers(0, 60)))
def test_server_matches_reference_and_keeps_fifo(reqs, budget, max_seqs, cuts):
    arr = [r[0] * 0.01 for r in reqs]  # 10 ms grid: many ties and overlaps with ~9-40 ms passes
    new = [r[1] for r in reqs]
    cached = [r[2] for r in reqs]
    ft_ref, start_ref = _reference_fifo(arr, new, cached, A40, budget, max_seqs)
    # event API with arbitrary extra advance_to calls between arrivals
    srv = PrefillServer(A40, token_budget=budget, max_num_seqs=max_seqs)
    order = sorted(range(len(arr)), key=lambda i: (arr[i], i))
    extra = sorted(c * 0.01 for c in cuts)
    got, last_t = {}, -math.inf
    for i in order:
        while extra and extra[0] <= arr[i]:
            t = extra.pop(0)
            for c in srv.advance_to(t):
                assert last_t <= c.t_first_token <= t  # returned in time order, never from the future
                last_t = c.t_first_token
                got[c.req_id] = c
        for c in srv.advance_to(arr[i]):
            assert last_t <= c.t_first_token <= arr[i]
            last_t = c.t_first_token
            got[c.req_id] = c
        srv.submit(i, arr[i], new[i], cached[i])
    for c in srv.drain():
        assert c.t_first_token >= last_t
        last_t = c.t_first_token
        got[c.req_id] = c
    assert sorted(got) == list(range(len(arr)))
    for i in range(len(arr)):
        assert got[i].t_first_token == ft_ref[i]
        assert got[i].queue_delay == start_ref[i] - arr[i] >= 0
        # batching or chunking never beats prefilling the request alone on an idle GPU
        n, c = (new[i], cached[i]) if new[i] else (1, max(cached[i] - 1, 0))
        assert got[i].t_first_token - arr[i] >= A40.prefill_time(n, c) * (1 - 1e-12)
    # the FIFO guarantee: in arrival order, first-chunk starts and first-token times never decrease
    fts = [got[i].t_first_token for i in order]
    starts = [got[i].queue_delay + arr[i] for i in order]  # start - arrival + arrival: rounding, hence the slack
    assert fts == sorted(fts) and all(b >= a - 1e-12 for a, b in zip(starts, starts[1:], strict=False))
    np.testing.assert_array_equal(simulate(arr, new, cached, server=srv),
                                  np.array(ft_ref) - np.array(arr))
    # submitting everything up front, then draining, forms the same iterations (later arrivals wait their turn)
    srv.reset()
    for i in order:
        srv.submit(i, arr[i], new[i], cached[i])
    assert {c.req_id: c.t_first_token for c in srv.drain()} == dict(enumerate(ft_ref))


def test_ttft_grows_with_load_on_synthetic_requests():
    rng = np.random.default_rng(7)
    n_req = 3000
    new = np.clip(rng.lognormal(6.5, 1.2, n_req), 16, 30_000).astype(int)
    cached = (rng.random(n_req) < 0.5) * rng.integers(0, 8000, n_req)
    base = np.cumsum(rng.exponential(1.0, n_req))
    service = A40.prefill_times(new, cached)
    means = []
    for u in (0.1, 0.3, 0.5, 0.7, 0.9, 1.1):
        arr = scale_to_utilisation(base, service, u)
        assert utilisation(arr, service) == pytest.approx(u, rel=1e-9)
        means.append(simulate(arr, new, cached).mean())
    assert all(b >= a for a, b in zip(means, means[1:], strict=False)), means
    assert means[-1] > 5 * means[0], means


def _mooncake():
    rows = [o for _, o in iter_json_lines(MOONCAKE_ARXIV)]
    t = np.array([r["timestamp"] for r in rows], dtype=float) / 1e3
    n = np.array([r["input_length"] for r in rows])
    seen, cached = set(), []
    for r in rows:  # an infinite prefix cache: leading 512-token blocks seen before
        k = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            k += 1
        seen.update(r["hash_ids"])
        cached.append(min(k * 512, r["input_length"]))
    return t, n, np.array(cached)


def test_mooncake_excerpt_load_and_ttft():
    t, n, c = _mooncake()
    assert len(t) == 1000 and t[-1] == pytest.approx(177.098)
    assert c.sum() / n.sum() == pytest.approx(0.3907, abs=1e-4)  # cf. Mooncake's reported ~40 % for conversations
    # at its own pace the excerpt (9.79 M prompt tokens in 177 s) overloads one A40 3.7x without a cache; an H200
    # would be 56 % busy
    assert utilisation(t, A40.prefill_times(n, 0)) == pytest.approx(3.717, rel=1e-3)
    assert utilisation(t, H200.prefill_times(n, 0)) == pytest.approx(0.562, rel=1e-3)
    service = A40.prefill_times(n - c, c)
    means = [simulate(scale_to_utilisation(t, service, u), n - c, c).mean() for u in (0.1, 0.5, 0.9, 1.5)]
    assert all(b >= a for a, b in zip(means, means[1:], strict=False)) and means[-1] > 10 * means[0], means
    # caching helps at the same arrival times
    arr = scale_to_utilisation(t, service, 0.7)
    assert simulate(arr, n - c, c).mean() < 0.7 * simulate(arr, n, 0).mean()


def test_server_is_deterministic_and_reset_works():
    rng = np.random.default_rng(3)
    arr = np.sort(rng.uniform(0, 5, 400))
    new = rng.integers(0, 9000, 400)
    cached = rng.integers(0, 9000, 400)
    srv = make_server({"preset": "qwen2.5-1.5b@h200", "token_budget": 2048})
    a = simulate(arr, new, cached, server=srv)
    b = simulate(arr, new, cached, server=srv)  # the same instance, reset inside
    c = simulate(arr, new, cached, server={"preset": "qwen2.5-1.5b@h200", "token_budget": 2048})
    assert a.tobytes() == b.tobytes() == c.tobytes()
    assert np.all(np.isfinite(a)) and np.all(a > 0)
    # input order does not matter (requests are served in stable arrival order)
    perm = rng.permutation(400)
    np.testing.assert_array_equal(simulate(arr[perm], new[perm], cached[perm], server=srv), a[perm])


def test_submit_and_advance_reject_time_travel():
    srv = make_server("qwen2.5-1.5b@a40")
    srv.submit(0, 1.0, 100)
    with pytest.raises(ValueError, match="arrival"):
        srv.submit(1, 0.5, 100)
    srv.advance_to(2.0)
    with pytest.raises(ValueError, match="arrival"):
        srv.submit(2, 1.5, 100)
    with pytest.raises(ValueError, match="backwards"):
        srv.advance_to(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        srv.submit(3, 3.0, -1)
    # a request arriving exactly at an advance_to time still joins the iteration starting then
    srv = make_server("qwen2.5-1.5b@a40")
    srv.advance_to(5.0)
    srv.submit("a", 5.0, 1000)
    assert srv.advance_to(5.0) == []
    srv.submit("b", 5.0, 1000)
    ca, cb = srv.drain()
    assert ca.t_first_token == cb.t_first_token == pytest.approx(5.0 + A40.batch_time([(1000, 0)] * 2))
    with pytest.raises(ValueError):
        srv.submit("c", 5.0, 10)  # the drained iteration started at 5.0


def test_instant_server_returns_no_ttft():
    srv = make_server("instant")
    assert isinstance(srv, InstantServer) and not srv.timed
    srv.submit("x", 1.0, 5000, 0)
    srv.submit("y", 2.0, 5000, 0)
    assert srv.advance_to(0.5) == []
    (cx,) = srv.advance_to(1.5)
    assert cx.req_id == "x" and cx.t_first_token == 1.0 and math.isnan(cx.queue_delay)
    (cy,) = srv.drain()
    assert cy.req_id == "y"
    assert np.all(np.isnan(simulate([0.0, 1.0], [100, 100], [0, 0], server="instant")))
    assert srv.decode_time(100, 100) == 0.0
    assert make_server({"preset": "instant"}).timed is False


# -- make_server --------------------------------------------------------------------------------------------------


def test_make_server_specs_and_errors():
    srv = make_server({"preset": "qwen2.5-1.5b@a40", "efficiency": 0.25, "token_budget": 2048, "max_num_seqs": 64})
    assert isinstance(srv, PrefillServer) and srv.token_budget == 2048 and srv.max_num_seqs == 64
    assert srv.prefill_time(1000) == pytest.approx(2 * A40.prefill_time(1000), rel=1e-12)
    assert make_server(srv) is srv
    assert make_server("Qwen2.5-1.5B@H200").token_budget == 8192
    custom = make_server({"model": "qwen2.5-1.5b", "gpu": {"peak_flops": 149.7e12, "mem_bandwidth": 696e9}})
    assert custom.prefill_time(1000) == pytest.approx(A40.prefill_time(1000), rel=1e-12)
    with pytest.raises(ValueError, match=r"valid: \['instant', 'qwen2.5-1.5b@a40', 'qwen2.5-1.5b@h200'\]"):
        make_server("llama@a100")
    with pytest.raises(ValueError, match="unknown key"):
        make_server({"preset": "qwen2.5-1.5b@a40", "budget": 10})
    with pytest.raises(ValueError, match="efficiency"):
        make_server({"preset": "qwen2.5-1.5b@a40", "efficiency": 1.5})
    with pytest.raises(ValueError, match="token_budget"):
        make_server({"preset": "qwen2.5-1.5b@a40", "token_budget": 0})
    with pytest.raises(ValueError, match="no options"):
        make_server({"preset": "instant", "token_budget": 10})
    with pytest.raises(ValueError, match="needs"):
        make_server({"token_budget": 10})


# -- calibration tables -------------------------------------------------------------------------------------------


def test_calibration_1d_exact_at_points_and_monotone():
    xs = [128, 512, 1024, 4096, 16384]
    ts = [0.009, 0.012, 0.036, 0.15, 0.7]
    tab = CalibrationTable(xs, ts)
    for x, t in zip(xs, ts, strict=True):
        assert tab.prefill_time(x) == t
    assert tab.prefill_time(768) == pytest.approx(0.024)
    assert tab.prefill_time(10) == 0.009  # below the table: the first time
    assert tab.prefill_time(0) == 0.0
    assert tab.prefill_time(20000) == pytest.approx(0.7 + (0.7 - 0.15) / (16384 - 4096) * (20000 - 16384))
    grid = np.arange(0, 40_000, 7)
    v = tab.prefill_times(grid)
    assert np.all(np.diff(v) >= 0)
    np.testing.assert_allclose(v, [tab.prefill_time(int(g)) for g in grid], rtol=1e-12)
    assert tab.batch_time([(512, 0), (512, 0)]) == tab.prefill_time(1024)


@settings(max_examples=100, deadline=None)
@given(pts=st.lists(st.tuples(st.integers(1, 100_000), st.floats(1e-4, 10.0)), min_size=2, max_size=12,
                    unique_by=lambda p: p[0]),
       n1=st.integers(0, 200_000), n2=st.integers(0, 200_000))
def test_calibration_monotone_property(pts, n1, n2):
    xs = [p[0] for p in sorted(pts)]
    ts = sorted(p[1] for p in pts)  # a valid (non-decreasing) table
    tab = CalibrationTable(xs, ts)
    lo, hi = sorted((n1, n2))
    assert tab.prefill_time(lo) <= tab.prefill_time(hi)
    assert all(tab.prefill_time(x) == t for x, t in zip(xs, ts, strict=True))


def test_calibration_2d_bilinear():
    news, cached, ts = [], [], []
    for c, base in ((0, 0.0), (4096, 0.01), (16384, 0.05)):
        for n, t in ((256, 0.01), (1024, 0.04), (4096, 0.16)):
            news.append(n)
            cached.append(c)
            ts.append(t + base)
    tab = CalibrationTable(news, ts, cached)
    for n, c, t in zip(news, cached, ts, strict=True):
        assert tab.prefill_time(n, c) == pytest.approx(t, rel=1e-12)
    assert tab.prefill_time(640, 2048) == pytest.approx((0.025 + 0.035) / 2)
    assert tab.prefill_time(1024, 100_000) == pytest.approx(0.09)  # cached axis clamped
    n = np.array([100, 640, 1024, 5000, 9000])
    c = np.array([0, 2048, 10_000, 20_000, 4096])
    np.testing.assert_allclose(tab.prefill_times(n, c), [tab.prefill_time(a, b) for a, b in zip(n, c, strict=True)])
    # the batch is looked up at its token-weighted mean context
    assert tab.batch_time([(512, 0), (512, 8192)]) == pytest.approx(tab.prefill_time(1024, 4096))
    with pytest.raises(ValueError, match="full grid"):
        CalibrationTable(news[:-1], ts[:-1], cached[:-1])


def test_calibration_rejects_bad_tables_naming_the_row(tmp_path):
    with pytest.raises(ValueError, match=r"point 2: time 0.01 s at new_tokens=1024 is below 0.02"):
        CalibrationTable([256, 512, 1024], [0.01, 0.02, 0.01])
    with pytest.raises(ValueError, match="point 1.*positive"):
        CalibrationTable([256, 512], [0.01, 0.0])
    with pytest.raises(ValueError, match="point 1.*finite"):
        CalibrationTable([256, 512], [0.01, float("nan")])
    with pytest.raises(ValueError, match="duplicate"):
        CalibrationTable([256, 256], [0.01, 0.02])
    p = tmp_path / "bad.csv"
    p.write_text("# measured on a40\nnew_tokens,cached_tokens,time_ms\n256,0,10\n1024,0,40\n"
                 "256,4096,12\n1024,4096,11\n")
    with pytest.raises(ValueError, match=r"bad.csv: line 6: time 0.011 s at new_tokens=1024, cached_tokens=4096"):
        CalibrationTable.load(p)
    p.write_text("new_tokens,time_s\n256,0.01\n512,abc\n")
    with pytest.raises(ValueError, match=r"line 3: field 'time_s'"):
        CalibrationTable.load(p)
    p.write_text("new_tokens,tme_s\n256,0.01\n")
    with pytest.raises(ValueError, match="unknown field"):
        CalibrationTable.load(p)


def test_calibration_files_load_alike(tmp_path):
    rows = [{"new_tokens": 256, "time_s": 0.01}, {"new_tokens": 1024, "time_s": 0.04},
            {"new_tokens": 8192, "time_s": 0.3}]
    (tmp_path / "t.csv").write_text("new_tokens,time_s\n" + "".join(f"{r['new_tokens']},{r['time_s']}\n"
                                                                    for r in rows))
    (tmp_path / "t.json").write_text(json.dumps({"points": rows, "decode_step_s": 0.006}))
    (tmp_path / "t.yaml").write_text("decode_step_s: 0.006\npoints:\n" + "".join(
        f"  - {{new_tokens: {r['new_tokens']}, time_s: {r['time_s']}}}\n" for r in rows))
    tabs = [CalibrationTable.load(tmp_path / f) for f in ("t.csv", "t.json", "t.yaml")]
    for x in (100, 256, 700, 1024, 5000, 20_000):
        assert tabs[0].prefill_time(x) == tabs[1].prefill_time(x) == tabs[2].prefill_time(x)
    assert tabs[1].decode_time(11, 500) == pytest.approx(0.06)
    with pytest.raises(ValueError, match="no decode timing"):
        tabs[0].decode_time(11, 500)
    srv = make_server({"calibration": str(tmp_path / "t.csv"), "preset": "qwen2.5-1.5b@a40", "token_budget": 512})
    assert srv.decode_time(11, 500) == A40.decode_time(11, 500)
    assert srv.prefill_time(700) == tabs[0].prefill_time(700)
    ttft = simulate([0.0], [1024], [0], server=srv)[0]  # two 512-token passes, the second after 512 of context
    assert ttft == pytest.approx(2 * tabs[0].prefill_time(512))
    with pytest.raises(ValueError, match="unknown calibration format"):
        CalibrationTable.load(tmp_path / "nothing.txt")


# -- load factor --------------------------------------------------------------------------------------------------


def test_utilisation_and_scaling():
    arr = np.array([10.0, 11.0, 15.0, 30.0])
    svc = np.array([1.0, 2.0, 1.0, 1.0])
    assert utilisation(arr, svc) == pytest.approx(5 / 20)
    scaled = scale_to_utilisation(arr, svc, 0.5)
    np.testing.assert_allclose(scaled, [10.0, 10.5, 12.5, 20.0])
    assert utilisation(scaled, svc) == pytest.approx(0.5)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            scale_to_utilisation(arr, svc, bad)
    with pytest.raises(ValueError, match="span"):
        utilisation([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        utilisation(arr, svc[:3])


def test_server_is_fast_enough_for_long_replays():
    import time

    rng = np.random.default_rng(0)
    n_req = 50_000
    arr = np.cumsum(rng.exponential(0.02, n_req))
    new = rng.integers(1, 2000, n_req)
    cached = rng.integers(0, 2000, n_req)
    t0 = time.perf_counter()
    simulate(arr, new, cached)
    assert time.perf_counter() - t0 < 5.0  # ~6 us per request here; millions of requests stay in seconds
