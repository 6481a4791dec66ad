"""The figures of the README's paper-vs-measured table, read from the run folders of the real_* studies.

Run the studies first (each is one command; see the README's "Paper vs measured" section), then

    python benchmarks/paper_table.py [--runs runs] [--json F]

Each study's latest run folder (``runs/<study>/<run-id>/``, newest ``report.md``) is read: ``paired.csv`` (the
reference agent, SAECache adaptive, paired per seed with every other agent, 95 % intervals) and ``summary.csv``.
Printed, one block per claim of the method (docs/SAECACHE.md, "Claims to measure against"):

1. TTFT (real_load): per load, the TTFT mean ratio LRU / SAECache and LPC / SAECache (geometric mean over seeds,
   interval), and the stronger baseline's (lower mean TTFT).
2. Hit rate (real_capacity): per workload and capacity, SAECache minus the stronger of LRU and LPC (higher mean token
   hit rate), in points, with its paired interval.
3. Mismatch (real_mismatch): per workload, TTFT mean ratio of each frozen agent (tuned on one workload; the
   defaults) to adaptive SAECache, matched (tuned on that workload) and mismatched.
4. Ablation (real_ablation): full SAECache minus each ablated variant (points), and that difference as a share of
   the full method's gain over LRU (only when that gain's interval excludes 0).
5. The single-turn caveat (real_mismatch, real_templated workload): SAECache's TTFT gain over LRU against its
   decision overhead (replay wall time per request, SAECache minus LRU, both on the Python engine: the server
   simulation is the same work for both).

The predictor's size and throughput come from ``python benchmarks/predictor_bench.py``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.files import write_json


def latest(runs: Path, study: str) -> Path | None:
    folders = [p.parent for p in (runs / study).glob("*/report.md")]
    return max(folders, key=lambda p: (p / "report.md").stat().st_mtime) if folders else None


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def num(v: str) -> float | None:
    return float(v) if v not in ("", None) else None


def interval(row: dict[str, str], digits: int = 2, suffix: str = "") -> str:
    text = f"{float(row['mean']):.{digits}f}{suffix}"
    if row["low"]:
        text += f" [{float(row['low']):.{digits}f}, {float(row['high']):.{digits}f}]"
    return text


def paired(run: Path) -> dict[tuple, dict[str, str]]:
    """(workload, capacity, load, agent, metric) -> paired row."""
    return {(r["workload"], r["capacity"], r["load"], r["agent"], r["metric"]): r
            for r in read_csv(run / "paired.csv")}


def means(run: Path, column: str) -> dict[tuple, float]:
    """(workload, capacity, load, agent) -> mean of ``column`` over seeds."""
    acc: dict[tuple, list[float]] = defaultdict(list)
    for r in read_csv(run / "summary.csv"):
        if r[column]:
            acc[(r["workload"], r["capacity"], r["load"], r["agent"])].append(float(r[column]))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def ttft(run: Path) -> dict[str, Any]:
    p, m = paired(run), means(run, "ttft_mean_ms")
    out = []
    for (w, c, u, agent, metric), row in sorted(p.items(), key=lambda kv: float(kv[0][2] or 0)):
        if agent != "lru" or metric != "ttft_mean_ratio":
            continue
        lpc = p[(w, c, u, "lpc", metric)]
        strongest = "lru" if m[(w, c, u, "lru")] <= m[(w, c, u, "lpc")] else "lpc"
        out.append({"workload": w, "capacity": c, "load": u, "lru": interval(row, 3, "x"),
                    "lpc": interval(lpc, 3, "x"), "stronger": strongest,
                    "stronger_ratio": interval(p[(w, c, u, strongest, metric)], 3, "x")})
    return {"rows": out}


def hit_rate(run: Path) -> dict[str, Any]:
    p, m = paired(run), means(run, "token_hit_rate")
    out = []
    for (w, c, u, agent, metric), _row in p.items():
        if agent != "lru" or metric != "token_hit_rate_pp":
            continue
        strongest = "lru" if m[(w, c, u, "lru")] >= m[(w, c, u, "lpc")] else "lpc"
        row = p[(w, c, u, strongest, metric)]
        out.append({"workload": w, "capacity": c, "stronger": strongest, "saecache_minus_stronger_pp": interval(row),
                    "mean": float(row["mean"]), "low": num(row["low"]), "high": num(row["high"])})
    lows = [r["low"] for r in out if r["low"] is not None]
    return {"rows": out, "range_pp": [round(min(r["mean"] for r in out), 2), round(max(r["mean"] for r in out), 2)],
            "settings": len(out), "settings_above_4.8": sum(1 for x in lows if x > 4.8)}


def mismatch(run: Path) -> dict[str, Any]:
    p = paired(run)
    out = []
    for (w, c, u, agent, metric), row in p.items():
        if metric == "ttft_mean_ratio" and (agent.startswith("tuned-on-") or agent == "saecache-fixed"):
            matched = agent == f"tuned-on-{w.removeprefix('real_')}"
            out.append({"workload": w, "agent": agent, "matched": matched,
                        "ttft_agent_over_adaptive": interval(row, 3, "x"), "mean": float(row["mean"]),
                        "adaptive_minus_agent_hit_pp": interval(p[(w, c, u, agent, "token_hit_rate_pp")])})
    worst = max((r for r in out if not r["matched"]), key=lambda r: r["mean"], default=None)
    return {"rows": out, "worst_mismatched": worst}


def ablation(run: Path) -> dict[str, Any]:
    p = paired(run)
    gain = next(r for k, r in p.items() if k[3] == "lru" and k[4] == "token_hit_rate_pp")
    g = float(gain["mean"])
    out = [{"variant": "lru (all mechanisms off)", "full_minus_variant_pp": interval(gain)}]
    for (_w, _c, _u, agent, metric), row in p.items():
        if metric != "token_hit_rate_pp" or agent in ("lru", "belady"):
            continue
        # A share of a gain whose interval holds 0 means nothing: left out.
        significant = gain["low"] and (float(gain["low"]) > 0 or float(gain["high"]) < 0)
        share = 100 * float(row["mean"]) / g if significant else None
        out.append({"variant": agent, "full_minus_variant_pp": interval(row),
                    "share_of_gain_pct": None if share is None else round(share, 1)})
    return {"rows": out, "gain_over_lru_pp": interval(gain)}


def caveat(run: Path) -> dict[str, Any]:
    p = paired(run)
    rows = read_csv(run / "summary.csv")
    w = "real_templated"
    per_request = {}
    for agent in ("lru", "saecache"):
        sel = [r for r in rows if r["workload"] == w and r["agent"] == agent and r["replay_s"]]
        per_request[agent] = 1e6 * sum(float(r["replay_s"]) for r in sel) / sum(int(r["requests"]) for r in sel)
    key = next(k for k in p if k[0] == w and k[3] == "lru" and k[4] == "ttft_mean_ms")
    return {"workload": w, "saecache_minus_lru_ttft_ms": interval(p[key], 2),
            "saecache_minus_lru_hit_pp": interval(p[key[:4] + ("token_hit_rate_pp",)]),
            "replay_us_per_request": {k: round(v, 1) for k, v in per_request.items()},
            "overhead_us_per_request": round(per_request["saecache"] - per_request["lru"], 1)}


_HIDDEN = {"mean", "low", "high", "run"}  # numeric helpers of the rows, kept in --json only


def markdown(block: dict[str, Any]) -> str:
    """A block's rows as a markdown table, its other figures as lines."""
    lines = []
    rows = block.get("rows")
    if isinstance(rows, list) and rows:
        cols = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in _HIDDEN]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in cols) + " |" for r in rows]
        lines.append("")
    for k, v in block.items():
        if k not in ("rows", "run"):
            shown = {kk: vv for kk, vv in v.items() if kk not in _HIDDEN} if isinstance(v, dict) else v
            lines.append(f"- {k}: {shown}")
    return "\n".join(lines) + "\n"


STUDIES = (("real_load", ttft), ("real_capacity", hit_rate), ("real_mismatch", mismatch),
           ("real_ablation", ablation), ("real_mismatch", caveat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="runs", help="the studies' output folder (default runs)")
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    figures: dict[str, Any] = {}
    for study, fn in STUDIES:
        run = latest(Path(args.runs), study)
        key = f"{study}:{fn.__name__}"
        if run is None:
            print(f"## {key}: no run folder under {args.runs}/{study}: run `python train.py --config "
                  f"configs/{study}.yaml` first\n")
            continue
        figures[key] = {"run": str(run), **fn(run)}
        print(f"## {key} ({run})\n")
        print(markdown(figures[key]))
    if args.json:
        write_json(args.json, figures, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
