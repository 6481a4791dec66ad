"""Requests and traces: the one data model every source produces and every replay consumes.

A :class:`Trace` is columnar. Per-request fields live in numpy arrays of length ``R``; the block keys of all
prompts live in one flat int64 array cut by CSR offsets (``prompt_offsets[i]:prompt_offsets[i+1]`` are request
``i``'s blocks), and likewise for the output blocks that become cacheable after decode. A million requests with
tens of blocks each therefore cost a few hundred MB at most, and slicing is a view, not a copy of Python objects.

Block keys are *prefix-chained* (:mod:`sae_env.keys`): a key stands for the whole prefix up to and including its
block, as in vLLM, so a lookup is "the longest run of leading keys that are cached". Only full blocks are cache keys
(vLLM caches full blocks only); ``prompt_tokens`` still counts the partial tail.

Why one piece (~780 lines): the vocabulary (token and app types, value bounds), the columns and their validation,
their two file encodings (:meth:`Trace.save` / :meth:`Trace.load`, each the other's inverse over exactly these
columns and bounds) and the :class:`TraceBuilder` that every loader, the native one included, builds through are one
contract; the format in a module of its own would have to import this one while ``Trace.load`` imports it back. The
reading helpers and the error every loader raises are in :mod:`sae_env.inputs`, the hashing in :mod:`sae_env.keys`.
"""

from __future__ import annotations

import enum
import gzip
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.inputs import TraceFormatError, brief, check_input_file, open_text
from sae_env.keys import chain_keys, content_hash, mix64

__all__ = [
    "HALF_SPLITS",
    "MAX_TIME_S",
    "MAX_TOKENS",
    "MAX_TURN",
    "AppType",
    "LoadReport",
    "Request",
    "TokenType",
    "Trace",
    "TraceBuilder",
    "TraceFormatError",
    "chain_keys",
    "chain_requests",
    "check_pause",
    "concat",
    "concat_ranges",
    "content_hash",
    "csr_offsets",
    "mix64",
    "repeated",
    "session_continues",
    "session_halves",
    "token_blocks",
]

FORMAT_NAME = "sae-trace"
FORMAT_VERSION = 1

# What a trace may hold. Every source checks its input against these bounds and names the file, line and field of a
# value outside them; Trace.validate checks them again for traces built in code.
#: Arrival times lie in [0, MAX_TIME_S] seconds on the trace clock: 1e10 s is ~317 years, more than any real trace
#: spans even on an absolute Unix clock (1.7e9 s today), while float64 still resolves 2 microseconds there. A
#: larger value is a unit mistake or garbage (a wrapped nanosecond clock, an overflowed integer).
MAX_TIME_S = 1e10
#: Prompt and output lengths are at most MAX_TOKENS tokens per request: ten times the longest context windows served
#: today (~10 M tokens). Blocks are arrays of that length / block_size, so one bad row cannot ask for gigabytes.
MAX_TOKENS = 100_000_000
#: ``turn`` is an int32 column.
MAX_TURN = 2**31 - 1
#: Keys and session ids are int64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class TokenType(enum.IntEnum):
    """What a block's tokens are (the dominant type of its tokens)."""

    SYSTEM = 0  # system prompt
    TEMPLATE = 1  # tool schemas, instructions, shared templates
    USER = 2  # user query
    ASSISTANT = 3  # model response kept in the history
    TOOL_OUTPUT = 4  # results returned by tools to an agent
    REASONING = 5  # chain of thought; generated, but dropped from the next turn's history
    UNKNOWN = 6


class AppType(enum.IntEnum):
    """What kind of application a request (its session) belongs to."""

    SINGLE_TURN = 0  # one request, typically templated (API-style)
    CHAT = 1  # multi-turn conversation with a human
    AGENT = 2  # multi-turn tool-using agent session
    UNKNOWN = 3


N_TOKEN_TYPES = len(TokenType)
N_APP_TYPES = len(AppType)


@dataclass
class LoadReport:
    """What a source did with its input: counted, never silent."""

    source: str
    path: str
    rows_read: int = 0
    rows_rejected: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    notes: list[str] = field(default_factory=list)  # heuristics used, re-orderings, dropped partial blocks, ...

    def reject(self, reason: str, n: int = 1) -> None:
        self.rows_rejected += n
        self.rejected[reason] = self.rejected.get(reason, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path, "rows_read": self.rows_read,
                "rows_rejected": self.rows_rejected, "rejected": dict(self.rejected), "notes": list(self.notes)}

    def __str__(self) -> str:
        lines = [f"{self.source}: {self.path}: {self.rows_read} rows read, {self.rows_rejected} rejected"]
        lines += [f"  rejected ({n}): {why}" for why, n in sorted(self.rejected.items())]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Blocks of requests


