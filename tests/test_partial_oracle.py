"""Tests of the partial oracles (sae_env/policies/partial_oracle.py): reuse-oracle, session-oracle, when-oracle.

* Golden: hand-built traces whose victims are worked out by hand in each case's docstring, for every oracle beside
  LRU and Belady.
* Differential: when-oracle with ``factor=1`` is Belady hit for hit (instant and timed); reuse-oracle is LRU hit
  for hit while no block is dead, Belady hit for hit when the cache holds every reused block, and at least LRU in
  every cell of the embedded real traces.
* Order: lru <= reuse-oracle <= belady on random prefix traces in instant mode (the test says why it must hold
  there, and where it need not). The invariants of every registered policy, oracles included, in instant and
  timed mode, are in test_policies.py (test_instant_invariants_and_forced_bypasses, test_timed_invariants);
  here the when-oracle's other factors get the same checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import build_trace, flat_trace, prefix_traces
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sae_env.cache import PrefixCache, resolve_capacity
from sae_env.policies import make_policy, policy_class
from sae_env.replay import Replay, replay
from sae_env.serving import make_server

SERVER = "qwen2.5-1.5b@a40"
ORACLES = ("reuse-oracle", "session-oracle", "when-oracle")
SETTINGS = settings(max_examples=40, deadline=None, report_multiple_bugs=False)


class Victims:
    """A cache observer that lists ``(request, victim key)`` for every eviction (the clock is the request)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.victims: list[tuple[int, int]] = []
        cache.observer = self

    def on_miss_run(self, keys, start, prompt, now) -> None:
        pass

    def on_ghost_hit(self, j, code, now) -> None:
        pass

    def on_evict(self, victim, now) -> None:
        self.victims.append((int(now), victim.key))


def run_flat(ids: list[int], sessions: list[int], capacity: int, name: str, **options):
    """Flat trace (key = id, request i at time i) with the given sessions; returns (victims, hits per request)."""
    trace = flat_trace(ids)
    trace.session = np.asarray(sessions, dtype=trace.session.dtype)
    cache = PrefixCache(capacity, make_policy(name, **options))
    victims = Victims(cache)
    r = Replay(trace, cache, window_requests=1, check=True)
    r.run()
    return victims.victims, [w.hit_blocks for w in r.windows]


