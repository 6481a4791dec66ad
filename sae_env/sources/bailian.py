"""Alibaba Qwen/Bailian KV-cache traces (ATC'25 "KVCache Cache in the Wild"): block ids, lengths, parent links.

Format: one JSON object a line with ``chat_id``, ``parent_chat_id`` (-1 = first turn), ``timestamp`` (seconds),
``input_length`` and ``output_length`` (tokens), ``type`` (``text`` / ``search`` / ``image`` / ``file``), ``turn``
(1 = first) and ``hash_ids``: one id per 16-token prompt block, ``len(hash_ids) == ceil(input_length / 16)``.
Unlike Mooncake's, these ids are per-block *content* hashes, not prefix-chained: the same id can follow different
prefixes (e.g. a common closing block), so they are chained here with :func:`~sae_env.trace.chain_keys` (one
vectorised call) and a key then stands for the whole prefix.

What the loader makes of it:

* Times in seconds on the trace's own clock (not rebased); rows out of time order are sorted stably and counted.
* Only full blocks are cache keys (vLLM): when ``input_length % 16 != 0`` the last id is a partial block, counted
  in ``prompt_tokens`` but dropped from ``prompt_keys`` (counted in the report's notes). The format has no ids for
  output blocks, so none is inserted after decode.
* Sessions follow ``parent_chat_id`` to the root of each chain (session ids 0.. in order of their first request).
  An excerpt may lack a request's parent: the request then starts a session of its own but keeps the ``turn``
  written in the file (counted in the notes). ``turn`` is kept as written; turns that are not the parent's + 1 are
  counted in the notes.
* App: a multi-turn request (``turn > 1`` or it has a child in the file) -> CHAT, otherwise SINGLE_TURN.
* The request ``type`` is kept as a list of strings, one per request in trace order, in ``trace.meta["request_type"]``
  (and the chat ids in ``meta["chat_id"]``); both describe the trace as loaded and go stale if it is re-ordered or
  sliced.
* Types, from structure (the same inference as Mooncake, :func:`sae_env.sources.hashonly.infer_block_types`): the
  shared head (keys used by >= ``shared_min_sessions`` distinct sessions, from the prompt's start) -> SYSTEM (first
  block) / TEMPLATE; blocks shared with the parent request keep its types; of the new blocks after them the first
  ``ceil(parent output_length / 16)`` -> ASSISTANT, the rest -> USER.

Bad rows (malformed JSON, missing or wrongly typed fields, negative times or lengths, ``turn < 1``,
``parent_chat_id < -1``, a duplicate ``chat_id``, a request that is its own parent or whose parent arrives after it,
a wrong number of ids) raise :class:`~sae_env.trace.TraceFormatError` naming file, line and field, or with
``on_error="skip"`` are dropped and counted (a dropped parent leaves its children without one, as above).

Options (defaults in :data:`DEFAULTS`): ``block_size = 16`` (the format's), ``shared_min_sessions = 3`` (as for
Mooncake: two sessions sharing blocks are most often one conversation, three or more a shared head; on the 22-row
excerpt it picks exactly the 45-block head 0..44 of 8 sessions and the 3-block head 1089..1091 of 5 sessions),
``salt = 0``, ``on_error = "raise"``.
"""

from __future__ import annotations

import os

import numpy as np

from sae_env.inputs import check_options
from sae_env.sources.hashonly import (
    COUNT,
    INT,
    STR,
    TIME,
    TOKENS,
    TURN,
    HashRows,
    chain_blocks,
    compact,
    infer_block_types,
    int_option,
    read_rows,
    reject_rows,
    resolve_forest,
    sort_by_time,
)
from sae_env.trace import AppType, LoadReport, Trace

__all__ = ["DEFAULTS", "REQUEST_TYPES", "load"]

SOURCE = "bailian"
DEFAULTS = {"block_size": 16, "shared_min_sessions": 3, "salt": 0, "on_error": "raise"}
FIELDS = {"chat_id": COUNT, "parent_chat_id": INT, "timestamp": TIME, "input_length": TOKENS,
          "output_length": TOKENS, "type": STR, "turn": TURN}
REQUEST_TYPES = ("text", "search", "image", "file")  # the values documented for trace A


def _parent_index(rows: HashRows) -> tuple[np.ndarray, np.ndarray]:
    """Row index of each row's parent (-1: first turn or not in the file) and whether the parent is missing."""
    chat = rows.column("chat_id")
    par = rows.column("parent_chat_id")
    order = np.argsort(chat, kind="stable")
    pos = np.minimum(np.searchsorted(chat[order], par), max(chat.size - 1, 0))
    found = (par >= 0) & (chat[order][pos] == par)
    parent = np.where(found, order[pos], -1)
    return parent, (par >= 0) & ~found


