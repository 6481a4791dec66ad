"""A policy's decision time over another's, as the README and issue 11 measure it: ``decision_us_per_request`` of
``python train.py replay --trace T --policy lpc,saecache --capacity 0.1`` (the replay's wall clock over its requests,
in the first replay of a fresh process, so loading each policy's compiled kernels is part of it), several runs per
trace, each in a new process.

    python benchmarks/decision_time.py [--traces wildchat,taubench,...] [--runs 5] [--warmup 1] [--capacity 0.1]
        [--policy saecache] [--against lpc] [--policy-opt KEY=VALUE ...] [--opt KEY=VALUE ...] [--repeat N]
        [--pause SECONDS] [--save-traces DIR] [--warm] [--json FILE]

    python benchmarks/decision_time.py --traces mooncake_arxiv,mooncake_synthetic --repeat 1,4,16 --runs 3

Prints one row per trace: the ratio (policy over against, each run's own pair) as median and range over the runs,
each policy's median us per request, and of the timed policy's the median part the compiled engine spent in its
per-window work ahead of the loop (``prepare_us_per_request``: SAECache's arrivals and continuation model; ``-`` on the
Python engine); the last line is ``ratio_max=...``, the largest median. These machines are
noisy: a run's ratio moves by 5-10 % from run to run, hence several runs and the median. One unreported run comes
first (``--warmup``): after an install or an edit of the package, the first process compiles the kernels that the
others load.

``--repeat N`` times each trace made N times longer at the same arrival rate (:func:`sae_env.trace.repeated`: N
copies one after another, each with sessions and blocks of its own): what a policy's decision time does as a trace
grows, where loading the kernels weighs less and the per-request work more. A list (``--repeat 1,4,16``) gives a row
per trace and length, labelled ``trace xN``. ``--save-traces DIR`` keeps those traces (``DIR/TRACE_xN.npz``) for
``train.py replay --trace``; ``--pause SECONDS`` puts the copies that much further apart (see
:func:`sae_env.trace.repeated` for why hit rates on copies back to back need care).

``--warm`` runs the same ``train.py replay`` command in this process instead, ``--runs`` times per trace after one
unreported call: each call's replays find the kernels loaded and the process warm, so a ratio is per-request work
only, each against the reference policy's replay of the same call (the house's way to time on a noisy machine). The
table then also gives the ratio of each policy's least time over the runs, the figure noise disturbs least.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from sae_env.files import check_output_file, write_json
from sae_env.trace import check_pause, repeated

ROOT = Path(__file__).resolve().parent.parent
TRACES = ("wildchat", "taubench", "bailian", "mooncake_arxiv", "mooncake_synthetic")


def row_label(trace: str, n: int) -> str:
    """A table row's (and the JSON's) label: the trace's name, ``trace xN`` when it is made N times longer."""
    return trace if n == 1 else f"{trace} x{n}"


def one_run(trace: str, policy: str, against: str, capacity: str, extra: list[str]) -> dict[str, float]:
    """One ``train.py replay`` in a new process: each policy's ``decision_us_per_request``. Raises RuntimeError
    with train.py's last error line if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "replay.json"
        cmd = [sys.executable, str(ROOT / "train.py"), *_replay_args(trace, policy, against, capacity, out, extra)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            _fail(done.stderr or done.stdout, done.returncode)
        return _figures(out)


def _replay_args(trace: str, policy: str, against: str, capacity: str, out: Path, extra: list[str]) -> list[str]:
    """``train.py replay``'s arguments for one run: ``against``, then ``policy``, their figures to ``out``."""
    return ["replay", "--trace", trace, "--policy", f"{against},{policy}", "--capacity", capacity, "--json", str(out),
            *extra]


def _figures(out: Path) -> dict[str, float]:
    """Each policy's ``decision_us_per_request`` from a run's ``--json``, and under ``POLICY prepare`` the part of it
    spent ahead of the compiled loop (``prepare_us_per_request``; NaN where the Python engine ran it)."""
    figures = {}
    for r in json.loads(out.read_text()):
        figures[r["policy"]] = float(r["decision_us_per_request"])
        prepare = r.get("prepare_us_per_request")
        figures[f"{r['policy']} prepare"] = math.nan if prepare is None else float(prepare)
    return figures


