"""Matplotlib figures written as PNG files (one function per figure, each returns the path it wrote).

Figures are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas, never through ``pyplot``: no global
backend switch, no figure registry to leak from, safe in worker processes without a display.

Characterisation figures take the dict returned by :func:`sae_env.characterize.characterize`:

- ``reuse_by_token_type.png``: forward reuse and backward hit ratio per TokenType (grouped bars; ``log_y`` optional,
  since the paper's spread across types reaches several hundred times);
- ``reuse_by_app.png``: the same per AppType;
- ``hit_by_offset.png``: hit ratio and forward reuse per log2 block-offset bucket;
- ``gap_histograms.png``: one panel per app, a histogram of the positive inter-turn gaps on log-spaced bins, drawn
  as density per unit of ln(gap) (so that a log-normal looks like a bell on the log-x axis), with both fitted
  densities overlaid on the same scale (``x * pdf(x)``).

Experiment figures (:mod:`sae_env.report` calls them) take summary rows (:func:`sae_env.report.summary_rows`) or cell
results; where one cell per workload stands for the rest it is the middle capacity, the highest load and the first
seed of the config (``_representative``):

- ``hit_rate_vs_capacity.png``: token hit rate against cache size (blocks), one line per agent, a panel per workload
  (means over seeds and loads; with several seeds a band for the 95 % confidence interval over seeds, cells of
  different loads at one size averaged per seed first);
- ``ttft_vs_load.png``: TTFT mean and p99 against load, one line per agent (only with several loads), with the 95 %
  confidence bands over seeds;
- ``ttft_cdf.png``: the CDF of every request's TTFT, one curve per agent, a panel per workload (timed serving);
- ``paired.png``: the reference agent paired with each other agent on the same seeds: token hit rate difference
  and TTFT ratio (timed serving), means with 95 % bands, against load or capacity, a column per workload;
- ``hit_rate_over_time.png``: windowed token hit rate over simulated time, one line per agent, phases shaded;
- ``params_<workload>_<agent>.png``: an adaptive agent's parameters over time (alpha per queue, type weights,
  mu / sigma, gamma for SAECache; any other parameters in a last panel), phases shaded.

Gap-analysis figures (``train.py explain``) take the dict returned by :func:`sae_env.explain.explain`:

- ``gap_bar.png``: every policy's token hit rate on one bar (LRU's hits grey, the LRU-to-Belady gap cut at each
  policy), each mark labelled with its share of the gap;
- ``miss_split.png``: each policy's prompt blocks as hits, compulsory, capacity and regret misses (stacked);
- ``regret_by.png``: the policy's regret misses by token type, queue at eviction, session turn, block depth and idle
  time at eviction, with the regret per 100 references of each bucket where that is defined;
- ``belady_keeps.png``: the blocks the policy misses and Belady hits, by token type and by age, beside all of the
  policy's misses.

Why one piece (~540 lines): every figure of the project (characterisation, experiment reports, explain) is one
function over one Agg-canvas style (sizes, DPI, colours, the 95 % band helper); callers pick theirs by name, and a
figure changes in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy import stats

from sae_env.files import atomic_path
from sae_env.intervals import mean_interval

__all__ = ["line_with_band", "plot_belady_keeps", "plot_gap_bar", "plot_gap_histograms", "plot_hit_by_offset",
           "plot_hit_rate_over_time", "plot_hit_rate_vs_capacity", "plot_miss_split", "plot_paired",
           "plot_param_trajectories", "plot_regret_breakdown", "plot_reuse_by_app", "plot_reuse_by_token_type",
           "plot_ttft_cdf", "plot_ttft_vs_load"]

_DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    with atomic_path(path) as tmp:  # a reader (or W&B) never sees half a PNG
        fig.savefig(tmp, dpi=_DPI, bbox_inches="tight", format=path.suffix.lstrip(".") or "png")
    return path


def _val(v: float | None) -> float:
    return float("nan") if v is None else float(v)


def _grouped_bars(table: Mapping[str, Mapping[str, Any]], title: str, xlabel: str, path: Path,
                  log_y: bool) -> Path:
    names = list(table)
    x = np.arange(len(names))
    fig = Figure(figsize=(max(5.0, 1.1 * len(names) + 2), 3.8))
    ax = fig.add_subplot()
    w = 0.38
    fwd = [_val(table[n]["reuse_ratio"]) for n in names]
    hit = [_val(table[n]["hit_ratio"]) for n in names]
    ax.bar(x - w / 2, fwd, w, label="forward reuse (occurrences reused later)")
    ax.bar(x + w / 2, hit, w, label="hit ratio (prompt refs seen before)")
    for xi, v in zip(x, fwd, strict=True):
        if math.isfinite(v):
            ax.annotate(f"{100 * v:.1f}%", (xi - w / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, names, rotation=20 if len(names) > 4 else 0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, 1.25)  # headroom for the legend above the bars
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_reuse_by_token_type(result: Mapping[str, Any], out_dir: str | Path, log_y: bool = False) -> Path:
    """Forward reuse and hit ratio per TokenType -> ``out_dir/reuse_by_token_type.png``."""
    return _grouped_bars(result["by_token_type"], f"Block reuse by token type ({result.get('source') or 'trace'})",
                         "token type", Path(out_dir) / "reuse_by_token_type.png", log_y)


def plot_reuse_by_app(result: Mapping[str, Any], out_dir: str | Path, log_y: bool = False) -> Path:
    """Forward reuse and hit ratio per AppType -> ``out_dir/reuse_by_app.png``."""
    return _grouped_bars(result["by_app"], f"Block reuse by application ({result.get('source') or 'trace'})",
                         "application", Path(out_dir) / "reuse_by_app.png", log_y)


def plot_hit_by_offset(result: Mapping[str, Any], out_dir: str | Path) -> Path:
    """Hit ratio and forward reuse per log2 block-offset bucket -> ``out_dir/hit_by_offset.png``."""
    rows = result["by_offset"]
    x = np.arange(len(rows))
    fig = Figure(figsize=(max(5.0, 0.55 * len(rows) + 2), 3.8))
    ax = fig.add_subplot()
    ax.plot(x, [_val(r["hit_ratio"]) for r in rows], "o-", label="hit ratio")
    ax.plot(x, [_val(r["reuse_ratio"]) for r in rows], "s--", label="forward reuse")
    ax.set_xticks(x, [r["bucket"] for r in rows], rotation=45 if len(rows) > 8 else 0)
    ax.set_xlabel("block offset in the prompt (log2 buckets)")
    ax.set_ylabel("fraction of prompt block refs")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Reuse by block position ({result.get('source') or 'trace'})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, Path(out_dir) / "hit_by_offset.png")


def plot_gap_histograms(result: Mapping[str, Any], gaps: Mapping[str, np.ndarray], out_dir: str | Path,
                        bins: int = 40) -> Path:
    """Inter-turn gap histograms per app with fitted log-normal and exponential -> ``out_dir/gap_histograms.png``.

    ``gaps`` maps an app name to its raw gaps (e.g. :func:`sae_env.characterize.session_gaps`); zero gaps are left
    out, as in the fits. An app with fewer than 2 positive gaps gets an empty panel saying so.
    """
    apps = list(gaps) or ["(no sessions)"]
    fig = Figure(figsize=(4.6 * len(apps), 3.6))
    axes = fig.subplots(1, len(apps), squeeze=False)[0]
    for ax, app in zip(axes, apps, strict=True):
        g = np.asarray(gaps.get(app, np.zeros(0)), dtype=np.float64)
        g = g[g > 0]
        fit = result.get("gaps", {}).get(app, {})
        ax.set_title(f"{app}: {g.size} gaps")
        ax.set_xscale("log")
        ax.set_xlabel("inter-turn gap (s)")
        ax.set_ylabel("density per unit ln(gap)")
        if g.size < 2 or g.min() == g.max():
            ax.text(0.5, 0.5, "too few distinct gaps to fit", transform=ax.transAxes, ha="center")
            continue
        edges = np.geomspace(g.min(), g.max(), bins + 1)
        counts, _ = np.histogram(g, edges)
        ax.stairs(counts / (g.size * np.diff(np.log(edges))), edges, fill=True, alpha=0.4, label="observed")
        xs = np.geomspace(g.min(), g.max(), 300)
        if fit.get("lognormal_sigma"):
            mu, sigma = fit["lognormal_mu"], fit["lognormal_sigma"]
            ax.plot(xs, xs * stats.lognorm.pdf(xs, sigma, scale=math.exp(mu)),
                    label=f"log-normal mu={mu:.2f} sigma={sigma:.2f}")
        if fit.get("exponential_rate"):
            rate = fit["exponential_rate"]
            ax.plot(xs, xs * stats.expon.pdf(xs, scale=1.0 / rate), "--", label=f"exponential rate={rate:.3g}/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"Inter-turn gaps ({result.get('source') or 'trace'})")
    return _save(fig, Path(out_dir) / "gap_histograms.png")


# ----------------------------------------------------------------------------------------------------------------
# Experiment figures


def _panels(n: int, width: float = 5.2, height: float = 3.6) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width * n, height))
    return fig, list(fig.subplots(1, n, squeeze=False)[0])


def line_with_band(ax: Any, xs: list[float], per_x: list[list[float]], style: str, color: str, label: str,
                   scale: float = 1.0) -> None:
    """The mean of each x's values as a line, and their 95 % confidence interval over seeds as a band."""
    ivs = [mean_interval(v) for v in per_x]
    ax.plot(xs, [np.nan if iv.mean is None else scale * iv.mean for iv in ivs], style, color=color, label=label)
    if any(iv.half is not None for iv in ivs):
        low = [np.nan if iv.low is None else scale * iv.low for iv in ivs]
        high = [np.nan if iv.high is None else scale * iv.high for iv in ivs]
        ax.fill_between(xs, low, high, color=color, alpha=0.18, lw=0)


