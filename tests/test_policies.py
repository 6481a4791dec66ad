"""Tests of the eviction policies through the cache and the replay.

* Differential, hit for hit: lru / lfu / fifo / belady against tests/reference_cache.py (victims chosen by brute
  force as the argmin of an explicit sort key over every evictable block) on random prefix-sharing traces, in
  instant mode; s3fifo against a classic S3-FIFO written from its docstring, on flat traces (one block a request).
* libCacheSim (an independent C simulator): lru / lfu / fifo / belady hit for hit with its LRU / LFU / FIFO /
  Belady on flat Zipf traces.
* Properties for every policy in both modes: invariants after every request, ``evict() is None`` only when nothing
  is evictable, bypasses exactly where capacity forces them (instant mode), Belady's MIN >= every online policy
  (instant mode) and equal to an exhaustive search's optimum on tiny traces, infinite capacity = the trace's reuse
  ratio.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import build_trace, flat_trace, prefix_traces, zipf_ids
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from reference_cache import optimal_hits_instant, reference_replay_instant, s3fifo_reference

from sae_env.cache import PrefixCache
from sae_env.policies import make_policy, policy_class, policy_names
from sae_env.policies.base import EvictionPolicy
from sae_env.replay import Replay, replay
from sae_env.serving import make_server

SERVER = "qwen2.5-1.5b@a40"
DIFF = ("lru", "lfu", "fifo", "belady")
ONLINE = [p for p in policy_names() if not policy_class(p).oracle]
SETTINGS = settings(max_examples=40, deadline=None, report_multiple_bugs=False)


def engine(trace, name: str, capacity: int, server=None, **kw) -> Replay:
    """The engine with one window per request (per-request statistics) and invariants checked after each."""
    return replay(trace, make_policy(name), capacity, server=server, window_requests=1, check=True, **kw)


def assert_matches(r: Replay, ref) -> None:
    assert [w.hit_blocks for w in r.windows] == ref.hits
    assert [w.evictions for w in r.windows] == [c.evictions for c in ref.counters]
    assert [w.bypasses for w in r.windows] == [c.bypasses for c in ref.counters]
    assert [w.inserted for w in r.windows] == [c.inserted for c in ref.counters]
    assert ([w.miss_after_eviction_by_type for w in r.windows]
            == [c.miss_after_eviction for c in ref.counters])
    assert set(r.to_python().blocks) == ref.cached


def guard_evict(policy: EvictionPolicy) -> EvictionPolicy:
    """Make ``policy.evict`` fail loudly if it gives up while the cache still holds an evictable block."""
    inner = policy.evict

    def evict(now: float):
        victim = inner(now)
        if victim is None and policy.cache.evictable():
            raise AssertionError(f"{policy.name}: evict() returned None with {len(policy.cache.evictable())} "
                                 f"evictable blocks among {len(policy.cache)}")
        return victim

    policy.evict = evict
    return policy


def total_hits(trace, name: str, capacity: int, server=None, **kw) -> int:
    r = replay(trace, make_policy(name), capacity, server=None if server is None else make_server(server),
               window_requests=max(1, len(trace)), **kw)
    return sum(w.hit_blocks for w in r.windows)


# ----------------------------------------------------------------------------------------------------------------
# Differential against the brute-force reference


@pytest.mark.parametrize("name", DIFF)
@SETTINGS
@given(trace=prefix_traces(), capacity=st.integers(1, 30))
def test_instant_matches_reference(name, trace, capacity):
    assert_matches(engine(trace, name, capacity), reference_replay_instant(trace, name, capacity))


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo"])
@settings(max_examples=30, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 30), ghosts=st.sampled_from([None, 0, 2]))
def test_compiled_engine_matches_reference(name, trace, capacity, ghosts):
    """The compiled engine (taken by default for these policies in instant mode) against the reference too."""
    pytest.importorskip("numba")
    r = replay(trace, make_policy(name), capacity, window_requests=1, ghost_capacity=ghosts, engine="fast")
    assert_matches(r, reference_replay_instant(trace, name, capacity, ghost_capacity=ghosts))


@pytest.mark.parametrize("name", DIFF)
@settings(max_examples=30, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 30), ghosts=st.integers(0, 5))
def test_instant_matches_reference_small_ghost_record(name, trace, capacity, ghosts):
    r = engine(trace, name, capacity, ghost_capacity=ghosts)
    assert_matches(r, reference_replay_instant(trace, name, capacity, ghost_capacity=ghosts))
    assert len(r.to_python().ghosts) <= ghosts


@pytest.mark.parametrize("name", DIFF)
@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 30))
def test_instant_matches_reference_without_output_caching(name, trace, capacity):
    """``cache_outputs=False``: outputs never touch the cache. Belady never counts an output as a use (cached or
    not: see test_belady_counts_only_prompt_references_as_uses); test_belady_ignores_uncached_outputs is the
    minimal case of the bug this once caught."""
    r = engine(trace, name, capacity, cache_outputs=False)
    assert_matches(r, reference_replay_instant(trace, name, capacity, cache_outputs=False))


def test_belady_ignores_uncached_outputs():
    """Minimal case: with outputs not cached, request 2's output b never reuses b, yet belady keeps b (next use
    2, stale) and evicts c (next use 4); every online policy evicts b and hits c at request 4."""
    trace = build_trace([[0, 1], [0, 2], [0], [3], [0, 2]], [[], [], [1], [], []])
    hits = {p: [w.hit_blocks for w in engine(trace, p, 3, cache_outputs=False).windows] for p in DIFF}
    assert hits["lru"] == hits["lfu"] == hits["fifo"] == [0, 1, 1, 0, 2]
    assert reference_replay_instant(trace, "belady", 3, cache_outputs=False).hits == [0, 1, 1, 0, 2]
    assert hits["belady"] == [0, 1, 1, 0, 2]


def test_reference_and_engine_agree_on_a_hand_example():
    """LRU by hand, capacity 3. Request 0 caches a-b-c and releases c, b, a (deepest first); request 1 (d) evicts
    c, the first released; request 2 (a-b-c) hits a-b, which it pins, so d is the only evictable leaf left."""
    trace = build_trace([[0, 1, 2], [3], [0, 1, 2]])
    r = engine(trace, "lru", 3)
    assert [w.hit_blocks for w in r.windows] == [0, 0, 2]
    assert [w.evictions for w in r.windows] == [0, 1, 1]
    assert reference_replay_instant(trace, "lru", 3).hits == [0, 0, 2]
    assert set(r.to_python().blocks) == set(trace.prompt_blocks(2)[0].tolist())


# ----------------------------------------------------------------------------------------------------------------
# S3-FIFO against a classic S3-FIFO (no prefix sharing: one block per request, so pins never matter)


@pytest.mark.parametrize("compiled", [False, True])
@settings(max_examples=80, deadline=None, report_multiple_bugs=False)
@given(ids=st.lists(st.integers(0, 15), min_size=1, max_size=80), capacity=st.integers(1, 12))
def test_s3fifo_matches_classic_s3fifo(compiled, ids, capacity):
    """On the Python engine (invariants checked after each request) and on the compiled one, which the replay
    takes by default for s3fifo in instant mode."""
    if compiled:
        pytest.importorskip("numba")
        r = replay(flat_trace(ids), make_policy("s3fifo"), capacity, window_requests=1, engine="fast")
    else:
        r = engine(flat_trace(ids), "s3fifo", capacity)
    hits, evictions, queue = s3fifo_reference(ids, capacity)
    assert [w.hit_blocks for w in r.windows] == hits
    assert sum(w.evictions for w in r.windows) == evictions
    assert {k: b.queue for k, b in r.to_python().blocks.items()} == queue


def test_s3fifo_evicts_when_every_block_is_evictable():
    """Capacity 1: a, a (freq 1), b. S's a moves to M, M's a gets its second chance, then it must be evicted:
    nothing is pinned, so b has to be inserted. The scan budget (len(S) + 2 len(M) + 1 = 2 steps) runs out first
    and b is bypassed."""
    r = engine(flat_trace([1, 1, 2, 2]), "s3fifo", 1)
    assert sum(w.bypasses for w in r.windows) == 0
    assert [w.hit_blocks for w in r.windows] == [0, 1, 0, 1]


def test_s3fifo_queues_on_a_hand_example():
    """Capacity 10 (S target 1): a one-hit wonder goes to the ghost; re-requested, it is inserted into M."""
    ids = list(range(1, 11)) + [1, 2, 3] + [11, 12] + [4]  # 1..3 hit once: promoted to M when they reach S's end
    r = engine(flat_trace(ids), "s3fifo", 10)
    hits, _, queue = s3fifo_reference(ids, 10)
    assert [w.hit_blocks for w in r.windows] == hits == [0] * 10 + [1, 1, 1, 0, 0, 0]
    assert {k: b.queue for k, b in r.to_python().blocks.items()} == queue
    assert queue[4] == 1  # 4 was evicted from S (to the ghost), so its return goes to M


# ----------------------------------------------------------------------------------------------------------------
# libCacheSim


INT64_MAX = np.iinfo(np.int64).max


def write_oracle_general(path, ids: np.ndarray) -> None:
    """libCacheSim's oracleGeneral records: uint32 time, uint64 id, uint32 size, int64 next access (INT64_MAX)."""
    ids = np.asarray(ids, dtype=np.uint64)
    n = ids.size
    rec = np.zeros(n, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")]))
    rec["t"] = np.arange(1, n + 1)
    rec["id"] = ids
    rec["size"] = 1
    nxt = np.full(n, INT64_MAX, dtype=np.int64)
    order = np.argsort(ids, kind="stable")  # each id's occurrences in time order
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    rec["next"] = nxt
    rec.tofile(path)


def libcachesim_hits(lcs, cls_name: str, path, capacity: int) -> tuple[list[int], int]:
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, cls_name)(capacity, hashpower=12)  # 2**12 buckets: the default 2**24 costs ~130 MB
    hits = [int(cache.get(req)) for req in reader]
    return hits, cache.get_n_obj()


