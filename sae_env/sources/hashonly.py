"""Shared machinery of the hash-only trace formats (Mooncake, Bailian): rows of block ids and lengths, no text.

Such traces give, per request, an arrival time, prompt and output lengths in tokens and one id per prompt block
(the last block may be partial). Everything else the simulator wants (prefix-chained keys, sessions, turns, the
TokenType of each block) has to be derived from the structure of the ids. This module holds the steps that the
formats share; each is vectorised over all blocks of the trace (numpy passes, no Python object per block).

Reading (:func:`read_rows`)
    One JSON object a line. Scalar fields are checked row by row (cheap type tests); the id lists are checked in
    one batch (a single ``np.array`` over all ids) and only re-examined row by row when that batch fails, so a
    million-block file costs one ``json.loads`` per line plus a few numpy passes. The length rule
    ``len(hash_ids) == ceil(input_length / block_size)`` is checked on every row.

Keys (:func:`chain_blocks`)
    All ids go through :func:`~sae_env.trace.chain_keys` (one vectorised call), so that every source's keys live
    in one hashed key space. The partial last block (``input_length % block_size != 0``) is chained with the rest
    (it takes part in the successor counts below) but is never a cache key: vLLM caches full blocks only.

Sessions (:func:`successor_counts`, :func:`infer_prefix_parents`, :func:`resolve_forest`)
    When a trace has no session ids, a request's previous turn is the most recent earlier request whose full-block
    list is a prefix of this one's and whose deepest shared block is not a *hub*: a block with at least
    ``hub_min_successors`` distinct successor blocks in the trace (a shared system prompt or template that many
    unrelated requests continue). Sessions are the trees of this parent relation; turn = depth + 1.

Types (:func:`infer_block_types`), inferred from structure, not observed:
    * shared head: the leading blocks whose key occurs in requests of at least ``shared_min_sessions`` distinct
      sessions (prefix-chained keys make this set prefix-closed). First block -> SYSTEM, the rest -> TEMPLATE.
    * inherited history: blocks shared with the parent request (their longest common prefix) keep the parent's
      types (resolved level by level down the session trees).
    * new blocks after the inherited part and the shared head: the first ``ceil(parent_output_tokens /
      block_size)`` -> ASSISTANT (the previous answer, now part of the history), the rest -> USER. A request
      without a parent has no ASSISTANT blocks.

Why one piece (~570 lines): reading, chaining, session inference and type inference are one vectorised pipeline
over the same flat arrays that the two hash-only sources share; each step consumes the previous one's arrays.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from sae_env.inputs import brief, open_binary, unreadable
from sae_env.trace import (
    MAX_TIME_S,
    MAX_TOKENS,
    MAX_TURN,
    LoadReport,
    TokenType,
    TraceFormatError,
    chain_keys,
    csr_offsets,
)

__all__ = [
    "HashRows",
    "unreadable",
    "ON_ERROR",
    "chain_blocks",
    "check_on_error",
    "common_prefix_len",
    "compact",
    "infer_block_types",
    "infer_prefix_parents",
    "open_binary",
    "int_option",
    "read_rows",
    "reject_rows",
    "resolve_forest",
    "sort_by_time",
    "successor_counts",
    "take_csr",
]

ON_ERROR = ("raise", "skip")

# Field kinds understood by read_rows (the bounds are the data model's, see sae_env.trace).
TIME = "time"  # finite number of seconds in [0, MAX_TIME_S]
TIME_MS = "time_ms"  # finite number of milliseconds in [0, 1000 * MAX_TIME_S]
TOKENS = "tokens"  # integer in [0, MAX_TOKENS]
TURN = "turn"  # integer in [1, MAX_TURN]
COUNT = "count"  # integer in [0, 2**63)
INT = "int"  # integer in [-2**63, 2**63)
STR = "str"
_MISSING = object()
_U64_END = 1 << 64
_I64_END = 1 << 63


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")


def int_option(source: str, name: str, value, minimum: int) -> int:
    """An integer option (not a bool) of at least ``minimum``, or a ValueError naming source and option."""
    if type(value) is not int and not isinstance(value, np.integer):
        raise ValueError(f"source '{source}': option {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"source '{source}': option {name} must be >= {minimum}, got {value}")
    return int(value)


def _positions(offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat positions of CSR rows ``idx`` (in that order) and the new offsets of the gathered rows."""
    lengths = np.diff(offsets)[idx]
    new_off = csr_offsets(lengths)
    total = int(new_off[-1])
    if total == 0:
        return np.zeros(0, dtype=np.int64), new_off
    return np.repeat(offsets[idx] - new_off[:-1], lengths) + np.arange(total, dtype=np.int64), new_off


