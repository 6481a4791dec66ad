"""Tests of the SAECache policy (sae_env/policies/saecache.py).

* LRU equivalence: with every switch off the policy must evict in exactly LRU order (differential against
  ``make_policy("lru")``: per-request hits, evictions, and the victim sequence) on hypothesis traces and on the
  synthetic ``tiny`` preset, in instant mode.
* Exact versus fast victims: at every eviction the policy's victim is compared with ``exact_victim(now)`` (the argmin
  over every evictable block), itself checked against an independent argmin over ``cache.evictable()``. Chat, agent
  and priority-eviction groups must agree exactly; for the structural queue the disagreement rate (victims of strictly
  larger (PE flag, priority) than the exact minimum) and the mean relative excess are measured and bounded.
* Invariants and determinism under hypothesis traces with sessions, turns, apps and every token type, for random
  combinations of the switches (and predictors), in instant and timed mode, with ``check=True``.
* Routing of blocks to queues on hand-built traces; priority-eviction blocks go first.
* The priority formula against a direct computation (scipy's log-normal survival); set_params clipping and errors.
* The gap statistics the policy measures against the log inter-arrival gaps computed from the trace.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from unittest.mock import patch

import numpy as np
import pytest
from conftest import BS, prefix_traces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import lognorm

from sae_env.cache import Block, PrefixCache, resolve_capacity
from sae_env.policies import make_policy, saecache
from sae_env.policies.arrivals import slot_p
from sae_env.policies.saecache import AG, CH, PAPER, PARAM_SPECS, PE, ST, SAECachePolicy
from sae_env.replay import Replay
from sae_env.serving import make_server
from sae_env.sources import load_source, open_trace
from sae_env.trace import AppType, TokenType, Trace, TraceBuilder, chain_requests

SERVER = "qwen2.5-1.5b@a40"
ALL_OFF = {"type_weights": False, "adaptive_alpha": False, "lognormal": False, "position_decay": False,
           "multi_queue": False, "predictor": False, "continuation": False, "density": False}
SWITCHES = ("type_weights", "adaptive_alpha", "lognormal", "position_decay", "multi_queue", "continuation", "density",
            "continuation_features", "pe_routing", "hit_value")
T = TokenType


def tiny(seed: int = 0) -> Trace:
    return load_source("synthetic", None, preset="tiny", seed=seed)[0]


def _predictor(trace: Trace, i: int) -> tuple[float, float]:
    """A deterministic stand-in for the session predictor: pseudo-random probabilities from the request index."""
    return (i * 37 % 10) / 10, (i * 53 % 10) / 10


# ----------------------------------------------------------------------------------------------------------------
# Traces with sessions, turns, apps and every token type (a hypothesis strategy)

# Prompt content letters and their token types; output letters are offset by 10 so that a key (which stands for its
# whole prefix, hence for its last block's content) always carries the same type.
_TYPE = {0: T.SYSTEM, 1: T.TEMPLATE, 2: T.USER, 3: T.USER, 4: T.TOOL_OUTPUT, 5: T.UNKNOWN,
         10: T.ASSISTANT, 11: T.REASONING, 12: T.TOOL_OUTPUT, 13: T.ASSISTANT}


def make_trace(prompts, outputs, sessions, turns, apps, times, tails=None, out_extra=None) -> Trace:
    """A trace from per-request content letters (types from the letter), chained over prompt then output."""
    n = len(prompts)
    seq = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seq])]).astype(np.int64)
    content = np.array([c for s in seq for c in s], dtype=np.uint64)
    n_prompt = np.array([len(p) for p in prompts], dtype=np.int64)
    pk, po, ok, oo = chain_requests(content, offsets, n_prompt)
    pt = np.array([_TYPE[c] for p in prompts for c in p], dtype=np.int8)
    ot = np.array([_TYPE[c] for o in outputs for c in o], dtype=np.int8)
    tails = [0] * n if tails is None else tails
    out_extra = [0] * n if out_extra is None else out_extra
    return Trace(t=np.asarray(times, dtype=np.float64), session=sessions, turn=turns, app=apps,
                 prompt_tokens=n_prompt * BS + np.asarray(tails, dtype=np.int64),
                 output_tokens=np.array([len(o) for o in outputs], dtype=np.int64) * BS
                 + np.asarray(out_extra, dtype=np.int64),
                 prompt_offsets=po, prompt_keys=pk, prompt_types=pt, output_offsets=oo, output_keys=ok,
                 output_types=ot, block_size=BS)


@st.composite
def session_traces(draw, max_requests: int = 24, timed: bool = False) -> Trace:
    """Sessions of several turns (a later turn = an earlier turn's prompt + its output without reasoning + new
    blocks), single requests without a session, every AppType, structural heads, reasoning outputs."""
    n = draw(st.integers(1, max_requests))
    prompts, outputs, sessions, turns, apps = [], [], [], [], []
    for _ in range(n):
        if prompts and draw(st.booleans()):
            j = draw(st.integers(0, len(prompts) - 1))
            hist = prompts[j] + [c for c in outputs[j] if c != 11]  # the next turn drops the reasoning
            p = (hist + draw(st.lists(st.sampled_from([2, 3, 4]), max_size=2)))[:10]
            s = sessions[j] if sessions[j] >= 0 else 1000 + j
            sessions.append(s)
            turns.append(turns[j] + 1)
            apps.append(apps[j])
        else:
            head = draw(st.lists(st.sampled_from([0, 1]), max_size=3))  # system prompt / template head
            p = head + draw(st.lists(st.integers(0, 5), max_size=4))
            sessions.append(draw(st.sampled_from([-1, len(prompts)])))
            turns.append(1)
            apps.append(draw(st.sampled_from(list(AppType))))
        prompts.append(p)
        outputs.append(draw(st.lists(st.sampled_from([10, 11, 12, 13]), max_size=3)))
    tails = draw(st.lists(st.integers(0, BS - 1), min_size=n, max_size=n))
    gaps = [0.0, 0.001, 0.005, 0.02, 0.1, 1.0] if timed else [0.0, 0.0004, 0.5, 1.0, 7.0, 300.0]
    times = np.cumsum(draw(st.lists(st.sampled_from(gaps), min_size=n, max_size=n)))
    out_extra = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)) if timed else None
    return make_trace(prompts, outputs, sessions, turns, apps, times, tails, out_extra)


# ----------------------------------------------------------------------------------------------------------------
# Eviction audit: exact victim before every real eviction


def pe_flag(policy: SAECachePolicy, b: Block) -> int:
    return 0 if (policy.switches["multi_queue"] and b.queue == PE) else 1


def reference_exact(policy: SAECachePolicy, now: float) -> Block | None:
    """Independent argmin of the policy's documented key (PE flag, priority, release stamp) over the cache's
    evictable blocks."""
    cands = policy.cache.evictable()
    if not cands:
        return None
    now = policy.clock(now)  # the ranking reads the clock in steps (clock_step)
    return min(cands, key=lambda b: (pe_flag(policy, b), policy.priority(b, now), b.stamp))


class Audit:
    """Wraps ``policy.evict``: computes ``exact_victim(now)`` first, then the real eviction, and records both.

    Always checked: ``exact_victim`` equals the independent reference argmin; ``evict`` returns None only when
    nothing is evictable; with multi_queue on, an evictable PE block is evicted before any other block. With
    ``strict_temporal``: when the exact victim is in a chat, agent or PE group, the policy must pick it.
    """

    def __init__(self, policy: SAECachePolicy, strict_temporal: bool = False):
        self.policy = policy
        self.strict = strict_temporal
        self.victims: list[int] = []
        self.st_evictions = 0
        self.st_disagree = 0
        self.st_excess: list[float] = []
        self.temporal_evictions = 0
        self.temporal_disagree: list[tuple] = []
        self._inner = policy.evict
        policy.evict = self.evict

    def evict(self, now: float) -> Block | None:
        p = self.policy
        ex = p.exact_victim(now)
        ref = reference_exact(p, now)
        assert ex is ref, f"exact_victim {ex!r} differs from the reference argmin {ref!r}"
        has_pe = p.switches["multi_queue"] and any(b.queue == PE for b in p.cache.evictable())
        v = self._inner(now)
        if v is None:
            assert ex is None, f"evict() gave up with {len(p.cache.evictable())} evictable blocks"
            return None
        assert ex is not None
        if has_pe:
            assert v.queue == PE, f"{v!r} evicted while a PE block was evictable"
        at = p.clock(now)
        kx = (pe_flag(p, ex), p.priority(ex, at))
        kv = (pe_flag(p, v), p.priority(v, at))
        assert kv >= kx
        if ex.queue == ST and p.switches["multi_queue"]:
            self.st_evictions += 1
            if kv > kx:
                self.st_disagree += 1
                if kv[0] == kx[0] and kx[1] > 0:
                    self.st_excess.append(kv[1] / kx[1] - 1.0)
        else:
            self.temporal_evictions += 1
            # Under ``density`` a group's candidates are its oldest and newest blocks (the density rises, then
            # falls, with idle time); blocks of one instant tie, and the newest candidate is the last of them, not
            # the first; and where the density is flat in idle time (exponential gaps are memoryless) keys differ
            # in rounding only. A victim of the least (PE flag, priority) up to rounding is exact up to ties.
            tie = kv[0] == kx[0] and math.isclose(kv[1], kx[1], rel_tol=1e-9)
            if v is not ex and not (p.switches["density"] and tie):
                self.temporal_disagree.append((now, ex, kx, v, kv))
                if self.strict:
                    raise AssertionError(f"t={now}: evicted {v!r} (key {kv}) but the exact victim is {ex!r} "
                                         f"(key {kx}) in a chat/agent/PE group")
        self.victims.append(v.key)
        return v


def run(trace: Trace, capacity: int, *, timed: bool = False, window_requests: int = 1, audit: bool = True,
        strict_temporal: bool = False, **options) -> tuple[Replay, Audit | None]:
    policy = SAECachePolicy(**options)
    a = Audit(policy, strict_temporal) if audit else None
    r = Replay(trace, PrefixCache(capacity, policy), make_server(SERVER) if timed else None,
               window_requests=window_requests, check=True)
    r.run()
    return r, a


def test_a_prefix_use_at_the_instant_of_earlier_evictions_rescores_structural_blocks():
    """Found by hypothesis: every request at t = 0, a structural prefix used again between two evictions of that
    instant. Its reuse rate moves, so structural scores must not come from the memo of the instant's earlier
    evictions (they did: a structural block went before a chat block of lower density)."""
    keys = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 4, 5, 6, 4, 4, 1, 2, 3, 1, 2, 3, 7]
    types = [2, 0, 0, 2, 0, 0, 2, 0, 0, 2, 0, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 2, 0, 0, 1]
    offsets = [0, 3, 3, 3, 3, 3, 3, 6, 6, 9, 12, 13, 16, 17, 18, 21, 24, 25]
    n = len(offsets) - 1
    session = np.array([-1] * 6 + [1000, -1, 1000, 1000, -1, -1, -1, -1, 1000, 1000, -1])
    turn = np.where(session > 0, 2, 1).astype(np.int32)
    trace = Trace(t=np.zeros(n), session=session, turn=turn, app=np.zeros(n, dtype=np.int8),
                  prompt_tokens=np.diff(offsets) * BS, output_tokens=np.zeros(n, dtype=np.int64),
                  prompt_offsets=np.array(offsets), prompt_keys=np.array(keys, dtype=np.int64),
                  prompt_types=np.array(types, dtype=np.int8), block_size=BS)
    run(trace, 5, strict_temporal=True, lognormal=False, continuation_features=False, predictor=None, sample=1)


@settings(max_examples=200, deadline=None)
@given(now=st.floats(0, 1e9), step=st.sampled_from([0.0, saecache.CLOCK_STEP, 0.125, 1.0]),
       horizon=st.floats(1e-3, 1e6))
def test_the_ranking_clock_rounds_up_to_its_step(now, step, horizon):
    """clock(now) is now itself with clock_step 0, else the least multiple of clock_step * horizon at or after now (up
    to the division's rounding: scores clamp idle times at min_dt)."""
    policy = SAECachePolicy(clock_step=step)
    policy._horizon = horizon
    at = policy.clock(now)
    if step == 0.0:
        assert at == now
        return
    q = step * horizon
    slack = 1e-12 * max(abs(now), q)
    assert now - slack <= at < now + q + slack
    assert at == math.ceil(now / q) * q


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "1/128", float("nan")])
def test_a_bad_clock_step_is_refused(bad):
    with pytest.raises(ValueError, match="clock_step"):
        SAECachePolicy(clock_step=bad)


