"""SAECache's online learners: the paper's feedback loop, applied after every window from the window statistics.

After each window (a :class:`~sae_env.metrics.WindowStats` and the policy's own counts) the learner moves every
parameter of :class:`~sae_env.policies.saecache.SAECachePolicy`:

* **token-type weights** ``w_type``: an exponential moving average towards a target that rises with the type's hit
  rate and its *miss-after-eviction* rate (regretted evictions, seen through the cache's ghost record), both per
  prompt reference, relative to the mean over the types present (a type that holds blocks but is never referenced,
  such as reasoning, gets a target of 0). ``w <- (1 - type_rate) * w + type_rate * target``;
* **log-normal (mu, sigma)** of the chat, agent and structural queues: streaming maximum likelihood from the
  re-access gaps of each queue (the inter-turn gaps of its sessions; for the structural queue, the gaps between
  uses of one shared prefix, measured when the policy ranks by hit density): sufficient statistics
  ``n, sum ln g, sum ln^2 g`` decayed by ``gap_decay`` per window, then ``mu = mean ln g``, ``sigma = std ln g``,
  with ``gap_prior`` pseudo-gaps at the current values (a gap is seen only when the next turn comes, so early windows
  see the short ones alone);
* **position decay gamma**: the structural blocks' hit ratio by relative offset ``x`` (in 10 bins) is fitted by
  weighted least squares to ``c * (1 - x ** gamma)`` over a log grid of gamma (``c`` solved for each); the fit
  moves gamma by an EMA in log space (``gamma_rate``). A small gamma means hits fall off right after the head of a
  prompt, a large one that they stay until its tail;
* **queue weights alpha**: each queue's hit blocks per block it holds, divided by the mean over the queues, through
  a softmax of temperature ``temperature``, scaled so that the weights average 1, then an EMA in log space
  (``alpha_rate``). The priority-eviction queue has no weight (it is emptied first).

Meta-parameters and defaults are in :class:`OnlineConfig`. The same learner runs as a replay callback
(:meth:`SAEOnlineLearner.callback`, so ``python train.py replay --policy saecache`` is the full adaptive method)
and inside the Gymnasium environment through ``agents.SAEOnlineAgent``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from agents.base import BaseAgent
from sae_env.metrics import WindowStats
from sae_env.policies.saecache import AG, CH, PARAM_SPECS, ST, SAECachePolicy
from sae_env.trace import TokenType, Trace

_SPECS = {p.name: p for p in PARAM_SPECS}
_GAMMA_GRID = np.exp(np.linspace(math.log(0.05), math.log(20.0), 81))
_X_BINS = 10


@dataclass(frozen=True)
class OnlineConfig:
    """Meta-parameters of the feedback loop (the only knobs; everything else is learned)."""

    type_rate: float = 0.3  # EMA rate of the token-type weights
    mae_weight: float = 4.0  # weight of the miss-after-eviction rate against the hit rate in a type's target
    gap_decay: float = 0.7  # per-window forgetting factor of the gap statistics (1 = never forget)
    min_gaps: int = 10  # gaps needed before (mu, sigma) are refitted
    gap_prior: float = 50.0  # pseudo-gaps at the current (mu, sigma): early windows only see short gaps
    gamma_rate: float = 0.3  # EMA rate (log space) of gamma
    min_structural_refs: int = 50  # structural references per window needed to refit gamma
    alpha_rate: float = 0.3  # EMA rate (log space) of the queue weights
    temperature: float = 3.0  # softmax temperature over relative queue efficiencies (lower = sharper)

    def __post_init__(self):
        for name in ("type_rate", "gamma_rate", "alpha_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"OnlineConfig.{name} must lie in [0, 1], got {getattr(self, name)}")
        if not self.gap_prior >= 0:
            raise ValueError(f"OnlineConfig.gap_prior must be >= 0, got {self.gap_prior}")
        if not 0 < self.gap_decay <= 1:
            raise ValueError(f"OnlineConfig.gap_decay must lie in (0, 1], got {self.gap_decay}")
        if not self.temperature > 0:
            raise ValueError(f"OnlineConfig.temperature must be positive, got {self.temperature}")


def _clip(name: str, v: float) -> float:
    return _SPECS[name].clip(v)


def lognormal_mle(gaps: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood (mu, sigma) of a log-normal from positive samples."""
    lg = np.log(np.asarray(gaps, dtype=np.float64))
    return float(lg.mean()), float(lg.std())


