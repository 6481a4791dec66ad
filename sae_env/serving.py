"""Serving model: prefill cost (roofline or calibration table), a FIFO chunked-prefill server, TTFT, load factor.

Everything runs on the trace clock (seconds): nothing reads the wall clock, so a replay is deterministic.

**Roofline cost** (:class:`RooflineCost`). A forward pass over a batch of prefill *chunks* ``(k, ctx)`` (``k`` new
tokens that follow ``ctx`` tokens whose KV is already in GPU memory, cached or prefilled by an earlier chunk) costs

    flops = 2 * N_lin * sum(k)  +  4 * L * A * sum(k * ctx + k * (k + 1) / 2)
    bytes = P * dtype_bytes     +  kv_bytes_per_token * sum(ctx + k)
    time  = max(flops / (peak_flops * eff), bytes / (mem_bandwidth * eff))

- *Linear layers*: a multiply-add per weight per token, 2 FLOPs. ``N_lin`` is the **non-embedding** parameter
  count: the input embedding is a gather (no FLOPs), and the LM head (tied to the embedding in Qwen2.5-1.5B) runs on
  the last position of a sequence only, to sample its first token; its ``2 * vocab * hidden`` = 0.47 GFLOP per
  request is ignored (0.02 % of a 1,000-token prefill).
- *Attention*: per layer, a query attending to ``m`` keys costs ``2 * A * m`` for the scores ``QK^T`` and
  ``2 * A * m`` for ``softmax(.) V``, ``A = heads * head_dim`` (= hidden for Qwen2.5). Grouped KV heads share K/V
  storage, not FLOPs. Causal masking: the i-th new token (0-based) of a chunk sees ``m = ctx + i + 1`` keys, itself
  included, so a chunk has ``k * ctx + k (k + 1) / 2`` (query, key) pairs, i.e. ``~ 4 L hidden k (ctx + k / 2)``
  FLOPs. Flash-attention kernels skip fully masked tiles, so the causal half, not ``k^2``, is what runs.
- *Bytes*: every weight is read once per forward pass (once per *iteration*, shared by all chunks of the batch;
  the tied embedding matrix is read as the LM head), the KV of the ``ctx`` context tokens is read and that of the
  ``k`` new tokens written. Activations are ignored: they matter only for large chunks, which are compute-bound.
- *Roofline max*: compute and memory traffic are assumed to overlap perfectly, so the slower of the two bounds the
  pass (a sum would double-count overlapped work). One efficiency factor (default 0.5) scales both peaks.

Hand check (a test): 1,000 uncached tokens of Qwen2.5-1.5B on an A40 at 50 %: ``2 * 1,310,340,608 * 1000 +
4 * 28 * 1536 * 500,500 = 2.7068e12`` FLOP at ``74.85e12`` FLOP/s = **36.16 ms** (compute-bound; the weights,
3.09 GB at 348 GB/s, take 8.9 ms). Counting all 1.54 B parameters (embedding included) would give 42.4 ms, so the
paper's "~36 ms" is the non-embedding count, which is also the faithful one. Compute and memory cross at ~250
prompt tokens on the A40: shorter prefills cost the weight read, ~8.9 ms, whatever their length.

A longer cached prefix never makes a prompt of fixed total length slower: ``sum(ctx + k)`` is the prompt length
(constant) and the attention pairs ``m P - m^2 / 2 + m / 2`` grow with the new-token count ``m <= P``.

**Decode** (:meth:`RooflineCost.decode_time`): the first output token comes out of the last prefill pass (vLLM
samples it from the prefill logits), so a request of ``N`` output tokens needs ``N - 1`` decode steps; step ``s``
(1-based) attends to ``P + s`` keys (prompt ``P`` plus ``s`` generated tokens). Per step, for a batch of ``b``
requests of the same length, ``flops = b * (2 * (N_lin + N_head) + 4 L A (P + s))`` and ``bytes = weights +
b * kv_bytes_per_token * (P + s)``, time is the roofline max; the sum over steps is evaluated in closed form
(both bounds are linear in ``s``, so they cross at most once). It tells the replay how long a request pins its
blocks after its first token. Batch 1 (the default) is memory-bound: ~8.9 ms per token on the A40 preset.

**Calibration table** (:class:`CalibrationTable`): measured prefill times at ``new_tokens`` points (1-D, linear
interpolation) or on a full ``new_tokens x cached_tokens`` grid (bilinear). Validation: every time positive and
finite, non-decreasing in new tokens (for each cached value), no duplicate point, a full grid; a ValueError names
the offending row. Outside the table: below the smallest ``new_tokens`` the first time (a short prefill costs the
weight read, not less), above the largest the last segment's slope continues; the cached axis is clamped to its
range (extrapolating it could break monotonicity in new tokens). ``new_tokens == 0`` costs 0. A batch of chunks
costs the table's time at ``(sum k, sum(k * ctx) / sum k)``: a batched prefill of ``K`` tokens is one ``K``-token
forward pass (weights once), and its attention work grows with the token-weighted mean context. Files: CSV with a
header (``new_tokens``, optional ``cached_tokens``, ``time_s`` or ``time_ms``; ``#`` comment lines), JSON or YAML
(a list of such rows, or ``{"points": [...], "decode_step_s": x}``); ``.gz`` is opened transparently. Decode
times come from ``decode_step_s`` (seconds per decode step) or from a roofline handed over as ``decode_model``.

**Server** (:class:`PrefillServer`): vLLM-style FIFO scheduling with chunked prefill. Iteration ``i`` starts at
``s = max(end of iteration i-1, arrival of the queue head)`` and takes, in arrival order, the requests that have
arrived by ``s`` (arrival ``<= s``), up to ``token_budget`` new tokens and ``max_num_seqs`` requests; only the last
request of a batch may be cut (chunked), and its rest heads the next iteration. The iteration lasts the cost
model's ``batch_time`` of its chunks (for the roofline: the batch's FLOPs and bytes with the weights read once).
Defaults: ``token_budget = 8192`` (vLLM V1's ``max_num_batched_tokens`` for the offline ``LLM`` class on an A40, and
for ``vllm serve`` on >= 70 GiB GPUs such as the H200; ``vllm serve`` on an A40 defaults to 2048, pass that to
mimic it) and ``max_num_seqs = 256`` (vLLM's default below 70 GiB). Decode tokens of running requests are not
modelled (they would take one budget slot each): this is a prefill server, and TTFT is prefill-dominated.
A request with 0 new tokens (a full cache hit) is prefilled as 1 token after ``cached - 1``: vLLM always recomputes
the last prompt token to get its logits.

- ``t_first_token`` = end of the iteration holding the request's last chunk (no extra decode step: the first token
  is sampled from that pass); ``TTFT = t_first_token - arrival``; ``queue_delay`` = start of the first iteration
  holding one of its chunks ``- arrival``.
- **FIFO guarantee**: in submission (= arrival) order, first-chunk starts and first-token times are both
  non-decreasing. Two requests finish in the same iteration or the earlier-arrived one finishes first; at most one
  request is partly prefilled at any time.
- Event API for the replay: ``submit`` requests in non-decreasing arrival order; ``advance_to(t)`` forms every
  iteration that starts strictly before ``t`` (a request arriving at ``t`` could still join an iteration that
  starts at ``t``) and returns, in time order, the completions with ``t_first_token <= t``; formed completions
  past ``t`` are returned by a later call. ``drain()`` runs everything queued and returns all completions.
  An arrival earlier than the last ``advance_to`` time is a ValueError (it would rewrite formed iterations).

**Instant server** (:class:`InstantServer`, mode "instant"): no time passes; each request completes at its
arrival with ``queue_delay = NaN``, ``timed = False`` and ``simulate`` returns NaN TTFTs: a replay reports no TTFT.

**Load factor**: ``utilisation = sum(service_times) / (max(arrivals) - min(arrivals))``; with service times of
each request prefilled alone, this is the fraction of the trace span the GPU would be busy without batching.
``scale_to_utilisation`` rescales every arrival's distance to the first arrival by one factor so that the span
becomes ``sum(service_times) / target`` (order and relative gaps kept). Batching shares the weight read, so
short-prompt workloads saturate above 1.0; long prompts (compute-bound) saturate near 1.0.
"""

