"""Per-request features a real server has when a request arrives, and session labels for the session predictor.

Everything here is pure numpy (no torch): sources and policies use it; the learned model lives in
:mod:`agents.session_predictor` and is handed to policies as a callable.

Only information available at a request's **arrival** is used: its prompt (text, block keys, block types, length)
and what earlier requests looked like. Never its output length, its session's size or app, later turns, or any
later request (tested by truncating the trace after the request).

Text features (:func:`ngram_vector`, :func:`chat_prompt_features`)
------------------------------------------------------------------
A fixed hashed n-gram projection of the prompt text, a stand-in for the paper's input (the serving model's final
hidden state; ``DEFAULT_TEXT_DIM = 1536`` is Qwen2.5-1.5B's hidden size). The text is cut into *segments* (the
chat template's pieces: role lines, each message's content, each tool call, the tool schemas) and n-grams never
cross a segment boundary, so the counts of a prompt are the sum of its segments' counts and a conversation's calls
are computed incrementally. Per segment, lower-cased:

* word unigrams and word bigrams (words = ``\\w+`` runs; a word's id is ``zlib.crc32`` of its UTF-8 bytes, a bigram
  hashes the pair of ids);
* byte 3-grams of the UTF-8 text (vectorised: the three bytes form a 24-bit id).

Every n-gram id goes through splitmix64 with a per-family salt; the low bits pick one of ``dim`` buckets and bit 63
a sign (signed feature hashing, so collisions cancel on average). The prompt's signed counts ``c`` become
``sign(c) * log1p(|c|)`` (sublinear term frequency), then the vector is L2-normalised (all zero stays zero).
Deterministic across processes and platforms (no salted ``hash()``). Stored as ``trace.features`` (float32) by the
``conversations`` and ``taubench`` sources with the option ``features="ngram"`` (``feature_dim``, default 1536).

Structural features (:func:`structural_features`, works on hash-only traces)
------------------------------------------------------------------------------
For request ``i`` (``STRUCTURAL_NAMES`` lists them): log prompt tokens; log number of full blocks; the partial tail
as a fraction of a block; the fraction of its blocks of each :class:`~sae_env.trace.TokenType`; how deep its prompt
is shared with *earlier requests of other sessions* (``shared`` = blocks seen before in another session, log and
fraction, and the log number of new blocks); how many distinct earlier sessions used its first block and its deepest
shared block (log); the depth of its *head* = the deepest block used by at least ``HEAD_MIN_SESSIONS = 3`` distinct
earlier sessions (three or more sessions = a real shared template, the rule the Mooncake loader uses); and two
one-hot hashed ids: the first block's key and the head's key, each bucketed into ``ID_BUCKETS = 32`` buckets
(zero when the request has no block / no head). The key of a prefix-chained block stands for its whole prefix, so
the head id names the shared template / system prompt the request starts with.

Counting distinct earlier sessions is vectorised: occurrences are sorted by key (stable, so request order is kept
within a key), the first occurrence of every (key, session) pair is flagged, and a cumulative sum within each key
group counts the distinct sessions seen strictly before each occurrence (minus the request's own session when it
was among them). Cost: two sorts of the block references up to the last requested index.

Labels (:func:`session_labels`)
-------------------------------
For the first request of every session (``turn == 1`` and the session's earliest request in the trace; unknown
sessions, ``-1``, are one request each): 0 = the session has no further request in the trace, 1 = it continues as
chat, 2 = it continues as agent (``trace.app == AGENT``; any other app of a multi-request session counts as chat).
The labels use the future (the session's size); features never do.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sae_env.trace import N_TOKEN_TYPES, AppType, Trace, concat_ranges

__all__ = [
    "DEFAULT_TEXT_DIM",
    "FEATURE_VERSION",
    "HEAD_MIN_SESSIONS",
    "ID_BUCKETS",
    "N_CLASSES",
    "N_STRUCTURAL",
    "STRUCTURAL_NAMES",
    "chat_prompt_features",
    "first_requests",
    "key_bucket",
    "ngram_vector",
    "request_features",
    "session_labels",
    "structural_features",
]

FEATURE_VERSION = 1  # bump when a feature's definition changes: checkpoints record it
DEFAULT_TEXT_DIM = 1536  # Qwen2.5-1.5B hidden size: the paper feeds the predictor the final hidden state
HEAD_MIN_SESSIONS = 3
ID_BUCKETS = 32
N_CLASSES = 3  # 0 = no continuation, 1 = continues as chat, 2 = continues as agent
CLASS_NAMES = ("none", "chat", "agent")

_TYPE_NAMES = ("system", "template", "user", "assistant", "tool_output", "reasoning", "unknown")
STRUCTURAL_NAMES: tuple[str, ...] = (
    "log_prompt_tokens", "log_blocks", "tail_fraction",
    *(f"frac_{t}" for t in _TYPE_NAMES),
    "log_shared_blocks", "shared_fraction", "log_new_blocks",
    "log_first_block_sessions", "log_shared_block_sessions", "first_block_seen", "log_head_depth",
    *(f"first_id_{b}" for b in range(ID_BUCKETS)),
    *(f"head_id_{b}" for b in range(ID_BUCKETS)),
)
N_STRUCTURAL = len(STRUCTURAL_NAMES)
if len(_TYPE_NAMES) != N_TOKEN_TYPES:
    raise RuntimeError("features: token type names out of date")

# ----------------------------------------------------------------------------------------------------------------
# Text: hashed n-grams

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SALT_UNI = np.uint64(0x51ED2701F3A5C7B1)
_SALT_BI = np.uint64(0x2545F4914F6CDD1D)
_SALT_CHAR = np.uint64(0x9E3779B97F4A7C15)
_WORD = re.compile(r"\w+")
_WORD_IDS: dict[str, int] = {}  # word -> crc32, bounded (cleared when full)
_WORD_CACHE_MAX = 1 << 20


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection on uint64)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def _word_ids(words: list[str]) -> np.ndarray:
    ids = _WORD_IDS
    if len(ids) > _WORD_CACHE_MAX:
        ids.clear()
    out = np.empty(len(words), dtype=np.uint64)
    for n, w in enumerate(words):
        v = ids.get(w)
        if v is None:
            v = ids[w] = zlib.crc32(w.encode("utf-8"))
        out[n] = v
    return out


def _ngram_hashes(text: str) -> np.ndarray:
    """uint64 hashes of the word unigrams, word bigrams and byte 3-grams of one segment (lower-cased)."""
    low = text.lower()
    w = _word_ids(_WORD.findall(low))
    parts = []
    if w.size:
        parts.append(_mix(w ^ _SALT_UNI))
        if w.size > 1:
            with np.errstate(over="ignore"):
                parts.append(_mix((w[:-1] << np.uint64(32)) ^ w[1:] ^ _SALT_BI))
    b = np.frombuffer(low.encode("utf-8"), dtype=np.uint8).astype(np.uint64)
    if b.size >= 3:
        tri = (b[:-2] << np.uint64(16)) | (b[1:-1] << np.uint64(8)) | b[2:]
        parts.append(_mix(tri ^ _SALT_CHAR))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _buckets(h: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(bucket, sign) of each hash: low bits -> bucket, top bit -> sign."""
    bucket = (h % np.uint64(dim)).astype(np.int64)
    sign = 1.0 - 2.0 * (h >> np.uint64(63)).astype(np.float64)
    return bucket, sign


