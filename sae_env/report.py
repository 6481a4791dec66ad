"""An experiment's report: ``summary.csv`` (one row per cell), ``report.md`` (tables) and the PNG plots.

Tables of ``report.md``, one per (workload, capacity, load) group, one row per agent, means over seeds (with the
spread when there are several): token hit rate, block hit rate, TTFT mean / p99 (timed serving only), the gap to
Belady (oracle minus agent token hit rate, in percentage points, when the config has a ``belady`` agent), and
per-phase token hit rates where the trace has a phase schedule. A phase's hit rate sums the hit and prompt tokens
of the windows whose first request belongs to the phase.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.files import atomic_path, write_text

__all__ = ["SUMMARY_COLUMNS", "summary_rows", "write_report"]

SUMMARY_COLUMNS = ("cell", "workload", "capacity", "capacity_blocks", "load", "agent", "policy", "agent_kind",
                   "seed", "requests", "token_hit_rate", "block_hit_rate", "gap_to_belady_pp", "ttft_mean_ms",
                   "ttft_p50_ms", "ttft_p99_ms", "evictions", "bypasses", "miss_after_eviction", "replay_s")


def _belady_key(cell: Mapping[str, Any]) -> tuple:
    return cell["workload"], str(cell["capacity"]), cell["load"], cell["seed"]


def summary_rows(results: Mapping[str, Mapping[str, Any]], order: Iterable[str]) -> list[dict[str, Any]]:
    """One dict per finished cell (in ``order``, the experiment's cell order) with :data:`SUMMARY_COLUMNS`."""
    oracle = {_belady_key(r["cell"]): r["summary"]["token_hit_rate"] for r in results.values()
              if r["cell"]["agent"]["policy"] == "belady"}
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
            "replay_s": r.get("timing", {}).get("replay_s"),
        })
    return rows


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: _csv_value(row[k]) for k in SUMMARY_COLUMNS})


def _mean_sd(values: list[float | None]) -> tuple[float | None, float | None]:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None, None
    return float(np.mean(xs)), (float(np.std(xs, ddof=1)) if len(xs) > 1 else None)


def _fmt(mean: float | None, sd: float | None, scale: float = 1.0, digits: int = 2) -> str:
    if mean is None:
        return "-"
    text = f"{scale * mean:.{digits}f}"
    return text + (f" ± {scale * sd:.{digits}f}" if sd is not None else "")


def _phase_rates(result: Mapping[str, Any]) -> dict[str, float]:
    phases = result.get("phases") or []
    hit: dict[int, int] = defaultdict(int)
    prompt: dict[int, int] = defaultdict(int)
    for row in result.get("history", []):
        if row.get("phase", -1) >= 0:
            hit[row["phase"]] += row["hit_tokens"]
            prompt[row["phase"]] += row["prompt_tokens"]
    return {phases[i]["name"]: hit[i] / prompt[i] for i in sorted(prompt) if prompt[i] and i < len(phases)}


def _markdown(run: Any, rows: list[dict[str, Any]], plots: list[Path]) -> str:
    config = run.config
    lines = [f"# {config.name}", ""]
    if config.description:
        lines += [config.description, ""]
    serving = config.serving.model
    lines += [f"Run folder `{run.run_dir}`; {len(run.cells)} cells ({len(run.results)} finished, "
              f"{len(run.failures)} failed); serving `{serving}`; window {config.window}; seeds "
              f"{list(config.seeds)}. Token hit rates in %, TTFT in ms; ± is the standard deviation over seeds; "
              "gap to Belady in percentage points. Per-phase columns (traces with a phase schedule) count the "
              "windows whose first request arrived within the phase; windows after the schedule's end (sessions "
              "still running) are in the totals only.", ""]
    timed = serving != "instant"
    by_group: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_group[(row["workload"], str(row["capacity"]), row["load"])].append(row)
    results_by_cell = run.results
    for (workload, capacity, load), group in by_group.items():
        blocks = group[0]["capacity_blocks"]
        title = f"## {workload}, capacity {capacity} ({blocks} blocks)" + ("" if load is None else f", load {load}")
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
            cols = [a, _fmt(*_mean_sd([r["token_hit_rate"] for r in rs]), 100.0),
                    _fmt(*_mean_sd([r["block_hit_rate"] for r in rs]), 100.0),
                    _fmt(*_mean_sd([r["gap_to_belady_pp"] for r in rs]))]
            if timed:
                cols += [_fmt(*_mean_sd([r["ttft_mean_ms"] for r in rs]), digits=1),
                         _fmt(*_mean_sd([r["ttft_p99_ms"] for r in rs]), digits=1)]
            cols += [_fmt(*_mean_sd(per_agent_phase[a].get(p, [])), 100.0) for p in phase_names]
            lines.append("| " + " | ".join(cols) + " |")
        lines.append("")
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
    out = Path(run.run_dir)
    _write_csv(out / "summary.csv", rows)
    figures: list[Path] = []
    if rows:
        results = [run.results[r["cell"]] for r in rows]
        figures += [p for p in (P.plot_hit_rate_vs_capacity(rows, out / "plots" / "hit_rate_vs_capacity.png"),
                                P.plot_ttft_vs_load(rows, out / "plots" / "ttft_vs_load.png"),
                                P.plot_ttft_cdf(results, out / "plots" / "ttft_cdf.png"),
                                P.plot_hit_rate_over_time(results, out / "plots" / "hit_rate_over_time.png"))
                    if p is not None]
        figures += P.plot_param_trajectories(results, out / "plots")
    report = write_text(out / "report.md", _markdown(run, rows, figures))
    return [out / "summary.csv", report, *figures]
