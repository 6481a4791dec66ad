"""PPO that learns to set an eviction policy's parameters window by window (CleanRL-style, one readable file).

Model: an actor-critic pair of MLPs (``tanh``, orthogonal init) over the flattened Dict observation (keys in the
observation space's order, as :func:`gymnasium.spaces.utils.flatten`). Actions are Gaussian over the env's
``Box(-1, 1, d)``: ``mean = action_offset + actor(obs)`` with a state-independent learned log-std. The actor's last
layer starts at zero and ``action_offset = env.params_to_action(env.default_params)``, so the untrained policy's
mean action *is* the policy's defaults (an untrained PPOAgent replays exactly like ``FixedAgent()``), and PPO
explores around SAECache's defaults rather than around the middle of the box. Sampled actions are stored unclipped
(their log-probabilities stay exact) and clipped to ``[-1, 1]`` before they reach the env.

Rollouts: ``num_envs`` copies of the env in a gymnasium 1.x vector env (``SyncVectorEnv`` by default,
``AsyncVectorEnv`` with ``vector="async"``), NEXT_STEP autoreset chosen explicitly. Under NEXT_STEP the step after
an episode ends ignores its action and returns the reset observation with reward 0: that step is not a transition.
The rollout marks it ``valid = False``; it gets no advantage, and the update leaves it out. Episode ends are
``terminated`` (the trace is exhausted: no bootstrap) or ``truncated`` (``max_steps``: bootstrap from the value of
the final observation, which NEXT_STEP returns at the ending step and the rollout keeps in the masked slot).

Update: GAE(``gamma``, ``gae_lambda``) over valid steps; ``update_epochs`` passes over shuffled minibatches of the
valid steps; clipped surrogate objective (``clip_coef``), clipped value loss, entropy bonus (``ent_coef``),
per-minibatch advantage normalisation, Adam with global gradient-norm clipping (``max_grad_norm``), optional linear
learning-rate annealing and early stop on ``target_kl``.

Metrics: one dict per iteration with namespaced keys (``charts/episodic_return``, ``charts/mean_reward``,
``losses/value_loss``, ``losses/policy_loss``, ``losses/entropy``, ``losses/approx_kl``, ``losses/clipfrac``,
``losses/explained_variance``, ...). ``perf/sps`` (steps per wall-clock second) is the only value that differs
between runs of one seed.

Determinism: ``torch.manual_seed(seed)``, one torch thread (``torch.set_num_threads(1)``, process-wide), a seeded
``torch.Generator`` for action noise, a seeded numpy generator for minibatches, and the vector env reset once with
``seed`` (later episodes draw from the envs' own generators). Same seed and config -> identical metrics.

Checkpoints: ``torch.save`` of ``{"format", "version", "config" (JSON string), "state_dict"}``; loaded with
``torch.load(weights_only=True)``. The config holds the run configuration, the model's shape and what the env must
match (policy, parameter names, observation keys).

Run configuration (``configs/ppo.yaml``)::

    seed: 0
    env: {...}              # agents.evaluate.make_env options (trace, capacity, window, segment_requests, reward...)
    trace_seeds: [1, 2, 3]  # optional: train on these seeds of the env's generated trace (a 'seed' key in its spec)
    ppo: {...}              # PPOConfig fields
    eval: {seed: 0, trace_seed: 0, env: {...}}   # optional: after training, PPOAgent vs FixedAgent() on this env

Why one piece (~720 lines): CleanRL's convention, one readable file from the network through rollouts, GAE, the
update and training to the agent and its command, so the algorithm reads top to bottom without jumping between
modules.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from torch import nn

from agents.base import BaseAgent
from agents.evaluate import evaluate, make_env
from sae_env.files import atomic_path, write_json

__all__ = ["ActorCritic", "PPOAgent", "PPOConfig", "Rollout", "RolloutState", "TrainResult",
           "collect_rollout", "compute_gae", "flatten_obs", "load_checkpoint", "make_vector_env", "ppo_update",
           "read_run_config", "run", "save_checkpoint", "train"]

CHECKPOINT_FORMAT = "saecache-ppo"
CHECKPOINT_VERSION = 1
RUN_KEYS = {"seed", "env", "trace_seeds", "ppo", "eval", "wandb"}


# ----------------------------------------------------------------------------------------------------------------
# Configuration


@dataclass
class PPOConfig:
    """PPO hyper-parameters (CleanRL's names). One iteration = ``num_steps`` vector steps of ``num_envs`` envs."""

    total_steps: int = 2048  # env steps (all envs, masked autoreset steps included)
    num_envs: int = 2
    num_steps: int = 32
    vector: str = "sync"  # "sync" or "async"
    learning_rate: float = 3e-4
    anneal_lr: bool = True
    gamma: float = 0.9
    gae_lambda: float = 0.95
    update_epochs: int = 4
    num_minibatches: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    hidden: tuple[int, ...] = (64, 64)
    init_log_std: float = -1.0  # std exp(-1) = 0.37 of the half-width of the action box

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        for name in ("total_steps", "num_envs", "num_steps", "update_epochs", "num_minibatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ppo.{name} must be an integer >= 1, got {v!r}")
        if self.vector not in ("sync", "async"):
            raise ValueError(f"ppo.vector must be 'sync' or 'async', got {self.vector!r}")
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ppo.{name} must lie in [0, 1], got {getattr(self, name)!r}")
        for name in ("learning_rate", "clip_coef", "max_grad_norm"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"ppo.{name} must be positive, got {getattr(self, name)!r}")
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"ppo.hidden must list layer widths >= 1, got {self.hidden!r}")
        if self.target_kl is not None and not self.target_kl > 0:
            raise ValueError(f"ppo.target_kl must be positive or null, got {self.target_kl!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "ppo") -> PPOConfig:
        data = dict(data or {})
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"{where}: unknown PPO option(s) {unknown}; valid: {sorted(valid)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d


def read_run_config(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A run configuration from a YAML file or a mapping, checked (unknown keys raise ValueError)."""
    if isinstance(source, Mapping):
        data, where = dict(source), "ppo run config"
    else:
        from sae_env.files import read_mapping, resolve_paths

        data, where = read_mapping(source, "ppo run config")
        data = resolve_paths(data, Path(source).parent)  # relative trace / predictor paths: next to the file
    unknown = sorted(set(data) - RUN_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(RUN_KEYS)}")
    if not isinstance(data.get("env", {}), Mapping):
        raise ValueError(f"{where}: 'env' must be a mapping of PrefixCacheEnv options")
    seeds = data.get("trace_seeds")
    if seeds is not None and (not isinstance(seeds, Sequence) or isinstance(seeds, str) or not seeds
                              or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ValueError(f"{where}: 'trace_seeds' must be a non-empty list of integers, got {seeds!r}")
    PPOConfig.from_dict(data.get("ppo"), where=f"{where}: ppo")  # validate early
    from sae_env.experiment import WandbConfig

    WandbConfig.from_config(data.get("wandb"), where=f"{where}: wandb")
    data.setdefault("seed", 0)
    data.setdefault("env", {})
    return data


def _trace_with_seed(spec: Any, seed: int) -> dict[str, Any]:
    if not isinstance(spec, Mapping) or "source" not in spec:
        raise ValueError("trace_seeds needs the env's 'trace' to be a generator spec such as "
                         "{source: synthetic, preset: shift}")
    return {**spec, "seed": int(seed)}


def seeded_env_config(env_config: Mapping[str, Any], trace_seeds: Sequence[int] | None) -> dict[str, Any]:
    """``env_config`` whose trace is drawn (at each reset, from the env's generator) among the traces of the given
    generator seeds; the traces are generated once here and shared read-only by every env built from the result."""
    config = dict(env_config)
    if not trace_seeds:
        return config
    from sae_env.sources import trace_from_spec

    traces = [trace_from_spec(_trace_with_seed(config.get("trace"), s))[0] for s in trace_seeds]
    config["trace"] = _TracePool(traces)
    return config


class _TracePool:
    """A picklable trace factory: one of a fixed list of traces, uniformly from the env's generator."""

    def __init__(self, traces: list) -> None:
        self.traces = traces

    def __call__(self, rng: np.random.Generator):
        return self.traces[int(rng.integers(len(self.traces)))]


# ----------------------------------------------------------------------------------------------------------------
# Observations and the model


def flatten_obs(space: spaces.Dict, obs: Mapping[str, np.ndarray]) -> np.ndarray:
    """A Dict observation (one env's, or a vector env's batch) as float32 vectors, keys in the space's order.

    For one env this equals ``gymnasium.spaces.utils.flatten(space, obs)`` (a test checks it).
    """
    return np.concatenate([np.asarray(obs[k], dtype=np.float32) for k in space.spaces], axis=-1)


def _layer(n_in: int, n_out: int, std: float = math.sqrt(2.0)) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def _mlp(n_in: int, hidden: Sequence[int], n_out: int, last_std: float) -> nn.Sequential:
    mods: list[nn.Module] = []
    for h in hidden:
        mods += [_layer(n_in, h), nn.Tanh()]
        n_in = h
    mods.append(_layer(n_in, n_out, last_std))
    return nn.Sequential(*mods)


class ActorCritic(nn.Module):
    """Critic ``V(obs)`` and Gaussian actor ``N(action_offset + actor(obs), exp(log_std))`` (module docstring)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: Sequence[int] = (64, 64), init_log_std: float = -1.0,
                 action_offset: Sequence[float] | np.ndarray | None = None):
        super().__init__()
        self.obs_dim, self.act_dim, self.hidden = int(obs_dim), int(act_dim), tuple(int(h) for h in hidden)
        self.critic = _mlp(obs_dim, hidden, 1, 1.0)
        self.actor = _mlp(obs_dim, hidden, act_dim, 0.0)  # zero last layer: the mean starts at action_offset
        self.log_std = nn.Parameter(torch.full((act_dim,), float(init_log_std)))
        offset = np.zeros(act_dim, dtype=np.float32) if action_offset is None else np.asarray(action_offset,
                                                                                              dtype=np.float32)
        if offset.shape != (act_dim,):
            raise ValueError(f"action_offset has shape {offset.shape}, need ({act_dim},)")
        self.register_buffer("action_offset", torch.as_tensor(offset))

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.action_offset + self.actor(x)

    def distribution(self, x: torch.Tensor) -> torch.distributions.Normal:
        mean = self.mean(x)
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean))

    def act(self, x: torch.Tensor, generator: torch.Generator | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sampled action (unclipped), its log-probability and the state value."""
        mean = self.mean(x)
        std = self.log_std.exp().expand_as(mean)
        # Noise drawn on the CPU generator, then moved: one seed, the same draws on every device.
        action = mean + std * torch.randn(mean.shape, generator=generator).to(mean.device)
        logprob = torch.distributions.Normal(mean, std).log_prob(action).sum(-1)
        return action, logprob, self.value(x)


# ----------------------------------------------------------------------------------------------------------------
# Rollouts


def make_vector_env(env_config: Mapping[str, Any], num_envs: int, vector: str = "sync") -> VectorEnv:
    """``num_envs`` PrefixCacheEnvs from one config in a gymnasium vector env with NEXT_STEP autoreset."""
    config = dict(env_config)
    fns = [lambda: make_env(config) for _ in range(num_envs)]
    cls = SyncVectorEnv if vector == "sync" else AsyncVectorEnv
    return cls(fns, autoreset_mode=AutoresetMode.NEXT_STEP)


@dataclass
class RolloutState:
    """What carries over between rollouts: the next observation, pending autoresets, running episode sums."""

    obs: np.ndarray  # (N, obs_dim) float32
    pending_reset: np.ndarray  # (N,) bool: the last step ended an episode, so the next step is the autoreset step
    ep_return: np.ndarray  # (N,) float64
    ep_length: np.ndarray  # (N,) int64


@dataclass
class Rollout:
    """``num_steps`` x ``num_envs`` transitions. ``valid`` is False on NEXT_STEP autoreset steps (not transitions).

    ``obs[t]`` is what the policy saw at step ``t``; on an autoreset step that is the final observation of the
    episode that ended at ``t - 1`` (its value bootstraps a truncated episode). ``next_obs`` / ``next_value``: the
    observation after the last step and its value.
    """

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    valid: np.ndarray
    next_obs: np.ndarray
    next_value: np.ndarray
    episodes: list[tuple[float, int]] = field(default_factory=list)  # (return, length) of episodes that ended


def initial_state(envs: VectorEnv, seed: int | None) -> RolloutState:
    obs, _ = envs.reset(seed=seed)
    n = envs.num_envs
    return RolloutState(obs=flatten_obs(envs.single_observation_space, obs), pending_reset=np.zeros(n, dtype=bool),
                        ep_return=np.zeros(n), ep_length=np.zeros(n, dtype=np.int64))


@torch.no_grad()
def collect_rollout(envs: VectorEnv, model: ActorCritic, state: RolloutState, num_steps: int,
                    generator: torch.Generator | None = None) -> Rollout:
    """Step the vector env ``num_steps`` times with sampled actions; updates ``state`` in place."""
    n, d = envs.num_envs, model.act_dim
    space = envs.single_observation_space
    device = model.log_std.device
    r = Rollout(obs=np.zeros((num_steps, n, model.obs_dim), dtype=np.float32),
                actions=np.zeros((num_steps, n, d), dtype=np.float32), logprobs=np.zeros((num_steps, n)),
                values=np.zeros((num_steps, n)), rewards=np.zeros((num_steps, n)),
                terminated=np.zeros((num_steps, n), dtype=bool), truncated=np.zeros((num_steps, n), dtype=bool),
                valid=np.zeros((num_steps, n), dtype=bool), next_obs=state.obs, next_value=np.zeros(n))
    for t in range(num_steps):
        x = torch.as_tensor(state.obs, device=device)
        action, logprob, value = model.act(x, generator)
        a = action.cpu().numpy()
        r.obs[t], r.actions[t], r.logprobs[t], r.values[t] = state.obs, a, logprob.cpu().numpy(), value.cpu().numpy()
        r.valid[t] = ~state.pending_reset
        obs, reward, terminated, truncated, _ = envs.step(np.clip(a, -1.0, 1.0))
        valid = r.valid[t]
        # On the autoreset step the env ignored the action and returned reward 0 and the reset observation.
        r.rewards[t] = np.where(valid, reward, 0.0)
        r.terminated[t] = terminated & valid
        r.truncated[t] = truncated & valid
        ended = r.terminated[t] | r.truncated[t]
        state.ep_return += r.rewards[t]
        state.ep_length += valid
        for i in np.flatnonzero(ended):
            r.episodes.append((float(state.ep_return[i]), int(state.ep_length[i])))
        state.ep_return[ended] = 0.0
        state.ep_length[ended] = 0
        state.pending_reset = ended
        state.obs = flatten_obs(space, obs)
    r.next_obs = state.obs
    r.next_value = model.value(torch.as_tensor(state.obs, device=device)).cpu().numpy().astype(np.float64)
    return r


def compute_gae(rewards: np.ndarray, values: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                valid: np.ndarray, next_value: np.ndarray, gamma: float, gae_lambda: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns, ``(T, N)`` each; zero on invalid (autoreset) steps.

    ``delta_t = r_t + gamma * V_{t+1} * (1 - terminated_t) - V_t`` where ``V_{t+1}`` is the value of the next
    observation (``values[t + 1]``, or ``next_value`` after the last step: after an episode end that is the final
    observation, kept in the autoreset slot); ``A_t = delta_t + gamma * lambda * (1 - ended_t) * A_{t+1}``.
    """
    T = rewards.shape[0]
    adv = np.zeros_like(values, dtype=np.float64)
    last = np.zeros(values.shape[1:], dtype=np.float64)
    ended = terminated | truncated
    for t in range(T - 1, -1, -1):
        nv = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * nv * (1.0 - terminated[t]) - values[t]
        last = np.where(valid[t], delta + gamma * gae_lambda * (1.0 - ended[t]) * last, 0.0)
        adv[t] = last
    return adv, np.where(valid, adv + values, 0.0)


def ppo_update(model: ActorCritic, optimizer: torch.optim.Optimizer, rollout: Rollout, advantages: np.ndarray,
               returns: np.ndarray, cfg: PPOConfig, rng: np.random.Generator) -> dict[str, float]:
    """The clipped-objective update over the rollout's valid steps; returns the ``losses/*`` metrics."""
    idx = np.flatnonzero(rollout.valid.reshape(-1))
    if idx.size == 0:
        return {}
    dev = model.log_std.device
    b_obs = torch.as_tensor(rollout.obs.reshape(-1, model.obs_dim)[idx], device=dev)
    b_act = torch.as_tensor(rollout.actions.reshape(-1, model.act_dim)[idx], device=dev)
    b_logp = torch.as_tensor(rollout.logprobs.reshape(-1)[idx], dtype=torch.float32, device=dev)
    b_adv = torch.as_tensor(advantages.reshape(-1)[idx], dtype=torch.float32, device=dev)
    b_ret = torch.as_tensor(returns.reshape(-1)[idx], dtype=torch.float32, device=dev)
    b_val = torch.as_tensor(rollout.values.reshape(-1)[idx], dtype=torch.float32, device=dev)
    n = idx.size
    mb = max(1, n // cfg.num_minibatches)
    clipfracs: list[float] = []
    stats: dict[str, float] = {}
    for _epoch in range(cfg.update_epochs):
        order = rng.permutation(n)
        for start in range(0, n, mb):
            mbi = torch.as_tensor(order[start:start + mb], device=dev)
            dist = model.distribution(b_obs[mbi])
            newlogp = dist.log_prob(b_act[mbi]).sum(-1)
            entropy = dist.entropy().sum(-1)
            newval = model.value(b_obs[mbi])
            logratio = newlogp - b_logp[mbi]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs.append(((ratio - 1.0).abs() > cfg.clip_coef).float().mean().item())
            adv = b_adv[mbi]
            if cfg.norm_adv and adv.numel() > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
            if cfg.clip_vloss:
                v_clipped = b_val[mbi] + (newval - b_val[mbi]).clamp(-cfg.clip_coef, cfg.clip_coef)
                v_loss = 0.5 * torch.max((newval - b_ret[mbi]) ** 2, (v_clipped - b_ret[mbi]) ** 2).mean()
            else:
                v_loss = 0.5 * ((newval - b_ret[mbi]) ** 2).mean()
            ent = entropy.mean()
            loss = pg_loss - cfg.ent_coef * ent + cfg.vf_coef * v_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            stats = {"losses/policy_loss": pg_loss.item(), "losses/value_loss": v_loss.item(),
                     "losses/entropy": ent.item(), "losses/old_approx_kl": old_approx_kl.item(),
                     "losses/approx_kl": approx_kl.item()}
        if cfg.target_kl is not None and stats["losses/approx_kl"] > cfg.target_kl:
            break
    y_pred, y_true = b_val.cpu().numpy().astype(np.float64), b_ret.cpu().numpy().astype(np.float64)
    var_y = np.var(y_true)
    stats["losses/clipfrac"] = float(np.mean(clipfracs))
    stats["losses/explained_variance"] = float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)
    return stats


# ----------------------------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainResult:
    model: ActorCritic
    metrics: list[dict[str, Any]]
    config: dict[str, Any]  # JSON-able: the run configuration and the model / env facts a checkpoint records


def _model_meta(env: Any, cfg: PPOConfig, offset: np.ndarray) -> dict[str, Any]:
    return {"obs_dim": int(spaces.utils.flatdim(env.observation_space)), "act_dim": int(env.action_space.shape[0]),
            "hidden": list(cfg.hidden), "init_log_std": cfg.init_log_std, "policy": env.policy_name,
            "param_names": [p.name for p in env.param_specs], "obs_keys": list(env.observation_space.spaces),
            "action_offset": [float(x) for x in offset]}


def train(run_config: Mapping[str, Any], log: Any = None, device: str = "cpu") -> TrainResult:
    """Train PPO from a run configuration (see the module docstring); ``log(metrics_dict)`` per iteration.

    ``device`` (``auto``, ``cpu``, ``cuda``; :func:`agents.device.resolve_device`): where the model trains (the
    weights start from the same seeded CPU initialisation everywhere); the returned model is on the CPU.
    """
    from agents.device import resolve_device

    dev = resolve_device(device)
    config = read_run_config(run_config)
    cfg = PPOConfig.from_dict(config.get("ppo"))
    run_json = _jsonable(config)  # before any work: a checkpoint must be able to record it
    seed = int(config["seed"])
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    env_config = seeded_env_config(config["env"], config.get("trace_seeds"))
    probe = make_env(env_config)
    offset = probe.params_to_action(probe.default_params)
    meta = _model_meta(probe, cfg, offset)
    probe.close()
    model = ActorCritic(meta["obs_dim"], meta["act_dim"], cfg.hidden, cfg.init_log_std, offset).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate, eps=1e-5)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    envs = make_vector_env(env_config, cfg.num_envs, cfg.vector)
    metrics: list[dict[str, Any]] = []
    try:
        state = initial_state(envs, seed)
        iterations = max(1, cfg.total_steps // (cfg.num_envs * cfg.num_steps))
        global_step = 0
        t0 = time.perf_counter()
        for it in range(1, iterations + 1):
            lr = cfg.learning_rate * (1.0 - (it - 1) / iterations if cfg.anneal_lr else 1.0)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rollout = collect_rollout(envs, model, state, cfg.num_steps, gen)
            global_step += cfg.num_envs * cfg.num_steps
            adv, ret = compute_gae(rollout.rewards, rollout.values, rollout.terminated, rollout.truncated,
                                   rollout.valid, rollout.next_value, cfg.gamma, cfg.gae_lambda)
            row: dict[str, Any] = {"iteration": it, "global_step": global_step, "charts/learning_rate": lr,
                                   "charts/mean_reward": float(rollout.rewards[rollout.valid].mean()),
                                   "charts/valid_fraction": float(rollout.valid.mean()),
                                   "charts/episodes": len(rollout.episodes)}
            if rollout.episodes:
                row["charts/episodic_return"] = float(np.mean([e[0] for e in rollout.episodes]))
                row["charts/episodic_length"] = float(np.mean([e[1] for e in rollout.episodes]))
            row.update(ppo_update(model, optimizer, rollout, adv, ret, cfg, rng))
            row["charts/action_std"] = float(model.log_std.exp().mean().item())
            row["perf/sps"] = global_step / max(time.perf_counter() - t0, 1e-9)
            metrics.append(row)
            if log is not None:
                log(row)
    finally:
        envs.close()
    out_config = {"run": run_json, "ppo": cfg.to_dict(), "model": meta, "device": str(dev)}
    return TrainResult(model=model.cpu(), metrics=metrics, config=out_config)


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    raise ValueError(f"the run configuration must be JSON-able (YAML scalars, lists, mappings), got {type(x)}")


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path: str | os.PathLike, model: ActorCritic, config: Mapping[str, Any]) -> Path:
    """Write the model and its JSON-able config (a ``TrainResult.config``)."""
    path = Path(path)
    with atomic_path(path) as tmp:  # a reader never sees half a checkpoint
        torch.save({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "config": json.dumps(config),
                    "state_dict": model.state_dict()}, tmp)
    return path


def load_checkpoint(path: str | os.PathLike) -> tuple[ActorCritic, dict[str, Any]]:
    """The model and config of a checkpoint, read with ``torch.load(weights_only=True)`` (no pickle)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    try:
        blob = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a foreign or damaged file
        raise ValueError(f"{path}: not a readable PPO checkpoint ({type(e).__name__}: {e})") from None
    fmt = blob.get("format") if isinstance(blob, dict) else None
    if fmt != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a PPO checkpoint (format {fmt!r}, expected {CHECKPOINT_FORMAT!r})")
    if blob.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {blob.get('version')!r}, this code reads {CHECKPOINT_VERSION}")
    config = json.loads(blob["config"])
    m = config["model"]
    model = ActorCritic(m["obs_dim"], m["act_dim"], m["hidden"], m["init_log_std"], m["action_offset"])
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, config


# ----------------------------------------------------------------------------------------------------------------
# The agent


class PPOAgent(BaseAgent):
    """A trained PPO policy: the deterministic mean action (clipped to the box) unless ``deterministic=False``;
    runs on ``device`` (default the CPU: see :mod:`agents.device`).

    Give ``checkpoint`` (a path) or ``model`` (with ``config``, a ``TrainResult.config``, to check the env against).
    With neither, :meth:`reset` builds an untrained model for the env (initialised from ``seed``, default 0),
    whose mean action is the env's default parameters: ``make_agent("ppo")`` then plays like ``FixedAgent()``.
    """

    name = "ppo"

    def __init__(self, checkpoint: str | os.PathLike | None = None, model: ActorCritic | None = None,
                 config: Mapping[str, Any] | None = None, deterministic: bool = True, seed: int | None = None,
                 device: str = "cpu"):
        super().__init__()
        from agents.device import resolve_device

        self.device = resolve_device(device)
        if checkpoint is not None and model is not None:
            raise ValueError("PPOAgent takes a checkpoint (a path) or a model, not both")
        if checkpoint is not None:
            model, config = load_checkpoint(checkpoint)
        self.model: ActorCritic | None = model
        self._seed = 0 if seed is None else int(seed)
        self.config = dict(config or {})
        self.deterministic = bool(deterministic)
        self._gen = torch.Generator().manual_seed(self._seed)
        self._space: spaces.Dict | None = None

    def reset(self, env: Any = None, *, seed: int | None = None) -> None:
        super().reset(env, seed=seed)
        env = self._env()
        dim = spaces.utils.flatdim(env.observation_space)
        if self.model is None:
            cfg = PPOConfig()
            with torch.random.fork_rng():  # leaves the caller's torch RNG as it was
                torch.manual_seed(self._seed)
                self.model = ActorCritic(dim, env.action_space.shape[0], cfg.hidden, cfg.init_log_std,
                                         env.params_to_action(env.default_params))
        if dim != self.model.obs_dim or env.action_space.shape[0] != self.model.act_dim:
            raise ValueError(f"PPOAgent: the model takes {self.model.obs_dim} observation values and gives "
                             f"{self.model.act_dim} actions; this env has {dim} and {env.action_space.shape[0]}")
        m = self.config.get("model", {})
        if m.get("policy") not in (None, env.policy_name):
            raise ValueError(f"PPOAgent: trained for policy {m['policy']!r}, the env runs {env.policy_name!r}")
        names = [p.name for p in env.param_specs]
        if m.get("param_names") not in (None, names):
            raise ValueError(f"PPOAgent: trained for parameters {m['param_names']}, the env has {names}")
        self.model.to(self.device)
        self._space = env.observation_space
        if env.param_specs:
            env.params_to_action(env.default_params)  # the env then decodes the defaults' action exactly
        if seed is not None and not self.deterministic:
            self._gen.manual_seed(int(seed))

    @torch.no_grad()
    def act(self, observation: dict[str, np.ndarray], info: dict[str, Any]) -> np.ndarray:
        if self._space is None:
            raise RuntimeError(f"agent {self.name!r}: call reset(env) after env.reset() before act()")
        x = torch.as_tensor(flatten_obs(self._space, observation), device=self.device).unsqueeze(0)
        a = self.model.mean(x) if self.deterministic else self.model.act(x, self._gen)[0]
        return np.clip(a.squeeze(0).cpu().numpy(), -1.0, 1.0).astype(np.float32)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "deterministic": self.deterministic, "device": str(self.device),
                "model": self.config.get("model", {})}


# ----------------------------------------------------------------------------------------------------------------
# Running from a config file: python train.py ppo --config configs/ppo.yaml


def evaluate_trained(result: TrainResult, eval_config: Mapping[str, Any]) -> dict[str, Any]:
    """PPOAgent (mean action) and FixedAgent() (the defaults) on one evaluation episode; summaries and histories.

    ``eval_config``: ``seed`` (episode seed, default 0), ``trace_seed`` (generator seed of the trace, optional),
    ``env`` (overrides of the training env options, e.g. no ``segment_requests`` to play the whole trace).
    """
    from agents.fixed import FixedAgent

    unknown = sorted(set(eval_config) - {"seed", "trace_seed", "env"})
    if unknown:
        raise ValueError(f"eval: unknown key(s) {unknown}; valid: ['env', 'seed', 'trace_seed']")
    env_config = dict(result.config["run"]["env"])
    env_config.update(eval_config.get("env") or {})
    if eval_config.get("trace_seed") is not None:
        env_config["trace"] = _trace_with_seed(env_config.get("trace"), eval_config["trace_seed"])
    seed = int(eval_config.get("seed", 0))
    out = {}
    for agent in (PPOAgent(model=result.model, config=result.config), FixedAgent(name="fixed_default")):
        res = evaluate(agent, env_config, seed)
        out[agent.name] = {"summary": res["summary"], "history": res["history"]}
    return out


def run(config_path: str | os.PathLike | Mapping[str, Any], out_dir: str | os.PathLike | None = None,
        overrides: Mapping[str, Any] | None = None, verbose: bool = True,
        wandb_mode: str | None = None, device: str = "cpu") -> tuple[TrainResult, Path]:
    """Train from a config and write ``checkpoint.pt``, ``metrics.json``, ``config.json`` (and ``eval.json``).

    Every iteration's metrics also go to a W&B run (job type ``ppo``, stepped on ``global_step``; ``charts/*``,
    ``losses/*``, ``perf/*``, and ``eval/<agent>/<key>`` in its summary): ``wandb_mode`` if given, else the config's
    ``wandb`` section (mode, project, entity, group, dir), else W&B's variables, else offline under ``<out>/wandb``.
    """
    from sae_env.experiment import WandbConfig
    from sae_env.tracking import TrainingRun, resolve_target

    config = read_run_config(config_path)
    for k, v in (overrides or {}).items():
        if k == "seed":
            config["seed"] = v
        else:
            config.setdefault("ppo", {})
            config["ppo"] = {**(config["ppo"] or {}), k: v}
    out = Path(out_dir) if out_dir is not None else Path("runs") / time.strftime("ppo-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def log(row: dict[str, Any]) -> None:
        if verbose:
            ret = row.get("charts/episodic_return")
            print(f"iter {row['iteration']:4d} step {row['global_step']:7d} mean reward "
                  f"{row['charts/mean_reward']:.4f}" + (f" episodic return {ret:.3f}" if ret is not None else "")
                  + f" value loss {row.get('losses/value_loss', float('nan')):.4g} std "
                  f"{row['charts/action_std']:.3f} sps {row['perf/sps']:.0f}", file=sys.stderr)

    w = WandbConfig.from_config(config.get("wandb"))
    tracking = TrainingRun(resolve_target(wandb_mode or w.mode, w.project, w.entity, w.dir, out), name=out.name,
                           job_type="ppo", group=w.group, config=_jsonable(config), step_metric="global_step",
                           log=lambda msg: print(msg, file=sys.stderr))

    def log_and_track(row: dict[str, Any]) -> None:
        log(row)
        tracking.log(row)

    try:
        result = train(config, log=log_and_track, device=device)
        save_checkpoint(out / "checkpoint.pt", result.model, result.config)
        write_json(out / "metrics.json", result.metrics, indent=1)
        write_json(out / "config.json", result.config, indent=1)
        if config.get("eval"):
            ev = evaluate_trained(result, config["eval"])
            write_json(out / "eval.json", {k: v["summary"] for k, v in ev.items()}, indent=1)
            tracking.summarize({f"eval/{name}/{k}": x for name, v in ev.items() for k, x in v["summary"].items()})
            if verbose:
                for name, v in ev.items():
                    print(f"eval {name}: token hit rate {v['summary']['token_hit_rate']:.4f}", file=sys.stderr)
    finally:
        tracking.finish()
    return result, out


def cmd_ppo(args: argparse.Namespace) -> int:
    from sae_env.cli import config_path, parse_overrides
    from sae_env.files import apply_overrides

    overrides = parse_overrides(args.set)
    if args.total_steps is not None:
        overrides["ppo.total_steps"] = args.total_steps
    if args.seed is not None:
        overrides["seed"] = args.seed
    path = config_path(args.config)
    config = apply_overrides(read_run_config(path), overrides)
    _, out = run(config, args.out, wandb_mode="disabled" if args.no_wandb else args.wandb, device=args.device)
    print(f"wrote {out / 'checkpoint.pt'}, {out / 'metrics.json'}, {out / 'config.json'}")
    return 0
