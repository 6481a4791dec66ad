"""Tests of sae_env.env.PrefixCacheEnv: the Gymnasium contract (check_env with warnings as errors, for every policy,
vector envs), the adapter property (per-window statistics equal a plain Replay), determinism and segment sampling,
the action mapping (exact round trip, log scale, NaN / out-of-range clipping counted), rewards, episode end,
observations checked against a direct computation, and the fast info / percentile helpers against their numpy /
WindowStats originals."""

from __future__ import annotations

import json
import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
from conftest import build_trace
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import sae_env  # noqa: F401 - registers the env
from sae_env.cache import PrefixCache
from sae_env.env import ENV_ID, PrefixCacheEnv
from sae_env.metrics import percentile, window_dict
from sae_env.policies import make_policy, policy_class, policy_names
from sae_env.policies.params import MEMORY, ActionCodec, action_to_values, values_to_action
from sae_env.replay import Replay
from sae_env.serving import make_server
from sae_env.sources.synthetic import generate
from sae_env.trace import N_TOKEN_TYPES, AppType

SERVER = "qwen2.5-1.5b@a40"
PARAMETERLESS = [p for p in policy_names() if not policy_class(p).param_specs]
TUNABLE = [p for p in policy_names() if policy_class(p).param_specs]
D = len(policy_class("saecache").param_specs)  # 15
MU = [p.name for p in policy_class("saecache").param_specs].index("mu_chat")


@pytest.fixture(scope="module")
def tiny():
    return generate(preset="tiny")  # 70 requests, all three session kinds


def rollout(env: PrefixCacheEnv, seed: int | None = 0, action=None, options=None):
    obs, info = env.reset(seed=seed, options=options)
    steps = [(obs, 0.0, False, False, info)]
    while True:
        a = env.noop_action() if action is None else action
        out = env.step(a)
        steps.append(out)
        if out[2] or out[3]:
            return steps


def plain_replay(env: PrefixCacheEnv) -> Replay:
    """A plain Replay of the env's current episode (same trace, policy, capacity, window, server)."""
    policy = make_policy(env.policy_name, **env.policy_options)
    rep = Replay(env.trace, PrefixCache(env.replay.capacity, policy), make_server(env.serving),
                 window_requests=env.window_requests, window_seconds=env.window_seconds)
    rep.run()
    return rep


def strip_none(d):
    if isinstance(d, dict):
        return {k: strip_none(v) for k, v in d.items() if v is not None}
    return d


# ----------------------------------------------------------------------------------------------------------------
# The Gymnasium contract


@pytest.mark.parametrize("policy", policy_names())
def test_check_env_passes_without_warnings(policy):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = gym.make(ENV_ID, policy=policy, window=200)
        check_env(env.unwrapped)  # the spec lets check_env build the "ansi" variant too
        env.close()


@pytest.mark.parametrize("policy", ["lru", "saecache"])
def test_check_env_timed_and_time_windows(policy):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make(ENV_ID, policy=policy, serving=SERVER, window="60s", reward="neg_ttft").unwrapped)


def test_make_with_no_arguments_runs_an_episode_quickly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = gym.make(ENV_ID)
        obs, info = env.reset(seed=0)
        assert env.unwrapped.policy_name == "saecache"
        assert obs in env.observation_space
        n, done = 0, False
        while not done:
            obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
            assert obs in env.observation_space and 0.0 <= reward <= 1.0
            done = terminated or truncated
            n += 1
        assert terminated and not truncated and n == math.ceil(len(env.unwrapped.trace) / 100)
        assert info["requests_done"] == len(env.unwrapped.trace) > 500


@pytest.mark.parametrize("policy", policy_names())
def test_spaces_per_policy(policy):
    env = PrefixCacheEnv(policy=policy)
    d = len(policy_class(policy).param_specs)
    assert env.action_space.shape == (max(d, 1),)
    assert env.observation_space["params"].shape == (max(d, 1),)
    for box in [env.action_space, *env.observation_space.spaces.values()]:
        assert box.dtype == np.float32 and np.all(np.isfinite(box.low)) and np.all(np.isfinite(box.high))


