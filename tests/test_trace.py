"""The trace model: chaining, columnar slicing, validation and save / load round trips."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sae_env.keys as keys_module
from sae_env.trace import (
    MAX_TIME_S,
    MAX_TOKENS,
    MAX_TURN,
    AppType,
    TokenType,
    Trace,
    TraceBuilder,
    TraceFormatError,
    chain_keys,
    chain_requests,
    concat,
    repeated,
    session_halves,
    token_blocks,
)

# -- chaining ----------------------------------------------------------------------------------------------------

seqs = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=8), min_size=1, max_size=12)


def _flat(seq_list):
    content = np.array([c for s in seq_list for c in s], dtype=np.int64)
    offsets = np.zeros(len(seq_list) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seq_list])
    return content, offsets


@given(seqs)
def test_chained_keys_are_equal_iff_prefixes_are_equal(seq_list):
    content, offsets = _flat(seq_list)
    keys = chain_keys(content, offsets)
    prefix_of = {}
    for i, s in enumerate(seq_list):
        for j in range(len(s)):
            prefix_of[int(offsets[i] + j)] = tuple(s[: j + 1])
    positions = sorted(prefix_of)
    for a in positions:
        for b in positions:
            assert (keys[a] == keys[b]) == (prefix_of[a] == prefix_of[b])


@given(seqs, st.integers(0, 3))
def test_chaining_chained_keys_keeps_every_equality(seq_list, salt):
    content, offsets = _flat(seq_list)
    once = chain_keys(content, offsets)
    twice = chain_keys(once, offsets, salt=salt)
    eq_once = once[:, None] == once[None, :]
    eq_twice = twice[:, None] == twice[None, :]
    assert np.array_equal(eq_once, eq_twice)


def test_chaining_is_deterministic_and_salted():
    content, offsets = _flat([[1, 2, 3], [1, 2]])
    assert np.array_equal(chain_keys(content, offsets), chain_keys(content, offsets))
    assert not np.intersect1d(chain_keys(content, offsets), chain_keys(content, offsets, salt=1)).size
    # golden values pin the hash function: keys saved by one version must mean the same in the next
    assert chain_keys(np.array([7]), np.array([0, 1]))[0] == chain_keys(np.array([7, 8]), np.array([0, 2]))[0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.integers(0, 2**64 - 1), st.integers(0, 5))
def test_chain_keys_scalar_tail_equals_the_vectorised_pass(lengths, seed, salt):
    """Sequences finished one by one (few left alive) chain exactly as the vectorised pass does (issue 15: one long
    request made the per-position pass cost 63 s)."""
    rng = np.random.default_rng(seed)
    content = rng.integers(0, 2**64 - 1, size=sum(lengths), dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    fast = chain_keys(content, offsets, salt=salt)
    old = keys_module._FEW_ALIVE
    keys_module._FEW_ALIVE = 0  # never leave the vectorised pass
    try:
        assert np.array_equal(chain_keys(content, offsets, salt=salt), fast)
    finally:
        keys_module._FEW_ALIVE = old


def test_chain_one_compiled_equals_python(monkeypatch):
    pytest.importorskip("numba")
    content = np.random.default_rng(7).integers(0, 2**64 - 1, size=3000, dtype=np.uint64)
    python = keys_module._chain_one(12345, content)
    monkeypatch.setattr(keys_module, "_JIT_MIN", 1)
    assert keys_module._chain_kernel() is not None
    assert np.array_equal(keys_module._chain_one(12345, content), python)


def test_chain_keys_rejects_bad_offsets():
    with pytest.raises(ValueError, match="offsets"):
        chain_keys(np.array([1, 2, 3]), np.array([0, 2]))


def test_chain_requests_continues_the_prompt_chain_into_outputs():
    # request 0: prompt [1, 2] output [3]; request 1: prompt [1, 2, 3] (it re-reads the previous answer)
    content, offsets = _flat([[1, 2, 3], [1, 2, 3, 4]])
    pk, po, ok, oo = chain_requests(content, offsets, np.array([2, 3]))
    assert po.tolist() == [0, 2, 5] and oo.tolist() == [0, 1, 2]
    assert ok[0] == pk[4]  # the output block of request 0 is the third prompt block of request 1


def test_token_blocks_drops_the_partial_tail_and_takes_the_dominant_type():
    tokens = np.arange(37)
    types = np.array([TokenType.SYSTEM] * 10 + [TokenType.USER] * 27, dtype=np.int8)
    content, btypes = token_blocks(tokens, types, 16)
    assert content.size == 2
    assert btypes.tolist() == [TokenType.SYSTEM, TokenType.USER]  # block 0: 10 SYSTEM, 6 USER
    same, _ = token_blocks(tokens[:32], types[:32], 16)
    assert np.array_equal(content, same)


# -- the columnar trace ------------------------------------------------------------------------------------------

@st.composite
def traces(draw):
    n = draw(st.integers(0, 15))
    bs = draw(st.sampled_from([1, 4, 16]))
    with_features = draw(st.booleans())
    b = TraceBuilder(block_size=bs, meta={"source": "hypothesis"})
    t = 0.0
    for _ in range(n):
        t += draw(st.floats(0, 5, allow_nan=False))
        n_p = draw(st.integers(0, 6))
        n_o = draw(st.integers(0, 3))
        b.add(t=t, session=draw(st.integers(-1, 4)), turn=draw(st.integers(1, 5)),
              app=draw(st.sampled_from(list(AppType))), prompt_tokens=n_p * bs + draw(st.integers(0, bs - 1)),
              output_tokens=draw(st.integers(0, 100)),
              prompt_keys=draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n_p, max_size=n_p)),
              prompt_types=draw(st.lists(st.sampled_from(list(TokenType)), min_size=n_p, max_size=n_p)),
              output_keys=draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n_o, max_size=n_o)),
              output_types=draw(st.lists(st.sampled_from(list(TokenType)), min_size=n_o, max_size=n_o)),
              features=[draw(st.floats(-1, 1, width=32)) for _ in range(3)] if with_features else None)
    return b.build()


@settings(max_examples=100, deadline=None)
@given(st.deferred(lambda: traces() | extreme_traces()), st.sampled_from([".npz", ".jsonl", ".jsonl.gz"]))
def test_save_load_round_trip(tmp_path_factory, trace, suffix):
    """Any trace, its values at the edges of the format's bounds included, reads back equal (issue 15)."""
    path = tmp_path_factory.mktemp("rt") / f"trace{suffix}"
    trace.save(path)
    back = Trace.load(path)
    assert back.equals(trace)
    assert back.meta == trace.meta
    assert not path.with_name(path.name + ".tmp").exists()


