"""Tests of the agents and the evaluation loop: SAEOnlineAgent through the env equals the replay-callback form
(same hits per window, same parameters per window, same final parameters), FixedAgent / BaselineAgent equal a
plain replay at the defaults and set given parameters exactly, parameter files, evaluate()'s history and summary
against a plain replay, determinism, and the agent registry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agents import (
    LEARNERS,
    Agent,
    BaselineAgent,
    FixedAgent,
    SAEOnlineAgent,
    agent_class,
    agent_names,
    evaluate,
    learner_for,
    load_params,
    make_agent,
    make_env,
    save_params,
)
from agents.sae_online import OnlineConfig, SAEOnlineLearner
from sae_env.cache import PrefixCache
from sae_env.metrics import summarize
from sae_env.policies import make_policy, policy_class, policy_names
from sae_env.replay import Replay
from sae_env.serving import make_server
from sae_env.sources.synthetic import generate

SERVER = "qwen2.5-1.5b@a40"
PARAMETERLESS = [p for p in policy_names() if not policy_class(p).param_specs]


@pytest.fixture(scope="module")
def tiny():
    return generate(preset="tiny")


def callback_form(env, learner: SAEOnlineLearner) -> tuple[Replay, dict]:
    """The replay-callback form of the learner on the env's current episode."""
    policy = make_policy("saecache", **env.policy_options)
    rep = Replay(env.trace, PrefixCache(env.replay.capacity, policy), make_server(env.serving),
                 window_requests=env.window_requests, window_seconds=env.window_seconds,
                 callbacks=[learner.callback()])
    rep.run()
    return rep, policy.params


def plain(env) -> Replay:
    rep = Replay(env.trace, PrefixCache(env.replay.capacity, make_policy(env.policy_name, **env.policy_options)),
                 make_server(env.serving), window_requests=env.window_requests, window_seconds=env.window_seconds)
    rep.run()
    return rep


def run_episode(agent, config, seed=0):
    env = make_env(config)
    obs, info = env.reset(seed=seed)
    agent.reset(env, seed=seed)
    done = False
    while not done:
        obs, reward, terminated, truncated, info = env.step(agent.act(obs, info))
        agent.observe(obs, reward, terminated, truncated, info)
        done = terminated or truncated
    return env


# ----------------------------------------------------------------------------------------------------------------
# SAEOnlineAgent == the replay callback


@pytest.mark.parametrize("config", [
    {"window": 50},  # the default synthetic trace, ~720 requests: every learner rule fires
    {"window": 30, "capacity": 0.05},
    {"window": 40, "serving": SERVER},
    {"window": "40s", "capacity": 0.2},
    {"window": 25, "segment_requests": 300},
    {"window": 50, "policy_options": {"lognormal": False, "sample": 2}},
])
def test_sae_online_agent_equals_replay_callback(config):
    agent = SAEOnlineAgent(gap_decay=0.8)
    env = run_episode(agent, config, seed=5)
    learner = SAEOnlineLearner(gap_decay=0.8)
    rep, final = callback_form(env, learner)
    windows = env.replay.windows
    assert len(windows) == len(rep.windows) >= 8
    assert [w.hit_blocks for w in windows] == [w.hit_blocks for w in rep.windows]
    assert [w.hits_per_request for w in windows] == [w.hits_per_request for w in rep.windows]
    assert [w.policy["params"] for w in windows] == [w.policy["params"] for w in rep.windows]
    assert agent.params == final
    assert agent.learner.history == learner.history
    assert windows == rep.windows
    # the learner really moved the parameters (the equality is not the trivial one of two constant runs)
    moved = {k for k, v in final.items() if v != env.default_params[k]}
    assert len(moved) >= 5


def test_sae_online_agent_needs_saecache(tiny):
    env = make_env({"trace": tiny, "policy": "lru"})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="saecache"):
        SAEOnlineAgent().reset(env)
    with pytest.raises(RuntimeError, match="reset"):
        SAEOnlineAgent().act({}, {})