def plot_hit_rate_vs_capacity(rows: list[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Token hit rate against capacity (blocks), one line per agent with its 95 % band, a panel per workload."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = _panels(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        for i, agent in enumerate(dict.fromkeys(r["agent"] for r in rows if r["workload"] == w)):
            # Per configured capacity: seed -> rates (one per load), and its size in blocks (a fraction of the
            # distinct blocks is a different size for each seed of a generated trace: x is their mean).
            points: dict[str, dict[int, list[float]]] = {}
            blocks: dict[str, list[int]] = {}
            for r in rows:
                if r["workload"] == w and r["agent"] == agent:
                    key = str(r["capacity"])
                    points.setdefault(key, {}).setdefault(r["seed"], []).append(float(r["token_hit_rate"]))
                    blocks.setdefault(key, []).append(int(r["capacity_blocks"]))
            keys = sorted(points, key=lambda k: np.mean(blocks[k]))
            line_with_band(ax, [float(np.mean(blocks[k])) for k in keys],
                            [[float(np.mean(v)) for v in points[k].values()] for k in keys], "o-", f"C{i % 10}",
                            agent, 100.0)
        ax.set_xlabel("cache capacity (blocks; mean over seeds)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(w)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, Path(path))


def plot_ttft_vs_load(rows: list[Mapping[str, Any]], path: str | Path) -> Path | None:
    """TTFT mean (solid) and p99 (dashed) against load per agent; None unless there are several loads."""
    loads = sorted({r["load"] for r in rows if r["load"] is not None and r["ttft_mean_ms"] is not None})
    if len(loads) < 2:
        return None
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = _panels(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        for i, agent in enumerate(dict.fromkeys(r["agent"] for r in rows if r["workload"] == w)):
            color = f"C{i % 10}"
            for key, style in (("ttft_mean_ms", "o-"), ("ttft_p99_ms", "s--")):
                per_load = [[r[key] for r in rows if r["workload"] == w and r["agent"] == agent and r["load"] == u
                             and r[key] is not None] for u in loads]
                line_with_band(ax, loads, per_load, style, color,
                                f"{agent} {'mean' if key == 'ttft_mean_ms' else 'p99'}")
        ax.set_yscale("log")
        ax.set_xlabel("load (target prefill utilisation)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{w}: TTFT vs load")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, ncol=2)
    return _save(fig, Path(path))


_PAIRED_PANELS = (("token_hit_rate_pp", "token hit rate difference (pp)", 0.0),
                  ("ttft_mean_ratio", "TTFT mean ratio (agent / reference)", 1.0))


def plot_paired(paired: list[Mapping[str, Any]], path: str | Path) -> Path | None:
    """The reference agent paired with each other agent per seed (:func:`sae_env.report.paired_rows`): its token hit
    rate difference and the TTFT ratio, mean with 95 % band, against load (several loads) or capacity; a column per
    workload. None without paired rows."""
    if not paired:
        return None
    workloads = list(dict.fromkeys(p["workload"] for p in paired))
    metrics = [m for m in _PAIRED_PANELS if any(p["metric"] == m[0] for p in paired)]
    fig = Figure(figsize=(5.2 * len(workloads), 3.4 * len(metrics)), layout="constrained")
    axes = fig.subplots(len(metrics), len(workloads), squeeze=False)
    reference = paired[0]["reference"]
    for col, w in enumerate(workloads):
        rows = [p for p in paired if p["workload"] == w]
        loads = sorted({p["load"] for p in rows if p["load"] is not None})
        by_load = len(loads) > 1
        caps = list(dict.fromkeys(str(p["capacity"]) for p in rows))
        for row, (metric, label, level) in enumerate(metrics):
            ax = axes[row][col]
            for i, agent in enumerate(dict.fromkeys(p["agent"] for p in rows)):
                pts = [p for p in rows if p["agent"] == agent and p["metric"] == metric]
                if by_load:  # the first capacity, per load
                    pts = sorted((p for p in pts if str(p["capacity"]) == caps[0]), key=lambda p: p["load"])
                    xs = [p["load"] for p in pts]
                else:
                    xs = [caps.index(str(p["capacity"])) for p in pts]
                color = f"C{i % 10}"
                ax.plot(xs, [p["mean"] for p in pts], "o-", color=color, label=agent)
                if any(p["low"] is not None for p in pts):
                    ax.fill_between(xs, [np.nan if p["low"] is None else p["low"] for p in pts],
                                    [np.nan if p["high"] is None else p["high"] for p in pts], color=color,
                                    alpha=0.18, lw=0)
            ax.axhline(level, color="0.4", lw=0.8, ls=":")
            if by_load:
                ax.set_xlabel(f"load (capacity {caps[0]})")
            else:
                ax.set_xticks(range(len(caps)), caps)
                ax.set_xlabel("capacity")
            ax.set_ylabel(label.replace("reference", reference) if metric == "ttft_mean_ratio"
                          else f"{reference} − agent: {label}", fontsize=8)
            ax.set_title(f"{w}: {reference} paired per seed", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(fig, Path(path))


def _representative(results: list[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Per workload, the cells (one per agent) at the middle capacity, highest load and first seed."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for w in dict.fromkeys(r["cell"]["workload"] for r in results):
        cells = [r for r in results if r["cell"]["workload"] == w]
        caps = list(dict.fromkeys(str(r["cell"]["capacity"]) for r in cells))
        loads = [u for u in dict.fromkeys(r["cell"]["load"] for r in cells)]
        load = max((u for u in loads if u is not None), default=None)
        seed = min(r["cell"]["seed"] for r in cells)
        cap = caps[len(caps) // 2]
        out[w] = [r for r in cells if str(r["cell"]["capacity"]) == cap and r["cell"]["load"] == load
                  and r["cell"]["seed"] == seed]
    return out


def _title(cell: Mapping[str, Any]) -> str:
    load = "" if cell["load"] is None else f", load {cell['load']:g}"
    return f"{cell['workload']} (capacity {cell['capacity']}{load}, seed {cell['seed']})"


def plot_ttft_cdf(results: list[Mapping[str, Any]], path: str | Path) -> Path | None:
    """CDF of per-request TTFT, one curve per agent, a panel per workload; None with instant serving."""
    groups = {w: [r for r in rs if r.get("ttft_quantiles_ms")] for w, rs in _representative(results).items()}
    groups = {w: rs for w, rs in groups.items() if rs}
    if not groups:
        return None
    fig, axes = _panels(len(groups))
    q = np.arange(101) / 100.0
    for ax, rs in zip(axes, groups.values(), strict=True):
        for r in rs:
            ax.plot(np.maximum(r["ttft_quantiles_ms"], 1e-3), q, label=r["cell"]["agent"]["name"])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(_title(rs[0]["cell"]), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return _save(fig, Path(path))


def _shade_phases(ax: Any, result: Mapping[str, Any]) -> None:
    """Alternate grey bands over the windows of each phase, labelled with its name at the top."""
    history, phases = result.get("history", []), result.get("phases") or []
    spans: list[tuple[int, float, float]] = []
    for row in history:
        p = row.get("phase", -1)
        if spans and spans[-1][0] == p:
            spans[-1] = (p, spans[-1][1], row["t_end"])
        else:
            spans.append((p, row["t_start"], row["t_end"]))
    for k, (p, t0, t1) in enumerate(spans):
        if p < 0 or p >= len(phases):
            continue
        if k % 2 == 0:
            ax.axvspan(t0, t1, color="0.5", alpha=0.12, lw=0)
        ax.annotate(phases[p]["name"], ((t0 + t1) / 2, 1.0), xycoords=("data", "axes fraction"), ha="center",
                    va="bottom", fontsize=7, color="0.3")


def plot_hit_rate_over_time(results: list[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Windowed token hit rate over simulated time, one line per agent, a panel per workload, phases shaded."""
    groups = _representative(results)
    fig, axes = _panels(len(groups), width=6.5)
    for ax, (_w, rs) in zip(axes, groups.items(), strict=True):
        for r in rs:
            h = r["history"]
            ax.plot([row["t_end"] for row in h], [100 * row["token_hit_rate"] for row in h], lw=1.2,
                    label=r["cell"]["agent"]["name"])
        if rs:
            _shade_phases(ax, rs[0])
            ax.set_title(_title(rs[0]["cell"]), fontsize=9, pad=12)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("token hit rate per window (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, Path(path))


_PARAM_GROUPS = (("alpha per queue", "alpha_"), ("type weights", "w_"), ("survival (mu / sigma)", ("mu_", "sigma_")),
                 ("position decay gamma", "gamma"))


def plot_param_trajectories(results: list[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """``params_<workload>_<agent>.png`` for every agent whose parameters move over time (representative cells)."""
    paths = []
    for w, rs in _representative(results).items():
        for r in rs:
            h = r["history"]
            names = list((h[0].get("params") or {}) if h else {})
            moving = [n for n in names if len({row["params"].get(n) for row in h}) > 1]
            if not moving:
                continue
            groups = [(title, [n for n in names if n.startswith(prefix)]) for title, prefix in _PARAM_GROUPS]
            grouped = {n for _, ns in groups for n in ns}
            groups.append(("other", [n for n in names if n not in grouped]))
            groups = [(t, ns) for t, ns in groups if ns]
            fig, axes = _panels(len(groups), width=4.6)
            t = [row["t_end"] for row in h]
            for ax, (title, ns) in zip(axes, groups, strict=True):
                for n in ns:
                    ax.plot(t, [row["params"][n] for row in h], lw=1.2, label=n)
                _shade_phases(ax, r)
                ax.set_title(title, fontsize=9, pad=12)
                ax.set_xlabel("simulated time (s)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=6)
            agent = r["cell"]["agent"]["name"]
            fig.suptitle(f"{agent}: parameters over time, {_title(r['cell'])}", fontsize=10, y=1.06)
            paths.append(_save(fig, Path(out_dir) / f"params_{w}_{agent}.png"))
    return paths


# ----------------------------------------------------------------------------------------------------------------
# Gap analysis (the dict returned by sae_env.explain.explain)

_MISS_COLORS = {"hits": "#4c9a5f", "compulsory": "#b0b0b0", "capacity": "#e0a040", "regret": "#c8443c"}


def _explain_title(result: Mapping[str, Any], what: str) -> str:
    share = result["capacity_blocks"] / max(1, result["distinct_blocks"])
    return (f"{what}: {result['policy']} on {result.get('trace') or 'the trace'}, "
            f"{result['capacity_blocks']:,} blocks ({share:.1%})")


def plot_gap_bar(result: Mapping[str, Any], path: str | Path) -> Path:
    """Every policy's token hit rate on one bar, from LRU to Belady, each with its share of the gap."""
    rows = result["policies"]
    by_rate: dict[float, list[Mapping[str, Any]]] = {}
    for r in rows:  # policies with the same rate share one mark
        by_rate.setdefault(round(100 * r["token_hit_rate"], 6), []).append(r)
    rates = sorted(by_rate)
    right = min(100.0, max(rates) * 1.12 + 1)
    fig = Figure(figsize=(9.0, 3.4))
    ax = fig.add_subplot()
    lru = next(100 * r["token_hit_rate"] for r in rows if r["policy"] == "lru")
    ax.barh(0, lru, height=0.5, color="#d9d9d9")
    colors = ["#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"]
    prev = lru
    for i, v in enumerate(x for x in rates if x > lru):
        ax.barh(0, v - prev, left=prev, height=0.5, color=colors[i % len(colors)])
        prev = v
    # Labels in lanes above and below the bar: a label takes the first lane whose last label ends left of it.
    lanes = [(1, 0), (-1, 0), (1, 1), (-1, 1), (1, 2), (-1, 2)]
    lane_end = dict.fromkeys(lanes, -math.inf)
    top = 0.0
    for v in rates:
        names = " = ".join(r["policy"] for r in by_rate[v])
        share = by_rate[v][0]["gap_share"]
        text = f"{names}\n{v:.2f} %" + ("" if share is None else f" ({100 * share:.0f} % of gap)")
        half = 0.5 * 0.0105 * right * max(len(line) for line in text.splitlines())  # ~ half the label's width
        lane = next((ln for ln in lanes if lane_end[ln] < v - half), lanes[-1])
        lane_end[lane] = v + half
        side, tier = lane
        y = side * (0.45 + 0.6 * tier)
        top = max(top, abs(y))
        is_x = any(r["policy"] == result["policy"] for r in by_rate[v])
        ax.plot([v, v], [-0.3, 0.3], color="#c8443c" if is_x else "black", lw=2.5 if is_x else 1.2)
        ax.plot([v, v], [side * 0.3, y], color="#999999", lw=0.6)
        ax.annotate(text, (v, y), ha="center", va="bottom" if side > 0 else "top", fontsize=8,
                    fontweight="bold" if is_x else "normal")
    ax.set_xlim(0, right)
    ax.set_ylim(-top - 0.75, top + 0.75)  # room for two lines of label beyond the outermost lane
    ax.set_yticks([])
    ax.set_xlabel("token hit rate (%)   grey: LRU's hits; blue: the LRU-to-Belady gap, cut at each policy")
    ax.set_title(_explain_title(result, "Hit rate from LRU to Belady"), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, Path(path))


def plot_miss_split(result: Mapping[str, Any], path: str | Path) -> Path:
    """Each policy's prompt blocks: hits, then compulsory, capacity and regret misses (stacked, % of blocks)."""
    rows = result["policies"]
    fig = Figure(figsize=(8.0, 0.55 * len(rows) + 1.6))
    ax = fig.add_subplot()
    y = np.arange(len(rows))[::-1]
    total = max(1, result["prompt_blocks"])
    left = np.zeros(len(rows))
    for part in ("hits", "compulsory", "capacity", "regret"):
        vals = np.array([(r["hit_blocks"] if part == "hits" else r[part]) / total * 100 for r in rows], dtype=float)
        ax.barh(y, vals, left=left, color=_MISS_COLORS[part], label=part, height=0.6)
        for yi, lo, v in zip(y, left, vals, strict=True):
            if v >= 4:
                ax.text(lo + v / 2, yi, f"{v:.1f}", ha="center", va="center", fontsize=7)
        left += vals
    ax.set_yticks(y, [r["policy"] for r in rows])
    for lab in ax.get_yticklabels():
        if lab.get_text() == result["policy"]:
            lab.set_fontweight("bold")
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of prompt blocks")
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title(_explain_title(result, "Hits and misses"), fontsize=10, pad=22)
    return _save(fig, Path(path))


def plot_regret_breakdown(result: Mapping[str, Any], path: str | Path) -> Path:
    """The policy's regret misses by token type, queue, session turn, depth and idle time at eviction; where the
    references are known, the regret per 100 references of the bucket is written on each bar."""
    titles = {"token_type": "token type", "queue": "queue at eviction", "turn": "session turn",
              "depth": "block depth", "idle_at_eviction": "idle at eviction"}
    fig = Figure(figsize=(13.0, 7.0), layout="constrained")
    axes = list(fig.subplots(2, 3).ravel())
    for ax, (dim, title) in zip(axes, titles.items(), strict=False):
        rows = [r for r in result["regret_by"][dim] if r.get("regret")]
        x = np.arange(len(rows))
        ax.bar(x, [r["regret"] for r in rows], color=_MISS_COLORS["regret"])
        for xi, r in zip(x, rows, strict=True):
            if r.get("references"):
                ax.annotate(f"{100 * r['regret'] / r['references']:.1f}", (xi, r["regret"]), ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks(x, [r["bucket"] for r in rows], rotation=40 if len(rows) > 4 else 0, fontsize=7,
                      ha="right" if len(rows) > 4 else "center")
        ax.set_title(f"by {title}", fontsize=9)
        ax.set_ylabel("regret misses (blocks)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        if not rows:
            ax.text(0.5, 0.5, "no regret", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[len(titles):]:
        ax.set_visible(False)
    fig.suptitle(_explain_title(result, "Regret (evicted, then missed while the ghost record held it)") +
                 "; numbers: regret per 100 references", fontsize=9)
    return _save(fig, Path(path))


def plot_belady_keeps(result: Mapping[str, Any], path: str | Path) -> Path:
    """Prompt blocks the policy misses and Belady hits, by token type and by age, beside all the policy's misses."""
    k = result["belady_keeps"]
    fig, axes = _panels(2, width=5.2, height=3.5)
    for ax, (key, title) in zip(axes, (("by_token_type", "token type"), ("by_age", "age (s since the key's "
                                                                                   "previous reference)")),
                                strict=True):
        rows = k[key]
        x = np.arange(len(rows))
        w = 0.4
        ax.bar(x - w / 2, [r["misses_seen_before"] for r in rows], w, color="#bdbdbd",
               label=f"{result['policy']}'s misses (keys seen before)")
        ax.bar(x + w / 2, [r["blocks"] for r in rows], w, color="#2171b5", label="of which Belady hits")
        ax.set_xticks(x, [r["bucket"] for r in rows], rotation=30, fontsize=7, ha="right")
        ax.set_title(f"by {title}", fontsize=9)
        ax.set_ylabel("prompt blocks", fontsize=8)
        ax.set_ylim(0, 1.3 * max([r["misses_seen_before"] for r in rows] + [1]))  # headroom for the legend
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(_explain_title(result, "Blocks Belady keeps that the policy evicts"), fontsize=9)
    return _save(fig, Path(path))
