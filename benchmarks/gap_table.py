"""Where each policy stands between LRU and Belady, on every embedded real trace: one table, re-run in a minute or so.

For each trace and cache size (a fraction of the trace's distinct blocks), every policy is replayed exactly as
``python train.py replay`` replays it (instant serving, window 200, SAECache with its online learners) and the
table gives its token hit rate and, in brackets, its share of the LRU-to-Belady gap (0 % = LRU, 100 % = Belady;
:func:`sae_env.explain.gap_share`). ``python train.py explain`` says where one of these cells' misses come from.

``--criteria`` adds SAECache's margin over the stronger of LRU and LPC in every cell, and checks it: at least
-0.2 points in every cell, at least +1 point on average over the cells where Belady is more than 5 points above LRU,
the share of the gap closed on WildChat at 5 %, and SAECache's decision time per request over LPC's: CPU time of
each whole replay with its online learners, summed over the cache sizes, in this process, so the compiled kernels
are loaded by the first replay of each policy only (CPU time is steadier on a shared machine). ``train.py replay``'s
decision_us is a different figure: the wall time of a process's first replay, kernel loading included, learners
excluded; on short traces loading weighs more in it, so its ratios are lower.
``--seeds`` replays traces whose source draws arrivals or gaps (WildChat's gaps come from our generator) under
several seeds and adds the mean margin with its 95 % interval per cache size. ``--opt KEY=VALUE`` (repeatable) sets a
source option, e.g. WildChat's session arrival ``rate``, on the traces whose source takes it (with the seeds); a trace
whose source does not take every option is replayed once, as shipped. ``--variant NAME:KEY=VALUE,...`` adds a column:
SAECache (or ``policy=P``: a registered name, or ``module:Class``, e.g. a probe of ``benchmarks/probes/``, importable as
``probes.NAME``) built with those constructor options (a switch flipped, ``refit_steps``), checked by ``--criteria``
like SAECache itself. ``--halves`` replays each trace as two: its sessions split by when they start (the first half of
the sessions, then the rest; ``--halves alternate``: every other session, the odd and the even half;
:func:`sae_env.trace.session_halves`): two shorter traces of each source, a check of how a result carries over to other
traces of it (docs/saecache-real-traces.md, "Held out: the shipped traces in halves"). ``--repeat N`` replays each trace
made N times longer at the same load (:func:`sae_env.trace.repeated`: N copies one after another, each with sessions and
blocks of its own; ``--pause SECONDS`` puts them that much further apart): the held-out traces are longer ones of the
same sources, and a cache of the same fraction of their distinct blocks holds more of their working set.

    python benchmarks/gap_table.py [--traces wildchat,taubench] [--capacities 0.05,0.1,0.2]
                                   [--policies lru,lpc,saecache,reuse-oracle,session-oracle,belady] [--json FILE]
    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria
    python benchmarks/gap_table.py --traces wildchat --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady \
        --criteria --seeds 0,1,2,3,4
    python benchmarks/gap_table.py --traces wildchat --capacities 0.05,0.1,0.2 --policies lru,lpc,saecache,belady \
        --criteria --seeds 0,1,2,3,4 --opt rate=0.1
    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria \
        --variant one-step:refit_steps=1 --variant no-features:continuation_features=false
    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria \
        --variant h15:policy=probes.horizon:Horizon,horizon_sigmas=1.5
    python benchmarks/gap_table.py --halves --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria
    python benchmarks/gap_table.py --halves alternate --capacities 0.02,0.05,0.1,0.2 \
        --policies lru,lpc,saecache,belady --criteria
    python benchmarks/gap_table.py --repeat 4 [--pause 3600] --capacities 0.02,0.05,0.1,0.2 \
        --policies lru,lpc,saecache,belady --criteria
    python benchmarks/gap_table.py --traces my_trace.jsonl --source mooncake --capacities 0.02,0.05,0.1,0.2 \
        --policies lru,lpc,saecache,belady --criteria

``--traces`` takes trace files too, in the format ``--source`` names (as ``train.py replay --source``; inferred for
native ``.npz`` / ``.jsonl`` traces): the issue's checks on a trace of one's own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from agents.cli import AgentsExtension
from sae_env.cache import PrefixCache, resolve_capacity
from sae_env.cli import UsageError, parse_options
from sae_env.explain import gap_share
from sae_env.files import write_json
from sae_env.inputs import UnknownOptionError
from sae_env.metrics import summarize
from sae_env.policies import make_policy, policy_names
from sae_env.replay import Replay
from sae_env.sources import open_trace
from sae_env.trace import HALF_SPLITS, check_pause, repeated, session_halves

TRACES = ("wildchat", "mooncake_arxiv", "mooncake_synthetic", "taubench", "bailian")
HALF_LABELS = {"start": ("early half", "late half"), "alternate": ("odd half", "even half")}  # rows' "half"
POLICIES = ("lru", "lpc", "saecache", "reuse-oracle", "session-oracle", "belady")


def hit_rate(trace: Any, name: str, capacity: int, window: int) -> float:
    """Token hit rate of ``name`` as ``train.py replay`` runs it (its online learners, if any, between windows)."""
    return replay_cell(trace, name, capacity, window)[0]


def replay_cell(trace: Any, name: str, capacity: int, window: int,
                options: dict[str, Any] | None = None) -> tuple[float, float]:
    """(token hit rate, CPU seconds of the whole replay, its online learners included) of ``name`` (built with
    ``options``) as ``train.py replay`` runs it."""
    policy = make_policy(name, **(options or {}))
    callbacks = AgentsExtension().replay_callbacks(argparse.Namespace(fixed=False), policy)
    rep = Replay(trace, PrefixCache(capacity, policy), None, window_requests=window, callbacks=callbacks)
    start = time.process_time()
    rep.run()
    return summarize(rep.windows)["token_hit_rate"], time.process_time() - start


def _label(who: str) -> str:
    return "SAECache" if who == "saecache" else who


def _where(r: dict[str, Any]) -> str:
    """A row's trace, and its half under --halves."""
    return f"{r['trace']} {r['half']}" if r.get("half") else r["trace"]