def _finish(counts: np.ndarray) -> np.ndarray:
    """Sublinear tf, then L2 normalisation (rows)."""
    v = np.sign(counts) * np.log1p(np.abs(counts))
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"feature dimension must be an integer >= 1, got {dim!r}")
    return int(dim)


def ngram_vector(text: str | Sequence[str], dim: int = DEFAULT_TEXT_DIM) -> np.ndarray:
    """The hashed n-gram vector (float32 [dim]) of a text, or of a list of segments (n-grams stay inside each)."""
    dim = _check_dim(dim)
    segments = [text] if isinstance(text, str) else list(text)
    hashes = [_ngram_hashes(s) for s in segments]
    h = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
    bucket, sign = _buckets(h, dim)
    return _finish(np.bincount(bucket, weights=sign, minlength=dim))


class _SegmentCache:
    """(bucket, sign) arrays of repeated segment texts (system prompts, tool schemas, role lines), bounded."""

    def __init__(self, dim: int, max_entries: int = 4096):
        self.dim = dim
        self.max_entries = max_entries
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, text: str, shared: bool) -> tuple[np.ndarray, np.ndarray]:
        if not (shared or len(text) < 32):
            return _buckets(_ngram_hashes(text), self.dim)
        hit = self._cache.get(text)
        if hit is None:
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            hit = self._cache[text] = _buckets(_ngram_hashes(text), self.dim)
        return hit


