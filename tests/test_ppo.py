"""Tests of agents/ppo.py: the NEXT_STEP autoreset step is masked (checked against single envs stepped by hand),
GAE against a direct sum over each episode, the update ignores masked steps, observation flattening equals
gymnasium's, the untrained agent replays exactly like FixedAgent(), PPO improves the hit rate where the starting
parameters are clearly bad (and a sign-flipped update would not), determinism, checkpoints (weights_only), the run
files and the command line."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from agents import FixedAgent, evaluate, make_agent, make_env
from agents.cli import main as cli_main
from agents.ppo import (
    ActorCritic,
    PPOAgent,
    PPOConfig,
    collect_rollout,
    compute_gae,
    flatten_obs,
    initial_state,
    load_checkpoint,
    ppo_update,
    read_run_config,
    save_checkpoint,
    seeded_env_config,
    train,
)
from sae_env.policies.saecache import PAPER

# A few hundred requests per episode, 3 windows: fast (~10 ms per step).
SMALL_ENV = {"capacity": 0.1, "window": 50, "segment_requests": 150}
SMALL_RUN = {"seed": 3, "env": SMALL_ENV, "ppo": {"num_envs": 2, "num_steps": 8, "total_steps": 16}}

# Starting parameters that are clearly bad on the default trace at 10 % capacity for the paper's ranking (hit rate
# 0.62 against 0.80 at SAECache's defaults): agent blocks given up after ~0.5 s idle, chat preferred over structure
# and agents, ... The smoke test trains on the paper's ranking, whose response to these parameters it was sized on.
BAD_START = {"alpha_st": 0.091, "alpha_ch": 10.986, "alpha_ag": 0.091, "w_template": 0.091, "w_user": 10.986,
             "w_assistant": 10.986, "mu_agent": -0.8, "sigma_agent": 0.49, "gamma": 0.091}


def _model_for(env, seed=0, **kw) -> ActorCritic:
    torch.manual_seed(seed)
    return ActorCritic(spaces.utils.flatdim(env.observation_space), env.action_space.shape[0],
                       action_offset=env.params_to_action(env.default_params), **kw)


# ----------------------------------------------------------------------------------------------------------------
# Observations, the initial policy


def test_flatten_obs_equals_gymnasium():
    env = make_env(SMALL_ENV)
    obs, _ = env.reset(seed=0)
    obs, *_ = env.step(env.noop_action())
    flat = flatten_obs(env.observation_space, obs)
    assert flat.dtype == np.float32
    np.testing.assert_array_equal(flat, spaces.utils.flatten(env.observation_space, obs))
    # batched (vector env) observations: row i = env i's flattening
    batch = {k: np.stack([v, v * 0.5]) for k, v in obs.items()}
    rows = flatten_obs(env.observation_space, batch)
    np.testing.assert_array_equal(rows[1], spaces.utils.flatten(env.observation_space,
                                                                {k: v[1] for k, v in batch.items()}))


def test_untrained_agent_replays_exactly_like_the_defaults():
    env = make_env({})
    model = _model_for(env)
    x = torch.zeros(1, model.obs_dim)
    np.testing.assert_array_equal(model.mean(x)[0].detach().numpy(), env.params_to_action(env.default_params))
    a = evaluate(PPOAgent(model=model), {"window": 100}, seed=0)
    b = evaluate(FixedAgent(), {"window": 100}, seed=0)
    assert [w["hit_blocks"] for w in a["history"]] == [w["hit_blocks"] for w in b["history"]]
    assert all(w["params"] == env.default_params for w in a["history"])
    assert a["summary"]["clipped"] == 0
    # make_agent("ppo") without a checkpoint: an untrained model built for the env
    c = evaluate(make_agent("ppo"), {"window": 100}, seed=0)
    assert [w["hit_blocks"] for w in c["history"]] == [w["hit_blocks"] for w in b["history"]]


# ----------------------------------------------------------------------------------------------------------------
# Rollouts: the autoreset step


def test_autoreset_step_is_masked_and_rollout_matches_single_envs():
    # Episodes of 3 and 4 steps, so the two envs end (and autoreset) at different times.
    configs = [dict(SMALL_ENV), dict(SMALL_ENV, segment_requests=200)]
    envs = SyncVectorEnv([lambda c=c: make_env(c) for c in configs], autoreset_mode=AutoresetMode.NEXT_STEP)
    model = _model_for(envs.envs[0], init_log_std=-0.5)
    state = initial_state(envs, seed=11)
    T = 12
    r = collect_rollout(envs, model, state, T, torch.Generator().manual_seed(0))
    envs.close()
    ended = r.terminated | r.truncated
    # valid is False exactly on the step after an episode end, and only there
    expect_valid = np.ones_like(r.valid)
    expect_valid[1:] = ~ended[:-1]
    np.testing.assert_array_equal(r.valid, expect_valid)
    assert (~r.valid[:, 0]).sum() == 3 and (~r.valid[:, 1]).sum() == 2  # 3-step and 4-step episodes
    assert np.all(r.rewards[~r.valid] == 0)
    space = envs.single_observation_space
    keys = list(space.spaces)
    offset = sum(space[k].shape[0] for k in keys[:keys.index("progress")])
    # the masked slot holds the episode's final observation (progress 1): what a truncation would bootstrap from
    assert np.all(r.obs[~r.valid][:, offset] == 1.0)
    # Differential check: each env stepped by hand with the rollout's (clipped) actions on its valid steps.
    for i, cfg in enumerate(configs):
        env = make_env(cfg)
        env.reset(seed=11 + i)  # SyncVectorEnv seeds env i with seed + i
        rewards, terms = [], []
        for t in range(T):
            if not r.valid[t, i]:
                env.reset()  # the autoreset, unseeded: continues the env's generator
                continue
            _, rew, term, trunc, _ = env.step(np.clip(r.actions[t, i], -1, 1))
            rewards.append(rew)
            terms.append(term)
        np.testing.assert_array_equal(r.rewards[r.valid[:, i], i], rewards)
        np.testing.assert_array_equal(r.terminated[r.valid[:, i], i], terms)
    # episodes: (sum of valid rewards, number of valid steps) per ended episode
    lengths = sorted(length for _, length in r.episodes)
    assert lengths == [3, 3, 3, 4, 4]
    first = r.rewards[:3, 0].sum()
    assert any(abs(ret - first) < 1e-12 and length == 3 for ret, length in r.episodes)


def _gae_reference(rewards, values, terminated, truncated, valid, next_value, gamma, lam):
    """Advantages as the direct in-episode sum A_t = sum_k (gamma lambda)^k delta_{t+k}."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for i in range(N):
        def v_next(t, i=i):
            return next_value[i] if t == T - 1 else values[t + 1, i]

        for t in range(T):
            if not valid[t, i]:
                continue
            total, k, s = 0.0, 0, t
            while True:
                boot = 0.0 if terminated[s, i] else gamma * v_next(s)
                total += (gamma * lam) ** k * (rewards[s, i] + boot - values[s, i])
                if terminated[s, i] or truncated[s, i] or s == T - 1:
                    break
                s, k = s + 1, k + 1
            adv[t, i] = total
    return adv


