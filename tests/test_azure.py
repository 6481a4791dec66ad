"""The Azure 2023 source: the arrival-and-length process measured on both CSVs, its samplers, the no-reuse
Trace, and bad input."""

import datetime as dt
import gzip
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.data import AZURE_CODE, AZURE_CONV, MOONCAKE_ARXIV
from sae_env.sources import azure, load_source, mooncake
from sae_env.trace import AppType, TokenType, Trace, TraceFormatError

SHARED = Path("/work/shared/data/azure_llm_2023")
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.fixture(scope="module")
def conv():
    return azure.load_process(AZURE_CONV)


@pytest.fixture(scope="module")
def code():
    return azure.load_process(AZURE_CODE)


def _ref(path):
    """Plain-Python reference parse: (seconds since the first row, context, generated)."""
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()[1:]
    stamps, ctx, gen = [], [], []
    for line in lines:
        ts, c, g = line.split(",")
        base, frac = ts.split(".")
        stamps.append(dt.datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp() * 1e9 + int(frac.ljust(9, "0")))
        ctx.append(int(c))
        gen.append(int(g))
    t = (np.array(stamps, dtype=np.float64) - stamps[0]) / 1e9
    return t, np.array(ctx), np.array(gen)


@pytest.mark.parametrize("which", ["conv", "code"])
def test_parse_matches_reference(which, conv, code):
    proc, path = (conv, AZURE_CONV) if which == "conv" else (code, AZURE_CODE)
    t, ctx, gen = _ref(path)
    assert np.allclose(proc.t, t, atol=1e-6, rtol=0)
    assert np.array_equal(proc.context_tokens, ctx) and np.array_equal(proc.generated_tokens, gen)


def test_measured_facts(conv, code):
    assert len(conv) == 19366 and len(code) == 8819
    assert conv.start == "2023-11-16T18:15:46.680590000" and code.start == "2023-11-16T18:17:03.979960000"
    assert conv.duration == pytest.approx(3501.721937) and code.duration == pytest.approx(3435.948056)
    assert conv.rate == pytest.approx(5.5301, abs=1e-4) and code.rate == pytest.approx(2.5664, abs=1e-4)
    assert conv.context_tokens.mean() == pytest.approx(1154.70, abs=0.01)
    assert code.context_tokens.mean() == pytest.approx(2047.85, abs=0.01)
    assert conv.generated_tokens.mean() == pytest.approx(211.13, abs=0.01)
    assert code.generated_tokens.mean() == pytest.approx(27.88, abs=0.01)
    # Burstiness: the code service's gaps are far burstier (coefficient of variation 13 vs 1.1).
    cv = [np.diff(p.t).std() / np.diff(p.t).mean() for p in (conv, code)]
    assert cv[0] == pytest.approx(1.094, abs=1e-3) and cv[1] == pytest.approx(13.15, abs=0.01)
    for p in (conv, code):
        assert p.t[0] == 0 and (np.diff(p.t) > 0).all() and p.report.rows_rejected == 0


def test_embedded_and_shared_copies_agree(conv):
    plain = azure.load_process(SHARED / "AzureLLMInferenceTrace_conv.csv")
    assert np.array_equal(plain.t, conv.t) and np.array_equal(plain.context_tokens, conv.context_tokens)
    a, _ = azure.load(SHARED / "AzureLLMInferenceTrace_code.csv")
    b, _ = load_source("azure", AZURE_CODE)
    assert a.equals(b)


