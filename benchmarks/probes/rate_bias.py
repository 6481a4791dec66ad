"""Probe: the continuation model's per-turn rates during a replay, against what the trace itself says, and the cure
model's estimate run offline, at the replay's points and at the trace's end. docs/saecache-real-traces.md: "Why the
learned rates run high at a trace's end" and "Why they run low before".

    python benchmarks/probes/rate_bias.py [--trace mooncake_synthetic] [--capacity 0.05] [--buckets 6]
        [--learners] [--half early|late]

Prints the trace's span and the horizons past which a quiet session counts as ended; then, at ten points of the
replay, the rates SAECache has learned (turn buckets 1, 2, ...), the share of the requests so far whose session
comes back at all in the trace (hindsight), and the share seen to come back so far; then, at the same points, the
cure model's EM over the requests so far (those seen back, and every other one pending at its idle time) under three
gap distributions: the policy's at that point, the trace's own pooled over its turns, and each bucket's own (the last
two from hindsight); then the gaps by when their request came (eighths of the trace's span); last, the EM fixed point
over every request at the trace's end, with the queue's pooled log-normal gaps and with each bucket's own.
``--learners`` replays as ``train.py replay`` does (window 200, the online learners between windows; without it:
window 256, the default parameters throughout); ``--half`` replays the early or late half of the trace's sessions
(``gap_table.py --halves``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agents.cli import AgentsExtension  # noqa: E402
from sae_env.cache import PrefixCache, resolve_capacity  # noqa: E402
from sae_env.policies import make_policy  # noqa: E402
from sae_env.policies.survival import LognormalGaps  # noqa: E402
from sae_env.replay import Replay  # noqa: E402
from sae_env.sources import open_trace  # noqa: E402
from sae_env.trace import session_halves  # noqa: E402


def em_rate(returned: np.ndarray, surv: np.ndarray, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """The cure model's continuation rate: the fixed point of its EM (as the policy's refits run it), from which
    requests came back and each other one's gap survival at its idle time."""
    a, b = prior
    p = 0.5
    for _ in range(500):
        w = p * surv / np.maximum(1.0 - p + p * surv, 1e-300)
        p = (returned.sum() + w.sum() + a) / (returned.size + a + b)
    return float(p)