def fit_gamma(x: np.ndarray, hit_ratio: np.ndarray, weight: np.ndarray) -> float | None:
    """Weighted least-squares gamma of ``hit_ratio ~ c * (1 - x ** gamma)`` over a log grid, the scale ``c`` solved
    for each gamma (None without signal)."""
    ok = weight > 0
    if ok.sum() < 2 or not (hit_ratio[ok] > 0).any():
        return None
    x, h, w = x[ok], np.clip(hit_ratio[ok], 0, 1), weight[ok]
    model = 1.0 - x[None, :] ** _GAMMA_GRID[:, None]  # grid x bins
    c = (model * (w * h)[None, :]).sum(axis=1) / np.maximum((model * model * w[None, :]).sum(axis=1), 1e-12)
    err = (w[None, :] * (h[None, :] - c[:, None] * model) ** 2).sum(axis=1)
    return float(_GAMMA_GRID[int(np.argmin(err))])


def structural_offset_profile(trace: Trace, stats: WindowStats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean relative offset, hit ratio and references per bin of the SYSTEM/TEMPLATE prompt blocks of a window.

    The relative offset is the policy's ``x = depth / prompt blocks`` (the first block at 0)."""
    a, b = stats.start, stats.start + stats.requests
    off = trace.prompt_offsets
    n_blocks = np.diff(off[a:b + 1])
    types = trace.prompt_types[off[a]:off[b]]
    pos = np.arange(types.size, dtype=np.int64) - np.repeat(off[a:b] - off[a], n_blocks)
    n_of = np.repeat(np.maximum(n_blocks, 1), n_blocks)
    hit = pos < np.repeat(np.asarray(stats.hits_per_request, dtype=np.int64), n_blocks)
    st = types <= TokenType.TEMPLATE
    x = pos[st] / n_of[st]
    xbin = np.minimum((x * _X_BINS).astype(np.int64), _X_BINS - 1)
    refs = np.bincount(xbin, minlength=_X_BINS).astype(np.float64)
    hits = np.bincount(xbin[hit[st]], minlength=_X_BINS).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_x = np.where(refs > 0, np.bincount(xbin, weights=x, minlength=_X_BINS) / refs, 0.0)
        ratio = np.where(refs > 0, hits / refs, 0.0)
    return mean_x, ratio, refs


class SAEOnlineLearner:
    """Sets a SAECache policy's parameters after each window (see the module docstring for the rules)."""

    def __init__(self, config: OnlineConfig | None = None, **overrides: Any):
        if config is not None and overrides:
            raise ValueError("give an OnlineConfig or keyword overrides, not both")
        self.config = config or OnlineConfig(**overrides)
        self._gaps = {CH: np.zeros(3), AG: np.zeros(3), ST: np.zeros(3)}
        self.history: list[dict[str, float]] = []

    def reset(self) -> None:
        self._gaps = {CH: np.zeros(3), AG: np.zeros(3), ST: np.zeros(3)}
        self.history = []

    # -- the feedback loop ---------------------------------------------------------------------------------
    def propose(self, stats: WindowStats, policy: SAECachePolicy, trace: Trace | None) -> dict[str, float]:
        """New parameter values from one window (does not apply them)."""
        cfg = self.config
        params = policy.params
        new: dict[str, float] = {}
        sw = policy.switches

        if sw["type_weights"]:
            refs = np.asarray(stats.refs_by_type, dtype=np.float64)
            hits = np.asarray(stats.hits_by_type, dtype=np.float64)
            mae = np.asarray(stats.miss_after_eviction_by_type, dtype=np.float64)
            held = np.asarray(stats.occupancy_by_type, dtype=np.float64)
            present = (refs > 0) | (held > 0)
            with np.errstate(invalid="ignore", divide="ignore"):
                score = np.where(refs > 0, (hits + cfg.mae_weight * mae) / refs, 0.0)
            if present.any() and score[present].mean() > 0:
                target = score / score[present].mean()
                for t in TokenType:
                    if present[t]:
                        name = f"w_{t.name.lower()}"
                        new[name] = _clip(name, (1 - cfg.type_rate) * params[name] + cfg.type_rate * target[t])

        gap_stats = stats.policy.get("gap_stats", {})
        for q, key, mu_name, sigma_name in ((CH, "chat", "mu_chat", "sigma_chat"),
                                            (AG, "agent", "mu_agent", "sigma_agent"),
                                            (ST, "structural", "mu_structural", "sigma_structural")):
            window = np.asarray(gap_stats.get(key, (0, 0.0, 0.0)), dtype=np.float64)
            self._gaps[q] = cfg.gap_decay * self._gaps[q] + window
            n, s1, s2 = self._gaps[q]
            if n >= cfg.min_gaps:
                # The prior shrinks the first fits towards the current values: a gap is only observed when the
                # next turn arrives, so the first windows of a trace see the short gaps alone.
                mu0, s0, n0 = params[mu_name], params[sigma_name], cfg.gap_prior
                mu = (s1 + n0 * mu0) / (n + n0)
                sigma = math.sqrt(max((s2 + n0 * (s0 * s0 + mu0 * mu0)) / (n + n0) - mu * mu, 0.0))
                new[mu_name], new[sigma_name] = _clip(mu_name, mu), _clip(sigma_name, sigma)

        if sw["position_decay"] and trace is not None and stats.hits_per_request:
            x, ratio, refs = structural_offset_profile(trace, stats)
            if refs.sum() >= cfg.min_structural_refs:
                g = fit_gamma(x, ratio, refs)
                if g is not None:
                    lg = (1 - cfg.gamma_rate) * math.log(params["gamma"]) + cfg.gamma_rate * math.log(g)
                    new["gamma"] = _clip("gamma", math.exp(lg))

        if sw["adaptive_alpha"] and sw["multi_queue"]:
            qh = stats.policy.get("queue_hits")
            occ = stats.policy.get("queue_occupancy")
            if qh and occ:
                queues = [(q, name) for q, name in ((ST, "alpha_st"), (CH, "alpha_ch"), (AG, "alpha_ag"))
                          if occ[q] > 0]
                eff = np.array([qh[q] / occ[q] for q, _ in queues], dtype=np.float64)
                if len(queues) >= 2 and eff.mean() > 0:
                    z = eff / eff.mean() / cfg.temperature
                    w = np.exp(z - z.max())
                    target = w / w.mean()
                    for (_, name), tgt in zip(queues, target, strict=True):
                        lg = (1 - cfg.alpha_rate) * math.log(params[name]) + cfg.alpha_rate * math.log(
                            max(tgt, _SPECS[name].low))
                        new[name] = _clip(name, math.exp(lg))
        return new

    def update(self, stats: WindowStats, policy: SAECachePolicy, trace: Trace | None = None) -> dict[str, float]:
        """Propose and apply new parameters; returns the policy's parameters after the update."""
        new = self.propose(stats, policy, trace)
        if new:
            policy.set_params(new)
        self.history.append(policy.params)
        return policy.params

    def callback(self):
        """A :class:`~sae_env.replay.Replay` window callback running this learner."""
        def on_window(stats: WindowStats, replay) -> None:
            if not isinstance(replay.policy, SAECachePolicy):
                raise TypeError(f"the SAECache learner needs a saecache policy, got {replay.policy.name!r}")
            self.update(stats, replay.policy, replay.trace)
        return on_window

    def describe(self) -> dict[str, Any]:
        return asdict(self.config)


class SAEOnlineAgent(BaseAgent):
    """The learners run through the env (needs the ``saecache`` policy).

    After every step it reads the window's :class:`~sae_env.metrics.WindowStats` (``env.unwrapped.last_stats``) and
    the policy, proposes the next parameters and returns them as its next action. The env applies that action at the
    start of the next step, exactly where the replay-callback form (``Replay(..., callbacks=[learner.callback()])``)
    applies them, and the env's exact action round trip makes both forms replay identically (a test checks it).
    """

    name = "sae_online"

    def __init__(self, config: OnlineConfig | None = None, **overrides: Any):
        super().__init__()
        self.learner = SAEOnlineLearner(config, **overrides)
        self._next: dict[str, float] | None = None

    @classmethod
    def replay_callback(cls) -> Any:
        """A fresh learner as a :class:`~sae_env.replay.Replay` window callback (``replay``'s adaptive mode)."""
        return SAEOnlineLearner().callback()

    def reset(self, env: Any = None, *, seed: int | None = None) -> None:
        super().reset(env, seed=seed)
        policy = self._env().policy
        if not isinstance(policy, SAECachePolicy):
            name = getattr(policy, "name", None)
            raise ValueError(f"SAEOnlineAgent needs the 'saecache' policy, got {name!r} (call env.reset() first)")
        self.learner.reset()
        self._next = None

    @property
    def params(self) -> dict[str, float]:
        """The parameters the agent will set next (after the last window: the learner's final parameters)."""
        return dict(self._next) if self._next is not None else self._env().params

    def act(self, observation: dict[str, np.ndarray], info: dict[str, Any]) -> np.ndarray:
        env = self._env()
        return env.noop_action() if self._next is None else env.params_to_action(self._next)

    def observe(self, observation: dict[str, np.ndarray], reward: float, terminated: bool, truncated: bool,
                info: dict[str, Any]) -> None:
        env = self._env()
        policy = env.policy
        # What SAEOnlineLearner.update does after a window, without touching the policy: the env applies the
        # proposal when it receives the next action.
        params = policy.params
        params.update(self.learner.propose(env.last_stats, policy, env.trace))
        self._next = params
        self.learner.history.append(dict(params))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.learner.describe()}
