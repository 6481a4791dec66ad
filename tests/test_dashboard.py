"""Dashboards as code (sae_env/dashboard.py, ``train.py dashboard``): the spec's panels against what the runs log.

A real experiment writes real offline W&B runs; ``train.py dashboard RUN_DIR`` writes the report spec; every panel's
keys are then looked up in the runs its runset selects, read back with :func:`read_offline_run`. The spec is also
built into W&B's report objects (``wandb_workspaces``, offline: saving needs an account and the network).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents import CellRunner
from agents.cli import main as cli_main
from sae_env.dashboard import build_report, dashboard_spec, panel_keys, spec_filters_match
from sae_env.experiment import load_config, run_experiment
from sae_env.tracking import offline_run_files, read_offline_run

RUNNER = CellRunner()
# Two phases with different mixes, a timed server at two loads, an adaptive agent whose parameters move.
TRACE = {"source": "synthetic", "preset": "tiny",
         "phases": [{"name": "templated", "duration": 150.0, "rate": 0.5,
                     "mix": {"templated": 0.8, "chat": 0.1, "agent": 0.1}},
                    {"name": "agentic", "duration": 150.0, "rate": 0.5,
                     "mix": {"templated": 0.1, "chat": 0.2, "agent": 0.7}}]}
CONFIG = {"name": "dash", "workloads": [{"name": "shifting", "trace": TRACE}], "capacities": [0.1],
          "agents": ["lru", "saecache"], "serving": {"model": "qwen2.5-1.5b@a40", "loads": [0.5, 0.9]},
          "window": 20, "seeds": [0, 1], "wandb": {"mode": "offline", "project": "dash-test"}}
SECTIONS = ["Who wins", "Adaptation over simulated time (phases mark the workload's shifts)", "Learned parameters",
            "TTFT against load"]


@pytest.fixture(scope="module")
def logged(tmp_path_factory, _wandb_home):
    out = tmp_path_factory.mktemp("dash")
    with pytest.MonkeyPatch.context() as mp:  # as the autouse wandb_dirs fixture, for this module-wide experiment
        for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR"):
            mp.delenv(name, raising=False)
        for name, path in _wandb_home.items():
            mp.setenv(name, path)
        run = run_experiment(load_config({**CONFIG, "output": str(out)}, RUNNER), RUNNER, serial=True,
                             progress=False, log=lambda m: None)
    assert run.ok
    runs = [read_offline_run(f) for f in offline_run_files(run.run_dir)]
    return run, runs


def test_dashboard_command_writes_the_spec(logged, capsys):
    run, _ = logged
    assert cli_main(["dashboard", str(run.run_dir)]) == 0
    captured = capsys.readouterr()
    spec = json.loads((run.run_dir / "dashboard.json").read_text())
    assert spec["format"] == "saecache-dashboard" and spec["group"] == "dash" and spec["project"] == "dash-test"
    assert [s["name"] for s in spec["sections"]] == SECTIONS
    assert "scatter TTFT p99 (ms) against load: config:load, summary:final/ttft_p99_ms" in captured.out
    assert "the report is built in your W&B project online" in captured.err
    who = spec["sections"][0]["grids"]
    assert [g["title"] for g in who] == ["shifting, capacity 0.1, load 0.5", "shifting, capacity 0.1, load 0.9",
                                         "Every cell"]
    learned = spec["sections"][2]["grids"]
    assert [g["title"] for g in learned] == ["saecache: parameters over simulated time"]  # lru has no parameters
    # the default SAECache learns its gap distributions; its type / queue weights and position decay are off
    assert [p["title"] for p in learned[0]["panels"]] == ["Re-access gaps (log-normal mu, sigma)"]
    assert dashboard_spec(run.run_dir) == spec


def test_every_panel_reads_keys_its_runs_log(logged):
    run, runs = logged
    spec = dashboard_spec(run.run_dir)
    assert len(runs) == len(run.cells) + 1
    checked = 0
    for section in spec["sections"]:
        for grid in section["grids"]:
            selected = [r for r in runs if spec_filters_match(grid["runset"]["filters"], r)]
            assert selected, f"{section['name']} / {grid['title']}: the runset selects no run"
            if grid["runset"]["groupby"] == ["JobType"] and section["name"] != "Learned parameters":
                assert {r["run"]["job_type"] for r in selected} == {"lru", "saecache"}
            for panel in grid["panels"]:
                for where, key in panel_keys(panel):
                    if where == "history":
                        present = [r for r in selected if any(key in row for row in r["history"])]
                        assert present, f"{grid['title']} / {panel['title']}: no selected run logs {key}"
                        if key.startswith("params/"):
                            values = {row[key] for r in present for row in r["history"] if key in row}
                            assert len(values) > 1, f"{key} does not move"
                    elif where == "summary":
                        assert all(key in r["summary"] for r in selected), key
                    elif where == "config":
                        assert all(key in r["config"] for r in selected), key
                    else:
                        assert all(r["history"][0][f"{key}/_type"] == "table-file" for r in selected)
                    checked += 1
    assert checked > 20
    phases = [row["phase"] for r in runs if r["run"]["job_type"] == "saecache" for row in r["history"]]
    assert {0, 1} <= set(phases)  # the phase panel marks both phases


def test_spec_builds_into_a_wandb_report(logged):
    pytest.importorskip("wandb_workspaces")
    import wandb_workspaces.reports.v2 as wr

    run, _ = logged
    spec = dashboard_spec(run.run_dir)
    report = build_report(spec, project="dash-test", entity="someone")
    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == sum(len(s["grids"]) for s in spec["sections"])
    assert report.project == "dash-test" and report.entity == "someone"
    first = grids[0]
    assert first.runsets[0].groupby == ["JobType"] and first.runsets[0].project == "dash-test"
    assert [type(p).__name__ for p in first.panels] == ["BarPlot", "BarPlot"]
    assert first.panels[0].metrics[0].name == "final/token_hit_rate"
    lines = [p for g in grids for p in g.panels if isinstance(p, wr.LinePlot)]
    assert {p.x for p in lines} == {"sim_time_s"} and any("params/mu_chat" in p.y for p in lines)
    scatter = [p for g in grids for p in g.panels if isinstance(p, wr.ScatterPlot)]
    assert len(scatter) == 1 and scatter[0].x.name == "load"


def test_dashboard_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert cli_main(["dashboard", str(tmp_path)]) == 2
    assert "not an experiment run folder (no config.json)" in capsys.readouterr().err
    Path(tmp_path, "config.json").write_text(json.dumps({"name": "x"}))
    assert cli_main(["dashboard", str(tmp_path)]) == 2
    assert "no finished cell yet" in capsys.readouterr().err
