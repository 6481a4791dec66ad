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

__all__ = ["plot_gap_histograms", "plot_hit_by_offset", "plot_reuse_by_app", "plot_reuse_by_token_type"]

_DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
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
