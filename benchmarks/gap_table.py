"""Where each policy stands between LRU and Belady, on every embedded real trace: one table, re-run in a minute or so.

For each trace and cache size (a fraction of the trace's distinct blocks), every policy is replayed exactly as
``python train.py replay`` replays it (instant serving, window 200, SAECache with its online learners) and the
table gives its token hit rate and, in brackets, its share of the LRU-to-Belady gap (0 % = LRU, 100 % = Belady;
:func:`sae_env.explain.gap_share`). ``python train.py explain`` says where one of these cells' misses come from.

    python benchmarks/gap_table.py [--traces wildchat,taubench] [--capacities 0.05,0.1,0.2]
                                   [--policies lru,lpc,saecache,reuse-oracle,session-oracle,belady] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from agents.cli import AgentsExtension
from sae_env.cache import PrefixCache, resolve_capacity
from sae_env.explain import gap_share
from sae_env.files import write_json
from sae_env.metrics import summarize
from sae_env.policies import make_policy, policy_names
from sae_env.replay import Replay
from sae_env.sources import open_trace

TRACES = ("wildchat", "mooncake_arxiv", "mooncake_synthetic", "taubench", "bailian")
POLICIES = ("lru", "lpc", "saecache", "reuse-oracle", "session-oracle", "belady")


def hit_rate(trace: Any, name: str, capacity: int, window: int) -> float:
    """Token hit rate of ``name`` as ``train.py replay`` runs it (its online learners, if any, between windows)."""
    policy = make_policy(name)
    callbacks = AgentsExtension().replay_callbacks(argparse.Namespace(fixed=False), policy)
    rep = Replay(trace, PrefixCache(capacity, policy), None, window_requests=window, callbacks=callbacks)
    rep.run()
    return summarize(rep.windows)["token_hit_rate"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default=",".join(TRACES), help="embedded trace names (comma list)")
    p.add_argument("--capacities", default="0.05,0.1,0.2", help="fractions of the distinct blocks (comma list)")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies (comma list; lru and belady needed)")
    p.add_argument("--window", type=int, default=200, help="requests per window, as replay's default")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in policy_names()] + [x for x in ("lru", "belady") if x not in policies]
    if bad:
        print(f"error: --policies: unknown or missing {bad} (lru and belady are the ends of the gap)", file=sys.stderr)
        return 2
    try:
        fractions = [float(x) for x in args.capacities.split(",")]
    except ValueError:
        print(f"error: --capacities expects fractions such as 0.05,0.1, got {args.capacities!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = []
    print("| trace | capacity | gap (pp) | " + " | ".join(policies) + " |")
    print("|---|---|---|" + "---|" * len(policies))
    for name in [x.strip() for x in args.traces.split(",") if x.strip()]:
        trace, _ = open_trace(name, None, {}, None)
        distinct = trace.distinct_blocks()
        for f in fractions:
            capacity = resolve_capacity(f, distinct)
            rate = {pol: hit_rate(trace, pol, capacity, args.window) for pol in policies}
            share = {pol: gap_share(rate[pol], rate["lru"], rate["belady"]) for pol in policies}
            rows.append({"trace": name, "capacity": f, "capacity_blocks": capacity, "token_hit_rate": rate,
                         "gap_share": share})
            cells = [f"{100 * rate[pol]:.2f}" + ("" if share[pol] is None else f" ({round(100 * share[pol])} %)")
                     for pol in policies]
            print(f"| {name} | {f:.0%} ({capacity:,}) | {100 * (rate['belady'] - rate['lru']):.2f} | "
                  + " | ".join(cells) + " |", flush=True)
    print(f"\nToken hit rate % (share of the LRU-to-Belady gap); instant serving, window {args.window}; "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