def token_blocks(tokens: np.ndarray, types: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut a token sequence into its *full* blocks: per block a content id and the dominant TokenType.

    The partial tail (``len(tokens) % block_size`` tokens) is dropped, as vLLM caches only full blocks. Ties
    between types in a block go to the type of lower value (SYSTEM before USER before REASONING, ...).
    """
    tokens = np.asarray(tokens)
    types = np.asarray(types, dtype=np.int8)
    if tokens.shape != types.shape:
        raise ValueError("tokens and types must have the same length")
    nb = tokens.size // block_size
    if nb == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int8)
    rows = tokens[: nb * block_size].reshape(nb, block_size)
    trow = types[: nb * block_size].reshape(nb, block_size)
    counts = np.zeros((nb, N_TOKEN_TYPES), dtype=np.int32)
    for k in range(N_TOKEN_TYPES):
        counts[:, k] = (trow == k).sum(axis=1)
    return content_hash(rows), counts.argmax(axis=1).astype(np.int8)


def chain_requests(seq_content: np.ndarray, seq_offsets: np.ndarray, n_prompt_blocks: np.ndarray,
                   salt: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chain each request's full sequence (prompt blocks then output blocks) and split it.

    ``seq_content`` holds per-block content ids of every request's prompt followed by its output blocks (CSR
    ``seq_offsets``); the first ``n_prompt_blocks[i]`` of request ``i`` are prompt blocks. Output keys continue the
    prompt's chain, as the decoded tokens extend the same sequence in vLLM. Returns ``(prompt_keys,
    prompt_offsets, output_keys, output_offsets)``.
    """
    seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
    n_prompt = np.asarray(n_prompt_blocks, dtype=np.int64)
    lengths = np.diff(seq_offsets)
    if (n_prompt > lengths).any() or (n_prompt < 0).any():
        raise ValueError("n_prompt_blocks must lie between 0 and each sequence's length")
    keys = chain_keys(seq_content, seq_offsets, salt=salt)
    pos = np.arange(keys.size, dtype=np.int64) - np.repeat(seq_offsets[:-1], lengths)
    is_prompt = pos < np.repeat(n_prompt, lengths)
    return keys[is_prompt], csr_offsets(n_prompt), keys[~is_prompt], csr_offsets(lengths - n_prompt)


# ----------------------------------------------------------------------------------------------------------------
# Requests and traces


@dataclass(frozen=True)
class Request:
    """One request, as a read-only view of a Trace row (for convenience, never on a hot path)."""

    index: int
    t: float  # arrival time, seconds on the trace clock
    session: int  # session id, -1 if unknown
    turn: int  # 1 = first request of its session
    app: AppType
    prompt_keys: np.ndarray  # int64 prefix-chained keys of the full prompt blocks
    prompt_types: np.ndarray  # int8 TokenType of each prompt block
    prompt_tokens: int  # prompt length in tokens, partial last block included
    output_tokens: int
    output_keys: np.ndarray  # keys of the output blocks that become cacheable after decode
    output_types: np.ndarray
    features: np.ndarray | None  # optional float32 features for learned components


def csr_offsets(lengths: np.ndarray) -> np.ndarray:
    """CSR offsets (n + 1 entries, from 0) of rows with the given lengths."""
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return off


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each ``(s, n)``, without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64) - csr_offsets(lengths)[:-1], lengths) + np.arange(
        total, dtype=np.int64)


_REQ_FIELDS = ("t", "session", "turn", "app", "prompt_tokens", "output_tokens")


def _column(values: Any, dtype: type) -> np.ndarray:
    """A read-only contiguous view of ``values`` as ``dtype``. A trace is data: no replay writes into it, and arrays
    that Ray hands a worker are read-only anyway, so read-only everywhere gives every compiled kernel one signature,
    compiled once for a serial replay and for a Ray worker alike (a writable and a read-only array are two types to
    numba)."""
    a = np.ascontiguousarray(values, dtype=dtype).view()
    a.flags.writeable = False
    return a


_COLUMN_DTYPES = {"t": np.float64, "session": np.int64, "turn": np.int32, "app": np.int8,
                  "prompt_tokens": np.int64, "output_tokens": np.int64,
                  "prompt_offsets": np.int64, "prompt_keys": np.int64, "prompt_types": np.int8,
                  "output_offsets": np.int64, "output_keys": np.int64, "output_types": np.int8,
                  "features": np.float32}


