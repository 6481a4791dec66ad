"""The command line (``python train.py ...``, ``saecache-gym ...`` or ``python -m sae_env ...``): parse, then call
the library.

Subcommands:
  run            run an experiment config (``python train.py`` alone runs configs/quickstart.yaml)
  characterize   the workload study of a trace (reuse by type / app / offset, gap fits)
  replay         replay a trace through one or more policies and print them side by side
  dashboard      the W&B report of a run folder, as code (spec as JSON; saved to W&B online)
  explain        where one policy loses to Belady: its misses split and explained, beside the partial oracles

Bad input (unknown source or policy, malformed trace, impossible capacity) prints one clear line on stderr and
exits with status 2; nothing is half-written (outputs are written atomically).

Why one piece (~590 lines): each subcommand's handler sits beside the parser that wires it, and every handler is a
few lines over the library (parse, call, print); split apart, the parser and its handlers would import each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from sae_env.files import check_output_file, write_json
from sae_env.trace import MAX_TOKENS, Trace, TraceFormatError

__all__ = ["CliExtension", "UsageError", "build_parser", "config_path", "load_extensions", "load_input", "main",
           "parse_options", "parse_overrides", "write_json"]

DEFAULT_TRACE = "taubench"  # an embedded real trace (see sae_env/data/README.md)
# The shipped configs, package data (sae_env/configs links to the repository's configs/ folder), so that an installed
# package finds them from any folder.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
# The default experiment: embedded real traces, the main agents, about a minute on 2 cores.
DEFAULT_CONFIG = SHIPPED_CONFIGS / "quickstart.yaml"
EXTENSION_GROUP = "saecache_gym.cli"  # entry points of CliExtension factories (the agents package declares one)


class UsageError(ValueError):
    """A bad command line or input file: reported in one line, exit status 2."""


class CliExtension(Protocol):
    """How the ``agents`` package plugs into this command line without ``sae_env`` importing it.

    ``train.py`` passes extensions to :func:`main`: they add subcommands (``predictor``, ``ppo``, ...), add options
    to ``replay``, hand policies their learned components (``policy_options``) and attach learners to a replay
    (``replay_callbacks``; e.g. SAECache's online feedback loop).
    """

    def add_commands(self, sub: Any) -> None: ...

    def add_replay_options(self, parser: argparse.ArgumentParser) -> None: ...

    def policy_options(self, args: argparse.Namespace, policy: str) -> dict[str, Any]: ...

    def replay_callbacks(self, args: argparse.Namespace, policy: Any) -> list: ...

    def cell_runner(self) -> Any:
        """What runs an experiment's cells (:class:`sae_env.experiment.CellRunner`), or None."""


# -- helpers -------------------------------------------------------------------------------------------------------

def parse_options(pairs: list[str] | None, flag: str = "--opt") -> dict[str, Any]:
    """``["rate=2", "seed=3"]`` -> ``{"rate": 2, "seed": 3}`` (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair or not pair.split("=", 1)[0].strip():
            raise UsageError(f"{flag} expects KEY=VALUE, got '{pair}'")
        k, v = pair.split("=", 1)
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise UsageError(f"{flag} {pair}: the value is not YAML ({str(e).splitlines()[0]})") from None
    return out


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs (KEY dotted for nested keys, VALUE YAML): the same for run, ppo and tune."""
    return parse_options(pairs, "--set")


def add_set_option(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (YAML value; dotted "
                   f"keys for nested ones, list items by position), e.g. {example}")


def config_path(value: str | None, default: Path = DEFAULT_CONFIG) -> Path:
    """The config file a command names: a path as given, else a shipped config by name (``load_sweep``,
    ``load_sweep.yaml``, ``configs/load_sweep.yaml``, ``tune/real_mismatch``), so that an installed package runs
    them from any folder."""
    if value is None:
        return default
    path = Path(value)
    if path.exists():
        return path
    if not path.is_absolute() and path.parts:
        parts = path.parts[1:] if path.parts[0] == "configs" else path.parts
        shipped = SHIPPED_CONFIGS.joinpath(*parts) if parts else SHIPPED_CONFIGS
        shipped = shipped if shipped.suffix else shipped.with_suffix(".yaml")
        if shipped.is_file():
            return shipped
    names = ", ".join(sorted(p.relative_to(SHIPPED_CONFIGS).with_suffix("").as_posix()
                             for p in SHIPPED_CONFIGS.rglob("*.yaml")))
    raise UsageError(f"config file {value} does not exist (shipped configs, by name: {names})")


def load_extensions() -> list[CliExtension]:
    """The installed :class:`CliExtension` objects (entry points of group :data:`EXTENSION_GROUP`): how
    ``python -m sae_env`` finds the agents' commands without importing the agents package by name."""
    from importlib.metadata import entry_points

    return [ep.load()() for ep in sorted(entry_points(group=EXTENSION_GROUP), key=lambda ep: ep.name)]


def load_input(trace: str, source: str | None, options: dict[str, Any],
               block_size: int | None = None) -> tuple[Trace, Any]:
    """Load a trace from a path or an embedded name (``taubench``, ``wildchat``, ``mooncake_arxiv``, ...).

    ``block_size`` re-cuts text and synthetic sources; for hash-only ones (fixed by their data) and for native
    traces it must match, or a UsageError says so.
    """
    from sae_env.sources import open_trace

    if block_size is not None and not 1 <= block_size <= MAX_TOKENS:
        raise UsageError(f"--block-size must lie in [1, {MAX_TOKENS:,}] tokens, got {str(block_size)[:40]}")
    trace_obj, report = open_trace(trace, source, options, block_size)
    if block_size is not None and trace_obj.block_size != block_size:
        raise UsageError(f"--block-size {block_size} does not match the trace's block size "
                         f"{trace_obj.block_size} (hash-only and native traces keep the block size of their data)")
    return trace_obj, report


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--num-cpus 0`` silently meant "all CPUs")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if not 1 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text[:40]}")
    return value


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse unusable output paths before any work: ``--json`` a folder, ``--plots`` an existing file."""
    if getattr(args, "json", None):
        check_output_file(args.json, "--json")
    plots = getattr(args, "plots", None)
    if plots and Path(plots).exists() and not Path(plots).is_dir():
        raise UsageError(f"--plots {plots} is a file; give a folder for the plots")


def _fmt(v: Any, width: int = 12) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:{width}.4f}" if abs(v) < 1e4 else f"{v:{width}.4g}"
    return str(v).rjust(width)


# -- subcommands ---------------------------------------------------------------------------------------------------

def cmd_characterize(args: argparse.Namespace) -> int:
    from sae_env.characterize import characterize, format_table

    _check_outputs(args)
    trace, report = load_input(args.trace, args.source, parse_options(args.opt))
    print(report, file=sys.stderr)
    result = characterize(trace)
    print(format_table(result))
    if args.headroom:
        from sae_env.characterize import format_headroom, headroom

        result["headroom"] = headroom(trace, parse_fractions(args.headroom))
        print("\nLRU-to-Belady headroom (token hit rate, instant serving)")
        print(format_headroom(result["headroom"]))
    if args.json:
        write_json(args.json, {**result, "load_report": report.to_dict()})
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        from sae_env.characterize import write_plots

        for p in write_plots(result, trace, args.plots):
            print(f"wrote {p}", file=sys.stderr)
    return 0


def parse_fractions(text: str) -> list[float]:
    """``"0.05,0.1,20%"`` -> ``[0.05, 0.1, 0.2]``: cache sizes as fractions of the distinct blocks."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            f = float(part[:-1]) / 100.0 if part.endswith("%") else float(part)
        except ValueError:
            raise UsageError(f"--headroom expects fractions such as 0.05,0.1,0.2 (or 5%,10%), got {part!r}") from None
        if not 0.0 < f <= 1.0:
            raise UsageError(f"--headroom: {part!r} is not a fraction of the distinct blocks in (0, 1]")
        out.append(f)
    return out


