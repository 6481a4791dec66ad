"""The serving model: how many milliseconds a cache hit saves, on the trace clock.

A request's uncached prompt tokens are prefilled by a server, whose iterations cost what a cost model says; the
replay turns the first token's time into a TTFT. Nothing reads the wall clock, so a replay is deterministic.

One concept per module, in the order a request meets them:

* :mod:`~sae_env.serving.spec` -- ``make_server("qwen2.5-1.5b@a40")``: a config's ``serving`` value built into a
  server; :func:`simulate` runs a list of requests through one.
* :mod:`~sae_env.serving.server` -- the :class:`Server` protocol the replay is typed with, and its two servers: the
  FIFO chunked-prefill scheduler (:class:`PrefillServer`, vLLM's rules) and the instant one (no time passes).
* :mod:`~sae_env.serving.cost` -- the :class:`CostModel` contract the scheduler prices its iterations with;
  :mod:`~sae_env.serving.roofline` (FLOPs and bytes of a model on a GPU, with the hand check) and
  :mod:`~sae_env.serving.calibration` (measured times, interpolated, and their CSV / JSON / YAML files) implement it.
* :mod:`~sae_env.serving.hardware` -- the catalogue of models, GPUs and presets the roofline reads.
* :mod:`~sae_env.serving.load` -- a trace's arrivals rescaled to a target utilisation of the server.
"""

from sae_env.serving.calibration import CalibrationTable
from sae_env.serving.cost import CostModel
from sae_env.serving.hardware import GPUS, MODELS, PRESETS, GPUSpec, ModelSpec
from sae_env.serving.load import at_load, scale_to_utilisation, utilisation
from sae_env.serving.roofline import RooflineCost
from sae_env.serving.server import Completion, InstantServer, PrefillServer, Server
from sae_env.serving.spec import make_server, simulate

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
    "Server",
    "at_load",
    "make_server",
    "scale_to_utilisation",
    "simulate",
    "utilisation",
]
