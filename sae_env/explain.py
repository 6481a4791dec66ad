"""Gap analysis: where and why a policy loses to Belady (``python train.py explain``).

A policy X is replayed exactly as ``train.py replay`` replays it (same windows, same online learners), on the Python
engine with a :class:`~sae_env.cache.CacheObserver` that records every ghost hit and eviction; reference policies
(by default ``lru``, ``session-oracle``, ``reuse-oracle`` and ``belady``) are replayed beside it. Everything counts
**prompt blocks** (outputs are never hits). Definitions:

* a **miss** is a prompt block after the request's longest cached prefix (a request that hits ``h`` of its ``n``
  blocks misses blocks ``h .. n-1``);
* **compulsory**: the block's key has never been referenced before (no earlier request holds it in its prompt or,
  when outputs are cached, its outputs): no cache of any size could hit it;
* **regret**: the key was in the ghost record when the request missed it, i.e. the policy evicted it and the bounded
  record of recent evictions (as many keys as the cache holds blocks) still held it. This is exactly the cache's
  *misses after eviction* on prompt blocks;
* **capacity**: every other miss: a key referenced before that is neither cached nor a recent eviction (evicted
  long ago, so that the ghost record forgot it, or never admitted: bypassed, or an output that was not cached).

``compulsory + capacity + regret = misses``; the compulsory misses are the same for every policy. Each regret is
described by the block's token type, its queue and idle time (trace seconds since its last use) when it was evicted,
the session turn of the request that missed it, and its depth (position in the prompt).

The **gap** is Belady's token hit rate minus LRU's; a policy's **share of the gap** is ``(h - h_lru) / (h_belady -
h_lru)`` (0 = LRU, 1 = Belady; below 0 or above 1 when it does worse than LRU or better than Belady, which Belady
allows only in timed mode). **Belady keeps, X evicts** are the prompt blocks that X misses and Belady hits, by token
type and by *age*: trace seconds since the latest earlier request that referenced the key (its reuse gap).

:func:`explain` returns a JSON-able dict; :func:`format_table` is the table ``train.py explain`` prints;
:func:`write_outputs` writes ``explain.md``, ``explain.json`` and the PNG plots (:mod:`sae_env.plots`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.block import Block, split_queue_type
from sae_env.cache import PrefixCache
from sae_env.metrics import offset_bucket_edges, summarize
from sae_env.policies import make_policy
from sae_env.policies.base import EvictionPolicy
from sae_env.replay import Replay, WindowCallback
from sae_env.trace import N_TOKEN_TYPES, TokenType, Trace

__all__ = ["MISS_CLASSES", "REFERENCES", "MissRecorder", "block_hits", "explain", "first_references",
           "format_table", "gap_share", "prompt_regret", "write_outputs"]

MISS_CLASSES = ("compulsory", "capacity", "regret")
REFERENCES = ("lru", "session-oracle", "reuse-oracle", "belady")  # the floor, two partial oracles, the ceiling
# Idle times and ages in trace seconds, decade buckets.
SECONDS_EDGES = (0.0, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
TURN_EDGES = (1, 2, 3, 4, 8, 16, 32)

Builder = Callable[[str], tuple[EvictionPolicy, list[WindowCallback]]]


# ----------------------------------------------------------------------------------------------------------------
# What the trace alone says


def first_references(trace: Trace, include_outputs: bool = True) -> np.ndarray:
    """Per prompt block (``trace.prompt_keys`` order): True if no earlier request references its key (in its prompt,
    or in its outputs when ``include_outputs``). These are the compulsory misses of every policy."""
    n = len(trace)
    keys, req = trace.prompt_keys, np.repeat(np.arange(n, dtype=np.int64), np.diff(trace.prompt_offsets))
    if include_outputs:
        keys = np.concatenate([keys, trace.output_keys])
        req = np.concatenate([req, np.repeat(np.arange(n, dtype=np.int64), np.diff(trace.output_offsets))])
    if not keys.size:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((req, keys))
    k = keys[order]
    starts = np.ones(k.size, dtype=bool)
    starts[1:] = k[1:] != k[:-1]
    first_req = req[order][np.flatnonzero(starts)]  # each key's first request
    first = first_req[np.cumsum(starts) - 1]  # per sorted occurrence
    out = np.empty(keys.size, dtype=bool)
    out[order] = req[order] == first
    return out[:trace.n_blocks]


def previous_reference(trace: Trace) -> np.ndarray:
    """Per prompt block: the latest earlier request that references its key (prompt or outputs), -1 if none."""
    n = len(trace)
    keys = np.concatenate([trace.prompt_keys, trace.output_keys])
    req = np.concatenate([np.repeat(np.arange(n, dtype=np.int64), np.diff(trace.prompt_offsets)),
                          np.repeat(np.arange(n, dtype=np.int64), np.diff(trace.output_offsets))])
    prev = np.full(keys.size, -1, dtype=np.int64)
    if keys.size:
        order = np.lexsort((req, keys))
        k, r = keys[order], req[order]
        new_run = np.ones(k.size, dtype=bool)  # runs of equal (key, request)
        new_run[1:] = (k[1:] != k[:-1]) | (r[1:] != r[:-1])
        run_first = np.flatnonzero(new_run)
        run_of = np.cumsum(new_run) - 1
        prev_run = np.full(run_first.size, -1, dtype=np.int64)
        same_key = k[run_first[1:]] == k[run_first[:-1]]
        prev_run[1:][same_key] = r[run_first[:-1]][same_key]
        prev[order] = prev_run[run_of]
    return prev[:trace.n_blocks]


def block_hits(trace: Trace, hits_per_request: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per prompt block: whether it hit, given each request's hit blocks (its longest cached prefix)."""
    h = np.asarray(hits_per_request, dtype=np.int64)
    if h.size != len(trace):
        raise ValueError(f"{h.size} hit counts for a trace of {len(trace)} requests")
    n_blocks = np.diff(trace.prompt_offsets)
    pos = np.arange(trace.n_blocks, dtype=np.int64) - np.repeat(trace.prompt_offsets[:-1], n_blocks)
    return pos < np.repeat(h, n_blocks)