REPLAY_COLUMNS = ("token_hit_rate", "block_hit_rate", "hit_tokens", "evictions", "bypasses", "ttft_mean_ms",
                  "ttft_p50_ms", "ttft_p99_ms", "decision_us_per_request")


def _policy_list(text: str) -> list[str]:
    """A comma list of registered policy names or ``module:Class`` policies (UsageError naming the unknown ones)."""
    from sae_env.policies import policy_class, policy_names

    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError(f"unknown policy {text!r}; valid policies: {', '.join(policy_names())} (or 'module:Class')")
    for p in names:
        try:
            policy_class(p)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return names


def _replay_inputs(args: argparse.Namespace, allow_range: bool = False) -> tuple[Trace, Any, int]:
    """The trace (``--trace/--source/--opt/--block-size``, rescaled by ``--load``), the capacity in blocks (with
    ``allow_range``: the list of capacities ``--capacity`` names, one or a range) and the trace's distinct blocks,
    as ``replay`` and ``explain`` read them."""
    from sae_env.cache import resolve_capacity
    from sae_env.mrc import capacity_range, is_range
    from sae_env.serving import make_server

    trace, report = load_input(args.trace, args.source, parse_options(args.opt), args.block_size)
    print(report, file=sys.stderr)
    if args.load is not None:
        trace = apply_load(trace, args.serving, args.load)
    distinct = trace.distinct_blocks()
    kv_bytes = make_server(args.serving).kv_bytes_per_token
    if is_range(args.capacity):
        if not allow_range:
            raise UsageError(f"--capacity {args.capacity}: give one capacity here (ranges are for `replay`)")
        capacities = capacity_range(args.capacity, distinct, kv_bytes, trace.block_size)
    else:
        capacities = [resolve_capacity(args.capacity, distinct, kv_bytes, trace.block_size)]
    if capacities[-1] > 100 * max(distinct, 1):
        raise UsageError(f"capacity {capacities[-1]} blocks is more than 100x the trace's {distinct} distinct "
                         "blocks; use a fraction (e.g. 0.15) or a smaller number")
    return trace, capacities if allow_range else capacities[0], distinct