def test_a_shared_prefix_use_rescores_only_the_structural_groups():
    """Every request of mooncake_arxiv uses a shared prefix, which moves the structural groups' density and no other
    group's. So an eviction finds a new clock (every group's candidates rescored) only at a new time or after the
    constants moved (a refit): it found one after every such arrival, twice LPC's replay time on the Python engine."""
    trace, _ = open_trace("mooncake_arxiv")
    trace = trace[:300]
    policy = make_policy("saecache")
    changed, clocks, times = [0], [0], set()
    inner_evict, inner_changed = policy.evict, policy._changed

    def evict(now):
        at = policy.clock(now)  # the ranking's clock (clock_step), which _cand_now holds
        clocks[0] += policy._cand_now != at
        times.add(at)
        return inner_evict(now)

    def on_changed():
        changed[0] += 1
        inner_changed()

    policy.evict, policy._changed = evict, on_changed
    Replay(trace, PrefixCache(resolve_capacity(0.1, trace.distinct_blocks()), policy), engine="python").run()
    assert policy.arrivals._prefix_uses == len(trace)  # the case in point: every arrival is a structural one
    assert 0 < clocks[0] <= len(times) + changed[0]


def record_victims(policy) -> list[int]:
    """Wrap ``policy.evict`` so that the victims' keys are appended, in order, to the returned list."""
    victims: list[int] = []
    inner = policy.evict

    def evict(now):
        v = inner(now)
        if v is not None:
            victims.append(v.key)
        return v

    policy.evict = evict
    return victims


def lru_run(trace: Trace, capacity: int, timed: bool = False) -> tuple[Replay, list[int]]:
    lru = make_policy("lru")
    victims = record_victims(lru)
    r = Replay(trace, PrefixCache(capacity, lru), make_server(SERVER) if timed else None, window_requests=1,
               check=True)
    r.run()
    return r, victims


def hits(r: Replay) -> list[int]:
    return [h for w in r.windows for h in w.hits_per_request]


# ----------------------------------------------------------------------------------------------------------------
# 1. Every switch off = LRU


def assert_same_as_lru(trace: Trace, capacity: int, timed: bool = False) -> None:
    r, a = run(trace, capacity, timed=timed, **ALL_OFF)
    ref, ref_victims = lru_run(trace, capacity, timed)
    assert hits(r) == hits(ref)
    assert [w.ttft_ms for w in r.windows] == [w.ttft_ms for w in ref.windows]
    assert [w.evictions for w in r.windows] == [w.evictions for w in ref.windows]
    assert [w.bypasses for w in r.windows] == [w.bypasses for w in ref.windows]
    assert a.victims == ref_victims
    assert set(r.to_python().blocks) == set(ref.cache.blocks)


@settings(max_examples=60, deadline=None)
@given(trace=prefix_traces(), capacity=st.integers(1, 30))
def test_all_switches_off_is_lru_prefix_traces(trace, capacity):
    assert_same_as_lru(trace, capacity)


@settings(max_examples=60, deadline=None)
@given(trace=session_traces(), capacity=st.integers(1, 30))
def test_all_switches_off_is_lru_session_traces(trace, capacity):
    """Sessions, reasoning, structural heads and equal / sub-millisecond arrival times (ties at ``min_dt``)."""
    assert_same_as_lru(trace, capacity)


@pytest.mark.parametrize("capacity", [5, 10, 20, 40, 80, 200])
def test_all_switches_off_is_lru_tiny(capacity):
    assert_same_as_lru(tiny(), capacity)


@settings(max_examples=40, deadline=None)
@given(trace=session_traces(timed=True), capacity=st.integers(1, 30))
def test_all_switches_off_is_lru_timed(trace, capacity):
    """Timed mode too: the recency lists are in release order, which is vLLM's (and our LRU's) order, even where it
    differs from the order of last accesses that the priority formula uses (see the timed exactness tests)."""
    assert_same_as_lru(trace, capacity, timed=True)


# ----------------------------------------------------------------------------------------------------------------
# 2. Exact versus fast victim

CAPACITIES = (5, 10, 20, 30, 40)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temporal_groups_pick_the_exact_victim_instant(seed):
    """Chat, agent and PE groups: the head of the release-ordered list is the exact minimum (instant mode)."""
    tr = tiny(seed)
    n = 0
    for cap in CAPACITIES:
        _, a = run(tr, cap, window_requests=25, strict_temporal=True)
        n += a.temporal_evictions
    assert n > 500  # the check had work to do


