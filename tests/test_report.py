"""Tests of an experiment's report over several seeds: the 95 % intervals in report.md, the paired comparisons
(report.md and paired.csv) checked against scipy, the bands of the plots, and the seed and phase in W&B runs."""

from __future__ import annotations

import csv
import re
from collections import defaultdict

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from scipy import stats

from agents.evaluate import CellRunner
from sae_env.experiment import load_config, run_experiment
from sae_env.plots import line_with_band
from sae_env.tracking import offline_run_files, read_offline_run

RUNNER = CellRunner()
SEEDS = [0, 1, 2]


@pytest.fixture(scope="module")
def run(tmp_path_factory, wandb_dirs_module):
    tmp = tmp_path_factory.mktemp("report")
    config = load_config({
        "name": "ci", "workloads": [{"name": "tiny", "trace": {"source": "synthetic", "preset": "tiny"}}],
        "capacities": [0.05, 0.2], "agents": ["lru", "saecache", "belady"],
        "serving": {"model": "qwen2.5-1.5b@a40", "loads": [0.6, 0.9]}, "window": 50, "seeds": SEEDS,
        "wandb": {"mode": "offline", "project": "test"}, "output": str(tmp / "runs")}, RUNNER)
    return run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def wandb_dirs_module(tmp_path_factory):
    """conftest's wandb_dirs for a module-scoped run: W&B's folders under a tmp folder, none of the user's choices."""
    tmp = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR"):
            mp.delenv(name, raising=False)
        for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            mp.setenv(name, str(tmp / name.lower()))
        yield