def test_sae_online_agent_config():
    agent = make_agent("sae_online", config=OnlineConfig(type_rate=0.5))
    assert agent.learner.config.type_rate == 0.5 and agent.describe()["config"]["type_rate"] == 0.5
    with pytest.raises(ValueError):
        SAEOnlineAgent(type_rate=2.0)


# ----------------------------------------------------------------------------------------------------------------
# Fixed and baseline agents


@pytest.mark.parametrize("policy", ["saecache", "lpc"])
def test_fixed_defaults_equal_plain_replay(policy, tiny):
    env = run_episode(FixedAgent(), {"trace": tiny, "policy": policy, "window": 9})
    assert env.replay.windows == plain(env).windows


@pytest.mark.parametrize("policy", PARAMETERLESS)
def test_baseline_equals_plain_replay(policy, tiny):
    env = run_episode(BaselineAgent(), {"trace": tiny, "policy": policy, "window": 9, "serving": SERVER})
    assert env.replay.windows == plain(env).windows
    assert env.params == {}


def test_baseline_on_a_tunable_policy_holds_the_defaults(tiny):
    env = run_episode(BaselineAgent(), {"trace": tiny, "policy": "saecache", "window": 9})
    assert env.params == env.default_params
    assert env.replay.windows == plain(env).windows


def test_fixed_sets_exact_values(tiny, tmp_path):
    values = {"alpha_st": 3.3, "w_reasoning": 0.07, "mu_chat": 2.2, "gamma": 0.5}
    env = run_episode(FixedAgent(values), {"trace": tiny, "window": 10})
    for w in env.replay.windows:
        assert {k: w.policy["params"][k] for k in values} == values
        assert w.policy["params"]["alpha_ch"] == env.default_params["alpha_ch"]
    # the same through a plain replay built with these parameters
    ref = Replay(env.trace, PrefixCache(env.replay.capacity, make_policy("saecache", params=values)),
                 window_requests=10)
    ref.run()
    assert env.replay.windows == ref.windows
    # from files
    path = save_params(tmp_path / "tuned.json", values)
    assert load_params(path) == values
    (tmp_path / "p.yaml").write_text("alpha_st: 3.3\nw_reasoning: 0.07\nmu_chat: 2.2\ngamma: 0.5\n")
    (tmp_path / "summary.json").write_text(json.dumps({"params": values, "token_hit_rate": 0.5}))
    for f in ("p.yaml", "summary.json"):
        env2 = run_episode(FixedAgent(tmp_path / f), {"trace": tiny, "window": 10})
        assert env2.replay.windows == env.replay.windows


def test_fixed_agent_errors(tiny, tmp_path):
    env = make_env({"trace": tiny})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="no parameter"):
        FixedAgent({"alpha": 1.0}).reset(env)
    lru = make_env({"trace": tiny, "policy": "lru"})
    lru.reset(seed=0)
    with pytest.raises(ValueError, match="no parameters"):
        FixedAgent({"alpha_st": 1.0}).reset(lru)
    with pytest.raises(ValueError, match="finite"):
        FixedAgent({"alpha_st": float("inf")})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*malformed JSON"):
        FixedAgent(tmp_path / "bad.json")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        FixedAgent(tmp_path / "list.yaml")
    with pytest.raises(ValueError, match=".json, .yaml"):
        FixedAgent(tmp_path / "params.txt")
    with pytest.raises(RuntimeError, match="reset"):
        FixedAgent().act({}, {})


# ----------------------------------------------------------------------------------------------------------------
# evaluate() and the registry