def _cell(r: dict[str, Any]) -> str:
    """A row's trace (and half) and cache size, as the criteria name it."""
    return f"{_where(r)} {r['capacity']:.0%}"


def margin(rate: dict[str, float], who: str = "saecache") -> float:
    """SAECache's (or a variant's) token hit rate minus the stronger of LRU and LPC, in points."""
    return 100.0 * (rate[who] - max(rate["lru"], rate["lpc"]))


def print_criteria(rows: list[dict[str, Any]], cpu: dict[str, dict[str, float]], where: str = "as shipped",
                   who: str = "saecache") -> None:
    """The checks of ``--criteria`` over the rows of seed 0 (the embedded traces as shipped, or under ``where``),
    for SAECache or a ``--variant``."""
    base = [r for r in rows if r.get("seed") in (None, 0)]
    worst = min(base, key=lambda r: margin(r["token_hit_rate"], who))
    below = [r for r in base if margin(r["token_hit_rate"], who) < -0.2]
    wide = [r for r in base if 100 * (r["token_hit_rate"]["belady"] - r["token_hit_rate"]["lru"]) > 5]
    print(f"\n{_label(who)} minus max(LRU, LPC), points, on the traces {where} (seed 0):")
    print(f"- every cell >= -0.2: {'yes' if not below else 'no'} (worst {margin(worst['token_hit_rate'], who):+.2f} "
          f"on {_cell(worst)}; below -0.2: "
          + (", ".join(f"{_cell(r)} {margin(r['token_hit_rate'], who):+.2f}" for r in below) or "none") + ")")
    if wide:
        mean = sum(margin(r["token_hit_rate"], who) for r in wide) / len(wide)
        print(f"- mean over the {len(wide)} cells where Belady - LRU > 5 points (the traces {where}, seed 0): "
              f"{mean:+.2f} (needs >= +1.00)")
        seeded = {}  # (trace, half, capacity) -> the margins over the seeds that drew its gaps
        for r in rows:
            if r.get("seed") is not None:
                seeded.setdefault((_where(r), r["capacity"]), []).append(margin(r["token_hit_rate"], who))
        if any(len(m) > 1 for m in seeded.values()):
            seed_means = {cell: sum(m) / len(m) for cell, m in seeded.items()}
            means = [seed_means.get((_where(r), r["capacity"]), margin(r["token_hit_rate"], who)) for r in wide]
            n = max(len(m) for m in seeded.values())
            print(f"- the same cells, each whose gaps a seed draws at its mean over the seeds ({n}): "
                  f"{sum(means) / len(means):+.2f}")
    for r in base:
        if r["trace"] == "wildchat" and abs(r["capacity"] - 0.05) < 1e-9:
            print(f"- share of the LRU-to-Belady gap closed on {_where(r)} at 5 %: "
                  f"{100 * r['gap_share'][who]:.1f} % (LPC: {100 * r['gap_share']['lpc']:.1f} %)")
    print(f"- decision time per request, CPU, kernels loaded once per process ({who} / lpc): " + ", ".join(
        f"{t} {1e6 * c[who] / c['requests']:.0f} / {1e6 * c['lpc'] / c['requests']:.0f} us = "
        f"{c[who] / c['lpc']:.2f}x" for t, c in cpu.items()))


