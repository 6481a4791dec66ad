"""GSM8K problems rendered through a few-shot chain-of-thought prompt -> Trace of templated single-turn requests.

Input: JSON lines, one problem a line, as OpenAI's grade-school-math release writes them: ``{"question": str,
"answer": str}``, where ``answer`` is the human-written step-by-step solution with calculator annotations
(``<<48/2=24>>``) and a last line ``#### <final answer>``. Other keys are ignored.

Rendering (the prompt style of Wei et al. 2022, "Chain-of-Thought Prompting Elicits Reasoning in Large Language
Models", as EleutherAI's lm-evaluation-harness task ``gsm8k_cot`` writes it): every request's prompt is the same
``shots`` worked examples (default all 8 of the paper's GSM8K exemplars, ``sae_env/data/gsm8k/cot_exemplars.json``)
as ``Q: {question}\\nA: {answer}\\n\\n``, then ``Q: {question}\\nA:``. Its output is the problem's own solution
written in the exemplars' style: calculator annotations removed, steps joined by spaces, the ``#### N`` line turned
into ``The answer is N.``: ``" {solution} The answer is N."``. So the prompt and the output text are recorded
(a published template, the dataset's questions and human-written reasoning); what a model would have generated is
stood in for by the human solution. Token types: the exemplars TEMPLATE, the question USER, the output REASONING
(a chain of thought: nothing later reuses it). Text is tokenized segment by segment (the exemplar block, the
question, the output) with :func:`~sae_env.tokenizer.get_tokenizer`; only full ``block_size``-token blocks are
kept, the block straddling the prompt / output boundary counts as output (as in
:mod:`~sae_env.sources.conversations`).

Requests: session id = the problem's index in the file (0-based, counting rejected rows), turn 1, app SINGLE_TURN.
Arrival times (modelled; the data have none, written to ``report.notes``): Poisson at ``rate`` requests/s (first at
t = 0) or the given ``start_times``, seeded by ``seed``. In a :mod:`~sae_env.sources.mix` each request is a session
of its own and takes the mix's start times instead.

Options: ``block_size`` (16), ``shots`` (8; 0..the number of exemplars), ``exemplars`` (a JSON file in the format of
the embedded one, for another template), ``seed`` (0), ``arrival`` / ``rate`` (0.5) / ``start_times``, ``tokenizer``,
``max_problems``, ``on_error`` (``raise`` | ``skip``). With ``path=None`` the embedded GSM8K test set (1,319
problems, MIT) is loaded.

A malformed row (not JSON, not an object, a missing or empty ``question``, an ``answer`` without a ``#### `` line)
raises :class:`~sae_env.trace.TraceFormatError` naming file, line and field, or with ``on_error="skip"`` is dropped
and counted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.inputs import check_options, lone_surrogate, open_text
from sae_env.sources.conversations import common_setup, int_option, parse_arrivals
from sae_env.trace import (
    AppType,
    LoadReport,
    TokenType,
    Trace,
    TraceFormatError,
    chain_requests,
    csr_offsets,
    token_blocks,
)

__all__ = ["load", "load_exemplars", "render_solution"]

SOURCE = "gsm8k"
_OPTIONS = {"block_size", "shots", "exemplars", "seed", "arrival", "rate", "start_times", "tokenizer",
            "max_problems", "on_error"}
_CALC = re.compile(r"<<[^<>]*>>")
_FINAL = re.compile(r"\n?####\s*(.*?)\s*$", re.S)


def render_solution(answer: str) -> str:
    """A GSM8K solution in the exemplars' style: no ``<<calc>>`` annotations, steps on one line, the ``#### N``
    line as ``The answer is N.``; ValueError when there is no ``####`` line or no final answer after it."""
    m = _FINAL.search(answer)
    if m is None or "####" not in answer:
        raise ValueError("has no final '#### <answer>' line")
    final = m.group(1).strip()
    if not final:
        raise ValueError("has nothing after '####'")
    steps = " ".join(s.strip() for s in _CALC.sub("", answer[:m.start()]).splitlines() if s.strip())
    return f"{steps} The answer is {final}." if steps else f"The answer is {final}."


def load_exemplars(path: str | os.PathLike | None = None) -> tuple[list[dict[str, str]], str]:
    """The worked examples of a template file (default: the embedded 8-shot CoT exemplars) and its provenance."""
    from sae_env import data

    path = Path(data.GSM8K_EXEMPLARS if path is None else path)
    with open_text(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"malformed JSON ({e.msg}, column {e.colno})", path=path, line=e.lineno) from e
    items = doc.get("exemplars") if isinstance(doc, Mapping) else None
    if not isinstance(items, list) or not items:
        raise TraceFormatError("must be an object with a non-empty list 'exemplars'", path=path, field="exemplars")
    for i, ex in enumerate(items):
        for key in ("question", "answer"):
            if not (isinstance(ex, Mapping) and isinstance(ex.get(key), str) and ex[key].strip()):
                raise TraceFormatError("must be a non-empty string", path=path, field=f"exemplars[{i}].{key}")
    return [{"question": ex["question"], "answer": ex["answer"]} for ex in items], str(doc.get("source", path))


