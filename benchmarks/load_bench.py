"""Loading and generation throughput: blocks per second for every source, and a million-block Mooncake file.

Prints one line per case; the last lines compare loading a ~1 M-block Mooncake-format file with reading the same
file as plain JSON lines (the reference run in the same process, since these machines are noisy).

    python benchmarks/load_bench.py [--blocks 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from sae_env import data
from sae_env.sources import load_source


def timed(fn, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def write_mooncake(path: Path, n_blocks: int, seed: int = 0) -> int:
    """A Mooncake-format file with ~n_blocks block ids: chat-like sessions that extend their own prefixes."""
    rng = np.random.default_rng(seed)
    rows, total, next_id, t = [], 0, 10_000, 0
    sessions: list[list[int]] = []
    while total < n_blocks:
        if sessions and rng.random() < 0.6:
            s = sessions[rng.integers(len(sessions))]
            grow = int(rng.integers(1, 6))
            s.extend(range(next_id, next_id + grow))
            next_id += grow
            ids = list(s)
        else:
            n = int(rng.integers(2, 30))
            ids = [int(rng.integers(0, 8))] + list(range(next_id, next_id + n - 1))
            next_id += n
            sessions.append(ids)
        t += int(rng.integers(0, 300))
        rows.append(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 100,
                                "hash_ids": ids}))
        total += len(ids)
    path.write_text("\n".join(rows) + "\n")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    print(f"{'case':34s} {'requests':>9s} {'blocks':>10s} {'seconds':>8s} {'blocks/s':>12s}")
    cases = [(name, path, src, {"tools": str(data.TAUBENCH_TOOLS)} if name == "taubench" else {})
             for name, (path, src) in data.ALL.items()]
    for name, path, src, opts in cases:
        dt, (trace, _) = timed(lambda p=path, s=src, o=opts: load_source(s, p, **o), args.repeat)
        blocks = trace.n_blocks + trace.n_output_blocks
        print(f"load {name:29s} {len(trace):9d} {blocks:10d} {dt:8.3f} {blocks / dt:12,.0f}")
    for preset in ("heterogeneous", "shift"):
        dt, (trace, _) = timed(lambda p=preset: load_source("synthetic", None, preset=p), args.repeat)
        blocks = trace.n_blocks + trace.n_output_blocks
        print(f"generate synthetic:{preset:15s} {len(trace):9d} {blocks:10d} {dt:8.3f} {blocks / dt:12,.0f}")

    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "mooncake_big.jsonl"
        n = write_mooncake(big, args.blocks)
        dt_ref, _ = timed(lambda: [json.loads(line) for line in big.open()], args.repeat)
        dt, (trace, _) = timed(lambda: load_source("mooncake", big), args.repeat)
        print(f"load mooncake ~{n / 1e6:.1f}M-block file     {len(trace):9d} {n:10d} {dt:8.3f} {n / dt:12,.0f}")
        print(f"json.loads of the same lines (reference)          {dt_ref:8.3f} s")
        npz = Path(tmp) / "big.npz"
        trace.save(npz)
        from sae_env.trace import Trace

        dt_npz, _ = timed(lambda: Trace.load(npz), args.repeat)
        print(f"load the same trace from .npz                     {dt_npz:8.3f} {n / dt_npz:12,.0f}")
        print(f"mooncake_load_vs_json_parse={dt / dt_ref:.2f}")

        # One request of many blocks against the same blocks cut into requests of 100: chaining must stay linear in
        # the blocks of a request (it once spent 63 s on one 1 M-block request).
        from sae_env.trace import MAX_TOKENS, chain_keys

        ids = np.random.default_rng(1).integers(0, 2**63, size=args.blocks).astype(np.uint64)
        dt_rows, _ = timed(lambda: chain_keys(ids, np.arange(0, ids.size + 1, 100)), args.repeat)
        dt_one, _ = timed(lambda: chain_keys(ids, np.array([0, ids.size])), args.repeat)
        print(f"chain_keys {ids.size:,} blocks in rows of 100              {dt_rows:8.3f} {ids.size / dt_rows:12,.0f}")
        print(f"chain_keys the same blocks as one request          {dt_one:8.3f} {ids.size / dt_one:12,.0f}")
        print(f"chain_one_request_vs_rows={dt_one / dt_rows:.2f}")
        one = Path(tmp) / "mooncake_one.jsonl"
        n_one = MAX_TOKENS // 512  # the longest request the loader accepts
        one.write_text(json.dumps({"timestamp": 0, "input_length": 512 * n_one, "output_length": 1,
                                   "hash_ids": list(range(n_one))}) + "\n")
        dt_big, _ = timed(lambda: load_source("mooncake", one), args.repeat)
        print(f"load one mooncake request of {n_one:,} blocks        {dt_big:8.3f} {n_one / dt_big:12,.0f}")


if __name__ == "__main__":
    main()