def test_temporal_groups_pick_the_exact_victim_timed_handbuilt():
    """Timed mode: a chat block accessed at t=0 but released late (long decode) has the larger ``dt`` and so the
    lower priority, yet it sits behind a block accessed at t=1 and released earlier in the release-ordered list.

    Request A (t=0, 2 USER blocks, 2000 output tokens, ~18 s of decode), request B (t=1, 2 USER blocks, 1 output
    token), request C (t=60, 1 block) into a 4-block cache: the exact victim is A's deepest block (last access 0,
    dt=60), the policy's head-of-list victim is B's deepest block (last access 1, dt=59).
    """
    b = TraceBuilder(block_size=BS)
    b.add(t=0.0, session=1, turn=1, app=AppType.CHAT, prompt_tokens=2 * BS, output_tokens=2000,
          prompt_keys=[11, 12], prompt_types=[T.USER, T.USER])
    b.add(t=1.0, session=2, turn=1, app=AppType.CHAT, prompt_tokens=2 * BS, output_tokens=1,
          prompt_keys=[21, 22], prompt_types=[T.USER, T.USER])
    b.add(t=60.0, session=3, turn=1, app=AppType.CHAT, prompt_tokens=BS, output_tokens=1, prompt_keys=[31],
          prompt_types=[T.USER])
    _, a = run(b.build(), 4, timed=True)
    assert a.temporal_evictions == 1
    detail = "; ".join(f"t={t}: exact {ex!r} key {kx}, evicted {v!r} key {kv}"
                       for t, ex, kx, v, kv in a.temporal_disagree)
    assert a.temporal_disagree == [], f"timed mode: the chat group's victim is not its exact minimum: {detail}"


def test_temporal_groups_pick_the_exact_victim_timed_tiny():
    """The same on the synthetic tiny preset (seed 1) in timed mode, small caches."""
    tr = tiny(1)
    bad, n = [], 0
    for cap in CAPACITIES:
        _, a = run(tr, cap, timed=True, window_requests=25)
        bad += a.temporal_disagree
        n += a.temporal_evictions
    print(f"\ntimed tiny seed 1: {len(bad)} of {n} chat/agent/PE evictions differ from the exact victim")
    assert not bad


def templated_heavy() -> Trace:
    """70 % templated requests over 40 templates and 4 system prompts: long structural lists, many shared heads."""
    return load_source("synthetic", None, preset="tiny", templated={"n_templates": 40, "n_system": 4},
                       phases=[{"duration": 120.0, "rate": 1.0,
                                "mix": {"templated": 0.7, "chat": 0.3, "agent": 0.0}}])[0]


WORKLOADS = {"tiny": lambda: [tiny(s) for s in (0, 1, 2)], "templated": lambda: [templated_heavy()]}


def structural_disagreement(workload: str, sample: int, timed: bool = False) -> tuple[int, int, list[float]]:
    n = dis = 0
    excess: list[float] = []
    for tr in WORKLOADS[workload]():
        for cap in CAPACITIES:
            _, a = run(tr, cap, timed=timed, window_requests=25, sample=sample)
            n += a.st_evictions
            dis += a.st_disagree
            excess += a.st_excess
    return n, dis, excess


def report(label: str, n: int, dis: int, excess: list[float]) -> None:
    print(f"\n{label}: {dis}/{n} structural victims above the exact minimum ({dis / n:.1%}), mean relative priority "
          f"excess of those {np.mean(excess) if excess else 0.0:.2f}")


@pytest.mark.parametrize("workload,timed", [("tiny", False), ("tiny", True), ("templated", False)])
def test_structural_sampled_victim_disagreement_is_bounded(workload, timed):
    """Default sample=8, capacities 5-40 blocks. Bound: at most 10 % of structural evictions may pick a block of
    strictly larger priority than the exact minimum. Why 10 %: sample=8 already finds every listed minimum on these
    workloads (sample=8 and sample=10**6 give the same victims), so the bound is about the returned-heap part; a
    candidate set that also takes the 8 oldest returned leaves measures 0.0 % on both workloads, and sample=1 gives
    12.6 % on the templated one, so 10 % catches a regression of that size without flaking. Measured on the current
    code: tiny 4.7 % (instant) / 4.2 % (timed), templated 13.3 % (fails: the returned-heap problem, see
    test_structural_returned_blocks_all_compete_handbuilt)."""
    n, dis, excess = structural_disagreement(workload, 8, timed)
    report(f"{workload}, sample=8, {'timed' if timed else 'instant'}", n, dis, excess)
    assert n > 1000
    assert dis / n < 0.10


@pytest.mark.parametrize("workload", ["tiny", "templated"])
def test_structural_exhaustive_sample_is_exact(workload):
    """With sample=10**6 every evictable block of a structural group should be a candidate: zero disagreement."""
    n, dis, excess = structural_disagreement(workload, 10**6)
    report(f"{workload}, sample=10**6, instant", n, dis, excess)
    assert dis == 0


def test_structural_returned_blocks_all_compete_handbuilt():
    """Minimal case of the exhaustive-sample failure: two structural inner nodes return to their group (their child
    was evicted) and the one released later has the larger offset, hence the lower priority; only the top of the
    returned-heap (ordered by release stamp) is a candidate, so the policy evicts the other one.

    A (t=0, single-turn): TEMPLATE, TEMPLATE, USER; B (t=1): 4 x TEMPLATE, USER; C (t=10, chat): 3 USER blocks into
    an 8-block cache. Evictions: A's USER block (PE), B's USER block (PE), then the exact minimum is B's 4th
    template block (x = 3/5, dt = 9: P = 0.4 / 9 = 0.044) but A's 2nd template block (x = 1/3, dt = 10: P = 0.067)
    goes.
    """
    b = TraceBuilder(block_size=BS)
    b.add(t=0.0, session=-1, turn=1, app=AppType.SINGLE_TURN, prompt_tokens=3 * BS, output_tokens=0,
          prompt_keys=[1, 2, 3], prompt_types=[T.TEMPLATE, T.TEMPLATE, T.USER])
    b.add(t=1.0, session=-1, turn=1, app=AppType.SINGLE_TURN, prompt_tokens=5 * BS, output_tokens=0,
          prompt_keys=[11, 12, 13, 14, 15], prompt_types=[T.TEMPLATE] * 4 + [T.USER])
    b.add(t=10.0, session=-1, turn=1, app=AppType.CHAT, prompt_tokens=3 * BS, output_tokens=0,
          prompt_keys=[21, 22, 23], prompt_types=[T.USER] * 3)
    _, a = run(b.build(), 8, sample=10**6, **PAPER)
    assert a.victims[:2] == [3, 15]
    assert a.victims[2] == 14, f"evicted block {a.victims[2]}, the exact minimum is block 14"


# ----------------------------------------------------------------------------------------------------------------
# 3. Invariants and determinism under every switch combination

switch_sets = st.fixed_dictionaries({s: st.booleans() for s in SWITCHES})
predictors = st.sampled_from(["rule", "off", "callable"])


def options(switches: dict, predictor: str, sample: int) -> dict:
    pred = {"rule": None, "off": False, "callable": _predictor}[predictor]
    return {**switches, "predictor": pred, "sample": sample}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(), capacity=st.integers(1, 30), switches=switch_sets, predictor=predictors,
       sample=st.sampled_from([1, 2, 8]))
def test_invariants_instant(trace, capacity, switches, predictor, sample):
    """check=True after every request, the audit at every eviction (chat/agent/PE exact in instant mode)."""
    run(trace, capacity, strict_temporal=True, **options(switches, predictor, sample))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(timed=True), capacity=st.integers(1, 30), switches=switch_sets, predictor=predictors,
       sample=st.sampled_from([1, 8]))
def test_invariants_timed(trace, capacity, switches, predictor, sample):
    """Requests overlap (pinned blocks, late releases); the audit is not strict about exactness here (see
    test_temporal_groups_pick_the_exact_victim_timed_*)."""
    r, _ = run(trace, capacity, timed=True, **options(switches, predictor, sample))
    assert sum(w.requests for w in r.windows) == len(trace)
    assert all(b.pins == 0 for b in r.to_python().blocks.values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(timed=True), capacity=st.integers(1, 30), switches=switch_sets, predictor=predictors,
       timed=st.booleans())
def test_deterministic(trace, capacity, switches, predictor, timed):
    def once():
        r, _ = run(trace, capacity, timed=timed, window_requests=5, audit=False, **options(switches, predictor, 8))
        return [w.to_dict(with_samples=True) for w in r.windows]

    assert once() == once()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(timed=True), capacity=st.integers(1, 30), switches=switch_sets, predictor=predictors,
       timed=st.booleans())
def test_compaction_changes_no_decision(trace, capacity, switches, predictor, timed):
    """The recency lists drop dead entries lazily and compact now and then; compacting after nearly every release
    must give the same victims and hits, with the invariants checked after every request."""
    def once():
        r, a = run(trace, capacity, timed=timed, **options(switches, predictor, 8))
        return hits(r), a.victims

    plain = once()
    with patch.object(saecache, "_COMPACT_MIN", 2):
        assert once() == plain


