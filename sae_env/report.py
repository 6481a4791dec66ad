"""An experiment's report: ``summary.csv`` (one row per cell), ``paired.csv``, ``report.md`` (tables) and the plots.

Tables of ``report.md``, one per (workload, capacity, load) group, one row per agent, means over seeds with the
half-width of their 95 % confidence interval when there are several seeds (:mod:`sae_env.intervals`): token hit
rate, block hit rate, TTFT mean / p99 (timed serving only), the gap to Belady (oracle minus agent token hit rate, in
percentage points, when the config has a ``belady`` agent), and per-phase token hit rates where the trace has a
phase schedule. A phase's hit rate sums the hit and prompt tokens of the windows whose first request belongs to the
phase.

Under each table, the **paired comparison** of the config's ``reference`` agent (default: ``saecache`` when the
config has it) with every other agent of the group: per seed, reference minus agent (token hit rate in points, TTFT
mean and p99 in ms) and the TTFT ratio agent / reference (above 1: the reference is faster), as means over the
seeds with their 95 % intervals, and the seeds on which the reference did better. ``paired.csv`` holds the same
numbers, one row per (group, agent, metric).

The **gap analysis** section, one table per group: each agent's share of the LRU-to-Belady gap (``(h - h_lru) /
(h_belady - h_lru)`` in token hit rate, per seed against the ``lru`` and ``belady`` agents of the same seed; needs
both in the config) and its prompt-block misses split into compulsory, capacity and regret, in % of the prompt
blocks (definitions in :mod:`sae_env.explain`; ``python train.py explain`` breaks one cell down further). The split
comes from each cell's summary: ``compulsory_misses`` and the misses after eviction on prompt blocks (cells written
before those counts existed show ``-``).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sae_env.explain import gap_share, prompt_regret
from sae_env.files import atomic_path, write_text
from sae_env.intervals import Interval, mean_interval, paired_difference, paired_ratio

__all__ = ["PAIRED_COLUMNS", "PAIRED_METRICS", "PHASE_COLUMNS", "SUMMARY_COLUMNS", "paired_rows", "phase_rows",
           "reference_agent", "summary_rows", "write_report"]

PAIRED_COLUMNS = ("workload", "capacity", "load", "reference", "agent", "metric", "mean", "low", "high", "n",
                  "reference_better")
# (metric, summary column, kind): differences are reference minus agent; ratios agent / reference.
PAIRED_METRICS = (("token_hit_rate_pp", "token_hit_rate", "difference"), ("ttft_mean_ms", "ttft_mean_ms",
                  "difference"), ("ttft_p99_ms", "ttft_p99_ms", "difference"),
                  ("ttft_mean_ratio", "ttft_mean_ms", "ratio"))
SUMMARY_COLUMNS = ("cell", "workload", "capacity", "capacity_blocks", "load", "agent", "policy", "agent_kind",
                   "seed", "requests", "token_hit_rate", "block_hit_rate", "gap_to_belady_pp", "ttft_mean_ms",
                   "ttft_p50_ms", "ttft_p99_ms", "evictions", "bypasses", "miss_after_eviction", "gap_share",
                   "prompt_blocks", "compulsory_misses", "capacity_misses", "regret_misses", "replay_s")


def _belady_key(cell: Mapping[str, Any]) -> tuple:
    return cell["workload"], str(cell["capacity"]), cell["load"], cell["seed"]


def _miss_split(s: Mapping[str, Any]) -> dict[str, int | None]:
    """Prompt blocks and the miss classes of a cell's summary (None where the summary lacks the counts)."""
    regret, compulsory = prompt_regret(s), s.get("compulsory_misses")
    misses = s["prompt_blocks"] - s["hit_blocks"] if "prompt_blocks" in s else None
    known = None not in (regret, compulsory, misses)
    return {"prompt_blocks": s.get("prompt_blocks"), "compulsory_misses": compulsory,
            "capacity_misses": misses - compulsory - regret if known else None,
            "regret_misses": regret if known else None}