def prompt_regret(summary: dict[str, Any]) -> int | None:
    """Regret misses from a replay summary (:func:`sae_env.metrics.summarize`): its misses after eviction on prompt
    blocks; None if the summary predates the count of those on outputs."""
    out = summary.get("output_miss_after_eviction")
    mae = summary.get("miss_after_eviction")
    return None if out is None or mae is None else int(mae) - int(out)


def gap_share(rate: float | None, lru: float | None, belady: float | None) -> float | None:
    """The share of the LRU-to-Belady gap that ``rate`` closes (None if undefined: no gap, or a rate missing)."""
    if rate is None or lru is None or belady is None or not belady - lru > 1e-12:
        return None
    return (rate - lru) / (belady - lru)


# ----------------------------------------------------------------------------------------------------------------
# The observer


class MissRecorder:
    """A :class:`~sae_env.cache.CacheObserver` that records, for every ghost hit on a prompt block, which request
    and position it was, with the block's queue, type and idle time when it was evicted.

    Prompt runs come one per request with a miss, in admission order (= request order), so the ``r``-th run is the
    ``r``-th request with a miss. Eviction details are kept per key while the ghost record may still hold it
    (pruned to the record's keys every ``ghost_capacity`` evictions).
    """

    def __init__(self, cache: PrefixCache) -> None:
        if cache.observer is not None:
            raise ValueError("the cache already has an observer")
        self.cache = cache
        cache.observer = self
        self.prompt_runs = 0
        self.regret: list[tuple[int, int, int, float]] = []  # (prompt run, position, ghost code, idle at eviction)
        self._keys: Sequence[int] = ()
        self._prompt = False
        self._evicted: dict[int, float] = {}  # key -> idle seconds at its latest eviction
        self._since_prune = 0

    def on_miss_run(self, keys: Sequence[int], start: int, prompt: bool, now: float) -> None:
        self._keys, self._prompt = keys, prompt
        if prompt:
            self.prompt_runs += 1

    def on_ghost_hit(self, j: int, code: int, now: float) -> None:
        idle = self._evicted.pop(self._keys[j], math.nan)
        if self._prompt:
            self.regret.append((self.prompt_runs - 1, j, code, idle))

    def on_evict(self, victim: Block, now: float) -> None:
        self._evicted[victim.key] = now - victim.last_access
        self._since_prune += 1
        if self._since_prune > max(self.cache.ghost_capacity, 1024):
            ghosts = self.cache.ghosts
            self._evicted = {k: v for k, v in self._evicted.items() if k in ghosts}
            self._since_prune = 0


# ----------------------------------------------------------------------------------------------------------------
# Replays


def _default_builder(name: str) -> tuple[EvictionPolicy, list[WindowCallback]]:
    return make_policy(name), []


def _replay(trace: Trace, name: str, capacity: int, build: Builder, server: Callable[[], Any] | None, window: int,
            observe: bool, progress: bool) -> tuple[Replay, MissRecorder | None]:
    policy, callbacks = build(name)
    cache = PrefixCache(capacity, policy)
    recorder = MissRecorder(cache) if observe else None
    rep = Replay(trace, cache, None if server is None else server(), window_requests=window, callbacks=callbacks)
    rep.run(progress=progress, desc=name)
    return rep, recorder