class Trace:
    """A sequence of requests in arrival order, stored column by column.

    Columns (``R`` requests, ``B`` prompt blocks, ``O`` output blocks in total):

    ===================  ============  ======================================================================
    ``t``                float64 [R]   arrival time in seconds (trace clock), non-decreasing
    ``session``          int64 [R]     session id (-1 = unknown / single request)
    ``turn``             int32 [R]     turn within the session, 1 = first
    ``app``              int8 [R]      :class:`AppType`
    ``prompt_tokens``    int64 [R]     prompt length in tokens (including a partial last block)
    ``output_tokens``    int64 [R]     generated tokens
    ``prompt_offsets``   int64 [R+1]   CSR offsets into ``prompt_keys`` / ``prompt_types``
    ``prompt_keys``      int64 [B]     prefix-chained keys of full prompt blocks
    ``prompt_types``     int8 [B]      :class:`TokenType` per prompt block
    ``output_offsets``   int64 [R+1]   CSR offsets into ``output_keys`` / ``output_types``
    ``output_keys``      int64 [O]     keys of full blocks completed by decode (cacheable on completion)
    ``output_types``     int8 [O]
    ``features``         float32 [R,F] optional per-request features (or None)
    ===================  ============  ======================================================================

    ``block_size`` is the number of tokens per block; ``meta`` is a JSON-able dict (source, provenance, ...).
    Construction validates shapes, dtypes and invariants and raises :class:`TraceFormatError` on violation. The
    columns are read-only (see :func:`_column`); to change one, set it anew (``trace.t = ...``).
    """

    __slots__ = ("t", "session", "turn", "app", "prompt_tokens", "output_tokens", "prompt_offsets", "prompt_keys",
                 "prompt_types", "output_offsets", "output_keys", "output_types", "features", "block_size", "meta")

    def __init__(self, *, t, session, turn, app, prompt_tokens, output_tokens, prompt_offsets, prompt_keys,
                 prompt_types, output_offsets=None, output_keys=None, output_types=None, features=None,
                 block_size: int, meta: dict[str, Any] | None = None, validate: bool = True):
        self.t = t
        n = self.t.size
        self.session, self.turn, self.app = session, turn, app
        self.prompt_tokens, self.output_tokens = prompt_tokens, output_tokens
        self.prompt_offsets, self.prompt_keys, self.prompt_types = prompt_offsets, prompt_keys, prompt_types
        if output_offsets is None:
            output_offsets = np.zeros(n + 1, dtype=np.int64)
            output_keys = np.zeros(0, dtype=np.int64)
            output_types = np.zeros(0, dtype=np.int8)
        self.output_offsets, self.output_keys, self.output_types = output_offsets, output_keys, output_types
        self.features = features
        self.block_size = int(block_size)
        self.meta = dict(meta or {})
        if validate:
            self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        """A column, whenever it is set, is stored as :func:`_column` makes it: contiguous, of its dtype, read-only."""
        dtype = _COLUMN_DTYPES.get(name)
        if dtype is not None and value is not None:
            value = _column(value, dtype)
        object.__setattr__(self, name, value)

    # -- invariants ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise TraceFormatError if any column is inconsistent."""
        n = self.t.size
        for name in ("session", "turn", "app", "prompt_tokens", "output_tokens"):
            if getattr(self, name).shape != (n,):
                raise TraceFormatError(f"has shape {getattr(self, name).shape}, expected ({n},)", field=name)
        if self.block_size <= 0:
            raise TraceFormatError(f"must be positive, got {self.block_size}", field="block_size")
        if not np.isfinite(self.t).all():
            raise TraceFormatError("arrival times must be finite", field="t")
        if n and (self.t < 0).any():
            raise TraceFormatError("arrival times must be >= 0", field="t")
        if n and self.t.max() > MAX_TIME_S:
            raise TraceFormatError(f"arrival times must be at most {MAX_TIME_S:.0e} s", field="t")
        if n > 1 and (np.diff(self.t) < 0).any():
            raise TraceFormatError("arrival times must be non-decreasing (sort the requests)", field="t")
        if (self.turn < 1).any():
            raise TraceFormatError("turn must be >= 1", field="turn")
        if ((self.app < 0) | (self.app >= N_APP_TYPES)).any():
            raise TraceFormatError("unknown AppType value", field="app")
        for name in ("prompt_tokens", "output_tokens"):
            col = getattr(self, name)
            if n and (col.min() < 0 or col.max() > MAX_TOKENS):
                raise TraceFormatError(f"token counts must lie in [0, {MAX_TOKENS:,}]", field=name)
        for kind in ("prompt", "output"):
            off = getattr(self, f"{kind}_offsets")
            keys = getattr(self, f"{kind}_keys")
            types = getattr(self, f"{kind}_types")
            if off.shape != (n + 1,) or off[0] != 0 or off[-1] != keys.size or (np.diff(off) < 0).any():
                raise TraceFormatError("offsets must be CSR (n+1 entries, from 0 to the number of keys, "
                                       "non-decreasing)", field=f"{kind}_offsets")
            if types.shape != keys.shape:
                raise TraceFormatError("must have one entry per key", field=f"{kind}_types")
            if types.size and ((types < 0) | (types >= N_TOKEN_TYPES)).any():
                raise TraceFormatError("unknown TokenType value", field=f"{kind}_types")
        full_blocks = self.prompt_tokens // self.block_size
        if (np.diff(self.prompt_offsets) > full_blocks).any():
            bad = int(np.flatnonzero(np.diff(self.prompt_offsets) > full_blocks)[0])
            raise TraceFormatError(f"request {bad} has more prompt blocks than full blocks in "
                                   f"{self.prompt_tokens[bad]} tokens", field="prompt_keys")
        if self.features is not None and (self.features.ndim != 2 or self.features.shape[0] != n):
            raise TraceFormatError("must be a 2-D array with one row per request", field="features")

    # -- sizes and access ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.t.size)

    @property
    def n_blocks(self) -> int:
        """Number of prompt block references."""
        return int(self.prompt_keys.size)

    @property
    def n_output_blocks(self) -> int:
        return int(self.output_keys.size)

    @property
    def duration(self) -> float:
        return float(self.t[-1] - self.t[0]) if len(self) else 0.0

    def distinct_blocks(self, include_outputs: bool = True) -> int:
        keys = np.concatenate([self.prompt_keys, self.output_keys]) if include_outputs else self.prompt_keys
        # A sort, not np.unique: numpy 2.4's hash-based unique is ~50x slower on millions of int64 keys.
        k = np.sort(keys)
        return int(k.size and 1 + np.count_nonzero(k[1:] != k[:-1]))

    def prompt_blocks(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.prompt_offsets[i], self.prompt_offsets[i + 1]
        return self.prompt_keys[a:b], self.prompt_types[a:b]

    def output_blocks(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.output_offsets[i], self.output_offsets[i + 1]
        return self.output_keys[a:b], self.output_types[a:b]

    def request(self, i: int) -> Request:
        if not -len(self) <= i < len(self):
            raise IndexError(f"request index {i} out of range for a trace of {len(self)} requests")
        i %= len(self)
        pk, pt = self.prompt_blocks(i)
        ok, ot = self.output_blocks(i)
        return Request(index=i, t=float(self.t[i]), session=int(self.session[i]), turn=int(self.turn[i]),
                       app=AppType(int(self.app[i])), prompt_keys=pk, prompt_types=pt,
                       prompt_tokens=int(self.prompt_tokens[i]), output_tokens=int(self.output_tokens[i]),
                       output_keys=ok, output_types=ot,
                       features=None if self.features is None else self.features[i])

    def __iter__(self) -> Iterator[Request]:
        for i in range(len(self)):
            yield self.request(i)

    def __getitem__(self, item: slice) -> Trace:
        if not isinstance(item, slice):
            raise TypeError("index a Trace with a slice (trace[a:b]); use trace.request(i) for one request")
        start, stop, step = item.indices(len(self))
        if step != 1:
            return self.take(np.arange(start, stop, step))
        return self._range(start, max(start, stop))

    def __repr__(self) -> str:
        return (f"Trace({len(self)} requests, {self.n_blocks} prompt blocks, {self.n_output_blocks} output blocks, "
                f"block_size={self.block_size}, {self.duration:.1f} s, source={self.meta.get('source', '?')})")

    # -- slicing -------------------------------------------------------------------------------------------
    def _range(self, a: int, b: int) -> Trace:
        pa, pb = self.prompt_offsets[a], self.prompt_offsets[b]
        oa, ob = self.output_offsets[a], self.output_offsets[b]
        return Trace(t=self.t[a:b], session=self.session[a:b], turn=self.turn[a:b], app=self.app[a:b],
                     prompt_tokens=self.prompt_tokens[a:b], output_tokens=self.output_tokens[a:b],
                     prompt_offsets=self.prompt_offsets[a:b + 1] - pa, prompt_keys=self.prompt_keys[pa:pb],
                     prompt_types=self.prompt_types[pa:pb], output_offsets=self.output_offsets[a:b + 1] - oa,
                     output_keys=self.output_keys[oa:ob], output_types=self.output_types[oa:ob],
                     features=None if self.features is None else self.features[a:b],
                     block_size=self.block_size, meta=self.meta, validate=False)

    def between(self, t0: float, t1: float) -> Trace:
        """Requests with ``t0 <= t < t1`` (times on the trace clock, not rebased)."""
        a, b = np.searchsorted(self.t, [t0, t1], side="left")
        return self._range(int(a), int(b))

    def take(self, idx: Sequence[int] | np.ndarray) -> Trace:
        """The requests at the given indices, in that order (times must stay non-decreasing)."""
        idx = np.asarray(idx, dtype=np.int64)
        p_len = np.diff(self.prompt_offsets)[idx]
        o_len = np.diff(self.output_offsets)[idx]
        p_sel = _gather(self.prompt_offsets, idx, p_len)
        o_sel = _gather(self.output_offsets, idx, o_len)
        return Trace(t=self.t[idx], session=self.session[idx], turn=self.turn[idx], app=self.app[idx],
                     prompt_tokens=self.prompt_tokens[idx], output_tokens=self.output_tokens[idx],
                     prompt_offsets=csr_offsets(p_len), prompt_keys=self.prompt_keys[p_sel],
                     prompt_types=self.prompt_types[p_sel], output_offsets=csr_offsets(o_len),
                     output_keys=self.output_keys[o_sel], output_types=self.output_types[o_sel],
                     features=None if self.features is None else self.features[idx],
                     block_size=self.block_size, meta=self.meta)

    def with_times(self, t: np.ndarray) -> Trace:
        """The same requests with new arrival times, re-sorted stably by time."""
        t = np.asarray(t, dtype=np.float64)
        if t.shape != self.t.shape:
            raise ValueError(f"need {len(self)} times, got {t.shape}")
        order = np.argsort(t, kind="stable")
        out = self.take(order)
        out.t = t[order]
        out.validate()
        return out

    # -- equality and summaries ----------------------------------------------------------------------------
    def equals(self, other: Trace) -> bool:
        """Same requests, blocks, types, features and block size (``meta`` is not compared)."""
        if not isinstance(other, Trace) or self.block_size != other.block_size:
            return False
        for name in _REQ_FIELDS + ("prompt_offsets", "prompt_keys", "prompt_types", "output_offsets",
                                   "output_keys", "output_types"):
            if not np.array_equal(getattr(self, name), getattr(other, name)):
                return False
        if (self.features is None) != (other.features is None):
            return False
        return self.features is None or np.array_equal(self.features, other.features)

    def session_ids(self) -> np.ndarray:
        """Session ids with unknown (-1) sessions made unique per request (negative ids, never clashing)."""
        s = self.session.copy()
        unknown = s < 0
        s[unknown] = -1 - np.flatnonzero(unknown)
        return s

    # -- persistence ---------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write ``.npz`` (fast binary) or ``.jsonl`` (canonical text; ``.jsonl.gz`` gzipped) according to the
        suffix; atomic."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if path.suffix == ".npz":
            arrays = {name: getattr(self, name) for name in _REQ_FIELDS + (
                "prompt_offsets", "prompt_keys", "prompt_types", "output_offsets", "output_keys", "output_types")}
            if self.features is not None:
                arrays["features"] = self.features
            header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "block_size": self.block_size,
                      "meta": self.meta}
            arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        elif path.suffix == ".jsonl" or path.name.lower().endswith(".jsonl.gz"):
            gz = path.suffix.lower() == ".gz"
            with (gzip.open(tmp, "wt", encoding="utf-8") if gz else open(tmp, "w", encoding="utf-8")) as f:
                f.write(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION,
                                    "block_size": self.block_size, "meta": self.meta}) + "\n")
                for i in range(len(self)):
                    pk, pt = self.prompt_blocks(i)
                    ok, ot = self.output_blocks(i)
                    row = {"t": float(self.t[i]), "session": int(self.session[i]), "turn": int(self.turn[i]),
                           "app": AppType(int(self.app[i])).name.lower(),
                           "prompt_tokens": int(self.prompt_tokens[i]),
                           "output_tokens": int(self.output_tokens[i]),
                           "prompt_keys": pk.tolist(), "prompt_types": pt.tolist(),
                           "output_keys": ok.tolist(), "output_types": ot.tolist()}
                    if self.features is not None:
                        row["features"] = [float(x) for x in self.features[i]]
                    f.write(json.dumps(row) + "\n")
        else:
            raise ValueError(f"{path}: unknown trace file suffix '{path.suffix}' (use .npz, .jsonl or .jsonl.gz)")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read a trace written by :meth:`save` (``.npz``, ``.jsonl`` or a gzipped ``.jsonl.gz``).

        Every field is checked (dtypes of ``.npz`` arrays too: nothing is coerced) and a bad one raises
        :class:`TraceFormatError` naming the file, line and field.
        """
        path = check_input_file(path)
        if path.suffix == ".npz":
            return _load_npz(path)
        if path.suffix == ".jsonl" or path.name.lower().endswith(".jsonl.gz"):
            return _load_jsonl(path)
        raise TraceFormatError(f"unknown trace file suffix '{path.suffix}' (use .npz, .jsonl or .jsonl.gz)",
                               path=path)


def _gather(offsets: np.ndarray, idx: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat positions of the CSR rows ``idx`` (concatenated in that order)."""
    return concat_ranges(offsets[idx], lengths)


