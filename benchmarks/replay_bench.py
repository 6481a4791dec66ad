"""Replay throughput and memory: our engine against libcachesim in the same process.

1. A block-reference stream with no shared prefixes (one block per request, Zipf ids) through our ``lru`` and
   through libcachesim's LRU (same cache size in objects); both throughputs, their hit ratios (they must agree) and
   the ratio of throughputs.
2. Block references per second for every registered online policy on a prefix-sharing trace (the synthetic
   heterogeneous workload by default), instant mode.
3. Bytes of memory per cached block (tracemalloc over filling an LRU cache).

The last line is ``lru_vs_libcachesim=<ratio>``. Machines here are noisy: compare ratios, not absolute figures.

    python benchmarks/replay_bench.py [--requests 1000000] [--objects 1000000] [--cache 0.1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from sae_env.cache import PrefixCache
from sae_env.policies import make_policy, policy_class, policy_names
from sae_env.replay import Replay
from sae_env.sources import load_source
from sae_env.trace import Trace

NEVER = np.iinfo(np.int64).max


def zipf_stream(n: int, objects: int, alpha: float, seed: int) -> np.ndarray:
    """``n`` draws of object ids 1..objects with P(rank k) proportional to k**-alpha (any alpha >= 0)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, objects + 1, dtype=np.float64) ** -alpha)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    return rng.permutation(objects)[np.minimum(ranks, objects - 1)].astype(np.int64) + 1


def single_block_trace(ids: np.ndarray, block_size: int = 16) -> Trace:
    n = ids.size
    return Trace(t=np.arange(n, dtype=np.float64), session=np.full(n, -1), turn=np.ones(n), app=np.zeros(n),
                 prompt_tokens=np.full(n, block_size), output_tokens=np.zeros(n), prompt_offsets=np.arange(n + 1),
                 prompt_keys=ids, prompt_types=np.zeros(n), block_size=block_size)


def next_access(ids: np.ndarray) -> np.ndarray:
    """Virtual time of each request's next access to the same object (INT64_MAX if none): a stable sort."""
    order = np.argsort(ids, kind="stable")
    nxt = np.full(ids.size, NEVER, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def libcachesim_lru(ids: np.ndarray, capacity: int, tmp: Path) -> tuple[float, int]:
    import libcachesim as lcs

    rec = np.zeros(ids.size, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
    rec["t"] = np.arange(ids.size)
    rec["id"] = ids
    rec["size"] = 1
    rec["next"] = next_access(ids)
    path = tmp / "stream.oracleGeneral"
    rec.tofile(path)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = lcs.LRU(capacity, hashpower=20)
    t0 = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    dt = time.perf_counter() - t0
    return dt, int(round((1 - miss_ratio) * ids.size))


def ours(trace: Trace, policy: str, capacity: int) -> tuple[float, int]:
    rep = Replay(trace, PrefixCache(capacity, make_policy(policy)), window_requests=50_000)
    t0 = time.perf_counter()
    rep.run()
    return time.perf_counter() - t0, sum(w.hit_blocks for w in rep.windows)


def bytes_per_block(capacity: int) -> float:
    """Memory held by an LRU cache filled to ``capacity`` blocks of 4-block prompts (ghosts full too)."""
    rng = np.random.default_rng(1)
    n_req = 3 * capacity // 4
    keys = rng.integers(1, 2**62, size=4 * n_req).tolist()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = PrefixCache(capacity, make_policy("lru"))
    for r in range(n_req):  # 3x capacity blocks: the cache fills, then evicts into a full ghost record
        cache.serve(keys[4 * r:4 * r + 4], [0, 0, 0, 2], (), (), float(r))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del keys
    return used / len(cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--cache", type=float, default=0.1, help="cache size as a fraction of the objects")
    ap.add_argument("--prefix-trace", default="synthetic", help="source for part 2 (default: synthetic preset)")
    args = ap.parse_args()

    ids = zipf_stream(args.requests, args.objects, args.alpha, seed=0)
    capacity = max(1, int(args.cache * args.objects))
    with tempfile.TemporaryDirectory() as tmp:
        dt_ref, hits_ref = libcachesim_lru(ids, capacity, Path(tmp))
    dt, hits = ours(single_block_trace(ids), "lru", capacity)
    print(f"no shared prefixes: {ids.size:,} requests, {args.objects:,} objects, cache {capacity:,} blocks")
    print(f"  libcachesim LRU  {ids.size / dt_ref / 1e6:8.3f} M refs/s   hits {hits_ref:,}")
    print(f"  our lru          {ids.size / dt / 1e6:8.3f} M refs/s   hits {hits:,}   "
          f"{'(hits agree)' if abs(hits - hits_ref) <= 1 else '(HITS DIFFER)'}")

    trace, _ = load_source("synthetic", None, preset="heterogeneous")
    refs = trace.n_blocks
    cap = max(1, int(0.15 * trace.distinct_blocks()))
    print(f"prefix-sharing trace (synthetic heterogeneous): {len(trace):,} requests, {refs:,} block refs, "
          f"cache {cap:,} blocks")
    for name in policy_names():
        cls = policy_class(name)
        if getattr(cls, "needs_predictor", False):
            continue
        t, h = ours(trace, name, cap)
        tag = " (oracle)" if cls.oracle else ""
        print(f"  {name:10s} {refs / t / 1e6:8.3f} M block refs/s   block hit rate {h / refs:.4f}{tag}")

    print(f"memory: {bytes_per_block(200_000):.0f} bytes per cached block (LRU, ghost record full)")
    print(f"lru_vs_libcachesim={(ids.size / dt) / (ids.size / dt_ref):.3f}")


if __name__ == "__main__":
    main()
