"""PrefixCacheEnv: a thin Gymnasium adapter over :class:`sae_env.replay.Replay` (registered as ``ENV_ID``).

One episode replays one trace (or a sampled segment of it) through a fresh cache, policy and server; one step
applies the agent's action as the policy's parameters and replays one window. Everything that decides an outcome
lives in :mod:`sae_env.replay`, :mod:`sae_env.cache` and the policies; this module only translates:

* **actions -> parameters** through the policy's :class:`~sae_env.policies.params.ActionCodec` (the affine map
  onto each :class:`ParamSpec`'s bounds, exact in the round trip for actions the env made: see
  :mod:`sae_env.policies.params`). An action that leaves every value unchanged does not call ``set_params`` at all,
  so an agent that holds the defaults replays exactly like a plain :class:`Replay`. Out-of-range components are
  clipped to ``[-1, 1]``, NaN components keep the current value; both are counted (``info["clipped"]``).
* **WindowStats -> observation** (:mod:`sae_env.observation`) and **-> info** (:func:`sae_env.metrics.window_dict`).

Time is the trace clock: no wall-clock value reaches the observation, the reward or ``info``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from sae_env.cache import PrefixCache, resolve_capacity
from sae_env.metrics import WindowStats, latency_summary, window_dict
from sae_env.observation import ObservationBuilder, box
from sae_env.policies import make_policy, policy_class
from sae_env.policies.base import EvictionPolicy
from sae_env.policies.params import ActionCodec, ParamSpec, action_to_values
from sae_env.replay import Replay
from sae_env.serving import at_load, make_server
from sae_env.sources import trace_from_spec
from sae_env.trace import N_TOKEN_TYPES, TokenType, Trace

__all__ = ["DEFAULT_TRACE", "ENV_ID", "REWARDS", "PrefixCacheEnv", "parse_window"]

ENV_ID = "sae_env/PrefixCache-v0"
REWARDS = ("hit_rate", "hit_tokens", "neg_ttft")

# The default workload: the synthetic "tiny" preset stretched to 600 s (~720 requests, ~4,000 distinct blocks, all
# three session kinds); an episode of saecache at 10 % capacity replays in ~0.25 s.
DEFAULT_TRACE: dict[str, Any] = {
    "source": "synthetic", "preset": "tiny",
    "phases": [{"duration": 600.0, "rate": 0.5, "mix": {"templated": 0.4, "chat": 0.3, "agent": 0.3},
                "name": "tiny"}],
}

TraceSpec = Trace | Callable[[np.random.Generator], Trace] | Mapping[str, Any] | str | None

_default_trace_cache: list[Trace] = []


# ----------------------------------------------------------------------------------------------------------------
# Configuration helpers


def _default_trace() -> Trace:
    # Traces are read-only to the replay, so one per process serves every env built with the defaults.
    if not _default_trace_cache:
        _default_trace_cache.append(trace_from_spec(DEFAULT_TRACE)[0])
    return _default_trace_cache[0]


def parse_window(window: int | str) -> tuple[int | None, float | None]:
    """``int`` -> requests per window; ``"30s"`` -> trace seconds per window; ValueError for anything else."""
    if isinstance(window, str):
        text = window.strip().lower()
        try:
            if text.endswith("s"):
                seconds = float(text[:-1])
                if not (seconds > 0 and math.isfinite(seconds)):
                    raise ValueError
                return None, seconds
            window = int(text)
        except ValueError:
            raise ValueError(f"window {window!r} is neither a number of requests (e.g. 100) nor seconds "
                             "(e.g. '30s')") from None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 1 <= window < 2**63:
        text = repr(window)
        raise ValueError(f"window must be a number of requests >= 1 or a string of seconds ('30s'), got "
                         f"{text if len(text) <= 40 else text[:20] + '...'}")
    return int(window), None


# ----------------------------------------------------------------------------------------------------------------
# The environment


class PrefixCacheEnv(gym.Env):
    """The prefix (KV) cache of an LLM server; the agent tunes an eviction policy's parameters window by window.

    ### Description
    Each episode replays a request trace (or a random contiguous segment of it) through a fresh
    :class:`~sae_env.cache.PrefixCache` run by the named eviction policy and, optionally, a prefill server model
    that turns cache hits into time to first token. Each step sets the policy's parameters and replays one window of
    requests. The env is only an adapter: its per-window statistics equal a plain :class:`~sae_env.replay.Replay`
    of the same trace, policy, capacity and window.

    ### Action Space
    ``Box(-1, 1, (d,), float32)`` with ``d`` = the policy's number of parameters (``param_specs``). Component
    ``i`` maps affinely onto parameter ``i``'s bounds, on a log scale for log parameters. ``params_to_action`` /
    ``action_to_params`` convert (exactly, for actions the env produced). Parameterless policies (lru, lfu, fifo,
    s3fifo, belady) get ``Box(-1, 1, (1,))`` whose value is ignored (a shape ``(0,)`` Box breaks common tooling).
    Invalid actions: components outside ``[-1, 1]`` (inf included) are clipped, NaN components keep the current
    value; both are counted in ``info["clipped"]`` (per episode). A wrong shape (a batch of one included) or
    anything but real numbers (strings, complex numbers, booleans) is a ValueError.

    ### Observation Space
    A ``Dict`` of float32 Boxes describing the last window (all zeros after ``reset`` except ``params`` and
    ``progress``; gymnasium orders the keys alphabetically):

    ====================  =======  ===========================================================================
    ``hit_rate``          (2,)     token and block hit rate, [0, 1]
    ``cache``             (3,)     occupancy / capacity, evictions / inserted blocks, bypassed / offered blocks
    ``queue_hit_share``   (4,)     hit blocks per queue / all hit blocks (policies reporting ``queue_hits``,
                                   i.e. saecache; zeros otherwise)
    ``queue_occupancy``   (4,)     cached blocks per queue / capacity (single-queue policies: queue 0 only)
    ``type_hit_rate``     (7,)     hit rate per TokenType (0 where the type is not referenced)
    ``type_ref_share``    (7,)     share of the window's prompt blocks per TokenType
    ``miss_after_evict``  (7,)     misses on evicted keys (ghost hits) / references, per TokenType
    ``app_mix``           (4,)     share of requests per AppType
    ``gaps``              (6,)     chat then agent: mean ln(inter-turn gap s) / 10 in [-1, 1], its std / 5 in
                                   [0, 1], share of the window's requests that are follow-up turns of that app
    ``latency``           (3,)     mean TTFT, p99 TTFT, mean queueing delay, each ``x / (1 + x)`` of seconds
                                   (zeros with the instant server)
    ``params``            (d,)     the parameters in effect, mapped into [-1, 1] as actions are
    ``progress``          (1,)     requests replayed / requests in the episode
    ====================  =======  ===========================================================================

    ### Rewards
    ``reward="hit_rate"`` (default): the window's token hit rate. ``"hit_tokens"``: hit tokens / ``reward_scale``
    (default 1e4). ``"neg_ttft"``: minus the mean TTFT in seconds of the first tokens produced in the window (0 if
    none); it needs a timed server.

    ### Starting State
    An empty cache; the policy at its defaults (plus ``policy_options``). With ``segment_requests=N`` the episode
    replays ``N`` consecutive requests starting at a position drawn from ``self.np_random`` (or
    ``options={"segment_start": k}``); with a trace factory the trace is drawn from ``self.np_random``.

    ### Episode End
    ``terminated`` when the episode's trace is exhausted; ``truncated`` after ``max_steps`` steps (if given).
    Stepping a finished episode raises RuntimeError.

    ### Info
    ``window``: :meth:`WindowStats.to_dict` of the window (None values left out; no wall-clock values),
    ``params``: the parameters used in the window, ``clipped``: invalid action components this episode,
    ``step``, ``requests_done``; after ``reset``: ``capacity_blocks``, ``trace_requests``, ``segment_start``.
    The last :class:`WindowStats` object itself is ``env.unwrapped.last_stats``; the replay ``env.unwrapped.replay``.

    ### Arguments
    * ``trace``: a :class:`Trace`; a factory ``f(rng) -> Trace`` called at every reset; a source spec
      ``{"source": "synthetic", "preset": "tiny", ...}`` / ``{"source": "mooncake", "path": ...}``; the name of an
      embedded trace (``sae_env.data.ALL``) or a native trace file. Default: :data:`DEFAULT_TRACE`.
    * ``capacity``: blocks (int), a fraction of the episode trace's distinct blocks (float), or a string (``"10%"``,
      ``"2GiB"`` with a timed server); default 0.1.
    * ``policy`` (default ``"saecache"``) and ``policy_options`` (constructor options, e.g. switches, predictor).
    * ``serving``: ``"instant"`` (default) or a server spec for :func:`sae_env.serving.make_server`;
      ``load``: target utilisation, rescales arrival times (timed servers only).
    * ``window``: requests per step (int, default 100) or trace seconds (``"30s"``).
    * ``reward``, ``reward_scale``: see Rewards. ``max_steps``: truncation. ``segment_requests``: see Starting State.
    * ``ghost_capacity``, ``cache_outputs``: passed to :class:`PrefixCache`. ``render_mode``: None or ``"ansi"``
      (another mode raises TypeError, Gymnasium's convention).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, trace: TraceSpec = None, capacity: float | int | str = 0.1, policy: str = "saecache",
                 policy_options: Mapping[str, Any] | None = None, serving: str | Mapping[str, Any] = "instant",
                 window: int | str = 100, reward: str = "hit_rate", reward_scale: float = 1e4,
                 max_steps: int | None = None, segment_requests: int | None = None, load: float | None = None,
                 ghost_capacity: int | None = None, cache_outputs: bool = True, render_mode: str | None = None):
        super().__init__()
        # -- the trace
        self._factory: Callable[[np.random.Generator], Trace] | None = None
        self._base_trace: Trace | None = None
        if trace is None:
            self._base_trace = _default_trace()
        elif isinstance(trace, Trace):
            self._base_trace = trace
        elif isinstance(trace, (Mapping, str)):
            self._base_trace = trace_from_spec(trace)[0]
        elif callable(trace):
            self._factory = trace
        else:
            raise ValueError(f"trace must be a Trace, a factory f(rng) -> Trace, a source spec dict or a name; got "
                             f"{type(trace).__name__}")
        if self._base_trace is not None and len(self._base_trace) == 0:
            raise ValueError("the trace has no requests")
        if segment_requests is not None and (isinstance(segment_requests, bool) or int(segment_requests) < 1):
            raise ValueError(f"segment_requests must be >= 1, got {segment_requests!r}")
        self.segment_requests = None if segment_requests is None else int(segment_requests)
        # -- the policy (built once here to validate its options and learn its parameters)
        self.policy_name = policy
        self.policy_options = dict(policy_options or {})
        probe = make_policy(policy, **self.policy_options)
        self.param_specs: tuple[ParamSpec, ...] = tuple(policy_class(policy).param_specs)
        self.default_params: dict[str, float] = probe.params
        # -- serving, capacity, windows, reward
        self.serving = serving
        timed = make_server(serving).timed
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; valid: {list(REWARDS)}")
        if reward == "neg_ttft" and not timed:
            raise ValueError("reward 'neg_ttft' needs a timed server (serving='qwen2.5-1.5b@a40', ...), not 'instant'")
        if not (reward_scale > 0 and math.isfinite(reward_scale)):
            raise ValueError(f"reward_scale must be positive, got {reward_scale!r}")
        if load is not None and not timed:
            raise ValueError("load (target utilisation) needs a timed server, not 'instant'")
        if load is not None and not (load > 0 and math.isfinite(load)):
            raise ValueError(f"load must be a positive utilisation, got {load!r}")
        if max_steps is not None and (isinstance(max_steps, bool) or int(max_steps) < 1):
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float, str, np.integer, np.floating)):
            raise ValueError(f"capacity must be blocks, a fraction or a string, got {capacity!r}")
        self.capacity = capacity
        self.timed = timed
        self.window_requests, self.window_seconds = parse_window(window)
        self.reward_kind = reward
        self.reward_scale = float(reward_scale)
        self.max_steps = None if max_steps is None else int(max_steps)
        self.load = load
        self.ghost_capacity = ghost_capacity
        self.cache_outputs = cache_outputs
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            # TypeError, as Gymnasium's own envs raise: wrappers such as Stable-Baselines3's make_vec_env pass
            # render_mode="rgb_array" and retry without it only on a TypeError.
            raise TypeError(f"render_mode must be None or one of {self.metadata['render_modes']}, got "
                            f"{render_mode!r}")
        self.render_mode = render_mode
        # -- spaces
        self._codec = ActionCodec(self.param_specs)
        self._observation = ObservationBuilder(self.param_specs)
        self.action_space = box(-1.0, 1.0, max(len(self.param_specs), 1))
        self.observation_space = self._observation.space
        # -- episode state
        self.trace: Trace | None = None
        self.capacity_blocks: int | None = None  # the episode's capacity in blocks (after reset)
        self.replay: Replay | None = None
        self.last_stats: WindowStats | None = None
        self._latency: tuple | None = None
        self.segment_start = 0
        self._steps = 0
        self._clipped = 0
        self._done = True

    # -- parameters <-> actions ----------------------------------------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy | None:
        """The current episode's policy (None before the first reset)."""
        return None if self.replay is None else self.replay.policy

    @property
    def params(self) -> dict[str, float]:
        """The parameters in effect (the defaults before the first reset)."""
        return self.policy.params if self.policy is not None else dict(self.default_params)

    def params_to_action(self, values: Mapping[str, float] | None = None) -> np.ndarray:
        """An action (float32) that sets these parameter values; names left out keep their current values.

        Values are clipped to their bounds; unknown names or non-finite values raise ValueError. The env remembers
        the encoding, so that :meth:`action_to_params` (and :meth:`step`) turn it back into exactly these values.
        """
        if not self.param_specs:
            if values:
                raise ValueError(f"policy {self.policy_name!r} has no parameters, got {sorted(values)}")
            return np.zeros(1, dtype=np.float32)
        full = self.params
        valid = {p.name for p in self.param_specs}
        for name, v in (values or {}).items():
            if name not in valid:
                raise ValueError(f"policy {self.policy_name!r} has no parameter {name!r}; valid: {sorted(valid)}")
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                raise ValueError(f"parameter {name!r}: need a finite number, got {v!r}")
            full[name] = float(v)
        return self._codec.encode({p.name: p.clip(full[p.name]) for p in self.param_specs})

    def action_to_params(self, action: np.ndarray) -> dict[str, float]:
        """The parameter values an in-range action stands for (exact for actions from :meth:`params_to_action`)."""
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.size != self.action_space.shape[0]:
            raise ValueError(f"action has {a.size} components, the action space {self.action_space.shape}")
        if not self.param_specs:
            return {}
        if not np.all(np.isfinite(a)) or np.any(np.abs(a) > 1.0):
            raise ValueError("action_to_params needs finite components in [-1, 1] (step() clips them)")
        return self._codec.decode(a)

    def noop_action(self) -> np.ndarray:
        """The action that leaves every parameter as it is (zeros for parameterless policies)."""
        return self.params_to_action()

    def _apply_action(self, action: Any) -> None:
        shape = self.action_space.shape
        try:
            raw = np.asarray(action)
        except (TypeError, ValueError):  # ragged nested lists
            raw = None
        # Real numbers of exactly the space's shape: numpy would quietly parse strings ("0.5"), drop the imaginary
        # part of complex numbers or flatten a (1, d) batch, and the replay would go on with something else.
        if raw is None or raw.dtype.kind not in "iuf":
            kind = "ragged" if raw is None else f"dtype {raw.dtype}"
            raise ValueError(f"action must be numeric (real numbers: float or int) with shape {shape}, got {kind}: "
                             f"{str(action)[:80]}")
        if raw.shape != shape:
            raise ValueError(f"action has shape {raw.shape}, the action space {shape}")
        a = raw.astype(np.float64, copy=False).reshape(-1)
        comps = a.tolist()  # a handful of components: Python floats beat numpy's per-call cost here
        nan = [x != x for x in comps]
        bad = sum(1 for x, n in zip(comps, nan, strict=True) if n or x < -1.0 or x > 1.0)
        self._clipped += bad
        if not self.param_specs:
            return
        policy = self.policy
        current = policy.params
        values = self._codec.recall(a) if bad == 0 else None
        if values is None:
            values = action_to_values(self.param_specs, [0.0 if n else min(1.0, max(-1.0, x))
                                                         for x, n in zip(comps, nan, strict=True)])
            for p, is_nan in zip(self.param_specs, nan, strict=True):
                if is_nan:
                    values[p.name] = current[p.name]
        if values != current:
            policy.set_params(values)

    # -- gymnasium API -------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = sorted(set(options) - {"segment_start"})
        if unknown:
            raise ValueError(f"unknown reset option(s) {unknown}; valid: ['segment_start']")
        trace = self._factory(self.np_random) if self._factory is not None else self._base_trace
        if not isinstance(trace, Trace) or len(trace) == 0:
            raise ValueError(f"the trace factory must return a non-empty Trace, got {trace!r}")
        start = 0
        n = self.segment_requests
        if n is not None and n < len(trace):
            if "segment_start" in options:
                start = int(options["segment_start"])
                if not 0 <= start <= len(trace) - n:
                    raise ValueError(f"segment_start {start} outside [0, {len(trace) - n}]")
            else:
                start = int(self.np_random.integers(0, len(trace) - n + 1))
            trace = trace[start:start + n]
        elif "segment_start" in options and int(options["segment_start"]) != 0:
            raise ValueError("segment_start needs segment_requests smaller than the trace")
        server = make_server(self.serving)
        if self.load is not None:
            trace = at_load(trace, server, self.load)
        capacity = resolve_capacity(self.capacity, trace.distinct_blocks(), server.kv_bytes_per_token,
                                    trace.block_size)
        policy = make_policy(self.policy_name, **self.policy_options)
        cache = PrefixCache(capacity, policy, ghost_capacity=self.ghost_capacity, cache_outputs=self.cache_outputs)
        self.trace = trace
        self.capacity_blocks = capacity
        self.segment_start = start
        self.replay = Replay(trace, cache, server, window_requests=self.window_requests,
                             window_seconds=self.window_seconds)
        self.last_stats = None
        self._latency = None
        self._observation.reset(trace)
        self._steps = 0
        self._clipped = 0
        self._done = False
        info = {"window": {}, "params": policy.params, "clipped": 0, "step": 0, "requests_done": 0,
                "capacity_blocks": capacity, "trace_requests": len(trace), "segment_start": start}
        return self._get_obs(), info

    def step(self, action: Any):
        if self.replay is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended; call reset()")
        self._apply_action(action)
        stats = self.replay.step()
        self.last_stats = stats
        self._latency = latency_summary(stats)
        self._steps += 1
        terminated = self.replay.done
        truncated = (not terminated) and self.max_steps is not None and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._get_obs(), self._reward(stats), terminated, truncated, self._get_info()

    def _reward(self, w: WindowStats) -> float:
        if self.reward_kind == "hit_rate":
            return float(w.token_hit_rate)
        if self.reward_kind == "hit_tokens":
            return w.hit_tokens / self.reward_scale
        return -float(np.mean(w.ttft_ms)) / 1e3 if w.ttft_ms else 0.0

    def _get_info(self) -> dict[str, Any]:
        w = self.last_stats
        return {"window": window_dict(w, self._latency) if w is not None else {}, "params": self.params,
                "clipped": self._clipped, "step": self._steps,
                "requests_done": 0 if self.replay is None else self.replay.next_request}

    def _get_obs(self) -> dict[str, np.ndarray]:
        progress = self.replay.next_request / len(self.trace) if self.replay is not None else 0.0
        return self._observation.build(self.params, progress, self.last_stats, self._latency)

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return self._render_ansi()

    def _render_ansi(self) -> str:
        if self.replay is None:
            return f"PrefixCacheEnv({self.policy_name}): not reset\n"
        # From the last window's statistics, not the replay's cache: the compiled engine may hold the state, and
        # only an explicit Replay.to_python() moves it to the Python objects.
        w = self.last_stats
        occupancy = w.occupancy if w is not None else 0
        lines = [f"PrefixCacheEnv | policy {self.policy_name} | step {self._steps} | requests "
                 f"{self.replay.next_request}/{len(self.trace)} | cache {occupancy}/{self.capacity_blocks} blocks"]
        if w is None:
            return "\n".join(lines) + "\n"
        lines.append(f"window {w.index}: token hit {w.token_hit_rate:.3f}  block hit {w.block_hit_rate:.3f}  "
                     f"evictions {w.evictions}  bypasses {w.bypasses}  reward {self._reward(w):.4f}")
        names = dict(enumerate(self.policy.queue_names))
        qh = w.policy.get("queue_hits") if isinstance(w.policy, dict) else None
        for q in sorted(set(names) | set(w.occupancy_by_queue)):
            n = w.occupancy_by_queue.get(q, 0)
            bar = "#" * int(round(20 * n / w.capacity))
            hits = f"  hits {qh[q]}" if qh and q < len(qh) else ""
            lines.append(f"  {names.get(q, f'queue {q}'):<18} [{bar:<20}] {n / w.capacity:6.1%}{hits}")
        rates = [f"{TokenType(k).name.lower()} {w.hits_by_type[k] / w.refs_by_type[k]:.2f}"
                 for k in range(N_TOKEN_TYPES) if w.refs_by_type[k]]
        lines.append("  hit rate by type: " + ", ".join(rates))
        return "\n".join(lines) + "\n"


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="sae_env.env:PrefixCacheEnv")