from __future__ import annotations

import bisect
import csv
import math
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from sae_env.files import parse_document

__all__ = [
    "GPUS",
    "MODELS",
    "PRESETS",
    "CalibrationTable",
    "Completion",
    "CostModel",
    "GPUSpec",
    "InstantServer",
    "ModelSpec",
    "PrefillServer",
    "RooflineCost",
    "make_server",
    "scale_to_utilisation",
    "simulate",
    "utilisation",
]

DEFAULT_TOKEN_BUDGET = 8192
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_EFFICIENCY = 0.5


# ----------------------------------------------------------------------------------------------------------------
# Hardware and model descriptions


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as its prefill / decode cost is concerned."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    params: int  # all parameters (every one is read once per forward pass)
    embedding_params: int  # input embedding table (a gather: no FLOPs per prompt token)
    kv_bytes_per_token: int  # K and V of every layer: 2 * layers * kv_heads * head_dim * dtype_bytes
    dtype_bytes: int = 2
    head_dim: int | None = None  # default hidden // heads
    lm_head_params: int | None = None  # default embedding_params (tied embeddings)

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "params", "kv_bytes_per_token", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelSpec '{self.name}': field '{f}' must be a positive integer, got {v!r}")
        if not isinstance(self.embedding_params, int) or not 0 <= self.embedding_params < self.params:
            raise ValueError(f"ModelSpec '{self.name}': field 'embedding_params' must be in [0, params), "
                             f"got {self.embedding_params!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise ValueError(f"ModelSpec '{self.name}': field 'head_dim' must be a positive integer")
        if self.lm_head_params is not None and (not isinstance(self.lm_head_params, int) or self.lm_head_params < 0):
            raise ValueError(f"ModelSpec '{self.name}': field 'lm_head_params' must be a non-negative integer")

    @property
    def attn_dim(self) -> int:
        """Width of the attention computation: heads * head_dim."""
        return self.heads * (self.head_dim if self.head_dim is not None else self.hidden // self.heads)

    @property
    def linear_params(self) -> int:
        """Parameters multiplied by every prompt token: all but the input embedding."""
        return self.params - self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class GPUSpec:
    """Dense peak throughput at the model's dtype and memory bandwidth."""

    name: str
    peak_flops: float  # FLOP/s, dense (no structured sparsity)
    mem_bandwidth: float  # bytes/s

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bandwidth"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"GPUSpec '{self.name}': field '{f}' must be a positive finite number, got {v!r}")


# Qwen2.5-1.5B(-Instruct), config.json: 28 layers, hidden 1536, 12 heads of 128, 2 KV heads, intermediate 8960,
# vocab 151,936, tied embeddings, bf16. Per layer 46,797,824 parameters (q/k/v with biases, o, gate/up/down, two
# RMSNorms); 28 layers + final norm = 1,310,340,608 non-embedding; + 151,936 * 1536 embedding = 1,543,714,304.
# KV per token: 2 * 28 * 2 * 128 * 2 B = 28,672 B = 28 KiB.
MODELS: dict[str, ModelSpec] = {
    "qwen2.5-1.5b": ModelSpec(name="qwen2.5-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2,
                              params=1_543_714_304, embedding_params=151_936 * 1536,
                              kv_bytes_per_token=2 * 28 * 2 * 128 * 2, dtype_bytes=2),
}

# NVIDIA data sheets, BF16 tensor-core dense (the sparse figures are twice these).
GPUS: dict[str, GPUSpec] = {
    "a40": GPUSpec(name="a40", peak_flops=149.7e12, mem_bandwidth=696e9),
    "h200": GPUSpec(name="h200", peak_flops=989.4e12, mem_bandwidth=4.8e12),
}

PRESETS: dict[str, tuple[str, str]] = {
    "qwen2.5-1.5b@a40": ("qwen2.5-1.5b", "a40"),  # the paper's set-up
    "qwen2.5-1.5b@h200": ("qwen2.5-1.5b", "h200"),
}


# ----------------------------------------------------------------------------------------------------------------
# Cost models


class CostModel(Protocol):
    """What the server needs from a cost model."""

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def prefill_times(self, new_tokens: Any, cached_tokens: Any = 0) -> np.ndarray: ...

    def batch_time(self, chunks: Sequence[tuple[int, int]]) -> float: ...

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float: ...


def _check_tokens(new_tokens: int, cached_tokens: int) -> None:
    if new_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"token counts must be non-negative, got new_tokens={new_tokens}, "
                         f"cached_tokens={cached_tokens}")


def _tokens_array(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    return a


def _sum_max_linear(a1: float, b1: float, a2: float, b2: float, lo: int, hi: int) -> float:
    """sum over integers s in [lo, hi] of max(a1 + b1 s, a2 + b2 s), in O(1)."""
    if hi < lo:
        return 0.0

    def lin(a: float, b: float, x: int, y: int) -> float:
        if y < x:
            return 0.0
        cnt = y - x + 1
        return a * cnt + b * (x + y) * cnt / 2.0

    db = b1 - b2
    da = a1 - a2
    if db == 0.0:
        return lin(a1, b1, lo, hi) if da >= 0 else lin(a2, b2, lo, hi)
    root = -da / db  # where the two lines cross
    if db > 0:  # line 1 wins from the root on
        m = min(max(math.ceil(root), lo), hi + 1)
        return lin(a2, b2, lo, m - 1) + lin(a1, b1, m, hi)
    m = min(max(math.floor(root) + 1, lo), hi + 1)  # line 1 wins up to the root
    return lin(a1, b1, lo, m - 1) + lin(a2, b2, m, hi)


class RooflineCost:
    """Prefill / decode time of ``model`` on ``gpu`` from the roofline (see the module docstring)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, efficiency: float = DEFAULT_EFFICIENCY):
        if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
        self.model, self.gpu, self.efficiency = model, gpu, float(efficiency)
        self._flop_rate = gpu.peak_flops * efficiency
        self._byte_rate = gpu.mem_bandwidth * efficiency
        self._lin = 2.0 * model.linear_params  # FLOPs per new token in the linear layers
        self._pair = 4.0 * model.layers * model.attn_dim  # FLOPs per (query, key) pair, all layers
        self._w = float(model.weight_bytes)
        self._kv = float(model.kv_bytes_per_token)
        lm_head = model.lm_head_params if model.lm_head_params is not None else model.embedding_params
        self._dec = 2.0 * (model.linear_params + lm_head)  # FLOPs per generated token, excluding attention

    @property
    def name(self) -> str:
        return f"{self.model.name}@{self.gpu.name}"

    def __repr__(self) -> str:
        return f"RooflineCost({self.name}, efficiency={self.efficiency})"

    def flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """FLOPs of prefilling ``new_tokens`` after ``cached_tokens`` (one request alone)."""
        n, c = new_tokens, cached_tokens
        return self._lin * n + self._pair * (n * c + n * (n + 1) // 2)

    def bytes_moved(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Bytes read or written by that prefill: weights + KV of the context + KV of the new tokens."""
        return self._w + self._kv * (new_tokens + cached_tokens)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` cached ones, as one pass; 0 when nothing is new."""
        if new_tokens <= 0 or cached_tokens < 0:
            _check_tokens(new_tokens, cached_tokens)
            return 0.0
        n, c = new_tokens, cached_tokens
        f = self._lin * n + self._pair * (n * c + n * (n + 1) // 2)
        b = self._w + self._kv * (n + c)
        return max(f / self._flop_rate, b / self._byte_rate)

    def prefill_times(self, new_tokens: Any, cached_tokens: Any = 0) -> np.ndarray:
        """Vectorised :meth:`prefill_time` (float64 array)."""
        n = _tokens_array(new_tokens, "new_tokens")
        c = _tokens_array(cached_tokens, "cached_tokens")
        f = self._lin * n + self._pair * (n * c + n * (n + 1) / 2)
        b = self._w + self._kv * (n + c)
        return np.where(n > 0, np.maximum(f / self._flop_rate, b / self._byte_rate), 0.0)

    def batch_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of one forward pass over chunks ``(new, context)``: weights once, FLOPs and KV bytes summed."""
        n_sum = 0
        pairs = 0
        kv = 0
        for k, ctx in chunks:
            n_sum += k
            pairs += k * ctx + k * (k + 1) // 2
            kv += ctx + k
        if n_sum <= 0:
            return 0.0
        f = self._lin * n_sum + self._pair * pairs
        b = self._w + self._kv * kv
        return max(f / self._flop_rate, b / self._byte_rate)

    def decode_step_time(self, context_tokens: int, batch: int = 1) -> float:
        """Seconds of one decode step of ``batch`` requests whose new token attends to ``context_tokens`` keys."""
        f = batch * (self._dec + self._pair * context_tokens)
        b = self._w + batch * self._kv * context_tokens
        return max(f / self._flop_rate, b / self._byte_rate)

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        """Seconds from the first output token to the last: ``output_tokens - 1`` memory-bound decode steps.

        ``context_tokens`` is the prompt length; step ``s`` attends to ``context_tokens + s`` keys. ``batch``
        requests of the same shape share each step's weight read.
        """
        if output_tokens < 0 or context_tokens < 0 or batch < 1:
            raise ValueError(f"decode_time needs output_tokens >= 0, context_tokens >= 0, batch >= 1; got "
                             f"{output_tokens}, {context_tokens}, {batch}")
        if output_tokens <= 1:
            return 0.0
        p = context_tokens
        # compute bound: (batch * (dec + pair * (p + s))) / F ; memory bound: (w + batch * kv * (p + s)) / B
        a1 = batch * (self._dec + self._pair * p) / self._flop_rate
        b1 = batch * self._pair / self._flop_rate
        a2 = (self._w + batch * self._kv * p) / self._byte_rate
        b2 = batch * self._kv / self._byte_rate
        return _sum_max_linear(a1, b1, a2, b2, 1, output_tokens - 1)


class CalibrationTable:
    """Measured prefill times, interpolated (see the module docstring for the rules and file formats).

    ``new_tokens``, ``times_s`` and optional ``cached_tokens`` are parallel sequences of points. ``rows`` names
    each point in error messages (defaults to ``"point i"``); ``source`` prefixes them (e.g. the file name).
    """

    def __init__(self, new_tokens: Sequence[float], times_s: Sequence[float],
                 cached_tokens: Sequence[float] | None = None, *, decode_step_s: float | None = None,
                 decode_model: CostModel | None = None, rows: Sequence[str] | None = None,
                 source: str = "calibration table"):
        n_pts = len(new_tokens)
        if len(times_s) != n_pts or (cached_tokens is not None and len(cached_tokens) != n_pts):
            raise ValueError(f"{source}: new_tokens, times and cached_tokens must have the same length")
        rows = list(rows) if rows is not None else [f"point {i}" for i in range(n_pts)]
        self.source = source
        self.two_d = cached_tokens is not None
        pts: dict[tuple[float, float], tuple[float, str]] = {}
        for i in range(n_pts):
            where = f"{source}: {rows[i]}"
            n = _finite(new_tokens[i], where, "new_tokens")
            c = _finite(cached_tokens[i], where, "cached_tokens") if self.two_d else 0.0
            t = _finite(times_s[i], where, "time")
            if n <= 0 or c < 0:
                raise ValueError(f"{where}: new_tokens must be > 0 and cached_tokens >= 0, got {n}, {c}")
            if t <= 0:
                raise ValueError(f"{where}: time must be positive, got {t}")
            if (n, c) in pts:
                raise ValueError(f"{where}: duplicate point new_tokens={n:g}, cached_tokens={c:g} "
                                 f"(also {pts[(n, c)][1]})")
            pts[(n, c)] = (t, rows[i])
        self._xs = sorted({n for n, _ in pts})
        self._cs = sorted({c for _, c in pts})
        if len(self._xs) < 2:
            raise ValueError(f"{source}: need at least two distinct new_tokens values, got {len(self._xs)}")
        self._rows: list[list[float]] = []  # one list of times per cached value, over self._xs
        for c in self._cs:
            row = []
            for n in self._xs:
                if (n, c) not in pts:
                    raise ValueError(f"{source}: the points must form a full grid; missing new_tokens={n:g} at "
                                     f"cached_tokens={c:g}")
                t, name = pts[(n, c)]
                if row and t < row[-1]:
                    raise ValueError(f"{source}: {name}: time {t:g} s at new_tokens={n:g}"
                                     f"{f', cached_tokens={c:g}' if self.two_d else ''} is below {row[-1]:g} s at "
                                     f"a smaller new_tokens: times must be non-decreasing in new tokens")
                row.append(t)
            self._rows.append(row)
        # slope of the last segment of each row, continued above the largest new_tokens
        self._tail = [(r[-1] - r[-2]) / (self._xs[-1] - self._xs[-2]) for r in self._rows]
        if decode_step_s is not None:
            decode_step_s = _finite(decode_step_s, source, "decode_step_s")
            if decode_step_s <= 0:
                raise ValueError(f"{source}: decode_step_s must be positive, got {decode_step_s}")
        self.decode_step_s = decode_step_s
        self.decode_model = decode_model

    def __repr__(self) -> str:
        return (f"CalibrationTable({self.source!r}, {len(self._xs)} new_tokens x {len(self._cs)} cached_tokens "
                f"points)")

    # -- interpolation ----------------------------------------------------------------------------------------

    def _row_at(self, j: int, n: float) -> float:
        xs, row = self._xs, self._rows[j]
        if n <= xs[0]:
            return row[0]
        if n >= xs[-1]:
            return row[-1] + self._tail[j] * (n - xs[-1])
        i = bisect.bisect_right(xs, n)  # xs[i-1] <= n < xs[i]
        x0 = xs[i - 1]
        return row[i - 1] + (row[i] - row[i - 1]) * (n - x0) / (xs[i] - x0)

    def prefill_time(self, new_tokens: float, cached_tokens: float = 0) -> float:
        if new_tokens <= 0 or cached_tokens < 0:
            _check_tokens(new_tokens, cached_tokens)
            return 0.0
        cs = self._cs
        if len(cs) == 1 or cached_tokens <= cs[0]:
            return self._row_at(0, new_tokens)
        if cached_tokens >= cs[-1]:
            return self._row_at(len(cs) - 1, new_tokens)
        j = bisect.bisect_right(cs, cached_tokens)
        w = (cached_tokens - cs[j - 1]) / (cs[j] - cs[j - 1])
        return (1.0 - w) * self._row_at(j - 1, new_tokens) + w * self._row_at(j, new_tokens)

    def prefill_times(self, new_tokens: Any, cached_tokens: Any = 0) -> np.ndarray:
        n, c = np.broadcast_arrays(_tokens_array(new_tokens, "new_tokens"),
                                   _tokens_array(cached_tokens, "cached_tokens"))
        xs = np.asarray(self._xs)
        rows = []
        for j, r in enumerate(self._rows):
            v = np.interp(n, xs, r)  # clamps at both ends
            rows.append(np.where(n > xs[-1], r[-1] + self._tail[j] * (n - xs[-1]), v))
        if len(self._cs) == 1:
            out = rows[0]
        else:
            cs = np.asarray(self._cs)
            cc = np.clip(c, cs[0], cs[-1])
            j = np.clip(np.searchsorted(cs, cc, side="right"), 1, len(cs) - 1)
            w = (cc - cs[j - 1]) / (cs[j] - cs[j - 1])
            stack = np.stack(rows)
            idx = np.arange(n.size).reshape(n.shape)
            out = (1.0 - w) * stack[j - 1, idx] + w * stack[j, idx]
        return np.where(n > 0, out, 0.0)

    def batch_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        n_sum = 0
        nc = 0
        for k, ctx in chunks:
            n_sum += k
            nc += k * ctx
        if n_sum <= 0:
            return 0.0
        return self.prefill_time(n_sum, nc / n_sum)

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        if self.decode_step_s is not None:
            if output_tokens < 0 or context_tokens < 0 or batch < 1:
                raise ValueError("decode_time needs output_tokens >= 0, context_tokens >= 0, batch >= 1")
            return max(output_tokens - 1, 0) * self.decode_step_s
        if self.decode_model is not None:
            return self.decode_model.decode_time(output_tokens, context_tokens, batch)
        raise ValueError(f"{self.source}: no decode timing: give 'decode_step_s' in the table or a preset "
                         f"(make_server({{'calibration': ..., 'preset': ...}})) for decode times")

    # -- loading ----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, decode_model: CostModel | None = None) -> CalibrationTable:
        """Read a table from ``.csv``, ``.json`` or ``.yaml`` / ``.yml`` (each optionally ``.gz``)."""
        from sae_env.sources._io import open_text  # local: keeps serving importable without the sources package

        path = Path(path)
        suffixes = [s.lower() for s in path.suffixes]
        if suffixes and suffixes[-1] == ".gz":
            suffixes = suffixes[:-1]
        kind = suffixes[-1] if suffixes else ""
        if kind not in (".csv", ".json", ".yaml", ".yml"):
            raise ValueError(f"{path}: unknown calibration format '{kind}'; use .csv, .json, .yaml or .yml")
        with open_text(path) as f:
            if kind == ".csv":
                return cls._from_csv(f, str(path), decode_model)
            doc = parse_document(f.read(), kind, str(path))
        return cls._from_doc(doc, str(path), decode_model)

    _COLUMNS = ("new_tokens", "cached_tokens", "time_s", "time_ms")

    @classmethod
    def _from_rows(cls, rows: list[tuple[str, dict[str, Any]]], source: str, decode_step_s: Any,
                   decode_model: CostModel | None) -> CalibrationTable:
        if not rows:
            raise ValueError(f"{source}: no calibration points")
        keys0 = set(rows[0][1])
        two_d = "cached_tokens" in keys0
        news, cached, times, names = [], [], [], []
        for name, row in rows:
            unknown = sorted(set(row) - set(cls._COLUMNS))
            if unknown:
                raise ValueError(f"{source}: {name}: unknown field(s) {unknown}; valid: {list(cls._COLUMNS)}")
            if ("cached_tokens" in row) != two_d:
                raise ValueError(f"{source}: {name}: 'cached_tokens' must be given on every row or on none")
            if "new_tokens" not in row:
                raise ValueError(f"{source}: {name}: field 'new_tokens' missing")
            if ("time_s" in row) == ("time_ms" in row):
                raise ValueError(f"{source}: {name}: give exactly one of 'time_s' and 'time_ms'")
            t = _number(row.get("time_s", row.get("time_ms")), f"{source}: {name}",
                        "time_s" if "time_s" in row else "time_ms")
            times.append(t if "time_s" in row else t / 1e3)
            news.append(_number(row["new_tokens"], f"{source}: {name}", "new_tokens"))
            if two_d:
                cached.append(_number(row["cached_tokens"], f"{source}: {name}", "cached_tokens"))
            names.append(name)
        return cls(news, times, cached if two_d else None, decode_step_s=decode_step_s, decode_model=decode_model,
                   rows=names, source=source)

    @classmethod
    def _from_csv(cls, f: Iterable[str], source: str, decode_model: CostModel | None) -> CalibrationTable:
        lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip() and not line.lstrip().startswith("#")]
        if not lines:
            raise ValueError(f"{source}: empty calibration file")
        reader = csv.reader([line for _, line in lines])
        header = [h.strip() for h in next(reader)]
        rows = []
        for (lineno, _), values in zip(lines[1:], reader, strict=True):
            if len(values) != len(header):
                raise ValueError(f"{source}: line {lineno}: {len(values)} values for {len(header)} columns")
            rows.append((f"line {lineno}", {h: v.strip() for h, v in zip(header, values, strict=True)}))
        return cls._from_rows(rows, source, None, decode_model)

    @classmethod
    def _from_doc(cls, doc: Any, source: str, decode_model: CostModel | None) -> CalibrationTable:
        decode_step_s = None
        if isinstance(doc, dict):
            unknown = sorted(set(doc) - {"points", "decode_step_s", "name", "notes"})
            if unknown:
                raise ValueError(f"{source}: unknown key(s) {unknown}; valid: ['decode_step_s', 'name', 'notes', "
                                 f"'points']")
            if "points" not in doc:
                raise ValueError(f"{source}: key 'points' missing")
            decode_step_s = doc.get("decode_step_s")
            doc = doc["points"]
        if not isinstance(doc, list):
            raise ValueError(f"{source}: expected a list of points or a mapping with 'points'")
        rows = []
        for i, row in enumerate(doc):
            if not isinstance(row, dict):
                raise ValueError(f"{source}: point {i}: expected a mapping, got {type(row).__name__}")
            rows.append((f"point {i}", row))
        return cls._from_rows(rows, source, decode_step_s, decode_model)


def _number(v: Any, where: str, field: str) -> float:
    if isinstance(v, bool):
        raise ValueError(f"{where}: field '{field}': expected a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field '{field}': expected a number, got {v!r}") from None


def _finite(v: Any, where: str, field: str) -> float:
    x = _number(v, where, field)
    if not math.isfinite(x):
        raise ValueError(f"{where}: field '{field}' must be finite, got {x}")
    return x


# ----------------------------------------------------------------------------------------------------------------
# Servers


class Completion(NamedTuple):
    """A request whose first token is out."""

    req_id: Any
    t_first_token: float
    queue_delay: float


def _check_submit(server: Any, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int) -> None:
    """The submit contract both servers share: arrivals in order, not before the clock; token counts >= 0."""
    if not t_arrival >= server._last_arrival or t_arrival < server._min_arrival:
        raise ValueError(f"request {req_id!r}: arrival {t_arrival} is before an earlier arrival "
                         f"({server._last_arrival}) or the server clock ({server._min_arrival}); submit in "
                         f"arrival order and before advancing past it")
    if new_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"request {req_id!r}: token counts must be non-negative, got new_tokens={new_tokens}, "
                         f"cached_tokens={cached_tokens}")


class PrefillServer:
    """FIFO chunked-prefill server under a token budget (see the module docstring for the exact rules)."""

    timed = True

    def __init__(self, cost: CostModel, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS):
        for name, v in (("token_budget", token_budget), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.cost = cost
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.reset()

    def __repr__(self) -> str:
        return f"PrefillServer({self.cost!r}, token_budget={self.token_budget}, max_num_seqs={self.max_num_seqs})"

    def reset(self) -> None:
        """Forget every request; the clock goes back to the beginning."""
        # queue entries: [req_id, t_arrival, remaining new tokens, context (cached + prefilled), t_start or None]
        self._queue: deque[list[Any]] = deque()
        self._done: deque[Completion] = deque()  # formed, not yet returned; in time order
        self._free_at = -math.inf  # end of the last formed iteration
        self._min_arrival = -math.inf  # arrivals before this would change formed iterations
        self._last_arrival = -math.inf
        self.iterations = 0
        self.busy_time = 0.0  # sum of iteration durations
        self.prefilled_tokens = 0

    @property
    def queue_length(self) -> int:
        """Requests submitted whose prefill is not finished (waiting or partly prefilled)."""
        return len(self._queue)

    @property
    def busy_until(self) -> float:
        """End of the last formed iteration (-inf before the first)."""
        return self._free_at

    def submit(self, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int = 0) -> None:
        """Queue a request. Arrivals must be non-decreasing and not before the last ``advance_to`` time."""
        _check_submit(self, req_id, t_arrival, new_tokens, cached_tokens)
        if new_tokens == 0:  # vLLM recomputes the last prompt token of a full hit to get its logits
            new_tokens, cached_tokens = 1, max(cached_tokens - 1, 0)
        self._last_arrival = t_arrival
        self._queue.append([req_id, t_arrival, new_tokens, cached_tokens, None])

    def _run_iteration(self) -> float:
        """Form and run the next iteration; returns its start time."""
        q = self._queue
        s = max(self._free_at, q[0][1])
        budget = self.token_budget
        seqs = self.max_num_seqs
        chunks = []
        finished = 0
        for entry in q:
            if entry[1] > s or seqs == 0:
                break
            rem = entry[2]
            k = rem if rem <= budget else budget
            chunks.append((k, entry[3]))
            if entry[4] is None:
                entry[4] = s
            entry[2] = rem - k
            entry[3] += k
            budget -= k
            seqs -= 1
            if k == rem:
                finished += 1
            if budget == 0:
                break
        dur = self.cost.batch_time(chunks)
        if not 0.0 <= dur < math.inf:
            raise RuntimeError(f"cost model {self.cost!r} gave an iteration time of {dur} s for chunks {chunks}")
        e = s + dur
        self._free_at = e
        self.iterations += 1
        self.busy_time += dur
        self.prefilled_tokens += self.token_budget - budget
        done = self._done
        for _ in range(finished):
            req_id, t_arr, _rem, _ctx, t_start = q.popleft()
            done.append(Completion(req_id, e, t_start - t_arr))
        return s

    def advance_to(self, t: float) -> list[Completion]:
        """Run every iteration that starts before ``t``; return completions with ``t_first_token <= t``."""
        if t < self._min_arrival:
            raise ValueError(f"advance_to({t}): time goes backwards (the server is at {self._min_arrival})")
        self._min_arrival = t
        q = self._queue
        while q and max(self._free_at, q[0][1]) < t:
            self._run_iteration()
        done = self._done
        out = []
        while done and done[0].t_first_token <= t:
            out.append(done.popleft())
        return out

    def drain(self) -> list[Completion]:
        """Run everything queued (no more arrivals before it is done) and return all outstanding completions."""
        s = None
        while self._queue:
            s = self._run_iteration()
        if s is not None:  # a later arrival at s would have joined that iteration
            self._min_arrival = max(self._min_arrival, math.nextafter(s, math.inf))
        out = list(self._done)
        self._done.clear()
        return out

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.cost.prefill_time(new_tokens, cached_tokens)

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        return self.cost.decode_time(output_tokens, context_tokens, batch)


class InstantServer:
    """Mode "instant": no time passes; requests complete at arrival with no TTFT (``queue_delay`` NaN)."""

    timed = False
    cost = None

    def __init__(self) -> None:
        self.reset()

    def __repr__(self) -> str:
        return "InstantServer()"

    def reset(self) -> None:
        self._queue: deque[Completion] = deque()
        self._min_arrival = -math.inf
        self._last_arrival = -math.inf
        self.iterations = 0
        self.busy_time = 0.0
        self.prefilled_tokens = 0

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def busy_until(self) -> float:
        return -math.inf

    def submit(self, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int = 0) -> None:
        _check_submit(self, req_id, t_arrival, new_tokens, cached_tokens)
        self._last_arrival = t_arrival
        self._queue.append(Completion(req_id, t_arrival, math.nan))

    def advance_to(self, t: float) -> list[Completion]:
        if t < self._min_arrival:
            raise ValueError(f"advance_to({t}): time goes backwards (the server is at {self._min_arrival})")
        self._min_arrival = t
        q = self._queue
        out = []
        while q and q[0].t_first_token <= t:
            out.append(q.popleft())
        return out

    def drain(self) -> list[Completion]:
        out = list(self._queue)
        self._queue.clear()
        return out

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 0.0

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        return 0.0


Server = PrefillServer | InstantServer

_SPEC_KEYS = {"preset", "efficiency", "token_budget", "max_num_seqs", "calibration", "model", "gpu"}


def make_server(spec: str | dict[str, Any] | Server) -> Server:
    """Build a server from ``"instant"``, a preset name, or a dict.

    Dict keys: ``preset`` (a name or "instant"), ``efficiency`` (default 0.5), ``token_budget`` (8192),
    ``max_num_seqs`` (256), ``calibration`` (a table file: prefill times come from it, decode times from the
    preset's roofline if a preset is given), or ``model`` / ``gpu`` (dicts of :class:`ModelSpec` /
    :class:`GPUSpec` fields, or names from ``MODELS`` / ``GPUS``) instead of a preset. A server instance is
    returned as is.
    """
    if isinstance(spec, (PrefillServer, InstantServer)):
        return spec
    if isinstance(spec, str):
        spec = {"preset": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"server spec must be 'instant', a preset name or a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"server spec: unknown key(s) {unknown}; valid: {sorted(_SPEC_KEYS)}")
    preset = spec.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"server spec: 'preset' must be a string, got {preset!r}")
    if preset is not None and preset.lower() == "instant":
        extra = sorted(set(spec) - {"preset"})
        if extra:
            raise ValueError(f"server spec: the instant server takes no options, got {extra}")
        return InstantServer()
    if preset is not None and ("model" in spec or "gpu" in spec):
        raise ValueError("server spec: give either 'preset' or 'model' and 'gpu', not both")
    efficiency = spec.get("efficiency", DEFAULT_EFFICIENCY)
    roofline = None
    if preset is not None:
        key = preset.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown server preset '{preset}'; valid: {['instant', *sorted(PRESETS)]}")
        m, g = PRESETS[key]
        roofline = RooflineCost(MODELS[m], GPUS[g], efficiency)
    elif "model" in spec or "gpu" in spec:
        if "model" not in spec or "gpu" not in spec:
            raise ValueError("server spec: 'model' and 'gpu' go together")
        roofline = RooflineCost(_spec_obj(spec["model"], MODELS, ModelSpec, "model"),
                                _spec_obj(spec["gpu"], GPUS, GPUSpec, "gpu"), efficiency)
    cost: CostModel
    if spec.get("calibration") is not None:
        if "efficiency" in spec and roofline is None:
            raise ValueError("server spec: 'efficiency' applies to a roofline; a calibration table alone has none")
        cost = CalibrationTable.load(spec["calibration"], decode_model=roofline)
    elif roofline is not None:
        cost = roofline
    else:
        raise ValueError(f"server spec needs 'preset' (one of {['instant', *sorted(PRESETS)]}), 'model' and "
                         f"'gpu', or 'calibration'")
    return PrefillServer(cost, token_budget=spec.get("token_budget", DEFAULT_TOKEN_BUDGET),
                         max_num_seqs=spec.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS))


def _spec_obj(v: Any, table: dict[str, Any], cls: type, what: str) -> Any:
    if isinstance(v, cls):
        return v
    if isinstance(v, str):
        if v.lower() not in table:
            raise ValueError(f"unknown {what} '{v}'; valid: {sorted(table)}")
        return table[v.lower()]
    if isinstance(v, dict):
        try:
            return cls(**{"name": f"custom-{what}", **v})
        except TypeError as e:
            raise ValueError(f"server spec: bad '{what}' fields: {e}") from None
    raise ValueError(f"server spec: '{what}' must be a name or a dict of fields, got {type(v).__name__}")


def simulate(arrivals: Any, new_tokens: Any, cached_tokens: Any = 0,
             server: str | dict[str, Any] | Server = "qwen2.5-1.5b@a40") -> np.ndarray:
    """TTFT (seconds) of each request, in input order; requests are served in stable arrival order.

    A server instance is reset first. The instant server gives NaN everywhere.
    """
    t = np.asarray(arrivals, dtype=np.float64)
    if t.ndim != 1:
        raise ValueError("arrivals must be 1-D")
    n = np.broadcast_to(np.asarray(new_tokens), t.shape)
    c = np.broadcast_to(np.asarray(cached_tokens), t.shape)
    if not np.all(np.isfinite(t)):
        raise ValueError("arrivals must be finite")
    srv = make_server(server)
    srv.reset()
    order = np.argsort(t, kind="stable")
    ttft = np.full(t.size, np.nan)
    tl, nl, cl = t.tolist(), n.tolist(), c.tolist()
    first_token = {}
    for i in order.tolist():
        for comp in srv.advance_to(tl[i]):
            first_token[comp.req_id] = comp.t_first_token
        srv.submit(i, tl[i], int(nl[i]), int(cl[i]))
    for comp in srv.drain():
        first_token[comp.req_id] = comp.t_first_token
    if srv.timed:
        for i, tf in first_token.items():
            ttft[i] = tf - tl[i]
    return ttft


# ----------------------------------------------------------------------------------------------------------------
# Load factor


def _load_arrays(arrival_times: Any, service_times: Any) -> tuple[np.ndarray, np.ndarray, float, float]:
    a = np.asarray(arrival_times, dtype=np.float64)
    s = np.asarray(service_times, dtype=np.float64)
    if a.ndim != 1 or s.shape != a.shape:
        raise ValueError(f"arrival_times and service_times must be 1-D of the same length, got {a.shape}, {s.shape}")
    if a.size < 2:
        raise ValueError("utilisation needs at least two arrivals")
    if not np.all(np.isfinite(a)) or not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError("arrival times must be finite and service times finite and non-negative")
    t0, t1 = float(a.min()), float(a.max())
    if t1 <= t0:
        raise ValueError("all arrivals at one instant: the trace has no span, utilisation is undefined")
    return a, s, t0, t1


def utilisation(arrival_times: Any, service_times: Any) -> float:
    """Total service work over the trace span: ``sum(service_times) / (max(arrivals) - min(arrivals))``."""
    _, s, t0, t1 = _load_arrays(arrival_times, service_times)
    return float(s.sum()) / (t1 - t0)


def scale_to_utilisation(arrival_times: Any, service_times: Any, target: float) -> np.ndarray:
    """Arrival times rescaled about the first arrival so that ``utilisation(result, service_times) == target``."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target <= 0:
        raise ValueError(f"target utilisation must be a positive finite number, got {target!r}")
    a, s, t0, t1 = _load_arrays(arrival_times, service_times)
    work = float(s.sum())
    if work <= 0:
        raise ValueError("service times sum to 0: no utilisation to scale to")
    factor = (work / target) / (t1 - t0)
    return t0 + (a - t0) * factor
