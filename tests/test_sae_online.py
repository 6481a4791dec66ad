"""Tests of SAECache's online learners (agents/sae_online.py).

* ``lognormal_mle`` on known log-normal samples; the streaming gap fit after a replay of a synthetic trace against
  the generator's chat parameters and against the exact MLE of the trace's own gaps.
* Token-type weights, gamma and queue weights on hand-built :class:`WindowStats` (direction of every move, and one
  step against the documented formula).
* Gamma conventions: with ``p = 1 - x ** gamma`` a *small* gamma means hits stop right after a prompt's head (strong
  position decay), a *large* one that they last until its tail.
* ``fit_gamma`` recovery on ``1 - x ** g``, and end to end (structural_offset_profile + fit_gamma) on hits generated
  from the policy's own position model.
* The learner as a replay callback equals calling ``update`` by hand after each window.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from agents.sae_online import (
    OnlineConfig,
    SAEOnlineLearner,
    fit_gamma,
    lognormal_mle,
    structural_offset_profile,
)
from sae_env.cache import PrefixCache
from sae_env.metrics import WindowStats
from sae_env.policies.saecache import PARAM_SPECS, SAECachePolicy
from sae_env.replay import Replay
from sae_env.sources import load_source
from sae_env.trace import N_APP_TYPES, N_TOKEN_TYPES, AppType, TokenType, Trace, TraceBuilder

# The learners move the paper's three multiplicative mechanisms too, which the default policy switches off.
LEARNED = {"type_weights": True, "adaptive_alpha": True, "position_decay": True}


def sae(**options) -> SAECachePolicy:
    """A SAECache policy with every mechanism the learners set switched on (options override)."""
    return SAECachePolicy(**{**LEARNED, **options})

T = TokenType
SPECS = {p.name: p for p in PARAM_SPECS}
X_CENTRES = (np.arange(10) + 0.5) / 10


def stats(*, refs=None, hits=None, mae=None, held=None, policy=None, start=0, requests=1,
          hits_per_request=None) -> WindowStats:
    """A hand-built window: only the fields the learner reads matter; the rest are consistent zeros."""
    z = [0] * N_TOKEN_TYPES
    refs, hits, mae, held = (list(v) if v is not None else list(z) for v in (refs, hits, mae, held))
    return WindowStats(index=0, start=start, t_start=0.0, t_end=0.0, requests=requests, prompt_tokens=0,
                       hit_tokens=0, prompt_blocks=sum(refs), hit_blocks=sum(hits), evictions=0, bypasses=0,
                       inserted=0, refs_by_type=refs, hits_by_type=hits, miss_after_eviction_by_type=mae,
                       miss_after_eviction_by_queue={}, refs_by_offset=[], hits_by_offset=[],
                       app_mix=[0] * N_APP_TYPES, occupancy=sum(held), capacity=max(1, sum(held)),
                       occupancy_by_queue={}, occupancy_by_type=held, hits_per_request=list(hits_per_request or []),
                       policy=dict(policy or {}))


# ----------------------------------------------------------------------------------------------------------------
# Log-normal fits


@pytest.mark.parametrize("mu,sigma", [(4.88, 0.98), (1.0, 0.8), (-1.5, 0.3), (2.0, 2.0)])
def test_lognormal_mle_recovers_parameters(mu, sigma):
    x = np.random.default_rng(7).lognormal(mu, sigma, 5000)
    m, s = lognormal_mle(x)
    assert m == pytest.approx(mu, rel=0.05)
    assert s == pytest.approx(sigma, rel=0.05)


CHAT_MU, CHAT_SIGMA = 2.0, 0.5


def gap_trace() -> Trace:
    """Chat and agent sessions only, ~2,800 requests, ~1,500 chat gaps with known log-normal parameters."""
    return load_source("synthetic", None, preset="tiny",
                       phases=[{"duration": 300.0, "rate": 2.0, "mix": {"templated": 0.0, "chat": 0.6, "agent": 0.4}}],
                       chat={"turns": {"mean": 6.0, "max": 12}, "gap_mu": CHAT_MU, "gap_sigma": CHAT_SIGMA},
                       agent={"gap_mu": 0.3, "gap_sigma": 0.9})[0]


def trace_log_gaps(trace: Trace, app: AppType) -> np.ndarray:
    last: dict[int, float] = {}
    out = []
    for i in range(len(trace)):
        s = int(trace.session[i])
        if s in last and trace.app[i] == app:
            out.append(math.log(trace.t[i] - last[s]))
        last[s] = float(trace.t[i])
    return np.array(out)


@pytest.mark.parametrize("gap_decay,gap_prior", [(0.7, 50.0), (1.0, 0.0)])
def test_streaming_gap_fit_converges_to_the_chat_gap_distribution(gap_decay, gap_prior):
    tr = gap_trace()
    policy = sae()
    learner = SAEOnlineLearner(gap_decay=gap_decay, gap_prior=gap_prior)
    Replay(tr, PrefixCache(200, policy), window_requests=200, callbacks=[learner.callback()]).run()
    p = policy.params
    assert p["mu_chat"] == pytest.approx(CHAT_MU, rel=0.10)
    assert p["sigma_chat"] == pytest.approx(CHAT_SIGMA, rel=0.10)
    if gap_decay == 1.0 and gap_prior == 0.0:
        # nothing forgotten, no prior: exactly the MLE of every gap in the trace, per queue
        for app, mu_name, sigma_name in ((AppType.CHAT, "mu_chat", "sigma_chat"),
                                         (AppType.AGENT, "mu_agent", "sigma_agent")):
            lg = trace_log_gaps(tr, app)
            assert lg.size > 500
            assert p[mu_name] == pytest.approx(lg.mean(), rel=1e-9)
            assert p[sigma_name] == pytest.approx(lg.std(), rel=1e-9)


def test_gap_fit_waits_for_min_gaps_and_forgets():
    policy = sae()
    learner = SAEOnlineLearner(min_gaps=10, gap_decay=0.5, gap_prior=0.0)
    lg = np.log([2.0, 3.0, 5.0])
    few = {"gap_stats": {"chat": [3, lg.sum(), (lg ** 2).sum()], "agent": [0, 0.0, 0.0]}}
    learner.update(stats(policy=few), policy)
    assert policy.params["mu_chat"] == SPECS["mu_chat"].default  # 3 < min_gaps
    many = {"gap_stats": {"chat": [20, 20 * 3.0, 20 * (9.0 + 0.25)], "agent": [0, 0.0, 0.0]}}
    learner.update(stats(policy=many), policy)
    n, s1, s2 = 0.5 * np.array([3, lg.sum(), (lg ** 2).sum()]) + np.array([20, 60.0, 185.0])
    mu = s1 / n
    assert policy.params["mu_chat"] == pytest.approx(mu)
    assert policy.params["sigma_chat"] == pytest.approx(math.sqrt(s2 / n - mu * mu))
    assert policy.params["mu_agent"] == SPECS["mu_agent"].default


def test_gap_prior_shrinks_towards_the_current_values():
    """``gap_prior`` pseudo-gaps at the current (mu, sigma) join the decayed statistics of the window."""
    policy = sae(params={"mu_chat": 4.0, "sigma_chat": 1.0})
    n0 = 30.0
    learner = SAEOnlineLearner(gap_prior=n0)
    n, s1, s2 = 40, 40 * 1.0, 40 * (1.0 + 0.09)  # 40 gaps of mean ln 1.0, std 0.3
    learner.update(stats(policy={"gap_stats": {"chat": [n, s1, s2], "agent": [0, 0.0, 0.0]}}), policy)
    mu = (s1 + n0 * 4.0) / (n + n0)
    sigma = math.sqrt((s2 + n0 * (1.0 + 16.0)) / (n + n0) - mu * mu)
    assert policy.params["mu_chat"] == pytest.approx(mu)
    assert policy.params["sigma_chat"] == pytest.approx(sigma)
    assert 1.0 < policy.params["mu_chat"] < 4.0


def test_gap_prior_must_not_be_negative():
    """A negative prior makes ``n + gap_prior`` zero or negative (division by zero, or a fit of the wrong sign)."""
    with pytest.raises(ValueError):
        OnlineConfig(gap_prior=-10.0)


# ----------------------------------------------------------------------------------------------------------------
# Token-type weights

PRESENT = [T.SYSTEM, T.TEMPLATE, T.USER, T.ASSISTANT, T.TOOL_OUTPUT]


def type_window(mae_user: int, held_reasoning: int = 20) -> WindowStats:
    refs = [100, 100, 100, 100, 100, 0, 0]
    hits = [50, 50, 50, 50, 50, 0, 0]
    mae = [2, 2, mae_user, 2, 2, 0, 0]
    held = [10, 10, 10, 10, 10, held_reasoning, 0]
    return stats(refs=refs, hits=hits, mae=mae, held=held)


def test_type_weight_rises_with_regretted_evictions():
    policy = sae()
    learner = SAEOnlineLearner()
    rel = []
    for k in range(8):
        learner.update(type_window(mae_user=2 + 5 * k), policy)
        p = policy.params
        others = np.mean([p[f"w_{t.name.lower()}"] for t in PRESENT if t != T.USER])
        rel.append(p["w_user"] / others)
    assert all(b > a for a, b in zip(rel, rel[1:], strict=False)), rel
    assert rel[-1] > 2.0


def test_type_weight_of_held_but_unreferenced_type_falls():
    policy = sae()
    learner = SAEOnlineLearner()
    w = []
    for _ in range(10):
        learner.update(type_window(mae_user=2), policy)
        w.append(policy.params["w_reasoning"])
    assert all(b < a for a, b in zip(w, w[1:], strict=False) if a > SPECS["w_reasoning"].low)
    assert w[0] == pytest.approx(0.7)  # target 0: (1 - type_rate) * 1
    assert w[-1] == SPECS["w_reasoning"].low
    assert policy.params["w_unknown"] == 1.0  # neither referenced nor held: untouched


def test_type_weights_one_step_formula():
    cfg = OnlineConfig()
    policy = sae()
    learner = SAEOnlineLearner(cfg)
    s = type_window(mae_user=30)
    refs, hits, mae = (np.array(v, float) for v in (s.refs_by_type, s.hits_by_type, s.miss_after_eviction_by_type))
    present = (refs > 0) | (np.array(s.occupancy_by_type) > 0)
    score = np.divide(hits + cfg.mae_weight * mae, refs, out=np.zeros_like(refs), where=refs > 0)
    target = score / score[present].mean()
    learner.update(s, policy)
    for t in TokenType:
        name = f"w_{t.name.lower()}"
        want = (1 - cfg.type_rate) + cfg.type_rate * target[t] if present[t] else 1.0
        assert policy.params[name] == pytest.approx(SPECS[name].clip(want)), name


def test_type_weights_frozen_when_switched_off():
    policy = sae(type_weights=False)
    SAEOnlineLearner().update(type_window(mae_user=50), policy)
    assert all(policy.params[f"w_{t.name.lower()}"] == 1.0 for t in TokenType)


# ----------------------------------------------------------------------------------------------------------------
# Position decay gamma


@pytest.mark.parametrize("g", [0.2, 0.5, 1.0, 2.0, 4.0, 8.0])
def test_fit_gamma_recovers_gamma(g):
    """Hit ratios exactly ``c * (1 - x ** g)`` at the bin centres the learner uses; the grid step is ~7.8 %, so 10 %
    is one grid step plus rounding."""
    for c in (1.0, 0.4):
        got = fit_gamma(X_CENTRES, c * (1 - X_CENTRES ** g), np.full(10, 100.0))
        assert got == pytest.approx(g, rel=0.10), f"g={g}, scale {c}: fitted {got}"


def test_fit_gamma_without_signal():
    assert fit_gamma(X_CENTRES, np.zeros(10), np.full(10, 5.0)) is None
    assert fit_gamma(X_CENTRES, np.ones(10), np.r_[5.0, np.zeros(9)]) is None


def structural_trace(n_requests: int, n_blocks: int, types=(T.SYSTEM, T.TEMPLATE)) -> Trace:
    b = TraceBuilder(block_size=16)
    for i in range(n_requests):
        tt = [types[min(d * len(types) // n_blocks, len(types) - 1)] for d in range(n_blocks)]
        b.add(t=float(i), session=-1, turn=1, app=AppType.SINGLE_TURN, prompt_tokens=16 * n_blocks, output_tokens=0,
              prompt_keys=np.arange(n_blocks) + 1000 * i, prompt_types=tt)
    return b.build()


def reference_profile(trace: Trace, start: int, hits_per_request) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    refs, hit, xsum = np.zeros(10), np.zeros(10), np.zeros(10)
    for j, h in enumerate(hits_per_request):
        i = start + j
        keys, types = trace.prompt_blocks(i)
        n = len(keys)
        for pos in range(n):
            if types[pos] <= T.TEMPLATE:
                k = min(pos * 10 // n, 9)
                refs[k] += 1
                hit[k] += pos < h
                xsum[k] += pos / n  # the policy's x: depth / prompt blocks
    return refs, hit, np.where(refs > 0, xsum / np.maximum(refs, 1), 0.0)


def test_structural_offset_profile_matches_reference():
    rng = np.random.default_rng(3)
    b = TraceBuilder(block_size=16)
    for i in range(40):
        n = int(rng.integers(0, 25))
        types = rng.choice([T.SYSTEM, T.TEMPLATE, T.USER, T.ASSISTANT], size=n)
        b.add(t=float(i), session=-1, turn=1, app=0, prompt_tokens=16 * n, output_tokens=0,
              prompt_keys=rng.integers(1, 10**9, size=n), prompt_types=types)
    tr = b.build()
    start, req = 5, 30
    h = [int(rng.integers(0, max(1, len(tr.prompt_blocks(start + j)[0])) + 1)) for j in range(req)]
    x, ratio, refs = structural_offset_profile(tr, stats(start=start, requests=req, hits_per_request=h))
    ref_refs, ref_hits, ref_x = reference_profile(tr, start, h)
    np.testing.assert_allclose(x, ref_x, rtol=1e-12, atol=1e-12)
    assert np.array_equal(refs, ref_refs)
    np.testing.assert_allclose(ratio, np.where(ref_refs > 0, ref_hits / np.maximum(ref_refs, 1), 0.0))


def gamma_after(hits_per_request, n_blocks: int = 10, gamma0: float = 1.0, **cfg) -> tuple[float, float | None]:
    """One learner update on a window of structural prompts; returns (new gamma, the window's fitted gamma)."""
    tr = structural_trace(len(hits_per_request), n_blocks)
    s = stats(start=0, requests=len(hits_per_request), hits_per_request=hits_per_request)
    policy = sae(params={"gamma": gamma0})
    SAEOnlineLearner(**cfg).update(s, policy, tr)
    return policy.params["gamma"], fit_gamma(*structural_offset_profile(tr, s))


def test_gamma_falls_when_hits_concentrate_on_the_first_block():
    """Only each prompt's first block hits: the position decay is strong, which p = 1 - x**gamma expresses with a
    small gamma."""
    new, fitted = gamma_after([1] * 10)
    assert fitted < 0.2
    assert new < 1.0
    assert new == pytest.approx(math.exp(0.3 * math.log(fitted)))  # EMA in log space, gamma_rate 0.3, from 1


def test_gamma_rises_when_hits_stay_flat_until_the_tail():
    """Every block but the last hits: no decay until the tail, a large gamma."""
    new, fitted = gamma_after([9] * 10)
    assert fitted > 5.0
    assert new > 1.0
    assert new == pytest.approx(math.exp(0.3 * math.log(fitted)))


def test_gamma_moves_monotonically_towards_the_fit():
    tr = structural_trace(10, 10)
    s = stats(start=0, requests=10, hits_per_request=[9] * 10)
    fitted = fit_gamma(*structural_offset_profile(tr, s))
    policy = sae()
    learner = SAEOnlineLearner()
    g = [policy.params["gamma"]]
    for _ in range(12):
        learner.update(s, policy, tr)
        g.append(policy.params["gamma"])
    assert all(b > a for a, b in zip(g, g[1:], strict=False))
    assert g[-1] == pytest.approx(fitted, rel=0.05)


def test_gamma_needs_enough_structural_references_and_the_switch():
    assert gamma_after([1] * 4)[0] == 1.0  # 40 structural references < min_structural_refs = 50
    tr = structural_trace(10, 10)
    s = stats(start=0, requests=10, hits_per_request=[1] * 10)
    policy = sae(position_decay=False)
    SAEOnlineLearner().update(s, policy, tr)
    assert policy.params["gamma"] == 1.0
    policy = sae()
    SAEOnlineLearner().update(s, policy, None)  # no trace, no profile
    assert policy.params["gamma"] == 1.0


def hits_from_position_model(n_blocks: int, g: float, n_requests: int = 1000) -> list[int]:
    """Per-request hit counts such that the block at depth d hits in a fraction 1 - (d / n) ** g of the requests:
    the policy's own structural survival ``1 - x_b ** gamma`` with ``x_b = depth / n_prompt``."""
    d = np.arange(n_blocks)
    n_above = np.round(n_requests * (1 - (d / n_blocks) ** g)).astype(int)  # requests with h > d
    h = np.zeros(n_requests, dtype=int)
    for k in range(n_blocks):
        h[:n_above[k]] = k + 1
    return h.tolist()


@pytest.mark.parametrize("n_blocks,g", [(100, 2.0), (10, 2.0), (100, 0.5)])
def test_learned_gamma_matches_the_policy_position_model(n_blocks, g):
    """End to end: hits generated from the policy's model (x = depth / prompt blocks), profiled and fitted by the
    learner, should give back about the same gamma (15 %)."""
    hpr = hits_from_position_model(n_blocks, g)
    tr = structural_trace(len(hpr), n_blocks, types=(T.TEMPLATE,))
    fitted = fit_gamma(*structural_offset_profile(tr, stats(start=0, requests=len(hpr), hits_per_request=hpr)))
    assert fitted == pytest.approx(g, rel=0.15), f"{n_blocks} blocks per prompt, gamma {g}: fitted {fitted:.3f}"


# ----------------------------------------------------------------------------------------------------------------
# Queue weights alpha


def alpha_window(queue_hits, queue_occupancy) -> WindowStats:
    return stats(policy={"queue_hits": list(queue_hits), "queue_occupancy": list(queue_occupancy),
                         "gap_stats": {"chat": [0, 0.0, 0.0], "agent": [0, 0.0, 0.0]}})


def test_alpha_shifts_towards_the_queue_with_more_hits_per_held_block():
    policy = sae()
    learner = SAEOnlineLearner()
    traj = []
    for _ in range(6):
        learner.update(alpha_window([0, 10, 100, 10], [5, 100, 100, 100]), policy)
        traj.append((policy.params["alpha_st"], policy.params["alpha_ch"], policy.params["alpha_ag"]))
    st_, ch, ag = zip(*traj, strict=True)
    assert all(b > a for a, b in zip(ch, ch[1:], strict=False)) and ch[0] > 1.0
    assert all(b < a for a, b in zip(st_, st_[1:], strict=False)) and st_[0] < 1.0
    assert st_ == pytest.approx(ag)  # equal efficiency, equal weight


def test_alpha_one_step_formula_and_absent_queue():
    cfg = OnlineConfig()
    policy = sae()
    SAEOnlineLearner(cfg).update(alpha_window([7, 40, 10, 0], [3, 80, 50, 0]), policy)
    eff = np.array([40 / 80, 10 / 50])
    z = eff / eff.mean() / cfg.temperature
    w = np.exp(z - z.max())
    target = w / w.mean()
    assert policy.params["alpha_st"] == pytest.approx(math.exp(cfg.alpha_rate * math.log(target[0])))
    assert policy.params["alpha_ch"] == pytest.approx(math.exp(cfg.alpha_rate * math.log(target[1])))
    assert policy.params["alpha_ag"] == 1.0  # holds nothing: no weight to learn
    assert policy.params["alpha_st"] > 1.0 > policy.params["alpha_ch"]


@pytest.mark.parametrize("switch", ["adaptive_alpha", "multi_queue"])
def test_alpha_frozen_when_switched_off(switch):
    policy = sae(**{switch: False})
    SAEOnlineLearner().update(alpha_window([0, 10, 100, 10], [5, 100, 100, 100]), policy)
    assert policy.params["alpha_st"] == policy.params["alpha_ch"] == policy.params["alpha_ag"] == 1.0


# ----------------------------------------------------------------------------------------------------------------
# The learner in a replay


def test_callback_equals_update_by_hand():
    tr = load_source("synthetic", None, preset="tiny")[0]
    p1, l1 = sae(), SAEOnlineLearner(min_gaps=3, min_structural_refs=10)
    r1 = Replay(tr, PrefixCache(40, p1), window_requests=10, callbacks=[l1.callback()])
    r1.run()
    p2, l2 = sae(), SAEOnlineLearner(min_gaps=3, min_structural_refs=10)
    r2 = Replay(tr, PrefixCache(40, p2), window_requests=10)
    while not r2.done:
        l2.update(r2.step(), p2, tr)
    assert l1.history == l2.history
    assert p1.params == p2.params
    assert [w.to_dict() for w in r1.windows] == [w.to_dict() for w in r2.windows]
    # the learner did move something of every kind
    d = sae().params
    moved = {k for k in d if p1.params[k] != d[k]}
    assert {"mu_chat", "mu_agent", "gamma", "alpha_ch", "w_user"} <= moved, moved


def test_callback_rejects_other_policies():
    from sae_env.policies import make_policy

    tr = load_source("synthetic", None, preset="tiny")[0]
    r = Replay(tr, PrefixCache(40, make_policy("lru")), window_requests=10, callbacks=[SAEOnlineLearner().callback()])
    with pytest.raises(TypeError):
        r.step()


def test_config_validation():
    with pytest.raises(ValueError):
        OnlineConfig(type_rate=1.5)
    with pytest.raises(ValueError):
        OnlineConfig(gap_decay=0.0)
    with pytest.raises(ValueError):
        OnlineConfig(temperature=0.0)
    with pytest.raises(ValueError):
        SAEOnlineLearner(OnlineConfig(), type_rate=0.1)
    with pytest.raises(TypeError):
        SAEOnlineLearner(nonsense=1)
