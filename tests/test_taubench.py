"""Tests of the tau-bench source: facts measured on the real trajectories, the shared tool prefix, bad input."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sae_env import data
from sae_env.inputs import open_text
from sae_env.sources import load_source
from sae_env.sources.taubench import load
from sae_env.tokenizer import ChatTemplate
from sae_env.trace import AppType, TokenType, TraceFormatError, chain_keys, token_blocks

SHARED = Path("/work/shared/data/tau_bench/airline_gpt4o_trajectories.json")
N_PREFIX_TOKENS = 4517  # system policy + 14 tool schemas, ChatML, simple tokenizer (~4 k, as data/README.md says)
N_PREFIX_BLOCKS = N_PREFIX_TOKENS // 16  # 282


@pytest.fixture(scope="module")
def raw():
    with open_text(data.TAUBENCH) as f:
        trajs = json.load(f)
    with open_text(data.TAUBENCH_TOOLS) as f:
        tools = json.load(f)
    return trajs, tools


@pytest.fixture(scope="module")
def taubench():
    return load(None)


def by_session_turn(trace) -> dict[tuple[int, int], int]:
    return {(int(s), int(t)): i for i, (s, t) in enumerate(zip(trace.session, trace.turn, strict=True))}


def small_file(tmp_path: Path, trajs: list, name: str = "airline_small.json", tools: bool = True) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(trajs))
    if tools:
        shutil.copy(data.TAUBENCH_TOOLS, tmp_path / "airline_tools_schema.json.gz")
    return path


# ----------------------------------------------------------------------------------------------------------------
# Facts measured on the real file


def test_counts(taubench, raw):
    trace, report = taubench
    trajs, tools = raw
    assert report.rows_read == 200 and report.rows_rejected == 0 and len(tools) == 14
    assert len(trace) == 2454  # = assistant messages (data/README.md: 2,454 LLM calls)
    assert sum(len(m.get("tool_calls") or ()) for s in trajs for m in s["traj"]) == 1164
    assert sorted(np.unique(trace.session).tolist()) == list(range(200))
    assert (trace.app == AppType.AGENT).all()
    per_session = np.bincount(trace.session, minlength=200)
    assert per_session.tolist() == [sum(m["role"] == "assistant" for m in s["traj"]) for s in trajs]
    assert np.array_equal(np.bincount(trace.session, weights=trace.turn == 1), np.ones(200))
    # pinned with the default simple tokenizer and block size 16
    assert trace.n_blocks == 955519 and trace.n_output_blocks == 11827
    assert np.bincount(trace.prompt_types, minlength=7).tolist() == [235584, 456444, 24886, 81910, 156695, 0, 0]
    assert trace.meta["source"] == "taubench" and trace.meta["tools"].endswith("airline_tools_schema.json.gz")
    assert "200 message(s) after the last assistant message" in "\n".join(report.notes)


def test_shared_system_and_tools_prefix(taubench, raw):
    trace, _ = taubench
    trajs, tools = raw
    assert {s["traj"][0]["content"] for s in trajs} == {trajs[0]["traj"][0]["content"]}
    assert len(trajs[0]["traj"][0]["content"]) == 6155
    prefix, types = ChatTemplate().render([trajs[0]["traj"][0]], tools)
    assert prefix.size == N_PREFIX_TOKENS
    assert (types == TokenType.TEMPLATE).sum() > 2500  # the schemas are most of it
    first = trace.prompt_offsets[:-1][trace.turn == 1]
    heads = trace.prompt_keys[first[:, None] + np.arange(N_PREFIX_BLOCKS + 1)]
    assert heads.shape == (200, N_PREFIX_BLOCKS + 1)
    assert (heads[:, :N_PREFIX_BLOCKS] == heads[0, :N_PREFIX_BLOCKS]).all()  # shared by all 200 sessions
    assert np.unique(heads[:, N_PREFIX_BLOCKS]).size > 100  # the block holding the first user words differs
    # every call of every session starts with the same prefix, of course
    all_heads = trace.prompt_keys[trace.prompt_offsets[:-1][:, None] + np.arange(N_PREFIX_BLOCKS)]
    assert (all_heads == heads[0, :N_PREFIX_BLOCKS]).all()
    # that prefix is a SYSTEM then TEMPLATE span
    t = trace.prompt_types[first[0]:first[0] + N_PREFIX_BLOCKS]
    assert set(np.unique(t)) == {TokenType.SYSTEM, TokenType.TEMPLATE}


def test_prefix_closed_growth(taubench):
    trace, _ = taubench
    index = by_session_turn(trace)
    n_prompt = np.diff(trace.prompt_offsets)
    assert np.array_equal(n_prompt, trace.prompt_tokens // 16)
    assert np.array_equal(n_prompt + np.diff(trace.output_offsets),
                          (trace.prompt_tokens + trace.output_tokens) // 16)
    for (sid, turn), i in index.items():
        j = index.get((sid, turn + 1))
        if j is None:
            continue
        assert trace.t[j] > trace.t[i]
        seq = np.concatenate([trace.prompt_blocks(i)[0], trace.output_blocks(i)[0]])  # no reasoning here
        assert np.array_equal(trace.prompt_blocks(j)[0][:seq.size], seq)


def test_matches_reference(taubench, raw):
    trace, _ = taubench
    trajs, tools = raw
    ct = ChatTemplate()
    index = by_session_turn(trace)
    for sid in (0, 77, 199):
        msgs = trajs[sid]["traj"]
        calls = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
        for turn, j in enumerate(calls, start=1):
            p, pt = ct.render(msgs[:j], tools, add_generation_prompt=True)
            o, ot = ct.render_output(msgs[j])
            content, types = token_blocks(np.concatenate([p, o]), np.concatenate([pt, ot]), 16)
            keys = chain_keys(content, np.array([0, content.size]))
            i, n = index[(sid, turn)], p.size // 16
            assert np.array_equal(trace.prompt_blocks(i)[0], keys[:n])
            assert np.array_equal(trace.prompt_blocks(i)[1], types[:n])
            assert np.array_equal(trace.output_blocks(i)[0], keys[n:])
            assert trace.prompt_tokens[i] == p.size and trace.output_tokens[i] == o.size


def test_tool_results_and_gaps(taubench, raw):
    trace, _ = taubench
    trajs, _ = raw
    index = by_session_turn(trace)
    after_tool, after_user = [], []
    for sid, s in enumerate(trajs):
        calls = [j for j, m in enumerate(s["traj"]) if m["role"] == "assistant"]
        for turn, j in enumerate(calls[1:], start=2):
            gap = trace.t[index[(sid, turn)]] - trace.t[index[(sid, turn - 1)]]
            (after_tool if s["traj"][j - 1]["role"] == "tool" else after_user).append(gap)
    ends_with_tool = sum(s["traj"][-1]["role"] == "tool" for s in trajs)
    assert ends_with_tool == 51
    assert len(after_tool) == 1164 - ends_with_tool  # every other tool result is followed by a call
    assert 0.8 < np.median(after_tool) < 1.25  # exp(N(0, 0.8)): median 1 s
    assert 9 < np.median(after_user) < 16  # exp(N(2.5, 0.9)): median ~12 s
    assert (trace.prompt_types == TokenType.TOOL_OUTPUT).sum() > 100_000


@pytest.mark.skipif(not SHARED.exists(), reason="shared data folder not present")
def test_shared_file_gives_the_same_trace(taubench):
    trace, report = load(SHARED)
    assert trace.equals(taubench[0])
    assert trace.meta["tools"].endswith("tau_bench/airline_tools_schema.json")


# ----------------------------------------------------------------------------------------------------------------
# Options


def test_tools_option(tmp_path, raw):
    trajs, tools = raw
    (tmp_path / "a").mkdir()
    bare = small_file(tmp_path / "a", trajs[:3], tools=False)
    with pytest.raises(ValueError, match="no tool schemas file"):
        load(bare)
    without, report = load(bare, tools="none")
    with_tools, _ = load(bare, tools=data.TAUBENCH_TOOLS)
    assert len(without) == len(with_tools) == sum(m["role"] == "assistant" for s in trajs[:3] for m in s["traj"])
    system = [trajs[0]["traj"][0]]
    schema_tokens = ChatTemplate().render(system, tools)[0].size - ChatTemplate().render(system)[0].size
    assert schema_tokens > 2800
    assert (with_tools.prompt_tokens - without.prompt_tokens == schema_tokens).all()
    assert not (without.prompt_types == TokenType.TEMPLATE).any()
    found, _ = load(small_file(tmp_path, trajs[:3]))
    assert found.equals(with_tools)
    # a retail file looks for retail_tools_schema.json first
    retail = tmp_path / "b"
    retail.mkdir()
    (retail / "retail_trajs.json").write_text(json.dumps(trajs[:1]))
    (retail / "retail_tools_schema.json").write_text(json.dumps(tools[:2]))
    r, rep = load(retail / "retail_trajs.json")
    assert "2 from" in "\n".join(rep.notes) and len(r) > 0


def test_registry_max_sessions_seed_and_start_times(tmp_path, raw):
    trajs, _ = raw
    path = small_file(tmp_path, trajs[:6])
    a, _ = load_source("taubench", path, max_sessions=4, seed=3)
    assert sorted(set(a.session.tolist())) == [0, 1, 2, 3]
    b, _ = load(path, max_sessions=4, seed=3)
    assert a.equals(b)
    starts = np.array([10.0, 0.0, 5.0, 7.0, 1.0, 2.0])
    c, _ = load(path, start_times=starts)
    firsts = c.turn == 1
    assert np.array_equal(c.t[firsts][np.argsort(c.session[firsts])], starts)
    d, _ = load(path, tool_gap_mu=-3.0, tool_gap_sigma=0.0, user_gap_mu=3.0, user_gap_sigma=0.0)
    gaps = set()
    index = by_session_turn(d)
    for (sid, turn), i in index.items():
        if (sid, turn + 1) in index:
            gaps.add(round(float(d.t[index[(sid, turn + 1)]] - d.t[i]), 6))
    assert gaps == {round(float(np.exp(-3.0)), 6), round(float(np.exp(3.0)), 6)}
    with pytest.raises(ValueError, match="unknown option"):
        load(path, gap_mu=1.0)


def test_gzip_input(tmp_path, raw):
    trajs, _ = raw
    gz = tmp_path / "airline_x.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        json.dump(trajs[:2], f, indent=1)  # pretty-printed, gzipped
    shutil.copy(data.TAUBENCH_TOOLS, tmp_path / "airline_tools_schema.json.gz")
    trace, _ = load(gz)
    plain, _ = load(small_file(tmp_path, trajs[:2], name="airline_y.json"))
    assert trace.equals(plain)


# ----------------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_file_line_and_field(tmp_path, raw):
    trajs, _ = raw
    good = trajs[0]
    cases = [
        ({"task_id": 1}, "[1].traj", "missing"),
        ("not a dict", "[1]", "must be an object"),
        ({"traj": {"role": "user"}}, "[1].traj", "non-empty list"),
        ({"traj": [{"role": "customer", "content": "x"}]}, "[1].traj[0].role", "unknown role"),
        ({"traj": [{"role": "user", "content": 3}]}, "[1].traj[0].content", "must be a string"),
        ({"traj": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
         "[1].traj[1].content", "null"),
        ({"traj": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": "f"}]},
         "[1].traj[1].tool_calls", "must be a list"),
        ({"traj": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                       "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
         "[1].traj[1].tool_calls[0].function.arguments", "JSON string or an object"),
        ({"traj": [{"role": "user", "content": "x"}]}, "[1].traj", "no assistant message"),
    ]
    for n, (bad, field, what) in enumerate(cases):
        path = tmp_path / f"airline_bad{n}.json"
        # pretty-printed: the bad trajectory starts on a known line
        text = "[\n" + json.dumps(good) + ",\n\n" + json.dumps(bad) + ",\n" + json.dumps(good) + "\n]\n"
        path.write_text(text)
        with pytest.raises(TraceFormatError) as e:
            load(path, tools="none")
        msg = str(e.value)
        assert str(path) in msg and "line 4" in msg and f"field '{field}'" in msg and what in msg, msg
        trace, report = load(path, tools="none", on_error="skip")
        assert report.rows_read == 3 and report.rows_rejected == 1
        assert sorted(set(trace.session.tolist())) == [0, 2]


def test_malformed_files(tmp_path):
    # structural errors raise even with on_error="skip": nothing after them can be read
    for text, match in [("", "empty file"), ('{"traj": []}', "must be a JSON list"), ("[{]", "malformed JSON"),
                        ('[{"traj": []} {}]', "expected ',' or ']'"), ("[] x", "extra data"),
                        ('[\n{"a": 1},\n{"b": tru}\n]', "line 3")]:
        path = tmp_path / "airline_m.json"
        path.write_text(text)
        with pytest.raises(TraceFormatError, match=match.replace("[", r"\[")) as e:
            load(path, tools="none", on_error="skip")
        assert str(path) in str(e.value)
    path.write_text("[]")
    assert len(load(path, tools="none")[0]) == 0
    bad_tools = tmp_path / "tools.json"
    bad_tools.write_text('{"a": 1}')
    with pytest.raises(TraceFormatError, match="list of tool schemas"):
        load(path, tools=bad_tools)
