"""benchmarks/decision_time.py: the README's decision-time ratios, each run a fresh ``train.py replay``."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sae_env.sources import open_trace

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "decision_time.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("args", "says"), [
    (("--runs", "0"), "--runs must be at least 1, got 0"),
    (("--repeat", "0"), "--repeat must be at least 1, got 0"),
    (("--repeat", "1,x"), "--repeat: 'x' is not a whole number"),
    (("--repeat", "4,0"), "--repeat must be at least 1, got 0"),
    (("--traces", "no_such_trace", "--repeat", "2"), "no_such_trace: say which format no_such_trace is in"),
    (("--traces", ","), "--traces: no trace named"),
    (("--warmup", "-1"), "--warmup must be at least 0, got -1"),
    (("--policy", "lpc"), "--policy and --against are both 'lpc'"),
    (("--pause", "-1"), "--pause must be a finite number of seconds >= 0, got -1.0"),
    (("--pause", "nan"), "--pause must be a finite number of seconds >= 0, got nan"),
    (("--save-traces", __file__, "--repeat", "2"), f"--save-traces {__file__}: File exists"),
    (("--pause", "60"), "--pause needs --repeat with a length above 1 (the traces made longer), got --repeat 1"),
    (("--save-traces", "tiled", "--repeat", "1,1"), "--save-traces needs --repeat with a length above 1"),
    (("--traces", "no_such_trace", "--runs", "1"), "no_such_trace: say which format no_such_trace is in"),
    (("--traces", "taubench", "--runs", "1", "--policy-opt", "bogus=1"), "taubench: --policy-opt bogus: none of lpc"),
    (("--json", str(Path(__file__) / "out.json"), "--runs", "1"), "is a file, not a folder"),
    (("--json", str(Path(__file__).parent), "--runs", "1"), "is a folder; give a file name"),
])
def test_a_mistake_exits_2_with_one_line_that_names_it(args, says, capsys):
    # main() in this process (a new interpreter per case cost a second each); the script's own exit status is
    # checked once, as a command, below
    assert _module().main(list(args)) == 2
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert out == ""


def test_the_command_exits_with_mains_status():
    done = run("--runs", "0")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: --runs must be at least 1, got 0"


@pytest.mark.slow
def test_one_run_prints_the_ratio_of_the_two_replays(tmp_path):
    out = tmp_path / "dt.json"
    done = run("--traces", "mooncake_arxiv", "--runs", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    row = re.search(r"^\| mooncake_arxiv \| ([\d.]+)x \(([\d.]+)-([\d.]+)\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                    done.stdout, re.M)
    assert row, done.stdout
    median, lo, hi = (float(row.group(k)) for k in (1, 2, 3))
    assert lo <= median <= hi
    last = done.stdout.strip().splitlines()[-1]
    # the row rounds it to 2 decimals (1e-9: the difference of two decimal strings is not exact in binary)
    assert last.startswith("ratio_max=") and abs(float(last.split("=")[1]) - median) <= 0.005 + 1e-9
    saved = json.loads(out.read_text())
    runs = saved["runs"]["mooncake_arxiv"]
    assert saved["warmup"] == 1  # the default: its run is not among the two
    assert len(runs) == 2 and all(set(r) == {"lpc", "saecache", "lpc prepare", "saecache prepare"} for r in runs)
    # SAECache's arrivals and continuation model run ahead of the compiled loop, a part of its time; LPC has none
    assert all(0 < r["saecache prepare"] < r["saecache"] and 0 <= r["lpc prepare"] < r["lpc"] for r in runs)
    assert 0 < float(row.group(6)) < float(row.group(4))


def _module():
    spec = importlib.util.spec_from_file_location("decision_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_warm_runs_time_the_same_command_in_one_process(tmp_path):
    """--warm: the same train.py replay called --runs times in the benchmark's process after one unreported call; the
    table adds the ratio of the least times, the JSON says warm."""
    out = tmp_path / "warm.json"
    done = run("--warm", "--traces", "bailian", "--runs", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "warm replays in one process, 2 call(s) per trace after one unreported" in done.stdout
    row = re.search(r"^\| bailian \| ([\d.]+)x \(([\d.]+)-([\d.]+)\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x"
                    r" \| ([\d.]+) \|$", done.stdout, re.M)
    assert row, done.stdout
    saved = json.loads(out.read_text())
    runs = saved["runs"]["bailian"]
    assert saved["warm"] is True and len(runs) == 2
    assert all(min(r["lpc"], r["saecache"], r["saecache prepare"]) > 0 for r in runs)
    least = min(r["saecache"] for r in runs) / min(r["lpc"] for r in runs)
    assert abs(float(row.group(6)) - least) <= 0.005 + 1e-9


def test_warm_mistake_exits_2_with_the_commands_line():
    done = run("--warm", "--traces", "taubench", "--runs", "1", "--policy-opt", "bogus=1")
    assert done.returncode == 2 and done.stdout == ""
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: taubench: --policy-opt bogus: none of lpc"), done.stderr


def test_a_list_of_lengths_gives_a_row_per_trace_and_length(tmp_path):
    """--repeat 1,2: the trace as it is and made twice as long, one row each (``trace``, ``trace x2``), in the JSON
    under the same labels. (FIFO over LRU: their kernels are the cheapest to compile in a fresh checkout.)"""
    out = tmp_path / "lengths.json"
    kept = tmp_path / "tiled"
    done = run("--warm", "--traces", "bailian", "--repeat", "1,2", "--runs", "1", "--policy", "fifo",
               "--against", "lru", "--json", str(out), "--save-traces", str(kept), "--pause", "600")
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^\| (bailian(?: x2)?) \| [\d.]+x \(", done.stdout, re.M)
    assert rows == ["bailian", "bailian x2"], done.stdout
    assert "`trace xN`: the trace made N times longer" in done.stdout
    saved = json.loads(out.read_text())
    assert saved["repeat"] == [1, 2] and list(saved["runs"]) == ["bailian", "bailian x2"]
    # --save-traces kept the traces replay timed, --pause put the longer one's copies 600 s further apart
    base, _ = open_trace("bailian")
    tiled, _ = open_trace(str(kept / "bailian_x2.npz"))
    assert sorted(p.name for p in kept.iterdir()) == ["bailian_x1.npz", "bailian_x2.npz"]  # every length replay read
    assert len(tiled) == 2 * len(base)
    np.testing.assert_allclose(tiled.t, _module().repeated(base, 2, pause=600.0).t, rtol=0, atol=0)
