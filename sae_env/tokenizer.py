"""Text to token ids, and ChatML chat rendering that labels every token with its :class:`TokenType`.

Tokenizers
----------
Anything with ``name``, ``encode(text) -> list[int]`` and ``special_id(token) -> int`` is a :class:`Tokenizer`.

* :class:`SimpleTokenizer` (the default, no dependency) is an *approximation* of a byte-level BPE on English text,
  good enough for block counts and prefix sharing, not for exact token counts. A regex cuts the text into pieces:

  - a run of up to 6 letters of an alphabetic script (Latin, Greek, Cyrillic, Hebrew, Arabic) not followed by
    another letter, with its leading space, is one token (" the", " policy");
  - a longer run is cut into 4-letter pieces (" inte", "rnat", "iona", "l"), so English text comes out at about
    4 characters a token, like GPT-4's or Qwen's BPE;
  - other letters (CJK, Thai, ...) go 2 characters a token, digits up to 3 a token, punctuation / symbol runs up
    to 3 a token (with a leading space), newline runs one token, and a run of spaces leaves its last space to the
    next word (as the GPT-2/Qwen pre-tokeniser does).

  The pieces concatenate back to the text exactly. A piece's id is ``zlib.crc32(utf-8 bytes) % vocab_size``
  (stable across processes and platforms; never Python's salted ``hash()``), cached in a dict, so encoding runs
  at a few million tokens a second. Different pieces may share an id (like any hashing trick), which can only
  merge, never split, equal prefixes.
* :class:`HFTokenizer` wraps any Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package.
* :func:`get_tokenizer` maps a spec (``None`` / ``"simple"`` / a path to ``tokenizer.json`` or its folder / a
  tokenizer object) to a tokenizer.

Special tokens have fixed reserved ids: Qwen2.5/Qwen3's ids for the simple tokenizer (its ordinary ids stay below
151,643, Qwen2.5's ordinary vocabulary size); for a Hugging Face tokenizer the id in its vocabulary when it has the
token, else reserved ids just past its vocabulary.

Chat rendering (:class:`ChatTemplate`)
--------------------------------------
ChatML exactly as Qwen2.5's chat template renders it (``<|im_start|>{role}\\n{content}<|im_end|>\\n``; tool schemas
in the system message under ``# Tools ... <tools>\\n{one JSON per tool}\\n</tools> ...``; assistant tool calls as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks; tool results wrapped in
``<tool_response>`` inside a ``user`` block, consecutive results sharing one block), plus reasoning as Qwen3
renders it: a generated assistant turn is ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``, and the history of
later turns drops the reasoning (Qwen3, DeepSeek-R1). Reasoning comes from a ``reasoning_content`` or
``reasoning`` field, else from ``<think>...</think>`` in the content (split as Qwen3's template does).
Tool-call arguments given as a JSON string are parsed and re-dumped (as vLLM does before templating); a string
that is not JSON is emitted verbatim. JSON is dumped with ``ensure_ascii=False`` (Hugging Face's ``tojson``).

Differences from Qwen2.5, on purpose: no default system prompt is injected unless ``default_system`` is given
(Qwen2.5 injects "You are Qwen, ..."; :data:`QWEN_DEFAULT_SYSTEM`), and Qwen3's rule that keeps the reasoning of
assistant turns after the last user message is not applied (reasoning is always dropped from the history).

Tokens are encoded *segment by segment* (role header, content, each tool call, ...), never across a segment
boundary, so a message's tokens do not depend on what follows it. This is what guarantees the key property:
``tokens(prompt_k) + tokens(output_k)`` is exactly a prefix of ``tokens(prompt_{k+1})`` when turn ``k`` has no
reasoning, where ``prompt_k`` ends with the generation prompt ``<|im_start|>assistant\\n`` and ``output_k`` is
the assistant's content (and tool calls) + ``<|im_end|>`` + ``\\n``. A real BPE would merge across some of these
boundaries (e.g. ``assistant\\n`` + a content starting with a newline); the difference is a token here and there.

Types come exactly from roles: system -> SYSTEM; the tools section of the system message -> TEMPLATE; user ->
USER; assistant (text and tool calls) -> ASSISTANT; tool results -> TOOL_OUTPUT; ``<think>...</think>\\n\\n`` ->
REASONING. Scaffolding tokens (``<|im_start|>``, the role line, ``<|im_end|>\\n``) take their message's type.

Why one piece (~500 lines): the chat template renders with its tokenizer's special ids and labels every token it
emits, so the two tokenizers, their reserved ids and the template that depends on them are one contract (a test
renders through both).
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sae_env.trace import TokenType

__all__ = [
    "QWEN_DEFAULT_SYSTEM",
    "SPECIAL_TOKENS",
    "ChatTemplate",
    "HFTokenizer",
    "RenderedConversation",
    "SimpleTokenizer",
    "Tokenizer",
    "get_tokenizer",
    "split_reasoning",
]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
THINK, THINK_END = "<think>", "</think>"

#: Special tokens and their ids in Qwen2.5 / Qwen3's vocabulary (the simple tokenizer uses these ids).
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    IM_START: 151644,
    IM_END: 151645,
    TOOL_CALL: 151657,
    TOOL_CALL_END: 151658,
    TOOL_RESPONSE: 151665,
    TOOL_RESPONSE_END: 151666,
    THINK: 151667,
    THINK_END: 151668,
}

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the chat renderer needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def special_id(self, token: str) -> int: ...


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers

_ALPHA = "A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u052f\u0590-\u05ff\u0600-\u06ff"
_PIECE_RE = re.compile(
    r" ?(?:"  # the optional leading space, matched once for all the alternatives that take it (faster)
    rf"[{_ALPHA}]{{1,6}}+(?![{_ALPHA}])"  # a short word: one token
    rf"|[{_ALPHA}]{{1,4}}"  # a long word: 4-letter pieces
    r"|\d{1,3}"  # numbers: up to 3 digits a token (as cl100k)
    r"|(?:[^\w\s]|_){1,3})"  # punctuation and symbols
    r"|[^\W\d_]{1,2}"  # letters of other scripts (CJK, Thai, ...): 2 a token
    r"|\s*[\r\n]+"  # newline runs (with the spaces before them)
    r"|\s+(?!\S)|\s+"  # space runs; the last space before a word goes with the word
)


class SimpleTokenizer:
    """Deterministic, dependency-free approximation of a BPE tokenizer (see the module docstring)."""

    VERSION = 1
    _MAX_CACHE = 2_000_000  # pieces; bounded so that a huge corpus cannot grow the cache without limit

    def __init__(self, vocab_size: int = 151_643):
        if vocab_size < 2 or vocab_size > min(SPECIAL_TOKENS.values()):
            raise ValueError(f"vocab_size must lie in [2, {min(SPECIAL_TOKENS.values())}], got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.name = f"simple-v{self.VERSION}-crc32-{self.vocab_size}"
        self._cache: dict[str, int] = {}

    def pieces(self, text: str) -> list[str]:
        """The text cut into token pieces (they concatenate back to ``text``)."""
        return _PIECE_RE.findall(text)

    def encode(self, text: str) -> list[int]:
        pieces = _PIECE_RE.findall(text)
        cache = self._cache
        try:
            return list(map(cache.__getitem__, pieces))
        except KeyError:
            if len(cache) > self._MAX_CACHE:
                cache.clear()
            v = self.vocab_size
            for p in pieces:
                if p not in cache:
                    cache[p] = zlib.crc32(p.encode("utf-8")) % v
            return list(map(cache.__getitem__, pieces))

    def special_id(self, token: str) -> int:
        try:
            return SPECIAL_TOKENS[token]
        except KeyError:
            raise ValueError(f"unknown special token {token!r}; known: {sorted(SPECIAL_TOKENS)}") from None

    def __repr__(self) -> str:
        return f"SimpleTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the optional ``tokenizers`` package."""

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:
            raise ImportError("HFTokenizer needs the optional 'tokenizers' package: "
                              "pip install 'saecache-gym[hf]' (or pip install tokenizers)") from e
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such tokenizer file (expected a Hugging Face tokenizer.json)")
        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises a plain Exception on bad files
            raise ValueError(f"{path}: not a readable Hugging Face tokenizer.json ({e})") from e
        self.path = path
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.name = f"hf:{path}"
        self._special: dict[str, int] = {}
        next_free = self.vocab_size
        for tok in SPECIAL_TOKENS:  # fixed order, so reserved ids do not depend on call order
            tid = self._tok.token_to_id(tok)
            if tid is None:
                tid, next_free = next_free, next_free + 1
            self._special[tok] = int(tid)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def special_id(self, token: str) -> int:
        try:
            return self._special[token]
        except KeyError:
            raise ValueError(f"unknown special token {token!r}; known: {sorted(self._special)}") from None

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