# dtype kind each .npz array must have ("i": integers, "f": floats; "if": either) and its bounds.
_NPZ_KINDS = {"t": "if", "session": "i", "turn": "i", "app": "i", "prompt_tokens": "i", "output_tokens": "i",
              "prompt_offsets": "i", "prompt_keys": "iu", "prompt_types": "i", "output_offsets": "i",
              "output_keys": "iu", "output_types": "i", "features": "if"}
_NPZ_BOUNDS = {"t": (0, MAX_TIME_S), "turn": (1, MAX_TURN), "app": (0, N_APP_TYPES - 1),
               "prompt_tokens": (0, MAX_TOKENS), "output_tokens": (0, MAX_TOKENS),
               "prompt_types": (0, N_TOKEN_TYPES - 1), "output_types": (0, N_TOKEN_TYPES - 1)}


def _check_npz_array(name: str, a: np.ndarray) -> None:
    """Raise TraceFormatError (field ``name``) unless ``a`` holds values of the column's kind within its bounds."""
    kinds = _NPZ_KINDS[name]
    if a.dtype.kind not in kinds or a.dtype == np.bool_:
        want = {"i": "integers", "if": "numbers", "iu": "integers"}[kinds]
        raise TraceFormatError(f"must hold {want}, got dtype {a.dtype} (nothing is coerced)", field=name)
    if a.ndim != (2 if name == "features" else 1):
        raise TraceFormatError(f"must be {'2' if name == 'features' else '1'}-dimensional, got shape {a.shape}",
                               field=name)
    if a.size == 0:
        return
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise TraceFormatError("must be finite", field=name)
    if name == "t" and a.dtype.kind == "i":
        a = a.astype(np.float64)
    if a.dtype.kind == "u" and a.dtype.itemsize == 8:
        a = a.view(np.int64)  # keys are 64-bit patterns: uint64 is the same key space
    if name in _NPZ_BOUNDS:
        lo, hi = _NPZ_BOUNDS[name]
        if a.min() < lo or a.max() > hi:
            raise TraceFormatError(f"values must lie in [{lo}, {hi:g}], got [{a.min()}, {a.max()}]", field=name)
    if name == "features" and np.abs(a).max() > np.finfo(np.float32).max:
        raise TraceFormatError("values must fit in float32", field=name)


