"""The cost-model contract: what the prefill server asks of a model of GPU time.

Two cost models implement it: the roofline of a model on a GPU (:mod:`sae_env.serving.roofline`) and a table of
measured times (:mod:`sae_env.serving.calibration`). A prefill of ``new_tokens`` follows ``cached_tokens`` whose KV
is already in GPU memory; a batch is a list of chunks ``(new, context)`` run as one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["CostModel", "check_tokens", "tokens_array"]


class CostModel(Protocol):
    """What the server needs from a cost model (times in seconds)."""

    #: KV cache bytes per token of the model, if the cost model knows the model (a capacity in bytes needs it).
    kv_bytes_per_token: int | None

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def prefill_times(self, new_tokens: Any, cached_tokens: Any = 0) -> np.ndarray: ...

    def batch_time(self, chunks: Sequence[tuple[int, int]]) -> float: ...

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float: ...


def check_tokens(new_tokens: float, cached_tokens: float) -> None:
    """ValueError unless both token counts are non-negative."""
    if new_tokens < 0 or cached_tokens < 0:
        raise ValueError(f"token counts must be non-negative, got new_tokens={new_tokens}, "
                         f"cached_tokens={cached_tokens}")


def tokens_array(x: Any, name: str) -> np.ndarray:
    """Token counts as a float64 array; ValueError unless every one is finite and non-negative."""
    a = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    return a