@functools.lru_cache(maxsize=8)
def _cached_tokenizer(spec: str) -> Tokenizer:
    if spec == "simple":
        return SimpleTokenizer()
    return HFTokenizer(spec)


def get_tokenizer(spec: str | os.PathLike | Tokenizer | None = None) -> Tokenizer:
    """``None`` / ``"simple"`` -> the shared :class:`SimpleTokenizer`; a path to a ``tokenizer.json`` (or a folder
    holding one) -> :class:`HFTokenizer`; a tokenizer object is returned as is."""
    if spec is None or spec == "simple":
        return _cached_tokenizer("simple")
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"unknown tokenizer spec {str(spec)!r}: use 'simple' or the path of a Hugging Face "
                             "tokenizer.json (file not found)")
        return _cached_tokenizer(str(path.resolve()))
    if isinstance(spec, Tokenizer):
        return spec
    raise TypeError(f"tokenizer must be None, 'simple', a path or a Tokenizer, got {type(spec).__name__}")


# ----------------------------------------------------------------------------------------------------------------
# Chat rendering

_SYS, _TPL, _USR, _AST, _TOOL, _RSN = (int(TokenType.SYSTEM), int(TokenType.TEMPLATE), int(TokenType.USER),
                                       int(TokenType.ASSISTANT), int(TokenType.TOOL_OUTPUT),
                                       int(TokenType.REASONING))