def engine_hits_per_request(trace, name: str, capacity: int) -> list[int]:
    """Per-request hits through the cache API (cheaper than one replay window per request)."""
    policy = make_policy(name)
    cache = PrefixCache(capacity, policy)
    policy.bind(trace)
    out = []
    for i in range(len(trace)):
        keys, types = (a.tolist() for a in trace.prompt_blocks(i))
        now = float(trace.t[i])
        policy.on_request(trace, i, now)
        path, h = cache.admit(keys, types, now)
        policy.on_complete(trace, i, now)
        cache.complete(path, len(keys), [], [], now)
        out.append(h)
    return out


@pytest.fixture(scope="module")
def zipf_trace_file(tmp_path_factory):
    ids = zipf_ids(2000, 300, 0.9, seed=7)
    path = tmp_path_factory.mktemp("lcs") / "zipf.oracleGeneral.bin"
    write_oracle_general(path, ids)
    return ids, path


@pytest.mark.parametrize("capacity", [1, 2, 7, 40, 150])
@pytest.mark.parametrize("name,cls_name", [("lru", "LRU"), ("lfu", "LFU"), ("fifo", "FIFO"), ("belady", "Belady")])
def test_matches_libcachesim_hit_for_hit(name, cls_name, capacity, zipf_trace_file):
    lcs = pytest.importorskip("libcachesim")
    ids, path = zipf_trace_file
    want, n_obj = libcachesim_hits(lcs, cls_name, path, capacity)
    assert n_obj == min(capacity, len(set(ids.tolist())))  # obj_size 1: the cache holds `capacity` objects
    trace = flat_trace(ids)
    assert engine_hits_per_request(trace, name, capacity) == want
    # the replay's instant fast path gives the same total
    assert total_hits(trace, name, capacity) == sum(want)