def print_seed_summary(rows: list[dict[str, Any]], who: str = "saecache") -> None:
    """Per trace and capacity over several seeds: the mean margin and its 95 % interval."""
    from sae_env.intervals import mean_interval

    # per trace, half (under --halves) and capacity: the halves of one seed are two cells, not two seeds
    keys = list(dict.fromkeys((_where(r), r["capacity"]) for r in rows if r.get("seed") is not None))
    print(f"\nOver seeds, {_label(who)} minus max(LRU, LPC), points (mean [95 % interval], min):")
    for where, cap in keys:
        m = [margin(r["token_hit_rate"], who) for r in rows
             if r.get("seed") is not None and (_where(r), r["capacity"]) == (where, cap)]
        iv = mean_interval(m)
        ci = "" if iv.half is None else f" [{iv.low:+.2f}, {iv.high:+.2f}]"
        print(f"- {where} {cap:.0%}: {iv.mean:+.2f}{ci}, min {min(m):+.2f} over {len(m)} seeds")


def parse_variants(specs: list[str] | None, policies: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """``["fast:refit_steps=1"]`` -> ``{"fast": ("saecache", {"refit_steps": 1})}``; each is built once here, so
    that a bad option stops the run before any replay (ValueError naming the variant)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in specs or []:
        name, sep, rest = spec.partition(":")
        name = name.strip()
        if not sep or not name or "|" in name or name in policies or name in out:
            raise UsageError(f"--variant expects a new column name, a colon and KEY=VALUE pairs (e.g. fast:refit_steps"
                             f"=1), got {spec!r}")
        options = parse_options([x for x in rest.split(",") if x.strip()], f"--variant {name}")
        policy = str(options.pop("policy", "saecache"))
        try:  # an unknown name, or a module:Class that is no policy, is a ValueError too
            make_policy(policy, **options)
        except ValueError as e:
            raise UsageError(f"--variant {name}: {e}") from None
        out[name] = (policy, options)
    return out


def _table_rows(trace: Any, name: str, half: str | None, seed: int | None, options: dict[str, Any], label: str,
                fractions: list[float], policies: list[str], variants: dict[str, tuple[str, dict[str, Any]]],
                args: argparse.Namespace, cpu: dict[str, dict[str, float]], header: list[str]) -> list[dict[str, Any]]:
    """One trace's rows, a cache size each, printed as they come (the table's header before the first)."""
    rows = []
    columns = policies + list(variants)
    distinct = trace.distinct_blocks()
    for f in fractions:
        capacity = resolve_capacity(f, distinct)
        cells = {pol: replay_cell(trace, pol, capacity, args.window) for pol in policies}
        cells.update({column: replay_cell(trace, policy, capacity, args.window, built_with)
                      for column, (policy, built_with) in variants.items()})
        rate = {pol: c[0] for pol, c in cells.items()}
        if seed in (None, 0):
            c = cpu.setdefault(name, {"requests": 0})
            if args.criteria:
                for who in ("saecache", "lpc", *variants):
                    c[who] = c.get(who, 0.0) + cells[who][1]
                c["requests"] += len(trace)
        share = {pol: gap_share(rate[pol], rate["lru"], rate["belady"]) for pol in columns}
        rows.append({"trace": name, "half": half, "seed": seed, "repeat": args.repeat, "pause": args.pause,
                     "options": {k: v for k, v in options.items() if k != "seed"}, "capacity": f,
                     "capacity_blocks": capacity, "token_hit_rate": rate, "gap_share": share})
        out = [f"{100 * rate[pol]:.2f}" + ("" if share[pol] is None else f" ({round(100 * share[pol])} %)")
               for pol in columns]
        if args.criteria:
            out.append(f"{margin(rate):+.2f}")
        while header:
            print(header.pop(0))
        print(f"| {label} | {f:.0%} ({capacity:,}) | {100 * (rate['belady'] - rate['lru']):.2f} | "
              + " | ".join(out) + " |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default=",".join(TRACES), help="embedded trace names or trace files (comma list)")
    p.add_argument("--source", help="the format of the trace files in --traces (as replay's --source: mooncake, "
                   "bailian, conversations, taubench, ...; inferred for native .npz / .jsonl traces)")
    p.add_argument("--capacities", default="0.05,0.1,0.2", help="fractions of the distinct blocks (comma list)")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies (comma list; lru and belady needed)")
    p.add_argument("--window", type=int, default=200, help="requests per window, as replay's default")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--criteria", action="store_true", help="SAECache's margin over max(LRU, LPC) per cell, checked "
                   "(needs lru, lpc, saecache and belady), and its decision time over LPC's")
    p.add_argument("--seeds", metavar="S,S,...", help="replay traces whose source takes a seed under each of these "
                   "seeds (others once)")
    p.add_argument("--opt", action="append", metavar="KEY=VALUE", help="a source option (repeatable; YAML value), "
                   "e.g. --opt rate=0.1, for the traces whose source takes it (the others once, as shipped)")
    p.add_argument("--variant", action="append", metavar="NAME:KEY=VALUE,...", help="one more column: saecache (or "
                   "policy=P, a registered name or module:Class, e.g. probes.relabel:Relabel) built with these "
                   "constructor options, e.g. --variant no-features:continuation_features=false or --variant "
                   "fast-refit:refit_steps=1 (repeatable; --criteria checks it too)")
    p.add_argument("--halves", nargs="?", const="start", choices=HALF_SPLITS, help="replay each trace as two, its "
                   "sessions split by when they start: the first half of the sessions, then the rest (start, the "
                   "default), or every other one (alternate); how a result carries over to other traces of a source")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="replay each trace made N times longer at the "
                   "same load: N copies one after another, sessions and blocks of their own (default 1: as shipped)")
    p.add_argument("--pause", type=float, default=0.0, metavar="SECONDS", help="with --repeat: seconds between the "
                   "copies (default 0: back to back)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        print(f"error: --repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    try:
        check_pause(args.pause)
    except ValueError as e:
        print(f"error: --pause: {e}", file=sys.stderr)
        return 2
    if args.repeat > 1 and args.halves:
        print("error: --repeat and --halves: one at a time (halves of copies would cut each copy's sessions apart)",
              file=sys.stderr)
        return 2
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    try:
        opts = parse_options(args.opt)
        variants = parse_variants(args.variant, policies)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [x for x in policies if x not in policy_names()] + [x for x in ("lru", "belady") if x not in policies]
    if bad:
        print(f"error: --policies: unknown or missing {bad} (lru and belady are the ends of the gap)", file=sys.stderr)
        return 2
    try:
        fractions = [float(x) for x in args.capacities.split(",")]
    except ValueError:
        print(f"error: --capacities expects fractions such as 0.05,0.1, got {args.capacities!r}", file=sys.stderr)
        return 2
    if args.criteria and not {"lru", "lpc", "saecache", "belady"} <= set(policies):
        print("error: --criteria needs lru, lpc, saecache and belady among --policies", file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        print(f"error: --seeds expects whole numbers such as 0,1,2, got {args.seeds!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = []
    cpu: dict[str, dict[str, float]] = {}
    columns = policies + list(variants)
    header = ["| trace | capacity | gap (pp) | " + " | ".join(columns) + (" | margin |" if args.criteria else " |"),
              "|---|---|---|" + "---|" * (len(columns) + args.criteria)]  # printed before the first row

    names = [x.strip() for x in args.traces.split(",") if x.strip()]
    files = {name for name in names if Path(name).exists()}  # trace files (in --source's format), not embedded names

    def source(name: str) -> str | None:
        """--source for a trace file; an embedded trace's name keeps its own format."""
        return args.source if name in files else None

    for name in names:
        for seed in (seeds or [None]):
            options = {**opts, **({} if seed is None else {"seed": seed})}
            try:
                trace, _ = open_trace(name, source(name), options, None)
            except UnknownOptionError:  # a source without arrival seeds or one of the options: once, as shipped
                if seed is not None and seed != seeds[0]:
                    continue
                trace, _ = open_trace(name, source(name), {}, None)
                seed, options = None, {}
            except ValueError as e:  # a value the source rejects (its message names the option), or a bad file
                print(f"error: {'--opt: ' if opts else ''}{name}: {e}", file=sys.stderr)
                return 2
            given = [f"{k}={v}" for k, v in options.items() if k != "seed"] + ([] if seed is None else [f"seed {seed}"])
            if args.repeat > 1:
                trace = repeated(trace, args.repeat, args.pause)
            if args.halves:
                try:
                    parts = list(zip(HALF_LABELS[args.halves], session_halves(trace, args.halves), strict=True))
                except ValueError as e:
                    print(f"error: --halves: {name}: {e}", file=sys.stderr)
                    return 2
            else:
                parts = [(None, trace)]
            for half, trace in parts:
                label = (name + (f" x{args.repeat}" if args.repeat > 1 else "") + (f" {half}" if half else "")
                         + (f" ({', '.join(given)})" if given else ""))
                rows.extend(_table_rows(trace, name, half, seed, options, label, fractions, policies, variants, args,
                                        cpu, header))
    print(f"\nToken hit rate % (share of the LRU-to-Belady gap); instant serving, window {args.window}; "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.criteria:
        shipped = "as given" if files else "as shipped"
        where = (shipped if not opts else
                 "with " + ", ".join(f"{k}={v}" for k, v in opts.items()) + " where their source takes it")
        if args.repeat > 1:
            where = f"made {args.repeat} times longer" + (f" ({args.pause:g} s apart)" if args.pause else "") + (
                "" if not opts else ", " + where)
        if args.halves:
            where = ("in halves" if args.halves == "start" else "in alternate halves") + ("" if not opts else
                                                                                          ", " + where)
        print_criteria(rows, cpu, where)
        for column in variants:
            print_criteria(rows, cpu, where, who=column)
        if seeds:
            print_seed_summary(rows)
            for column in variants:
                print_seed_summary(rows, who=column)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