def _hits_per_request(rep: Replay) -> np.ndarray:
    return np.concatenate([np.asarray(w.hits_per_request, dtype=np.int64) for w in rep.windows]) \
        if rep.windows else np.zeros(0, dtype=np.int64)


def _queue_label(policy: EvictionPolicy, q: int) -> str:
    """A queue id by the name its policy gives it (``Block.queue``), the id itself past the named ones."""
    names = policy.queue_names
    return names[q] if 0 <= q < len(names) else str(q)


def _buckets(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """The bucket of each value: ``i`` for ``edges[i] <= v < edges[i + 1]``, the last one open-ended."""
    return np.maximum(np.searchsorted(np.asarray(edges, dtype=np.float64), values, side="right") - 1, 0)


def _second_labels() -> list[str]:
    e = SECONDS_EDGES
    return [f"{e[i]:g}-{e[i + 1]:g} s" for i in range(len(e) - 1)] + [f">= {e[-1]:g} s"]


def _range_labels(edges: Sequence[int]) -> list[str]:
    out = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] - 1 if i + 1 < len(edges) else None
        out.append(f"{lo}+" if hi is None else (str(lo) if hi == lo else f"{lo}-{hi}"))
    return out


def _table(dim: np.ndarray, labels: Sequence[str], **masks: np.ndarray) -> list[dict[str, Any]]:
    """One row per bucket with at least one counted block: the bucket's label and a count per mask."""
    counts = {name: np.bincount(dim[m], minlength=len(labels))[:len(labels)] for name, m in masks.items()}
    return [{"bucket": labels[b], **{name: int(c[b]) for name, c in counts.items()}}
            for b in range(len(labels)) if any(c[b] for c in counts.values())]