Segment = tuple[str, int, bool]  # (text, TokenType value, is a special token)


@dataclass
class RenderedConversation:
    """A conversation's history stream and the generated form of each assistant message.

    ``tokens`` / ``types`` render every message as the *history* of a later turn (reasoning dropped).
    ``ends[j]`` is the length of the history once ``messages[:j]`` are rendered, so the prompt of a call at
    assistant message ``j`` is ``tokens[:ends[j]]`` + the generation prompt. ``outputs[j]`` are the tokens and
    types generated at assistant message ``j`` (reasoning included), ending with ``<|im_end|>``, ``\\n``.
    """

    tokens: np.ndarray
    types: np.ndarray
    ends: np.ndarray
    outputs: dict[int, tuple[np.ndarray, np.ndarray]]


def _text(content: Any) -> str:
    return "" if content is None else content


def split_reasoning(message: Mapping[str, Any]) -> tuple[str | None, str]:
    """(reasoning or None, content without it) of an assistant message, as Qwen3's chat template splits them."""
    content = _text(message.get("content"))
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = message.get("reasoning")
    if isinstance(reasoning, str):
        pass
    elif THINK_END in content:
        reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK)[-1].lstrip("\n")
        content = content.split(THINK_END)[-1].lstrip("\n")
    else:
        reasoning = None
    if reasoning is not None and not reasoning.strip("\n"):
        reasoning = None  # an empty <think></think> (Qwen3 non-thinking mode) carries nothing to cache
    if reasoning is not None:
        content = content.lstrip("\n")
    return reasoning, content


def _arguments_json(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, ensure_ascii=False)