def test_vector_envs_run(tiny):
    fns = [lambda: gym.make(ENV_ID, trace=tiny, policy="saecache", window=10) for _ in range(2)]
    for vec in (gym.vector.SyncVectorEnv(fns), gym.vector.AsyncVectorEnv(fns)):
        try:
            obs, info = vec.reset(seed=[1, 2])
            assert obs["params"].shape == (2, D)
            for _ in range(4):
                obs, reward, terminated, truncated, info = vec.step(vec.action_space.sample())
                assert reward.shape == (2,) and np.all((reward >= 0) & (reward <= 1))
                assert info["window"]["requests"].tolist() == [10, 10]
                assert vec.single_observation_space.contains({k: v[0] for k, v in obs.items()})
        finally:
            vec.close()


def test_ansi_render(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="saecache", window=20, render_mode="ansi")
    env.reset(seed=0)
    assert "saecache" in env.render()
    env.step(env.noop_action())
    text = env.render()
    assert isinstance(text, str)
    for word in ("token hit", "structural", "chat", "agent", "hit rate by type"):
        assert word in text
    assert PrefixCacheEnv(trace=tiny, policy="lru").render() is None  # no render mode
    fast = PrefixCacheEnv(trace=tiny, policy="lru", window=20, render_mode="ansi")
    fast.reset(seed=0)
    assert "cache 0/" in fast.render()
    _, _, _, _, info = fast.step(fast.noop_action())
    engine = fast.replay.engine
    assert f"cache {info['window']['occupancy']}/{info['window']['capacity']} blocks" in fast.render()
    assert fast.replay.engine == engine  # rendering reads the statistics: the replay stays on its engine
    with pytest.raises(TypeError, match="render_mode"):  # Gymnasium's convention; SB3's make_vec_env relies on it
        PrefixCacheEnv(trace=tiny, render_mode="human")


# ----------------------------------------------------------------------------------------------------------------
# The env is only an adapter


@pytest.mark.parametrize("policy", policy_names())
def test_env_equals_plain_replay(policy, tiny):
    env = PrefixCacheEnv(trace=tiny, policy=policy, capacity=0.1, window=15)
    steps = rollout(env)
    rep = plain_replay(env)
    assert env.replay.windows == rep.windows  # every field of every WindowStats, policy statistics included
    assert [s[4]["window"] for s in steps[1:]] == [strip_none(w.to_dict()) for w in rep.windows]
    assert [s[1] for s in steps[1:]] == [w.token_hit_rate for w in rep.windows]


@pytest.mark.parametrize("policy", ["lru", "lpc", "saecache"])
@pytest.mark.parametrize("window", [7, "5s"])
def test_env_equals_plain_replay_timed(policy, window, tiny):
    env = PrefixCacheEnv(trace=tiny, policy=policy, capacity=0.2, window=window, serving=SERVER)
    rollout(env)
    rep = plain_replay(env)
    assert env.replay.windows == rep.windows
    assert sum(len(w.ttft_ms) for w in rep.windows) == len(tiny)


def test_window_dict_equals_to_dict_and_is_json(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="saecache", window=9, serving=SERVER)
    steps = rollout(env)
    for w, s in zip(env.replay.windows, steps[1:], strict=True):
        assert window_dict(w) == strip_none(w.to_dict())
        json.dumps(s[4])


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50),
       q=st.one_of(st.sampled_from([0.0, 50.0, 99.0, 100.0]), st.floats(0, 100)))
def test_percentile_is_numpys_bit_for_bit(values, q):
    assert percentile(sorted(values), q) == float(np.percentile(values, q))


# ----------------------------------------------------------------------------------------------------------------
# Determinism and sampling


def test_same_seed_same_rollout_different_seed_different_segment(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="saecache", window=8, segment_requests=30)
    a = rollout(env, seed=3, action=np.full(D, 0.3, dtype=np.float32))
    b = rollout(env, seed=3, action=np.full(D, 0.3, dtype=np.float32))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert all(np.array_equal(x[0][k], y[0][k]) for k in x[0])
        assert x[1:] == y[1:]
    starts = set()
    for seed in range(8):
        env.reset(seed=seed)
        starts.add(env.segment_start)
        assert len(env.trace) == 30 and env.trace.t[0] == tiny.t[env.segment_start]
    assert len(starts) >= 4
    env.reset(seed=0, options={"segment_start": 40})
    assert env.segment_start == 40 and env.trace.equals(tiny[40:70])
    with pytest.raises(ValueError, match="segment_start"):
        env.reset(options={"segment_start": 41})
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"start": 1})


