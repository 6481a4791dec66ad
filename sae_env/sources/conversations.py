"""Text conversations (WildChat, ShareGPT, Arena) -> Trace; also the chat pipeline shared with tau-bench.

Input: JSON lines, one conversation a line, in any of these layouts (roles are mapped, case-insensitively:
human/user -> user; gpt/assistant/chatgpt/bard/bing/model/bot -> assistant; system; tool/function/observation ->
tool):

* WildChat / OpenAI: ``{"id", "metadata", "messages": [{"role", "content"}, ...]}``; an assistant message may carry
  OpenAI ``tool_calls`` and ``reasoning_content`` / ``reasoning``; a row may carry an OpenAI ``tools`` list.
* ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value"}, ...]}``.
* Arena: ``{"conversation": [...]}`` (LMSYS-Chat-1M), or ``{"conversation_a": [...], "conversation_b": [...]}``
  (Chatbot Arena: both sides were served, so both become sessions).

``content`` is a string, or a list of ``{"type": "text", "text"}`` parts (joined), or null for an assistant message
that only calls tools.

The pipeline (:func:`build_chat_trace`, also used by :mod:`sae_env.sources.taubench`):

1. Every assistant message is one LLM call. Its prompt is the ChatML rendering of every message before it
   (:class:`~sae_env.tokenizer.ChatTemplate`, Qwen2.5 format) plus the generation prompt
   ``<|im_start|>assistant\\n``; its output is the assistant message as generated (reasoning included) +
   ``<|im_end|>\\n``. A conversation is rendered once; a call's prompt is a prefix of that history stream.
2. The call's whole sequence (prompt + output) is cut into ``block_size``-token blocks and only full blocks are kept
   (vLLM caches full blocks only). Prompt keys = the full blocks inside the prompt; output keys = the full blocks of
   the whole sequence beyond those (the block straddling the prompt / output boundary is an output block: it
   completes during decode). Block type = the dominant token type. Block contents of all calls are hashed in one
   vectorised pass, and all calls are chained at once by :func:`~sae_env.trace.chain_requests`.
3. Arrival times (the data have none; these are modelling assumptions, written to ``report.notes``): sessions start
   by a Poisson process (``rate`` sessions/s, first session at t = 0) or at given ``start_times``; each later call
   arrives a log-normal gap after its predecessor's arrival (so the gap includes the predecessor's decode time).
   For conversations the gap is ``exp(N(gap_mu, gap_sigma))`` with Mooncake's fitted inter-turn gap
   (mu = 4.88, sigma = 0.98 ln s, median ~2 min, data/README.md). Seeded by ``seed``: starts are drawn first,
   then one gap per call, so a seed gives the same times on every run.

Session id = index of the conversation in the input (0-based, counting rejected ones, so ids do not move when
``on_error="skip"`` drops a row); turn = 1, 2, ... over its calls; app = CHAT for a conversation with more than one
assistant message, SINGLE_TURN otherwise. Messages after the last assistant message (e.g. a trailing user message)
produce no call and are counted in the notes; so are conversations that start with an assistant message (its
call has an empty history) and assistant messages that follow another assistant message (a "continue" call whose
history holds the previous reply).

Options: ``block_size`` (16), ``seed`` (0), ``arrival`` ("poisson", or "start_times" when ``start_times`` is
given), ``rate`` (0.5 sessions/s), ``start_times`` (array of session start times, at least one per session),
``gap_mu`` (4.88), ``gap_sigma`` (0.98), ``tokenizer`` (spec for :func:`~sae_env.tokenizer.get_tokenizer`,
default the simple tokenizer), ``system_prompt`` (text prepended to every conversation as a system message),
``max_conversations`` (stop after that many accepted conversations), ``on_error`` ("raise" | "skip"),
``features`` (None, default, or ``"ngram"``: store one row per call in ``trace.features``, the hashed n-gram vector
of the call's rendered prompt, see :func:`sae_env.features.chat_prompt_features`) and ``feature_dim`` (1536).
With ``path=None`` the embedded WildChat excerpt is loaded.

Why one piece (~590 lines): one source, one module; the chat pipeline (render, cut into blocks, chain, time) is
shared with tau-bench and only makes sense with the message normalisation that feeds it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sae_env.inputs import check_options, lone_surrogate, open_text
from sae_env.tokenizer import ChatTemplate, get_tokenizer
from sae_env.trace import (
    AppType,
    LoadReport,
    Trace,
    TraceFormatError,
    chain_requests,
    concat_ranges,
    csr_offsets,
    token_blocks,
)

__all__ = [
    "COMMON_OPTIONS",
    "Arrivals",
    "BadMessage",
    "ChatSession",
    "build_chat_trace",
    "common_setup",
    "feature_option",
    "gap_note",
    "int_option",
    "load",
    "normalize_messages",
    "parse_arrivals",
    "pipeline_notes",
]

SOURCE = "conversations"
DEFAULT_GAP_MU = 4.88  # ln s; Mooncake conversation trace, inter-turn gaps fitted to a log-normal (data/README.md)
DEFAULT_GAP_SIGMA = 0.98
DEFAULT_RATE = 0.5  # sessions per second

COMMON_OPTIONS = {"block_size", "seed", "rate", "arrival", "start_times", "tokenizer", "on_error", "features",
                  "feature_dim"}
_OPTIONS = COMMON_OPTIONS | {"gap_mu", "gap_sigma", "system_prompt", "max_conversations"}

ROLE_ALIASES: dict[str, str] = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "bot": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}


# ----------------------------------------------------------------------------------------------------------------
# Message validation (shared with tau-bench)


class BadMessage(ValueError):
    """A message list is malformed: ``field`` says where (e.g. ``messages[3].content``), ``reason`` is the short
    category counted in the load report."""

    def __init__(self, field: str | None, message: str, reason: str):
        super().__init__(message)
        self.field, self.message, self.reason = field, message, reason


def _content_text(value: Any, role: str, has_calls: bool, where: str) -> str | None:
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant" and has_calls:
            return None
        raise BadMessage(where, "is null (only an assistant message with tool_calls may have no content)",
                         "bad content")
    if isinstance(value, list):
        parts = []
        for n, part in enumerate(value):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadMessage(f"{where}[{n}]", "content parts must be {'type': 'text', 'text': str}",
                                 "bad content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadMessage(where, f"must be a string, got {type(value).__name__}", "bad content")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise BadMessage(where, f"must be a list, got {type(value).__name__}", "bad tool_calls")
    calls = []
    for n, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise BadMessage(f"{where}[{n}]", "must be an object with a 'function'", "bad tool_calls")
        if not isinstance(fn.get("name"), str):
            raise BadMessage(f"{where}[{n}].function.name", "must be a string", "bad tool_calls")
        args = fn.get("arguments", {})
        if not isinstance(args, (str, Mapping, list)):
            raise BadMessage(f"{where}[{n}].function.arguments", "must be a JSON string or an object",
                             "bad tool_calls")
        calls.append({"function": {"name": fn["name"], "arguments": args}})
    return calls


def normalize_messages(raw: Any, key: str) -> list[dict[str, Any]]:
    """Validate a message list and map it to the template's format (``role``, ``content`` and, for an assistant,
    ``tool_calls`` / ``reasoning_content``). Accepts ``role``/``content`` and ShareGPT ``from``/``value`` keys.
    Raises :class:`BadMessage` naming the field (``{key}[i].role``, ...)."""
    if not isinstance(raw, list) or not raw:
        raise BadMessage(key, "must be a non-empty list of messages", "bad messages")
    out = []
    for i, m in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(m, Mapping):
            raise BadMessage(where, f"must be an object, got {type(m).__name__}", "bad messages")
        role_key = "role" if "role" in m else "from" if "from" in m else None
        if role_key is None:
            raise BadMessage(f"{where}.role", "missing", "bad role")
        role = m[role_key]
        mapped = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
        if mapped is None:
            raise BadMessage(f"{where}.{role_key}", f"unknown role {role!r} (expected one of "
                             f"{sorted(ROLE_ALIASES)})", "bad role")
        calls = None
        if mapped == "assistant" and m.get("tool_calls") is not None:
            calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls") or None
        content_key = "content" if "content" in m else "value" if "value" in m else None
        if content_key is None:
            raise BadMessage(f"{where}.content", "missing", "bad content")
        msg: dict[str, Any] = {"role": mapped,
                               "content": _content_text(m[content_key], mapped, bool(calls),
                                                        f"{where}.{content_key}")}
        if calls:
            msg["tool_calls"] = calls
        if mapped == "assistant":
            for rk in ("reasoning_content", "reasoning"):
                r = m.get(rk)
                if r is not None:
                    if not isinstance(r, str):
                        raise BadMessage(f"{where}.{rk}", f"must be a string, got {type(r).__name__}",
                                         "bad content")
                    msg["reasoning_content"] = r
                    break
        out.append(msg)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Arrival model (shared with tau-bench)


@dataclass(frozen=True)
class Arrivals:
    """When sessions start and how long each call waits after its predecessor (see the module docstring)."""

    arrival: str = "poisson"
    rate: float = DEFAULT_RATE
    start_times: np.ndarray | None = None
    user_gap: tuple[float, float] = (DEFAULT_GAP_MU, DEFAULT_GAP_SIGMA)  # (mu, sigma), ln seconds
    tool_gap: tuple[float, float] = (DEFAULT_GAP_MU, DEFAULT_GAP_SIGMA)  # after a tool result

    def session_starts(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.arrival == "poisson":
            gaps = rng.exponential(1.0 / self.rate, size=max(n - 1, 0))
            return np.concatenate([[0.0], np.cumsum(gaps)])[:n]
        st = self.start_times
        if st is None or st.size < n:
            raise ValueError(f"start_times has {0 if st is None else st.size} entries but there are {n} sessions")
        return st[:n].astype(np.float64, copy=True)

    def call_times(self, calls_per_session: np.ndarray, after_tool: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
        """Arrival time of every call (calls grouped by session, in order)."""
        counts = np.asarray(calls_per_session, dtype=np.int64)
        starts = self.session_starts(counts.size, rng)
        mu = np.where(after_tool, self.tool_gap[0], self.user_gap[0])
        sigma = np.where(after_tool, self.tool_gap[1], self.user_gap[1])
        steps = rng.lognormal(mu, sigma) if mu.size else np.zeros(0)
        live = counts > 0  # a session without calls keeps its start draw (stable seeding) but places nothing
        first = csr_offsets(counts)[:-1][live]
        steps[first] = starts[live]
        # a cumulative sum per session: one global cumsum, minus what the earlier sessions contributed
        cs = np.cumsum(steps)
        return cs - np.repeat(cs[first] - starts[live], counts[live])

    def describe(self) -> str:
        start = (f"Poisson session starts at {self.rate:g} sessions/s (first at t=0)" if self.arrival == "poisson"
                 else "session starts from the given start_times")
        return start


def _finite(name: str, v: Any, positive: bool = False, nonneg: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise ValueError(f"option '{name}' must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise ValueError(f"option '{name}' must be > 0, got {v!r}")
    if nonneg and v < 0:
        raise ValueError(f"option '{name}' must be >= 0, got {v!r}")
    return float(v)


def int_option(name: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"option '{name}' must be an integer >= {minimum}, got {v!r}")
    return int(v)


def parse_arrivals(options: Mapping[str, Any], user_gap: tuple[str, str, float, float],
                   tool_gap: tuple[str, str, float, float] | None) -> Arrivals:
    """Read ``arrival`` / ``rate`` / ``start_times`` and the gap options (``(mu name, sigma name, mu default,
    sigma default)``; ``tool_gap=None``: one gap distribution for every call)."""
    st = options.get("start_times")
    arrival = options.get("arrival", "start_times" if st is not None else "poisson")
    if arrival not in ("poisson", "start_times"):
        raise ValueError(f"option 'arrival' must be 'poisson' or 'start_times', got {arrival!r}")
    start_times = None
    if arrival == "start_times":
        if st is None:
            raise ValueError("arrival='start_times' needs the option 'start_times' (one start time per session)")
        start_times = np.asarray(st, dtype=np.float64)
        if start_times.ndim != 1 or not np.isfinite(start_times).all() or (start_times < 0).any():
            raise ValueError("option 'start_times' must be a 1-D array of finite times >= 0")
    elif st is not None:
        raise ValueError("options 'start_times' and arrival='poisson' contradict each other")

    def gap(spec: tuple[str, str, float, float]) -> tuple[float, float]:
        mu_name, sigma_name, mu, sigma = spec
        return (_finite(mu_name, options.get(mu_name, mu)),
                _finite(sigma_name, options.get(sigma_name, sigma), nonneg=True))

    ug = gap(user_gap)
    return Arrivals(arrival=arrival, rate=_finite("rate", options.get("rate", DEFAULT_RATE), positive=True),
                    start_times=start_times, user_gap=ug, tool_gap=gap(tool_gap) if tool_gap else ug)


# ----------------------------------------------------------------------------------------------------------------
# The shared pipeline: sessions -> rendered calls -> blocks -> chained keys -> Trace


@dataclass
class ChatSession:
    """One conversation or agent session: validated messages, optional tool schemas, its id and app type."""

    messages: list[dict[str, Any]]
    session: int
    app: AppType
    tools: list[Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def build_chat_trace(sessions: Sequence[ChatSession], *, template: ChatTemplate, block_size: int,
                     arrivals: Arrivals, rng: np.random.Generator, meta: Mapping[str, Any] | None = None,
                     feature_dim: int | None = None) -> Trace:
    """Render every assistant message of every session as one call and build the Trace (module docstring).

    ``feature_dim``: also store each call's prompt text features (:func:`sae_env.features.chat_prompt_features`).
    """
    bs = int(block_size)
    gen_ids, gen_types = template.generation_prompt()
    g = gen_ids.size
    pool_ids: list[np.ndarray] = [gen_ids]  # every token sequence we need, laid end to end
    pool_types: list[np.ndarray] = [gen_types]
    pos = g
    h_start: list[int] = []  # per session: where its history stream starts in the pool
    calls_per_session: list[int] = []
    call_sess: list[int] = []  # per call: session index, history tokens in its prompt, output position / length
    call_hist: list[int] = []
    call_out_start: list[int] = []
    call_out_len: list[int] = []
    after_tool: list[bool] = []
    for si, s in enumerate(sessions):
        r = template.conversation(s.messages, s.tools)
        pool_ids.append(r.tokens)
        pool_types.append(r.types)
        h_start.append(pos)
        pos += r.tokens.size
        calls_per_session.append(len(r.outputs))
        for j, (out_ids, out_types) in r.outputs.items():  # dict order = message order
            pool_ids.append(out_ids)
            pool_types.append(out_types)
            call_sess.append(si)
            call_hist.append(int(r.ends[j]))
            call_out_start.append(pos)
            call_out_len.append(out_ids.size)
            after_tool.append(j > 0 and s.messages[j - 1]["role"] == "tool")
            pos += out_ids.size
    tokens = np.concatenate(pool_ids)
    types = np.concatenate(pool_types)
    n_sess, n_calls = len(sessions), len(call_sess)
    cs = np.asarray(call_sess, dtype=np.int64)
    p = np.asarray(call_hist, dtype=np.int64)  # history tokens in the prompt (before the generation prompt)
    o = np.asarray(call_out_len, dtype=np.int64)
    hs = np.asarray(h_start, dtype=np.int64)

    # Blocks fully inside a call's history part are blocks of its session's history stream: hash those once per
    # session. The rest of the call (history tail, generation prompt, output) is hashed per call.
    n_hist_full = p // bs
    hist_blocks = np.zeros(n_sess, dtype=np.int64)
    np.maximum.at(hist_blocks, cs, n_hist_full)
    tail_hist = p - n_hist_full * bs
    tail_blocks = (tail_hist + g + o) // bs
    keep = tail_blocks * bs  # tail tokens in full blocks; cut the three tail pieces to that
    a = np.minimum(tail_hist, keep)
    b = np.minimum(g, keep - a)
    c = keep - a - b
    starts = np.concatenate([hs, np.stack([hs[cs] + n_hist_full * bs, np.zeros(n_calls, dtype=np.int64),
                                           np.asarray(call_out_start, dtype=np.int64)], axis=1).ravel()])
    lengths = np.concatenate([hist_blocks * bs, np.stack([a, b, c], axis=1).ravel()])
    idx = concat_ranges(starts, lengths)
    content, btypes = token_blocks(tokens[idx], types[idx], bs)

    hist_block0 = csr_offsets(hist_blocks)[:-1]
    tail_block0 = int(hist_blocks.sum()) + csr_offsets(tail_blocks)[:-1]
    seq_idx = concat_ranges(np.stack([hist_block0[cs], tail_block0], axis=1).ravel(),
                      np.stack([n_hist_full, tail_blocks], axis=1).ravel())
    seq_len = n_hist_full + tail_blocks
    n_prompt = (p + g) // bs
    pk, po, ok, oo = chain_requests(content[seq_idx], csr_offsets(seq_len), n_prompt)
    seq_types = btypes[seq_idx]
    is_prompt = (np.arange(seq_idx.size) - np.repeat(csr_offsets(seq_len)[:-1], seq_len)) < np.repeat(n_prompt, seq_len)
    if pk.size + ok.size != seq_idx.size:
        raise RuntimeError("block split lost blocks")

    counts = np.asarray(calls_per_session, dtype=np.int64)
    t = arrivals.call_times(counts, np.asarray(after_tool, dtype=bool), rng)
    feats = None
    if feature_dim is not None:
        from sae_env.features import chat_prompt_features

        feats = chat_prompt_features(sessions, template, feature_dim)
        if feats.shape[0] != n_calls:
            raise RuntimeError(f"text features for {feats.shape[0]} calls, the trace has {n_calls}")
    turn = np.arange(n_calls, dtype=np.int64) - np.repeat(csr_offsets(counts)[:-1], counts) + 1
    trace = Trace(t=t, session=np.array([s.session for s in sessions], dtype=np.int64)[cs], turn=turn,
                  app=np.array([int(s.app) for s in sessions], dtype=np.int8)[cs], prompt_tokens=p + g,
                  output_tokens=o, prompt_offsets=po, prompt_keys=pk, prompt_types=seq_types[is_prompt],
                  output_offsets=oo, output_keys=ok, output_types=seq_types[~is_prompt], features=feats,
                  block_size=bs, meta=dict(meta or {}), validate=False)
    return trace.with_times(t)  # sorts by time (stable) and validates


def common_setup(source: str, options: Mapping[str, Any]) -> tuple[int, np.random.Generator, ChatTemplate, str]:
    """Parse the options every chat source shares: block size, seed, tokenizer, on_error."""
    bs = int_option("block_size", options.get("block_size", 16), 1)
    seed = options.get("seed", 0)
    if seed is not None:  # None: fresh entropy (not reproducible)
        seed = int_option("seed", seed, 0)
    on_error = options.get("on_error", "raise")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"source '{source}': option 'on_error' must be 'raise' or 'skip', got {on_error!r}")
    template = ChatTemplate(get_tokenizer(options.get("tokenizer")))
    return bs, np.random.default_rng(seed), template, on_error


def feature_option(source: str, options: Mapping[str, Any]) -> int | None:
    """The text-feature dimension asked for by ``features`` / ``feature_dim`` (None = no features)."""
    kind = options.get("features")
    if kind is None or kind == "none":
        if options.get("feature_dim") is not None:
            raise ValueError(f"source '{source}': option 'feature_dim' needs features='ngram'")
        return None
    if kind != "ngram":
        raise ValueError(f"source '{source}': option 'features' must be 'ngram' or None, got {kind!r}")
    from sae_env.features import DEFAULT_TEXT_DIM

    return int_option("feature_dim", options.get("feature_dim", DEFAULT_TEXT_DIM), 1)


def feature_note(feature_dim: int | None) -> list[str]:
    if feature_dim is None:
        return []
    return [f"features: hashed word 1-2-gram + byte 3-gram vector of each call's rendered prompt, {feature_dim} "
            "dims, signed hashing, log1p counts, L2-normalised (sae_env.features)"]


def gap_note(arrivals: Arrivals, tool: bool) -> str:
    def fmt(mg: tuple[float, float]) -> str:
        return f"exp(N({mg[0]:g}, {mg[1]:g})) s (median {math.exp(mg[0]):.3g} s)"

    text = f"arrival (assumed; the data have no times): {arrivals.describe()}; each later call arrives "
    if tool:
        return text + (f"{fmt(arrivals.tool_gap)} after its predecessor's arrival when it follows a tool result, "
                       f"{fmt(arrivals.user_gap)} when it follows a user message (gaps include decode time)")
    return text + f"{fmt(arrivals.user_gap)} after its predecessor's arrival (gap includes decode time)"


def pipeline_notes(template: ChatTemplate, bs: int) -> list[str]:
    return [f"tokenizer {template.tokenizer.name}; ChatML (Qwen2.5 template, Qwen3 reasoning), each segment "
            "tokenized on its own",
            f"every assistant message is one call: prompt = history + '<|im_start|>assistant\\n', output = the "
            f"message + '<|im_end|>\\n'; full {bs}-token blocks only, the block straddling prompt/output counts "
            "as output; reasoning is in the output but dropped from later prompts"]


# ----------------------------------------------------------------------------------------------------------------
# The conversations source


def _row_conversations(obj: Any) -> tuple[list[tuple[str, Any]], list[Any] | None]:
    if not isinstance(obj, Mapping):
        raise BadMessage(None, f"a row must be a JSON object, got {type(obj).__name__}", "not an object")
    if "messages" in obj:
        convs = [("messages", obj["messages"])]
    elif "conversations" in obj:
        convs = [("conversations", obj["conversations"])]
    elif "conversation" in obj:
        convs = [("conversation", obj["conversation"])]
    elif "conversation_a" in obj or "conversation_b" in obj:
        convs = [(k, obj[k]) for k in ("conversation_a", "conversation_b") if k in obj]
    else:
        raise BadMessage("messages", "missing (expected 'messages', 'conversations', 'conversation' or "
                         "'conversation_a'/'conversation_b')", "missing messages")
    tools = obj.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadMessage("tools", "is a string but not JSON", "bad tools") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise BadMessage("tools", "must be a list of tool schemas (objects)", "bad tools")
    return convs, tools or None


def load(path: str | os.PathLike | None = None, **options: Any) -> tuple[Trace, LoadReport]:
    """Load a JSON-lines conversation file (module docstring); ``path=None`` loads the embedded WildChat data."""
    check_options(SOURCE, options, _OPTIONS)
    if path is None:
        from sae_env.data import WILDCHAT
        path = WILDCHAT
    bs, rng, template, on_error = common_setup(SOURCE, options)
    feature_dim = feature_option(SOURCE, options)
    arrivals = parse_arrivals(options, ("gap_mu", "gap_sigma", DEFAULT_GAP_MU, DEFAULT_GAP_SIGMA), None)
    system_prompt = options.get("system_prompt")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"option 'system_prompt' must be a string, got {type(system_prompt).__name__}")
    max_conv = options.get("max_conversations")
    if max_conv is not None:
        max_conv = int_option("max_conversations", max_conv, 0)

    report = LoadReport(source=SOURCE, path=str(path))
    sessions: list[ChatSession] = []
    counts = {"trailing": 0, "leading_assistant": 0, "consecutive_assistant": 0, "reasoning": 0, "tool": 0}
    conv_index = 0

    def fail(reason: str, message: str, line: int, field_name: str | None) -> None:
        if on_error == "raise":
            raise TraceFormatError(message, path=path, line=line, field=field_name)
        report.reject(reason)

    with open_text(path) as f:
        empty = True
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            empty = False
            if max_conv is not None and len(sessions) >= max_conv:
                break
            report.rows_read += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                fail("malformed JSON", f"malformed JSON ({e.msg}, column {e.colno})", lineno, None)
                conv_index += 1
                continue
            bad_text = lone_surrogate(obj) if "\\u" in line else None
            if bad_text is not None:
                fail("not text", "holds half a UTF-16 surrogate pair (a lone \\uD800-\\uDFFF escape), not text",
                     lineno, bad_text)
                conv_index += 1
                continue
            try:
                convs, tools = _row_conversations(obj)
                parsed = [normalize_messages(raw, key) for key, raw in convs]
            except BadMessage as e:
                fail(e.reason, e.message, lineno, e.field)
                conv_index += 1
                continue
            for msgs in parsed:
                sid = conv_index
                conv_index += 1
                roles = [m["role"] for m in msgs]
                if "assistant" not in roles:
                    fail("no assistant message", "has no assistant message (no LLM call)", lineno, convs[0][0])
                    continue
                last = len(roles) - 1 - roles[::-1].index("assistant")
                counts["trailing"] += len(roles) - 1 - last
                first_non_system = next(r for r in roles if r != "system")
                counts["leading_assistant"] += first_non_system == "assistant"
                counts["consecutive_assistant"] += sum(roles[k] == roles[k + 1] == "assistant"
                                                       for k in range(len(roles) - 1))
                counts["reasoning"] += sum(1 for m in msgs if m["role"] == "assistant" and (
                    "reasoning_content" in m or "</think>" in (m["content"] or "")))
                counts["tool"] += roles.count("tool")
                if system_prompt is not None:
                    msgs = [{"role": "system", "content": system_prompt}, *msgs]
                n_calls = roles.count("assistant")
                sessions.append(ChatSession(messages=msgs, session=sid, tools=tools,
                                            app=AppType.CHAT if n_calls > 1 else AppType.SINGLE_TURN,
                                            meta={"line": lineno}))
                if max_conv is not None and len(sessions) >= max_conv:
                    break
        if empty:
            raise TraceFormatError("empty file", path=path)

    meta = {"source": SOURCE, "path": str(path), "tokenizer": template.tokenizer.name, "template": "chatml-qwen2.5",
            "block_size": bs, "seed": options.get("seed", 0), "sessions": len(sessions),
            "arrival": arrivals.arrival, "rate": arrivals.rate, "gap_mu": arrivals.user_gap[0],
            "gap_sigma": arrivals.user_gap[1], "system_prompt": system_prompt is not None}
    if feature_dim is not None:
        meta["features"] = {"kind": "ngram", "dim": feature_dim}
    trace = build_chat_trace(sessions, template=template, block_size=bs, arrivals=arrivals, rng=rng, meta=meta,
                             feature_dim=feature_dim)
    report.notes += pipeline_notes(template, bs)
    report.notes += feature_note(feature_dim)
    report.notes.append(gap_note(arrivals, tool=False))
    report.notes.append(f"{len(sessions)} conversations, {len(trace)} calls; app = chat when a conversation has more "
                        "than one assistant message, else single_turn")
    if counts["trailing"]:
        report.notes.append(f"{counts['trailing']} message(s) after the last assistant message (e.g. a trailing "
                            "user message) dropped: they produce no call")
    if counts["leading_assistant"]:
        report.notes.append(f"{counts['leading_assistant']} conversation(s) start with an assistant message: its "
                            "call has an empty history")
    if counts["consecutive_assistant"]:
        report.notes.append(f"{counts['consecutive_assistant']} assistant message(s) follow another assistant "
                            "message: a continue call whose history holds the previous reply")
    if counts["reasoning"]:
        report.notes.append(f"{counts['reasoning']} assistant message(s) with reasoning: generated, then dropped "
                            "from later prompts")
    if system_prompt is not None:
        report.notes.append(f"system_prompt prepended to every conversation ({len(system_prompt)} characters)")
    return trace, report