def _fail(said: str, code: int) -> NoReturn:
    """RuntimeError with train.py's last error line."""
    lines = [x for x in said.splitlines() if x.strip()]
    raise RuntimeError(lines[-1] if lines else f"train.py replay exited {code}")


def warm_runs(trace: str, policy: str, against: str, capacity: str, extra: list[str],
              runs: int) -> list[dict[str, float]]:
    """``runs`` + 1 calls of ``train.py replay`` in this process (the first unreported: it loads the kernels), as
    :func:`one_run` returns them. Raises RuntimeError with the command's last error line if one fails."""
    from agents.cli import main as train

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(runs + 1):
            path = Path(tmp) / f"replay{k}.json"
            said = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
                code = train(_replay_args(trace, policy, against, capacity, path, extra))
            if code != 0:
                _fail(said.getvalue(), code)
            if k:
                out.append(_figures(path))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default=",".join(TRACES), help="trace names, as replay's --trace (comma list)")
    p.add_argument("--runs", type=int, default=5, help="runs per trace, each in a new process (default 5)")
    p.add_argument("--warmup", type=int, default=1,
                   help="unreported runs first, of the first trace (default 1): the first run after an install or an "
                        "edit of the package compiles the kernels, and only loading them belongs in the figure")
    p.add_argument("--capacity", default="0.1", help="as replay's --capacity (default 0.1)")
    p.add_argument("--policy", default="saecache", help="the policy timed (default saecache)")
    p.add_argument("--against", default="lpc", help="the policy it is divided by (default lpc)")
    p.add_argument("--policy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to replay (repeatable), e.g. --policy-opt continuation=false")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a source option passed to replay (repeatable)")
    p.add_argument("--repeat", default="1", metavar="N[,N...]",
                   help="time each trace made N times longer at the same arrival rate (N copies in a row, each with "
                        "its own sessions and blocks; default 1: the trace as it is); a comma list: a row per length")
    p.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                   help="with --repeat: this many seconds more between the copies (default 0: back to back, where "
                        "every session running at a copy's end stops at once)")
    p.add_argument("--save-traces", metavar="DIR",
                   help="with --repeat: keep the longer traces in DIR (TRACE_xN.npz, for train.py replay --trace) "
                        "instead of a temporary folder")
    p.add_argument("--warm", action="store_true",
                   help="time warm replays in this process (--runs calls of the command after one unreported) "
                        "instead of each run's first replay in a new process")
    p.add_argument("--json", metavar="FILE", help="also write every run's figures as JSON")
    args = p.parse_args(argv)
    traces = [x.strip() for x in args.traces.split(",") if x.strip()]
    if not traces:
        print("error: --traces: no trace named", file=sys.stderr)
        return 2
    if args.runs < 1:
        print(f"error: --runs must be at least 1, got {args.runs}", file=sys.stderr)
        return 2
    if args.warmup < 0:
        print(f"error: --warmup must be at least 0, got {args.warmup}", file=sys.stderr)
        return 2
    repeats = []
    for x in args.repeat.split(","):
        try:
            n = int(x)
        except ValueError:
            print(f"error: --repeat: {x.strip()!r} is not a whole number", file=sys.stderr)
            return 2
        if n < 1:
            print(f"error: --repeat must be at least 1, got {n}", file=sys.stderr)
            return 2
        if n not in repeats:
            repeats.append(n)
    try:
        check_pause(args.pause)  # before minutes of runs
    except ValueError as e:
        print(f"error: --{e}", file=sys.stderr)
        return 2
    for flag, given in (("--pause", args.pause > 0), ("--save-traces", args.save_traces is not None)):
        if given and max(repeats) == 1:  # nothing to space out or keep: the traces are read as they are
            print(f"error: {flag} needs --repeat with a length above 1 (the traces made longer), got --repeat "
                  f"{args.repeat}", file=sys.stderr)
            return 2
    if args.policy == args.against:
        print(f"error: --policy and --against are both {args.policy!r}", file=sys.stderr)
        return 2
    if args.json:
        try:
            check_output_file(args.json, "--json")  # before minutes of runs
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    extra = [x for kv in args.policy_opt for x in ("--policy-opt", kv)]
    # a temporary folder only for longer traces that are not kept
    temporary = max(repeats) > 1 and not args.save_traces
    with tempfile.TemporaryDirectory() if temporary else contextlib.nullcontext() as tmp:
        folder = tmp or args.save_traces
        return _measure(args, traces, repeats, extra, Path(folder) if folder else None)


