"""The compiled replay engine (numba): the same replay as the Python engine, hit for hit, over numeric arrays.

:class:`~sae_env.replay.Replay` uses it by itself where it applies (``engine="auto"``): a policy with a compiled twin,
instant mode or a timed replay on :class:`~sae_env.serving.PrefillServer`, no cache observer, no per-request
invariant checks, numba importable, and a trace the engine accepts (:func:`engine.trace_reason`).
``engine="python"`` forces the Python engine; ``Replay.to_python()`` / ``Replay.to_fast()`` move a replay's state
between the two after any window (:mod:`sae_env.state` is the contract between them).

Modules, one concept each:

* :mod:`~sae_env.fast_engine.jit` -- numba (optional) and the compiled hook interface: a policy's hooks are chosen
  by the class of its state, so the loop is written once and compiled per policy;
* :mod:`~sae_env.fast_engine.keys` -- dense ids for the trace's keys;
* :mod:`~sae_env.fast_engine.loop` -- the request loop (admission, insertion, eviction, ghosts, completion, and the
  timed event loop), the compiled :meth:`~sae_env.cache.PrefixCache.admit` / ``complete``;
* :mod:`~sae_env.fast_engine.server` -- the prefill server and its cost models;
* :mod:`~sae_env.fast_engine.heap` -- the keyed policies' lazy-deletion heap;
* :mod:`~sae_env.fast_engine.treap` -- an ordered set of slots by (group, set, stamp), for SAECache's candidates;
* :mod:`~sae_env.fast_engine.arrivals` -- SAECache's arrivals-only learning, per arrival (its refits run in Python);
* :mod:`~sae_env.fast_engine.twin` -- what a policy's compiled twin is, and the registry;
* :mod:`~sae_env.fast_engine.baselines`, :mod:`~sae_env.fast_engine.oracles`, :mod:`~sae_env.fast_engine.lpc`,
  :mod:`~sae_env.fast_engine.saecache` -- the twins;
* :mod:`~sae_env.fast_engine.engine` -- :class:`FastEngine`: a replay's compiled state, loaded from and saved to the
  Python objects.

Equivalence: every window's statistics equal the Python engine's exactly (``tests/test_fast_engine.py``, every
policy with a twin, hypothesis traces and every embedded trace, instant and timed), and a state handed over in
either direction after any window gives the same replay.

numba is optional (``pip install saecache-gym[fast]``): without it :data:`AVAILABLE` is False and the replay falls
back to the Python engine. numba checks its on-disk cache of a compiled function against that function's file only;
this package's kernels are checked against all of its files (a changed hook recompiles the loop that inlines it).
"""

from sae_env.fast_engine.engine import MAX_REFS, FastEngine, TimedState, WindowCounts, unsupported_reason
from sae_env.fast_engine.jit import AVAILABLE

__all__ = ["AVAILABLE", "MAX_REFS", "FastEngine", "TimedState", "WindowCounts", "unsupported_reason"]