def summary_rows(results: Mapping[str, Mapping[str, Any]], order: Iterable[str]) -> list[dict[str, Any]]:
    """One dict per finished cell (in ``order``, the experiment's cell order) with :data:`SUMMARY_COLUMNS`."""
    def rates(policy: str) -> dict[tuple, float]:
        return {_belady_key(r["cell"]): r["summary"]["token_hit_rate"] for r in results.values()
                if r["cell"]["agent"]["policy"] == policy}

    oracle, lru = rates("belady"), rates("lru")
    rows = []
    for cid in order:
        if cid not in results:
            continue
        r = results[cid]
        c, s = r["cell"], r["summary"]
        best = oracle.get(_belady_key(c))
        rows.append({
            "cell": cid, "workload": c["workload"], "capacity": c["capacity"], "capacity_blocks": s["capacity_blocks"],
            "load": c["load"], "agent": c["agent"]["name"], "policy": c["agent"]["policy"],
            "agent_kind": c["agent"]["agent"], "seed": c["seed"], "requests": s["requests"],
            "token_hit_rate": s["token_hit_rate"], "block_hit_rate": s["block_hit_rate"],
            "gap_to_belady_pp": None if best is None else 100.0 * (best - s["token_hit_rate"]),
            "ttft_mean_ms": s.get("ttft_mean_ms"), "ttft_p50_ms": s.get("ttft_p50_ms"),
            "ttft_p99_ms": s.get("ttft_p99_ms"), "evictions": s["evictions"], "bypasses": s["bypasses"],
            "miss_after_eviction": s.get("miss_after_eviction"),
            "gap_share": gap_share(s["token_hit_rate"], lru.get(_belady_key(c)), best), **_miss_split(s),
            "replay_s": r.get("timing", {}).get("replay_s"),
        })
    return rows


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...] = SUMMARY_COLUMNS) -> None:
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for row in rows:
            w.writerow({k: _csv_value(row[k]) for k in columns})