def _measure(args: argparse.Namespace, traces: list[str], repeats: list[int], extra: list[str],
             keep: Path | None) -> int:
    """The runs and the table of main(), the longer traces written into ``keep`` (None: no --repeat above 1)."""
    if args.save_traces:
        try:
            keep.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"error: --save-traces {args.save_traces}: {e.strerror or e}", file=sys.stderr)
            return 2
    # a row per trace and length, in that order: label -> what replay's --trace reads
    paths = {row_label(t, n): t for t in traces for n in repeats}
    if max(repeats) > 1:  # the source options went into the written traces
        from sae_env.cli import UsageError, parse_options
        from sae_env.sources import open_trace

        for t in traces:
            try:
                base, _ = open_trace(t, None, parse_options(args.opt), None)
            except (UsageError, ValueError, OSError) as e:
                print(f"error: {t}: {e}", file=sys.stderr)
                return 2
            for n in repeats:
                path = keep / f"{t}_x{n}.npz"
                try:
                    paths[row_label(t, n)] = repeated(base, n, args.pause).save(path)
                except OSError as e:  # a folder it cannot write to (--save-traces), a full disk
                    print(f"error: {path}: {e.strerror or e}", file=sys.stderr)
                    return 2
    else:
        extra += [x for kv in args.opt for x in ("--opt", kv)]
    labels = list(paths)
    from tqdm import tqdm

    results: dict[str, list[dict[str, float]]] = {x: [] for x in labels}
    if args.warm:
        jobs = [(x, results[x]) for x in labels]
        args.warmup = 0  # each trace's first call is its warm-up
    else:
        jobs = [(labels[0], None)] * args.warmup + [(x, results[x]) for x in labels for _ in range(args.runs)]
    with tqdm(total=len(jobs), unit="run", leave=False, file=sys.stderr, disable=None) as bar:
        for trace, kept in jobs:
            bar.set_postfix_str(trace if kept is not None else f"{trace} (warm-up)")
            try:
                if args.warm:
                    kept.extend(warm_runs(str(paths[trace]), args.policy, args.against, args.capacity, extra,
                                          args.runs))
                else:
                    run = one_run(str(paths[trace]), args.policy, args.against, args.capacity, extra)
                    if kept is not None:
                        kept.append(run)
            except RuntimeError as e:
                bar.close()
                why = str(e).removeprefix("error: ")
                print(f"error: {trace}: {why}", file=sys.stderr)
                return 2
            bar.update()
    label = args.policy + "".join(f" {kv}" for kv in args.policy_opt)
    longer = ", `trace xN`: the trace made N times longer (--repeat)" if max(repeats) > 1 else ""
    how = (f"warm replays in one process, {args.runs} call(s) per trace after one unreported" if args.warm else
           f"first replay of a process, {args.runs} run(s) per trace after {args.warmup} unreported")
    print(f"decision_us_per_request of `train.py replay --capacity {args.capacity}`, {how}{longer}: {label} over "
          f"{args.against}")
    least = " | least / least" if args.warm else ""
    print(f"| trace | {args.policy} / {args.against}: median (range) | {args.policy} us/request | "
          f"{args.against} us/request{least} | {args.policy} ahead of the loop, us/request |")
    print("|---|---|---|---|" + ("---|" if args.warm else "") + "---|")
    medians = []
    for trace, runs in results.items():
        ratios = [r[args.policy] / r[args.against] for r in runs]
        m = statistics.median(ratios)
        medians.append(m)
        tail = (f" | {min(r[args.policy] for r in runs) / min(r[args.against] for r in runs):.2f}x" if args.warm
                else "")
        ahead = statistics.median(r[f"{args.policy} prepare"] for r in runs)
        print(f"| {trace} | {m:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{statistics.median(r[args.policy] for r in runs):.2f} | "
              f"{statistics.median(r[args.against] for r in runs):.2f}{tail} | "
              f"{'-' if math.isnan(ahead) else f'{ahead:.2f}'} |")
    if args.json:
        write_json(args.json, {"policy": args.policy, "against": args.against, "capacity": args.capacity,
                               "policy_opt": args.policy_opt, "opt": args.opt, "warmup": args.warmup, "warm": args.warm,
                               "repeat": repeats, "runs": results},
                   indent=1)
    print(f"ratio_max={max(medians):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