def explain(trace: Trace, policy: str, capacity: int, *, build: Builder | None = None,
            server: Callable[[], Any] | None = None, window: int = 200, references: Sequence[str] = REFERENCES,
            progress: bool = False, label: str = "", serving: str = "instant") -> dict[str, Any]:
    """Replay ``policy`` (observed) and ``references`` on ``trace`` and explain the policy's misses.

    Args:
        build: ``name -> (policy, window callbacks)``; default: the registry's policy, no learners. The command
            line passes what ``train.py replay`` would use, so that the numbers are replay's.
        server: a factory of fresh servers (``None``: instant mode).
        window: requests per window (online learners act between windows).
        references: policies replayed beside it; must include ``lru`` and ``belady`` (the ends of the gap).
        label, serving: the trace's and the serving model's names in the outputs.
    """
    missing = [p for p in ("lru", "belady") if p not in references]
    if missing:
        raise ValueError(f"explain: the references must include {missing} (the ends of the gap)")
    build = build or _default_builder
    names = list(dict.fromkeys([references[0], policy, *references[1:]]))
    runs: dict[str, Replay] = {}
    recorder = None
    for name in names:
        runs[name], rec = _replay(trace, name, capacity, build, server, window, name == policy, progress)
        recorder = rec or recorder
    x = runs[policy]
    n_blocks = np.diff(trace.prompt_offsets)
    req_of = np.repeat(np.arange(len(trace), dtype=np.int64), n_blocks)
    pos = np.arange(trace.n_blocks, dtype=np.int64) - trace.prompt_offsets[req_of]
    compulsory = first_references(trace, include_outputs=x.cache.cache_outputs)
    hit = {name: block_hits(trace, _hits_per_request(r)) for name, r in runs.items()}

    # X's regret, block by block, from the observer; checked against the cache's own count
    x_hits = _hits_per_request(x)
    with_miss = np.flatnonzero(x_hits < n_blocks)
    if recorder.prompt_runs != with_miss.size:
        raise RuntimeError(f"explain: {recorder.prompt_runs} prompt insertions observed, {with_miss.size} requests "
                           "with a miss")
    regret = np.zeros(trace.n_blocks, dtype=bool)
    queue = np.full(trace.n_blocks, -1, dtype=np.int64)
    idle = np.full(trace.n_blocks, np.nan)
    if recorder.regret:
        run, j, code, idle_s = (np.asarray(c) for c in zip(*recorder.regret, strict=True))
        at = trace.prompt_offsets[with_miss[run]] + j
        regret[at], queue[at], idle[at] = True, split_queue_type(code)[0], idle_s
    if np.isnan(idle[regret]).any():
        raise RuntimeError("explain: a regretted block without its eviction")
    x_summary = summarize(x.windows, policy=policy)
    if int(regret.sum()) != prompt_regret(x_summary):
        raise RuntimeError(f"explain: {int(regret.sum())} regretted prompt blocks observed, the cache counted "
                           f"{prompt_regret(x_summary)}")
    x_miss = ~hit[policy]
    if np.any(regret & (compulsory | ~x_miss)):
        raise RuntimeError("explain: a regretted block is a hit or a first reference")

    # the policies side by side
    rate = {name: summarize(r.windows)["token_hit_rate"] for name, r in runs.items()}
    rows = []
    for name, r in runs.items():
        s = summarize(r.windows, policy=name)
        misses = s["prompt_blocks"] - s["hit_blocks"]
        comp = int(np.count_nonzero(compulsory & ~hit[name]))
        reg = prompt_regret(s)
        rows.append({"policy": name, "oracle": bool(r.policy.oracle), "token_hit_rate": s["token_hit_rate"],
                     "block_hit_rate": s["block_hit_rate"], "hit_blocks": s["hit_blocks"], "misses": misses,
                     "compulsory": comp, "capacity": misses - comp - reg, "regret": reg,
                     "gap_share": gap_share(s["token_hit_rate"], rate["lru"], rate["belady"])})

    # X's regret by type, queue, turn, depth and idle time at eviction
    types = trace.prompt_types.astype(np.int64)
    type_labels = [TokenType(t).name for t in range(N_TOKEN_TYPES)]
    turn_labels = _range_labels(TURN_EDGES)
    turns = _buckets(trace.turn[req_of], TURN_EDGES)
    depth_edges = offset_bucket_edges().tolist()
    depth_labels = _range_labels(depth_edges)
    depths = _buckets(pos, depth_edges)
    sec_labels = _second_labels()
    every = np.ones(trace.n_blocks, dtype=bool)
    queues = sorted(set(queue[regret].tolist()))
    regret_by = {
        "token_type": _table(types, type_labels, references=every, misses=x_miss, regret=regret),
        "queue": _table(np.searchsorted(queues, queue), [_queue_label(x.policy, q) for q in queues], regret=regret),
        "turn": _table(turns, turn_labels, references=every, misses=x_miss, regret=regret),
        "depth": _table(depths, depth_labels, references=every, misses=x_miss, regret=regret),
        "idle_at_eviction": _table(_buckets(idle, SECONDS_EDGES), sec_labels,
                                   regret=regret),
    }

    # what Belady keeps that X evicts, beside X's misses on keys seen before (the ones a cache could have hit)
    kept = x_miss & hit["belady"]
    seen = x_miss & ~compulsory
    prev = previous_reference(trace)
    age = trace.t[req_of] - trace.t[np.maximum(prev, 0)]
    belady_keeps = {
        "blocks": int(kept.sum()), "share_of_misses": float(kept.sum() / max(1, x_miss.sum())),
        "capacity": int(np.count_nonzero(kept & ~regret)), "regret": int(np.count_nonzero(kept & regret)),
        "policy_keeps_belady_misses": int(np.count_nonzero(hit[policy] & ~hit["belady"])),
        "by_token_type": _table(types, type_labels, blocks=kept, misses_seen_before=seen),
        "by_age": _table(_buckets(age, SECONDS_EDGES), sec_labels, blocks=kept, misses_seen_before=seen),
    }
    if kept.any() and np.any(compulsory & kept):
        raise RuntimeError("explain: Belady hit a first reference")

    return {
        "trace": label, "policy": policy, "requests": len(trace), "prompt_blocks": int(trace.n_blocks),
        "distinct_blocks": trace.distinct_blocks(), "capacity_blocks": int(capacity),
        "block_size": trace.block_size, "window": window, "serving": serving,
        "adaptive": bool(x.callbacks), "policies": rows, "regret_by": regret_by, "belady_keeps": belady_keeps,
    }


# ----------------------------------------------------------------------------------------------------------------
# Outputs


def _pct(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}"


def _headline(result: dict[str, Any]) -> str:
    r = result
    share = r["capacity_blocks"] / max(1, r["distinct_blocks"])
    return (f"{r['policy']} on {r['trace'] or 'the trace'}: {r['requests']:,} requests, {r['prompt_blocks']:,} "
            f"prompt blocks, capacity {r['capacity_blocks']:,} blocks ({share:.1%} of {r['distinct_blocks']:,} "
            f"distinct), serving {r['serving']}, window {r['window']}")


