"""The roofline cost model: prefill and decode time of a model on a GPU from its FLOPs and bytes moved.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sae_env.serving.cost import check_tokens, tokens_array
from sae_env.serving.hardware import GPUSpec, ModelSpec

__all__ = ["DEFAULT_EFFICIENCY", "RooflineCost", "sum_max_linear"]

DEFAULT_EFFICIENCY = 0.5  # one factor on both peaks (see above)


def sum_max_linear(a1: float, b1: float, a2: float, b2: float, lo: int, hi: int) -> float:
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

    @property
    def kv_bytes_per_token(self) -> int:
        """The model's KV cache bytes per token (what a capacity in bytes is divided by)."""
        return self.model.kv_bytes_per_token

    def __repr__(self) -> str:
        return f"RooflineCost({self.name}, efficiency={self.efficiency})"

    def terms(self) -> tuple[float, float, float, float, float, float]:
        """The constants :meth:`batch_time` computes with: FLOPs per new token (linear layers), FLOPs per (query,
        key) pair, weight bytes, KV bytes per token, FLOP rate, byte rate (the compiled server uses them as is)."""
        return self._lin, self._pair, self._w, self._kv, self._flop_rate, self._byte_rate

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
            check_tokens(new_tokens, cached_tokens)
            return 0.0
        n, c = new_tokens, cached_tokens
        f = self._lin * n + self._pair * (n * c + n * (n + 1) // 2)
        b = self._w + self._kv * (n + c)
        return max(f / self._flop_rate, b / self._byte_rate)

    def prefill_times(self, new_tokens: Any, cached_tokens: Any = 0) -> np.ndarray:
        """Vectorised :meth:`prefill_time` (float64 array)."""
        n = tokens_array(new_tokens, "new_tokens")
        c = tokens_array(cached_tokens, "cached_tokens")
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
        return sum_max_linear(a1, b1, a2, b2, 1, output_tokens - 1)