@st.composite
def extreme_traces(draw):
    """Traces whose values sit at the edges of what the native format holds (the bounds of sae_env.trace)."""
    n = draw(st.integers(1, 6))
    bs = draw(st.sampled_from([1, 16, MAX_TOKENS]))
    b = TraceBuilder(block_size=bs, meta={"note": draw(st.text(max_size=5)), "n": draw(st.integers())})
    for _ in range(n):
        n_p = draw(st.integers(0, 2)) if bs < MAX_TOKENS else draw(st.integers(0, 1))
        b.add(t=draw(st.sampled_from([0.0, 5e-324, 1.5, MAX_TIME_S]) | st.floats(0, MAX_TIME_S)),
              session=draw(st.sampled_from([-(2**63), -1, 0, 2**63 - 1])), turn=draw(st.sampled_from([1, MAX_TURN])),
              app=draw(st.sampled_from(list(AppType))),
              prompt_tokens=draw(st.integers(n_p * bs, min(MAX_TOKENS, n_p * bs + bs - 1))),
              output_tokens=draw(st.sampled_from([0, MAX_TOKENS])),
              prompt_keys=draw(st.lists(st.sampled_from([-(2**63), 0, 2**63 - 1]), min_size=n_p, max_size=n_p)),
              prompt_types=draw(st.lists(st.sampled_from(list(TokenType)), min_size=n_p, max_size=n_p)))
    return b.build()


