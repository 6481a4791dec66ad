"""Tests of sae_env.features: text hashing, structural features, labels, and the sources' ``features`` option.

* Text: the vectorised hashing against a pure-Python reference (crc32 + splitmix64 written out with ints); a
  conversation's per-call features against hashing the rendered prompt of each call directly; invariance to later
  turns.
* Structural: against a brute-force reference (Python sets per key) on random prefix-sharing traces with random
  sessions; arrival-time only (a request's features are unchanged when every later request is cut off).
* Labels: hand-built traces, and facts measured on the embedded files.
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
from conftest import build_trace, prefix_traces
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env import data
from sae_env.features import (
    DEFAULT_TEXT_DIM,
    HEAD_MIN_SESSIONS,
    ID_BUCKETS,
    N_STRUCTURAL,
    STRUCTURAL_NAMES,
    first_requests,
    key_bucket,
    ngram_vector,
    request_features,
    session_labels,
    structural_features,
)
from sae_env.sources import load_source
from sae_env.tokenizer import ChatTemplate
from sae_env.trace import AppType, Trace

MASK = (1 << 64) - 1
COL = {name: c for c, name in enumerate(STRUCTURAL_NAMES)}


# ----------------------------------------------------------------------------------------------------------------
# Text


def _mix_ref(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def ngram_reference(segments: list[str], dim: int) -> np.ndarray:
    """The module docstring's definition, one n-gram at a time with Python ints."""
    counts = np.zeros(dim)
    for text in segments:
        low = text.lower()
        ids = [zlib.crc32(w.encode("utf-8")) for w in re.findall(r"\w+", low)]
        hashes = [_mix_ref(i ^ 0x51ED2701F3A5C7B1) for i in ids]
        hashes += [_mix_ref(((a << 32) ^ b ^ 0x2545F4914F6CDD1D) & MASK) for a, b in zip(ids, ids[1:], strict=False)]
        raw = low.encode("utf-8")
        hashes += [_mix_ref(((raw[k] << 16) | (raw[k + 1] << 8) | raw[k + 2]) ^ 0x9E3779B97F4A7C15)
                   for k in range(len(raw) - 2)]
        for h in hashes:
            counts[h % dim] += -1.0 if h >> 63 else 1.0
    v = np.sign(counts) * np.log1p(np.abs(counts))
    n = np.linalg.norm(v)
    return v / n if n > 0 else v


@settings(max_examples=60, deadline=None)
@given(segments=st.lists(st.text(max_size=40), max_size=4), dim=st.sampled_from([1, 7, 64, 1536]))
def test_ngram_vector_matches_reference(segments, dim):
    got = ngram_vector(segments, dim)
    assert got.dtype == np.float32 and got.shape == (dim,)
    np.testing.assert_allclose(got, ngram_reference(segments, dim), rtol=1e-5, atol=1e-6)


def test_ngram_vector_basic_properties():
    v = ngram_vector("Book a flight to Boston, please")
    assert v.shape == (DEFAULT_TEXT_DIM,)
    assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(v, ngram_vector("BOOK A FLIGHT TO BOSTON, PLEASE"))  # lower-cased
    assert not np.array_equal(v, ngram_vector("Book a flight to Denver, please"))
    assert np.count_nonzero(ngram_vector("")) == 0
    # n-grams stay inside segments: splitting a text changes its bigrams and 3-grams
    assert not np.array_equal(ngram_vector(["ab", "cd"], 64), ngram_vector("abcd", 64))
    with pytest.raises(ValueError, match="feature dimension"):
        ngram_vector("x", 0)