def test_lfu_tie_break_is_libcachesims(tmp_path):
    """Capacity 2, all counts 1 until request 5: among equal counts both evict the least recently used (an MRU
    tie-break would keep 1 at request 2 and hit it at request 3)."""
    lcs = pytest.importorskip("libcachesim")
    ids = np.array([1, 2, 3, 1, 2, 2, 4, 1, 3])
    want = [0, 0, 0, 0, 0, 1, 0, 0, 0]
    write_oracle_general(tmp_path / "t.bin", ids)
    assert libcachesim_hits(lcs, "LFU", tmp_path / "t.bin", 2)[0] == want
    assert engine_hits_per_request(flat_trace(ids), "lfu", 2) == want


def test_libcachesim_belady_reads_next_access_times(tmp_path):
    """Guard against libCacheSim's silent fallback: without next-access data its Belady is LRU-like."""
    lcs = pytest.importorskip("libcachesim")
    ids = np.array([1, 2, 3, 1, 4, 1, 2, 5, 3, 3, 6, 2])
    write_oracle_general(tmp_path / "t.bin", ids)
    reader = lcs.TraceReader(str(tmp_path / "t.bin"), lcs.TraceType.ORACLE_GENERAL_TRACE)
    nexts = [req.next_access_vtime for req in reader]
    assert nexts[:3] == [3, 6, 8] and nexts[4] == INT64_MAX
    hits, _ = libcachesim_hits(lcs, "Belady", tmp_path / "t.bin", 3)
    assert hits == [0, 0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1]  # MIN by hand: 5 hits (LRU gets 3)
    assert engine_hits_per_request(flat_trace(ids), "belady", 3) == hits