def chat_prompt_features(sessions: Sequence[Any], template: Any, dim: int = DEFAULT_TEXT_DIM) -> np.ndarray:
    """Text features of every LLM call of chat sessions, in :func:`build_chat_trace`'s call order.

    ``sessions`` have ``messages`` and ``tools`` (:class:`~sae_env.sources.conversations.ChatSession`);
    ``template`` is a :class:`~sae_env.tokenizer.ChatTemplate`. A call at assistant message ``j`` has the prompt
    ``segments(messages[:j]) + generation prompt``, which is a prefix of the whole conversation's segments (the
    template renders a message independently of what follows it, except a tool result's closing tag, which is
    the same whether the next message is an assistant message or nothing); its vector is computed from the
    running counts of that prefix. Returns float32 ``[n_calls, dim]``.
    """
    dim = _check_dim(dim)
    cache = _SegmentCache(dim)
    shared_types = (0, 1)  # SYSTEM, TEMPLATE segments repeat across sessions

    def seg_arrays(segs: Sequence[tuple[str, int, bool]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = [cache.get(text, typ in shared_types) for text, typ, _ in segs]
        lens = np.array([p[0].size for p in parts], dtype=np.int64)
        off = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0), off
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), off

    gb, gs, _ = seg_arrays(template.generation_segments())
    gen = np.bincount(gb, weights=gs, minlength=dim)
    rows: list[np.ndarray] = []
    for s in sessions:
        messages: list[Mapping[str, Any]] = s.messages
        segs = template.segments(messages, s.tools)
        bucket, sign, off = seg_arrays(segs)
        acc = np.zeros(dim)
        done = 0
        for j, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            cut = len(template.segments(messages[:j], s.tools))
            if cut < done:
                raise RuntimeError("chat_prompt_features: a call's prompt is not a prefix of the next one's")
            a, b = off[done], off[cut]
            if b > a:
                acc += np.bincount(bucket[a:b], weights=sign[a:b], minlength=dim)
            done = cut
            rows.append(acc + gen)
    if not rows:
        return np.zeros((0, dim), dtype=np.float32)
    return _finish(np.stack(rows))


# ----------------------------------------------------------------------------------------------------------------
# Structural features (hash-only traces too)


def _other_sessions_before(trace: Trace, upto: int) -> np.ndarray:
    """For every prompt block reference of requests ``[0, upto)``: the number of distinct *other* sessions that
    used the same key in an earlier request (arrival order)."""
    n_occ = int(trace.prompt_offsets[upto])
    keys = trace.prompt_keys[:n_occ]
    if n_occ == 0:
        return np.zeros(0, dtype=np.int64)
    lens = np.diff(trace.prompt_offsets[: upto + 1])
    sess = np.repeat(trace.session_ids()[:upto], lens)
    # first occurrence of each (key, session) pair; lexsort is stable, so ties keep request order
    o2 = np.lexsort((sess, keys))
    k2, s2 = keys[o2], sess[o2]
    fp = np.ones(n_occ, dtype=bool)
    fp[1:] = (k2[1:] != k2[:-1]) | (s2[1:] != s2[:-1])
    first_pair = np.empty(n_occ, dtype=bool)
    first_pair[o2] = fp
    # distinct sessions strictly before each occurrence within its key group (request order)
    o1 = np.argsort(keys, kind="stable")
    k1 = keys[o1]
    f1 = first_pair[o1].astype(np.int64)
    cs = np.cumsum(f1) - f1
    start = np.ones(n_occ, dtype=bool)
    start[1:] = k1[1:] != k1[:-1]
    group_start = np.maximum.accumulate(np.where(start, np.arange(n_occ), 0))
    before = np.empty(n_occ, dtype=np.int64)
    before[o1] = cs - cs[group_start]
    return before - (~first_pair).astype(np.int64)


def key_bucket(keys: np.ndarray) -> np.ndarray:
    """The id bucket (0 .. ID_BUCKETS - 1) of each block key: a salted hash, so keys spread evenly."""
    h = _mix(keys.astype(np.int64).view(np.uint64) ^ _SALT_BI)
    return (h % np.uint64(ID_BUCKETS)).astype(np.int64)


def _as_index(trace: Trace, idx: Sequence[int] | np.ndarray | None) -> np.ndarray:
    n = len(trace)
    idx = np.arange(n, dtype=np.int64) if idx is None else np.asarray(idx, dtype=np.int64).ravel()
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"request indices must lie in [0, {n}), got {int(idx.min())}..{int(idx.max())}")
    return idx


