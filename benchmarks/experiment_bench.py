"""Ray speed-up of the experiment runner: the same 8 equal cells serially and as Ray tasks, in one process.

    python benchmarks/experiment_bench.py [--cells 8] [--num-cpus 2] [--preset heterogeneous] [--agent saecache-fixed]

The cells are one agent on one generated trace (generator seed fixed, so every cell does the same work) under
``--cells`` cell seeds. Serial: ``run_experiment(serial=True)``; Ray: the same config on a private local cluster of
``--num-cpus`` CPUs, started before the clock, and its workers warmed (one task per CPU that imports what a cell
imports) before the clock too, as the serial side imported everything before its clock: both one-off costs are
printed on their own lines (paid once per experiment, not per cell). W&B off and no report, so that both sides time
the cells and the runner only. The results of both runs are checked equal. Last line:
``ray_speedup=<serial seconds / Ray seconds>``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents import CellRunner  # noqa: E402
from sae_env.experiment import load_config, run_experiment  # noqa: E402
from sae_env.ray_local import ray_cluster  # noqa: E402


def _warm(hold: float) -> None:
    """Import what a cell imports; hold the CPU a moment so that each warm-up lands on its own worker."""
    import agents.evaluate  # noqa: F401
    import sae_env.env  # noqa: F401

    time.sleep(hold)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=int, default=8)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--preset", default="heterogeneous", help="synthetic preset of the trace")
    p.add_argument("--agent", default="saecache-fixed")
    p.add_argument("--capacity", type=float, default=0.1)
    args = p.parse_args()
    runner = CellRunner()
    out = tempfile.mkdtemp(prefix="expbench")
    config = load_config({
        "name": "bench", "workloads": [{"name": args.preset,
                                        "trace": {"source": "synthetic", "preset": args.preset, "seed": 0}}],
        "capacities": [args.capacity], "agents": [args.agent], "seeds": list(range(args.cells)), "window": 200,
        "serving": "instant", "wandb": {"mode": "disabled"}, "output": out}, runner)
    # Each side computes every cell: no reuse of the other side's cells (they share the experiment's folder).
    quiet = dict(progress=False, report=False, reuse=False, log=lambda m: None)

    t0 = time.perf_counter()
    serial = run_experiment(config, runner, serial=True, run_id="serial", **quiet)
    t_serial = time.perf_counter() - t0
    print(f"serial: {args.cells} cells in {t_serial:.2f} s ({t_serial / args.cells:.2f} s per cell)")

    global _warm
    t0 = time.perf_counter()
    with ray_cluster(num_cpus=args.num_cpus) as ray:
        _warm = ray.remote(_warm)
        print(f"ray start: {time.perf_counter() - t0:.2f} s (once per experiment; not in the ratio)")
        t0 = time.perf_counter()
        ray.get([_warm.options(num_cpus=1).remote(0.5) for _ in range(args.num_cpus)])
        print(f"ray workers warm: {time.perf_counter() - t0:.2f} s (imports, once per worker; not in the ratio)")
        t1 = time.perf_counter()
        on_ray = run_experiment(config, runner, serial=False, run_id="ray", **quiet)
        t_ray = time.perf_counter() - t1
    print(f"ray ({args.num_cpus} CPUs): {args.cells} cells in {t_ray:.2f} s")

    def strip(results: dict) -> dict:
        return {k: {kk: vv for kk, vv in v.items() if kk != "timing"} for k, v in results.items()}

    if strip(serial.results) != strip(on_ray.results):
        print("ERROR: Ray and serial results differ", file=sys.stderr)
        return 1
    print("results identical serial vs Ray: yes")
    print(f"ray_speedup={t_serial / t_ray:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