def test_trace_factory_draws_from_the_env_rng():
    seen = []

    def factory(rng):
        seed = int(rng.integers(0, 1000))
        seen.append(seed)
        return generate(preset="tiny")[:20 + seed % 10]

    env = PrefixCacheEnv(trace=factory, policy="lru", window=10)
    env.reset(seed=1)
    n1 = len(env.trace)
    env.reset(seed=1)
    assert len(env.trace) == n1 and seen[0] == seen[1]
    env.reset(seed=2)
    assert seen[2] != seen[0]


def test_trace_specs(tiny):
    env = PrefixCacheEnv(trace={"source": "synthetic", "preset": "tiny"}, policy="lru")
    env.reset(seed=0)
    assert env.trace.equals(tiny)
    env = PrefixCacheEnv(trace="mooncake_arxiv", policy="lru", window=500)
    env.reset(seed=0)
    assert len(env.trace) == 1000 and env.trace.block_size == 512
    with pytest.raises(ValueError, match="source"):
        PrefixCacheEnv(trace={"preset": "tiny"})
    with pytest.raises(ValueError, match="trace must be"):
        PrefixCacheEnv(trace=42)


def test_capacity_resolves_on_the_episode_trace(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="lru", capacity=0.5, segment_requests=20)
    _, info = env.reset(seed=0)
    assert info["capacity_blocks"] == round(0.5 * env.trace.distinct_blocks())
    _, info = PrefixCacheEnv(trace=tiny, policy="lru", capacity=37).reset(seed=0)
    assert info["capacity_blocks"] == 37
    _, info = PrefixCacheEnv(trace=tiny, policy="lru", capacity="1GiB", serving=SERVER).reset(seed=0)
    assert info["capacity_blocks"] == 2**30 // (28672 * 16)  # Qwen2.5-1.5B: 28 KiB of KV per token, 16-token blocks


def test_load_rescales_arrivals(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="lru", serving=SERVER, load=0.5)
    env.reset(seed=0)
    assert env.trace.duration != pytest.approx(tiny.duration)
    with pytest.raises(ValueError, match="timed server"):
        PrefixCacheEnv(trace=tiny, load=0.5)


# ----------------------------------------------------------------------------------------------------------------
# Actions


def test_action_mapping_log_and_linear_scales():
    specs = policy_class("saecache").param_specs
    mid = action_to_values(specs, np.zeros(len(specs)))
    assert mid["alpha_st"] == pytest.approx(1.0)  # log scale over [0.05, 20]: the geometric mean is 1
    assert mid["mu_chat"] == pytest.approx(1.5)  # linear over [-7, 10]
    ends = action_to_values(specs, np.ones(len(specs)))
    assert all(ends[p.name] == pytest.approx(p.high) for p in specs)
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.uniform(-1, 1, len(specs))
        assert np.allclose(values_to_action(specs, action_to_values(specs, a)), a, atol=1e-12)


@pytest.mark.parametrize("policy", TUNABLE)
def test_params_round_trip_is_exact(policy, tiny):
    env = PrefixCacheEnv(trace=tiny, policy=policy, window=10)
    env.reset(seed=0)
    rng = np.random.default_rng(1)
    specs = env.param_specs
    for _ in range(20):
        target = {p.name: float(np.exp(rng.uniform(np.log(p.low), np.log(p.high)))) if p.log
                  else float(rng.uniform(p.low, p.high)) for p in specs}
        action = env.params_to_action(target)
        assert action.dtype == np.float32 and action in env.action_space
        assert env.action_to_params(action) == target
        env.step(action)
        assert env.policy.params == target and env.last_stats.policy.get("params", target) == target
        if env.replay.done:
            env.reset(seed=0)
    assert env.params_to_action({specs[0].name: 1e9})[0] == 1.0  # clipped to the bound
    with pytest.raises(ValueError, match="no parameter"):
        env.params_to_action({"nope": 1.0})
    with pytest.raises(ValueError, match="finite"):
        env.params_to_action({specs[0].name: float("nan")})