# ----------------------------------------------------------------------------------------------------------------
# Properties for every policy


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 30), cache_outputs=st.booleans())
def test_instant_invariants_and_forced_bypasses(name, trace, capacity, cache_outputs):
    """Instant mode: only the request's own blocks are pinned, so a bypass happens exactly when its own sequence
    (prompt, then outputs if the whole prompt fits) is longer than the cache, whatever the policy."""
    policy = guard_evict(make_policy(name))
    r = replay(trace, policy, capacity, window_requests=1, check=True, cache_outputs=cache_outputs)
    for i, w in enumerate(r.windows):
        n_p = len(trace.prompt_blocks(i)[0])
        n_o = len(trace.output_blocks(i)[0]) if cache_outputs else 0
        forced = n_p - capacity if n_p > capacity else max(0, n_p + n_o - capacity)
        assert w.bypasses == forced, f"request {i}"
        assert w.occupancy <= capacity
        assert 0 <= w.hit_blocks <= w.prompt_blocks
    assert len(r.to_python()) == sum(w.inserted - w.evictions for w in r.windows)


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=30, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(timed=True), capacity=st.integers(1, 30))
def test_timed_invariants(name, trace, capacity):
    policy = guard_evict(make_policy(name))
    r = replay(trace, policy, capacity, server=make_server(SERVER), window_requests=1, check=True)
    assert all(w.occupancy <= capacity for w in r.windows)
    assert len(r.to_python()) == sum(w.inserted - w.evictions for w in r.windows)
    assert all(b.pins == 0 for b in r.to_python().blocks.values())  # every request completed and released its blocks
    assert sum(len(w.ttft_ms) for w in r.windows) == len(trace)


# Found by hypothesis against the definition of a use that counted outputs: LPC 1 hit, Belady 0.
LPC_BEATS_OUTPUT_USES = build_trace([[]] * 11 + [[1]] + [[]] * 8,
                                    [[], [], [], [], [1], [], [], [], [2], [0], [2]] + [[]] * 9)


@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 30), cache_outputs=st.booleans())
@example(trace=LPC_BEATS_OUTPUT_USES, capacity=2, cache_outputs=True)
def test_belady_beats_every_online_policy_instant(trace, capacity, cache_outputs):
    """MIN is optimal for prompt hits in instant mode, outputs cached or not: each request references its blocks
    in prefix order, a parent's next use is never after its child's, only the request's own blocks are pinned, and
    bypasses are forced identically for every policy. A *use* is a prompt reference only: a later request's output
    that contains a cached key shares it, which is worth no hit, and inserts it if it is missing, whatever the
    cache holds. Counting such outputs as uses (Belady's old definition, MIN on the whole reference stream) keeps a
    block for a reference worth nothing; the @example is the case hypothesis found where LPC then beat it, and
    test_belady_is_the_optimum_on_tiny_traces checks the definition against an exhaustive search."""
    best = total_hits(trace, "belady", capacity, cache_outputs=cache_outputs)
    for p in ONLINE:
        assert total_hits(trace, p, capacity, cache_outputs=cache_outputs) <= best, p