def _fmt(iv: Interval, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± half`` (the 95 % interval's half-width), ``mean`` alone from one seed, ``-`` without a value."""
    if iv.mean is None:
        return "-"
    text = f"{scale * iv.mean:.{digits}f}"
    return text + (f" ± {abs(scale) * iv.half:.{digits}f}" if iv.half is not None else "")


def _fmt_range(iv: Interval, digits: int = 2, suffix: str = "") -> str:
    """``mean [low, high]`` (or ``mean`` from one seed)."""
    if iv.mean is None:
        return "-"
    text = f"{iv.mean:.{digits}f}{suffix}"
    if iv.low is not None:
        text += f" [{iv.low:.{digits}f}, {iv.high:.{digits}f}]"
    return text


def reference_agent(config: Any) -> str | None:
    """The agent the paired comparisons are made against: the config's ``reference``, else ``saecache`` if the
    config has an agent of that name, else None (no paired tables)."""
    names = [a.name for a in config.agents]
    ref = getattr(config, "reference", None)
    if ref is not None:
        return ref
    return "saecache" if "saecache" in names else None


def _group_key(row: Mapping[str, Any]) -> tuple:
    return row["workload"], str(row["capacity"]), row["load"]


def paired_rows(rows: list[dict[str, Any]], reference: str | None) -> list[dict[str, Any]]:
    """Per (workload, capacity, load) group and agent other than ``reference``: the paired statistics of
    :data:`PAIRED_METRICS` over the seeds both ran (see the module docstring); [] without a reference."""
    if reference is None:
        return []
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[_group_key(row)].append(row)
    out = []
    for key, group in groups.items():
        ref = {r["seed"]: r for r in group if r["agent"] == reference}
        if not ref:
            continue
        for agent in dict.fromkeys(r["agent"] for r in group if r["agent"] != reference):
            other = {r["seed"]: r for r in group if r["agent"] == agent}
            seeds = sorted(set(ref) & set(other))
            for metric, column, kind in PAIRED_METRICS:
                a = [ref[s][column] for s in seeds]
                b = [other[s][column] for s in seeds]
                if kind == "ratio":
                    iv = paired_ratio(b, a)
                else:
                    iv = paired_difference(a, b).scaled(100.0 if column == "token_hit_rate" else 1.0)
                if iv.mean is None:
                    continue
                higher_better = column == "token_hit_rate"
                better = sum(1 for x, y in zip(a, b, strict=True) if x is not None and y is not None
                             and (x > y if higher_better else x < y))
                out.append({"workload": key[0], "capacity": group[0]["capacity"], "load": key[2],
                            "reference": reference, "agent": agent, "metric": metric, "mean": iv.mean,
                            "low": iv.low, "high": iv.high, "n": iv.n, "reference_better": better})
    return out


def _phase_totals(result: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per phase name: hit and prompt tokens, requests, and TTFT summed over the requests (windows whose first
    request belongs to the phase; window TTFT means weighted by their requests)."""
    phases = result.get("phases") or []
    out: dict[str, dict[str, float]] = {}
    for row in result.get("history", []):
        i = row.get("phase", -1)
        if i < 0 or i >= len(phases):
            continue
        acc = out.setdefault(phases[i]["name"], {"hit": 0, "prompt": 0, "requests": 0, "ttft_sum": 0.0,
                                                   "ttft_requests": 0})
        acc["hit"] += row["hit_tokens"]
        acc["prompt"] += row["prompt_tokens"]
        acc["requests"] += row.get("requests", 0)
        if row.get("ttft_mean_ms") is not None and row.get("requests"):
            acc["ttft_sum"] += row["ttft_mean_ms"] * row["requests"]
            acc["ttft_requests"] += row["requests"]
    return out


def _phase_rates(result: Mapping[str, Any]) -> dict[str, float]:
    return {name: acc["hit"] / acc["prompt"] for name, acc in _phase_totals(result).items() if acc["prompt"]}


PHASE_COLUMNS = ("cell", "workload", "capacity", "load", "agent", "seed", "phase", "requests", "token_hit_rate",
                 "ttft_mean_ms")


def phase_rows(results: Mapping[str, Mapping[str, Any]], order: Iterable[str]) -> list[dict[str, Any]]:
    """One dict per (finished cell, phase of its trace) with :data:`PHASE_COLUMNS` (empty without phases)."""
    rows = []
    for cid in order:
        if cid not in results:
            continue
        c = results[cid]["cell"]
        for name, acc in _phase_totals(results[cid]).items():
            rows.append({"cell": cid, "workload": c["workload"], "capacity": c["capacity"], "load": c["load"],
                         "agent": c["agent"]["name"], "seed": c["seed"], "phase": name, "requests": acc["requests"],
                         "token_hit_rate": acc["hit"] / acc["prompt"] if acc["prompt"] else None,
                         "ttft_mean_ms": acc["ttft_sum"] / acc["ttft_requests"] if acc["ttft_requests"] else None})
    return rows


def _paired_table(paired: list[dict[str, Any]], reference: str, timed: bool) -> list[str]:
    """The paired comparison of one group, one row per agent."""
    by_agent: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for p in paired:
        by_agent[p["agent"]][p["metric"]] = p
    if not by_agent:
        return []
    n = max(p["n"] for p in paired)
    header = ["agent", f"{reference} − agent: token hit (pp)"]
    if timed:
        header += ["TTFT mean (ms)", "TTFT p99 (ms)", f"TTFT ratio agent / {reference}"]
    header += [f"seeds {reference} better (hit" + (", TTFT mean)" if timed else ")")]
    lines = [f"Paired per seed ({n} seed{'s' if n != 1 else ''}): {reference} minus each agent, mean [95 % "
             "interval]; the TTFT ratio is a geometric mean (above 1: the agent is slower).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(agent: str, metric: str, digits: int = 2, suffix: str = "") -> str:
        p = by_agent[agent].get(metric)
        if p is None:
            return "-"
        return _fmt_range(Interval(p["mean"], None, p["n"], p["low"], p["high"]), digits, suffix)

    for agent, metrics in by_agent.items():
        cols = [agent, cell(agent, "token_hit_rate_pp")]
        if timed:
            cols += [cell(agent, "ttft_mean_ms", 1), cell(agent, "ttft_p99_ms", 1),
                     cell(agent, "ttft_mean_ratio", 2, "x")]
        wins = [metrics.get("token_hit_rate_pp")] + ([metrics.get("ttft_mean_ms")] if timed else [])
        cols.append(", ".join("-" if w is None else f"{w['reference_better']}/{w['n']}" for w in wins))
        lines.append("| " + " | ".join(cols) + " |")
    return lines + [""]


def _per_block(row: Mapping[str, Any], key: str) -> float | None:
    """``row[key]`` as a fraction of the cell's prompt blocks (None when unknown)."""
    return None if row[key] is None or not row["prompt_blocks"] else row[key] / row["prompt_blocks"]


def _gap_section(by_group: Mapping[tuple, list[dict[str, Any]]]) -> list[str]:
    """Per group: each agent's share of the LRU-to-Belady gap and its miss split (% of prompt blocks)."""
    classes = ("compulsory_misses", "capacity_misses", "regret_misses")
    lines = ["## Gap analysis", "",
             "Share of the LRU-to-Belady gap in token hit rate (0 % = LRU, 100 % = Belady; needs both agents) and "
             "the prompt-block misses split into compulsory (first reference of the key), capacity and regret "
             "(evicted, then missed while the ghost record held it), in % of the prompt blocks; "
             "`python train.py explain` breaks one cell down by type, queue, turn, depth and idle time.", ""]
    for (workload, capacity, load), group in by_group.items():
        lines += [f"### {workload}, capacity {capacity}" + ("" if load is None else f", load {load}"), "",
                  "| agent | gap share % | misses % | compulsory % | capacity % | regret % |",
                  "|---|---|---|---|---|---|"]
        for a in dict.fromkeys(r["agent"] for r in group):
            rs = [r for r in group if r["agent"] == a]
            misses = [None if r["regret_misses"] is None else 1.0 - r["block_hit_rate"] for r in rs]
            values = [[r["gap_share"] for r in rs], misses] + [[_per_block(r, k) for r in rs] for k in classes]
            cols = [a] + [_fmt(mean_interval(v), 100.0, 1) for v in values]
            lines.append("| " + " | ".join(cols) + " |")
        lines.append("")
    return lines


def _markdown(run: Any, rows: list[dict[str, Any]], paired: list[dict[str, Any]], plots: list[Path]) -> str:
    config = run.config
    lines = [f"# {config.name}", ""]
    if config.description:
        lines += [config.description, ""]
    serving = config.serving.model
    reference = reference_agent(config)
    lines += [f"Run folder `{run.run_dir}`; {len(run.cells)} cells ({len(run.results)} finished, "
              f"{len(run.failures)} failed); serving `{serving}`; window {config.window}; seeds "
              f"{list(config.seeds)}. Token hit rates in %, TTFT in ms; with several seeds, ± is the half-width of "
              "the 95 % confidence interval of the mean over seeds (Student t); gap to Belady in percentage "
              "points. Per-phase columns (traces with a phase schedule) count the windows whose first request "
              "arrived within the phase; windows after the schedule's end (sessions still running) are in the "
              "totals only." + (f" Under each table, {reference} paired with every other agent on the same seeds."
                                if reference else ""), ""]
    timed = serving != "instant"
    by_group: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_group[_group_key(row)].append(row)
    paired_by_group: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for p in paired:
        paired_by_group[(p["workload"], str(p["capacity"]), p["load"])].append(p)
    results_by_cell = run.results
    for (workload, capacity, load), group in by_group.items():
        sizes = sorted({r["capacity_blocks"] for r in group})  # a fraction of each seed's own trace
        blocks = f"{sizes[0]} blocks" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} blocks over seeds"
        title = f"## {workload}, capacity {capacity} ({blocks})" + ("" if load is None else f", load {load}")
        lines += [title, ""]
        agents = list(dict.fromkeys(r["agent"] for r in group))
        phase_names: list[str] = []
        per_agent_phase: dict[str, dict[str, list[float]]] = {}
        for a in agents:
            per_agent_phase[a] = defaultdict(list)
            for r in group:
                if r["agent"] == a:
                    for name, rate in _phase_rates(results_by_cell[r["cell"]]).items():
                        per_agent_phase[a][name].append(rate)
                        if name not in phase_names:
                            phase_names.append(name)
        header = ["agent", "token hit %", "block hit %", "gap to Belady (pp)"]
        if timed:
            header += ["TTFT mean", "TTFT p99"]
        header += [f"{p} hit %" for p in phase_names]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for a in agents:
            rs = [r for r in group if r["agent"] == a]
            cols = [a, _fmt(mean_interval([r["token_hit_rate"] for r in rs]), 100.0),
                    _fmt(mean_interval([r["block_hit_rate"] for r in rs]), 100.0),
                    _fmt(mean_interval([r["gap_to_belady_pp"] for r in rs]))]
            if timed:
                cols += [_fmt(mean_interval([r["ttft_mean_ms"] for r in rs]), digits=1),
                         _fmt(mean_interval([r["ttft_p99_ms"] for r in rs]), digits=1)]
            cols += [_fmt(mean_interval(per_agent_phase[a].get(p, [])), 100.0) for p in phase_names]
            lines.append("| " + " | ".join(cols) + " |")
        lines.append("")
        if reference is not None:
            lines += _paired_table(paired_by_group.get((workload, capacity, load), []), reference, timed)
    lines += _gap_section(by_group)
    if run.failures:
        lines += ["## Failed cells", ""]
        for cid, f in run.failures.items():
            lines.append(f"- `{cid}` ({f['attempts']} attempts): {f['error']}")
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(run.run_dir)})" for p in plots]
        lines.append("")
    return "\n".join(lines)