def hits(trace, policy, capacity: int, timed: bool = False, **kw) -> list[int]:
    """Per-request hit blocks (invariants checked after every request)."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    r = replay(trace, policy, capacity, server=make_server(SERVER) if timed else None, window_requests=1, check=True,
               **kw)
    return [w.hit_blocks for w in r.windows]


# ----------------------------------------------------------------------------------------------------------------
# Golden: victims by hand

GOLDEN = {
    # ids, sessions, capacity, {policy: (victims as (request, key), hits per request)}
    "reuse": (
        [2, 1, 3, 2], [0, 1, 2, 3], 2, {
            "lru": ([(2, 2), (3, 1)], [0, 0, 0, 0]),
            "reuse-oracle": ([(2, 1)], [0, 0, 0, 1]),
            "session-oracle": ([(2, 2), (3, 1)], [0, 0, 0, 0]),
            "when-oracle": ([(2, 1)], [0, 0, 0, 1]),
            "belady": ([(2, 1)], [0, 0, 0, 1]),
        }),
    "session": (
        [1, 2, 3, 2], [0, 1, 0, 2], 2, {
            "lru": ([(2, 1)], [0, 0, 0, 1]),
            "reuse-oracle": ([(2, 1)], [0, 0, 0, 1]),
            "session-oracle": ([(2, 2), (3, 3)], [0, 0, 0, 0]),
            "when-oracle": ([(2, 1)], [0, 0, 0, 1]),
            "belady": ([(2, 1)], [0, 0, 0, 1]),
        }),
    "shared": (
        [7, 2, 7, 1, 3, 2, 7], [0, 1, 2, 3, 4, 1, 5], 3, {
            "lru": ([(4, 2), (5, 7), (6, 1)], [0, 0, 1, 0, 0, 0, 0]),
            "reuse-oracle": ([(4, 1)], [0, 0, 1, 0, 0, 1, 1]),
            "session-oracle": ([(4, 1)], [0, 0, 1, 0, 0, 1, 1]),
            "when-oracle": ([(4, 1)], [0, 0, 1, 0, 0, 1, 1]),
            "belady": ([(4, 1)], [0, 0, 1, 0, 0, 1, 1]),
        }),
    "when": (
        [1, 2, 3, 4, 3, 4, 2, 1], list(range(8)), 3, {
            "lru": ([(3, 1), (7, 3)], [0, 0, 0, 0, 1, 1, 1, 0]),
            "reuse-oracle": ([(3, 1), (7, 3)], [0, 0, 0, 0, 1, 1, 1, 0]),
            "session-oracle": ([(3, 1), (7, 3)], [0, 0, 0, 0, 1, 1, 1, 0]),
            "when-oracle": ([(3, 2), (6, 3)], [0, 0, 0, 0, 1, 1, 0, 1]),
            "belady": ([(3, 1), (7, 3)], [0, 0, 0, 0, 1, 1, 1, 0]),
        }),
}


@pytest.mark.parametrize("case", list(GOLDEN))
def test_golden_victims(case):
    """One block per request (key = id), request i at time i; worked out by hand:

    * ``reuse`` (2 1 3 2, capacity 2, every request its own session): request 2 evicts 2 under LRU (released
      first) but 1 under reuse-oracle, when-oracle and Belady (1 is never used again: dead), so they hit 2 at
      request 3. session-oracle: every block's last user is its session's final request and nobody shared them,
      so all are equally dead and LRU's order decides, as for LRU.
    * ``session`` (1 2 3 2; sessions A B A C): at request 2, 1's last user (request 0) has another turn in its
      session, 2's (request 1, session B) does not: session-oracle evicts 2, although C reuses it next; the others
      evict 1 (dead; LRU: released first). At request 3 session-oracle evicts 3 (A's final turn) and keeps 1, whose
      last user's session continued, although 1 is never used again: it knows turns, not blocks.
    * ``shared`` (7 2 7 1 3 2 7, capacity 3; requests 1 and 5 are session B, the rest their own): request 2 hits 7
      from another session, so session-oracle holds 7 alive for good; at request 4 the oracles evict 1 (D's final
      turn; dead) and hit 2 and 7 afterwards; LRU evicts in release order 2, 7, 1 and misses both.
    * ``when`` (1 2 3 4 3 4 2 1, capacity 3): at request 3 the next uses are 1 -> 7, 2 -> 6, 3 -> 4. Belady evicts 1.
      when-oracle (factor 2) knows each only to within [2**k, 2**(k+1)) of the request that brought the knowledge:
      1 is 7 after request 0 (bucket [4, 8), estimate 0 + 4 sqrt 2 = 5.7), 2 is 5 after request 1 (bucket [4, 8),
      estimate 1 + 5.7 = 6.7), 3 is 2 after request 2 (estimate 4.8): it evicts 2, misses it at request 6 and then
      evicts 3 (never used again, like 4; released before 4). LRU and reuse-oracle evict 1 (released first, all
      alive); at request 7 Belady and LRU evict 3 among 2, 3, 4 (no use left; 3 became evictable first).
    """
    ids, sessions, capacity, want = GOLDEN[case]
    for name, (victims, per_request) in want.items():
        assert run_flat(ids, sessions, capacity, name) == (victims, per_request), name
    # factor 1 is Belady's knowledge
    assert run_flat(ids, sessions, capacity, "when-oracle", factor=1) == want["belady"]


def test_oracles_are_marked():
    for name in ORACLES:
        assert policy_class(name).oracle, name
    assert not policy_class("lru").oracle


@pytest.mark.parametrize("factor", [0.5, float("inf"), float("nan"), True, "2"])
def test_when_oracle_rejects_a_bad_factor(factor):
    with pytest.raises(ValueError, match="factor"):
        make_policy("when-oracle", factor=factor)


# ----------------------------------------------------------------------------------------------------------------
# Differential


@pytest.mark.parametrize("timed", [False, True])
@SETTINGS
@given(data=st.data(), capacity=st.integers(1, 30))
def test_when_oracle_with_factor_one_is_belady(timed, data, capacity):
    """Same decisions whenever they matter: two evictable leaves can share a finite next use only if one is the
    other's ancestor (one request's blocks form one chain), which a leaf cannot be, so the tie-breaks (Belady:
    deeper first; when-oracle: release order) only order dead blocks, and which dead block goes first never
    changes a hit."""
    trace = data.draw(prefix_traces(timed=timed))
    assert hits(trace, make_policy("when-oracle", factor=1), capacity, timed) == hits(trace, "belady", capacity,
                                                                                       timed)


@pytest.mark.parametrize("timed", [False, True])
@SETTINGS
@given(data=st.data(), capacity=st.integers(1, 30), factor=st.sampled_from([1.0, 1.5, 3.0, 10.0]))
def test_when_oracle_invariants_for_any_factor(timed, data, capacity, factor):
    """The registry's when-oracle (factor 2) is covered by test_policies.py; other factors keep the cache's
    invariants too (checked after every request) and never give up while a block is evictable."""
    trace = data.draw(prefix_traces(timed=timed))
    r = replay(trace, make_policy("when-oracle", factor=factor), capacity,
               server=make_server(SERVER) if timed else None, window_requests=1, check=True)
    assert all(w.occupancy <= capacity for w in r.windows)
    if not timed:
        for i, w in enumerate(r.windows):  # instant mode: bypasses only where the request itself does not fit
            n_p, n_o = len(trace.prompt_blocks(i)[0]), len(trace.output_blocks(i)[0])
            assert w.bypasses == (n_p - capacity if n_p > capacity else max(0, n_p + n_o - capacity))


def cycled(prompts: list[list[int]], cycles: int, timed: bool):
    """The prompts ``cycles`` times over (no outputs); timed: arrivals 5 ms apart, so that requests overlap."""
    n = len(prompts) * cycles
    times = np.arange(n) * 0.005 if timed else None
    return build_trace(prompts * cycles, None, times, out_extra=[30] * n if timed else None)


@pytest.mark.parametrize("timed", [False, True])
@SETTINGS
@given(prompts=st.lists(st.lists(st.integers(0, 2), max_size=5), min_size=1, max_size=12),
       cycles=st.integers(2, 3), capacity=st.integers(1, 20))
def test_reuse_oracle_is_lru_while_nothing_is_dead(timed, prompts, cycles, capacity):
    """A trace of the same requests ``cycles`` times (no outputs): every block used in a cycle but the last is used
    again in the next one, so until the last cycle no block is dead, reuse-oracle's knowledge separates nothing,
    and it must make LRU's decisions (vLLM's release order), hit for hit."""
    trace = cycled(prompts, cycles, timed)
    before_last = len(prompts) * (cycles - 1)
    assert hits(trace, "reuse-oracle", capacity, timed)[:before_last] == hits(trace, "lru", capacity,
                                                                               timed)[:before_last]


def reused_keys(trace) -> int:
    """Keys referenced by a prompt after an earlier reference (prompt or output): the ones worth keeping."""
    seen: set[int] = set()
    reused: set[int] = set()
    for i in range(len(trace)):
        keys = trace.prompt_blocks(i)[0].tolist()
        reused.update(k for k in keys if k in seen)
        seen.update(keys)
        seen.update(trace.output_blocks(i)[0].tolist())
    return len(reused)


@SETTINGS
@given(trace=prefix_traces(), extra=st.integers(0, 3))
def test_reuse_oracle_is_belady_when_the_cache_holds_every_reused_block(trace, extra):
    """Instant mode, capacity >= R + L (R: keys ever reused, L: the longest request's prompt plus outputs): at an
    eviction the request pins fewer than L blocks, so more than R are unpinned, one of them is dead, and so is
    every block under it: there is a dead evictable leaf. reuse-oracle and Belady then only ever evict dead
    blocks and both hit every reference of a key seen before (LRU need not: it may evict a live block released
    before a dead one)."""
    longest = max(len(trace.prompt_blocks(i)[0]) + len(trace.output_blocks(i)[0]) for i in range(len(trace)))
    capacity = max(1, reused_keys(trace) + longest + extra)
    got = hits(trace, "reuse-oracle", capacity)
    assert got == hits(trace, "belady", capacity)
    assert sum(got) == sum(hits(trace, "lru", 10 ** 6))  # a cache that never evicts


# The first case hypothesis found of session-oracle below LRU (see test_oracle_order_instant).
SESSION_BELOW_LRU = build_trace([[]] * 7 + [[1]] + [[]] * 7, [[], [], [], [0], [0], [1], [2, 0, 0]] + [[]] * 8)


def test_session_oracle_can_lose_to_lru():
    """Every request of a build_trace is its own session, so every block is 'last used by a final turn' until
    another session hits it: before that, session-oracle cannot tell a block another session will reuse from a
    dead one, and here it evicts the one LRU keeps."""
    assert sum(hits(SESSION_BELOW_LRU, "session-oracle", 4)) < sum(hits(SESSION_BELOW_LRU, "lru", 4))


@settings(max_examples=60, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 30), cache_outputs=st.booleans())
@example(trace=SESSION_BELOW_LRU, capacity=4, cache_outputs=True)
def test_oracle_order_instant(trace, capacity, cache_outputs):
    """lru <= reuse-oracle <= belady (total prompt hits) in instant mode.

    Where it must hold: Belady is optimal there (test_policies.py checks it against an exhaustive search), which
    gives reuse-oracle <= belady; and evicting dead blocks first never costs a hit and leaves LRU's order among the
    live ones, so reuse-oracle holds at least the live blocks LRU holds (no counterexample in ~3,000 searched
    cases). Where it need not: in timed mode, hits change prefill and decode times and so which blocks in-flight
    requests pin, and Belady's optimality argument (the same forced bypasses for every policy) no longer applies;
    session-oracle is in no order with LRU (test_session_oracle_can_lose_to_lru) nor with reuse-oracle (on
    mooncake_arxiv at 5 % it beats it: 31.85 vs 31.54 %), as neither's knowledge contains the other's.
    """
    got = {p: sum(hits(trace, p, capacity, cache_outputs=cache_outputs)) for p in ("lru", "reuse-oracle", "belady")}
    assert got["lru"] <= got["reuse-oracle"] <= got["belady"], got


EMBEDDED = ("wildchat", "mooncake_arxiv", "mooncake_synthetic", "taubench", "bailian")


@pytest.fixture(scope="module")
def embedded_traces():
    from sae_env.sources import open_trace

    class Lazy(dict):
        def __missing__(self, name):
            self[name] = open_trace(name, None, {}, None)[0]
            return self[name]

    return Lazy()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "taubench" else n
                                  for n in EMBEDDED])  # taubench: ~9 s of the 10-minute suite's budget
def test_reuse_oracle_beats_lru_on_every_embedded_trace(name, embedded_traces):
    """reuse-oracle >= LRU (token hit rate) at 2, 5, 10 and 20 % of the distinct blocks, on every embedded real
    trace, and strictly above at some size."""
    trace = embedded_traces[name]
    gains = []
    for fraction in (0.02, 0.05, 0.1, 0.2):
        capacity = resolve_capacity(fraction, trace.distinct_blocks())
        rate = {}
        for p in ("lru", "reuse-oracle"):
            w = replay(trace, make_policy(p), capacity, window_requests=len(trace)).windows[0]
            rate[p] = w.hit_tokens / w.prompt_tokens
        assert rate["reuse-oracle"] >= rate["lru"], (fraction, rate)
        gains.append(rate["reuse-oracle"] - rate["lru"])
    assert max(gains) > 0