def test_compaction_on_tiny_keeps_decisions(monkeypatch):
    def once():
        r, a = run(tiny(2), 25, timed=True, window_requests=25)
        return hits(r), a.victims

    plain = once()
    monkeypatch.setattr(saecache, "_COMPACT_MIN", 4)
    compacted = once()
    assert compacted == plain and plain[1]


def test_deterministic_tiny_timed():
    def once():
        r, _ = run(tiny(), 20, timed=True, window_requests=10, audit=False)
        return [w.to_dict(with_samples=True) for w in r.windows]

    assert once() == once()


# ----------------------------------------------------------------------------------------------------------------
# 4. Routing


def queues_after(trace: Trace, capacity: int = 10_000, **opts) -> dict[int, int]:
    """Replay (instant, no eviction) and return key -> queue of every cached block."""
    policy = SAECachePolicy(**opts)
    Replay(trace, PrefixCache(capacity, policy), window_requests=1, check=True).run()
    return {k: b.queue for k, b in policy.cache.blocks.items()}


def add(b: TraceBuilder, t, session, turn, app, prompt, outputs=()) -> None:
    """``prompt`` / ``outputs``: lists of (key, TokenType)."""
    b.add(t=t, session=session, turn=turn, app=app, prompt_tokens=len(prompt) * BS,
          output_tokens=len(outputs) * BS, prompt_keys=[k for k, _ in prompt], prompt_types=[t_ for _, t_ in prompt],
          output_keys=[k for k, _ in outputs], output_types=[t_ for _, t_ in outputs])


def routing_trace() -> Trace:
    b = TraceBuilder(block_size=BS)
    # chat session 1: turn 1 (no template) and turn 2
    add(b, 0.0, 1, 1, AppType.CHAT, [(100, T.SYSTEM), (101, T.USER)], [(102, T.ASSISTANT)])
    add(b, 5.0, 1, 2, AppType.CHAT, [(100, T.SYSTEM), (101, T.USER), (102, T.ASSISTANT), (103, T.USER)],
        [(104, T.ASSISTANT), (105, T.ASSISTANT)])
    # agent session 2: turn 1 and turn 2
    add(b, 6.0, 2, 1, AppType.AGENT, [(200, T.SYSTEM), (201, T.TEMPLATE), (202, T.USER)], [(203, T.ASSISTANT)])
    add(b, 7.0, 2, 2, AppType.AGENT, [(200, T.SYSTEM), (201, T.TEMPLATE), (202, T.USER), (203, T.ASSISTANT),
                                      (204, T.TOOL_OUTPUT)], [(205, T.ASSISTANT)])
    # single-turn templated request (no session)
    add(b, 8.0, -1, 1, AppType.SINGLE_TURN, [(300, T.SYSTEM), (301, T.TEMPLATE), (302, T.USER), (303, T.USER)],
        [(304, T.ASSISTANT)])
    # a first request with no template and an unknown app: may start a conversation
    add(b, 9.0, 4, 1, AppType.UNKNOWN, [(400, T.USER), (401, T.TOOL_OUTPUT)], [(402, T.ASSISTANT)])
    # a chat turn whose output opens with reasoning: the whole output (the straddling USER block too) goes to PE
    add(b, 10.0, 5, 1, AppType.CHAT, [(500, T.USER)], [(501, T.USER), (502, T.REASONING), (503, T.ASSISTANT),
                                                        (504, T.UNKNOWN)])
    add(b, 11.0, 5, 2, AppType.CHAT, [(500, T.USER), (505, T.USER)], [(506, T.ASSISTANT)])
    return b.build()


def test_routing_by_rule():
    q = queues_after(routing_trace(), **PAPER)
    expect = {100: ST, 101: CH, 102: CH, 103: CH, 104: CH, 105: CH,  # chat: structural head, the rest chat
              200: ST, 201: ST, 202: AG, 203: AG, 204: AG, 205: AG,  # agent app -> agent queue from turn 1
              300: ST, 301: ST, 302: PE, 303: PE, 304: PE,  # templated first request -> single-turn -> PE
              400: CH, 401: CH, 402: CH,  # no template, not an agent: a possible conversation start
              500: CH, 501: PE, 502: PE, 503: PE, 504: PE,  # output with reasoning: all PE
              505: CH, 506: CH}
    assert q == expect


def test_routing_single_queue_when_multi_queue_off():
    q = queues_after(routing_trace(), multi_queue=False)
    assert set(q.values()) == {CH}


@pytest.mark.parametrize("answer,threshold,expected", [
    ((0.9, 0.1), 0.5, CH), ((0.2, 0.7), 0.5, AG), ((0.6, 0.55), 0.5, CH), ((0.3, 0.4), 0.5, PE),
    ((0.3, 0.4), 0.35, AG), ((0.5, 0.0), 0.5, CH), ((0.49, 0.49), 0.5, PE)])
def test_routing_first_request_by_predictor(answer, threshold, expected):
    calls: list[int] = []

    def predictor(trace, i):
        calls.append(i)
        return answer

    q = queues_after(routing_trace(), predictor=predictor, continue_threshold=threshold, **PAPER)
    # first requests: the predictor decides for every non-structural block (reasoning outputs stay PE)
    for k in (101, 102, 202, 203, 302, 303, 304, 400, 401, 402, 500):
        assert q[k] == expected, k
    # later turns: by their app, whatever the predictor says
    assert q[103] == q[104] == q[105] == CH
    assert q[204] == q[205] == AG
    # structural blocks stay structural, reasoning outputs PE
    assert q[100] == q[201] == q[300] == q[301] == ST
    assert q[501] == q[502] == q[503] == q[504] == PE
    # asked about first requests only (turn 1), never about later turns
    assert set(calls) == {0, 2, 4, 5, 6}


def test_predictor_false_routes_by_rule():
    assert queues_after(routing_trace(), predictor=False, **PAPER) == queues_after(routing_trace(), **PAPER)


def test_pe_blocks_are_evicted_first():
    """A fresh PE block (single-turn templated request at t=100) goes before older chat / structural blocks."""
    b = TraceBuilder(block_size=BS)
    add(b, 0.0, 1, 1, AppType.CHAT, [(1, T.SYSTEM), (2, T.USER), (3, T.USER)], [(4, T.ASSISTANT)])
    add(b, 100.0, -1, 1, AppType.SINGLE_TURN, [(10, T.TEMPLATE), (11, T.USER), (12, T.USER)], [])
    add(b, 100.5, 3, 1, AppType.CHAT, [(20, T.USER), (21, T.USER)], [])
    _, a = run(b.build(), 7, **PAPER)
    assert a.victims == [12, 11]


# ----------------------------------------------------------------------------------------------------------------
# 5. Priority formula and parameters

PARAMS = {"alpha_st": 2.0, "alpha_ch": 0.5, "alpha_ag": 3.0, "w_system": 1.5, "w_template": 0.8, "w_user": 2.0,
          "w_assistant": 0.3, "w_tool_output": 4.0, "w_reasoning": 0.1, "w_unknown": 1.0, "mu_chat": 2.0,
          "sigma_chat": 0.7, "mu_agent": 0.5, "sigma_agent": 1.2, "gamma": 2.5}


def block(queue: int, btype: int, last_access: float, x: float | None = None) -> Block:
    b = Block(1, None, 3, btype, last_access)
    b.queue = queue
    b.pdata = x
    return b


def expected_priority(queue, btype, dt, x=None, *, type_weights=True, adaptive_alpha=True, lognormal=True,
                      position_decay=True, params=PARAMS, min_dt=1e-3) -> float:
    dt = max(dt, min_dt)
    alpha = {PE: 1.0, ST: params["alpha_st"], CH: params["alpha_ch"], AG: params["alpha_ag"]}[queue]
    alpha = alpha if adaptive_alpha else 1.0
    w = params[f"w_{TokenType(btype).name.lower()}"] if type_weights else 1.0
    if queue in (CH, AG):
        mu, sigma = (params["mu_chat"], params["sigma_chat"]) if queue == CH else (params["mu_agent"],
                                                                                  params["sigma_agent"])
        p = (lognorm.sf(dt, s=sigma, scale=math.exp(mu)) if lognormal
             else math.exp(-dt / math.exp(mu + sigma ** 2 / 2)))
    elif queue == ST:
        p = 1.0 - x ** params["gamma"] if position_decay else 1.0
    else:
        p = 1.0
    return alpha * w * p / dt


