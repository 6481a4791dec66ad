"""Mooncake traces (Kimi's FAST'25 release): block ids and lengths, no text, no sessions.

Format: one JSON object a line with ``timestamp`` (milliseconds since the trace start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``: one id per 512-token prompt block, prefix-chained by the trace's
authors (an id stands for its whole prefix), so ``len(hash_ids) == ceil(input_length / 512)``.

What the loader makes of it (all derived; the trace itself has none of it):

* Times: milliseconds -> seconds, on the trace's own clock (not rebased). Rows out of time order are sorted stably
  and counted in the report.
* Keys: the ids go through :func:`~sae_env.trace.chain_keys` (one vectorised call) so that every source's keys
  live in one hashed key space. The ids are already chained, and chaining is injective on (parent, id) pairs, so
  this keeps every equality between blocks and adds none (tested). Only full blocks are cache keys, as in vLLM:
  when ``input_length % 512 != 0`` the last id is the partial block, counted in ``prompt_tokens`` but dropped from
  ``prompt_keys`` (the number dropped is in the report's notes). The format has no ids for output blocks, so no
  output block is inserted after decode (``output_keys`` is empty).
* Sessions, through the hash chain: a request's previous turn is the most recent earlier request whose full-block
  list (its ids except a partial last block) is a prefix of this one's, and whose deepest shared block is not a
  shared-template *hub*: a block with at least ``hub_min_successors`` distinct successor blocks in the loaded
  trace (partial blocks count as successors: a single-turn request whose variable part fits in one partial block
  still shows that the template branches there). Optionally the previous turn must lie at most ``max_gap_s``
  seconds earlier. Sessions are the trees of this relation (ids 0.. in order of their first request); turn =
  parent's turn + 1. See :mod:`sae_env.sources.hashonly` for the vectorised algorithm.
* App: a session with more than one request -> CHAT, a lone request -> SINGLE_TURN. The arXiv excerpt's three
  applications are told apart by their first block (0 = chat, 46..57 = a 12-block API template, 74..78 = a 5-block
  template), but within its 177 s most chat turns have no earlier or later turn in the excerpt (median gap between
  turns ~2 min), so most chat-family requests come out SINGLE_TURN; see the tests for the measured split.
* Types, from structure (not observed): blocks of the shared head (keys used by >= ``shared_min_sessions``
  distinct sessions, from the start of the prompt) -> SYSTEM for the first, TEMPLATE for the rest; blocks shared
  with the previous turn keep that turn's types; of the new blocks after them, the first
  ``ceil(previous output_length / 512)`` -> ASSISTANT (the previous answer), the rest -> USER.

Parameters and why their defaults:

* ``hub_min_successors = 16``. Measured successor counts: in ``arxiv_trace_first1000`` the three template heads
  (blocks 0, 57 and 78) have 401, 356 and 152 distinct successors and every other block at most 3; in
  ``synthetic_trace`` (no shared template; long documents asked several questions each) the largest count is 13.
  Any threshold in 14..152 links the same requests on both files (arXiv: 77 links, 923 sessions; synthetic: 1,455
  links, 2,538 sessions). 16 sits at the low end of that range on purpose: hub counts grow with the length of the
  excerpt (in the first 100 arXiv rows the 5-block template has only 18 successors; a threshold of 32 there chains
  38 unrelated template requests into fake sessions up to 15 turns deep, 16 links none), and missing a hub merges
  unrelated requests into fake sessions, a worse error than splitting a document session that had more than 16
  questions. Without hubs (a huge threshold) the arXiv excerpt collapses into 24 sessions up to 182 turns deep.
* ``shared_min_sessions = 3``: a block shared by two sessions is most often one conversation split by a missed
  link (arXiv: 338 such blocks, all in chat-family requests); three or more means a real shared head. On arXiv any
  value from 3 to 152 gives exactly the template heads (0; 46..57; 74..78).
* ``max_gap_s = None`` (no limit).
* ``block_size = 512`` (the format's), ``salt = 0`` (key-space separation, see ``chain_keys``),
  ``on_error = "raise"`` or ``"skip"``.
"""

from __future__ import annotations

import os

import numpy as np

from sae_env.inputs import check_options
from sae_env.sources.hashonly import (
    TIME_MS,
    TOKENS,
    chain_blocks,
    compact,
    infer_block_types,
    infer_prefix_parents,
    int_option,
    read_rows,
    resolve_forest,
    sort_by_time,
    successor_counts,
)
from sae_env.trace import AppType, LoadReport, Trace

__all__ = ["DEFAULTS", "load"]