def _parse_row(line: str) -> tuple[str, str]:
    """``(question, rendered solution)`` of one row; ValueError with ``(field, message)`` args when malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(None, f"malformed JSON ({e.msg}, column {e.colno})", "malformed JSON") from None
    if not isinstance(obj, Mapping):
        raise ValueError(None, f"a row must be a JSON object, got {type(obj).__name__}", "not an object")
    bad_text = lone_surrogate(obj) if "\\u" in line else None
    if bad_text is not None:
        raise ValueError(bad_text, "holds half a UTF-16 surrogate pair (a lone \\uD800-\\uDFFF escape), not text",
                         "not text")
    q, a = obj.get("question"), obj.get("answer")
    if not isinstance(q, str) or not q.strip():
        raise ValueError("question", "missing, empty or not a string", "bad question")
    if not isinstance(a, str):
        raise ValueError("answer", "missing or not a string", "bad answer")
    try:
        return q.strip(), render_solution(a)
    except ValueError as e:
        raise ValueError("answer", str(e), "bad answer") from None


def load(path: str | os.PathLike | None = None, **options: Any) -> tuple[Trace, LoadReport]:
    """Load GSM8K-style problems as templated single-turn requests (module docstring); ``path=None``: embedded."""
    check_options(SOURCE, options, _OPTIONS)
    from sae_env import data

    path = Path(data.GSM8K if path is None else path)
    bs, rng, template, on_error = common_setup(SOURCE, options)
    tokenizer = template.tokenizer
    # Each request is a one-call session; the gap options of the chat sources do not apply (none is accepted).
    arrivals = parse_arrivals(options, ("", "", 0.0, 0.0), None)
    exemplars, provenance = load_exemplars(options.get("exemplars"))
    shots = int_option("shots", options.get("shots", len(exemplars)), 0)
    if shots > len(exemplars):
        raise ValueError(f"source '{SOURCE}': option 'shots' is {shots} but the template has {len(exemplars)} "
                         "exemplars")
    max_problems = options.get("max_problems")
    if max_problems is not None:
        max_problems = int_option("max_problems", max_problems, 0)

    report = LoadReport(source=SOURCE, path=str(path))
    questions: list[str] = []
    solutions: list[str] = []
    index: list[int] = []
    with open_text(path) as f:
        row = -1
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if max_problems is not None and len(questions) >= max_problems:
                break
            row += 1
            report.rows_read += 1
            try:
                q, s = _parse_row(line)
            except ValueError as e:
                field, message, reason = e.args
                if on_error == "raise":
                    raise TraceFormatError(message, path=path, line=lineno, field=field) from None
                report.reject(reason)
                continue
            questions.append(q)
            solutions.append(s)
            index.append(row)
    if row < 0:
        raise TraceFormatError("empty file", path=path)
    if not questions:
        raise TraceFormatError(f"no valid rows ({report.rows_rejected} rejected: {dict(report.rejected)})",
                               path=path)

    prefix = "".join(f"Q: {ex['question']}\nA: {ex['answer']}\n\n" for ex in exemplars[:shots])
    prefix_ids = np.asarray(tokenizer.encode(prefix), dtype=np.int64) if prefix else np.zeros(0, dtype=np.int64)
    n = len(questions)
    seqs, seq_types, n_prompt = [], [], np.zeros(n, dtype=np.int64)
    prompt_tokens, output_tokens = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for i, (q, s) in enumerate(zip(questions, solutions, strict=True)):
        q_ids = np.asarray(tokenizer.encode(f"Q: {q}\nA:"), dtype=np.int64)
        o_ids = np.asarray(tokenizer.encode(f" {s}"), dtype=np.int64)
        ids = np.concatenate([prefix_ids, q_ids, o_ids])
        types = np.concatenate([np.full(prefix_ids.size, int(TokenType.TEMPLATE), dtype=np.int8),
                                np.full(q_ids.size, int(TokenType.USER), dtype=np.int8),
                                np.full(o_ids.size, int(TokenType.REASONING), dtype=np.int8)])
        content, btypes = token_blocks(ids, types, bs)
        seqs.append(content)
        seq_types.append(btypes)
        prompt_tokens[i] = prefix_ids.size + q_ids.size
        output_tokens[i] = o_ids.size
        n_prompt[i] = prompt_tokens[i] // bs
    lengths = np.array([c.size for c in seqs], dtype=np.int64)
    pk, po, ok, oo = chain_requests(np.concatenate(seqs), csr_offsets(lengths), n_prompt)
    all_types = np.concatenate(seq_types)
    pos = np.arange(all_types.size, dtype=np.int64) - np.repeat(csr_offsets(lengths)[:-1], lengths)
    is_prompt = pos < np.repeat(n_prompt, lengths)
    t = arrivals.call_times(np.ones(n, dtype=np.int64), np.zeros(n, dtype=bool), rng)

    meta = {"source": SOURCE, "path": str(path), "tokenizer": tokenizer.name, "template": "few-shot CoT",
            "template_source": provenance, "shots": shots, "block_size": bs, "seed": options.get("seed", 0),
            "arrival": arrivals.arrival, "rate": arrivals.rate, "problems": n}
    trace = Trace(t=t, session=np.asarray(index, dtype=np.int64), turn=np.ones(n, dtype=np.int64),
                  app=np.full(n, int(AppType.SINGLE_TURN), dtype=np.int8), prompt_tokens=prompt_tokens,
                  output_tokens=output_tokens, prompt_offsets=po, prompt_keys=pk,
                  prompt_types=all_types[is_prompt], output_offsets=oo, output_keys=ok,
                  output_types=all_types[~is_prompt], block_size=bs, meta=meta, validate=False)
    trace = trace.with_times(t)  # sorts by time (stable) and validates
    report.notes += [
        f"tokenizer {tokenizer.name}; few-shot chain-of-thought prompt, {shots} exemplars ({provenance}): "
        f"{prefix_ids.size} shared TEMPLATE tokens, then 'Q: <question>\\nA:' (USER)",
        "output = the human-written solution in the exemplars' style (calculator annotations removed, "
        "'#### N' -> 'The answer is N.'), type REASONING; full "
        f"{bs}-token blocks only, the block straddling prompt/output counts as output",
        f"arrival (assumed; the data have no times): {arrivals.describe()}; every request is a one-call session "
        "(app single_turn)",
    ]
    return trace, report