def test_evaluate_history_and_summary(tiny):
    config = {"trace": tiny, "policy": "saecache", "window": 10, "serving": SERVER}
    result = evaluate(FixedAgent({"gamma": 2.0}), config, seed=0)
    env = make_env(config)
    env.reset(seed=0)
    ref = Replay(env.trace, PrefixCache(env.replay.capacity, make_policy("saecache", params={"gamma": 2.0})),
                 make_server(SERVER), window_requests=10)
    ref.run()
    expected = summarize(ref.windows, policy="saecache", block_size=tiny.block_size, timed=True)
    summary = result["summary"]
    assert {k: summary[k] for k in expected} == expected
    assert summary["agent"] == "fixed" and summary["steps"] == len(ref.windows) == len(result["history"])
    assert summary["episode_reward"] == pytest.approx(sum(h["reward"] for h in result["history"]))
    assert summary["terminated"] and not summary["truncated"] and summary["clipped"] == 0
    assert summary["final_params"]["gamma"] == 2.0 and summary["trace_requests"] == len(tiny)
    for h, w in zip(result["history"], ref.windows, strict=True):
        assert h["hit_blocks"] == w.hit_blocks and h["params"] == w.policy["params"] and h["ttft_p99_ms"] is not None
    json.dumps({k: result[k] for k in ("history", "summary")})
    again = evaluate(FixedAgent({"gamma": 2.0}), config, seed=0)
    assert again["history"] == result["history"] and again["summary"] == summary
    assert set(result["timing"]) == {"replay_s", "total_s"}


def test_evaluate_sae_online_matches_callback_summary():
    result = evaluate(SAEOnlineAgent(), {"window": 60}, seed=0)
    env = make_env({"window": 60})
    env.reset(seed=0)
    rep, _ = callback_form(env, SAEOnlineLearner())
    assert result["summary"]["hit_tokens"] == summarize(rep.windows)["hit_tokens"]


def test_evaluate_truncates_and_rejects_unknown_options(tiny):
    result = evaluate(BaselineAgent(), {"trace": tiny, "policy": "lru", "window": 10, "max_steps": 3}, seed=1)
    assert result["summary"]["steps"] == 3 and result["summary"]["truncated"]
    assert result["summary"]["requests"] == 30
    with pytest.raises(ValueError, match="unknown env option"):
        evaluate(BaselineAgent(), {"trace": tiny, "windw": 10})


def test_registry_and_protocol():
    assert set(agent_names()) >= {"fixed", "baseline", "sae_online"}
    for name in agent_names():
        assert isinstance(make_agent(name), Agent)
    assert make_agent("fixed", params={"gamma": 2.0}).values == {"gamma": 2.0}
    with pytest.raises(ValueError, match="unknown agent"):
        make_agent("ppo2")
    with pytest.raises(ValueError, match="bad options"):
        make_agent("baseline", gamma=1.0)


def test_learner_registry_names_a_learner_per_adaptive_policy(tiny):
    """Every policy in LEARNERS is registered and its learner, run as replay's window callback, moves its
    parameters; a policy without a learner gets none (replay --policy asks the registry, not the policy's name)."""
    assert set(LEARNERS) <= set(policy_names()) and learner_for("lru") is None
    for policy, kind in LEARNERS.items():
        assert kind in agent_names()
        pol = make_policy(policy)
        rep = Replay(tiny, PrefixCache(max(1, tiny.distinct_blocks() // 10), pol), window_requests=10,
                     callbacks=[agent_class(kind).replay_callback()])
        rep.run()
        assert pol.params != make_policy(policy).params, policy


def test_random_actions_through_an_agent_are_valid(tiny):
    class RandomAgent(BaselineAgent):
        name = "random"

        def reset(self, env=None, *, seed=None):
            super().reset(env, seed=seed)
            self.rng = np.random.default_rng(seed)

        def act(self, observation, info):
            return self.rng.uniform(-1.5, 1.5, self.env.action_space.shape).astype(np.float32)

    result = evaluate(RandomAgent(), {"trace": tiny, "window": 10}, seed=3)
    clipped = result["summary"]["clipped"]
    assert 0 < clipped < 7 * 15  # about a third of the components fall outside [-1, 1]
    assert result == evaluate(RandomAgent(), {"trace": tiny, "window": 10}, seed=3) | {"timing": result["timing"]}