CASES = [(CH, T.USER, 5.0, None), (CH, T.ASSISTANT, 40.0, None), (CH, T.USER, 0.2, None),
         (AG, T.TOOL_OUTPUT, 1.5, None), (AG, T.ASSISTANT, 12.0, None), (ST, T.SYSTEM, 3.0, 0.0),
         (ST, T.TEMPLATE, 3.0, 0.4), (ST, T.TEMPLATE, 0.5, 0.95), (PE, T.REASONING, 2.0, None),
         (PE, T.USER, 7.0, None), (CH, T.USER, 1e-5, None), (ST, T.SYSTEM, 0.0, 0.5)]


@pytest.mark.parametrize("switch", [None, "type_weights", "adaptive_alpha", "lognormal", "position_decay"])
def test_priority_formula(switch):
    opts = {} if switch is None else {switch: False}
    policy = SAECachePolicy(params=PARAMS, **{**PAPER, **opts})
    now = 100.0
    for q, t, dt, x in CASES:
        got = policy.priority(block(q, t, now - dt, x), now)
        want = expected_priority(q, t, dt, x, **opts)
        assert got == pytest.approx(want, rel=1e-9), (q, t, dt, x, switch)


def test_priority_all_switches_off_is_recency():
    policy = SAECachePolicy(params=PARAMS, **ALL_OFF)
    now = 50.0
    for q, t, dt, x in CASES:
        if q == CH:
            want = math.exp(-max(dt, 1e-3) / math.exp(2.0 + 0.7 ** 2 / 2)) / max(dt, 1e-3)
            assert policy.priority(block(q, t, now - dt, x), now) == pytest.approx(want, rel=1e-9)
        if q in (ST, PE):
            assert policy.priority(block(q, t, now - dt, x), now) == pytest.approx(1 / max(dt, 1e-3), rel=1e-9)


def test_set_params_changes_priority():
    policy = SAECachePolicy(**PAPER)
    b = block(CH, T.USER, 0.0)
    before = policy.priority(b, 10.0)
    policy.set_params({"alpha_ch": 4.0})
    assert policy.priority(b, 10.0) == pytest.approx(4 * before)
    policy.set_params({"mu_chat": 2.0, "sigma_chat": 0.5})
    assert policy.priority(b, 10.0) == pytest.approx(4 * lognorm.sf(10, s=0.5, scale=math.exp(2.0)) / 10)


def test_set_params_clips_counts_and_rejects():
    policy = SAECachePolicy()
    specs = {p.name: p for p in PARAM_SPECS}
    n = policy.set_params({"gamma": 1e6, "alpha_ch": -3.0, "mu_chat": 3.0, "sigma_agent": float("nan")})
    assert n == 3  # two clipped, one NaN ignored
    assert policy.params["gamma"] == specs["gamma"].high
    assert policy.params["alpha_ch"] == specs["alpha_ch"].low
    assert policy.params["mu_chat"] == 3.0
    assert policy.params["sigma_agent"] == specs["sigma_agent"].default
    with pytest.raises(ValueError, match="no parameter"):
        policy.set_params({"gamma": 1.0, "beta": 2.0})
    with pytest.raises(ValueError):
        policy.set_params([1.0, 2.0])
    vec = [p.default for p in PARAM_SPECS]
    vec[[p.name for p in PARAM_SPECS].index("gamma")] = 100.0
    assert policy.set_params(vec) == 1
    assert policy.params["gamma"] == specs["gamma"].high
    assert SAECachePolicy(params={"gamma": 0.0}).params["gamma"] == specs["gamma"].low
    with pytest.raises(ValueError):
        SAECachePolicy(params={"nope": 1.0})
    with pytest.raises(ValueError):
        SAECachePolicy(sample=0)
    with pytest.raises(ValueError):
        SAECachePolicy(min_dt=0.0)
    for bad in ("false", 0, None):  # bool("false") is True: a switch takes true or false only
        with pytest.raises(ValueError, match="timed_refit must be true or false"):
            SAECachePolicy(timed_refit=bad)
    assert SAECachePolicy(censoring=np.bool_(False)).switches["censoring"] is False


# ----------------------------------------------------------------------------------------------------------------
# What the policy measures for its learners


def reference_gaps(trace: Trace) -> dict[str, list[float]]:
    """Log inter-arrival gaps of later turns, by queue (app AGENT -> agent, else chat); zero gaps skipped."""
    last: dict[int, float] = {}
    out = {"chat": [], "agent": []}
    for i in range(len(trace)):
        s = int(trace.session[i])
        if s < 0:
            continue
        if s in last and trace.turn[i] > 1:
            gap = trace.t[i] - last[s]
            if gap > 0:
                out["agent" if trace.app[i] == AppType.AGENT else "chat"].append(math.log(gap))
        last[s] = float(trace.t[i])
    return out


def test_gap_stats_match_the_trace():
    tr = tiny()
    r, _ = run(tr, 10_000, window_requests=7, audit=False)
    ref = reference_gaps(tr)
    for name in ("chat", "agent"):
        got = np.sum([w.policy["gap_stats"][name] for w in r.windows], axis=0)
        lg = np.array(ref[name])
        assert got[0] == lg.size > 5
        assert got[1] == pytest.approx(lg.sum(), rel=1e-9)
        assert got[2] == pytest.approx((lg ** 2).sum(), rel=1e-9)


def test_window_stats_queue_counts():
    tr = tiny()
    r, _ = run(tr, 60, window_requests=10, audit=False)
    for w in r.windows:
        occ = w.policy["queue_occupancy"]
        assert sum(occ) == w.occupancy
        assert {q: n for q, n in enumerate(occ) if n} == w.occupancy_by_queue
        assert sum(w.policy["queue_hits"]) >= w.hit_blocks
    counts = {}
    for b in r.to_python().blocks.values():
        counts[b.queue] = counts.get(b.queue, 0) + 1
    assert counts == r.policy.occupancy_by_queue()


# ----------------------------------------------------------------------------------------------------------------
# 6. The default ranking: continuation model and hit density


def test_density_priority_matches_a_direct_computation():
    """alpha_q * w_type * D, with D computed from its definition (scipy: the survival integral), p the centre of the
    block's continuation bin, the horizon the policy's turnover time."""
    from scipy.integrate import quad

    policy = SAECachePolicy(params=PARAMS, type_weights=True, adaptive_alpha=True, position_decay=True)
    now, h = 500.0, policy.horizon
    for q, t, dt, x, slot in [(CH, T.USER, 5.0, None, 20), (CH, T.ASSISTANT, 300.0, None, 3), (AG, T.TOOL_OUTPUT,
                              1.5, None, 28), (ST, T.TEMPLATE, 40.0, 0.4, 0), (ST, T.SYSTEM, 2.0, 0.0, 0)]:
        b = block(q, t, now - dt, x)
        if q != ST:
            b.pdata = q * 8 + t + saecache._SLOT * slot
        mu, sigma = {CH: (PARAMS["mu_chat"], PARAMS["sigma_chat"]), AG: (PARAMS["mu_agent"], PARAMS["sigma_agent"]),
                     ST: (3.4, 2.0)}[q]
        p = slot_p(slot) if q != ST else policy.arrivals.p_structural

        def sf(y, mu=mu, sigma=sigma):
            return lognorm.sf(y, s=sigma, scale=math.exp(mu))

        s_now = sf(dt)
        pi = p * s_now / (1 - p + p * s_now)
        hit = pi * (s_now - sf(dt + h)) / s_now
        held = pi * quad(lambda y, s_now=s_now, sf=sf: sf(y) / s_now, dt, dt + h, epsrel=1e-11)[0] + (1 - pi) * h
        alpha = {ST: PARAMS["alpha_st"], CH: PARAMS["alpha_ch"], AG: PARAMS["alpha_ag"]}[q]
        want = alpha * PARAMS[f"w_{TokenType(t).name.lower()}"] * hit / held
        if q == ST:
            want *= 1 - x ** PARAMS["gamma"]
        assert policy.priority(b, now) == pytest.approx(want, rel=1e-6), (q, t, dt)


def test_the_value_context_is_the_models_linear_over_attention_flops():
    """First principles, not a fit: a block's FLOPs per token are ``2 N`` in the linear layers (N: Qwen2.5-1.5B's
    non-embedding parameters) plus ``4 L d`` per token of context (L layers, d the attention width), so its
    recompute costs twice the start-of-prompt cost at ``N / (2 L d)`` tokens of context."""
    assert saecache._VALUE_CONTEXT == pytest.approx(1_310_340_608 / (2 * 28 * 1536), rel=1e-12)
    assert 15_000 < saecache._VALUE_CONTEXT < 15_500
    assert SAECachePolicy().value_context == saecache._VALUE_CONTEXT  # the default, the paper's model


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "many", True])
def test_a_bad_value_context_is_refused(bad):
    with pytest.raises(ValueError, match="value_context must be a positive number of tokens"):
        SAECachePolicy(hit_value=True, value_context=bad)