def _build_policy(args: argparse.Namespace, name: str) -> tuple[Any, list]:
    """The policy ``name`` with what the extensions give it (a predictor) and its online learners, as ``replay``
    runs it."""
    from sae_env.policies import make_policy

    extensions = getattr(args, "extensions", ())
    options: dict[str, Any] = {}
    for ext in extensions:
        options.update(ext.policy_options(args, name))
    options.update(_given_options(args, name))
    policy = make_policy(name, **options)
    return policy, [cb for ext in extensions for cb in ext.replay_callbacks(args, policy)]


def policy_option_names(name: str) -> set[str]:
    """The constructor options a policy takes (by name)."""
    import inspect

    from sae_env.policies import policy_class

    params = inspect.signature(policy_class(name).__init__).parameters
    return {k for k, p in params.items() if k != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def _given_options(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The ``--policy-opt`` options that policy ``name`` takes (none for commands without the flag)."""
    names = policy_option_names(name)
    return {k: v for k, v in getattr(args, "policy_options", {}).items() if k in names}


def cmd_replay(args: argparse.Namespace) -> int:
    from sae_env.cache import PrefixCache
    from sae_env.fast_engine import AVAILABLE as COMPILED
    from sae_env.metrics import summarize
    from sae_env.replay import Replay
    from sae_env.serving import make_server

    names = _policy_list(args.policy)
    args.policy_options = parse_options(getattr(args, "policy_opt", None), "--policy-opt")
    for key in args.policy_options:
        if not any(key in policy_option_names(n) for n in names):
            takes = sorted(set().union(*(policy_option_names(n) for n in names)))
            raise UsageError(f"--policy-opt {key}: none of {', '.join(names)} takes it (their options: "
                             f"{', '.join(takes) or 'none'})")
    _check_outputs(args)
    trace, capacities, distinct = _replay_inputs(args, allow_range=True)
    results = []
    for name in names:
        curve = _lru_curve(args, trace, name, capacities)
        for capacity in capacities:
            if curve is not None:
                results.append({**curve[capacity], "distinct_blocks": distinct, "serving": args.serving,
                                "load": args.load})
                continue
            policy, callbacks = _build_policy(args, name)
            server = make_server(args.serving)
            rep = Replay(trace, PrefixCache(capacity, policy), server, window_requests=args.window,
                         callbacks=callbacks)
            rep.run(progress=args.progress)
            summary = summarize(rep.windows, policy=name, block_size=trace.block_size, timed=server.timed)
            summary["oracle"] = policy.oracle
            summary["distinct_blocks"] = distinct
            summary["serving"] = args.serving
            summary["load"] = args.load
            summary["adaptive"] = bool(callbacks)
            summary["params"] = policy.params
            summary["decision_us_per_request"] = 1e6 * rep.wall_s / max(len(trace), 1)  # wall clock, not a metric
            prepare = rep.prepare_s  # of it: the policy's per-window work ahead of the compiled loop
            summary["prepare_us_per_request"] = None if prepare is None else 1e6 * prepare / max(len(trace), 1)
            summary["method"] = "replay"
            summary["policy_options"] = _given_options(args, name)
            summary["engine"] = rep.engine  # decision_us_per_request is this engine's
            if rep.fast_reason is not None:
                summary["engine_note"] = rep.fast_reason
            results.append(summary)
    sweep = len(capacities) > 1
    size = (f"{len(capacities)} capacities from {capacities[0]} to {capacities[-1]} blocks "
            f"({capacities[0] / max(distinct, 1):.1%} to {capacities[-1] / max(distinct, 1):.1%})" if sweep else
            f"capacity {capacities[0]} blocks ({capacities[0] / max(distinct, 1):.1%})")
    print(f"{len(trace)} requests, {trace.n_blocks} prompt blocks, {distinct} distinct blocks, {size}, block size "
          f"{trace.block_size}, serving {args.serving}")
    width = max(14, *(len(r["policy"]) + 2 for r in results))  # module:Class names run longer than registered ones
    print(("capacity".rjust(10) + "  " if sweep else "") + "policy".ljust(width)
          + "".join(c[:12].rjust(13) for c in REPLAY_COLUMNS))
    for r in results:
        print((str(r["capacity_blocks"]).rjust(10) + "  " if sweep else "") + r["policy"].ljust(width)
              + "".join(" " + _fmt(r[c]) for c in REPLAY_COLUMNS))
    for name in names:
        taken = _given_options(args, name)
        if taken:
            print(f"{name} ran with " + ", ".join(f"{k}={v}" for k, v in taken.items()))
    if COMPILED:  # the compiled engine ran the others: say which policy it declined, and why (a slower decision_us)
        declined = {r["policy"]: r["engine_note"] for r in results
                    if r.get("engine") == "python" and "engine_note" in r}
        for name, why in declined.items():
            print(f"{name} ran on the Python engine: {why}")
    if args.json:
        write_json(args.json, results[0] if len(results) == 1 else results)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _lru_curve(args: argparse.Namespace, trace: Trace, name: str,
               capacities: list[int]) -> dict[int, dict[str, Any]] | None:
    """For a range of capacities, ``lru`` in instant mode from one pass (:mod:`sae_env.mrc`), as a summary per
    capacity with the keys a replay's has (those a curve cannot give, misses after eviction and by type, are
    None); None where separate replays run instead: one capacity, another policy, timed serving, an extension
    that gives lru learners, or a trace the curve declines (said on stderr)."""
    from sae_env.mrc import MissRatioCurve
    from sae_env.policies.lru import LRUPolicy

    if len(capacities) < 2 or name != "lru" or args.serving != "instant":
        return None
    policy, callbacks = _build_policy(args, name)
    if type(policy) is not LRUPolicy or callbacks:
        return None
    t0 = time.perf_counter()
    try:
        curve = MissRatioCurve.build(trace)
    except ValueError as e:
        print(f"note: lru replayed at each capacity: {e}", file=sys.stderr)
        return None
    points = {c: curve.point(c) for c in capacities}
    wall = time.perf_counter() - t0
    print(f"lru: one pass (miss-ratio curve) for {len(capacities)} capacities in {wall:.3f} s", file=sys.stderr)
    unknown = ("windows", "miss_after_eviction", "output_miss_after_eviction", "hit_rate_by_type",
               "miss_after_eviction_by_type", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
               "queue_mean_ms", "decision_us_per_request")
    out = {}
    for c, p in points.items():
        figures = {k: v for k, v in p.to_dict().items() if k != "capacity"}
        out[c] = {"policy": name, "capacity_blocks": c, "block_size": trace.block_size, **figures,
                  **dict.fromkeys(unknown), "duration_s": float(trace.t[-1] - trace.t[0]), "oracle": False,
                  "adaptive": False, "params": policy.params, "method": "curve"}
    return out


def cmd_explain(args: argparse.Namespace) -> int:
    """Where a policy loses to Belady: replay it (as ``replay`` does) beside the references and explain its misses."""
    from sae_env.explain import explain, format_table, write_outputs
    from sae_env.serving import make_server

    names = _policy_list(args.policy)
    if len(names) != 1:
        raise UsageError(f"--policy takes one policy, got {args.policy!r} (compare others with --compare)")
    policy = names[0]
    references = _policy_list(args.compare)
    missing = [p for p in ("lru", "belady") if p not in references]
    if missing:
        raise UsageError(f"--compare must include {' and '.join(missing)} (the ends of the gap), got "
                         f"{args.compare!r}")
    name = Path(args.trace).name.split(".")[0] or "trace"
    folder = f"{name}_{policy}_{args.capacity}".replace("%", "pct").replace("/", "_")
    out = Path(args.out) if args.out else Path("runs") / "explain" / folder
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    trace, capacity, _ = _replay_inputs(args)
    timed = args.serving != "instant"
    result = explain(trace, policy, capacity, build=lambda n: _build_policy(args, n),
                     server=(lambda: make_server(args.serving)) if timed else None, window=args.window,
                     references=references, progress=args.progress, label=name, serving=args.serving)
    print(format_table(result))
    for path in write_outputs(result, out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def apply_load(trace: Trace, serving: str, target: float) -> Trace:
    """Rescale arrival times so that the uncached prefill work over the trace span equals ``target``."""
    from sae_env.serving import at_load, make_server

    server = make_server(serving)
    if not server.timed:
        raise UsageError("--load needs a timed serving model (e.g. --serving qwen2.5-1.5b@a40), not 'instant'")
    return at_load(trace, server, target)


def cmd_run(args: argparse.Namespace) -> int:
    """Run an experiment config (default: the quickstart); print its tables; exit 1 if a cell failed."""
    from sae_env.experiment import ConfigError, is_ppo_config, load_config, run_experiment
    from sae_env.files import read_mapping

    path = config_path(args.config)
    try:
        data, where = read_mapping(path, "config")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    prog = getattr(args, "prog", "train.py")
    if is_ppo_config(data):
        print(f"{path} is a PPO training config: running `{prog} ppo --config {path}`", file=sys.stderr)
        parser = build_parser(args.extensions, prog=prog)
        argv = ["ppo", "--config", str(path), *(f"--set={pair}" for pair in args.set or ())]
        if args.no_wandb or args.wandb:
            argv += ["--wandb", "disabled" if args.no_wandb else args.wandb]
        ns = parser.parse_args(argv)
        ns.extensions, ns.prog = args.extensions, prog
        return ns.func(ns)
    runners = [r for r in (getattr(ext, "cell_runner", lambda: None)() for ext in args.extensions) if r is not None]
    if not runners:
        raise UsageError(f"running experiments needs a cell runner: start it through train.py, saecache-gym or "
                         f"python -m sae_env with the agents package installed (not {prog})")
    overrides = parse_overrides(args.set)
    if args.output:
        overrides["output"] = args.output
    config = load_config(data, runners[0], overrides, where=where, base=path.parent)
    wandb_mode = "disabled" if args.no_wandb else args.wandb
    run = run_experiment(config, runners[0], serial=True if args.serial else None, ray_address=args.ray_address,
                         num_cpus=args.num_cpus, run_id=args.run_id or (_fresh_id(config) if args.fresh else None),
                         reuse=not args.fresh,
                         wandb_mode=wandb_mode, progress=not args.no_progress)
    report = run.run_dir / "report.md"
    print(report.read_text())
    print(f"{len(run.results)}/{len(run.cells)} cells in {run.wall_s:.1f} s ({run.resumed} resumed); results in "
          f"{run.run_dir} (summary.csv, report.md, plots/, cells/)", file=sys.stderr)
    if run.failures:
        print(f"{len(run.failures)} cell(s) failed: see {run.run_dir / 'failures.json'}; rerun the same command to "
              "retry them (finished cells are kept)", file=sys.stderr)
        return 1
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """The W&B report of a run folder as code: the spec as JSON always, the report itself when online."""
    from sae_env.dashboard import dashboard_spec, panel_keys, save_report
    from sae_env.tracking import resolve_target

    run_dir = Path(args.run_dir)
    spec = dashboard_spec(run_dir)
    w = json.loads((run_dir / "config.json").read_text()).get("wandb") or {}
    mode = "disabled" if args.no_wandb else args.wandb or w.get("mode")
    target = resolve_target(mode, args.project or w.get("project"), args.entity or w.get("entity"),
                            default_dir=run_dir)
    out = Path(args.out) if args.out else run_dir / "dashboard.json"
    write_json(out, spec)
    for section in spec["sections"]:
        print(section["name"])
        for grid in section["grids"]:
            print(f"  {grid['title']}")
            for panel in grid["panels"]:
                keys = ", ".join(f"{where}:{key}" for where, key in panel_keys(panel))
                print(f"    {panel['type']:7s} {panel['title']}: {keys}")
    print(f"wrote {out}", file=sys.stderr)
    if target.mode != "online":
        prog = getattr(args, "prog", "train.py")
        print(f"W&B mode {target.mode}: the report is built in your W&B project online; upload the runs with "
              f"`wandb sync {run_dir}/wandb/offline-run-*`, then run `{prog} dashboard {run_dir} --wandb online`",
              file=sys.stderr)
        return 0
    try:
        url = save_report(spec, target.project, target.entity)
    except ImportError:
        raise UsageError("building the W&B report needs the dashboards extra: pip install -e \".[dashboards]\" "
                         "(wandb-workspaces)") from None
    print(f"saved the report to W&B project {target.project}: {url}")
    return 0


def _fresh_id(config: Any) -> str:
    return f"{config.results_key()}-{time.strftime('%Y%m%d-%H%M%S')}"


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="experiment YAML (default: configs/quickstart.yaml); a PPO "
                   "config (with 'ppo:') runs `train.py ppo`")
    add_serial_option(p, "run the cells one after another in this process (no Ray)")
    p.add_argument("--ray-address", metavar="ADDR", help="run on an existing Ray cluster (its network setup is its "
                   "owner's); default: a private local cluster that sends nothing off the machine")
    p.add_argument("--num-cpus", type=positive_int, metavar="N", help="CPUs of the local Ray cluster (default: all)")
    p.add_argument("--run-id", help="name of the run folder under <output>/<experiment>/ (default: a hash of the "
                   "config, so rerunning the same config resumes it)")
    p.add_argument("--fresh", action="store_true", help="compute every cell again in a new run folder (no resuming, "
                   "no reuse of earlier runs' cells; e.g. after changing the code)")
    p.add_argument("--output", metavar="DIR", help="output folder (default: the config's 'output', runs)")
    add_set_option(p, "--set seeds=[0,1,2] --set serving.model=instant")
    add_wandb_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class _Deprecated(argparse.Action):
    """A former spelling of a flag: does what the flag does, and says so once on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, replacement: str = "", **kw: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        print(f"warning: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, True)


def add_serial_option(p: argparse.ArgumentParser, help_: str) -> None:
    """``--serial``: one name, across subcommands, for running in this process without Ray (``--no-ray``, tune's
    former spelling, still works)."""
    p.add_argument("--serial", action="store_true", help=help_)
    p.add_argument("--no-ray", dest="serial", action=_Deprecated, replacement="--serial", help=argparse.SUPPRESS)


def add_wandb_options(p: argparse.ArgumentParser) -> None:
    """``--wandb MODE`` and ``--no-wandb``: the same pair for experiments and training commands."""
    from sae_env.tracking import WANDB_MODES

    p.add_argument("--wandb", choices=WANDB_MODES, help="W&B mode (default: the config's, else $WANDB_MODE, else "
                   "offline)")
    p.add_argument("--no-wandb", action="store_true", help="no W&B runs (same as --wandb disabled)")


# -- parser --------------------------------------------------------------------------------------------------------

def build_parser(extensions: Sequence[CliExtension] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``prog`` names the program in usage lines (default: how it was started, e.g. ``train.py`` or
    ``saecache-gym``)."""
    p = argparse.ArgumentParser(prog=prog, description="SAECache-Gym: prefix-cache eviction agents in a "
                                "Gymnasium environment. With no subcommand: run an experiment (the options below; "
                                "default configs/quickstart.yaml).")
    add_run_options(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    # SUPPRESS: an option left out after `run` keeps what was given before it (`train.py --config F run`).
    run = sub.add_parser("run", help="run an experiment config (workloads x capacities x agents x seeds)",
                         argument_default=argparse.SUPPRESS,
                         description="Expand a YAML config into cells, run them on a local Ray cluster (or "
                         "serially), write runs/<experiment>/<run-id>/ (cells/, summary.csv, report.md, plots/) "
                         "and W&B runs (offline by default). Rerunning the same command resumes.")
    add_run_options(run)
    run.set_defaults(func=cmd_run)

    def trace_args(sp: argparse.ArgumentParser, positional: bool) -> None:
        from sae_env import data

        help_ = (f"trace file, 'synthetic' (generated; options via --opt, e.g. --opt preset=shift), or an embedded "
                 f"trace: {', '.join(data.ALL)}")
        if positional:
            sp.add_argument("trace", help=help_)
        else:
            sp.add_argument("--trace", default=DEFAULT_TRACE, help=help_ + f" (default: {DEFAULT_TRACE})")
        sp.add_argument("--source", help="input format: mooncake, bailian, conversations, taubench, azure, "
                        "synthetic, mix, trace (inferred for embedded traces and .npz)")
        sp.add_argument("--opt", action="append", metavar="KEY=VALUE", help="a source option (repeatable), e.g. "
                        "--opt seed=3 --opt rate=0.5")

    c = sub.add_parser("characterize", help="workload characterisation of a trace",
                       description="Reuse ratios by token type, app and block offset; intra- vs cross-session "
                       "reuse; inter-turn gaps fitted to log-normal and exponential.")
    trace_args(c, positional=True)
    c.add_argument("--json", help="write the result as JSON")
    c.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    c.add_argument("--headroom", nargs="?", const="0.05,0.1,0.2", metavar="FRACTIONS", help="also replay LRU and "
                   "Belady at these cache sizes (fractions of the distinct blocks; default 0.05,0.1,0.2) and print "
                   "the headroom between them")
    c.set_defaults(func=cmd_characterize)

    r = sub.add_parser("replay", help="replay a trace through eviction policies",
                       description="Replay a trace through one or more policies (comma list) on the same cache size "
                       "and print them side by side.")
    trace_args(r, positional=False)
    r.add_argument("--policy", default="lru", help="policy name or comma list (e.g. lru,lfu,belady)")
    r.add_argument("--capacity", default="0.1", help="blocks (int), fraction of distinct blocks (0.15), '15%%', "
                   "or KV bytes ('2GiB', needs a serving preset); or several: a range LO:HI[:N] (N capacities "
                   "spaced geometrically from LO to HI, default 20; e.g. 1%%:40%%) or a comma list (1%%,5%%,10%%). "
                   "Over several capacities lru in instant serving comes from one pass over the trace (its exact "
                   "miss-ratio curve; no misses after eviction), every other policy from a replay per capacity")
    r.add_argument("--serving", default="instant", help="'instant' (no time passes) or a preset: "
                   "qwen2.5-1.5b@a40, qwen2.5-1.5b@h200")
    r.add_argument("--load", type=float, metavar="U", help="rescale arrivals to a target utilisation U of the "
                   "prefill server (uncached work / trace span; e.g. 0.7)")
    r.add_argument("--block-size", type=int, help="block size in tokens (text sources re-cut; must match "
                   "hash-only traces)")
    r.add_argument("--window", type=int, default=200, help="requests per window; adaptive policies learn after "
                   "each window (default 200)")
    r.add_argument("--policy-opt", action="append", metavar="KEY=VALUE", help="a constructor option of the policies "
                   "that take it (repeatable; YAML value), e.g. --policy-opt continuation=false to replay SAECache "
                   "without its continuation model; an option no listed policy takes is an error")
    r.add_argument("--json", help="write the summary as JSON")
    r.add_argument("--progress", action="store_true", help="show a progress bar")
    r.set_defaults(func=cmd_replay)

    d = sub.add_parser("dashboard", help="the W&B report of a run folder, as code",
                       description="Build the W&B report of an experiment run (who wins, adaptation over simulated "
                       "time with phases, learned parameters, TTFT against load) from what its runs log. Writes the "
                       "spec as JSON (RUN_DIR/dashboard.json) and lists its panels; online it saves the report to "
                       "your W&B project (wandb-workspaces, the dashboards extra).")
    d.add_argument("run_dir", metavar="RUN_DIR", help="an experiment run folder, runs/<experiment>/<run-id>")
    d.add_argument("--out", metavar="FILE", help="where to write the spec (default RUN_DIR/dashboard.json)")
    d.add_argument("--project", help="W&B project (default: the run's config, else $WANDB_PROJECT, else "
                   "saecache-gym)")
    d.add_argument("--entity", help="W&B entity (default: the run's config, else $WANDB_ENTITY, else yours)")
    add_wandb_options(d)
    d.set_defaults(func=cmd_dashboard)
    e = sub.add_parser("explain", help="where a policy loses to Belady (misses split, regret, partial oracles)",
                       description="Replay one policy exactly as `replay` does, beside LRU, the partial oracles and "
                       "Belady; split its prompt-block misses into compulsory, capacity and regret (evicted, then "
                       "missed while the ghost record held it), break the regret down by token type, queue, turn, "
                       "depth and idle time at eviction, and list the blocks Belady keeps that it evicts. Prints the "
                       "main table; writes explain.md, explain.json and plots/*.png to --out.")
    trace_args(e, positional=False)
    e.add_argument("--policy", required=True, help="the policy to explain (one name, e.g. saecache)")
    e.add_argument("--capacity", default="0.1", help="as for replay (blocks, fraction, '15%%' or KV bytes)")
    e.add_argument("--compare", default="lru,session-oracle,reuse-oracle,belady", help="reference policies "
                   "replayed beside it (comma list; must include lru and belady; default %(default)s)")
    e.add_argument("--serving", default="instant", help="as for replay")
    e.add_argument("--load", type=float, metavar="U", help="as for replay")
    e.add_argument("--block-size", type=int, help="as for replay")
    e.add_argument("--window", type=int, default=200, help="requests per window, as for replay (default 200)")
    e.add_argument("--out", metavar="DIR", help="output folder (default runs/explain/<trace>_<policy>_<capacity>)")
    e.add_argument("--progress", action="store_true", help="show a progress bar per replay")
    e.set_defaults(func=cmd_explain)
    for ext in extensions:
        ext.add_replay_options(r)
        ext.add_replay_options(e)
        ext.add_commands(sub)
    return p


def main(argv: list[str] | None = None, extensions: Sequence[CliExtension] = (), prog: str | None = None) -> int:
    """Run the command line; ``extensions`` (from ``agents``) add subcommands and learned components."""
    parser = build_parser(extensions, prog)
    args = parser.parse_args(argv)
    args.extensions = tuple(extensions)
    args.prog = parser.prog
    func = getattr(args, "func", cmd_run)
    try:
        return func(args)
    except (UsageError, TraceFormatError, ValueError, OSError) as e:  # OSError: a path the user gave
        if os.environ.get("SAE_DEBUG"):
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    """The error as one line (an exception's message may span several, e.g. YAML's)."""
    text = " ".join(str(e).split("\n")).strip()
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
