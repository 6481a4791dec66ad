"""Tests of the GSM8K source: few-shot chain-of-thought requests, facts of the real file, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sae_env import data
from sae_env.inputs import open_text
from sae_env.sources import load_source, open_trace
from sae_env.sources.gsm8k import load, load_exemplars, render_solution
from sae_env.tokenizer import get_tokenizer
from sae_env.trace import AppType, TokenType, TraceFormatError

SHARED = Path("/work/shared/data/gsm8k/gsm8k_test.jsonl")


@pytest.fixture(scope="module")
def gsm8k():
    return load(None)


@pytest.fixture(scope="module")
def rows():
    with open_text(data.GSM8K) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_text(question: str, shots: int = 8) -> str:
    exemplars, _ = load_exemplars()
    return "".join(f"Q: {e['question']}\nA: {e['answer']}\n\n" for e in exemplars[:shots]) + f"Q: {question}\nA:"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_real_file_facts(gsm8k, rows):
    trace, report = gsm8k
    assert report.rows_read == len(rows) == len(trace) == 1319 and report.rows_rejected == 0
    assert (trace.app == AppType.SINGLE_TURN).all() and (trace.turn == 1).all()
    assert sorted(trace.session.tolist()) == list(range(1319))  # one session per problem, by its row
    assert (np.diff(trace.t) >= 0).all() and trace.t[0] == 0.0
    # The 8 exemplars (Wei et al. 2022) are the same 599 tokens before every question: 37 full TEMPLATE blocks
    # shared by every request.
    n_shared = 599 // 16
    heads = np.stack([trace.prompt_blocks(i)[0][:n_shared] for i in range(len(trace))])
    assert (heads == heads[0]).all()
    assert (np.stack([trace.prompt_blocks(i)[1][:n_shared] for i in range(len(trace))]) == TokenType.TEMPLATE).all()
    types = np.bincount(trace.output_types, minlength=len(TokenType))
    assert types[TokenType.REASONING] > 0.85 * trace.n_output_blocks  # the rest straddle the question's end
    assert trace.meta["shots"] == 8 and "Wei et al." in trace.meta["template_source"]


def test_prompts_are_the_published_template_and_share_exactly_their_common_tokens(gsm8k, rows):
    """Differential: two requests share as many leading prompt keys as full blocks of their common token prefix
    (tokenizing each whole prompt text independently), and the token counts are the rendered texts'."""
    trace, _ = gsm8k
    tok = get_tokenizer(None)
    by_row = {int(s): i for i, s in enumerate(trace.session)}
    picks = [0, 1, 2, 77, 500, 1318]
    ids = {r: tok.encode(prompt_text(rows[r]["question"].strip())) for r in picks}
    for r in picks:
        assert trace.prompt_tokens[by_row[r]] == len(ids[r])
    for a in picks:
        for b in picks:
            if a < b:
                ka, kb = trace.prompt_blocks(by_row[a])[0], trace.prompt_blocks(by_row[b])[0]
                shared = common_prefix(ka.tolist(), kb.tolist())
                assert shared == common_prefix(ids[a], ids[b]) // 16, (a, b)


def test_render_solution(rows):
    assert render_solution(rows[0]["answer"]) == ("Janet sells 16 - 3 - 4 = 9 duck eggs a day. She makes 9 * 2 = $18 "
                                                  "every day at the farmer\u2019s market. The answer is 18.")
    assert render_solution("#### 5") == "The answer is 5."
    for bad in ("no final line", "2 + 3 = 5\n####", "####   \n"):
        with pytest.raises(ValueError):
            render_solution(bad)
    for r in rows:  # every real solution renders, without annotations
        text = render_solution(r["answer"])
        assert "<<" not in text and "####" not in text and text.endswith(".")


def test_output_tokens_are_the_rendered_solution(gsm8k, rows):
    trace, _ = gsm8k
    tok = get_tokenizer(None)
    i = int(np.flatnonzero(trace.session == 7)[0])
    assert trace.output_tokens[i] == len(tok.encode(" " + render_solution(rows[7]["answer"])))


