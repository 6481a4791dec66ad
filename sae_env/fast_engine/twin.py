"""A policy's compiled twin: its state as a numba state (a NamedTuple of arrays, whose class selects the compiled
hooks), built from the dictionary the policy exports (:mod:`sae_env.state`) and written back as one.

A twin never reads a policy's attributes: it gets the policy's public parameters (``params``), options it was built
with (public attributes such as ``small_ratio``), the trace, and the state dictionary. While the compiled engine holds
the state the Python policy object stays the user's handle (its ``params``, ``set_params``, ``switches``); the twin
follows parameter changes (``params_changed``, called after every ``set_params`` through
:meth:`~sae_env.policies.base.EvictionPolicy.watch_params`) and reports the window statistics the policy would
(:meth:`window_stats`).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy as np

from sae_env.fast_engine.keys import KeyTable
from sae_env.trace import Trace

__all__ = ["Twin", "register", "twin_class"]

# The modules that define twins (imported on first use: they compile nothing until a kernel runs).
_MODULES = ("sae_env.fast_engine.baselines", "sae_env.fast_engine.oracles", "sae_env.fast_engine.lpc",
            "sae_env.fast_engine.saecache")
_TWINS: dict[type, type[Twin]] = {}


def register(twin: type[Twin]) -> type[Twin]:
    for cls in twin.classes:
        _TWINS[cls] = twin
    return twin


def twin_class(policy: Any) -> type[Twin] | None:
    """The twin of ``policy``'s class exactly (a subclass may override hooks the twin does not mirror), or None."""
    for m in _MODULES:  # every time: importing one of them directly must not hide the others' twins
        importlib.import_module(m)
    return _TWINS.get(type(policy))


class Twin:
    """Base class. ``state`` is the numba state the request loop is compiled for."""

    classes: tuple[type, ...] = ()
    chained = False  # needs chained keys (it reads a block's depth, or its context by position)
    state: NamedTuple

    def __init__(self, policy: Any, trace: Trace, capacity: int, keys: KeyTable):
        self.policy = policy
        self.trace = trace
        self.capacity = capacity
        self.keys = keys

    @classmethod
    def reason(cls, policy: Any) -> str | None:
        """Why this twin cannot run ``policy`` (None if it can)."""
        return None

    def map_keys(self, state: dict[str, Any]) -> None:
        """Map the keys the exported state names (not blocks: e.g. a policy's own ghost) to dense ids, before the
        engine sizes its per-key arrays."""

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        """Take the policy's exported state for ``n`` blocks (block ``i`` in slot ``i``); ``core`` (the cache's
        arrays, :class:`~sae_env.fast_engine.loop.Core`) is loaded already."""
        raise NotImplementedError

    def export(self, n: int, core: Any) -> dict[str, Any]:
        """The state as the policy's ``import_state`` takes it (slot ``i`` = block ``i``)."""
        raise NotImplementedError

    def prepare(self, a: int, b: int) -> None:
        """Requests ``a .. b-1`` are served next (a twin that computes per-request inputs ahead does it here)."""

    def begin_window(self) -> None:
        """The replay starts a window (the policy's ``reset_window``)."""

    def params_changed(self) -> None:
        """The policy's parameters were set (its ``params_changed``)."""

    def window_stats(self) -> dict[str, Any]:
        return {}

    def occupancy_by_queue(self, n: int) -> dict[int, int]:
        return {0: n} if n else {}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in _arrays(self.state))


def _arrays(x: Any) -> list[np.ndarray]:
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, tuple):
        return [a for v in x for a in _arrays(v)]
    return []
