"""The server spec: what a config's or a command line's ``serving`` value names, built into a server.

``"instant"``, a preset (``qwen2.5-1.5b@a40``), or a dict: ``preset``, ``efficiency``, ``token_budget``,
``max_num_seqs``, ``calibration`` (a table file), or ``model`` / ``gpu`` instead of a preset (see
:func:`make_server`). :func:`simulate` runs a list of requests through such a server.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sae_env.serving.calibration import CalibrationTable
from sae_env.serving.cost import CostModel
from sae_env.serving.hardware import GPUS, MODELS, PRESETS, GPUSpec, ModelSpec
from sae_env.serving.roofline import DEFAULT_EFFICIENCY, RooflineCost
from sae_env.serving.server import DEFAULT_MAX_NUM_SEQS, DEFAULT_TOKEN_BUDGET, InstantServer, PrefillServer, Server

__all__ = ["make_server", "simulate"]

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