@pytest.mark.parametrize("seed", range(5))
def test_gae_equals_direct_sum(seed):
    rng = np.random.default_rng(seed)
    T, N = 17, 3
    terminated = rng.random((T, N)) < 0.15
    truncated = (rng.random((T, N)) < 0.1) & ~terminated
    ended = terminated | truncated
    valid = np.ones((T, N), dtype=bool)
    valid[1:] = ~ended[:-1]  # NEXT_STEP: the step after an end is the autoreset step
    terminated &= valid
    truncated &= valid
    rewards = np.where(valid, rng.random((T, N)), 0.0)
    values = rng.normal(size=(T, N))
    next_value = rng.normal(size=N)
    adv, ret = compute_gae(rewards, values, terminated, truncated, valid, next_value, 0.9, 0.8)
    ref = _gae_reference(rewards, values, terminated, truncated, valid, next_value, 0.9, 0.8)
    np.testing.assert_allclose(adv, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret[valid], (ref + values)[valid])
    assert np.all(adv[~valid] == 0) and np.all(ret[~valid] == 0)


def test_update_ignores_masked_steps():
    env = make_env(SMALL_ENV)
    envs = SyncVectorEnv([lambda: make_env(SMALL_ENV)] * 2, autoreset_mode=AutoresetMode.NEXT_STEP)
    model = _model_for(env)
    r = collect_rollout(envs, model, initial_state(envs, 0), 10, torch.Generator().manual_seed(0))
    envs.close()
    assert (~r.valid).any()
    cfg = PPOConfig(num_minibatches=2, update_epochs=2)
    adv, ret = compute_gae(r.rewards, r.values, r.terminated, r.truncated, r.valid, r.next_value, 0.9, 0.95)
    garbage = copy.deepcopy(r)
    garbage.obs[~r.valid] = 123.0
    garbage.actions[~r.valid] = -7.0
    garbage.logprobs[~r.valid] = 55.0
    garbage_adv = np.where(r.valid, adv, 1e6)
    params = []
    for roll, a in ((r, adv), (garbage, garbage_adv)):
        m = copy.deepcopy(model)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        stats = ppo_update(m, opt, roll, a, ret, cfg, np.random.default_rng(0))
        params.append([p.detach().clone() for p in m.parameters()])
        assert np.isfinite(stats["losses/value_loss"])
    for p, q in zip(*params, strict=True):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------------------------------------------
