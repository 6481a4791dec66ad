"""tau-bench agent trajectories -> Trace (one request per LLM call of a tool-using agent).

Input: a JSON list (optionally gzipped) of ``{task_id, trial, reward, info, traj}``, where ``traj`` is an
OpenAI-style message list (system / user / assistant with text or ``tool_calls`` / tool), as tau-bench writes it;
plus the OpenAI ``tools`` list (the function schemas the agent was given with every call).

Each assistant message is one LLM call: its prompt is the ChatML rendering of the tool schemas (in the system
message, as Qwen2.5 renders tools) and every message before it, its output that assistant message (text or tool
calls). Tool results are TOOL_OUTPUT, the schemas TEMPLATE. Rendering, block cutting and chaining are the shared
chat pipeline of :func:`sae_env.sources.conversations.build_chat_trace`. app = AGENT; session id = index of the
trajectory in the list; turn = 1, 2, ... over its calls.

Arrival times are assumptions (the file has no times), recorded in ``report.notes``: sessions start by the same
arrival process as conversations (Poisson, ``rate`` sessions/s, or ``start_times``); a call that follows a tool
result arrives ``exp(N(tool_gap_mu, tool_gap_sigma))`` seconds after its predecessor's arrival (defaults 0.0, 0.8:
median 1 s, i.e. decode of a short tool call plus tool latency), a call that follows a (simulated) user message
``exp(N(user_gap_mu, user_gap_sigma))`` seconds after it (defaults 2.5, 0.9: median ~12 s of reading and typing).

Options: ``tools`` (path of the schemas file; default: ``airline_tools_schema.json[.gz]`` or
``{domain}_tools_schema.json[.gz]`` next to the trajectories, where ``domain`` is the file name up to its first
``_``; ``"none"`` renders no schemas), ``block_size`` (16), ``seed`` (0), ``arrival``, ``rate`` (0.5),
``start_times``, ``tool_gap_mu``, ``tool_gap_sigma``, ``user_gap_mu``, ``user_gap_sigma``, ``tokenizer``,
``max_sessions``, ``on_error`` ("raise" | "skip" a malformed trajectory), ``features`` / ``feature_dim`` (per-call
prompt text features, as for :mod:`~sae_env.sources.conversations`). With ``path=None`` the embedded airline
trajectories and their schemas are loaded.

Malformed input raises :class:`~sae_env.trace.TraceFormatError` naming the file, the line where the trajectory
starts (the file is often a single line, so the field also names the trajectory index: ``[17].traj[4].role``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sae_env.inputs import check_options, lone_surrogate, open_text
from sae_env.sources.conversations import (
    COMMON_OPTIONS,
    BadMessage,
    ChatSession,
    build_chat_trace,
    common_setup,
    feature_note,
    feature_option,
    gap_note,
    int_option,
    normalize_messages,
    parse_arrivals,
    pipeline_notes,
)
from sae_env.trace import AppType, LoadReport, Trace, TraceFormatError

__all__ = ["load", "load_tools"]

SOURCE = "taubench"
DEFAULT_TOOL_GAP = (0.0, 0.8)  # ln s: median 1 s between a call and the next one after its tool result
DEFAULT_USER_GAP = (2.5, 0.9)  # ln s: median ~12 s for a (simulated) customer to answer
_OPTIONS = COMMON_OPTIONS | {"tools", "tool_gap_mu", "tool_gap_sigma", "user_gap_mu", "user_gap_sigma",
                              "max_sessions"}
_WS = re.compile(r"[ \t\n\r]*")


def load_tools(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read an OpenAI ``tools`` list (JSON, optionally gzipped)."""
    with open_text(path) as f:
        try:
            tools = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"malformed JSON ({e.msg}, column {e.colno})", path=path, line=e.lineno) from e
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise TraceFormatError("must be a JSON list of tool schemas (objects)", path=path, field="tools")
    return tools


def _find_tools(path: Path) -> Path | None:
    names = ["airline_tools_schema.json"]
    domain = path.name.split("_")[0]
    if domain and domain != "airline":
        names.insert(0, f"{domain}_tools_schema.json")
    for name in names:
        for candidate in (path.parent / name, path.parent / (name + ".gz")):
            if candidate.is_file():
                return candidate
    return None


