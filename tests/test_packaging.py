"""The package as users install and start it: console script and ``python -m sae_env`` name themselves, shipped
configs are package data found from any folder, relative paths in configs resolve against the config file, and
``--set`` takes dotted keys the same way for ``run``, ``ppo`` and ``tune``; ``--serial`` is the one spelling.

The slow test installs the project non-editable into a fresh venv and runs it from /tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agents.cli import main as cli_main
from sae_env.cli import SHIPPED_CONFIGS, config_path
from sae_env.files import apply_overrides, relative_to, resolve_paths
from sae_env.sources import trace_from_spec

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"name": "pkg", "workloads": [{"name": "tiny", "trace": {"source": "synthetic", "preset": "tiny"}}],
         "capacities": [0.2], "agents": ["lru"], "serving": "qwen2.5-1.5b@a40", "window": 10, "seeds": [0],
         "wandb": {"mode": "disabled"}}
TINY_ENV = {"trace": {"source": "synthetic", "preset": "tiny"}, "capacity": 0.05, "window": 20}


# -- names: the console script, python -m sae_env, train.py -------------------------------------------------------

def test_each_entry_point_names_itself_in_its_usage(tmp_path):
    script = Path(sys.executable).parent / "saecache-gym"
    runs = {"saecache-gym": [str(script), "--help"], "python -m sae_env": [sys.executable, "-m", "sae_env", "--help"],
            "train.py": [sys.executable, str(ROOT / "train.py"), "--help"]}
    for name, argv in runs.items():
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: {name} "), (name, proc.stdout[:80])
        for sub in ("run", "replay", "ppo", "predictor", "tune"):  # the agents' commands too (entry points)
            assert sub in proc.stdout


# -- shipped configs -------------------------------------------------------------------------------------------------

def test_shipped_configs_are_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    names = sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))
    assert {"quickstart", "ppo", "load_sweep"} <= set(names)
    for spelling in ("load_sweep", "load_sweep.yaml", "configs/load_sweep.yaml"):
        assert config_path(spelling) == SHIPPED_CONFIGS / "load_sweep.yaml"
    assert config_path(None) == SHIPPED_CONFIGS / "quickstart.yaml"
    for spelling in ("tune/real_mismatch", "configs/tune/real_mismatch.yaml"):  # a shipped subfolder too
        assert config_path(spelling) == SHIPPED_CONFIGS / "tune" / "real_mismatch.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "load_sweep.yaml").write_text("name: mine\n")
    assert config_path("configs/load_sweep.yaml") == Path("configs/load_sweep.yaml")  # a real file wins
    assert cli_main(["run", "--config", "nosuch", "--serial"]) == 2


def test_pyproject_ships_the_configs():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"sae_env" = ["configs/*.yaml", "configs/*/*.yaml"]' in text
    assert 'agents = "agents.cli:AgentsExtension"' in text
    assert (ROOT / "sae_env" / "configs").resolve() == (ROOT / "configs").resolve()


# -- relative paths in configs -------------------------------------------------------------------------------------

def test_relative_paths_resolve_against_the_config_file(tmp_path, monkeypatch, capsys):
    study = tmp_path / "study"
    (study / "data").mkdir(parents=True)
    trace, _ = trace_from_spec({"source": "synthetic", "preset": "tiny", "seed": 4})
    trace.save(study / "data" / "tiny.npz")
    (study / "params.json").write_text(json.dumps({"gamma": 2.0}))
    config = {**SMALL, "serving": "instant", "output": str(tmp_path / "runs"),
              "workloads": [{"name": "file", "trace": "data/tiny.npz"},
                            {"name": "spec", "trace": {"source": "trace", "path": "data/tiny.npz"}},
                            {"name": "named", "trace": "bailian"}],  # an embedded name stays a name
              "agents": ["lru", {"name": "tuned", "policy": "saecache", "agent": "fixed",
                                 "options": {"params": "params.json"}}]}
    (study / "exp.yaml").write_text(json.dumps(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli_main(["run", "--config", str(study / "exp.yaml"), "--serial", "--no-progress"]) == 0
    capsys.readouterr()
    (run_dir,) = (tmp_path / "runs" / "pkg").iterdir()
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["workloads"][0]["trace"] == str(study / "data" / "tiny.npz")
    assert resolved["workloads"][1]["trace"]["path"] == str(study / "data" / "tiny.npz")
    assert resolved["workloads"][2]["trace"] == "bailian"
    assert resolved["agents"][1]["options"]["params"] == str(study / "params.json")
    cell = json.loads((run_dir / "cells" / "file__cap0.2__tuned__s0.json").read_text())
    assert cell["summary"]["final_params"]["gamma"] == 2.0
    # A path that exists only relative to the working folder keeps working as before.
    assert relative_to(study, "here.json") == "here.json"
    assert relative_to(study, str(study / "params.json")) == str(study / "params.json")
    assert resolve_paths({"env": {"trace": {"path": "data/tiny.npz"}}, "name": "data"}, study) == {
        "env": {"trace": {"path": str(study / "data" / "tiny.npz")}}, "name": "data"}


# -- --set: dotted keys, the same for run, ppo and tune ------------------------------------------------------------

def test_apply_overrides():
    data = {"serving": {"model": "a", "loads": [0.5]}, "agents": ["lru", {"name": "x"}], "window": 10}
    out = apply_overrides(data, {"serving.model": "instant", "agents.1.name": "y", "ppo.total_steps": 8,
                                 "window": 20})
    assert out == {"serving": {"model": "instant", "loads": [0.5]}, "agents": ["lru", {"name": "y"}],
                   "window": 20, "ppo": {"total_steps": 8}}
    assert data["serving"]["model"] == "a"  # a copy
    with pytest.raises(ValueError, match=r"--set window.x: window is 10, not a mapping"):
        apply_overrides(data, {"window.x": 1})
    with pytest.raises(ValueError, match=r"agents is a list of 2; '7' is not an index"):
        apply_overrides(data, {"agents.7.name": 1})


def test_run_set_takes_dotted_keys(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({**SMALL, "output": str(tmp_path / "runs")}))
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress", "--set", "serving.model=instant",
                     "--set", "serving.loads=[null]", "--set", "seeds=[2]"]) == 0
    capsys.readouterr()
    (run_dir,) = (tmp_path / "runs" / "pkg").iterdir()
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["serving"] == {"model": "instant", "loads": [None]} and resolved["seeds"] == [2]
    assert cli_main(["run", "--config", str(path), "--serial", "--set", "serving.nope=1"]) == 2
    assert "serving: unknown key(s) ['nope']" in capsys.readouterr().err
    assert cli_main(["run", "--config", str(path), "--serial", "--set", "window.x=1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --set window.x: window is 10, not a mapping; set window itself " \
                                              "(e.g. --set window={...})"
    assert cli_main(["run", "--config", str(path), "--set", "seeds"]) == 2
    assert "--set expects KEY=VALUE" in capsys.readouterr().err


def test_ppo_set_takes_dotted_keys(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(json.dumps({"seed": 0, "env": {"capacity": 0.1, "window": 50, "segment_requests": 150},
                                "ppo": {"num_envs": 2, "num_steps": 8, "total_steps": 64}}))
    out = tmp_path / "out"
    assert cli_main(["ppo", "--config", str(path), "--out", str(out), "--no-wandb", "--set", "ppo.total_steps=16",
                     "--set", "env.capacity=0.2", "--set", "seed=5"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["ppo"]["total_steps"] == 16 and config["run"]["seed"] == 5
    assert config["run"]["env"]["capacity"] == 0.2
    assert len(json.loads((out / "metrics.json").read_text())) == 1


def test_tune_set_and_serial(tmp_path, capsys):
    out = tmp_path / "best.json"
    assert cli_main(["tune", "--env", json.dumps(TINY_ENV), "--serial", "--out", str(out), "--set", "trials=2",
                     "--set", "env.capacity=0.1"]) == 0
    trials = json.loads((tmp_path / "best.trials.json").read_text())
    assert trials["n_trials"] == 2 and trials["env"]["capacity"] == 0.1
    assert "(serial)" in capsys.readouterr().out
    # The former spelling still works, and says it is deprecated.
    assert cli_main(["tune", "--env", json.dumps(TINY_ENV), "--no-ray", "--trials", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "(serial)" in captured.out and "--no-ray is deprecated; use --serial" in captured.err
    assert cli_main(["tune", "--env", json.dumps(TINY_ENV), "--serial", "--trials", "1", "--out", str(out),
                     "--set", "bogus=1"]) == 2
    assert "--set: unknown key(s) ['bogus']" in capsys.readouterr().err


# -- a non-editable install in a fresh venv, run from /tmp ---------------------------------------------------------

@pytest.mark.slow
def test_installed_package_runs_from_any_folder(tmp_path, request):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "torch==2.13.0", str(ROOT)]
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = Path(tempfile.mkdtemp(prefix="saecache-gym-", dir="/tmp"))  # outside the checkout and tmp_path
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    script = str(venv / "bin" / "saecache-gym")
    help_ = subprocess.run([script, "--help"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: saecache-gym "), help_.stderr[-2000:]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import sae_env; print(sae_env.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert str(venv) in where.stdout  # the installed copy, not the checkout
    small = subprocess.run([script, "--config", "load_sweep", "--serial", "--no-wandb", "--no-progress",
                            "--set", "workloads.0.trace.preset=tiny", "--set", "serving.loads=[0.5]",
                            "--set", "agents=[lru]", "--output", str(work / "runs")],
                           cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert small.returncode == 0, small.stderr[-3000:]
    assert "| lru |" in small.stdout and list((work / "runs" / "load_sweep").glob("*/summary.csv"))
    module = subprocess.run([str(venv / "bin" / "python"), "-m", "sae_env", "replay", "--trace", "bailian",
                             "--policy", "lru,belady"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert module.returncode == 0 and "belady" in module.stdout, module.stderr[-2000:]
