"""W&B conventions (sae_env/tracking.py): W&B's variables, typed tables, training runs namespaced as CleanRL.

Real W&B offline runs, read back from their .wandb files with :func:`read_offline_run` (no server needed). The
autouse ``wandb_dirs`` fixture (conftest.py) clears the user's WANDB_* choices; each test sets the ones it checks.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from agents import CellRunner
from agents.cli import main as cli_main
from sae_env.experiment import load_config, run_experiment
from sae_env.tracking import DEFAULT_PROJECT, offline_run_files, read_offline_run, resolve_target, table_columns

RUNNER = CellRunner()
EXPERIMENT = {
    "name": "tracked",
    "workloads": [{"name": "tiny", "trace": {"source": "synthetic", "preset": "tiny"}}],
    "capacities": [0.2],
    "agents": ["lru", "saecache"],
    "serving": "instant",
    "window": 10,
    "seeds": [0],
}


def _experiment(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({**EXPERIMENT, "output": str(tmp_path / "runs"), **changes}))
    return path


def _all_offline_runs(root: Path) -> list[Path]:
    return sorted(root.rglob("offline-run-*/run-*.wandb"))


# -- resolution: the command line, then the config, then W&B's variables, then the defaults ------------------------

def test_resolve_target_precedence():
    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "theirs", "WANDB_ENTITY": "team", "WANDB_DIR": "/x"}
    assert resolve_target(environ={}, default_dir="d") == resolve_target(
        "offline", DEFAULT_PROJECT, None, "d", environ={})
    got = resolve_target(environ=env, default_dir="d")
    assert (got.mode, got.project, got.entity, str(got.dir)) == ("disabled", "theirs", "team", "/x")
    mine = resolve_target("online", "mine", "me", "/y", environ=env)
    assert (mine.mode, mine.project, mine.entity, str(mine.dir)) == ("online", "mine", "me", "/y")
    assert resolve_target(environ={"WANDB_MODE": "dryrun"}).mode == "offline"  # W&B's older spelling
    with pytest.raises(ValueError, match="WANDB_MODE 'cloud' is not one of offline, online, disabled"):
        resolve_target(environ={"WANDB_MODE": "cloud"})


def test_wandb_mode_disabled_writes_no_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = _experiment(tmp_path)
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress"]) == 0
    (run_dir,) = (tmp_path / "runs" / "tracked").iterdir()
    assert (run_dir / "summary.csv").exists() and len(list((run_dir / "cells").glob("*.json"))) == 2
    assert not (run_dir / "wandb").exists() and _all_offline_runs(tmp_path) == []
    # A config that sets the mode wins over the variable; the command line wins over both.
    path = _experiment(tmp_path, wandb={"mode": "offline"})
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress", "--fresh"]) == 0
    assert len(_all_offline_runs(tmp_path)) == 3  # two cells and the summary run
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress", "--fresh", "--no-wandb"]) == 0
    assert len(_all_offline_runs(tmp_path)) == 3
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    capsys.readouterr()
    assert cli_main(["run", "--config", str(_experiment(tmp_path)), "--serial", "--no-progress", "--fresh"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: W&B: WANDB_MODE 'sometimes' is not one of offline, online, disabled")


def test_wandb_project_entity_and_dir_variables(tmp_path, monkeypatch):
    elsewhere = tmp_path / "scratch"
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_ENTITY", "env-team")
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    config = load_config(json.loads(_experiment(tmp_path).read_text()), RUNNER)
    run = run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    assert offline_run_files(run.run_dir) == []  # not in the run folder: under $WANDB_DIR/wandb
    files = offline_run_files(elsewhere)
    assert len(files) == 3
    for f in files:
        logged = read_offline_run(f)["run"]
        assert (logged["project"], logged["entity"], logged["group"]) == ("env-project", "env-team", "tracked")
    # The config's own values win.
    config = load_config({**json.loads(_experiment(tmp_path).read_text()), "output": str(tmp_path / "runs2"),
                          "wandb": {"project": "cfg-project", "dir": str(tmp_path / "cfg-dir")}}, RUNNER)
    run = run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    files = offline_run_files(tmp_path / "cfg-dir")
    assert len(files) == 3 and {read_offline_run(f)["run"]["project"] for f in files} == {"cfg-project"}


# -- the summary run's table keeps numbers as numbers --------------------------------------------------------------

def test_summary_table_columns_are_typed(tmp_path):
    config = load_config({**json.loads(_experiment(tmp_path).read_text()), "wandb": {"mode": "offline"},
                          "capacities": [0.2, "30%"], "agents": ["lru", "belady"]}, RUNNER)
    run = run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    (summary,) = [f for f in offline_run_files(run.run_dir) if read_offline_run(f)["run"]["job_type"] == "summary"]
    logged = read_offline_run(summary)["history"][0]
    assert logged["cells/_type"] == "table-file" and logged["cells/nrows"] == 4
    table = json.loads((summary.parent / "files" / logged["cells/path"]).read_text())
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    with (run.run_dir / "summary.csv").open(newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == [r["cell"] for r in csv_rows]
    for got, want in zip(rows, csv_rows, strict=True):
        for key in ("token_hit_rate", "block_hit_rate", "gap_to_belady_pp", "evictions", "seed", "requests",
                    "capacity_blocks"):
            assert type(got[key]) in (int, float), (key, got[key])  # W&B can plot it
            assert got[key] == pytest.approx(float(want[key]), rel=1e-5)
        assert got["ttft_mean_ms"] is None and want["ttft_mean_ms"] == ""  # instant serving: no TTFT
        assert isinstance(got["capacity"], str)  # a column mixing 0.2 and '30%' is text, not half-typed
    assert isinstance(rows[0]["evictions"], int)


def test_table_columns():
    rows = [{"a": 1, "b": 0.5, "c": "x", "d": None}, {"a": 2, "b": float("nan"), "c": 3, "d": True}]
    cols = table_columns(rows, ["a", "b", "c", "d"])
    assert cols == {"a": [1, 2], "b": [0.5, None], "c": ["x", "3"], "d": [None, "True"]}


# -- training runs: PPO and the session predictor, CleanRL's namespaces --------------------------------------------

def test_ppo_training_is_logged(tmp_path):
    run_config = {"seed": 3, "env": {"capacity": 0.1, "window": 50, "segment_requests": 150},
                  "ppo": {"num_envs": 2, "num_steps": 8, "total_steps": 32},
                  "eval": {"seed": 1, "env": {"segment_requests": 100}}}
    path = tmp_path / "ppo.yaml"
    path.write_text(json.dumps(run_config))
    out = tmp_path / "ppo-out"
    assert cli_main(["ppo", "--config", str(path), "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    (f,) = offline_run_files(out)
    logged = read_offline_run(f)
    assert logged["run"]["job_type"] == "ppo" and logged["run"]["name"] == "ppo-out"
    assert logged["config"]["ppo"]["total_steps"] == 32
    for pattern in ("charts/*", "losses/*", "perf/*"):
        assert logged["metrics"][pattern] == "global_step"
    assert len(logged["history"]) == len(metrics) == 2
    for got, want in zip(logged["history"], metrics, strict=True):
        assert got["global_step"] == want["global_step"]
        for key in ("charts/mean_reward", "charts/learning_rate", "losses/policy_loss", "losses/value_loss",
                    "losses/approx_kl", "losses/clipfrac"):
            assert got[key] == pytest.approx(want[key])
    ev = json.loads((out / "eval.json").read_text())
    assert logged["summary"]["eval/ppo/token_hit_rate"] == pytest.approx(ev["ppo"]["token_hit_rate"])
    # --no-wandb (or WANDB_MODE=disabled) writes none.
    assert cli_main(["ppo", "--config", str(path), "--out", str(tmp_path / "quiet"), "--no-wandb"]) == 0
    assert not (tmp_path / "quiet" / "wandb").exists()


def test_predictor_training_is_logged(tmp_path):
    out = tmp_path / "pred" / "p.pt"
    assert cli_main(["predictor", "--train", "synthetic", "--opt", "preset=tiny", "--out", str(out),
                     "--epochs", "3"]) == 0
    (f,) = offline_run_files(out.parent)
    logged = read_offline_run(f)
    assert logged["run"]["job_type"] == "predictor" and logged["metrics"]["losses/*"] == "epoch"
    assert [h["epoch"] for h in logged["history"]] == [1, 2, 3]
    assert all("losses/train_loss" in h for h in logged["history"])
    last = logged["history"][-1]
    assert {"losses/val_loss", "charts/val_accuracy", "charts/val_macro_auc"} <= set(last)
    assert logged["summary"]["n_params"] == 960_515 and 0 <= logged["summary"]["val_accuracy"] <= 1