def test_invalid_actions_are_clipped_and_counted(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="saecache", window=10)
    env.reset(seed=0)
    specs = env.param_specs
    before = env.policy.params
    a = env.params_to_action(before).astype(np.float64)
    a[0], a[1], a[2], a[MU] = np.nan, 5.0, -np.inf, 1.0  # mu_chat: in range, exactly the bound
    _, _, _, _, info = env.step(a)
    p = env.policy.params
    assert p[specs[0].name] == before[specs[0].name]  # NaN keeps the current value
    assert p[specs[1].name] == specs[1].high and p[specs[2].name] == specs[2].low
    assert p["mu_chat"] == specs[MU].high
    assert info["clipped"] == 3
    _, _, _, _, info = env.step(np.full(D, 2.0))
    assert info["clipped"] == 3 + D and env.policy.params == {s.name: s.high for s in specs}
    _, info = env.reset(seed=0)
    assert info["clipped"] == 0
    lru = PrefixCacheEnv(trace=tiny, policy="lru", window=10)
    lru.reset(seed=0)
    _, _, _, _, info = lru.step(np.array([np.nan]))
    assert info["clipped"] == 1 and info["params"] == {}
    with pytest.raises(ValueError, match="shape"):
        lru.step(np.zeros(2))
    with pytest.raises(ValueError, match="numeric"):
        lru.step("left")


@pytest.mark.parametrize("make_bad, message", [
    (lambda a: a.astype(str), "dtype <U"),  # numpy would parse "0.5"
    (lambda a: a.astype(complex) + 1j, "dtype complex"),  # numpy would drop the imaginary part
    (lambda a: a > 0, "dtype bool"),
    (lambda a: a[None, :], r"shape \(1, "),  # a batch of one was flattened
    (lambda a: a[:, None], "shape"),
    (lambda a: [list(a), [0.0]], "ragged|dtype object"),
    (lambda a: np.array(list(a), dtype=object), "dtype object"),
])
def test_actions_that_are_not_real_numbers_of_the_space_shape_are_rejected(tiny, make_bad, message):
    """Issue 15: string, complex and wrongly shaped actions were accepted."""
    env = PrefixCacheEnv(trace=tiny, window=10)
    env.reset(seed=0)
    good = env.noop_action()
    before = env.policy.params
    with pytest.raises(ValueError, match=message):
        env.step(make_bad(good))
    assert env.policy.params == before and env.last_stats is None
    env.step(list(good.astype(float)))  # a plain list of floats of the right length is fine


def test_noop_action_changes_nothing(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="lpc", window=10, policy_options={"tau": 30.0})
    env.reset(seed=0)
    env.step(env.params_to_action({"tau_scale": 3.0}))
    before = env.policy.params
    env.step(env.noop_action())
    assert env.policy.params == before == env.params and before["tau_scale"] == 3.0


# ----------------------------------------------------------------------------------------------------------------
# Rewards, episode end, observations


def test_rewards(tiny):
    steps = rollout(PrefixCacheEnv(trace=tiny, policy="lru", window=10, reward="hit_tokens", reward_scale=100))
    assert [s[1] for s in steps[1:]] == [s[4]["window"]["hit_tokens"] / 100 for s in steps[1:]]
    env = PrefixCacheEnv(trace=tiny, policy="lru", window=10, reward="neg_ttft", serving=SERVER)
    steps = rollout(env)
    for s, w in zip(steps[1:], env.replay.windows, strict=True):
        assert s[1] == (-float(np.mean(w.ttft_ms)) / 1e3 if w.ttft_ms else 0.0) and s[1] <= 0
    with pytest.raises(ValueError, match="timed server"):
        PrefixCacheEnv(trace=tiny, reward="neg_ttft")
    with pytest.raises(ValueError, match="unknown reward"):
        PrefixCacheEnv(trace=tiny, reward="hits")


def test_episode_end(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="lru", window=10, max_steps=2)
    env.reset(seed=0)
    assert env.step(env.noop_action())[2:4] == (False, False)
    assert env.step(env.noop_action())[2:4] == (False, True)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(env.noop_action())
    with pytest.raises(RuntimeError, match="reset"):
        PrefixCacheEnv(trace=tiny).step(np.zeros(D))
    steps = rollout(PrefixCacheEnv(trace=tiny, policy="lru", window=10))
    assert [s[2] for s in steps[1:]] == [False] * 6 + [True]


@pytest.mark.parametrize("bad", [{"window": 0}, {"window": "x"}, {"window": 2.5}, {"capacity": True},
                                 {"capacity": "lots"}, {"policy": "nope"}, {"policy_options": {"bogus": 1}},
                                 {"max_steps": 0}, {"segment_requests": 0}, {"reward_scale": 0}])
def test_bad_configuration(bad, tiny):
    with pytest.raises(ValueError):
        env = PrefixCacheEnv(trace=tiny, **bad)
        env.reset(seed=0)