def structural_features(trace: Trace, idx: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Structural features (float32 ``[len(idx), N_STRUCTURAL]``) of the requests ``idx`` (default: all).

    Uses only the requests' prompts and the requests before them (module docstring).
    """
    idx = _as_index(trace, idx)
    out = np.zeros((idx.size, N_STRUCTURAL), dtype=np.float32)
    if idx.size == 0:
        return out
    upto = int(idx.max()) + 1
    other = _other_sessions_before(trace, upto)
    po = trace.prompt_offsets
    nb = (po[idx + 1] - po[idx]).astype(np.int64)
    pos = concat_ranges(po[idx], nb)  # flat positions of the requested requests' blocks
    seg = np.repeat(np.arange(idx.size, dtype=np.int64), nb)
    oth = other[pos]
    m = idx.size
    shared = np.bincount(seg, weights=oth >= 1, minlength=m)
    head = np.bincount(seg, weights=oth >= HEAD_MIN_SESSIONS, minlength=m).astype(np.int64)
    types = trace.prompt_types[pos].astype(np.int64)
    by_type = np.bincount(seg * N_TOKEN_TYPES + types, minlength=m * N_TOKEN_TYPES).reshape(m, N_TOKEN_TYPES)
    has = nb > 0
    first = po[idx]
    first_sessions = np.where(has, other[np.minimum(first, other.size - 1)] if other.size else 0, 0)
    shared_i = shared.astype(np.int64)
    deepest = first + np.maximum(shared_i - 1, 0)
    shared_sessions = np.where(shared_i > 0, other[np.minimum(deepest, other.size - 1)] if other.size else 0, 0)
    tokens = trace.prompt_tokens[idx].astype(np.float64)
    bs = trace.block_size
    c = 0
    out[:, c] = np.log1p(tokens)
    out[:, c + 1] = np.log1p(nb)
    out[:, c + 2] = np.clip(tokens - nb * bs, 0, bs) / bs
    c += 3
    out[:, c:c + N_TOKEN_TYPES] = by_type / np.maximum(nb, 1)[:, None]
    c += N_TOKEN_TYPES
    out[:, c] = np.log1p(shared)
    out[:, c + 1] = shared / np.maximum(nb, 1)
    out[:, c + 2] = np.log1p(nb - shared)
    out[:, c + 3] = np.log1p(first_sessions)
    out[:, c + 4] = np.log1p(shared_sessions)
    out[:, c + 5] = first_sessions > 0
    out[:, c + 6] = np.log1p(head)
    c += 7
    rows = np.flatnonzero(has)
    keys = trace.prompt_keys
    out[rows, c + key_bucket(keys[first[rows]])] = 1.0
    c += ID_BUCKETS
    rows = np.flatnonzero(head > 0)
    out[rows, c + key_bucket(keys[first[rows] + head[rows] - 1])] = 1.0
    c += ID_BUCKETS
    if c != N_STRUCTURAL:
        raise RuntimeError("structural_features: column count disagrees with STRUCTURAL_NAMES")
    return out


def request_features(trace: Trace, idx: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """``concat(structural, text)`` for the requests ``idx``; the text block only when ``trace.features`` exists."""
    idx = _as_index(trace, idx)
    s = structural_features(trace, idx)
    if trace.features is None:
        return s
    return np.concatenate([s, trace.features[idx].astype(np.float32, copy=False)], axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Labels


def first_requests(trace: Trace) -> np.ndarray:
    """Indices of the first request of every session: ``turn == 1`` and the session's earliest request."""
    sid = trace.session_ids()
    if sid.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(sid, kind="stable")
    s = sid[order]
    start = np.ones(s.size, dtype=bool)
    start[1:] = s[1:] != s[:-1]
    earliest = order[start]
    return np.sort(earliest[trace.turn[earliest] == 1]).astype(np.int64)


def session_labels(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """``(idx, labels)``: the first requests (:func:`first_requests`) and their class (module docstring)."""
    idx = first_requests(trace)
    sid = trace.session_ids()
    order = np.sort(sid)
    sizes = np.searchsorted(order, sid[idx], side="right") - np.searchsorted(order, sid[idx], side="left")
    labels = np.where(sizes <= 1, 0, np.where(trace.app[idx] == int(AppType.AGENT), 2, 1)).astype(np.int64)
    return idx, labels