def test_belady_counts_only_prompt_references_as_uses():
    """Capacity 2; outputs 1, 2, 0, 2, then a prompt 1 (each an empty prompt, so each output key is a root).
    At request 2 one of 1 and 2 must go: 2's next reference is request 3's *output*, 1's is request 4's prompt.
    Belady evicts 2 (no prompt use ever), re-inserts it at request 3 in place of the dead 0, and hits 1 at
    request 4. Counting the output as a use evicts 1 instead and loses that hit (LRU does the same)."""
    trace = build_trace([[], [], [], [], [1]], [[1], [2], [0], [2], []])
    r = engine(trace, "belady", 2)
    assert [w.hit_blocks for w in r.windows] == [0, 0, 0, 0, 1]
    assert [w.inserted for w in r.windows] == [1, 1, 1, 1, 0]  # 2 inserted twice: the price of the hit
    assert [w.hit_blocks for w in engine(trace, "lru", 2).windows] == [0, 0, 0, 0, 0]
    assert optimal_hits_instant(trace, 2) == 1


@settings(max_examples=60, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(max_requests=9, max_prompt=3, max_output=2), capacity=st.integers(1, 5),
       cache_outputs=st.booleans())
@example(trace=LPC_BEATS_OUTPUT_USES, capacity=2, cache_outputs=True)
def test_belady_is_the_optimum_on_tiny_traces(trace, capacity, cache_outputs):
    """Belady's prompt hits equal the best any sequence of victims gives (an exhaustive search on the reference
    cache, tests/reference_cache.py), in instant mode. Searches too large to finish are skipped."""
    best = optimal_hits_instant(trace, capacity, cache_outputs=cache_outputs)
    assume(best is not None)
    assert total_hits(trace, "belady", capacity, cache_outputs=cache_outputs) == best


def test_belady_beats_online_policies_on_a_zipf_prefix_trace():
    rng = np.random.default_rng(3)
    prompts = []
    for _ in range(300):
        sys_prompt = [int(rng.zipf(1.5)) % 8]
        prompts.append(sys_prompt + [int(x) for x in rng.integers(0, 3, size=rng.integers(0, 6))])
    trace = build_trace(prompts, [[int(rng.integers(0, 3))] for _ in prompts])
    for capacity in (5, 20, 60):
        best = total_hits(trace, "belady", capacity)
        assert best > 0
        for p in ONLINE:
            assert total_hits(trace, p, capacity) <= best, (p, capacity)


def infinite_capacity_hits(trace) -> int:
    """Prompt references whose key occurred in an earlier request (prompt or output)."""
    seen: set[int] = set()
    hits = 0
    for i in range(len(trace)):
        keys = trace.prompt_blocks(i)[0].tolist()
        hits += sum(k in seen for k in keys)
        seen.update(keys)
        seen.update(trace.output_blocks(i)[0].tolist())
    return hits


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=20, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), extra=st.integers(0, 5))
def test_infinite_capacity_hits_every_earlier_key(name, trace, extra):
    capacity = max(1, trace.distinct_blocks()) + extra
    r = replay(trace, make_policy(name), capacity, window_requests=max(1, len(trace)), check=True)
    assert sum(w.hit_blocks for w in r.windows) == infinite_capacity_hits(trace)
    assert sum(w.evictions + w.bypasses for w in r.windows) == 0


@settings(max_examples=12, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces())
def test_infinite_capacity_hit_rate_is_the_reuse_ratio(trace):
    characterize = pytest.importorskip("sae_env.characterize").characterize
    if trace.n_blocks == 0:
        return
    r = replay(trace, make_policy("lru"), max(1, trace.distinct_blocks()), window_requests=len(trace))
    hit_rate = sum(w.hit_blocks for w in r.windows) / trace.n_blocks
    assert hit_rate == characterize(trace)["reuse_ratio"]