def _check_header(header: Any, path: Path, line: int | None = None) -> tuple[int, dict[str, Any]]:
    """The block size and meta of a native trace header (the JSON object that opens every file)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"not a {FORMAT_NAME} file (the header must say format: {FORMAT_NAME})", path=path,
                               line=line, field="format")
    version = header.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise TraceFormatError(f"unsupported version {version!r} (this code reads version {FORMAT_VERSION})",
                               path=path, line=line, field="version")
    if "block_size" not in header:
        raise TraceFormatError("missing", path=path, line=line, field="block_size")
    bs = header["block_size"]
    if type(bs) is not int or not 1 <= bs <= MAX_TOKENS:
        raise TraceFormatError(f"must be an integer in [1, {MAX_TOKENS:,}], got {brief(bs)}", path=path, line=line,
                               field="block_size")
    meta = header.get("meta", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise TraceFormatError(f"must be a JSON object, got {type(meta).__name__}", path=path, line=line,
                               field="meta")
    return bs, meta


def _load_npz(path: Path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001 - np.load raises many kinds
        raise TraceFormatError(f"not a readable .npz trace ({e})", path=path) from e
    if "header" not in data:
        raise TraceFormatError("missing header", path=path, field="header")
    raw = data.pop("header")
    try:
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise ValueError(f"dtype {raw.dtype}, shape {raw.shape}")
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"not the UTF-8 bytes of a JSON object ({e})", path=path, field="header") from None
    block_size, meta = _check_header(header, path)
    missing = [k for k in _REQ_FIELDS + ("prompt_offsets", "prompt_keys", "prompt_types") if k not in data]
    if missing:
        raise TraceFormatError(f"missing arrays {missing}", path=path)
    unknown = sorted(set(data) - set(_NPZ_KINDS))
    if unknown:
        raise TraceFormatError(f"unknown arrays {unknown}", path=path)
    outputs = [k for k in ("output_offsets", "output_keys", "output_types") if k in data]
    if outputs and len(outputs) != 3:
        raise TraceFormatError(f"has {outputs} but output_offsets, output_keys and output_types go together",
                               path=path)
    try:
        for name, a in data.items():
            _check_npz_array(name, a)
        return Trace(**data, block_size=block_size, meta=meta)
    except TraceFormatError as e:
        raise e.located(path) from e


def _load_jsonl(path: Path) -> Trace:
    b = TraceBuilder(block_size=1)
    with open_text(path) as f:
        first = f.readline()
        if not first.strip():
            raise TraceFormatError("empty file", path=path, line=1)
        try:
            header = json.loads(first)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"malformed JSON header ({e.msg})", path=path, line=1) from e
        b.block_size, b.meta = _check_header(header, path, line=1)
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"malformed JSON ({e.msg})", path=path, line=lineno) from e
            try:
                if not isinstance(row, dict):
                    raise TraceFormatError(f"a row must be a JSON object, got {type(row).__name__}")
                b.add(t=_num(row, "t", 0, MAX_TIME_S), session=_int(row, "session", INT64_MIN, INT64_MAX),
                      turn=_int(row, "turn", 1, MAX_TURN), app=_app(row),
                      prompt_tokens=_int(row, "prompt_tokens", 0, MAX_TOKENS),
                      output_tokens=_int(row, "output_tokens", 0, MAX_TOKENS),
                      prompt_keys=_int_list(row, "prompt_keys"), prompt_types=_type_list(row, "prompt_types"),
                      output_keys=_int_list(row, "output_keys", []),
                      output_types=_type_list(row, "output_types", []), features=_features(row))
            except KeyError as e:
                raise TraceFormatError("missing", path=path, line=lineno, field=str(e.args[0])) from e
            except TraceFormatError as e:
                raise e.located(path, lineno) from e
    try:
        return b.build()
    except TraceFormatError as e:
        raise e.located(path) from e



def _num(row: dict, name: str, lo: float, hi: float) -> float:
    v = row[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise TraceFormatError(f"must be a finite number, got {brief(v)}", field=name)
    if not lo <= v <= hi:  # compared before any float conversion: a 400-digit integer has none
        raise TraceFormatError(f"must lie in [{lo:g}, {hi:g}], got {brief(v)}", field=name)
    return float(v)


def _int(row: dict, name: str, lo: int, hi: int) -> int:
    v = row[name]
    if type(v) is not int:  # exact: a bool is not a count, 1.5 is not a turn
        raise TraceFormatError(f"must be an integer, got {brief(v)}", field=name)
    if not lo <= v <= hi:
        raise TraceFormatError(f"must lie in [{lo}, {hi}], got {brief(v)}", field=name)
    return v


def _app(row: dict) -> AppType:
    app = row["app"]
    if isinstance(app, str) and app.upper() in AppType.__members__:
        return AppType[app.upper()]
    if type(app) is int and 0 <= app < N_APP_TYPES:
        return AppType(app)
    raise TraceFormatError(f"must be one of {[a.name.lower() for a in AppType]}, got {brief(app)}", field="app")


def _int_list(row: dict, name: str, default: list | None = None, lo: int = INT64_MIN,
              hi: int = INT64_MAX) -> list[int]:
    v = row.get(name, default) if default is not None else row[name]
    if not isinstance(v, list):
        raise TraceFormatError(f"must be a list of integers, got {type(v).__name__}", field=name)
    for k, x in enumerate(v):
        if type(x) is not int:
            raise TraceFormatError(f"element {k} must be an integer, got {brief(x)}", field=name)
        if not lo <= x <= hi:
            raise TraceFormatError(f"element {k} must lie in [{lo}, {hi}], got {brief(x)}", field=name)
    return v


def _type_list(row: dict, name: str, default: list | None = None) -> list[int]:
    return _int_list(row, name, default, 0, N_TOKEN_TYPES - 1)


def _features(row: dict) -> list[float] | None:
    v = row.get("features")
    if v is None:
        return None
    limit = float(np.finfo(np.float32).max)
    # abs() before isfinite(): an int has no float form past 1e308, and isfinite() would need one.
    if not isinstance(v, list) or not all(
            type(x) in (int, float) and abs(x) <= limit and math.isfinite(x) for x in v):
        raise TraceFormatError("must be a list of finite numbers (float32)", field="features")
    return v


class TraceBuilder:
    """Accumulates requests row by row (loaders) and builds a validated :class:`Trace` once.

    Rows may arrive out of time order; :meth:`build` sorts them stably by time and records how many were moved.
    """

    def __init__(self, block_size: int, meta: dict[str, Any] | None = None):
        self.block_size = block_size
        self.meta = dict(meta or {})
        self._cols: dict[str, list] = {k: [] for k in _REQ_FIELDS}
        self._pk: list[np.ndarray] = []
        self._pt: list[np.ndarray] = []
        self._ok: list[np.ndarray] = []
        self._ot: list[np.ndarray] = []
        self._feat: list[Any] = []
        self.reordered = 0

    def __len__(self) -> int:
        return len(self._cols["t"])

    def add(self, *, t: float, session: int, turn: int, app: int, prompt_tokens: int, output_tokens: int,
            prompt_keys: Iterable[int] | np.ndarray, prompt_types: Iterable[int] | np.ndarray,
            output_keys: Iterable[int] | np.ndarray = (), output_types: Iterable[int] | np.ndarray = (),
            features: Sequence[float] | np.ndarray | None = None) -> None:
        pk = np.asarray(prompt_keys, dtype=np.int64).ravel()
        pt = np.asarray(prompt_types, dtype=np.int8).ravel()
        ok = np.asarray(output_keys, dtype=np.int64).ravel()
        ot = np.asarray(output_types, dtype=np.int8).ravel()
        if pk.size != pt.size:
            raise TraceFormatError(f"{pk.size} keys but {pt.size} types", field="prompt_types")
        if ok.size != ot.size:
            raise TraceFormatError(f"{ok.size} keys but {ot.size} types", field="output_types")
        if not (t >= 0 and math.isfinite(t)):
            raise TraceFormatError(f"must be finite and >= 0, got {t!r}", field="t")
        for name, v in (("t", t), ("session", session), ("turn", turn), ("app", int(app)),
                        ("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
            self._cols[name].append(v)
        self._pk.append(pk)
        self._pt.append(pt)
        self._ok.append(ok)
        self._ot.append(ot)
        self._feat.append(features)

    def build(self) -> Trace:
        n = len(self)
        t = np.asarray(self._cols["t"], dtype=np.float64)
        order = np.argsort(t, kind="stable")
        self.reordered = int((order != np.arange(n)).sum())
        feats = None
        if n and any(f is not None for f in self._feat):
            if any(f is None for f in self._feat):
                raise TraceFormatError("either every request has features or none does", field="features")
            feats = np.asarray(self._feat, dtype=np.float32)

        def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

        trace = Trace(
            t=t, session=self._cols["session"], turn=self._cols["turn"], app=self._cols["app"],
            prompt_tokens=self._cols["prompt_tokens"], output_tokens=self._cols["output_tokens"],
            prompt_offsets=csr_offsets(np.array([a.size for a in self._pk], dtype=np.int64)),
            prompt_keys=cat(self._pk, np.int64), prompt_types=cat(self._pt, np.int8),
            output_offsets=csr_offsets(np.array([a.size for a in self._ok], dtype=np.int64)),
            output_keys=cat(self._ok, np.int64), output_types=cat(self._ot, np.int8),
            features=feats, block_size=self.block_size, meta=self.meta, validate=False)
        if self.reordered:
            trace = trace.take(order)
        trace.validate()
        return trace


def concat(traces: Sequence[Trace], meta: dict[str, Any] | None = None) -> Trace:
    """Concatenate traces with the same block size and re-sort by time (sessions must already be disjoint)."""
    if not traces:
        raise ValueError("concat needs at least one trace")
    bs = {tr.block_size for tr in traces}
    if len(bs) != 1:
        raise ValueError(f"cannot concatenate traces with different block sizes {sorted(bs)}")
    has_f = {tr.features is not None for tr in traces}
    if len(has_f) != 1:
        raise ValueError("either every trace has features or none does")

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(tr, name) for tr in traces])

    p_len = np.concatenate([np.diff(tr.prompt_offsets) for tr in traces])
    o_len = np.concatenate([np.diff(tr.output_offsets) for tr in traces])
    out = Trace(t=cat("t"), session=cat("session"), turn=cat("turn"), app=cat("app"),
                prompt_tokens=cat("prompt_tokens"), output_tokens=cat("output_tokens"),
                prompt_offsets=csr_offsets(p_len), prompt_keys=cat("prompt_keys"), prompt_types=cat("prompt_types"),
                output_offsets=csr_offsets(o_len), output_keys=cat("output_keys"), output_types=cat("output_types"),
                features=cat("features") if traces[0].features is not None else None,
                block_size=traces[0].block_size, meta=meta or traces[0].meta, validate=False)
    order = np.argsort(out.t, kind="stable")
    if (order != np.arange(len(out))).any():
        out = out.take(order)
    out.validate()
    return out


HALF_SPLITS = ("start", "alternate")  # session_halves' ways to split a trace


def repeated(trace: Trace, n: int, pause: float = 0.0) -> Trace:
    """``trace`` ``n`` times in a row: copy ``k`` arrives ``k`` times (the span plus one mean gap, plus ``pause``
    seconds) later, with its own session ids and block keys (XOR with a per-copy constant: equal keys stay equal within
    a copy, and copies share no block, not even a system prompt, so a copy's hits are its own).

    Back to back (``pause`` 0) every session still going at a copy's end stops there, all at once, while the next copy's
    sessions start at once: a seam no real trace has, which a policy that bets on sessions continuing pays for until its
    posteriors have decayed. A pause of an hour lets them decay first (docs/saecache-real-traces.md, "The ranking's
    clock has steps"). What a longer trace of the same source looks like to a policy whose cache is the same fraction of
    its distinct blocks (``benchmarks/gap_table.py --repeat``), and what its decision time does as a trace grows
    (``benchmarks/decision_time.py --repeat``). ValueError for ``n`` below 1 or a ``pause`` :func:`check_pause`
    rejects."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"repeated: n must be a whole number >= 1, got {n!r}")
    check_pause(pause)
    span = float(trace.t[-1] - trace.t[0]) if len(trace) else 0.0
    step = span + (span / (len(trace) - 1) if len(trace) > 1 else 1.0) + pause
    sessions = int(trace.session.max()) + 1 if len(trace) else 0
    copies = []
    for k in range(n):
        c = trace.take(np.arange(len(trace)))
        salt = np.int64(np.uint64((0x9E3779B97F4A7C15 * k) % 2**64).view(np.int64))
        c.t = trace.t + k * step
        c.session = np.where(trace.session >= 0, trace.session + k * sessions, trace.session)
        c.prompt_keys = trace.prompt_keys ^ salt
        c.output_keys = trace.output_keys ^ salt
        copies.append(c)
    return concat(copies)


def check_pause(pause: float) -> None:
    """ValueError unless ``pause`` (seconds between tiled copies, :func:`repeated`) is finite and at least 0."""
    if not (math.isfinite(pause) and pause >= 0):
        raise ValueError(f"pause must be a finite number of seconds >= 0, got {pause!r}")


def session_continues(trace: Trace) -> np.ndarray:
    """Whether each request's session has a later request in the trace (bool per request; a request of unknown
    session, -1, is a session of its own and has none). Hindsight: what the session oracle knows, and what probes
    score a policy's predictions against."""
    sid = trace.session_ids()
    order = np.lexsort((np.arange(len(sid)), sid))  # by session, then arrival
    has_next = np.zeros(len(sid), dtype=bool)
    has_next[order[:-1]] = sid[order[:-1]] == sid[order[1:]]
    return has_next


def session_halves(trace: Trace, split: str = "start") -> tuple[Trace, Trace]:
    """The trace's sessions in two halves, each session whole in one, ordered by first arrival: ``split="start"``,
    the first ``ceil(n / 2)`` of its ``n`` sessions, then the others (an early and a late half); ``"alternate"``, the
    1st, 3rd, 5th ... session, then the 2nd, 4th ... (two halves over the whole span, each at about half the load).
    Each half keeps its requests' times and order; a request of unknown session (-1) is a session of its own. Two
    traces of the same source, neither cut inside a session: a result tuned on one can be checked on the other
    (``benchmarks/gap_table.py --halves``). The early half ends with no new sessions and the late one starts with none
    under way; the alternate halves have neither edge, but each is half as busy as the trace."""
    if split not in HALF_SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(HALF_SPLITS)}")
    sid = trace.session_ids()
    sessions, first = np.unique(sid, return_index=True)  # requests are in time order: the first index is the start
    if sessions.size < 2:
        raise ValueError(f"a trace needs at least two sessions to be split in halves, this one has {sessions.size}")
    by_start = sessions[np.argsort(first, kind="stable")]
    early = by_start[:(sessions.size + 1) // 2] if split == "start" else by_start[0::2]
    in_early = np.isin(sid, early)
    return trace.take(np.flatnonzero(in_early)), trace.take(np.flatnonzero(~in_early))