# Training


def _smoke(flip: bool = False, monkeypatch=None) -> tuple[float, float, list]:
    if flip:
        import agents.ppo as ppo_mod

        original = ppo_mod.compute_gae

        def flipped(*a, **k):
            adv, ret = original(*a, **k)
            return -adv, ret

        monkeypatch.setattr(ppo_mod, "compute_gae", flipped)
    env = dict(SMALL_ENV, segment_requests=300, policy_options={"params": BAD_START, **PAPER})
    config = {"seed": 0, "env": env, "ppo": {"total_steps": 384, "num_envs": 2, "num_steps": 32, "gamma": 0.5,
                                             "learning_rate": 3e-3, "init_log_std": -0.5, "update_epochs": 8}}
    result = train(config)
    full = {"capacity": 0.1, "window": 50, "policy_options": {"params": BAD_START, **PAPER}}
    start = evaluate(FixedAgent(), full, 0)["summary"]["token_hit_rate"]
    trained = evaluate(PPOAgent(model=result.model, config=result.config), full, 0)["summary"]["token_hit_rate"]
    return start, trained, result.metrics


def test_ppo_improves_on_a_clearly_bad_start():
    start, trained, metrics = _smoke()
    assert 0.55 < start < 0.68  # the bad start (SAECache's defaults reach ~0.80 here)
    assert trained > start + 0.05, (start, trained)
    assert metrics[-1]["charts/mean_reward"] > metrics[0]["charts/mean_reward"]
    for key in ("charts/episodic_return", "losses/value_loss", "losses/policy_loss", "losses/entropy",
                "losses/approx_kl", "losses/clipfrac", "losses/explained_variance", "global_step"):
        assert key in metrics[0], key


@pytest.mark.slow
def test_sign_flipped_update_does_not_improve(monkeypatch):
    start, trained, _ = _smoke(flip=True, monkeypatch=monkeypatch)
    assert trained < start + 0.01


