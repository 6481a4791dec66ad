"""Ray Client (the ``client`` extra): the README's ``--ray-address ray://HOST:PORT`` against a real head node.

The test starts a private head with ``ray start --head`` on loopback (:func:`sae_env.ray_local.head_node`: the same
no-traffic settings as the private cluster, stopped through its own process group at the end), runs the README's
command through ``ray://127.0.0.1:PORT`` and compares every cell with a serial run, then checks that a connection to
that cluster gives SIGTERM's handler back as it found it. The slow variant runs all of it under ``strace -f`` and
checks that no connection leaves the machine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("grpc", reason="Ray Client needs the client extra (ray[client])")

from test_experiment import SMALL as EXPERIMENT  # noqa: E402
from test_experiment import assert_stays_on_the_machine, strace, strip_timing  # noqa: E402

from agents import CellRunner  # noqa: E402
from sae_env.experiment import load_config, load_results, run_experiment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = {**EXPERIMENT, "name": "client"}  # 24 small cells: two workloads, two capacities, three agents, two seeds

# The driver: a head node on loopback, then the README's command through Ray Client, then (the head is a user's
# cluster, and starting one is most of this test's time) the SIGTERM handler that a connection to it leaves: ray.init
# replaces SIGTERM's handler with its own sys.exit (and, for a driver with a core worker, a C handler that can abort
# the process); ray_cluster takes it back on a user's cluster as on a local one. The head is stopped at exit.
DRIVER = textwrap.dedent("""
    import signal, subprocess, sys
    from sae_env.ray_local import head_node, ray_cluster

    def mine(signum, frame):
        pass

    def name(h):
        return "mine" if h is mine else h.__qualname__ if callable(h) else signal.Handlers(h).name

    with head_node(num_cpus=2) as address:
        print("address", address, flush=True)
        argv = [sys.executable, "train.py", "--config", sys.argv[1], "--ray-address", address, "--no-progress"]
        code = subprocess.run(argv).returncode
        if code:
            sys.exit(code)
        for before in (signal.SIG_DFL, mine):
            signal.signal(signal.SIGTERM, before)
            with ray_cluster(address=address):
                during = signal.getsignal(signal.SIGTERM)
            print("sigterm", name(before), name(during), name(signal.getsignal(signal.SIGTERM)), flush=True)
""")


def _client_run(tmp_path: Path, prefix: list[str] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    config = {**SMALL, "output": str(tmp_path / "runs")}
    path = tmp_path / "client.yaml"
    path.write_text(json.dumps(config))
    proc = subprocess.run([*prefix, sys.executable, "-c", DRIVER, str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"address ray://127\.0\.0\.1:\d+", proc.stdout)
    (run_dir,) = (tmp_path / "runs" / "client").iterdir()
    serial = run_experiment(load_config({**config, "output": str(tmp_path / "serial")}, CellRunner()), CellRunner(),
                            serial=True, progress=False, log=lambda m: None)
    return proc, {"client": load_results(run_dir), "serial": serial.results}


def _no_head_left(stdout: str) -> None:
    """The head's processes are gone (found by the session folder they were started with)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    port = re.search(r"ray://127\.0\.0\.1:(\d+)", stdout).group(1)
    assert f"--ray-client-server-port={port}" not in ps


def test_ray_client_run_equals_serial_and_gives_sigterm_back(tmp_path):
    proc, results = _client_run(tmp_path)
    assert len(results["client"]) == 24
    assert strip_timing(results["client"]) == strip_timing(results["serial"])
    assert [line for line in proc.stdout.splitlines() if line.startswith("sigterm ")] == [
        "sigterm SIG_DFL _exit_on_sigterm.<locals>.handler SIG_DFL", "sigterm mine mine mine"]
    _no_head_left(proc.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace")
def test_ray_client_sends_nothing_off_the_machine(tmp_path):
    log = tmp_path / "strace.txt"
    proc, results = _client_run(tmp_path, strace(log))
    assert strip_timing(results["client"]) == strip_timing(results["serial"])
    assert_stays_on_the_machine(log)