def write_report(run: Any) -> list[Path]:
    """Write summary.csv, the plots and report.md into ``run.run_dir``; returns every path written."""
    from sae_env import plots as P

    order = [c.id for c in run.cells]
    rows = summary_rows(run.results, order)
    paired = paired_rows(rows, reference_agent(run.config))
    out = Path(run.run_dir)
    _write_csv(out / "summary.csv", rows)
    written = [out / "summary.csv"]
    if paired:
        _write_csv(out / "paired.csv", paired, PAIRED_COLUMNS)
        written.append(out / "paired.csv")
    figures: list[Path] = []
    if rows:
        results = [run.results[r["cell"]] for r in rows]
        figures += [p for p in (P.plot_hit_rate_vs_capacity(rows, out / "plots" / "hit_rate_vs_capacity.png"),
                                P.plot_ttft_vs_load(rows, out / "plots" / "ttft_vs_load.png"),
                                P.plot_paired(paired, out / "plots" / "paired.png"),
                                P.plot_ttft_cdf(results, out / "plots" / "ttft_cdf.png"),
                                P.plot_hit_rate_over_time(results, out / "plots" / "hit_rate_over_time.png"))
                    if p is not None]
        figures += P.plot_param_trajectories(results, out / "plots")
    report = write_text(out / "report.md", _markdown(run, rows, paired, figures))
    return [*written, report, *figures]