def take_csr(values: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` of a CSR array, concatenated in that order: ``(values, offsets)``."""
    pos, new_off = _positions(offsets, np.asarray(idx, dtype=np.int64))
    return values[pos], new_off


def _local_index(offsets: np.ndarray) -> np.ndarray:
    """Position of every element within its CSR row."""
    lengths = np.diff(offsets)
    return np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths)


# ----------------------------------------------------------------------------------------------------------------
# Reading


@dataclass
class HashRows:
    """The accepted rows of a hash-only file, in file order."""

    path: str
    line: np.ndarray  # int64 [R] line number of each row (1-based)
    columns: dict[str, list]  # field -> per-row values (the id field excluded)
    ids: np.ndarray  # uint64 [N] all ids, CSR-cut by ``offsets``
    offsets: np.ndarray  # int64 [R + 1]

    def __len__(self) -> int:
        return int(self.line.size)

    def column(self, name: str, dtype=np.int64) -> np.ndarray:
        return np.asarray(self.columns[name], dtype=dtype) if self.columns[name] else np.zeros(0, dtype=dtype)

    def take(self, idx: np.ndarray) -> HashRows:
        """Rows ``idx`` in that order (used to sort by time or to drop rows)."""
        idx = np.asarray(idx, dtype=np.int64)
        ids, off = take_csr(self.ids, self.offsets, idx)
        il = idx.tolist()
        cols = {k: [v[i] for i in il] for k, v in self.columns.items()}
        return HashRows(self.path, self.line[idx], cols, ids, off)


_TIME_END = {TIME: MAX_TIME_S, TIME_MS: 1000.0 * MAX_TIME_S}
# Integer kinds: (lowest, highest, what is wrong past the highest (past the lowest: ">= lowest", or this for INT)).
_INT_KINDS = {COUNT: (0, _I64_END - 1, "must be < 2**63"),
              TOKENS: (0, MAX_TOKENS, f"must be at most {MAX_TOKENS:,} tokens"),
              TURN: (1, MAX_TURN, f"must be at most {MAX_TURN}"), INT: (-_I64_END, _I64_END - 1, "must fit in 64 bits")}



def _check_value(v, kind: str) -> str | None:
    """Why ``v`` is not a valid value of ``kind`` (None when valid). Exact type tests: bool is not an integer."""
    t = type(v)
    if kind in _INT_KINDS:
        if t is not int:
            return f"must be an integer, got {brief(v)}"
        lo, hi, too_big = _INT_KINDS[kind]
        if v > hi:
            return f"{too_big}, got {brief(v)}"
        return None if v >= lo else f"{too_big if kind == INT else f'must be >= {lo}'}, got {brief(v)}"
    if kind in _TIME_END:
        if t is not int and t is not float:
            return f"must be a number, got {brief(v)}"
        # Compare before any float conversion: a 400-digit integer has none.
        if t is float and not math.isfinite(v):
            return f"must be finite, got {v!r}"
        if v < 0:
            return f"must be >= 0, got {brief(v)}"
        end = _TIME_END[kind]
        unit = "s" if kind == TIME else "ms"
        return None if v <= end else f"must be at most {end:.0e} {unit} (the trace clock's range), got {brief(v)}"
    if kind == STR:
        return None if t is str else f"must be a string, got {brief(v)}"
    raise RuntimeError(f"unknown field kind {kind!r}")


def _bad_id_list(ids) -> str | None:
    """Slow-path check of one id list: why it is invalid, or None."""
    for k, x in enumerate(ids):
        if type(x) is not int:
            return f"element {k} must be an integer, got {brief(x)}"
        if not 0 <= x < _U64_END:
            return f"element {k} must lie in [0, 2**64), got {brief(x)}"
    return None


def read_rows(path: str | os.PathLike, fields: Mapping[str, str], *, block_size: int, on_error: str,
              report: LoadReport, ids_field: str = "hash_ids", length_field: str = "input_length") -> HashRows:
    """Read and validate a hash-only JSONL file.

    ``fields`` maps each required scalar field to its kind (``"time"``, ``"count"``, ``"int"``, ``"str"``); the
    id list ``ids_field`` must hold ``ceil(row[length_field] / block_size)`` integers in ``[0, 2**64)``. A bad row
    raises :class:`TraceFormatError` (file, line, field) or, with ``on_error="skip"``, is dropped and counted in
    ``report``. Blank lines are ignored. A file without rows, or without a valid one, always raises, as does one
    that is not UTF-8 text or a broken gzip stream (nothing after that point could be read).
    """
    check_on_error(on_error)
    specs = list(fields.items())
    cols: dict[str, list] = {name: [] for name in fields}
    id_lists: list[list] = []
    lines: list[int] = []
    maybe_bool: list[int] = []  # indices into id_lists of rows whose text holds a JSON true / false
    skip = on_error == "skip"
    loads = json.loads

    def batch_ids() -> tuple[np.ndarray, list[int]]:
        """All ids as uint64 plus the indices (into id_lists) of rows whose ids are invalid."""
        flat: list = []
        for h in id_lists:
            flat.extend(h)
        try:
            arr = np.array(flat) if flat else np.zeros(0, dtype=np.int64)
        except ValueError:  # a list nested in an id list: ragged
            arr = None
        # numpy reads a JSON true among integers as 1: rows whose text holds a literal true / false are checked
        # one id at a time (rare, so the fast path stays one np.array over all ids).
        if (arr is not None and arr.dtype.kind == "i" and (arr.size == 0 or arr.min() >= 0)
                and not any(_bad_id_list(id_lists[i]) for i in maybe_bool)):
            return arr.view(np.uint64), []
        # Slow path: something is not a non-negative int64 (floats, strings, bools, or ids >= 2**63).
        bad = [i for i, h in enumerate(id_lists) if _bad_id_list(h) is not None]
        bad_set = set(bad)
        good = [h for i, h in enumerate(id_lists) if i not in bad_set]
        parts = [np.array(h, dtype=np.uint64) for h in good if h]
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)), bad

    def fail(lineno: int, field: str | None, message: str, reason: str) -> None:
        if skip:
            report.reject(reason)
            return
        # Report the earliest error: an invalid id element on an earlier row is only found by the batch check.
        _, bad = batch_ids()
        if bad:
            i = bad[0]
            raise TraceFormatError(_bad_id_list(id_lists[i]), path=path, line=lines[i], field=ids_field)
        raise TraceFormatError(message, path=path, line=lineno, field=field)

    rows_read = 0
    lineno = 0
    # Bytes, decoded line by line: a line that is not UTF-8 is then one bad row with its own number.
    with open_binary(path) as f, unreadable(path, lambda: lineno):
        for lineno, text in enumerate(f, start=1):
            if not text or text.isspace():
                continue
            rows_read += 1
            try:
                # Decoded here, not by json.loads: bytes it would guess to be UTF-16 (a line starting with ff fe)
                # must read as what they are, text that is not UTF-8. A BOM opens only the first line.
                row = loads(text.decode("utf-8-sig" if lineno == 1 else "utf-8"))
            except UnicodeDecodeError as e:
                fail(lineno, None, f"not UTF-8 text ({e.reason} at byte {e.start})", "not UTF-8 text")
                continue
            except ValueError as e:
                msg = f"malformed JSON ({e.msg}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else str(e)
                fail(lineno, None, msg, "malformed JSON")
                continue
            if type(row) is not dict:
                fail(lineno, None, f"expected a JSON object, got {type(row).__name__}", "not a JSON object")
                continue
            values = []
            error = None
            for name, kind in specs:
                v = row.get(name, _MISSING)
                if v is _MISSING:
                    error = (name, "missing", f"{name}: missing")
                    break
                why = _check_value(v, kind)
                if why is not None:
                    error = (name, why, f"{name}: wrong type or value")
                    break
                values.append(v)
            if error is None:
                h = row.get(ids_field, _MISSING)
                if h is _MISSING:
                    error = (ids_field, "missing", f"{ids_field}: missing")
                elif type(h) is not list:
                    error = (ids_field, f"must be a list of integers, got {type(h).__name__}",
                             f"{ids_field}: wrong type or value")
                else:
                    n_len = row[length_field]
                    expected = -(-n_len // block_size)
                    if len(h) != expected:
                        error = (ids_field, f"has {len(h)} ids but {length_field}={n_len} needs "
                                 f"ceil({n_len}/{block_size}) = {expected}", f"{ids_field}: length mismatch")
            if error is not None:
                fail(lineno, error[0], error[1], error[2])
                continue
            for (name, _), v in zip(specs, values, strict=True):
                cols[name].append(v)
            if b"true" in text or b"false" in text:
                maybe_bool.append(len(id_lists))
            id_lists.append(h)
            lines.append(lineno)
    report.rows_read += rows_read
    if rows_read == 0:
        raise TraceFormatError("empty file (no rows)", path=path)
    ids, bad = batch_ids()
    lengths = np.fromiter((len(h) for h in id_lists), dtype=np.int64, count=len(id_lists))
    if bad:
        if not skip:
            i = bad[0]
            raise TraceFormatError(_bad_id_list(id_lists[i]), path=path, line=lines[i], field=ids_field)
        report.reject(f"{ids_field}: wrong type or value", len(bad))
        keep = np.ones(len(id_lists), dtype=bool)
        keep[bad] = False
        kept = np.flatnonzero(keep).tolist()
        cols = {k: [v[i] for i in kept] for k, v in cols.items()}
        lines = [lines[i] for i in kept]
        lengths = lengths[keep]
    if not lines:
        raise TraceFormatError(f"no valid rows ({report.rows_rejected} rejected: {dict(report.rejected)})",
                               path=path)
    return HashRows(str(path), np.asarray(lines, dtype=np.int64), cols, ids, csr_offsets(lengths))


def reject_rows(rows: HashRows, bad: np.ndarray, field: str, message: Callable[[int], str], reason: str,
                on_error: str, report: LoadReport) -> HashRows:
    """Drop the rows flagged in ``bad`` (counted under ``reason``) or, with ``on_error="raise"``, raise for the
    earliest of them (``message(i)`` says what is wrong with row ``i``)."""
    idx = np.flatnonzero(bad)
    if idx.size == 0:
        return rows
    if on_error == "raise":
        i = int(idx[np.argmin(rows.line[idx])])
        raise TraceFormatError(message(i), path=rows.path, line=int(rows.line[i]), field=field)
    report.reject(reason, int(idx.size))
    keep = np.flatnonzero(~np.asarray(bad, dtype=bool))
    if keep.size == 0:
        raise TraceFormatError(f"no valid rows ({report.rows_rejected} rejected: {dict(report.rejected)})",
                               path=rows.path)
    return rows.take(keep)


def sort_by_time(rows: HashRows, t: np.ndarray, report: LoadReport) -> tuple[HashRows, np.ndarray]:
    """Rows in arrival order (stable, so that equal times keep file order); counts moved rows in the notes."""
    order = np.argsort(t, kind="stable")
    moved = int((order != np.arange(order.size)).sum())
    if moved == 0:
        return rows, t
    report.notes.append(f"rows not in time order: sorted stably by arrival time ({moved} rows moved)")
    return rows.take(order), t[order]


# ----------------------------------------------------------------------------------------------------------------
# Keys


def chain_blocks(ids: np.ndarray, offsets: np.ndarray, prompt_tokens: np.ndarray, block_size: int,
                 salt: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chain every row's ids and keep the full blocks.

    Returns ``(all_keys, is_full, full_keys, full_offsets)``: the chained key of every block (partial last blocks
    included, CSR ``offsets``), which of them are full blocks, and the keys and CSR offsets of the full blocks only
    (``prompt_tokens // block_size`` per row).
    """
    all_keys = chain_keys(ids, offsets, salt=salt)
    n_full = np.asarray(prompt_tokens, dtype=np.int64) // block_size
    lengths = np.diff(offsets)
    if (n_full > lengths).any():
        raise RuntimeError("a row has more full blocks than ids (the length check was skipped)")
    is_full = _local_index(offsets) < np.repeat(n_full, lengths)
    return all_keys, is_full, all_keys[is_full], csr_offsets(n_full)


# ----------------------------------------------------------------------------------------------------------------
# Sessions


def compact(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids ``0..U-1`` for the distinct values of ``keys`` (sorted order) and ``U``: small ids pack into one
    int64 sort key with another column, which is much faster than a lexsort or a searchsorted of 64-bit keys."""
    # Sort-based on purpose: numpy 2's hash-based np.unique is several times slower on 64-bit keys here.
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    order = np.argsort(keys)
    s = keys[order]
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    dense = np.cumsum(new, dtype=np.int64) - 1
    kid = np.empty(keys.size, dtype=np.int64)
    kid[order] = dense
    return kid, int(dense[-1]) + 1


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort-based; see :func:`compact`)."""
    s = np.sort(values)
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def _pack(hi: np.ndarray, lo: np.ndarray, lo_range: int) -> np.ndarray:
    """``hi * lo_range + lo`` as int64 (both non-negative, ``lo < lo_range``), checked against overflow."""
    if hi.size and (int(hi.max()) + 1) * lo_range >= 1 << 63:
        raise RuntimeError("too many distinct keys to pack into int64 sort keys")
    return hi * lo_range + lo


def successor_counts(kid: np.ndarray, n_kid: int, offsets: np.ndarray) -> np.ndarray:
    """For every block, the number of distinct blocks that follow its key anywhere in the trace.

    ``kid`` are dense key ids (:func:`compact`) of all blocks, CSR-cut by ``offsets``.
    """
    n = kid.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    has_next = np.ones(n, dtype=bool)
    lengths = np.diff(offsets)
    has_next[offsets[1:][lengths > 0] - 1] = False
    src = np.flatnonzero(has_next)
    pairs = _distinct(_pack(kid[src], kid[src + 1], n_kid))
    return np.bincount(pairs // n_kid, minlength=n_kid)[kid]


def infer_prefix_parents(full_kid: np.ndarray, full_offsets: np.ndarray, eligible: np.ndarray,
                         t: np.ndarray | None = None, max_gap_s: float | None = None) -> np.ndarray:
    """Each request's previous turn: the latest earlier request whose full-block list is a prefix of its own.

    Requests are in arrival order; ``full_kid`` are dense ids (:func:`compact`) of the chained full-block keys. A
    candidate ``j`` for request ``i`` is one whose last full key equals ``i``'s key at some position ``p`` with
    ``eligible[p]`` (the caller excludes hub blocks): chained keys make "ends at the same key" the same as "is a
    prefix". The latest candidate wins; with ``max_gap_s`` it must also lie no more than that many seconds before
    ``i`` (the latest is the closest, so no other can qualify). Returns int64 parent indices, -1 for none.
    One sort of (key, request, kind) events and a running maximum; no per-block Python.
    """
    n_req = full_offsets.size - 1
    lengths = np.diff(full_offsets)
    parent = np.full(n_req, -1, dtype=np.int64)
    has = lengths > 0
    end_req = np.flatnonzero(has)
    q_pos = np.flatnonzero(eligible)
    if end_req.size == 0 or q_pos.size == 0:
        return parent
    end_kid = full_kid[full_offsets[1:][has] - 1]
    q_req = np.repeat(np.arange(n_req, dtype=np.int64), lengths)[q_pos]
    # Event code = (key, request, kind): a query (kind 0) sorts before an end (kind 1) of the same request, so
    # that a request is never its own parent.
    code = np.concatenate([_pack(end_kid, 2 * end_req + 1, 2 * n_req), _pack(full_kid[q_pos], 2 * q_req, 2 * n_req)])
    code.sort()
    key, rest = np.divmod(code, 2 * n_req)
    req, is_end = np.divmod(rest, 2)
    is_end = is_end.astype(bool)
    last_end = np.maximum.accumulate(np.where(is_end, np.arange(code.size), -1))
    qi = np.flatnonzero(~is_end)
    le = last_end[qi]
    ok = le >= 0
    ok[ok] = key[le[ok]] == key[qi[ok]]
    np.maximum.at(parent, req[qi[ok]], req[le[ok]])
    if max_gap_s is not None and t is not None:
        linked = parent >= 0
        too_far = np.zeros(n_req, dtype=bool)
        too_far[linked] = (t[linked] - t[parent[linked]]) > max_gap_s
        parent[too_far] = -1
    return parent


def resolve_forest(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Root and depth (0 = root) of every node of a parent forest, by pointer jumping (O(n log depth))."""
    n = parent.size
    idx = np.arange(n, dtype=np.int64)
    if ((parent < -1) | (parent >= n) | (parent == idx)).any():
        raise RuntimeError("parent indices must be -1 or another node's index")
    ptr = np.where(parent >= 0, parent, idx)
    depth = (parent >= 0).astype(np.int64)
    for _ in range(64):
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            return ptr, depth
        depth = depth + depth[ptr]
        ptr = nxt
    raise RuntimeError("parent relation has a cycle")


def common_prefix_len(keys: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Length of the longest common prefix of the CSR rows ``a[k]`` and ``b[k]`` (pairwise)."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    lengths = np.diff(offsets)
    m = np.minimum(lengths[a], lengths[b])
    out = np.zeros(a.size, dtype=np.int64)
    total = int(m.sum())
    if total == 0:
        return out
    seg = csr_offsets(m)
    local = np.arange(total, dtype=np.int64) - np.repeat(seg[:-1], m)
    eq = keys[np.repeat(offsets[a], m) + local] == keys[np.repeat(offsets[b], m) + local]
    # The first mismatch (or the row's end) is the common prefix length.
    val = np.where(eq, np.repeat(m, m), local)
    nz = m > 0
    out[nz] = np.minimum.reduceat(val, seg[:-1][nz])
    return out


def infer_block_types(kid: np.ndarray, n_kid: int, offsets: np.ndarray, parent: np.ndarray, session: np.ndarray,
                      depth: np.ndarray, parent_output_blocks: np.ndarray, shared_min_sessions: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TokenType of every (full) prompt block, inferred from structure (see the module docstring).

    ``kid`` are dense ids (:func:`compact`) of the chained prompt keys, CSR-cut by ``offsets``; ``parent`` (-1 =
    none) must be a forest whose ``depth`` is given; ``session`` holds dense session ids (0..S-1);
    ``parent_output_blocks[i]`` is the number of blocks that the parent's answer takes in request ``i``'s history.
    Returns ``(types, head_len, inherited)``: the int8 types, and per request the length of its shared head and of
    the prefix it shares with its parent.
    """
    n_req = offsets.size - 1
    lengths = np.diff(offsets)
    n = kid.size
    types = np.full(n, int(TokenType.USER), dtype=np.int8)
    head = np.zeros(n_req, dtype=np.int64)
    inherited = np.zeros(n_req, dtype=np.int64)
    if n == 0:
        return types, head, inherited
    local = _local_index(offsets)
    req_of = np.repeat(np.arange(n_req, dtype=np.int64), lengths)

    # Shared head: keys used by >= shared_min_sessions distinct sessions (distinct (key, session) pairs).
    n_session = int(session.max()) + 1
    pairs = _distinct(_pack(kid, session[req_of], n_session))
    shared = np.bincount(pairs // n_session, minlength=n_kid)[kid] >= shared_min_sessions
    # Leading run of shared blocks (prefix-closed for chained keys; the run makes it so for any ids).
    nz = lengths > 0
    head[nz] = np.minimum.reduceat(np.where(shared, np.repeat(lengths, lengths), local), offsets[:-1][nz])
    in_head = local < head[req_of]
    types[in_head] = int(TokenType.TEMPLATE)
    types[in_head & (local == 0)] = int(TokenType.SYSTEM)

    has_parent = parent >= 0
    kids = np.flatnonzero(has_parent)
    inherited[kids] = common_prefix_len(kid, offsets, kids, parent[kids])
    new_start = np.maximum(inherited, head)
    m = np.where(has_parent, parent_output_blocks, 0)
    rel = local - new_start[req_of]
    types[(rel >= 0) & (rel < m[req_of])] = int(TokenType.ASSISTANT)

    # Inherited blocks past the head copy the parent's types, shallowest level first so parents are final.
    copy = has_parent & (inherited > head)
    cand = np.flatnonzero(copy)
    if cand.size:
        cand = cand[np.argsort(depth[cand], kind="stable")]
        d = depth[cand]
        cuts = np.flatnonzero(np.diff(d)) + 1
        for group in np.split(cand, cuts):
            cnt = inherited[group] - head[group]
            seg = csr_offsets(cnt)
            loc = np.arange(int(seg[-1]), dtype=np.int64) - np.repeat(seg[:-1], cnt) + np.repeat(head[group], cnt)
            dst = np.repeat(offsets[group], cnt) + loc
            src = np.repeat(offsets[parent[group]], cnt) + loc
            types[dst] = types[src]
    return types, head, inherited
