"""Tests of sae_env.characterize: a differential check against a slow, obviously-correct reference on random
traces, a hand-computed example, gap-fit recovery, and the figures."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from sae_env.characterize import characterize, format_table, offset_bucket, session_gaps, write_plots
from sae_env.plots import plot_gap_histograms
from sae_env.trace import AppType, TokenType, Trace, TraceBuilder

BS = 4


# ----------------------------------------------------------------------------------------------------------------
# Reference: a per-request loop over dicts, written straight from the definitions in the module docstring.


def _ks(x: np.ndarray, cdf) -> float:
    x = np.sort(x)
    n = x.size
    f = cdf(x)
    i = np.arange(1, n + 1)
    return float(max((i / n - f).max(), (f - (i - 1) / n).max()))


def _ref_fit(gaps: list[float]) -> dict:
    pos = np.array([g for g in gaps if g > 0], dtype=float)
    res = {"n": int(pos.size), "zero_gaps": sum(1 for g in gaps if g == 0),
           "mean_s": float(pos.mean()) if pos.size else None,
           "median_s": float(np.median(pos)) if pos.size else None,
           "lognormal_mu": None, "lognormal_sigma": None, "exponential_rate": None, "ks_lognormal": None,
           "ks_exponential": None, "loglik_lognormal": None, "loglik_exponential": None, "better": None}
    if pos.size < 2:
        return res
    n = pos.size
    mu = sum(math.log(g) for g in pos) / n
    sigma = math.sqrt(sum((math.log(g) - mu) ** 2 for g in pos) / n)
    rate = n / sum(pos)
    res.update(lognormal_mu=mu, lognormal_sigma=sigma, exponential_rate=rate,
               ks_exponential=_ks(pos, lambda x: 1 - np.exp(-rate * x)),
               loglik_exponential=sum(math.log(rate) - rate * g for g in pos))
    if sigma > 0:
        res["ks_lognormal"] = _ks(pos, lambda x: stats.norm.cdf((np.log(x) - mu) / sigma))
        res["loglik_lognormal"] = sum(-math.log(g * sigma * math.sqrt(2 * math.pi))
                                      - (math.log(g) - mu) ** 2 / (2 * sigma**2) for g in pos)
        res["better"] = "lognormal" if res["loglik_lognormal"] > res["loglik_exponential"] else "exponential"
    return res


def reference(trace: Trace) -> dict:
    n = len(trace)
    sid = trace.session_ids()
    reqs = []  # per request: list of (key, type, prompt offset or None)
    for i in range(n):
        pk, pt = trace.prompt_blocks(i)
        ok, ot = trace.output_blocks(i)
        occ = [(int(k), int(t), j) for j, (k, t) in enumerate(zip(pk, pt, strict=True))]
        occ += [(int(k), int(t), None) for k, t in zip(ok, ot, strict=True)]
        reqs.append(occ)
    prompt_reqs = defaultdict(list)  # key -> requests whose prompt holds it (with repeats)
    for i, occ in enumerate(reqs):
        for k, _, j in occ:
            if j is not None:
                prompt_reqs[k].append(i)

    def later_prompt_refs(k: int, i: int) -> int:
        return sum(1 for r in prompt_reqs[k] if r > i)

    last = {}  # key -> most recent earlier request holding it
    hits = intra = 0
    groups = {"by_token_type": defaultdict(lambda: defaultdict(int)), "by_app": defaultdict(lambda: defaultdict(int))}
    first_seen = {"by_token_type": {}, "by_app": {}}  # (label, key) -> first request
    offs = defaultdict(lambda: defaultdict(int))
    for i, occ in enumerate(reqs):
        app = AppType(int(trace.app[i])).name
        for k, t, j in occ:
            fwd = later_prompt_refs(k, i) > 0
            hit = k in last
            for gname, label in (("by_token_type", TokenType(t).name), ("by_app", app)):
                g = groups[gname][label]
                g["refs"] += 1
                g["fwd"] += fwd
                if j is not None:
                    g["prefs"] += 1
                    g["hits"] += hit
                first_seen[gname].setdefault((label, k), i)
            if j is not None:
                b = 0 if j == 0 else int(math.floor(math.log2(j))) + 1
                offs[b]["refs"] += 1
                offs[b]["hits"] += hit
                offs[b]["fwd"] += fwd
                if hit:
                    hits += 1
                    intra += sid[last[k]] == sid[i]
        for k, _, _ in occ:
            last[k] = i

    def table(gname: str) -> dict:
        out = {}
        for label, g in groups[gname].items():
            keys = [(k, f) for (lab, k), f in first_seen[gname].items() if lab == label]
            out[label] = {"block_refs": g["refs"], "prompt_refs": g["prefs"], "distinct_blocks": len(keys),
                          "reuse_ratio": g["fwd"] / g["refs"],
                          "hit_ratio": g["hits"] / g["prefs"] if g["prefs"] else None,
                          "reuses_per_block": sum(later_prompt_refs(k, f) for k, f in keys) / len(keys)}
        return out

    by_offset = []
    for b in range(max(offs) + 1 if offs else 0):
        lo, hi = (0, 0) if b == 0 else (2 ** (b - 1), 2**b - 1)
        o = offs[b]
        by_offset.append({"bucket": str(lo) if lo == hi else f"{lo}-{hi}", "lo": lo, "hi": hi, "refs": o["refs"],
                          "hit_ratio": o["hits"] / o["refs"], "reuse_ratio": o["fwd"] / o["refs"]})

    times = defaultdict(list)  # session -> [(t, request)]
    for i in range(n):
        times[int(sid[i])].append((float(trace.t[i]), i))
    gaps = defaultdict(list)
    for lst in times.values():
        lst.sort()
        for (t0, _), (t1, i1) in zip(lst, lst[1:], strict=False):
            gaps[AppType(int(trace.app[i1])).name].append(t1 - t0)

    keys = set()
    for occ in reqs:
        keys.update(k for k, _, _ in occ)
    return {
        "source": trace.meta.get("source"), "requests": n, "sessions": len(set(sid.tolist())),
        "block_size": trace.block_size, "duration_s": float(trace.t[-1] - trace.t[0]) if n else 0.0,
        "block_refs": sum(1 for occ in reqs for _, _, j in occ if j is not None),
        "output_blocks": sum(1 for occ in reqs for _, _, j in occ if j is None),
        "distinct_blocks": len(keys), "hits": hits,
        "reuse_ratio": hits / trace.n_blocks if trace.n_blocks else None,
        "by_token_type": table("by_token_type"), "by_app": table("by_app"), "by_offset": by_offset,
        "intra_session_fraction": intra / hits if hits else None,
        "cross_session_fraction": (hits - intra) / hits if hits else None,
        "gaps": {app: _ref_fit(g) for app, g in gaps.items()},
    }


def assert_same(got, want, path="result"):
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float), f"{path}: {got!r} is not a float"
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), f"{path}: {got} != {want}"
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


# ----------------------------------------------------------------------------------------------------------------
# Random traces


@st.composite
def traces(draw) -> Trace:
    n = draw(st.integers(0, 25))
    pool = draw(st.integers(1, 10))
    n_sessions = draw(st.integers(1, 5))
    b = TraceBuilder(block_size=BS, meta={"source": "hypothesis"})
    t = 0.0
    for _ in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5, 7.0, 30.0]))
        np_ = draw(st.integers(0, 9))
        no = draw(st.integers(0, 3))
        keys = st.integers(0, pool - 1)
        ty = st.integers(0, len(TokenType) - 1)
        b.add(t=t, session=draw(st.integers(-1, n_sessions - 1)), turn=1, app=draw(st.integers(0, len(AppType) - 1)),
              prompt_tokens=np_ * BS + draw(st.integers(0, BS - 1)), output_tokens=no * BS,
              prompt_keys=draw(st.lists(keys, min_size=np_, max_size=np_)),
              prompt_types=draw(st.lists(ty, min_size=np_, max_size=np_)),
              output_keys=draw(st.lists(keys, min_size=no, max_size=no)),
              output_types=draw(st.lists(ty, min_size=no, max_size=no)))
    return b.build()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_matches_reference(trace):
    got = characterize(trace)
    assert_same(got, reference(trace))
    json.dumps(got, allow_nan=False)


def _hand_trace() -> Trace:
    b = TraceBuilder(block_size=BS, meta={"source": "hand"})
    b.add(t=0, session=1, turn=1, app=AppType.CHAT, prompt_tokens=12, output_tokens=8, prompt_keys=[1, 2, 3],
          prompt_types=[0, 2, 2], output_keys=[4, 5], output_types=[5, 3])
    b.add(t=5, session=1, turn=2, app=AppType.CHAT, prompt_tokens=16, output_tokens=8, prompt_keys=[1, 2, 5, 6],
          prompt_types=[0, 2, 3, 2], output_keys=[7], output_types=[3])
    b.add(t=6, session=2, turn=1, app=AppType.AGENT, prompt_tokens=16, output_tokens=0, prompt_keys=[1, 9, 9, 6],
          prompt_types=[0, 1, 1, 2])
    b.add(t=16, session=1, turn=3, app=AppType.CHAT, prompt_tokens=16, output_tokens=0, prompt_keys=[1, 2, 5, 6],
          prompt_types=[0, 2, 3, 2])
    b.add(t=17, session=1, turn=4, app=AppType.CHAT, prompt_tokens=16, output_tokens=0, prompt_keys=[1, 2, 5, 6],
          prompt_types=[0, 2, 3, 2])
    return b.build()


def test_hand_computed_example():
    r = characterize(_hand_trace())
    # Hits: request 1 -> 1, 2, 5 (5 is request 0's output); request 2 -> 1, 6 (the repeated 9 is not a hit);
    # requests 3 and 4 -> all four. 13 of 19 prompt refs.
    assert (r["requests"], r["sessions"], r["block_refs"], r["output_blocks"]) == (5, 2, 19, 3)
    assert r["distinct_blocks"] == 8
    assert r["hits"] == 13 and r["reuse_ratio"] == pytest.approx(13 / 19)
    # Cross-session hits: request 2's 1 and 6 (from session 1), request 3's 1 and 6 (last seen in session 2).
    assert r["cross_session_fraction"] == pytest.approx(4 / 13)
    assert r["intra_session_fraction"] == pytest.approx(9 / 13)
    reasoning = r["by_token_type"]["REASONING"]  # key 4, output only, never prompted again
    assert reasoning == {"block_refs": 1, "prompt_refs": 0, "distinct_blocks": 1, "reuse_ratio": 0.0,
                         "hit_ratio": None, "reuses_per_block": 0.0}
    assistant = r["by_token_type"]["ASSISTANT"]  # key 5 (output of 0, prompt of 1, 3, 4) and key 7 (output of 1)
    assert assistant["block_refs"] == 5 and assistant["reuse_ratio"] == pytest.approx(3 / 5)
    assert assistant["hit_ratio"] == 1.0 and assistant["reuses_per_block"] == pytest.approx((3 + 0) / 2)
    assert r["by_token_type"]["SYSTEM"]["reuses_per_block"] == 4.0
    assert [o["bucket"] for o in r["by_offset"]] == ["0", "1", "2-3"]
    assert [o["refs"] for o in r["by_offset"]] == [5, 5, 9]
    assert r["gaps"]["CHAT"]["n"] == 3 and "AGENT" not in r["gaps"]
    assert r["gaps"]["CHAT"]["exponential_rate"] == pytest.approx(3 / 17)


def test_offset_bucket():
    j = np.array([0, 1, 2, 3, 4, 7, 8, 15, 16, 1023, 1024, 2**40 - 1, 2**40])
    assert offset_bucket(j).tolist() == [0, 1, 2, 2, 3, 3, 4, 4, 5, 10, 11, 40, 41]


def test_empty_trace():
    r = characterize(TraceBuilder(block_size=BS).build())
    assert r["requests"] == 0 and r["block_refs"] == 0 and r["reuse_ratio"] is None
    assert r["by_token_type"] == {} and r["by_offset"] == [] and r["gaps"] == {}
    assert r["intra_session_fraction"] is None
    json.dumps(r, allow_nan=False)
    assert "requests: 0" in format_table(r)


# ----------------------------------------------------------------------------------------------------------------
# Gap fits


def _session_trace(rng: np.random.Generator, apps: dict[AppType, callable], n_sessions: int, turns: int) -> Trace:
    """Sessions of ``turns`` requests whose gaps are drawn by ``apps[app](size)``; starts spread over a day."""
    b = TraceBuilder(block_size=BS, meta={"source": "gaps"})
    sid = 0
    for app, draw in apps.items():
        for _ in range(n_sessions):
            t = rng.uniform(0, 86400)
            for k in range(turns):
                b.add(t=t, session=sid, turn=k + 1, app=app, prompt_tokens=BS, output_tokens=0,
                      prompt_keys=[sid * 1000 + k], prompt_types=[TokenType.USER])
                if k < turns - 1:
                    t += float(draw(1)[0])
            sid += 1
    return b.build()


def test_lognormal_mle_recovers_parameters():
    rng = np.random.default_rng(7)
    truth = {AppType.CHAT: (3.5, 1.2), AppType.AGENT: (0.8, 0.5)}
    trace = _session_trace(rng, {a: (lambda size, m=m, s=s: rng.lognormal(m, s, size)) for a, (m, s) in
                                 truth.items()}, n_sessions=300, turns=6)
    r = characterize(trace)
    for app, (mu, sigma) in truth.items():
        g = r["gaps"][app.name]
        assert g["n"] == 300 * 5 and g["zero_gaps"] == 0
        assert g["lognormal_mu"] == pytest.approx(mu, rel=0.1)
        assert g["lognormal_sigma"] == pytest.approx(sigma, rel=0.1)
        assert g["better"] == "lognormal"
        assert g["ks_lognormal"] < g["ks_exponential"]
    assert set(session_gaps(trace)) == {"CHAT", "AGENT"}


def test_exponential_wins_on_exponential_gaps():
    rng = np.random.default_rng(11)
    trace = _session_trace(rng, {AppType.CHAT: lambda size: rng.exponential(20.0, size)}, n_sessions=300, turns=5)
    g = characterize(trace)["gaps"]["CHAT"]
    assert g["better"] == "exponential"
    assert g["loglik_exponential"] > g["loglik_lognormal"]
    assert g["exponential_rate"] == pytest.approx(1 / 20.0, rel=0.1)
    assert g["ks_exponential"] < g["ks_lognormal"]


def test_zero_gaps_and_degenerate_fits():
    b = TraceBuilder(block_size=BS)
    for k, t in enumerate([0.0, 0.0, 3.0, 6.0]):  # gaps 0, 3, 3: sigma = 0
        b.add(t=t, session=4, turn=k + 1, app=AppType.AGENT, prompt_tokens=0, output_tokens=0, prompt_keys=[],
              prompt_types=[])
    b.add(t=7.0, session=-1, turn=1, app=AppType.CHAT, prompt_tokens=0, output_tokens=0, prompt_keys=[],
          prompt_types=[])
    b.add(t=8.0, session=-1, turn=1, app=AppType.CHAT, prompt_tokens=0, output_tokens=0, prompt_keys=[],
          prompt_types=[])
    r = characterize(b.build())
    assert r["sessions"] == 3  # the two unknown sessions are distinct
    g = r["gaps"]["AGENT"]
    assert (g["n"], g["zero_gaps"], g["lognormal_sigma"], g["exponential_rate"]) == (2, 1, 0.0, pytest.approx(1 / 3))
    assert g["ks_lognormal"] is None and g["loglik_lognormal"] is None and g["better"] is None
    assert "CHAT" not in r["gaps"]
    json.dumps(r, allow_nan=False)


# ----------------------------------------------------------------------------------------------------------------
# Output: table and figures


def test_format_table_is_aligned():
    r = characterize(_hand_trace())
    text = format_table(r)
    for name in ("SYSTEM", "REASONING", "CHAT", "AGENT", "2-3", "68.4%"):
        assert name in text
    blocks = [blk.splitlines() for blk in text.split("\n\n")[1:]]
    for lines in blocks:
        assert len({len(line) for line in lines}) == 1, lines  # every row of a table has the same width


def test_plots_written(tmp_path):
    rng = np.random.default_rng(3)
    trace = _session_trace(rng, {AppType.CHAT: lambda size: rng.lognormal(2, 1, size),
                                 AppType.AGENT: lambda size: rng.exponential(5, size)}, n_sessions=40, turns=4)
    paths = write_plots(characterize(trace), trace, tmp_path / "figs")
    assert [p.name for p in paths] == ["reuse_by_token_type.png", "reuse_by_app.png", "hit_by_offset.png",
                                       "gap_histograms.png"]
    for p in paths:
        assert p.stat().st_size > 2000
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A trace without any session gap still gets its (empty) gap figure.
    one = _hand_trace()[2:3]
    p = plot_gap_histograms(characterize(one), session_gaps(one), tmp_path / "one")
    assert p.stat().st_size > 2000


# ----------------------------------------------------------------------------------------------------------------
# Throughput (benchmark-ish, not a timed assertion)


def _big_trace(rng: np.random.Generator, n_req: int = 40_000, mean_blocks: int = 25) -> Trace:
    """~1 M prompt references: shared system heads, per-session histories and fresh user tails, with outputs."""
    p_len = rng.integers(1, 2 * mean_blocks, n_req)
    o_len = rng.integers(0, 4, n_req)
    n_p, n_o = int(p_len.sum()), int(o_len.sum())
    keys = rng.integers(0, n_p // 3, n_p)  # a third as many keys as refs: plenty of reuse
    keys[np.cumsum(p_len) - p_len] = rng.integers(0, 20, n_req)  # first blocks: 20 shared system prompts
    p_off = np.concatenate([[0], np.cumsum(p_len)])
    o_off = np.concatenate([[0], np.cumsum(o_len)])
    return Trace(t=np.sort(rng.uniform(0, 3600, n_req)), session=rng.integers(-1, n_req // 5, n_req),
                 turn=np.ones(n_req), app=rng.integers(0, len(AppType), n_req), prompt_tokens=p_len * BS,
                 output_tokens=o_len * BS, prompt_offsets=p_off, prompt_keys=keys,
                 prompt_types=rng.integers(0, len(TokenType), n_p), output_offsets=o_off,
                 output_keys=rng.integers(0, n_p, n_o), output_types=np.full(n_o, TokenType.REASONING),
                 block_size=BS, meta={"source": "bench"})


@pytest.mark.slow
def test_throughput_on_a_million_refs(capsys):
    trace = _big_trace(np.random.default_rng(0))
    t0, c0 = time.perf_counter(), time.process_time()
    r = characterize(trace)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = trace.n_blocks + trace.n_output_blocks
    with capsys.disabled():
        print(f"\ncharacterize: {trace.n_blocks} prompt refs + {trace.n_output_blocks} output blocks in {dt:.2f} s "
              f"wall, {dc:.2f} s CPU = {n / dt / 1e6:.2f} M blocks/s (wall), {n / dc / 1e6:.2f} M blocks/s (CPU)")
    assert trace.n_blocks > 900_000
    assert sum(d["block_refs"] for d in r["by_token_type"].values()) == n
    assert sum(d["prompt_refs"] for d in r["by_app"].values()) == trace.n_blocks
    assert sum(o["refs"] for o in r["by_offset"]) == trace.n_blocks
    # The infinite-cache hit ratio from a plain first-occurrence computation over the stream.
    first_req = {}
    for i in range(len(trace)):
        for k in trace.output_blocks(i)[0].tolist() + trace.prompt_blocks(i)[0].tolist():
            first_req.setdefault(k, i)
    req = np.repeat(np.arange(len(trace)), np.diff(trace.prompt_offsets))
    hits = sum(first_req[k] < i for k, i in zip(trace.prompt_keys.tolist(), req.tolist(), strict=True))
    assert r["hits"] == hits