SOURCE = "mooncake"
DEFAULTS = {
    "block_size": 512,
    "hub_min_successors": 16,
    "shared_min_sessions": 3,
    "max_gap_s": None,
    "salt": 0,
    "on_error": "raise",
}
FIELDS = {"timestamp": TIME_MS, "input_length": TOKENS, "output_length": TOKENS}


def load(path: str | os.PathLike, **options) -> tuple[Trace, LoadReport]:
    """Load a Mooncake JSONL trace (``.gz`` transparently); options and defaults in :data:`DEFAULTS`."""
    check_options(SOURCE, options, set(DEFAULTS))
    opt = {**DEFAULTS, **options}
    bs = int_option(SOURCE, "block_size", opt["block_size"], 1)
    hub_min = int_option(SOURCE, "hub_min_successors", opt["hub_min_successors"], 2)
    shared_min = int_option(SOURCE, "shared_min_sessions", opt["shared_min_sessions"], 2)
    salt = int_option(SOURCE, "salt", opt["salt"], 0)
    max_gap = opt["max_gap_s"]
    if max_gap is not None and (isinstance(max_gap, bool) or not isinstance(max_gap, (int, float))
                                or not max_gap > 0):
        raise ValueError(f"source '{SOURCE}': option max_gap_s must be None or a number > 0, got {max_gap!r}")

    report = LoadReport(source=SOURCE, path=str(path))
    rows = read_rows(path, FIELDS, block_size=bs, on_error=opt["on_error"], report=report)
    rows, t = sort_by_time(rows, rows.column("timestamp", np.float64) / 1000.0, report)
    prompt_tokens = rows.column("input_length")
    output_tokens = rows.column("output_length")

    all_keys, is_full, keys, offsets = chain_blocks(rows.ids, rows.offsets, prompt_tokens, bs, salt)
    n_partial = int((prompt_tokens % bs != 0).sum())

    kid, n_kid = compact(all_keys)
    succ = successor_counts(kid, n_kid, rows.offsets)
    hub = succ[is_full] >= hub_min
    full_kid = kid[is_full]
    parent = infer_prefix_parents(full_kid, offsets, ~hub, t, None if max_gap is None else float(max_gap))
    root, depth = resolve_forest(parent)
    session, n_sessions = compact(root)
    sizes = np.bincount(session, minlength=n_sessions)
    multi = sizes[session] > 1
    app = np.where(multi, int(AppType.CHAT), int(AppType.SINGLE_TURN)).astype(np.int8)
    linked = parent >= 0
    parent_out = np.zeros(len(rows), dtype=np.int64)
    parent_out[linked] = -(-output_tokens[parent[linked]] // bs)
    types, head, _ = infer_block_types(full_kid, n_kid, offsets, parent, session, depth, parent_out, shared_min)

    n_hubs = compact(kid[succ >= hub_min])[1]
    report.notes += [
        f"keys: hash_ids passed through chain_keys (salt={salt}); already prefix-chained, so equalities are kept",
        f"partial blocks: {n_partial} partial last blocks dropped from prompt_keys (prompt_tokens still count "
        f"them; only full {bs}-token blocks are cacheable)",
        "output blocks: none inserted (the format has no ids for output blocks)",
        f"sessions inferred from the hash chain (hub_min_successors={hub_min}, max_gap_s={max_gap}): "
        f"{n_hubs} hub blocks, {int(linked.sum())} requests linked to a previous turn, {n_sessions} "
        f"sessions, {int((sizes > 1).sum())} with more than one request",
        "app inferred: sessions with > 1 request -> CHAT, others -> SINGLE_TURN",
        f"types inferred from structure (shared_min_sessions={shared_min}): shared head -> SYSTEM (first block) / "
        f"TEMPLATE, inherited history keeps the previous turn's types, then ceil(previous output/{bs}) new blocks "
        f"-> ASSISTANT, the rest -> USER; {int((head > 0).sum())} requests start with a shared head",
    ]
    meta = {
        "source": SOURCE, "path": str(path), "format": "mooncake-jsonl", "time_unit": "ms (converted to s)",
        "block_size": bs, "keys": "chain_keys(hash_ids)", "salt": salt,
        "sessions": "inferred", "types": "inferred", "app": "inferred",
        "hub_min_successors": hub_min, "shared_min_sessions": shared_min, "max_gap_s": max_gap,
        "rows_rejected": report.rows_rejected, "partial_blocks_dropped": n_partial,
    }
    trace = Trace(t=t, session=session, turn=depth + 1, app=app, prompt_tokens=prompt_tokens,
                  output_tokens=output_tokens, prompt_offsets=offsets, prompt_keys=keys, prompt_types=types,
                  block_size=bs, meta=meta)
    return trace, report
