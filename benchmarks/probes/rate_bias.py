"""Probe: the continuation model's per-turn rates during a replay, against what the trace itself says, and the cure
model's estimate run offline at the trace's end. README: "Why the learned rates run high at a trace's end".

    python benchmarks/probes/rate_bias.py [--trace mooncake_synthetic] [--capacity 0.05] [--buckets 6]

Prints the trace's span and the horizons past which a quiet session counts as ended; then, at ten points of the
replay, the rates SAECache has learned (turn buckets 1, 2, ...), the share of the requests so far whose session
comes back at all in the trace (hindsight), and the share seen to come back so far; last, the EM fixed point of the
cure model over every request at the trace's end, with the queue's pooled log-normal gaps and with each bucket's own.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sae_env.cache import PrefixCache, resolve_capacity  # noqa: E402
from sae_env.policies import make_policy  # noqa: E402
from sae_env.policies.survival import LognormalGaps  # noqa: E402
from sae_env.replay import Replay  # noqa: E402
from sae_env.sources import open_trace  # noqa: E402


def em_rate(returned: np.ndarray, surv: np.ndarray, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """The cure model's continuation rate: the fixed point of its EM (as the policy's refits run it), from which
    requests came back and each other one's gap survival at its idle time."""
    a, b = prior
    p = 0.5
    for _ in range(500):
        w = p * surv / np.maximum(1.0 - p + p * surv, 1e-300)
        p = (returned.sum() + w.sum() + a) / (returned.size + a + b)
    return float(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="mooncake_synthetic")
    ap.add_argument("--capacity", type=float, default=0.05)
    ap.add_argument("--buckets", type=int, default=6, help="turn buckets shown (default 6)")
    args = ap.parse_args(argv)
    trace, _ = open_trace(args.trace)
    policy = make_policy("saecache")
    rep = Replay(trace, PrefixCache(resolve_capacity(args.capacity, trace.distinct_blocks()), policy), None,
                 window_requests=256)
    points = [(rep.next_request, w.policy["continuation"]["rates"]) for w in rep]
    model, gaps = policy.arrivals.model, policy.arrivals.gaps
    bucket = np.asarray(model.turn_buckets)
    t, session = np.asarray(trace.t), np.asarray(trace.session)
    nxt, last = np.full(len(trace), -1), {}
    for i in range(len(trace) - 1, -1, -1):  # each request's session's next request
        s = int(session[i])
        if s >= 0:
            nxt[i] = last.get(s, -1)
            last[s] = i
    comes_back = nxt >= 0
    mu, s2 = gaps[0].constants()[:2]
    sigma = s2 / math.sqrt(2)
    span = float(t[-1] - t[0])
    print(f"{args.trace}: {len(trace)} requests over {span:.0f} s; chat gaps median {math.exp(mu):.0f} s, sigma "
          f"{sigma:.2f}; horizons (chat, agent) {', '.join(f'{h:.0f} s' for h in model.horizons(gaps))}")
    k = args.buckets

    def share(mask_of: np.ndarray, upto: int) -> list[str]:
        return [f"{mask_of[:upto][bucket[:upto] == b].mean():.2f}" if (bucket[:upto] == b).any() else "-"
                for b in range(1, k + 1)]

    print("| after request | learned | comes back (hindsight) | seen back so far |\n|---|---|---|---|")
    shown = points[::max(1, len(points) // 10)]
    for end, rates in shown + ([points[-1]] if shown[-1] is not points[-1] else []):
        seen = comes_back & (nxt < end)
        print(f"| {end} | {' '.join(f'{r:.2f}' for r in rates[:k])} | {' '.join(share(comes_back, end))} | "
              f"{' '.join(share(seen, end))} |")
    print("\nAt the trace's end, the cure model's EM over every request of each bucket (pooled gaps / the bucket's "
          "own log-normal) against the share that came back:")
    end_t = float(t[-1])
    for b in range(1, k + 1):
        idx = np.flatnonzero(bucket == b)
        if not idx.size:
            continue
        back = comes_back[idx]
        idle = end_t - t[idx[~back]]
        own = np.log(np.maximum(t[nxt[idx[back]]] - t[idx[back]], 1e-3))
        pooled = em_rate(back, gaps[0].sf_array(idle))
        mine = em_rate(back, LognormalGaps(own.mean(), own.std()).sf_array(idle)) if own.size > 1 else float("nan")
        print(f"- bucket {b} ({idx.size} requests): EM {pooled:.2f} / {mine:.2f}, came back {back.mean():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