CONVS = [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Plan a trip to Rome"},
                  {"role": "assistant", "content": "Day 1: Colosseum. Day 2: Vatican."},
                  {"role": "user", "content": "And food?"}, {"role": "assistant", "content": "Try cacio e pepe."}]},
    {"messages": [{"role": "user", "content": "Write a haiku about rain"},
                  {"role": "assistant", "content": "<think>count syllables</think>Soft rain on the roof"}]},
    {"messages": [{"role": "user", "content": "Which tool?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
                  {"role": "tool", "content": "result one"}, {"role": "tool", "content": "result two"},
                  {"role": "assistant", "content": "Done."}],
     "tools": [{"type": "function", "function": {"name": "search", "parameters": {}}}]},
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _call_messages(rows):
    """(session, turn) -> the messages before that call's assistant message, and the session's tools."""
    out = {}
    for s, row in enumerate(rows):
        msgs = row["messages"]
        turn = 0
        for j, m in enumerate(msgs):
            if m["role"] == "assistant":
                turn += 1
                out[(s, turn)] = (msgs[:j], row.get("tools"))
    return out


def test_conversation_features_are_the_rendered_prompt(tmp_path):
    """Each call's row = the hashed n-grams of the segments of its own rendered prompt, computed directly."""
    path = _write(tmp_path / "c.jsonl", CONVS)
    tr, rep = load_source("conversations", path, features="ngram", feature_dim=256)
    assert tr.features.shape == (len(tr), 256) and tr.features.dtype == np.float32
    assert tr.meta["features"] == {"kind": "ngram", "dim": 256}
    assert any("features:" in n for n in rep.notes)
    template = ChatTemplate()
    calls = _call_messages(CONVS)
    assert len(calls) == len(tr)
    for i in range(len(tr)):
        before, tools = calls[(int(tr.session[i]), int(tr.turn[i]))]
        from sae_env.sources.conversations import normalize_messages

        segs = template.segments(normalize_messages(before, "m") if before else [], tools, add_generation_prompt=True)
        np.testing.assert_allclose(tr.features[i], ngram_reference([s[0] for s in segs], 256), atol=1e-6)
    # the rest of the trace is unchanged by the option
    plain, _ = load_source("conversations", path)
    assert plain.features is None
    tr.features = None
    assert plain.equals(tr)


def test_first_request_features_ignore_later_turns(tmp_path):
    """Changing what later turns say (not how many there are) leaves every first request's features unchanged."""
    other = json.loads(json.dumps(CONVS))
    other[0]["messages"][3]["content"] = "Plan a trip to Oslo in winter with kids"
    other[0]["messages"][6]["content"] = "Herring."
    other[2]["messages"][4]["content"] = "Finished, with a much longer closing remark than before."
    a, _ = load_source("conversations", _write(tmp_path / "a.jsonl", CONVS), features="ngram")
    b, _ = load_source("conversations", _write(tmp_path / "b.jsonl", other), features="ngram")
    ia, _ = session_labels(a)
    ib, _ = session_labels(b)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_array_equal(request_features(a, ia), request_features(b, ib))
    later = np.setdiff1d(np.arange(len(a)), ia)
    assert not np.array_equal(request_features(a, later), request_features(b, later))


def test_taubench_features_option():
    tr, _ = load_source("taubench", data.TAUBENCH, tools=str(data.TAUBENCH_TOOLS), max_sessions=3,
                        features="ngram", feature_dim=64)
    assert tr.features.shape == (len(tr), 64)
    np.testing.assert_allclose(np.linalg.norm(tr.features, axis=1), 1.0, atol=1e-5)
    first = first_requests(tr)
    # every session starts with the same policy prompt and schemas, then its own first user message
    assert len({tr.features[i].tobytes() for i in first}) == 3
    assert min(float(tr.features[first[0]] @ tr.features[i]) for i in first) > 0.9


@pytest.mark.parametrize("source", ["conversations", "taubench"])
def test_feature_option_validation(tmp_path, source):
    path = _write(tmp_path / "c.jsonl", CONVS[:1]) if source == "conversations" else data.TAUBENCH
    kw = {} if source == "conversations" else {"tools": str(data.TAUBENCH_TOOLS), "max_sessions": 1}
    with pytest.raises(ValueError, match="'features' must be 'ngram'"):
        load_source(source, path, features="bert", **kw)
    with pytest.raises(ValueError, match="feature_dim"):
        load_source(source, path, feature_dim=64, **kw)
    with pytest.raises(ValueError, match="feature_dim"):
        load_source(source, path, features="ngram", feature_dim=0, **kw)
    tr, _ = load_source(source, path, features="none", **kw)
    assert tr.features is None


# ----------------------------------------------------------------------------------------------------------------
# Structural


def structural_reference(trace: Trace, i: int) -> dict[str, float]:
    """Brute force from the definition: Python sets of sessions per key, over requests before i."""
    sid = trace.session_ids()
    users: dict[int, set[int]] = {}
    for r in range(i):
        for k in trace.prompt_blocks(r)[0].tolist():
            users.setdefault(k, set()).add(int(sid[r]))
    keys, types = trace.prompt_blocks(i)
    other = [len(users.get(k, set()) - {int(sid[i])}) for k in keys.tolist()]
    nb = len(keys)
    shared = sum(o >= 1 for o in other)
    head = sum(o >= HEAD_MIN_SESSIONS for o in other)
    ref = {"log_blocks": np.log1p(nb), "log_shared_blocks": np.log1p(shared),
           "shared_fraction": shared / max(nb, 1), "log_new_blocks": np.log1p(nb - shared),
           "log_first_block_sessions": np.log1p(other[0]) if nb else 0.0,
           "log_shared_block_sessions": np.log1p(other[shared - 1]) if shared else 0.0,
           "first_block_seen": float(bool(nb and other[0] >= 1)), "log_head_depth": np.log1p(head),
           "log_prompt_tokens": np.log1p(trace.prompt_tokens[i])}
    for t, name in enumerate(("system", "template", "user", "assistant", "tool_output", "reasoning", "unknown")):
        ref[f"frac_{name}"] = float(np.sum(types == t)) / max(nb, 1)
    for b in range(ID_BUCKETS):
        ref[f"first_id_{b}"] = float(nb > 0 and int(key_bucket(keys[:1])[0]) == b)
        ref[f"head_id_{b}"] = float(head > 0 and int(key_bucket(keys[head - 1:head])[0]) == b)
    return ref


@st.composite
def traces_with_sessions(draw):
    tr = draw(prefix_traces(max_requests=20))
    n = len(tr)
    tr.session = np.asarray(draw(st.lists(st.integers(-1, 4), min_size=n, max_size=n)), dtype=np.int64)
    tr.prompt_types = np.asarray(draw(st.lists(st.integers(0, 6), min_size=tr.n_blocks, max_size=tr.n_blocks)),
                                 dtype=np.int8)
    return tr


@settings(max_examples=80, deadline=None)
@given(trace=traces_with_sessions())
def test_structural_features_match_reference(trace):
    got = structural_features(trace)
    assert got.shape == (len(trace), N_STRUCTURAL) and got.dtype == np.float32
    for i in range(len(trace)):
        for name, v in structural_reference(trace, i).items():
            assert got[i, COL[name]] == pytest.approx(v, abs=1e-5), (i, name)
    # a subset of indices gives the same rows, in the order asked
    idx = np.arange(len(trace))[::-2]
    np.testing.assert_array_equal(structural_features(trace, idx), got[idx])


def test_structural_features_use_only_the_past():
    """Cutting the trace right after a request leaves its features unchanged (no later request is consulted)."""
    tr, _ = load_source("synthetic", None, preset="tiny", seed=3)
    idx = first_requests(tr)
    full = request_features(tr, idx)
    for i in idx[:: max(1, idx.size // 25)].tolist():
        cut = request_features(tr[: i + 1], [i])
        np.testing.assert_array_equal(cut[0], full[np.searchsorted(idx, i)], err_msg=f"request {i}")
    assert structural_features(tr, np.zeros(0, dtype=np.int64)).shape == (0, N_STRUCTURAL)
    with pytest.raises(ValueError, match="request indices"):
        structural_features(tr, [len(tr)])


def test_shared_head_on_mooncake():
    """Mooncake arXiv excerpt: the templated API requests start with a 12-block head used by >= 3 earlier
    sessions; chat requests (first block id 0) share at most their first block."""
    tr, _ = load_source("mooncake", data.MOONCAKE_ARXIV)
    idx = first_requests(tr)
    X = structural_features(tr, idx)
    head = np.expm1(X[:, COL["log_head_depth"]]).round().astype(int)
    assert np.bincount(head).argmax() <= 1
    assert (head == 12).sum() > 200  # the 12-block (6,144-token) template
    assert (head == 5).sum() > 50  # the 5-block template
    # requests with the same head depth >= 5 carry the same head id bucket
    for d in (5, 12):
        ids = X[head == d][:, COL["head_id_0"]:COL["head_id_0"] + ID_BUCKETS].argmax(axis=1)
        assert np.unique(ids).size == 1


# ----------------------------------------------------------------------------------------------------------------
# Labels


def _trace(sessions, turns, apps):
    n = len(sessions)
    tr = build_trace([[i + 1] for i in range(n)])
    tr.session = np.asarray(sessions, dtype=np.int64)
    tr.turn = np.asarray(turns, dtype=np.int32)
    tr.app = np.asarray(apps, dtype=np.int8)
    tr.validate()
    return tr


def test_labels_on_hand_built_trace():
    C, A, S, U = int(AppType.CHAT), int(AppType.AGENT), int(AppType.SINGLE_TURN), int(AppType.UNKNOWN)
    tr = _trace(sessions=[0, 1, 2, 0, -1, 3, 2, -1, 4, 1, 5],
                turns=[1, 1, 1, 2, 1, 1, 2, 1, 3, 2, 1],
                apps=[C, A, U, C, S, S, U, S, C, A, C])
    idx, y = session_labels(tr)
    # session 4 is seen from its turn 3 only: no first request in the trace
    np.testing.assert_array_equal(idx, [0, 1, 2, 4, 5, 7, 10])
    np.testing.assert_array_equal(y, [1, 2, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(first_requests(tr), idx)


def test_labels_on_embedded_data():
    wild, _ = load_source("conversations", data.WILDCHAT)
    idx, y = session_labels(wild)
    assert idx.size == 187 and (y == 1).all()  # every WildChat excerpt conversation is multi-turn
    tau, _ = load_source("taubench", data.TAUBENCH, tools=str(data.TAUBENCH_TOOLS))
    idx, y = session_labels(tau)
    assert idx.size == 200 and (y == 2).all()
    moon, _ = load_source("mooncake", data.MOONCAKE_ARXIV)
    idx, y = session_labels(moon)
    np.testing.assert_array_equal(np.bincount(y, minlength=3), [858, 65, 0])  # 923 inferred sessions
    syn, _ = load_source("synthetic", None, preset="tiny", seed=0)
    idx, y = session_labels(syn)
    assert (y[syn.app[idx] == int(AppType.SINGLE_TURN)] == 0).all()
    assert set(np.unique(y)) == {0, 1, 2}