def test_the_value_context_option_sets_the_bins():
    """Another model's context (``value_context``, tokens): the bins of the same depths move with it."""
    for context in (8.0, 1_000.0, saecache._VALUE_CONTEXT, 26_000):
        policy = SAECachePolicy(hit_value=True, value_context=context)
        policy._block_size = 16
        for depth in (0, 1, 7, 100, 5000):
            assert policy._value_bin_of(depth) == math.floor(4 * math.log2(1 + depth * 16 / context))


def test_hit_value_weighs_the_density_by_the_blocks_value_bin():
    """Under hit_value a chat or agent block's priority is its hit density times the centre of its value bin,
    ``2 ** ((k + 0.5) / 4)`` with ``k = floor(4 log2(1 + context / _VALUE_CONTEXT))`` (the context: the tokens before
    the block), computed here apart from the policy; without it, the density alone."""
    now, slot = 500.0, 20
    plain, valued = SAECachePolicy(params=PARAMS), SAECachePolicy(params=PARAMS, hit_value=True)
    valued._block_size = 16
    seen = set()
    for depth in (0, 100, 181, 182, 1000, 4000, 20000):
        k = math.floor(4 * math.log2(1 + depth * 16 / saecache._VALUE_CONTEXT))
        assert valued._value_bin_of(depth) == k
        seen.add(k)
        b = block(CH, T.USER, now - 30.0)
        b.depth = depth
        b.pdata = CH * 8 + saecache._SLOT * slot
        base = plain.priority(b, now)
        b.pdata += saecache.VALUE_STRIDE * k
        assert valued.priority(b, now) == pytest.approx(base * 2 ** ((k + 0.5) / 4), rel=1e-12)
    assert len(seen) >= 5  # the depths span several bins


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hit_value_victims_are_exact_across_value_bins(seed):
    """With a value context of 8 tokens the tiny traces' blocks spread over many value bins (groups): the victim is
    still the exact least (PE flag, value x density, stamp) over every evictable block, and the bins change
    decisions (against hit_value off)."""
    tr = tiny(seed)
    n, differ, bins = 0, 0, set()
    for cap in CAPACITIES:
        r, a = run(tr, cap, window_requests=25, strict_temporal=True, hit_value=True, value_context=8.0)
        n += a.temporal_evictions
        bins |= {g // saecache.VALUE_STRIDE for g in r.policy._lists}
        _, b = run(tr, cap, window_requests=25, hit_value=False)
        differ += a.victims != b.victims
    assert n > 500 and differ and len(bins) >= 5


def test_continuation_routing():
    """With the continuation model, every request's non-structural blocks go to the chat or agent queue by its app
    (no rule for first requests); reasoning outputs to PE, SYSTEM / TEMPLATE blocks to structural. With pe_routing
    and a threshold above every probability, the temporal blocks go to PE instead."""
    q = queues_after(routing_trace())
    expect = {100: ST, 101: CH, 102: CH, 103: CH, 104: CH, 105: CH,
              200: ST, 201: ST, 202: AG, 203: AG, 204: AG, 205: AG,
              300: ST, 301: ST, 302: CH, 303: CH, 304: CH,  # templated first request: its probability decides
              400: CH, 401: CH, 402: CH,
              500: CH, 501: PE, 502: PE, 503: PE, 504: PE,
              505: CH, 506: CH}
    assert q == expect
    q = queues_after(routing_trace(), pe_routing=True, continue_threshold=1.0)
    assert {k for k, v in q.items() if v == PE} == {k for k, v in expect.items() if v in (CH, AG, PE)}


def test_structural_gap_stats_match_the_trace():
    """Under density, the structural queue's gaps are the times between uses of one shared prefix (the key ending a
    request's leading SYSTEM / TEMPLATE run)."""
    tr = templated_heavy()
    r, _ = run(tr, 10_000, window_requests=7, audit=False)
    last: dict[int, float] = {}
    lg = []
    for i in range(len(tr)):
        keys, types = tr.prompt_blocks(i)
        run_len = 0
        while run_len < len(types) and types[run_len] <= T.TEMPLATE:
            run_len += 1
        if not run_len:
            continue
        key = int(keys[run_len - 1])
        if key in last and tr.t[i] > last[key]:
            lg.append(math.log(tr.t[i] - last[key]))
        last[key] = float(tr.t[i])
    got = np.sum([w.policy["gap_stats"]["structural"] for w in r.windows], axis=0)
    assert got[0] == len(lg) > 20
    assert got[1] == pytest.approx(sum(lg), rel=1e-9)
    assert got[2] == pytest.approx(sum(x * x for x in lg), rel=1e-9)


@pytest.mark.parametrize("timed,rebin,shape", [(False, False, None), (True, False, None), (False, True, None),
                                               (False, False, "empirical_gaps"), (False, False, "gap_mixture"),
                                               (False, True, "gap_select"), (True, False, "gap_select")])
def test_decisions_never_read_the_future(timed, rebin, shape):
    """The default policy with its online learners, on the trace and on the trace cut after request k: the same hits
    for every request before k (and, in instant mode, the same victims). Nothing a decision uses may come from a
    later request: not the continuation model, the turnover time, the learners, nor anything bind() precomputes."""
    from agents.sae_online import SAEOnlineLearner

    trace = load_source("conversations", None)[0]
    cap = max(1, int(0.05 * trace.distinct_blocks()))

    def replay(tr):
        policy = SAECachePolicy(rebin=rebin, **({shape: True} if shape else {}))
        victims = record_victims(policy)
        r = Replay(tr, PrefixCache(cap, policy), make_server(SERVER) if timed else None, window_requests=25,
                   callbacks=[SAEOnlineLearner().callback()])
        r.run()
        return [h for w in r.windows for h in w.hits_per_request], victims

    hits_full, victims_full = replay(trace)
    for k in (100, 350):
        hits_cut, victims_cut = replay(trace.take(np.arange(k)))
        assert hits_cut == hits_full[:k], k
        if not timed:
            assert victims_cut == victims_full[:len(victims_cut)], k


def test_a_shared_prefix_keeps_its_last_use_across_traces_and_state_round_trips():
    """The structural reuse rate counts a use of a shared prefix by its key: a prefix last used on one trace is
    reused when a later trace (bound to the same arrivals) uses it, and an exported state carries it into arrivals
    bound to either trace, or to none yet."""
    from sae_env.policies.arrivals import Arrivals

    def trace(prefix_keys: list[int], t0: float) -> Trace:
        b = TraceBuilder(block_size=BS)
        for j, key in enumerate(prefix_keys):
            b.add(t=t0 + j, session=-1, turn=1, app=AppType.CHAT, prompt_tokens=2 * BS, output_tokens=0,
                  prompt_keys=[key, 1000 + j], prompt_types=[TokenType.SYSTEM, TokenType.USER])
        return b.build()

    first, second = trace([7, 8], 0.0), trace([9, 7], 10.0)
    a = Arrivals(continuation=False)
    for i in range(len(first)):
        a.arrive(first, i, float(first.t[i]))
    state = a.export_state()
    assert sorted(state["prefix_keys"].tolist()) == [7, 8]
    for make in (lambda: a, lambda: _imported(Arrivals, state, second), lambda: _imported(Arrivals, state, None)):
        b = make()
        b.arrive(second, 0, 10.0)  # prefix 9: new
        assert (b._prefix_uses, b._prefix_reused) == (3, 0)
        b.arrive(second, 1, 11.0)  # prefix 7: last used at 0 on the first trace
        assert (b._prefix_uses, b._prefix_reused) == (4, 1)
        assert b.gap_stats[ST][0] == 1 and b.gap_stats[ST][1] == pytest.approx(math.log(11.0))


def _imported(cls, state, bound):
    a = cls(continuation=False)
    if bound is not None:
        a.bind(bound)
    a.import_state(state)
    return a


# ----------------------------------------------------------------------------------------------------------------
# 7. rebin: blocks follow their request's current continuation bin

@pytest.mark.parametrize("switch,needs", [("rebin", ("continuation", "density")),
                                          ("empirical_gaps", ("density", "lognormal")),
                                          ("gap_mixture", ("density", "lognormal")),
                                          ("gap_select", ("density", "lognormal"))])
def test_a_switch_needs_what_it_builds_on(switch, needs):
    """rebin moves blocks between continuation bins (the model's, under the density); empirical_gaps and gap_mixture
    reshape the density's gap distribution, with the log-normal as the prior, and exclude each other; gap_select
    chooses between the density's log-normal and its exponential."""
    for off in needs:
        with pytest.raises(ValueError, match=switch):
            SAECachePolicy(**{switch: True, off: False})
    with pytest.raises(ValueError, match=f"{switch} must be true or false"):
        make_policy("saecache", **{switch: "yes"})
    with pytest.raises(ValueError, match="choose one"):
        SAECachePolicy(empirical_gaps=True, gap_mixture=True)


def test_rebin_is_on_by_default_wherever_its_bins_exist():
    """Left unset, rebin follows the continuation model and the hit density (its bins need both): on in the default,
    off in the paper's method and in the ablations that switch either off, without an error; set, it is checked."""
    assert make_policy("saecache").switches["rebin"]
    assert not make_policy("saecache", rebin=False).switches["rebin"]
    assert not make_policy("saecache-paper").switches["rebin"]
    for off in ("continuation", "density"):
        assert not SAECachePolicy(**{off: False}).switches["rebin"]


def test_rebin_every_is_a_whole_number_of_refits():
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="rebin_every"):
            make_policy("saecache", rebin=True, rebin_every=bad)