# A value just past each bound of a native .jsonl row: the loader names the line and the field (issue 15).
PAST_BOUNDS = [("t", MAX_TIME_S * 1.0001), ("t", 10**400), ("t", -1e-9), ("turn", MAX_TURN + 1), ("turn", 1.5),
               ("turn", True), ("session", 2**63), ("prompt_tokens", MAX_TOKENS + 1), ("output_tokens", 10**400),
               ("output_tokens", 2.0), ("app", 7), ("app", "robot"), ("prompt_keys", [2**63]),
               ("prompt_keys", [True]), ("prompt_keys", [[1]]), ("prompt_types", [7]), ("features", [1e39]),
               ("features", ["x"])]


@settings(max_examples=40, deadline=None)
@given(extreme_traces(), st.sampled_from(PAST_BOUNDS))
def test_a_value_past_a_bound_is_named(tmp_path_factory, trace, bad):
    field, value = bad
    path = tmp_path_factory.mktemp("bad") / "trace.jsonl"
    trace.save(path)
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row[field] = value
    if field in ("prompt_keys", "prompt_types"):
        row["prompt_keys"], row["prompt_types"] = [0], [0]
        row["prompt_tokens"] = trace.block_size
        row[field] = value
    lines[1] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as exc:
        Trace.load(path)
    assert exc.value.line == 2 and exc.value.field == field and str(path) in str(exc.value)