def _iter_json_array(text: str, path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, element)`` of a top-level JSON array, with the line on which each element starts."""

    def line_at(pos: int) -> int:
        return 1 + text.count("\n", 0, pos)

    i = _WS.match(text).end()
    if i >= len(text):
        raise TraceFormatError("empty file", path=path)
    if text[i] != "[":
        raise TraceFormatError("must be a JSON list of trajectories", path=path, line=line_at(i))
    decoder = json.JSONDecoder()
    line, last = 1, 0
    i = _WS.match(text, i + 1).end()
    if text.startswith("]", i):
        i += 1
    else:
        while True:
            line += text.count("\n", last, i)  # incremental: the file may be one huge line or pretty-printed
            last = i
            try:
                obj, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"malformed JSON ({e.msg}, column {e.colno})", path=path,
                                       line=e.lineno) from e
            yield line, obj
            i = _WS.match(text, end).end()
            if text.startswith("]", i):
                i += 1
                break
            if not text.startswith(",", i):
                raise TraceFormatError("malformed JSON (expected ',' or ']' after a trajectory)", path=path,
                                       line=line_at(i))
            i = _WS.match(text, i + 1).end()
    if _WS.match(text, i).end() != len(text):
        raise TraceFormatError("extra data after the JSON list", path=path, line=line_at(i))


def load(path: str | os.PathLike | None = None, **options: Any) -> tuple[Trace, LoadReport]:
    """Load tau-bench trajectories (module docstring); ``path=None`` loads the embedded airline data."""
    check_options(SOURCE, options, _OPTIONS)
    from sae_env import data

    path = Path(data.TAUBENCH if path is None else path)
    bs, rng, template, on_error = common_setup(SOURCE, options)
    feature_dim = feature_option(SOURCE, options)
    arrivals = parse_arrivals(options, ("user_gap_mu", "user_gap_sigma", *DEFAULT_USER_GAP),
                              ("tool_gap_mu", "tool_gap_sigma", *DEFAULT_TOOL_GAP))
    max_sessions = options.get("max_sessions")
    if max_sessions is not None:
        max_sessions = int_option("max_sessions", max_sessions, 0)

    tools_opt = options.get("tools")
    if tools_opt == "none":
        tools, tools_path = None, None
    else:
        if tools_opt is None:
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file")
            tools_path = _find_tools(path)
            if tools_path is None:
                raise ValueError(f"{path}: no tool schemas file next to it (airline_tools_schema.json[.gz]); pass "
                                 "the option tools=PATH, or tools='none' to render no schemas")
        else:
            tools_path = Path(tools_opt)
        tools = load_tools(tools_path)

    report = LoadReport(source=SOURCE, path=str(path))
    with open_text(path) as f:
        text = f.read()
    sessions: list[ChatSession] = []
    trailing = 0
    may_escape = "\\u" in text
    for index, (line, rec) in enumerate(_iter_json_array(text, path)):
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
        report.rows_read += 1
        try:
            if not isinstance(rec, Mapping):
                raise BadMessage(f"[{index}]", f"a trajectory must be an object, got {type(rec).__name__}",
                                 "not an object")
            if "traj" not in rec:
                raise BadMessage(f"[{index}].traj", "missing", "missing traj")
            bad_text = lone_surrogate(rec["traj"], f"[{index}].traj") if may_escape else None
            if bad_text is not None:
                raise BadMessage(bad_text, "holds half a UTF-16 surrogate pair (a lone \\uD800-\\uDFFF escape), "
                                 "not text", "not text")
            msgs = normalize_messages(rec["traj"], f"[{index}].traj")
        except BadMessage as e:
            if on_error == "raise":
                raise TraceFormatError(e.message, path=path, line=line, field=e.field) from None
            report.reject(e.reason)
            continue
        roles = [m["role"] for m in msgs]
        if "assistant" not in roles:
            if on_error == "raise":
                raise TraceFormatError("has no assistant message (no LLM call)", path=path, line=line,
                                       field=f"[{index}].traj")
            report.reject("no assistant message")
            continue
        trailing += len(roles) - 1 - (len(roles) - 1 - roles[::-1].index("assistant"))
        sessions.append(ChatSession(messages=msgs, session=index, app=AppType.AGENT, tools=tools,
                                    meta={k: rec.get(k) for k in ("task_id", "trial", "reward")}))

    meta = {"source": SOURCE, "path": str(path), "tools": None if tools_path is None else str(tools_path),
            "tokenizer": template.tokenizer.name, "template": "chatml-qwen2.5", "block_size": bs,
            "seed": options.get("seed", 0), "sessions": len(sessions), "arrival": arrivals.arrival,
            "rate": arrivals.rate, "tool_gap": list(arrivals.tool_gap), "user_gap": list(arrivals.user_gap)}
    if feature_dim is not None:
        meta["features"] = {"kind": "ngram", "dim": feature_dim}
    trace = build_chat_trace(sessions, template=template, block_size=bs, arrivals=arrivals, rng=rng, meta=meta,
                             feature_dim=feature_dim)
    report.notes += pipeline_notes(template, bs)
    report.notes += feature_note(feature_dim)
    report.notes.append(gap_note(arrivals, tool=True))
    report.notes.append(f"{len(sessions)} sessions, {len(trace)} calls, app = agent; tool schemas: "
                        f"{'none' if tools is None else f'{len(tools)} from {tools_path}'}")
    if trailing:
        report.notes.append(f"{trailing} message(s) after the last assistant message of their session (the "
                            "final user or tool message) produce no call")
    return trace, report