def test_rebin_move_is_a_number_of_logits():
    for bad in (-0.1, -math.inf, math.nan, True, "0.25", None):
        with pytest.raises(ValueError, match="rebin_move"):
            make_policy("saecache", rebin=True, rebin_move=bad)
    assert make_policy("saecache", rebin=True, rebin_move=0).rebin_move == 0.0


def test_the_model_moved_once_beta_changes_or_a_rate_moves_past_the_step():
    """model_moved, the trigger both engines read: any change of beta, or some turn's rate (bucket 0 unused) moved by
    more than the step on the logit scale, with the rates clipped as the model's p clips them."""
    from sae_env.policies.arrivals import REBIN_MOVE, model_moved
    from sae_env.policies.continuation import P_CLIP

    rates, beta = np.array([0.5, 0.2, 0.7, 0.9]), np.zeros(3)
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    expit = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert model_moved(rates, beta, None, REBIN_MOVE)  # the first refit always rebins
    assert not model_moved(rates, beta, (rates.copy(), beta.copy()), REBIN_MOVE)
    assert model_moved(rates, beta + np.array([0, 1e-12, 0]), (rates, beta), REBIN_MOVE)
    for k in (1, 2, 3):
        for step, moved in ((0.9 * REBIN_MOVE, False), (1.1 * REBIN_MOVE, True), (-1.1 * REBIN_MOVE, True)):
            now = rates.copy()
            now[k] = expit(logit(rates[k]) + step)
            assert model_moved(now, beta, (rates, beta), REBIN_MOVE) is moved, (k, step)
    now = rates.copy()
    now[0] = 0.99  # bucket 0 is unused
    assert not model_moved(now, beta, (rates, beta), REBIN_MOVE)
    low = rates.copy()
    low[1] = P_CLIP / 10
    lower = rates.copy()
    lower[1] = P_CLIP / 1000  # both clip to P_CLIP: no move
    assert not model_moved(lower, beta, (low, beta), REBIN_MOVE)
    ulp = rates.copy()
    ulp[2] = np.nextafter(rates[2], 1.0)
    assert model_moved(ulp, beta, (rates, beta), 0.0)  # at 0, any move at all
    assert not model_moved(rates, beta, (rates.copy(), beta.copy()), 0.0)


def test_rebin_move_zero_rebins_as_every_refit_did_and_the_default_skips_refits():
    """rebin_move=0 skips only refits after which the model has not moved at all, where a rebinning would find every
    bin as it was: the same decisions as rebinning at every refit. The default step skips refits on a real trace
    (once its rates settle) and still moves blocks."""
    trace = open_trace("mooncake_synthetic")[0]
    cap = resolve_capacity(0.1, trace.distinct_blocks())
    done = []
    inner = SAECachePolicy._rebin_blocks

    def counting(self):
        done.append(self.arrivals.arrivals)
        inner(self)

    def hits(move, always=False):
        done.clear()
        policy = SAECachePolicy(rebin=True, rebin_move=move)
        with patch.object(SAECachePolicy, "_rebin_blocks", counting), \
                patch.object(saecache, "model_moved", lambda *a: True) if always else nullcontext():
            r = Replay(trace, PrefixCache(cap, policy), window_requests=200, engine="python")
            r.run()
        return [h for w in r.windows for h in w.hits_per_request], len(done)

    every, n_every = hits(0.0, always=True)
    zero, n_zero = hits(0.0)
    assert zero == every and n_zero <= n_every == len(trace) // 64
    default, n_default = hits(saecache.REBIN_MOVE)
    assert n_default < 3 * n_every // 4 and default != every  # 34 of 62
    assert default != hits(math.inf)[0]  # the rates' moves rebin too (math.inf: only where beta is refitted)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(max_requests=40), capacity=st.integers(1, 30), switches=switch_sets,
       predictor=predictors, timed=st.booleans())
def test_rebin_keeps_the_invariants_and_the_exact_victims(trace, capacity, switches, predictor, timed):
    """Rebinning every third arrival (REFIT_EVERY patched) under random switches: check=True after every request,
    the audit at every eviction (strict in instant mode: a moved group's order must stay exact), and every listed
    chat or agent block in the group of its request's bin at the last rebinning."""
    from sae_env.policies import arrivals

    opts = {**options(switches, predictor, 8), "continuation": True, "density": True, "rebin": True}
    checked = []
    with patch.object(arrivals, "REFIT_EVERY", 3), patch.object(SAECachePolicy, "_rebin_blocks",
                                                                _checked_rebin(checked)):
        run(trace, capacity, timed=timed, strict_temporal=not timed, **opts)
    if len(trace) >= 3:
        assert checked  # it rebinned


def _checked_rebin(log: list):
    inner = SAECachePolicy._rebin_blocks

    def rebin(self):
        inner(self)
        for g, lst in self._lists.items():
            for _, b in lst.live():
                if b.queue in (CH, AG):
                    i = self._released_by[b]
                    slot = g % saecache.VALUE_STRIDE // saecache.GROUP_SLOT
                    assert slot == self._bin_now.get(i, slot), (b, i)
                    assert g == self._group(b) == b.pdata
        log.append(len(self._bin_now))
    return rebin


def test_rebin_moves_blocks_on_a_real_trace():
    """On real conversations the model's answers move after a request's arrival, and blocks change bins; the replay
    then differs from the one without rebinning."""
    trace = load_source("conversations", None)[0]
    cap = max(1, int(0.05 * trace.distinct_blocks()))
    moved = []
    inner = SAECachePolicy._rebin_blocks

    def counting(self):
        before = {b: b.pdata for lst in self._lists.values() for _, b in lst.live() if b.queue in (CH, AG)}
        inner(self)
        moved.append(sum(b.pdata != g for b, g in before.items()))

    def hit_counts(**opts):
        r = Replay(trace, PrefixCache(cap, SAECachePolicy(**opts)), window_requests=25, check=True)
        r.run()
        return [h for w in r.windows for h in w.hits_per_request]

    with patch.object(SAECachePolicy, "_rebin_blocks", counting):
        rebinned = hit_counts(rebin=True)
    assert len(moved) >= len(trace) // 64 - 1 and sum(moved) > 0
    assert rebinned != hit_counts(rebin=False)


def test_rebin_state_round_trips():
    """export_state -> import_state carries each block's releasing request and the bins of the last rebinning: the
    copy exports the same state and goes on making the same decisions."""
    from sae_env.state import export_cache, import_cache

    trace = load_source("conversations", None)[0]
    cap = max(1, int(0.05 * trace.distinct_blocks()))
    cut = 200
    r = Replay(trace[:cut], PrefixCache(cap, SAECachePolicy(rebin=True)), window_requests=25)
    r.run()
    cache = r.to_python()
    state, blocks = export_cache(cache)
    index = {b.key: i for i, b in enumerate(blocks)}
    exported = cache.policy.export_state(index)
    assert (exported["released_by"] >= 0).any() and exported["rebin_requests"].size
    copy = PrefixCache(cache.capacity, SAECachePolicy(rebin=True))
    copy.policy.bind(trace)
    copied = import_cache(copy, state)
    copy.policy.import_state(exported, copied)
    copy.check_invariants()
    again = copy.policy.export_state({b.key: i for i, b in enumerate(copied)})
    for k, v in exported.items():
        assert np.array_equal(np.asarray(v), np.asarray(again[k]), equal_nan=True), k
    now = float(trace.t[cut - 1]) + 1.0
    victims = []
    for c in (cache, copy):
        v = record_victims(c.policy)
        while len(c) > cap // 2 and c._evict_one(now):
            pass
        c.check_invariants()
        victims.append(v)
    assert victims[0] == victims[1] and victims[0]


