"""The hardware catalogue: a transformer's shape (:class:`ModelSpec`), a GPU's peaks (:class:`GPUSpec`), and the
presets a config names (``qwen2.5-1.5b@a40``, the paper's set-up, and ``qwen2.5-1.5b@h200``).

Only what the roofline (:mod:`sae_env.serving.roofline`) needs: parameter counts, attention width, KV bytes per
token, dense peak FLOP/s and memory bandwidth. Every figure says where it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GPUS", "MODELS", "PRESETS", "GPUSpec", "ModelSpec"]



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