def test_shots_seed_rate_and_registry():
    full, _ = load(None, max_problems=40)
    zero, _ = load(None, max_problems=40, shots=0)
    two, _ = load(None, max_problems=40, shots=2)
    assert not (zero.prompt_types == TokenType.TEMPLATE).any()
    assert (two.prompt_types == TokenType.TEMPLATE).sum() < (full.prompt_types == TokenType.TEMPLATE).sum()
    with pytest.raises(ValueError, match="'shots' is 9 but the template has 8"):
        load(None, shots=9)
    with pytest.raises(ValueError, match="unknown option"):
        load(None, gap_mu=1.0)
    a, _ = load(None, max_problems=200, seed=3, rate=2.0)
    b, _ = load(None, max_problems=200, seed=3, rate=2.0)
    c, _ = load(None, max_problems=200, seed=4, rate=2.0)
    assert a.equals(b) and not np.array_equal(a.t, c.t)
    assert 60 < a.t[-1] < 140  # 199 Poisson gaps at 2/s
    st, _ = load(None, max_problems=3, start_times=[5.0, 1.0, 9.0])
    assert st.t.tolist() == [1.0, 5.0, 9.0] and st.session.tolist() == [1, 0, 2]
    by_name, _ = open_trace("gsm8k")
    assert by_name.equals(load_source("gsm8k", None)[0])
    recut, _ = open_trace("gsm8k", options={"max_problems": 5}, block_size=32)
    assert recut.block_size == 32


def test_shared_copy_gives_the_same_trace(gsm8k):
    if not SHARED.exists():
        pytest.skip("the shared data folder is not mounted")
    assert load(SHARED)[0].equals(gsm8k[0])


def test_own_exemplars_file(tmp_path):
    path = tmp_path / "two_shot.json"
    path.write_text(json.dumps({"source": "mine", "exemplars": [{"question": "1+1?", "answer": "2. The answer is 2."},
                                                                {"question": "2+2?", "answer": "The answer is 4."}]}))
    trace, report = load(None, max_problems=3, exemplars=str(path))
    assert trace.meta["template_source"] == "mine" and trace.meta["shots"] == 2
    assert any("2 exemplars (mine)" in n for n in report.notes)
    path.write_text(json.dumps({"exemplars": [{"question": "x", "answer": ""}]}))
    with pytest.raises(TraceFormatError, match=r"exemplars\[0\]\.answer"):
        load(None, exemplars=str(path))
    path.write_text("{not json")
    with pytest.raises(TraceFormatError, match="malformed JSON"):
        load(None, exemplars=str(path))


@pytest.mark.parametrize("line, field, message", [
    ("{not json", None, "malformed JSON"),
    ('["a list"]', None, "must be a JSON object"),
    ('{"answer": "#### 3"}', "question", "missing, empty or not a string"),
    ('{"question": "  ", "answer": "#### 3"}', "question", "missing, empty or not a string"),
    ('{"question": "q?", "answer": 3}', "answer", "missing or not a string"),
    ('{"question": "q?", "answer": "2 + 1 = 3"}', "answer", "no final '#### <answer>' line"),
])
def test_bad_row_names_file_line_and_field(tmp_path, line, field, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "How many?", "answer": "1 + 1 = 2\n#### 2"})
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(TraceFormatError) as e:
        load(path)
    assert e.value.line == 3 and e.value.field == field and message in str(e.value)
    trace, report = load(path, on_error="skip")
    assert len(trace) == 2 and report.rows_rejected == 1 and report.rows_read == 3
    assert trace.session.tolist() == [0, 2]  # ids count the rejected row


def test_empty_and_all_bad_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="empty file"):
        load(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(TraceFormatError, match="no valid rows"):
        load(bad, on_error="skip")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.jsonl")
