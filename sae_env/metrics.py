"""WindowStats: what one window of a replay did, its serialisation, and summaries over many windows.

Everything here is a deterministic function of the trace, the cache and the policy: no wall-clock values (those
live in :class:`sae_env.replay.Replay` as ``wall_s`` and are reported separately).

Every TTFT percentile (a window's p50 / p99, a replay's, an evaluation's 0-100 quantiles) comes from
:func:`percentile`: numpy's "linear" method, bit for bit, on values sorted once. :meth:`WindowStats.to_dict` is the
full record; :func:`window_dict` is the same without its None values, ~10x faster, for the env's per-step ``info``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from sae_env.trace import N_APP_TYPES, N_TOKEN_TYPES, AppType, TokenType

__all__ = ["OFFSET_BUCKETS", "WindowStats", "latency_summary", "offset_bucket_edges", "percentile", "summarize",
           "window_dict"]

# Block offsets are grouped in log2 buckets: [0,1), [1,2), [2,4), [4,8), ..., the last one open-ended.
OFFSET_BUCKETS = 16


def offset_bucket_edges(n: int = OFFSET_BUCKETS) -> np.ndarray:
    """Lower edges of the offset buckets: 0, 1, 2, 4, 8, ..."""
    return np.concatenate([[0], 2 ** np.arange(n - 1)]).astype(np.int64)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """``np.percentile(values, q)`` (the default "linear" method), bit for bit, from already sorted values.

    numpy's call costs ~50 us of machinery on a short list, per step; this is the same arithmetic in Python
    floats (virtual index ``(n - 1) * q / 100``, numpy's two-sided lerp). A test checks the equality.
    """
    n = len(sorted_values)
    v = (n - 1) * (q / 100)
    if v >= n - 1:
        return float(sorted_values[-1])
    i = math.floor(v)
    g = v - i
    a, b = sorted_values[i], sorted_values[i + 1]
    d = b - a
    return float(b - d * (1 - g) if g >= 0.5 else a + d * g)


@dataclass
class WindowStats:
    """Statistics of one replay window (``requests`` consecutive requests, or those in a time span)."""

    index: int  # window number, 0 = first
    start: int  # index of the window's first request in the trace (its last is start + requests - 1)
    t_start: float  # trace time of the window's first arrival
    t_end: float  # trace time of its last arrival
    requests: int
    prompt_tokens: int
    hit_tokens: int  # prompt tokens served from the cache
    prompt_blocks: int  # full prompt blocks referenced
    hit_blocks: int
    evictions: int
    bypasses: int  # blocks not inserted because nothing was evictable
    inserted: int
    refs_by_type: list[int]  # prompt block references per TokenType
    hits_by_type: list[int]
    miss_after_eviction_by_type: list[int]  # misses on keys evicted earlier (ghost hits), per TokenType
    miss_after_eviction_by_queue: dict[int, int]
    refs_by_offset: list[int]  # prompt block references per log2 offset bucket
    hits_by_offset: list[int]
    app_mix: list[int]  # requests per AppType
    occupancy: int  # cached blocks at the end of the window
    capacity: int
    occupancy_by_queue: dict[int, int]
    occupancy_by_type: list[int]
    output_miss_after_eviction: int = 0  # of the misses after eviction, those on output blocks (not prompt misses)
    ttft_ms: list[float] = field(default_factory=list, repr=False)  # first tokens produced in this window
    queue_ms: list[float] = field(default_factory=list, repr=False)
    hits_per_request: list[int] = field(default_factory=list, repr=False)  # hit blocks of each request, in order
    policy: dict[str, Any] = field(default_factory=dict)  # policy-specific statistics (queues, gaps, params)

    # -- derived ---------------------------------------------------------------------------------------------
    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def ttft_percentile(self, q: float) -> float | None:
        return percentile(sorted(self.ttft_ms), q) if self.ttft_ms else None

    @property
    def ttft_mean_ms(self) -> float | None:
        return float(np.mean(self.ttft_ms)) if self.ttft_ms else None

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_samples:
            d.pop("ttft_ms")
            d.pop("queue_ms")
            d.pop("hits_per_request")
        d["token_hit_rate"] = self.token_hit_rate
        d["block_hit_rate"] = self.block_hit_rate
        lat = latency_summary(self)
        d["ttft_mean_ms"], d["ttft_p50_ms"], d["ttft_p99_ms"] = lat[:3] if lat is not None else (None, None, None)
        d["queue_mean_ms"] = float(np.mean(self.queue_ms)) if self.queue_ms else None
        d["hit_rate_by_type"] = {TokenType(k).name: (self.hits_by_type[k] / self.refs_by_type[k]
                                                     if self.refs_by_type[k] else None) for k in range(N_TOKEN_TYPES)}
        d["app_share"] = {AppType(k).name: self.app_mix[k] / self.requests if self.requests else 0.0
                          for k in range(N_APP_TYPES)}
        return d


def summarize(windows: list[WindowStats], *, policy: str = "", block_size: int | None = None,
              timed: bool | None = None) -> dict[str, Any]:
    """Totals over a replay's windows, with the keys the CLI and the experiment runner report."""
    def total(name: str) -> int:
        return int(sum(getattr(w, name) for w in windows))

    prompt_tokens, hit_tokens = total("prompt_tokens"), total("hit_tokens")
    prompt_blocks, hit_blocks = total("prompt_blocks"), total("hit_blocks")
    ttft = np.concatenate([np.asarray(w.ttft_ms, dtype=np.float64) for w in windows]) if windows else np.zeros(0)
    queue = np.concatenate([np.asarray(w.queue_ms, dtype=np.float64) for w in windows]) if windows else np.zeros(0)
    if timed is None:
        timed = ttft.size > 0
    refs = np.sum([w.refs_by_type for w in windows], axis=0) if windows else np.zeros(N_TOKEN_TYPES)
    hits = np.sum([w.hits_by_type for w in windows], axis=0) if windows else np.zeros(N_TOKEN_TYPES)
    mae = np.sum([w.miss_after_eviction_by_type for w in windows], axis=0) if windows else np.zeros(N_TOKEN_TYPES)

    ordered = np.sort(ttft)

    def pct(q: float) -> float | None:
        return percentile(ordered, q) if timed and ttft.size else None

    return {
        "policy": policy,
        "capacity_blocks": windows[-1].capacity if windows else None,
        "block_size": block_size,
        "windows": len(windows),
        "requests": total("requests"),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "token_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "prompt_blocks": prompt_blocks,
        "hit_blocks": hit_blocks,
        "block_hit_rate": hit_blocks / prompt_blocks if prompt_blocks else 0.0,
        "evictions": total("evictions"),
        "bypasses": total("bypasses"),
        "inserted": total("inserted"),
        "miss_after_eviction": int(mae.sum()),
        "output_miss_after_eviction": total("output_miss_after_eviction"),
        "hit_rate_by_type": {TokenType(k).name: (float(hits[k] / refs[k]) if refs[k] else None)
                             for k in range(N_TOKEN_TYPES)},
        "miss_after_eviction_by_type": {TokenType(k).name: int(mae[k]) for k in range(N_TOKEN_TYPES)},
        "ttft_mean_ms": float(ttft.mean()) if timed and ttft.size else None,
        "ttft_p50_ms": pct(50),
        "ttft_p90_ms": pct(90),
        "ttft_p99_ms": pct(99),
        "queue_mean_ms": float(queue.mean()) if timed and queue.size else None,
        "duration_s": (windows[-1].t_end - windows[0].t_start) if windows else 0.0,
    }


def _copy(x: Any) -> Any:
    """A copy of nested dicts / lists of scalars (``copy.deepcopy`` costs ~10x more on the step path)."""
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


_WINDOW_FIELDS = tuple(f.name for f in fields(WindowStats) if f.name not in ("ttft_ms", "queue_ms",
                                                                                "hits_per_request"))
_TYPE_NAMES = tuple(t.name for t in TokenType)
_APP_NAMES = tuple(a.name for a in AppType)


def latency_summary(w: WindowStats) -> tuple[float, float, float, float | None] | None:
    """``(mean, p50, p99)`` TTFT and mean queueing delay (ms) of a window, as ``to_dict`` computes them; None if
    no first token came out in the window."""
    if not w.ttft_ms:
        return None
    ordered = sorted(w.ttft_ms)
    return (float(np.mean(w.ttft_ms)), percentile(ordered, 50), percentile(ordered, 99),
            float(np.mean(w.queue_ms)) if w.queue_ms else None)


def window_dict(w: WindowStats, latency: tuple | None = None) -> dict[str, Any]:
    """``w.to_dict()`` without its None values (a test checks the equality), ~10x faster than ``asdict``.

    None values are left out because gymnasium's vector envs stack info values into typed arrays. ``latency``:
    :func:`latency_summary` of ``w`` if already computed.
    """
    d = {}
    for name in _WINDOW_FIELDS:
        v = getattr(w, name)
        # Only ``policy`` nests; the other lists and dicts hold scalars, and a shallow copy is a full one.
        d[name] = _copy(v) if name == "policy" else v.copy() if isinstance(v, (list, dict)) else v
    d["token_hit_rate"] = w.token_hit_rate
    d["block_hit_rate"] = w.block_hit_rate
    lat = latency if latency is not None else latency_summary(w)
    if lat is not None:
        d["ttft_mean_ms"], d["ttft_p50_ms"], d["ttft_p99_ms"] = lat[:3]
        if lat[3] is not None:
            d["queue_mean_ms"] = lat[3]
    elif w.queue_ms:
        d["queue_mean_ms"] = float(np.mean(w.queue_ms))
    hits, refs = w.hits_by_type, w.refs_by_type
    d["hit_rate_by_type"] = {_TYPE_NAMES[k]: hits[k] / refs[k] for k in range(N_TOKEN_TYPES) if refs[k]}
    n = w.requests
    d["app_share"] = {_APP_NAMES[k]: c / n if n else 0.0 for k, c in enumerate(w.app_mix)}
    return d
