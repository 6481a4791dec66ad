"""Resuming an experiment after a kill or a damaged file, and two runs of one folder (issue 15).

Real processes killed with SIGKILL, real W&B offline runs counted by reading their .wandb files back
(:func:`sae_env.tracking.run_file_status` / :func:`read_offline_run`), real cell files damaged on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agents import CellRunner
from agents.cli import main as cli_main
from sae_env.experiment import ConfigError, RunFolderBusy, load_config, load_results, run_experiment, run_lock
from sae_env.tracking import read_offline_run, run_file_status, run_folders

ROOT = Path(__file__).resolve().parent.parent
RUNNER = CellRunner()

# 12 cells of a few milliseconds each: W&B (~0.7 s a run) is what takes time, so a kill lands with most cells
# written and most of their W&B runs not.
CONFIG = {
    "name": "resume",
    "workloads": [{"name": "tiny", "trace": {"source": "synthetic", "preset": "tiny"}}],
    "capacities": [0.1, 0.3],
    "agents": ["lru", "saecache", "belady"],
    "serving": "instant",
    "window": 10,
    "seeds": [0, 1],
}
N_CELLS = 12


def _config_file(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({**CONFIG, "output": str(tmp_path / "runs"), **changes}))
    return path


def _wandb_census(run_dir: Path) -> tuple[Counter, int, int]:
    """(complete cell runs by name, complete summary runs, incomplete runs) in the run folder's W&B folder."""
    cells, summaries, incomplete = Counter(), 0, 0
    for folder in run_folders(run_dir):
        info = run_file_status(folder)
        if not info["complete"]:
            incomplete += 1
        elif info["job_type"] == "summary":
            summaries += 1
        else:
            cells[info["name"]] += 1
    return cells, summaries, incomplete


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_kill_and_resume_leaves_exactly_one_complete_wandb_run_per_cell(tmp_path, wandb_dirs):
    """SIGKILL a run once a few cells are written, again while the resumed run re-logs W&B runs, then resume: the
    W&B folder holds one complete run per cell and one summary run, as an uninterrupted run does (issue 15: after
    kills and a resume it held none of the resumed cells' runs)."""
    path = _config_file(tmp_path, wandb={"mode": "offline"})
    cmd = [sys.executable, str(ROOT / "train.py"), "run", "--config", str(path), "--serial", "--no-progress"]
    # A killed process leaves its temporary folders (W&B's media and artifact folders) behind: in this test's folder.
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, **wandb_dirs, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "tmp")}
    runs = tmp_path / "runs" / "resume"

    def cells_written() -> int:
        return sum(len(list(d.glob("*.json"))) for d in runs.glob("*/cells"))

    _kill_when(_start(cmd, env), lambda: cells_written() >= 4)
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir()]
    first = cells_written()
    assert 4 <= first < N_CELLS, f"the kill came too late to test resuming ({first} cells written)"
    logged, _, _ = _wandb_census(run_dir)
    assert sum(logged.values()) < first, "every written cell already had its W&B run: nothing to re-log"

    # Second kill: while the resumed run is logging cells again (or computing the rest).
    _kill_when(_start(cmd, env), lambda: sum(_wandb_census(run_dir)[0].values()) >= sum(logged.values()) + 2)

    final = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"{N_CELLS}/{N_CELLS} cells" in final.stderr
    cells, summaries, incomplete = _wandb_census(run_dir)
    assert set(cells) == {p.stem for p in (run_dir / "cells").glob("*.json")} and len(cells) == N_CELLS
    assert set(cells.values()) == {1} and summaries == 1 and incomplete == 0
    # The re-logged runs hold the cells' metrics, as a first logging does.
    results = load_results(run_dir)
    for folder in run_folders(run_dir):
        data = read_offline_run(next(folder.glob("run-*.wandb")))
        if data["run"]["job_type"] != "summary":
            result = results[data["run"]["name"]]
            assert len(data["history"]) == len(result["history"])
            assert data["summary"]["final/token_hit_rate"] == pytest.approx(result["summary"]["token_hit_rate"])
    # A new run folder of the same experiment reuses every cell, and logs each of them there once.
    again = subprocess.run([*cmd, "--run-id", "copy"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and f"{N_CELLS} reused" in again.stderr, again.stderr[-2000:]
    cells, summaries, incomplete = _wandb_census(runs / "copy")
    assert len(cells) == N_CELLS and set(cells.values()) == {1} and summaries == 1 and incomplete == 0


@pytest.mark.parametrize("content", [os.urandom(64), b"{}", b"[]", b'{"cell": {"id": "other"}, "summary": {}}',
                                     b'{"cell": {"id": "%s"}}', b'{"cell": '],
                         ids=["random-bytes", "empty-object", "list", "wrong-id", "no-summary", "truncated"])
def test_a_damaged_cell_file_is_named_set_aside_and_recomputed(tmp_path, content):
    """Issue 15: random bytes gave "'utf-8' codec can't decode" without a file name, ``{}`` a KeyError traceback,
    ``[]`` a TypeError."""
    config = load_config({**CONFIG, "output": str(tmp_path / "runs"), "wandb": {"mode": "disabled"}}, RUNNER)
    first = run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    victim = sorted((first.run_dir / "cells").glob("*.json"))[3]
    victim.write_bytes(content.replace(b"%s", victim.stem.encode()))
    messages: list[str] = []
    again = run_experiment(config, RUNNER, serial=True, progress=False, log=messages.append)
    assert again.ok and again.resumed == N_CELLS - 1
    assert any(str(victim) in m and "damaged cell file" in m for m in messages), messages
    aside = first.run_dir / "aside" / "cells" / victim.name
    assert aside.read_bytes() == content.replace(b"%s", victim.stem.encode())
    recomputed = {k: v for k, v in json.loads(victim.read_text()).items() if k != "timing"}
    assert recomputed == {k: v for k, v in first.results[victim.stem].items() if k != "timing"}
    assert again.results.keys() == first.results.keys()


def test_a_damaged_file_in_a_sibling_run_does_not_break_the_reuse_scan(tmp_path, capsys):
    path = _config_file(tmp_path, wandb={"mode": "disabled"})
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress", "--run-id", "first"]) == 0
    sibling = tmp_path / "runs" / "resume" / "first"
    (sibling / "cells" / "garbage.json").write_bytes(b"\xff\xfe not json")
    victim = sorted((sibling / "cells").glob("tiny*.json"))[0]
    victim.write_text("{}")
    capsys.readouterr()
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress", "--run-id", "second"]) == 0
    err = capsys.readouterr().err
    assert str(sibling / "cells" / "garbage.json") in err and str(victim) in err
    assert f"{N_CELLS - 1} reused" in err  # the damaged one is computed again
    assert sorted(p.name for p in (sibling / "aside" / "cells").iterdir()) == sorted(["garbage.json", victim.name])
    assert len(list((tmp_path / "runs" / "resume" / "second" / "cells").glob("*.json"))) == N_CELLS


def test_a_second_run_of_the_same_folder_exits_with_a_clear_message(tmp_path, capsys):
    """Issue 15: two identical runs into one folder both computed every cell (194 W&B runs for 96 cells)."""
    path = _config_file(tmp_path, wandb={"mode": "disabled"})
    config = load_config(path, RUNNER)
    run_dir = tmp_path / "runs" / "resume" / config.results_key()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from sae_env.experiment import run_lock\n"
                               f"with run_lock(Path({str(run_dir)!r})):\n    print('held', flush=True); "
                               "time.sleep(60)"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli_main(["run", "--config", str(path), "--serial", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"{run_dir} is in use by another run of this experiment (process {holder.pid})" in err
        assert not (run_dir / "cells").exists()
        with pytest.raises(RunFolderBusy):
            run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    finally:
        holder.kill()
        holder.wait()
    # The lock goes with its process: the folder is free at once.
    assert run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None).ok
    with run_lock(run_dir), pytest.raises(RunFolderBusy):  # and, within one process, a second holder is refused
        run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)


@pytest.mark.parametrize("run_id", ["../../escape", "/tmp/elsewhere", "a/b", "..", ".hidden"])
def test_run_id_is_a_plain_name(tmp_path, capsys, run_id):
    """Issue 15: ``--run-id ../../x`` or an absolute path wrote outside --output."""
    path = _config_file(tmp_path, wandb={"mode": "disabled"})
    assert cli_main(["run", "--config", str(path), "--serial", "--no-progress", "--run-id", run_id]) == 2
    assert "--run-id" in capsys.readouterr().err
    assert not (tmp_path / "escape").exists() and not Path("/tmp/elsewhere").exists()
    with pytest.raises(ConfigError, match="is not a valid name"):
        run_experiment(load_config(path, RUNNER), RUNNER, run_id=run_id, serial=True, progress=False)


def test_under_a_shared_wandb_dir_resume_touches_only_its_own_runs(tmp_path, monkeypatch):
    """With WANDB_DIR shared by several experiments, a run cut short while W&B started it holds no record of whose
    it is: the run folder lists the ids of the runs it starts (wandb-runs.txt) before W&B writes anything."""
    shared = tmp_path / "shared"
    monkeypatch.setenv("WANDB_DIR", str(shared))
    config = load_config({**CONFIG, "output": str(tmp_path / "runs"), "capacities": [0.1], "seeds": [0],
                          "agents": ["lru"], "wandb": {"mode": "offline"}}, RUNNER)
    first = run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    planted = {}
    for who, run_id in (("mine", "aaaa0000"), ("theirs", "bbbb0000")):
        folder = shared / "wandb" / f"offline-run-20990101_000000-{run_id}"
        folder.mkdir()
        (folder / f"run-{run_id}.wandb").write_bytes(b":W&B\x00\x00\x00")  # a header, nothing after: cut short
        planted[who] = folder
    with open(first.run_dir / "wandb-runs.txt", "a") as f:
        f.write("aaaa0000\n")
    run_experiment(config, RUNNER, serial=True, progress=False, log=lambda m: None)
    assert not planted["mine"].exists() and (first.run_dir / "aside" / "wandb" / planted["mine"].name).exists()
    assert planted["theirs"].exists()
    cells, summaries, incomplete = _wandb_census(shared)
    assert dict(cells) == {"tiny__cap0.1__lru__s0": 1} and summaries == 1 and incomplete == 1  # theirs