def summary(run) -> list[dict]:
    with (run.run_dir / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def section(report: str, capacity: str, load: str) -> str:
    (text,) = [part for part in report.split("\n## ")
               if re.match(rf"tiny, capacity {capacity} \(\d+(-\d+)? blocks( over seeds)?\), load {load}\n", part)]
    return text


def table_cell(text: str, agent: str, column: int) -> str:
    line = next(li for li in text.splitlines() if li.startswith(f"| {agent} |"))
    return line.strip("|").split("|")[column].strip()


def test_report_shows_means_with_their_95_percent_intervals(run):
    rows = summary(run)
    report = (run.run_dir / "report.md").read_text()
    assert "half-width of the 95 % confidence interval" in report
    for capacity in ("0.05", "0.2"):
        for load in ("0.6", "0.9"):
            text = section(report, capacity, load)
            for agent in ("lru", "saecache", "belady"):
                for column, key, scale in ((1, "token_hit_rate", 100.0), (4, "ttft_mean_ms", 1.0)):
                    xs = [scale * float(r[key]) for r in rows if r["capacity"] == capacity and r["load"] == load
                          and r["agent"] == agent]
                    assert len(xs) == 3
                    mean, half = map(float, re.match(r"([-\d.]+) ± ([\d.]+)", table_cell(text, agent, column)).groups())
                    low, high = stats.t.interval(0.95, 2, loc=np.mean(xs), scale=stats.sem(xs))
                    digits = 2 if key == "token_hit_rate" else 1
                    assert mean == pytest.approx(np.mean(xs), abs=0.6 * 10 ** -digits)
                    assert half == pytest.approx((high - low) / 2, abs=0.6 * 10 ** -digits)


def test_paired_differences_match_scipys_paired_t_test(run):
    by = defaultdict(dict)  # exact values (summary.csv rounds to 6 digits)
    for r in run.results.values():
        c = r["cell"]
        by[(str(c["capacity"]), str(c["load"]), c["agent"]["name"])][c["seed"]] = r["summary"]
    with (run.run_dir / "paired.csv").open() as f:
        paired = list(csv.DictReader(f))
    assert {p["reference"] for p in paired} == {"saecache"} and {p["agent"] for p in paired} == {"lru", "belady"}
    assert len(paired) == 2 * 2 * 2 * 4  # capacities x loads x agents x metrics
    for p in paired:
        ref, other = by[(p["capacity"], p["load"], "saecache")], by[(p["capacity"], p["load"], p["agent"])]
        column = {"token_hit_rate_pp": "token_hit_rate", "ttft_mean_ms": "ttft_mean_ms",
                  "ttft_p99_ms": "ttft_p99_ms", "ttft_mean_ratio": "ttft_mean_ms"}[p["metric"]]
        a = np.array([float(ref[s][column]) for s in SEEDS])
        b = np.array([float(other[s][column]) for s in SEEDS])
        if p["metric"] == "ttft_mean_ratio":
            want = np.exp(np.mean(np.log(b / a)))
            ci = np.exp(stats.ttest_rel(np.log(b), np.log(a)).confidence_interval(0.95))
        else:
            scale = 100.0 if column == "token_hit_rate" else 1.0
            want = scale * np.mean(a - b)
            ci = scale * np.array(stats.ttest_rel(a, b).confidence_interval(0.95)) if np.ptp(a - b) else None
        assert float(p["mean"]) == pytest.approx(want, rel=1e-5, abs=1e-5)  # paired.csv: 6 significant digits
        if ci is not None and p["low"]:
            assert (float(p["low"]), float(p["high"])) == pytest.approx(tuple(ci), rel=1e-5, abs=1e-5)
        better = (a > b) if column == "token_hit_rate" else (a < b)
        assert int(p["reference_better"]) == int(better.sum()) and int(p["n"]) == 3
    report = (run.run_dir / "report.md").read_text()
    assert report.count("Paired per seed (3 seeds): saecache minus each agent") == 4
    text = section(report, "0.05", "0.9")
    row = next(p for p in paired if p["capacity"] == "0.05" and p["load"] == "0.9" and p["agent"] == "lru"
               and p["metric"] == "token_hit_rate_pp")
    cell = text.split("Paired per seed")[1]
    assert table_cell(cell, "lru", 1).startswith(f"{float(row['mean']):.2f}")


def test_plots_draw_the_intervals_as_bands(run):
    for name in ("ttft_vs_load.png", "hit_rate_vs_capacity.png", "paired.png"):
        assert (run.run_dir / "plots" / name).stat().st_size > 5000
    assert "over seeds)" in (run.run_dir / "report.md").read_text()  # each seed's trace has its own size
    ax = Figure().add_subplot()
    per_x = [[1.0, 2.0, 3.0], [2.0, 2.5, 4.0], [5.0]]
    line_with_band(ax, [0.5, 0.7, 0.9], per_x, "o-", "C0", "x")
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    ys = band.get_paths()[0].vertices[:, 1]
    for xs in per_x[:2]:
        low, high = stats.t.interval(0.95, len(xs) - 1, loc=np.mean(xs), scale=stats.sem(xs))
        assert np.isclose(ys, low).any() and np.isclose(ys, high).any()
    one = Figure().add_subplot()
    line_with_band(one, [1.0], [[2.0]], "o-", "C0", "single seed")
    assert not one.collections  # one seed: a line, no band


def test_wandb_runs_carry_seed_and_phase(run):
    runs = {d["run"]["name"]: d for d in map(read_offline_run, offline_run_files(run.run_dir))}
    cell = run.cells[0]
    logged = runs[cell.id]
    assert logged["config"]["seed"] == cell.seed and logged["config"]["phases"] == ["tiny"]
    result = run.results[cell.id]
    hit = sum(h["hit_tokens"] for h in result["history"] if h["phase"] == 0)
    prompt = sum(h["prompt_tokens"] for h in result["history"] if h["phase"] == 0)
    assert logged["summary"]["final/phase/tiny/token_hit_rate"] == pytest.approx(hit / prompt)
    assert {c.seed for c in run.cells} == {runs[c.id]["config"]["seed"] for c in run.cells} == set(SEEDS)
    summary_run = runs["ci-summary"]
    assert any(k.startswith("phases") for h in summary_run["history"] for k in h)