def test_same_seed_same_metrics_and_weights():
    runs = [train(SMALL_RUN), train(SMALL_RUN), train(dict(SMALL_RUN, seed=4))]
    strip = [[{k: v for k, v in row.items() if not k.startswith("perf/")} for row in r.metrics] for r in runs]
    assert strip[0] == strip[1]
    assert strip[0] != strip[2]
    for (k, a), b in zip(runs[0].model.state_dict().items(), runs[1].model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert len(runs[0].metrics) == 1 and runs[0].metrics[0]["global_step"] == 16


def test_checkpoint_round_trip_weights_only(tmp_path):
    result = train(SMALL_RUN)
    path = save_checkpoint(tmp_path / "ck.pt", result.model, result.config)
    blob = torch.load(path, weights_only=True)  # no pickle needed
    assert blob["format"] == "saecache-ppo" and json.loads(blob["config"])["model"]["policy"] == "saecache"
    model, config = load_checkpoint(path)
    for (k, a), b in zip(result.model.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert config == json.loads(json.dumps(result.config))
    # the loaded agent acts exactly as the trained one
    a = evaluate(PPOAgent(path), SMALL_ENV, seed=2)
    b = evaluate(PPOAgent(model=result.model, config=result.config), SMALL_ENV, seed=2)
    assert [w["action"] for w in a["history"]] == [w["action"] for w in b["history"]]
    assert isinstance(make_agent("ppo", checkpoint=str(path)), PPOAgent)
    # wrong files and wrong envs
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": {}}, bad)
    with pytest.raises(ValueError, match="not a PPO checkpoint"):
        load_checkpoint(bad)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="observation values"):
        evaluate(PPOAgent(path), dict(SMALL_ENV, policy="lpc"), seed=0)
    other = {**result.config, "model": {**result.config["model"], "policy": "other"}}
    with pytest.raises(ValueError, match="trained for policy 'other'"):
        evaluate(PPOAgent(model=result.model, config=other), SMALL_ENV, seed=0)


def test_run_writes_files_and_cli(tmp_path):
    cfg_file = tmp_path / "ppo.yaml"
    cfg_file.write_text(json.dumps(dict(SMALL_RUN, eval={"seed": 1, "env": {"segment_requests": 100}})))
    out = tmp_path / "out"
    assert cli_main(["ppo", "--config", str(cfg_file), "--out", str(out), "--total-steps", "32"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics) == 2 and metrics[-1]["global_step"] == 32
    config = json.loads((out / "config.json").read_text())
    assert config["ppo"]["total_steps"] == 32 and config["run"]["env"] == SMALL_ENV
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev) == {"ppo", "fixed_default"} and ev["ppo"]["trace_requests"] == 100
    load_checkpoint(out / "checkpoint.pt")
    # bad configs
    with pytest.raises(ValueError, match="unknown key"):
        read_run_config({"env": {}, "epochs": 3})
    with pytest.raises(ValueError, match="unknown PPO option"):
        read_run_config({"ppo": {"lr": 3}})
    with pytest.raises(ValueError, match="trace_seeds"):
        read_run_config({"trace_seeds": "1"})
    with pytest.raises(ValueError, match="num_envs"):
        PPOConfig(num_envs=0)
    assert cli_main(["ppo", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_trace_seeds_pool():
    spec = {"source": "synthetic", "preset": "tiny"}
    cfg = seeded_env_config({"trace": spec}, [1, 2])
    pool = cfg["trace"]
    assert len(pool.traces) == 2 and not pool.traces[0].equals(pool.traces[1])
    env = make_env(cfg)
    seen = set()
    for s in range(8):
        env.reset(seed=s)
        seen.add(id(env.trace))
    assert len(seen) == 2  # both traces are drawn
    with pytest.raises(ValueError, match="generator spec"):
        seeded_env_config({}, [1])


@pytest.mark.slow
def test_async_vector_env_gives_the_same_run():
    sync = train(SMALL_RUN).metrics
    asyn = train(dict(SMALL_RUN, ppo={**SMALL_RUN["ppo"], "vector": "async"})).metrics
    strip = [[{k: v for k, v in row.items() if not k.startswith("perf/")} for row in m] for m in (sync, asyn)]
    assert strip[0] == strip[1]