def test_native_header_needs_a_block_size(tmp_path):
    _one().save(tmp_path / "a.jsonl")
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    for bad in (None, 0, 1.5, "16", True):
        if bad is None:
            header.pop("block_size")
        else:
            header["block_size"] = bad
        (tmp_path / "b.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
        with pytest.raises(TraceFormatError, match="field 'block_size'"):
            Trace.load(tmp_path / "b.jsonl")
    _one().save(tmp_path / "a.npz")
    arrays = dict(np.load(tmp_path / "a.npz"))
    header = json.loads(arrays["header"].tobytes())
    del header["block_size"]
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(tmp_path / "b.npz", **arrays)
    with pytest.raises(TraceFormatError, match=r"b\.npz, field 'block_size': missing"):
        Trace.load(tmp_path / "b.npz")


@pytest.mark.parametrize("column, value, message", [
    ("turn", lambda a: a.astype(str), "must hold integers, got dtype <U"),
    ("turn", lambda a: a + 0.5, "must hold integers, got dtype float64"),
    ("t", lambda a: a.astype(str), "must hold numbers"),
    ("prompt_keys", lambda a: a.astype(np.float64), "must hold integers"),
    ("session", lambda a: a.astype(bool), "must hold integers"),
    ("t", lambda a: a.reshape(-1, 1), "1-dimensional"),
    ("t", lambda a: a + 2 * MAX_TIME_S, "values must lie in"),
    ("prompt_tokens", lambda a: a + MAX_TOKENS, "values must lie in"),
    ("header", lambda a: np.frombuffer(b"\xff", dtype=np.uint8), "not the UTF-8 bytes"),
])
def test_npz_columns_are_not_coerced(tmp_path, column, value, message):
    """String or float columns in a .npz were silently cast to the column's dtype (issue 15)."""
    _one().save(tmp_path / "a.npz")
    arrays = dict(np.load(tmp_path / "a.npz"))
    arrays[column] = value(arrays[column])
    np.savez(tmp_path / "b.npz", **arrays)
    with pytest.raises(TraceFormatError, match=message) as exc:
        Trace.load(tmp_path / "b.npz")
    assert exc.value.field == column and "b.npz" in str(exc.value)


def test_bounds_are_checked_for_traces_built_in_code():
    with pytest.raises(TraceFormatError, match="'t'"):
        _one(t=[MAX_TIME_S * 2])
    with pytest.raises(TraceFormatError, match="'output_tokens'"):
        _one(output_tokens=[MAX_TOKENS + 1])


@settings(max_examples=60, deadline=None)
@given(traces(), st.data())
def test_slices_agree_with_per_request_views(trace, data):
    a = data.draw(st.integers(0, len(trace)))
    b = data.draw(st.integers(a, len(trace)))
    part = trace[a:b]
    assert len(part) == b - a
    for i in range(len(part)):
        r, s = part.request(i), trace.request(a + i)
        assert np.array_equal(r.prompt_keys, s.prompt_keys) and np.array_equal(r.output_types, s.output_types)
        assert (r.t, r.session, r.turn, r.app, r.prompt_tokens) == (s.t, s.session, s.turn, s.app, s.prompt_tokens)
    assert trace.take(np.arange(a, b)).equals(part)
    if len(trace):
        t0, t1 = float(trace.t[0]), float(trace.t[-1])
        window = trace.between(t0, (t0 + t1) / 2)
        assert ((window.t >= t0) & (window.t < (t0 + t1) / 2)).all()
        assert len(window) == int(((trace.t >= t0) & (trace.t < (t0 + t1) / 2)).sum())


def test_builder_sorts_by_time_and_counts_moves():
    b = TraceBuilder(block_size=4)
    for t, key in ((2.0, 20), (1.0, 10), (3.0, 30)):
        b.add(t=t, session=-1, turn=1, app=AppType.SINGLE_TURN, prompt_tokens=4, output_tokens=1,
              prompt_keys=[key], prompt_types=[TokenType.USER])
    trace = b.build()
    assert trace.t.tolist() == [1.0, 2.0, 3.0]
    assert trace.prompt_keys.tolist() == [10, 20, 30]
    assert b.reordered == 2


def test_concat_and_with_times():
    b = TraceBuilder(block_size=4)
    b.add(t=0.0, session=0, turn=1, app=1, prompt_tokens=8, output_tokens=1, prompt_keys=[1, 2], prompt_types=[0, 2])
    b.add(t=5.0, session=0, turn=2, app=1, prompt_tokens=4, output_tokens=1, prompt_keys=[1], prompt_types=[0])
    tr = b.build()
    both = concat([tr, tr.with_times(np.array([1.0, 2.0]))])
    assert both.t.tolist() == [0.0, 1.0, 2.0, 5.0]
    assert both.prompt_keys.tolist() == [1, 2, 1, 2, 1, 1]
    with pytest.raises(ValueError, match="block sizes"):
        concat([tr, _with_bs(tr, 8)])


def _with_bs(tr, bs):
    return Trace(t=tr.t, session=tr.session, turn=tr.turn, app=tr.app, prompt_tokens=tr.prompt_tokens * 2,
                 output_tokens=tr.output_tokens, prompt_offsets=tr.prompt_offsets, prompt_keys=tr.prompt_keys,
                 prompt_types=tr.prompt_types, block_size=bs)


def test_columns_are_read_only_whenever_set():
    """A trace is data: its columns are read-only (so every compiled kernel sees one array type, serial or on Ray),
    the caller's arrays are not frozen with them, and a column set anew is stored the same way, in its dtype."""
    t = np.array([0.0])
    tr = _one(t=t, turn=np.array([1], dtype=np.int64))
    assert t.flags.writeable  # the caller's array is left as it was
    for name in ("t", "session", "turn", "app", "prompt_tokens", "output_tokens", "prompt_offsets", "prompt_keys",
                 "prompt_types", "output_offsets", "output_keys", "output_types"):
        col = getattr(tr, name)
        assert not col.flags.writeable and col.flags.c_contiguous, name
        with pytest.raises(ValueError, match="read-only"):
            col[:1] = 0
    assert tr.turn.dtype == np.int32
    tr.session = [7]
    assert tr.session.dtype == np.int64 and not tr.session.flags.writeable and tr.session.tolist() == [7]
    tr.features = None  # an optional column stays None
    assert tr.features is None
    tr.features = [[1.0, 2.0]]
    assert tr.features.dtype == np.float32 and not tr.features.flags.writeable
    assert not tr.with_times(np.array([3.0])).t.flags.writeable


# -- validation and bad files ------------------------------------------------------------------------------------

def _one(**over):
    cols = dict(t=[0.0], session=[0], turn=[1], app=[1], prompt_tokens=[16], output_tokens=[0],
                prompt_offsets=[0, 1], prompt_keys=[5], prompt_types=[0], block_size=16)
    cols.update(over)
    return Trace(**cols)


@pytest.mark.parametrize("over, field", [
    (dict(t=[-1.0]), "'t'"),
    (dict(t=[float("nan")]), "'t'"),
    (dict(turn=[0]), "'turn'"),
    (dict(app=[9]), "'app'"),
    (dict(prompt_types=[42]), "prompt_types"),
    (dict(prompt_offsets=[0, 2]), "prompt_offsets"),
    (dict(prompt_tokens=[15]), "prompt_keys"),  # one key but no full block of 16 tokens
    (dict(block_size=0), "block_size"),
])
def test_invalid_columns_name_the_field(over, field):
    with pytest.raises(TraceFormatError, match=field):
        _one(**over)


def test_non_monotone_times_are_rejected():
    with pytest.raises(TraceFormatError, match="non-decreasing"):
        Trace(t=[1.0, 0.5], session=[0, 0], turn=[1, 2], app=[1, 1], prompt_tokens=[0, 0], output_tokens=[0, 0],
              prompt_offsets=[0, 0, 0], prompt_keys=[], prompt_types=[], block_size=16)


def test_bad_jsonl_names_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    _one().save(path)
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row["prompt_keys"] = "oops"
    path.write_text("\n".join([lines[0], lines[1], json.dumps(row)]) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl, line 3, field 'prompt_keys'"):
        Trace.load(path)
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(TraceFormatError, match="line 2.*malformed JSON"):
        Trace.load(path)
    del row["t"]
    row["prompt_keys"] = [1]
    path.write_text(lines[0] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TraceFormatError, match="line 2, field 't'"):
        Trace.load(path)
    path.write_text("")
    with pytest.raises(TraceFormatError, match="empty"):
        Trace.load(path)


def test_npz_is_loaded_without_pickle(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, header=np.array([{"format": "sae-trace"}], dtype=object))
    with pytest.raises(TraceFormatError, match="not a readable"):
        Trace.load(path)


@given(traces(), st.sampled_from(["start", "alternate"]))
def test_session_halves_split_whole_sessions_by_start(trace, split):
    """The halves hold every request once, in time order, each session whole in one of them; the first half holds the
    first ceil(n / 2) sessions by first arrival (``start``) or the 1st, 3rd, ... (``alternate``; a request of unknown
    session is a session of its own); a trace of fewer than two sessions is a ValueError."""
    sid = trace.session_ids()
    n = np.unique(sid).size
    if n < 2:
        with pytest.raises(ValueError, match="two sessions"):
            session_halves(trace, split)
        return
    early, late = session_halves(trace, split)
    assert len(early) + len(late) == len(trace)
    for half in (early, late):
        assert (np.diff(half.t) >= 0).all()
    starts = {}
    for i, s in enumerate(sid.tolist()):
        starts.setdefault(s, i)
    by_start = sorted(starts, key=starts.get)
    first = by_start[:(n + 1) // 2] if split == "start" else by_start[0::2]
    in_early = np.isin(sid, first)
    for half, mask in ((early, in_early), (late, ~in_early)):
        idx = np.flatnonzero(mask)
        assert np.array_equal(half.t, trace.t[idx]) and np.array_equal(half.session, trace.session[idx])
        for j, i in enumerate(idx.tolist()):
            for got, want in zip(half.prompt_blocks(j) + half.output_blocks(j),
                                 trace.prompt_blocks(i) + trace.output_blocks(i), strict=True):
                assert np.array_equal(got, want)


def test_session_halves_rejects_an_unknown_split():
    b = TraceBuilder(block_size=1)
    for s in range(3):
        b.add(t=float(s), session=s, turn=1, app=AppType.CHAT, prompt_tokens=1, output_tokens=0, prompt_keys=[s],
              prompt_types=[TokenType.USER], output_keys=[], output_types=[])
    trace = b.build()
    assert len(session_halves(trace, "alternate")[0]) == 2  # sessions 0 and 2
    with pytest.raises(ValueError, match="unknown split 'random'; valid splits: start, alternate"):
        session_halves(trace, "random")


def test_repeat_makes_copies_that_share_nothing():
    """repeated (decision_time.py and gap_table.py --repeat): n copies in a row at the same arrival rate, each with
    sessions and blocks of its own.
    Differential check: LRU never evicts a newer block while an older one is cached, so a copy's blocks see a cache
    full of the previous copies' as an empty one: n times the hits of the trace itself."""
    from sae_env.metrics import summarize
    from sae_env.policies import make_policy
    from sae_env.replay import replay
    from sae_env.sources import open_trace

    trace, _ = open_trace("mooncake_arxiv")
    longer = repeated(trace, 3)
    n = len(trace)
    assert len(longer) == 3 * n and np.all(np.diff(longer.t) >= 0)
    np.testing.assert_allclose(longer.t[n:2 * n] - trace.t, longer.t[n] - trace.t[0], rtol=0, atol=1e-9)
    assert longer.t[n] > trace.t[-1]
    copies = [set(longer.prompt_keys[longer.prompt_offsets[k * n]:longer.prompt_offsets[(k + 1) * n]].tolist())
              for k in range(3)]
    assert not (copies[0] & copies[1]) and not (copies[1] & copies[2])
    assert len(copies[0]) == len(set(trace.prompt_keys.tolist()))
    known = longer.session[longer.session >= 0]
    assert np.unique(known).size == 3 * np.unique(trace.session[trace.session >= 0]).size
    capacity = 400
    hits = [summarize(replay(t, make_policy("lru"), capacity).windows)["hit_tokens"] for t in (trace, longer)]
    assert hits[1] == 3 * hits[0] > 0


def test_a_pause_puts_the_copies_further_apart_and_nothing_else():
    from sae_env.sources import open_trace

    trace, _ = open_trace("mooncake_arxiv")
    back_to_back, apart = repeated(trace, 3), repeated(trace, 3, pause=3600.0)
    n = len(trace)
    for k in range(3):
        np.testing.assert_allclose(apart.t[k * n:(k + 1) * n] - back_to_back.t[k * n:(k + 1) * n], 3600.0 * k,
                                   rtol=0, atol=1e-6)
    for name in ("session", "prompt_keys", "output_keys", "prompt_offsets"):
        np.testing.assert_array_equal(getattr(apart, name), getattr(back_to_back, name))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="pause must be a finite number of seconds >= 0"):
            repeated(trace, 2, pause=bad)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="n must be a whole number >= 1"):
            repeated(trace, bad)
    assert len(repeated(trace, 1)) == n and np.array_equal(repeated(trace, 1).prompt_keys, trace.prompt_keys)


def test_session_continues_against_a_reverse_scan():
    """session_continues: a request's session has a later request, as a scan from the end counts it, on a real
    trace and on one whose unknown sessions (-1) are each a session of their own."""
    from sae_env.sources import open_trace
    from sae_env.trace import session_continues

    def reference(trace):
        sid, seen, out = trace.session_ids(), set(), np.zeros(len(trace), dtype=bool)
        for i in range(len(trace) - 1, -1, -1):
            out[i] = int(sid[i]) in seen
            seen.add(int(sid[i]))
        return out

    trace, _ = open_trace("wildchat")
    assert session_continues(trace).tolist() == reference(trace).tolist()
    assert 0 < session_continues(trace).mean() < 1
    n = 6  # sessions 0, -1, 0, -1, 1, 1: the unknown ones never continue, session 0's first and 1's first do
    small = Trace(t=np.arange(n, dtype=float), session=[0, -1, 0, -1, 1, 1], turn=[1, 1, 2, 1, 1, 2], app=[1] * n,
                  prompt_tokens=[16] * n, output_tokens=[0] * n, prompt_offsets=np.arange(n + 1),
                  prompt_keys=np.arange(n) + 5, prompt_types=[0] * n, block_size=16)
    assert session_continues(small).tolist() == [True, False, False, False, True, False] == reference(small).tolist()