def load(path: str | os.PathLike, **options) -> tuple[Trace, LoadReport]:
    """Load a Bailian JSONL trace (``.gz`` transparently); options and defaults in :data:`DEFAULTS`."""
    check_options(SOURCE, options, set(DEFAULTS))
    opt = {**DEFAULTS, **options}
    bs = int_option(SOURCE, "block_size", opt["block_size"], 1)
    shared_min = int_option(SOURCE, "shared_min_sessions", opt["shared_min_sessions"], 2)
    salt = int_option(SOURCE, "salt", opt["salt"], 0)
    on_error = opt["on_error"]

    report = LoadReport(source=SOURCE, path=str(path))
    rows = read_rows(path, FIELDS, block_size=bs, on_error=on_error, report=report)

    def check(rows: HashRows, bad: np.ndarray, field: str, why, reason: str) -> HashRows:
        return reject_rows(rows, bad, field, why, reason, on_error, report)

    par = rows.column("parent_chat_id")
    rows = check(rows, par < -1, "parent_chat_id",
                 lambda i: f"must be -1 (first turn) or a chat_id, got {rows.columns['parent_chat_id'][i]}",
                 "parent_chat_id: wrong type or value")
    chat, par = rows.column("chat_id"), rows.column("parent_chat_id")
    rows = check(rows, chat == par, "parent_chat_id", lambda i: f"request {chat[i]} is its own parent",
                 "parent_chat_id: own parent")
    chat = rows.column("chat_id")
    order = np.argsort(chat, kind="stable")
    dup = np.zeros(chat.size, dtype=bool)
    dup[order[1:]] = chat[order][1:] == chat[order][:-1]  # the later line of a repeated id is the bad one
    rows = check(rows, dup, "chat_id", lambda i: f"duplicate chat_id {chat[i]}", "chat_id: duplicate")

    rows, t = sort_by_time(rows, rows.column("timestamp", np.float64), report)
    parent, _ = _parent_index(rows)
    late = parent > np.arange(parent.size)
    rows = check(rows, late, "parent_chat_id",
                 lambda i: f"parent {rows.columns['parent_chat_id'][i]} arrives after this request",
                 "parent_chat_id: parent arrives later")
    if late.any():
        t = rows.column("timestamp", np.float64)
    parent, missing = _parent_index(rows)

    prompt_tokens = rows.column("input_length")
    output_tokens = rows.column("output_length")
    turn = rows.column("turn")
    _, _, keys, offsets = chain_blocks(rows.ids, rows.offsets, prompt_tokens, bs, salt)
    n_partial = int((prompt_tokens % bs != 0).sum())

    root, depth = resolve_forest(parent)
    session, n_sessions = compact(root)
    linked = parent >= 0
    has_child = np.zeros(len(rows), dtype=bool)
    has_child[parent[linked]] = True
    app = np.where((turn > 1) | has_child, int(AppType.CHAT), int(AppType.SINGLE_TURN)).astype(np.int8)
    parent_out = np.zeros(len(rows), dtype=np.int64)
    parent_out[linked] = -(-output_tokens[parent[linked]] // bs)
    kid, n_kid = compact(keys)
    types, head, _ = infer_block_types(kid, n_kid, offsets, parent, session, depth, parent_out, shared_min)
    bad_turn = int((linked & (turn != np.where(linked, turn[np.maximum(parent, 0)] + 1, 0))).sum())
    request_type = list(rows.columns["type"])
    unknown_types = sorted(set(request_type) - set(REQUEST_TYPES))

    report.notes += [
        f"keys: per-block content hashes chained with chain_keys (salt={salt})",
        f"partial blocks: {n_partial} partial last blocks dropped from prompt_keys (prompt_tokens still count "
        f"them; only full {bs}-token blocks are cacheable)",
        "output blocks: none inserted (the format has no ids for output blocks)",
        f"sessions from parent_chat_id: {n_sessions} sessions; {int(missing.sum())} requests whose parent is not "
        f"in the file start a session of their own and keep their turn number",
        f"turn kept as written; {bad_turn} requests whose turn is not their parent's + 1",
        "app inferred: turn > 1 or has a child -> CHAT, others -> SINGLE_TURN",
        f"types inferred from structure (shared_min_sessions={shared_min}): shared head -> SYSTEM (first block) / "
        f"TEMPLATE, inherited history keeps the parent's types, then ceil(parent output/{bs}) new blocks -> "
        f"ASSISTANT, the rest -> USER; {int((head > 0).sum())} requests start with a shared head",
        "request type kept in meta['request_type'] (one string per request, trace order)",
    ]
    if unknown_types:
        report.notes.append(f"request types other than {list(REQUEST_TYPES)}: {unknown_types}")
    meta = {
        "source": SOURCE, "path": str(path), "format": "bailian-jsonl", "time_unit": "s", "block_size": bs,
        "keys": "chain_keys(hash_ids)", "salt": salt, "sessions": "parent_chat_id", "types": "inferred",
        "app": "inferred", "shared_min_sessions": shared_min, "rows_rejected": report.rows_rejected,
        "partial_blocks_dropped": n_partial, "parents_missing": int(missing.sum()),
        "request_type": request_type, "chat_id": list(rows.columns["chat_id"]),
    }
    trace = Trace(t=t, session=session, turn=turn, app=app, prompt_tokens=prompt_tokens,
                  output_tokens=output_tokens, prompt_offsets=offsets, prompt_keys=keys, prompt_types=types,
                  block_size=bs, meta=meta)
    return trace, report