def test_trace_is_a_no_reuse_baseline(conv, tmp_path):
    trace, report = azure.load(AZURE_CONV)
    assert len(trace) == 19366 and trace.block_size == 16
    assert trace.n_blocks == 1388632 == int((conv.context_tokens // 16).sum())
    assert len(set(trace.prompt_keys.tolist())) == trace.n_blocks  # every key unique
    assert (trace.session == -1).all() and (trace.turn == 1).all() and (trace.app == AppType.SINGLE_TURN).all()
    assert (trace.prompt_types == TokenType.UNKNOWN).all() and trace.n_output_blocks == 0
    assert np.array_equal(trace.t, conv.t) and np.array_equal(trace.prompt_tokens, conv.context_tokens)
    assert any("no content hashes" in n for n in report.notes)
    # Keys stay apart from another source's small-integer ids, even under the same salt.
    moon, _ = mooncake.load(MOONCAKE_ARXIV)
    assert not set(moon.prompt_keys.tolist()).intersection(trace.prompt_keys.tolist())
    bigger, _ = azure.load(AZURE_CONV, block_size=512)
    assert bigger.n_blocks == int((conv.context_tokens // 512).sum())
    assert Trace.load(trace.save(tmp_path / "a.npz")).equals(trace)


def test_start_times(conv):
    assert np.array_equal(conv.start_times(100), conv.t[:100])
    n = len(conv)
    tiled = conv.start_times(2 * n + 5)
    assert tiled.size == 2 * n + 5 and (np.diff(tiled) > 0).all()
    assert np.allclose(tiled[n:2 * n] - tiled[n], conv.t)
    fast = conv.start_times(1000, rate=50.0)
    assert (fast.size - 1) / fast[-1] == pytest.approx(50.0)
    assert np.allclose(fast / fast[-1], conv.t[:1000] / conv.t[999])  # same shape, rescaled
    assert conv.start_times(0).size == 0
    with pytest.raises(ValueError, match="rate"):
        conv.start_times(10, rate=0)
    with pytest.raises(ValueError, match="non-negative integer"):
        conv.start_times(-1)


def test_sample_start_times(code):
    a = code.sample_start_times(5000, rng=1)
    assert np.array_equal(a, code.sample_start_times(5000, rng=np.random.default_rng(1)))
    assert a[0] == 0 and (np.diff(a) >= 0).all()
    # Every gap is one of the trace's gaps (up to the round-off of summing and differencing).
    gaps = np.sort(np.diff(code.t))
    d = np.diff(a)
    pos = np.clip(np.searchsorted(gaps, d), 1, gaps.size - 1)
    assert (np.minimum(np.abs(gaps[pos] - d), np.abs(gaps[pos - 1] - d)) < 1e-9).all()
    # The resampled gaps keep the burstiness (CV far above a Poisson process's 1).
    assert np.diff(a).std() / np.diff(a).mean() > 5
    b = code.sample_start_times(5000, rng=1, rate=10.0)
    assert (b.size - 1) / b[-1] == pytest.approx(10.0)


def test_sample_lengths(conv):
    ctx, gen = conv.sample_lengths(2000, rng=3)
    assert ctx.shape == gen.shape == (2000,)
    pairs = set(zip(conv.context_tokens.tolist(), conv.generated_tokens.tolist(), strict=True))
    assert all(p in pairs for p in zip(ctx.tolist(), gen.tolist(), strict=True))
    assert abs(ctx.mean() - conv.context_tokens.mean()) < 100
    c2, g2 = conv.sample_lengths(2000, rng=3)
    assert np.array_equal(ctx, c2) and np.array_equal(gen, g2)


# -- bad input -------------------------------------------------------------------------------------------------------


def _write(tmp_path, lines, name="t.csv"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = ["2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.0319600,3180,8"]
BAD = [
    ("2023-11-16 18:17:04.1,abc,8", "ContextTokens", "must be an integer"),
    ("2023-11-16 18:17:04.1,12.5,8", "ContextTokens", "must be an integer"),
    ("2023-11-16 18:17:04.1,100,-3", "GeneratedTokens", ">= 0"),
    ("2023-11-16 18:17:04.1,,8", "ContextTokens", "must be an integer"),
    ("2023-11-16 25:17:04.1,100,8", "TIMESTAMP", "not a timestamp"),
    ("yesterday,100,8", "TIMESTAMP", "not a timestamp"),
    ("NaT,100,8", "TIMESTAMP", "not a timestamp"),
    ("2023-11-16 18:17:04.1,100", None, "expected 3 comma-separated fields, got 2"),
    ("2023-11-16 18:17:04.1,100,8,9", None, "got 4"),
    # issue 15: numpy's nanosecond datetimes wrapped these silently (a trace starting in 1752, gaps of 8.6e9 s)
    ("-1,100,8", "TIMESTAMP", "must lie between 1970-01-01 and 2262-04-11, got '-1'"),
    ("9999-12-31,100,8", "TIMESTAMP", "must lie between"),
    ("1000-01-01,100,8", "TIMESTAMP", "must lie between"),
    ("1969-12-31 23:59:59,100,8", "TIMESTAMP", "must lie between"),
    # issue 15: one row of 1e10 tokens allocated gigabytes of keys
    ("2023-11-16 18:17:04.1,10000000000,8", "ContextTokens", "at most 100,000,000 tokens"),
    ("2023-11-16 18:17:04.1,100," + "9" * 400, "GeneratedTokens", "at most 100,000,000 tokens"),
]


@pytest.mark.parametrize("bad,field,message", BAD)
def test_bad_row_names_file_line_and_field(tmp_path, bad, field, message):
    path = _write(tmp_path, [HEADER, GOOD[0], "", bad, GOOD[1]])
    with pytest.raises(TraceFormatError, match=message) as exc:
        azure.load_process(path)
    assert exc.value.line == 4 and exc.value.field == field and str(path) in str(exc.value)
    with pytest.raises(TraceFormatError, match="line 4"):
        azure.load(path)
    proc = azure.load_process(path, on_error="skip")
    assert len(proc) == 2 and proc.report.rows_read == 3 and proc.report.rows_rejected == 1
    trace, report = azure.load(path, on_error="skip")
    assert len(trace) == 2 and report.rows_rejected == 1


def test_skip_counts_by_reason_and_reports_the_first_line(tmp_path):
    path = _write(tmp_path, [HEADER, GOOD[0], "x,1,1", "2023-11-16 18:17:05,1,-1", "2023-11-16 18:17:06,1",
                             "y,2,2", GOOD[1]])
    with pytest.raises(TraceFormatError) as exc:
        azure.load_process(path)
    assert exc.value.line == 3 and exc.value.field == "TIMESTAMP"
    proc = azure.load_process(path, on_error="skip")
    assert len(proc) == 2 and proc.report.rejected == {
        "TIMESTAMP: bad value": 2, "GeneratedTokens: bad value": 1, "wrong number of fields": 1}


def test_out_of_order_rows_are_sorted_and_counted(tmp_path):
    path = _write(tmp_path, [HEADER, GOOD[1], GOOD[0], "2023-11-16 18:17:05,7,7"])
    proc = azure.load_process(path)
    assert proc.t.tolist() == pytest.approx([0.0, 0.052, 1.02004])
    assert proc.context_tokens.tolist() == [4808, 3180, 7]
    assert any("2 rows moved" in n for n in proc.report.notes)


def test_header_empty_and_options(tmp_path):
    path = _write(tmp_path, ["GeneratedTokens,TIMESTAMP,ContextTokens", "5,2023-11-16 18:17:05,7"])
    proc = azure.load_process(path)  # columns in any order, by name
    assert proc.context_tokens.tolist() == [7] and proc.generated_tokens.tolist() == [5]
    with pytest.raises(TraceFormatError, match="expected the header") as exc:
        azure.load_process(_write(tmp_path, ["time,ctx,gen", GOOD[0]]))
    assert exc.value.line == 1
    with pytest.raises(TraceFormatError, match="empty file"):
        azure.load_process(_write(tmp_path, [""]))
    with pytest.raises(TraceFormatError, match="no rows"):
        azure.load_process(_write(tmp_path, [HEADER]))
    with pytest.raises(TraceFormatError, match="no valid rows"):
        azure.load_process(_write(tmp_path, [HEADER, "x,1,1"]), on_error="skip")
    with pytest.raises(ValueError, match="unknown option"):
        azure.load(AZURE_CONV, rate=3)
    with pytest.raises(ValueError, match="block_size"):
        azure.load(AZURE_CONV, block_size=0)
    with pytest.raises(FileNotFoundError):
        azure.load_process(tmp_path / "missing.csv")
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(AZURE_CODE.read_bytes()[:5000])
    with pytest.raises(TraceFormatError, match="unreadable gzip stream"):
        azure.load_process(cut)
    latin = tmp_path / "latin1.csv"
    latin.write_bytes((HEADER + "\n").encode() + b"2023-11-16 18:17:05\xe9,1,1\n")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        azure.load_process(latin)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3000), st.integers(0, 5000)), min_size=1,
                max_size=30))
@settings(max_examples=60, deadline=None)
def test_round_trip_of_generated_csv(tmp_path_factory, rows):
    base = np.datetime64("2023-11-16T18:00:00", "ns")
    lines = [HEADER] + [f"{str(base + np.timedelta64(us * 100, 'ns')).replace('T', ' ')},{c},{g}"
                        for us, c, g in rows]
    path = tmp_path_factory.mktemp("csv") / "t.csv"
    path.write_text("\n".join(lines))
    proc = azure.load_process(path)
    order = np.argsort([r[0] for r in rows], kind="stable")
    us = np.array([r[0] for r in rows])[order]
    assert np.allclose(proc.t, (us - us[0]) * 1e-7, atol=1e-9)
    assert proc.context_tokens.tolist() == [rows[i][1] for i in order]
    trace, _ = azure.load(path)
    assert len(set(trace.prompt_keys.tolist())) == trace.n_blocks == sum(r[1] // 16 for r in rows)