@pytest.mark.parametrize("name", policy_names())
def test_timed_outputs_are_cached_only_after_decode(name):
    """Request 1 extends request 0's prompt and output c, 1 ms later: c is not cached yet (request 0 is still
    decoding), so request 1 hits a-b only and inserts c itself; request 0's completion then shares c. Prompts are
    cached at admission, so request 2 (much later) hits all three. Instant mode would give 3 + 3."""
    trace = build_trace([[0, 1], [0, 1, 2], [0, 1, 2]], [[2], [], []], times=[0.0, 0.001, 5.0],
                        out_extra=[30, 1, 1])
    cap = trace.distinct_blocks()
    assert total_hits(trace, name, cap) == infinite_capacity_hits(trace) == 6
    r = replay(trace, make_policy(name), cap, server=make_server(SERVER), window_requests=1, check=True)
    assert [w.hit_blocks for w in r.windows] == [0, 2, 3]
    assert sum(w.inserted for w in r.windows) == 3


# ----------------------------------------------------------------------------------------------------------------
# Bad policies and registry


class _PinnedVictim(EvictionPolicy):
    name = "bad-pinned"

    def evict(self, now):
        return next(b for b in self.cache.blocks.values() if b.pins)


class _InternalVictim(EvictionPolicy):
    name = "bad-internal"

    def evict(self, now):
        return next(b for b in self.cache.blocks.values() if b.n_children)


class _ForeignVictim(EvictionPolicy):
    name = "bad-foreign"

    def evict(self, now):
        from sae_env.cache import Block

        return Block(12345, None, 0, 2, now)


def test_a_policy_choosing_a_pinned_block_is_refused():
    cache = PrefixCache(2, _PinnedVictim())
    cache.admit([1, 2], [2, 2], 0.0)  # both pinned, not completed
    with pytest.raises(RuntimeError, match="not an evictable"):
        cache.admit([3], [2], 0.0)


def test_a_policy_choosing_an_internal_block_is_refused():
    cache = PrefixCache(2, _InternalVictim())
    path, _ = cache.admit([1, 2], [2, 2], 0.0)
    cache.complete(path, 2, [], [], 0.0)
    with pytest.raises(RuntimeError, match="not an evictable"):
        cache.admit([3], [2], 0.0)


def test_a_policy_choosing_an_uncached_block_is_refused():
    cache = PrefixCache(1, _ForeignVictim())
    path, _ = cache.admit([1], [2], 0.0)
    cache.complete(path, 1, [], [], 0.0)
    with pytest.raises(RuntimeError, match="not an evictable"):
        cache.admit([3], [2], 0.0)


def test_a_policy_named_by_module_and_class():
    """make_policy("module:Class") builds an unregistered policy class (its options passed on); a module or class
    that is not there, or a class that is not a policy, is a ValueError naming it, before anything of it is called."""
    from sae_env.policies.lru import LRUPolicy
    from sae_env.policies.saecache import SAECachePolicy

    assert type(make_policy("sae_env.policies.lru:LRUPolicy")) is LRUPolicy
    assert make_policy("sae_env.policies.saecache:SAECachePolicy", censoring=False).arrivals.model.censoring is False
    assert isinstance(make_policy("saecache"), SAECachePolicy)
    for name, said in (("no_such_module:X", "cannot import"), ("sae_env.policies.lru:Nope", "cannot import"),
                       ("sae_env.trace:Trace", "not a policy class"), ("os:system", "not a policy class")):
        with pytest.raises(ValueError, match=said) as e:
            make_policy(name)
        assert name in str(e.value)


def test_registry():
    assert set(policy_names()) >= {"lru", "lfu", "fifo", "s3fifo", "belady"}
    with pytest.raises(ValueError, match="unknown policy 'nope'; valid policies: lru, "):
        make_policy("nope")
    with pytest.raises(ValueError, match="bad options"):
        make_policy("lru", foo=1)
    with pytest.raises(ValueError):
        make_policy("s3fifo", small_ratio=1.5)
    policy = make_policy("lru")
    PrefixCache(4, policy)
    with pytest.raises(RuntimeError, match="already attached"):
        PrefixCache(4, policy)