# ----------------------------------------------------------------------------------------------------------------
# 8. empirical_gaps: the chat and agent queues' gap shape from the gaps completed so far

def test_empirical_gaps_are_the_sessions_completed_gaps():
    """The arrivals keep every chat and agent session gap as it completes (the same ones the learners' statistics
    count), and each refit rebuilds the ranking's gap distributions from them; an exported state carries them."""
    from sae_env.policies.arrivals import Arrivals
    from sae_env.policies.survival import EmpiricalGaps

    trace = load_source("conversations", None)[0]
    policy = SAECachePolicy(empirical_gaps=True)
    r = Replay(trace, PrefixCache(max(1, int(0.05 * trace.distinct_blocks())), policy), window_requests=50)
    r.run()
    r.to_python()  # the compiled engine, where it ran, gives the state back (the gaps and the tables' counts)
    raw = policy.arrivals.raw_gaps
    want = []  # every chat session's gaps, in arrival order (WildChat: every session is a chat one)
    last = {}
    for i in range(len(trace)):
        s = int(trace.session[i])
        if s in last and trace.t[i] > last[s]:
            want.append(float(trace.t[i] - last[s]))
        last[s] = float(trace.t[i])
    assert list(raw[CH]) == pytest.approx(want) and len(raw[AG]) == 0 and len(want) > 100
    n_logged = sum(w.policy["gap_stats"]["chat"][0] for w in r.windows)
    assert n_logged == len(want)
    ranking = policy._gaps[CH]
    assert isinstance(ranking, EmpiricalGaps) and 0 < ranking.n <= len(want)
    state = policy.arrivals.export_state()
    copy = Arrivals(keep_gaps=True)
    copy.bind(trace)
    copy.import_state(state)
    assert list(copy.raw_gaps[CH]) == list(raw[CH])
    plain = Arrivals()
    plain.bind(trace)
    plain.import_state(state)  # a policy without the switch ignores them
    assert plain.raw_gaps is None


@pytest.mark.parametrize("shape", ["empirical_gaps", "gap_mixture"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(max_requests=40), capacity=st.integers(1, 30), switches=switch_sets,
       predictor=predictors, timed=st.booleans())
def test_empirical_gaps_keep_the_invariants(shape, trace, capacity, switches, predictor, timed):
    """Refitting every third arrival (REFIT_EVERY patched) under random switches: check=True after every request and
    the audit at every eviction. Not strict about the chat and agent victims: an empirical density need not rise then
    fall with idle time, so a group's oldest and newest blocks need not hold its least. The mixture is fitted from 3
    gaps on and always taken (BIC's penalty patched away), so that these short traces rank by it."""
    from sae_env.policies import arrivals, survival

    opts = {**options(switches, predictor, 8), "density": True, "lognormal": True, shape: True}
    with patch.object(arrivals, "REFIT_EVERY", 3), patch.object(survival, "MIXTURE_MIN_GAPS", 3), \
            patch.object(survival, "MIXTURE_EXTRA_PARAMETERS", -1e9):
        r, _ = run(trace, capacity, timed=timed, **opts)
    assert sum(w.requests for w in r.windows) == len(trace)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=session_traces(max_requests=40), capacity=st.integers(1, 30), switches=switch_sets,
       predictor=predictors, timed=st.booleans(), sample=st.sampled_from([1, 2, 128]),
       census=st.sampled_from([math.inf, 4.0, 0.5]))
def test_gap_select_keeps_the_invariants(trace, capacity, switches, predictor, timed, sample, census):
    """gap_select, choosing every third arrival (REFIT_EVERY patched) under random switches, its census over or not:
    check=True after every request (the idle blocks it counts are the cache's unpinned ones) and the audit at every
    eviction, strict in instant mode: the exponential's density falls with idle time, so a group's oldest block holds
    its least, and the log-normal's rises then falls, as before."""
    from sae_env.policies import arrivals

    opts = {**options(switches, predictor, 8), "density": True, "lognormal": True, "gap_select": True,
            "idle_sample": sample, "census": census}
    with patch.object(arrivals, "REFIT_EVERY", 3):
        r, _ = run(trace, capacity, timed=timed, strict_temporal=not timed, **opts)
    assert sum(w.requests for w in r.windows) == len(trace)


# ----------------------------------------------------------------------------------------------------------------
# 9. gap_mixture: two log-normals where the gaps choose them

def test_gap_mixture_ranks_by_the_mixture_the_gaps_choose():
    """On mooncake_synthetic (recorded gaps with a fast-return mode) the chat queue ends ranked by a mixture fitted
    on a count of its gaps the schedule gives; on WildChat (gaps our generator draws from one log-normal) by the
    learners' log-normal."""
    from agents.sae_online import SAEOnlineLearner
    from sae_env.policies.survival import LognormalGaps, MixtureGaps, mixture_gaps_used

    for name, kind in (("mooncake_synthetic", MixtureGaps), ("wildchat", LognormalGaps)):
        trace = open_trace(name, None, {}, None)[0]
        trace = trace.take(np.arange(min(1500, len(trace))))
        policy = SAECachePolicy(gap_mixture=True)
        r = Replay(trace, PrefixCache(max(1, int(0.05 * trace.distinct_blocks())), policy), window_requests=200,
                   callbacks=[SAEOnlineLearner().callback()])
        r.run()
        r.to_python()
        ranking = policy._gaps[CH]
        assert isinstance(ranking, kind), name
        n = len(policy.arrivals.raw_gaps[CH])
        used = policy._shapes.used[0]  # at the last refit: a point of the schedule, some gaps ago
        assert 0 < used == mixture_gaps_used(used, 0.5) <= n < used * 1.5 + 64
        if kind is MixtureGaps:
            assert ranking.n == used and ranking.weights.min() > 0.05


@pytest.mark.parametrize("engine", ["python", "fast"])
def test_gap_mixture_state_carries_the_fit_prior(engine):
    """A window's end where the learners have moved the log-normal since the chat mixture was fitted: the state
    carries the count and the prior of the fit, and a policy importing it ranks by the same table (the compiled
    engine's state, handed to the Python policy at every window, against a Python replay's)."""
    from agents.sae_online import SAEOnlineLearner
    from sae_env.policies.survival import MixtureGaps
    from sae_env.state import export_cache, import_cache

    trace = open_trace("mooncake_synthetic", None, {}, None)[0]
    cap = max(1, int(0.05 * trace.distinct_blocks()))

    def replay(engine: str) -> Replay:
        return Replay(trace, PrefixCache(cap, SAECachePolicy(gap_mixture=True)), window_requests=100,
                      callbacks=[SAEOnlineLearner().callback()], engine=engine)

    ref, moved = replay("python"), replay(engine)
    if engine == "fast" and moved.engine != "fast":
        pytest.skip("no compiled engine here")
    policy = ref.policy
    while not ref.done:
        ref.step()
        moved.step()
        ranking = policy._gaps[CH]
        if isinstance(ranking, MixtureGaps) and (ranking.mu, ranking.sigma) != tuple(policy._ln[CH]):
            break
    else:
        pytest.fail("the learners never moved the log-normal after a mixture fit")
    cache = moved.to_python()
    state, blocks = export_cache(cache)
    pstate = cache.policy.export_state({b.key: i for i, b in enumerate(blocks)})
    assert pstate["mixture_prior"][0].tolist() == [ranking.mu, ranking.sigma]
    copy = PrefixCache(cache.capacity, SAECachePolicy(gap_mixture=True))
    copy.policy.bind(trace)
    copy.policy.set_params(cache.policy.params)
    copy.policy.import_state(pstate, import_cache(copy, state))
    for p in (cache.policy, copy.policy):
        assert np.array_equal(p._gaps[CH].table()[0], ranking.table()[0])


def test_rebin_keeps_the_parent_shortcut():
    """Under rebin a chain's parents are taken without a scan as without it: the shortcut compares the victim's group
    now, not the one it had before the last rebinning (a parent the shortcut took never returned, so its recorded
    group may predate it, and each such miss cost a full scan: 2.5 times the scans on mooncake_synthetic at 10 %)."""
    trace = open_trace("mooncake_synthetic", None, {}, None)[0].take(np.arange(1500))
    scans = {}
    for rebin in (False, True):
        policy = make_policy("saecache", rebin=rebin)
        count = [0]
        best = policy._best

        def counted(g, now, best=best, count=count):
            count[0] += 1
            return best(g, now)

        policy._best = counted
        Replay(trace, PrefixCache(int(0.1 * trace.distinct_blocks()), policy), window_requests=200,
               engine="python").run()
        scans[rebin] = count[0]
    assert scans[True] < 1.3 * scans[False]