class ChatTemplate:
    """Renders conversations in ChatML (Qwen2.5, with Qwen3 reasoning) to parallel token id / TokenType arrays.

    Messages are dicts with ``role`` (system / user / assistant / tool), ``content`` (str or None) and, for an
    assistant, optional ``tool_calls`` (OpenAI style, ``{"function": {"name", "arguments"}}`` or
    ``{"name", "arguments"}``) and ``reasoning_content`` / ``reasoning``. ``tools`` is an OpenAI ``tools`` list.
    """

    _SHARED_CACHE = 256  # encoded system prompts / tool sections kept (they repeat across sessions)

    def __init__(self, tokenizer: Tokenizer | str | None = None, default_system: str | None = None):
        self.tokenizer = get_tokenizer(tokenizer)
        self.default_system = default_system
        self._special = {t: self.tokenizer.special_id(t) for t in SPECIAL_TOKENS}
        # the template's own strings (role lines, newlines), encoded once
        self._const = {t: np.array(self.tokenizer.encode(t), dtype=np.int64)
                       for t in ("system\n", "user\n", "assistant\n", "user", "\n", "\n\n")}
        self._special_arr = {t: np.array([i], dtype=np.int64) for t, i in self._special.items()}
        self._shared: dict[str, np.ndarray] = {}
        self._last_tools: tuple[Sequence[Any], str] | None = None

    # -- segments: the template itself, as (text, type, special) -----------------------------------------------
    def _tools_text(self, tools: Sequence[Any]) -> str:
        if self._last_tools is not None and self._last_tools[0] is tools:  # the same list for every session
            return self._last_tools[1]
        text = _TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_TAIL
        self._last_tools = (tools, text)
        return text

    def _system_segments(self, content: str | None, tools: Sequence[Any] | None) -> list[Segment]:
        segs: list[Segment] = [(IM_START, _SYS, True), ("system\n", _SYS, False)]
        if content:
            segs.append((content, _SYS, False))
        if tools:
            segs.append((self._tools_text(tools), _TPL, False))
        segs += [(IM_END, _SYS, True), ("\n", _SYS, False)]
        return segs

    def _preamble(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> list[Segment]:
        """The system block rendered before ``messages[0]`` when that message is not itself a system message."""
        if messages and messages[0].get("role") == "system":
            return []
        if tools or self.default_system is not None:
            return self._system_segments(self.default_system, tools)
        return []

    @staticmethod
    def _tool_call_segments(message: Mapping[str, Any], has_content: bool) -> list[Segment]:
        segs: list[Segment] = []
        for n, call in enumerate(message.get("tool_calls") or ()):
            fn = call.get("function") or call
            if n or has_content:
                segs.append(("\n", _AST, False))
            segs += [(TOOL_CALL, _AST, True),
                     (f'\n{{"name": "{fn.get("name")}", "arguments": {_arguments_json(fn.get("arguments"))}}}\n',
                      _AST, False),
                     (TOOL_CALL_END, _AST, True)]
        return segs

    def _assistant_parts(self, message: Mapping[str, Any]) -> tuple[list[Segment], list[Segment]]:
        """(reasoning segments, body segments) of an assistant message; the history keeps only the body."""
        reasoning, content = split_reasoning(message)
        body: list[Segment] = [(content, _AST, False)] if content else []
        body += self._tool_call_segments(message, bool(content))
        if reasoning is None:
            return [], body
        return [(THINK, _RSN, True), ("\n" + reasoning.strip("\n") + "\n", _RSN, False), (THINK_END, _RSN, True),
                ("\n\n", _RSN, False)], body

    def _message_segments(self, messages: Sequence[Mapping[str, Any]], i: int, tools: Sequence[Any] | None,
                          ) -> tuple[list[Segment], tuple[int, int] | None]:
        """History segments of ``messages[i]`` (and, for an assistant, the index range of its body in them)."""
        m = messages[i]
        role = m.get("role")
        content = _text(m.get("content"))
        if role == "system":
            if i == 0:
                return self._system_segments(content, tools), None
            return [(IM_START, _SYS, True), ("system\n", _SYS, False), (content, _SYS, False), (IM_END, _SYS, True),
                    ("\n", _SYS, False)], None
        if role == "user":
            return [(IM_START, _USR, True), ("user\n", _USR, False), (content, _USR, False), (IM_END, _USR, True),
                    ("\n", _USR, False)], None
        if role == "assistant":
            _, body = self._assistant_parts(m)
            return [(IM_START, _AST, True), ("assistant\n", _AST, False), *body, (IM_END, _AST, True),
                    ("\n", _AST, False)], (2, 2 + len(body))
        if role == "tool":
            segs: list[Segment] = []
            if i == 0 or messages[i - 1].get("role") != "tool":
                segs += [(IM_START, _TOOL, True), ("user", _TOOL, False)]
            segs += [("\n", _TOOL, False), (TOOL_RESPONSE, _TOOL, True), ("\n" + content + "\n", _TOOL, False),
                     (TOOL_RESPONSE_END, _TOOL, True)]
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                segs += [(IM_END, _TOOL, True), ("\n", _TOOL, False)]
            return segs, None
        raise ValueError(f"message {i}: unknown role {role!r} (expected system, user, assistant or tool)")

    @staticmethod
    def generation_segments() -> list[Segment]:
        return [(IM_START, _AST, True), ("assistant\n", _AST, False)]

    def segments(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                 add_generation_prompt: bool = False) -> list[Segment]:
        """The whole rendering as segments (history form: reasoning dropped)."""
        segs = self._preamble(messages, tools)
        for i in range(len(messages)):
            segs += self._message_segments(messages, i, tools)[0]
        if add_generation_prompt:
            segs += self.generation_segments()
        return segs

    def output_segments(self, message: Mapping[str, Any]) -> list[Segment]:
        """What the model generates for an assistant message after the generation prompt (reasoning included)."""
        reasoning, body = self._assistant_parts(message)
        return [*reasoning, *body, (IM_END, _AST, True), ("\n", _AST, False)]

    # -- encoding ------------------------------------------------------------------------------------------------
    def _encode(self, seg: Segment) -> np.ndarray:
        text, typ, special = seg
        if special:
            return self._special_arr[text]
        ids = self._const.get(text)
        if ids is not None:
            return ids
        if typ == _SYS or typ == _TPL:  # system prompts and tool sections repeat across sessions: keep them
            ids = self._shared.get(text)
            if ids is None:
                if len(self._shared) >= self._SHARED_CACHE:
                    self._shared.clear()
                ids = self._shared[text] = np.array(self.tokenizer.encode(text), dtype=np.int64)
            return ids
        return np.array(self.tokenizer.encode(text), dtype=np.int64)

    @staticmethod
    def _join(segs: Sequence[Segment], encoded: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if not encoded:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8)
        return (np.concatenate(encoded),
                np.repeat(np.array([s[1] for s in segs], dtype=np.int8), [e.size for e in encoded]))

    def encode_segments(self, segs: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and TokenTypes (int8) of a segment list, each segment encoded on its own."""
        return self._join(segs, [self._encode(s) for s in segs])

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
               add_generation_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and TokenTypes of a conversation (history form), optionally with the generation prompt."""
        return self.encode_segments(self.segments(messages, tools, add_generation_prompt))

    def render_output(self, message: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and TokenTypes generated for an assistant message (reasoning, content, calls, im_end, \\n)."""
        return self.encode_segments(self.output_segments(message))

    def render_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = False) -> str:
        """The rendered text (what Qwen2.5's Jinja template produces)."""
        return "".join(s[0] for s in self.segments(messages, tools, add_generation_prompt))

    def conversation(self, messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Any] | None = None) -> RenderedConversation:
        """Render a whole conversation once: the history stream, the prompt cut of every message, and the
        generated tokens of every assistant message (see :class:`RenderedConversation`)."""
        all_segs = self._preamble(messages, tools)
        encoded = [self._encode(s) for s in all_segs]
        ends = np.zeros(len(messages) + 1, dtype=np.int64)
        n = ends[0] = sum(e.size for e in encoded)
        outputs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        tail = [(IM_END, _AST, True), ("\n", _AST, False)]
        for i in range(len(messages)):
            segs, body = self._message_segments(messages, i, tools)
            enc = [self._encode(s) for s in segs]
            all_segs += segs
            encoded += enc
            n += sum(e.size for e in enc)
            ends[i + 1] = n
            if body is not None:  # an assistant message: its generated form reuses the body's encoding
                reasoning = self._assistant_parts(messages[i])[0] if _may_reason(messages[i]) else []
                out_segs = reasoning + segs[body[0]:body[1]] + tail
                out_enc = [self._encode(s) for s in reasoning] + enc[body[0]:body[1]] + [self._encode(s)
                                                                                          for s in tail]
                outputs[i] = self._join(out_segs, out_enc)
        tokens, types = self._join(all_segs, encoded)
        return RenderedConversation(tokens=tokens, types=types, ends=ends, outputs=outputs)

    def generation_prompt(self) -> tuple[np.ndarray, np.ndarray]:
        return self.encode_segments(self.generation_segments())


def _may_reason(message: Mapping[str, Any]) -> bool:
    return (isinstance(message.get("reasoning_content"), str) or isinstance(message.get("reasoning"), str)
            or THINK_END in _text(message.get("content")))