def _fit(log_gaps: np.ndarray) -> LognormalGaps | None:
    return LognormalGaps(log_gaps.mean(), log_gaps.std()) if log_gaps.size > 1 and log_gaps.std() > 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="mooncake_synthetic")
    ap.add_argument("--capacity", type=float, default=0.05)
    ap.add_argument("--buckets", type=int, default=6, help="turn buckets shown (default 6)")
    ap.add_argument("--learners", action="store_true", help="window 200 and the online learners, as train.py replay")
    ap.add_argument("--half", choices=("early", "late"), help="the early or late half of the sessions")
    args = ap.parse_args(argv)
    trace, _ = open_trace(args.trace)
    if args.half:
        trace = session_halves(trace, "start")[args.half == "late"]
    policy = make_policy("saecache")
    callbacks = AgentsExtension().replay_callbacks(argparse.Namespace(fixed=False), policy) if args.learners else []
    rep = Replay(trace, PrefixCache(resolve_capacity(args.capacity, trace.distinct_blocks()), policy), None,
                 window_requests=200 if args.learners else 256, callbacks=callbacks)
    points = [(rep.next_request, w.policy["continuation"]["rates"], tuple(policy.arrivals.gaps)) for w in rep]
    model, gaps = policy.arrivals.model, policy.arrivals.gaps
    bucket, agent = np.asarray(model.turn_buckets), np.asarray(model.agent_flags)
    t, session = np.asarray(trace.t), np.asarray(trace.session)
    nxt, last = np.full(len(trace), -1), {}
    for i in range(len(trace) - 1, -1, -1):  # each request's session's next request
        s = int(session[i])
        if s >= 0:
            nxt[i] = last.get(s, -1)
            last[s] = i
    comes_back = nxt >= 0
    log_gap = np.full(len(trace), np.nan)
    log_gap[comes_back] = np.log(np.maximum(t[nxt[comes_back]] - t[comes_back], 1e-3))
    mu, s2 = gaps[0].constants()[:2]
    sigma = s2 / math.sqrt(2)
    span = float(t[-1] - t[0])
    print(f"{args.trace}{f' ({args.half} half)' if args.half else ''}: {len(trace)} requests over {span:.0f} s; "
          f"chat gaps median {math.exp(mu):.0f} s, sigma {sigma:.2f}{' (learned)' if args.learners else ''}; "
          f"horizons (chat, agent) {', '.join(f'{h:.0f} s' for h in model.horizons(gaps))}")
    k = args.buckets

    def share(mask_of: np.ndarray, upto: int) -> list[str]:
        return [f"{mask_of[:upto][bucket[:upto] == b].mean():.2f}" if (bucket[:upto] == b).any() else "-"
                for b in range(1, k + 1)]

    print("| after request | learned | comes back (hindsight) | seen back so far |\n|---|---|---|---|")
    shown = points[::max(1, len(points) // 10)]
    shown += [points[-1]] if shown[-1] is not points[-1] else []
    for end, rates, _ in shown:
        seen = comes_back & (nxt < end)
        print(f"| {end} | {' '.join(f'{r:.2f}' for r in rates[:k])} | {' '.join(share(comes_back, end))} | "
              f"{' '.join(share(seen, end))} |")

    # The cure model's EM over the requests so far, each pending one at its idle time, under three gap laws: the
    # policy's then, and two from hindsight (the trace's gaps pooled per queue; each turn bucket's own).
    pooled = [_fit(log_gap[comes_back & (agent == a)]) for a in (False, True)]
    own = {b: _fit(log_gap[comes_back & (bucket == b)]) for b in range(2, k + 1)}

    def em_at(end: int, b: int, law: list[LognormalGaps | None]) -> str:
        idx = np.flatnonzero(bucket[:end] == b)
        back = comes_back[idx] & (nxt[idx] < end)
        pend = idx[~back]
        if not idx.size or any(law[a] is None for a in np.unique(agent[pend]).tolist()):
            return "-"
        surv = np.empty(pend.size)
        for a in (False, True):
            sel = agent[pend] == a
            if sel.any():
                surv[sel] = law[a].sf_array(t[end - 1] - t[pend[sel]])
        return f"{em_rate(back, surv):.2f}"

    print(f"\nThe cure model's EM over the requests so far (turn buckets 2-{k}), with the policy's gaps at that "
          "point / the trace's own, pooled (hindsight) / each bucket's own (hindsight):")
    print("| after request | policy's gaps | pooled | own | comes back (hindsight) |\n|---|---|---|---|---|")
    for end, _, at in shown:
        cols = [" ".join(em_at(end, b, list(at)) for b in range(2, k + 1)),
                " ".join(em_at(end, b, pooled) for b in range(2, k + 1)),
                " ".join(em_at(end, b, [own[b], own[b]]) for b in range(2, k + 1))]
        print(f"| {end} | {' | '.join(cols)} | {' '.join(share(comes_back, end)[1:])} |")

    print("\nGaps by when their request came (eighths of the span): turn buckets 1 / 2 / 3, the share that comes back "
          "and the median gap of those that do:")
    print("| arrived (s) | requests | comes back | median gap (s) |\n|---|---|---|---|")
    edges = np.linspace(t[0], t[-1], 9)
    edges[-1] = np.inf
    for a, z in zip(edges[:-1], edges[1:], strict=True):
        cells = []
        for b in (1, 2, 3):
            idx = np.flatnonzero((bucket == b) & (t >= a) & (t < z))
            back = idx[comes_back[idx]]
            cells.append((str(idx.size), f"{comes_back[idx].mean():.2f}" if idx.size else "-",
                          f"{math.exp(np.median(log_gap[back])):.0f}" if back.size else "-"))
        columns = zip(*cells, strict=True)  # (requests, share, median) of buckets 1-3
        print(f"| {a - t[0]:.0f}-{min(z, t[-1]) - t[0]:.0f} | " + " | ".join(" / ".join(c) for c in columns) + " |")

    print("\nAt the trace's end, the cure model's EM over every request of each bucket (pooled gaps / the bucket's "
          "own log-normal) against the share that came back:")
    end_t = float(t[-1])
    for b in range(1, k + 1):
        idx = np.flatnonzero(bucket == b)
        if not idx.size:
            continue
        back = comes_back[idx]
        idle = end_t - t[idx[~back]]
        mine = _fit(log_gap[idx[back]])
        print(f"- bucket {b} ({idx.size} requests): EM {em_rate(back, gaps[0].sf_array(idle)):.2f} / "
              f"{em_rate(back, mine.sf_array(idle)) if mine is not None else float('nan'):.2f}, "
              f"came back {back.mean():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