def format_table(result: dict[str, Any]) -> str:
    """The main table: each policy's token hit rate, share of the LRU-to-Belady gap and miss split (blocks)."""
    lines = [_headline(result), "",
             f"{'policy':<16}{'token hit %':>12}{'gap share %':>13}{'misses':>10}{'compulsory':>12}{'capacity':>10}"
             f"{'regret':>10}"]
    for p in result["policies"]:
        lines.append(f"{p['policy']:<16}{_pct(p['token_hit_rate']):>12}{_pct(p['gap_share'], 1):>13}"
                     f"{p['misses']:>10,}{p['compulsory']:>12,}{p['capacity']:>10,}{p['regret']:>10,}")
    k = result["belady_keeps"]
    x = result["policy"]
    lines += ["", f"Belady hits {k['blocks']:,} prompt blocks that {x} misses ({k['share_of_misses']:.1%} of its "
              f"misses: {k['capacity']:,} capacity, {k['regret']:,} regret); {x} hits "
              f"{k['policy_keeps_belady_misses']:,} that Belady misses."]
    by_type = sorted(result["regret_by"]["token_type"], key=lambda r: -r["regret"])
    total = sum(r["regret"] for r in by_type)
    if total:
        top = ", ".join(f"{r['bucket']} {r['regret'] / total:.0%}" for r in by_type[:3] if r["regret"])
        lines.append(f"{x}'s regret by token type: {top}.")
    return "\n".join(lines)


def _md_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in columns) + " |")
    return out


def _markdown(result: dict[str, Any], plots: list[Path], out_dir: Path) -> str:
    x = result["policy"]
    lines = [f"# Where {x} loses to Belady", "", _headline(result) + ".", "",
             "Prompt blocks only. A *miss* is a block after the request's longest cached prefix; *compulsory*: the "
             "key's first reference; *regret*: the key was in the ghost record (evicted recently: the record holds "
             "as many keys as the cache holds blocks); *capacity*: every other miss (evicted long ago, or never "
             "admitted). *Gap share*: (hit rate - LRU's) / (Belady's - LRU's), token hit rates.", "",
             "| policy | token hit % | gap share % | misses | compulsory | capacity | regret |",
             "|---|---|---|---|---|---|---|"]
    for p in result["policies"]:
        lines.append(f"| {p['policy']} | {_pct(p['token_hit_rate'])} | {_pct(p['gap_share'], 1)} | {p['misses']:,} | "
                     f"{p['compulsory']:,} | {p['capacity']:,} | {p['regret']:,} |")
    titles = {"token_type": "token type", "queue": "queue at eviction", "turn": "session turn of the request",
              "depth": "block depth (position in the prompt)",
              "idle_at_eviction": "idle time at eviction (trace seconds since the block's last use)"}
    lines += ["", f"## {x}'s regret", ""]
    for dim, rows in result["regret_by"].items():
        lines += [f"By {titles[dim]}:", ""] + _md_table(rows, ["bucket", *[c for c in rows[0] if c != "bucket"]]
                                                       if rows else ["bucket", "regret"]) + [""]
    k = result["belady_keeps"]
    lines += [f"## Blocks Belady keeps that {x} evicts", "",
              f"{k['blocks']:,} prompt blocks hit by Belady and missed by {x} ({k['share_of_misses']:.1%} of {x}'s "
              f"misses; {k['capacity']:,} capacity, {k['regret']:,} regret). {x} hits "
              f"{k['policy_keeps_belady_misses']:,} blocks that Belady misses. *Age*: trace seconds since the latest "
              f"earlier request that referenced the key; *misses_seen_before*: all of {x}'s misses on keys referenced "
              "before (its misses less the compulsory ones).", "", "By token type:", ""]
    columns = ["bucket", "blocks", "misses_seen_before"]
    lines += _md_table(k["by_token_type"], columns) + ["", "By age:", ""] + _md_table(k["by_age"], columns) + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in plots] + [""]
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``explain.json``, the plots (``plots/*.png``) and ``explain.md`` into ``out_dir``; returns the paths."""
    from sae_env import plots as P
    from sae_env.files import write_json, write_text

    out = Path(out_dir)
    figures = [P.plot_gap_bar(result, out / "plots" / "gap_bar.png"),
               P.plot_miss_split(result, out / "plots" / "miss_split.png"),
               P.plot_regret_breakdown(result, out / "plots" / "regret_by.png"),
               P.plot_belady_keeps(result, out / "plots" / "belady_keeps.png")]
    write_json(out / "explain.json", result)
    write_text(out / "explain.md", _markdown(result, figures, out))
    return [out / "explain.md", out / "explain.json", *figures]
