"""Load scaling: a trace's arrival times stretched or squeezed so that the prefill server reaches a target load.

``utilisation = sum(service_times) / (max(arrivals) - min(arrivals))``; with service times of each request
prefilled alone, this is the fraction of the trace span the GPU would be busy without batching.
:func:`scale_to_utilisation` rescales every arrival's distance to the first arrival by one factor so that the span
becomes ``sum(service_times) / target`` (order and relative gaps kept). Batching shares the weight read, so
short-prompt workloads saturate above 1.0; long prompts (compute-bound) saturate near 1.0. :func:`at_load` does it
to a trace for a server, with every prompt uncached: the one place the env, the command line and the experiment
runner rescale a workload.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sae_env.serving.server import Server
    from sae_env.trace import Trace

__all__ = ["at_load", "scale_to_utilisation", "utilisation"]


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


def at_load(trace: Trace, server: Server, target: float) -> Trace:
    """``trace`` with its arrivals rescaled so that ``server`` prefilling every prompt alone, uncached, would be busy
    ``target`` of the span; ValueError for a server where no time passes (the instant one)."""
    if not server.timed or server.cost is None:
        raise ValueError(f"a target load needs a timed server (e.g. 'qwen2.5-1.5b@a40'), not {server!r}")
    service = server.cost.prefill_times(trace.prompt_tokens, 0)
    return trace.with_times(scale_to_utilisation(trace.t, service, target))
