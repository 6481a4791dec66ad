"""Tests of the conversations source (WildChat / ShareGPT / Arena JSONL) and the shared chat pipeline."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sae_env import data
from sae_env.inputs import open_text
from sae_env.sources import load_source
from sae_env.sources.conversations import Arrivals, load
from sae_env.tokenizer import ChatTemplate, split_reasoning
from sae_env.trace import AppType, TokenType, TraceFormatError, chain_keys, token_blocks

SHARED_WILDCHAT = Path("/work/shared/data/wildchat/wildchat_multiturn.jsonl")


@pytest.fixture(scope="module")
def wildchat():
    return load(None)


@pytest.fixture(scope="module")
def wildchat_rows():
    with open_text(data.WILDCHAT) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def by_session_turn(trace) -> dict[tuple[int, int], int]:
    return {(int(s), int(t)): i for i, (s, t) in enumerate(zip(trace.session, trace.turn, strict=True))}


def reference_calls(msgs: list[dict], bs: int, tools=None, template: ChatTemplate | None = None):
    """Straightforward per-call reference: render prompt and output on their own, cut, hash and chain."""
    ct = template or ChatTemplate()
    out = []
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        p, pt = ct.render(msgs[:j], tools, add_generation_prompt=True)
        o, ot = ct.render_output(m)
        content, types = token_blocks(np.concatenate([p, o]), np.concatenate([pt, ot]), bs)
        keys = chain_keys(content, np.array([0, content.size]))
        n = p.size // bs
        out.append((keys[:n], types[:n], keys[n:], types[n:], p.size, o.size))
    return out


def assert_matches_reference(trace, sessions: dict[int, list[dict]], bs: int, tools=None):
    index = by_session_turn(trace)
    for sid, msgs in sessions.items():
        for turn, (pk, pt, ok, ot, np_, no) in enumerate(reference_calls(msgs, bs, tools), start=1):
            i = index[(sid, turn)]
            assert np.array_equal(trace.prompt_blocks(i)[0], pk) and np.array_equal(trace.prompt_blocks(i)[1], pt)
            assert np.array_equal(trace.output_blocks(i)[0], ok) and np.array_equal(trace.output_blocks(i)[1], ot)
            assert trace.prompt_tokens[i] == np_ and trace.output_tokens[i] == no


# ----------------------------------------------------------------------------------------------------------------
# Facts measured on the real WildChat excerpt


def test_wildchat_counts(wildchat, wildchat_rows):
    trace, report = wildchat
    assert len(wildchat_rows) == report.rows_read == 187 and report.rows_rejected == 0
    n_user = sum(m["role"] == "user" for r in wildchat_rows for m in r["messages"])
    assert n_user == 741  # 3.96 user turns per conversation on average
    assert len(trace) == 750  # one call per assistant message
    assert sorted(np.unique(trace.session).tolist()) == list(range(187))
    assert (trace.app == AppType.CHAT).all()  # every conversation has > 1 assistant message
    assert np.bincount(trace.turn).tolist()[:6] == [0, 187, 187, 102, 73, 50]
    assert trace.block_size == 16 and trace.meta["source"] == "conversations"
    # pinned with the default simple tokenizer and block size 16
    assert trace.n_blocks == 72054 and trace.n_output_blocks == 18391
    assert int(trace.prompt_tokens.sum()) == 1158500 and int(trace.output_tokens.sum()) == 294236
    assert set(np.unique(trace.prompt_types)) == {TokenType.USER, TokenType.ASSISTANT}
    notes = "\n".join(report.notes)
    assert "5 conversation(s) start with an assistant message" in notes
    assert "4 assistant message(s) follow another assistant message" in notes


@pytest.mark.skipif(not SHARED_WILDCHAT.exists(), reason="shared data folder not present")
def test_shared_file_gives_the_same_trace(wildchat):
    trace, _ = load(SHARED_WILDCHAT)
    assert trace.equals(wildchat[0])


def test_wildchat_matches_reference(wildchat, wildchat_rows):
    sessions = {sid: wildchat_rows[sid]["messages"] for sid in (0, 11, 26, 49, 105, 138, 186)}
    assert_matches_reference(wildchat[0], sessions, 16)


def test_block_counts_and_prefix_growth(wildchat):
    trace, _ = wildchat
    bs = trace.block_size
    n_prompt = np.diff(trace.prompt_offsets)
    n_out = np.diff(trace.output_offsets)
    assert np.array_equal(n_prompt, trace.prompt_tokens // bs)
    assert np.array_equal(n_prompt + n_out, (trace.prompt_tokens + trace.output_tokens) // bs)
    index = by_session_turn(trace)
    for (sid, turn), i in index.items():
        j = index.get((sid, turn + 1))
        if j is None:
            continue
        assert trace.t[j] >= trace.t[i]
        seq = np.concatenate([trace.prompt_blocks(i)[0], trace.output_blocks(i)[0]])
        assert np.array_equal(trace.prompt_blocks(j)[0][:seq.size], seq)  # no reasoning in WildChat


def test_other_block_sizes(tmp_path, wildchat_rows):
    path = write_jsonl(tmp_path / "c.jsonl", wildchat_rows[:8])
    for bs in (1, 7, 64):
        trace, _ = load(path, block_size=bs)
        assert np.array_equal(np.diff(trace.prompt_offsets), trace.prompt_tokens // bs)
        assert_matches_reference(trace, {3: wildchat_rows[3]["messages"], 7: wildchat_rows[7]["messages"]}, bs)


def test_block_boundaries_sweep(tmp_path):
    """Prompt lengths swept across block boundaries, with outputs as short as 2 tokens (an empty reply):
    the straddling block, the generation prompt cut by a boundary, and outputs that complete no block."""
    convs = []
    for n in range(40):
        for reply in ("", "ok", "a longer reply " * 3):
            convs.append([{"role": "user", "content": " x" * n}, {"role": "assistant", "content": reply},
                          {"role": "user", "content": "y"}, {"role": "assistant", "content": reply[::-1]}])
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": c} for c in convs])
    for bs in (3, 4, 16):
        trace, _ = load(path, block_size=bs)
        assert_matches_reference(trace, dict(enumerate(convs)), bs)


# ----------------------------------------------------------------------------------------------------------------
# Random conversations: prefix growth, and reasoning blocks never reused

_TEXT = st.text(alphabet=st.sampled_from(list("abcdefgh ijklm,.\n'\"{}:é你")), max_size=60)


@st.composite
def convo(draw):
    msgs = []
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(_TEXT)})
        a = {"role": "assistant", "content": draw(_TEXT)}
        if draw(st.integers(0, 2)) == 0:
            a["reasoning_content"] = "r" + draw(_TEXT)
        msgs.append(a)
    return msgs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(convo(), min_size=1, max_size=4), st.sampled_from([1, 4, 16]))
def test_random_conversations(tmp_path, convs, bs):
    path = write_jsonl(tmp_path / "r.jsonl", [{"messages": c} for c in convs])
    trace, _ = load(path, block_size=bs, rate=5.0)
    assert_matches_reference(trace, dict(enumerate(convs)), bs)
    index = by_session_turn(trace)
    all_prompt_keys = set(trace.prompt_keys.tolist())
    for (sid, turn), i in index.items():
        ok, ot = trace.output_blocks(i)
        msg = [m for m in convs[sid] if m["role"] == "assistant"][turn - 1]
        # a block holding any generated reasoning token is never a later prompt's block
        assert not (set(ok[ot == TokenType.REASONING].tolist()) & all_prompt_keys)
        j = index.get((sid, turn + 1))
        if j is None:
            continue
        pk_next = trace.prompt_blocks(j)[0]
        seq = np.concatenate([trace.prompt_blocks(i)[0], ok])
        if split_reasoning(msg)[0] is None:
            assert np.array_equal(pk_next[:seq.size], seq)
        else:
            assert np.array_equal(pk_next[:trace.prompt_blocks(i)[0].size], trace.prompt_blocks(i)[0])


def test_reasoning_blocks_not_reused(tmp_path):
    think = "<think>\n" + "let me think about this carefully " * 10 + "\n</think>\n\n"
    conv = [{"role": "user", "content": "question one"},
            {"role": "assistant", "content": think + "answer one " * 8},
            {"role": "user", "content": "question two"},
            {"role": "assistant", "content": "answer two"}]
    trace, report = load(write_jsonl(tmp_path / "t.jsonl", [{"messages": conv}]), block_size=4)
    i, j = (0, 1) if trace.turn[0] == 1 else (1, 0)
    ok, ot = trace.output_blocks(i)
    assert (ot == TokenType.REASONING).sum() >= 10
    assert not (set(ok.tolist()) & set(trace.prompt_blocks(j)[0].tolist()))  # reasoning is the output's head
    p1 = trace.prompt_blocks(i)[0]
    assert np.array_equal(trace.prompt_blocks(j)[0][:p1.size], p1)
    assert "1 assistant message(s) with reasoning" in "\n".join(report.notes)


# ----------------------------------------------------------------------------------------------------------------
# Formats


def test_formats_map_to_the_same_trace(tmp_path):
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hi, how can I help?"}, {"role": "user", "content": "tell a joke"},
            {"role": "assistant", "content": "no"}]
    ref, _ = load(write_jsonl(tmp_path / "m.jsonl", [{"id": "x", "metadata": {}, "messages": msgs}]))
    fr = {"system": "system", "user": "human", "assistant": "gpt"}
    variants = {
        "sharegpt": {"conversations": [{"from": fr[m["role"]], "value": m["content"]} for m in msgs]},
        "lmsys": {"conversation": msgs, "model": "m"},
        "parts": {"messages": [{**m, "content": [{"type": "text", "text": m["content"][:3]},
                                                 {"type": "text", "text": m["content"][3:]}]} for m in msgs]},
        "upper": {"messages": [{**m, "role": m["role"].upper()} for m in msgs]},
    }
    for name, row in variants.items():
        trace, _ = load(write_jsonl(tmp_path / f"{name}.jsonl", [row]))
        assert trace.equals(ref), name
    arena, report = load(write_jsonl(tmp_path / "arena.jsonl", [{"conversation_a": msgs, "conversation_b": msgs}]))
    assert len(arena) == 4 and sorted(set(arena.session.tolist())) == [0, 1] and report.rows_read == 1
    assert np.array_equal(arena.prompt_keys[arena.session.repeat(np.diff(arena.prompt_offsets)) == 0],
                          ref.prompt_keys)


def test_gzip_and_registry(tmp_path, wildchat_rows):
    raw = "".join(json.dumps(r) + "\n" for r in wildchat_rows[:5])
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(raw)
    plain = tmp_path / "c.jsonl"
    plain.write_text(raw + "\n\n")  # blank lines are skipped
    a, _ = load_source("conversations", gz)
    b, _ = load(plain)
    assert a.equals(b) and len(a) == sum(m["role"] == "assistant" for r in wildchat_rows[:5] for m in r["messages"])


def test_trailing_user_dropped_and_single_turn(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "unanswered"}]},
            {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
                          {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]}]
    trace, report = load(write_jsonl(tmp_path / "c.jsonl", rows))
    assert len(trace) == 3
    assert trace.app[trace.session == 0].tolist() == [AppType.SINGLE_TURN]
    assert trace.app[trace.session == 1].tolist() == [AppType.CHAT] * 2
    assert "1 message(s) after the last assistant message" in "\n".join(report.notes)


def test_system_prompt_is_a_shared_system_prefix(tmp_path, wildchat_rows):
    path = write_jsonl(tmp_path / "c.jsonl", wildchat_rows[:30])
    system = "You are a helpful assistant. " * 20
    trace, report = load(path, system_prompt=system)
    n = len(ChatTemplate().render([{"role": "system", "content": system}])[0]) // 16
    first = trace.prompt_keys[trace.prompt_offsets[:-1][trace.turn == 1][:, None] + np.arange(n)]
    assert (first == first[0]).all()
    assert (trace.prompt_types[trace.prompt_offsets[:-1][trace.turn == 1][:, None] + np.arange(n)] ==
            TokenType.SYSTEM).all()
    assert any("system_prompt prepended" in note for note in report.notes)


def test_max_conversations(tmp_path, wildchat_rows):
    path = write_jsonl(tmp_path / "c.jsonl", wildchat_rows[:10])
    trace, report = load(path, max_conversations=3)
    assert sorted(set(trace.session.tolist())) == [0, 1, 2] and report.rows_read == 3
    assert len(load(path, max_conversations=0)[0]) == 0


def test_tokenizer_option(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello there friend", "how can I help"], trainers.WordLevelTrainer(
        special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    rows = [{"messages": [{"role": "user", "content": "hello there friend " * 10},
                          {"role": "assistant", "content": "how can I help " * 10}]}]
    trace, report = load(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=str(tmp_path / "tokenizer.json"),
                         block_size=4)
    assert trace.meta["tokenizer"].startswith("hf:")
    # im_start, "user\n" (unknown word: [UNK]; the newline is whitespace), 30 words, im_end, "\n" (nothing),
    # im_start, "assistant\n" ([UNK])
    assert trace.prompt_tokens[0] == 1 + 1 + 30 + 1 + 0 + 1 + 1
    assert_matches_reference_with(trace, rows[0]["messages"], 4, ChatTemplate(str(tmp_path / "tokenizer.json")))


def assert_matches_reference_with(trace, msgs, bs, template):
    (pk, pt, ok, ot, np_, no), = reference_calls(msgs, bs, template=template)
    assert np.array_equal(trace.prompt_keys, pk) and np.array_equal(trace.output_keys, ok)
    assert trace.prompt_tokens[0] == np_ and trace.output_tokens[0] == no


# ----------------------------------------------------------------------------------------------------------------
# Arrival times


def test_arrivals_seeded_and_start_times(tmp_path, wildchat_rows):
    path = write_jsonl(tmp_path / "c.jsonl", wildchat_rows[:40])
    a, _ = load(path, seed=1)
    b, _ = load(path, seed=1)
    c, _ = load(path, seed=2)
    assert a.equals(b) and not np.array_equal(a.t, c.t)
    starts = np.arange(40, dtype=float) * 100.0
    d, _ = load(path, start_times=starts)
    assert np.array_equal(d.t[d.turn == 1], starts)  # session i starts at start_times[i]
    assert np.array_equal(np.sort(d.session[d.turn == 1]), np.arange(40))
    for sid in range(40):  # turns arrive in order within a session
        assert np.all(np.diff(d.turn[d.session == sid]) == 1)
    with pytest.raises(ValueError, match="start_times has 10 entries but there are 40 sessions"):
        load(path, start_times=starts[:10])
    with pytest.raises(ValueError, match="needs the option 'start_times'"):
        load(path, arrival="start_times")
    with pytest.raises(ValueError, match="contradict"):
        load(path, arrival="poisson", start_times=starts)


def test_arrival_distributions():
    rng = np.random.default_rng(0)
    n = 20_000
    arr = Arrivals(rate=2.0, user_gap=(4.88, 0.98), tool_gap=(0.0, 0.5))
    counts = np.full(n, 3)
    after_tool = np.tile([False, False, True], n)
    t = arr.call_times(counts, after_tool, rng).reshape(n, 3)
    assert abs(np.diff(t[:, 0]).mean() - 0.5) < 0.02  # Poisson starts at 2 sessions/s, first at 0
    assert t[0, 0] == 0.0
    user_gaps, tool_gaps = np.log(t[:, 1] - t[:, 0]), np.log(t[:, 2] - t[:, 1])
    assert abs(user_gaps.mean() - 4.88) < 0.03 and abs(user_gaps.std() - 0.98) < 0.03
    assert abs(tool_gaps.mean() - 0.0) < 0.02 and abs(tool_gaps.std() - 0.5) < 0.02
    # sessions without calls keep their start draw and place nothing
    t2 = arr.call_times(np.array([2, 0, 1]), np.zeros(3, dtype=bool), np.random.default_rng(5))
    assert t2.size == 3 and t2[0] == 0.0 and t2[1] > t2[0]


def test_gap_options(tmp_path, wildchat_rows):
    path = write_jsonl(tmp_path / "c.jsonl", wildchat_rows[:60])
    trace, report = load(path, gap_mu=1.0, gap_sigma=0.0, rate=100.0)
    index = by_session_turn(trace)
    gaps = [trace.t[index[(s, k + 1)]] - trace.t[i] for (s, k), i in index.items() if (s, k + 1) in index]
    assert np.allclose(gaps, math.e)
    assert "exp(N(1, 0))" in "\n".join(report.notes)


# ----------------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_file_line_and_field(tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    cases = [
        ("{not json", "line 2", None, "malformed JSON"),
        ({"id": 3}, "line 2", "messages", "missing"),
        ({"messages": []}, "line 2", "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "line 2", "messages[0].role", "unknown role"),
        ({"messages": [{"role": "user", "content": 5}]}, "line 2", "messages[0].content", "must be a string"),
        ({"messages": [{"role": "user"}]}, "line 2", "messages[0].content", "missing"),
        ({"messages": [{"role": "user", "content": None}]}, "line 2", "messages[0].content", "null"),
        ({"messages": ["hi"]}, "line 2", "messages[0]", "must be an object"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                          "tool_calls": [{"function": {"name": 3}}]}]},
         "line 2", "messages[1].tool_calls[0].function.name", "must be a string"),
        ({"messages": [{"role": "user", "content": "a"}]}, "line 2", "messages", "no assistant message"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "line 2", "conversations[0].from", "unknown role"),
        ([1, 2], "line 2", None, "must be a JSON object"),
    ]
    for n, (row, line, field, what) in enumerate(cases):
        path = write_jsonl(tmp_path / f"bad{n}.jsonl", [good, row, good])
        with pytest.raises(TraceFormatError) as e:
            load(path)
        msg = str(e.value)
        assert str(path) in msg and line in msg and what in msg, msg
        if field is not None:
            assert f"field '{field}'" in msg, msg
        trace, report = load(path, on_error="skip")
        assert report.rows_rejected == 1 and len(trace) == 2 and report.rows_read == 3
        assert sorted(set(trace.session.tolist())) == [0, 2]  # ids do not move when a row is skipped


def test_skip_counts_reasons(tmp_path):
    rows = ["{oops", {"messages": [{"role": "x", "content": "y"}]}, {"messages": [{"role": "y", "content": "y"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    trace, report = load(write_jsonl(tmp_path / "c.jsonl", rows), on_error="skip")
    assert len(trace) == 1 and report.rejected == {"malformed JSON": 1, "bad role": 2}


def test_empty_file_and_bad_options(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="empty file"):
        load(empty)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.jsonl")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"}]}])
    for opts, match in [({"blocksize": 4}, "unknown option"), ({"block_size": 0}, "block_size"),
                        ({"rate": -1}, "rate"), ({"gap_sigma": -0.1}, "gap_sigma"), ({"on_error": "ignore"},
                                                                                      "on_error"),
                        ({"arrival": "uniform"}, "arrival"), ({"system_prompt": 3}, "system_prompt"),
                        ({"max_conversations": -1}, "max_conversations"), ({"gap_mu": float("nan")}, "gap_mu")]:
        with pytest.raises(ValueError, match=match):
            load(path, **opts)