def reference_gap_features(trace, a, b):
    """Inter-turn gap features of requests [a, b), by a plain loop over the trace."""
    last: dict[int, float] = {}
    gaps: list[tuple[int, float]] = []
    for i in range(len(trace)):
        s = int(trace.session[i])
        if a <= i < b and s >= 0 and s in last and trace.t[i] - last[s] > 0:
            gaps.append((int(trace.app[i]), float(trace.t[i] - last[s])))
        if s >= 0:
            last[s] = float(trace.t[i])
    out = []
    for app in (AppType.CHAT, AppType.AGENT):
        lg = np.log([g for k, g in gaps if k == app])
        out += [lg.mean() / 10, lg.std() / 5, lg.size / (b - a)] if lg.size else [0.0, 0.0, 0.0]
    return np.clip(out, -1, 1)


def test_observation_features(tiny):
    env = PrefixCacheEnv(trace=tiny, policy="saecache", window=12, serving=SERVER)
    steps = rollout(env)
    for (obs, *_), w in zip(steps[1:], env.replay.windows, strict=True):
        assert obs["hit_rate"][0] == np.float32(w.token_hit_rate)
        refs = np.array(w.refs_by_type)
        assert np.allclose(obs["type_ref_share"], refs / refs.sum())
        assert np.allclose(obs["type_hit_rate"], [h / r if r else 0 for h, r in zip(w.hits_by_type, refs,
                                                                                      strict=True)])
        assert np.allclose(obs["app_mix"], np.array(w.app_mix) / w.requests)
        assert np.allclose(obs["queue_occupancy"], [w.occupancy_by_queue.get(q, 0) / w.capacity for q in range(4)])
        qh = np.array(w.policy["queue_hits"])
        assert np.allclose(obs["queue_hit_share"], qh / qh.sum() if qh.sum() else qh)
        assert np.allclose(obs["gaps"], reference_gap_features(tiny, w.start, w.start + w.requests), atol=1e-6)
        if w.ttft_ms:
            m = np.mean(w.ttft_ms) / 1e3
            assert obs["latency"][0] == pytest.approx(m / (1 + m), rel=1e-6)
        assert np.allclose(obs["params"], values_to_action(env.param_specs, w.policy["params"]))
        assert obs["progress"][0] == np.float32((w.start + w.requests) / len(tiny))
    assert steps[0][0]["hit_rate"].tolist() == [0, 0] and steps[0][0]["progress"][0] == 0
    assert len(steps[0][0]["type_hit_rate"]) == N_TOKEN_TYPES


def test_toy_trace_observation_by_hand():
    """Two requests sharing 2 of 3 blocks, capacity 10: the second hits 2 of its 3 blocks."""
    trace = build_trace([[1, 2, 3], [1, 2, 4]], times=[0.0, 1.0])
    env = PrefixCacheEnv(trace=trace, policy="lru", capacity=10, window=1)
    env.reset(seed=0)
    obs, reward, *_ = env.step(env.noop_action())
    assert reward == 0.0 and obs["cache"][0] == np.float32(0.3)
    obs, reward, terminated, _, info = env.step(env.noop_action())
    assert reward == pytest.approx(2 / 3) and terminated and info["window"]["hit_blocks"] == 2
    assert obs["cache"][0] == np.float32(0.4) and obs["queue_occupancy"][0] == np.float32(0.4)
    assert obs["progress"][0] == 1.0


def test_memo_keeps_an_action_in_use(tiny):
    """An action that is used every step stays exact however many other encodings are made in between."""
    env = PrefixCacheEnv(trace=tiny, policy="saecache", window=10)
    env.reset(seed=0)
    target = {"gamma": 0.123456789, "mu_chat": 1.23456789}
    a = env.params_to_action(target)
    rng = np.random.default_rng(0)
    for _ in range(300):
        env.params_to_action({"gamma": float(rng.uniform(0.05, 20))})
        got = env.action_to_params(a)
        assert got["gamma"] == 0.123456789 and got["mu_chat"] == 1.23456789


def test_action_codec_remembers_a_bounded_number_of_encodings():
    specs = policy_class("saecache").param_specs
    codec = ActionCodec(specs)
    defaults = {p.name: p.default for p in specs}
    first = codec.encode({**defaults, "gamma": 0.123456789})
    for g in np.linspace(0.05, 20, 3 * MEMORY):
        codec.encode({**defaults, "gamma": float(g)})
    assert len(codec) == MEMORY
    assert codec.recall(first) is None  # the oldest went first
    assert codec.decode(first)["gamma"] != 0.123456789  # decoded from its float32 bits only
