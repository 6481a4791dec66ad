"""Unit tests of sae_env.cache: capacity parsing, the PrefixCache loop (hits, pins, bypasses, outputs, ghosts),
its invariant checker, the instant fast path ``serve`` against ``admit`` + ``complete``, and the ghost record
against an OrderedDict."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from conftest import prefix_traces
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.cache import GhostRecord, PrefixCache, resolve_capacity
from sae_env.policies import make_policy, policy_names
from sae_env.serving import MODELS
from sae_env.trace import TokenType

USER, ASSISTANT, SYSTEM = int(TokenType.USER), int(TokenType.ASSISTANT), int(TokenType.SYSTEM)


def run(cache: PrefixCache, keys, out=(), now: float = 0.0, types=None) -> int:
    """One instant request through admit + complete; returns its hit count."""
    types = [USER] * len(keys) if types is None else types
    path, h = cache.admit(list(keys), types, now)
    cache.complete(path, len(keys), list(out), [ASSISTANT] * len(out), now)
    cache.check_invariants()
    return h


# ----------------------------------------------------------------------------------------------------------------
# resolve_capacity

KV = MODELS["qwen2.5-1.5b"].kv_bytes_per_token  # 28 KiB per token


def test_capacity_in_blocks():
    assert resolve_capacity(4096) == 4096
    assert resolve_capacity(np.int64(7)) == 7
    assert resolve_capacity("4096") == 4096
    assert resolve_capacity(" 12 ") == 12
    assert resolve_capacity(3.0) == 3  # a whole float above 1 is a number of blocks
    assert resolve_capacity("1e3") == 1000


def test_capacity_as_fraction_or_percentage():
    assert resolve_capacity(0.15, distinct_blocks=1000) == 150
    assert resolve_capacity("15%", distinct_blocks=1000) == 150
    assert resolve_capacity("0.5", distinct_blocks=10) == 5
    assert resolve_capacity(np.float64(0.25), distinct_blocks=8) == 2
    assert resolve_capacity(0.06, distinct_blocks=10) == 1  # 0.6 blocks round to one
    with pytest.raises(ValueError, match="less than one"):  # not silently one block (issue 15)
        resolve_capacity(0.0000001, distinct_blocks=1405)
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        resolve_capacity(str(10**400))
    assert resolve_capacity("12.5%", distinct_blocks=80) == 10


def test_capacity_of_the_whole_trace():
    """The docstring accepts a fraction in (0, 1]: 1.0 and "100%" mean every distinct block, not one block."""
    assert resolve_capacity("100%", distinct_blocks=1000) == 1000
    assert resolve_capacity(1.0, distinct_blocks=1000) == 1000


def test_capacity_in_bytes():
    # 2 GiB of KV at 28 KiB per token and 16 tokens per block: floor(2**31 / 458,752) = 4681 blocks
    assert resolve_capacity("2GiB", kv_bytes_per_token=KV, block_size=16) == 2**31 // (KV * 16) == 4681
    assert resolve_capacity("2 GiB", kv_bytes_per_token=KV, block_size=16) == 4681
    assert resolve_capacity("500MB", kv_bytes_per_token=KV, block_size=16) == int(500e6 // (KV * 16))
    assert resolve_capacity("1tb", kv_bytes_per_token=1, block_size=1) == 10**12
    assert resolve_capacity("4096b", kv_bytes_per_token=1024, block_size=2) == 2


@pytest.mark.parametrize("bad", [0, -1, -0.5, 0.0, "0", "-3", "0%", "-5%", float("nan"), float("inf"), "1e999",
                                 "abc", "", "GiB", "12 blocks", "nan", "1.5", 2.5, True, False, None, [4], "5x"])
def test_bad_capacities_raise(bad):
    with pytest.raises(ValueError):
        resolve_capacity(bad, distinct_blocks=100, kv_bytes_per_token=KV, block_size=16)


def test_capacity_errors_need_context():
    with pytest.raises(ValueError, match="distinct blocks"):
        resolve_capacity(0.5)
    with pytest.raises(ValueError, match="distinct blocks"):
        resolve_capacity("10%")
    with pytest.raises(ValueError, match="bytes"):
        resolve_capacity("2GiB")
    with pytest.raises(ValueError, match="less than one block"):
        resolve_capacity("1KiB", kv_bytes_per_token=KV, block_size=16)


@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.0, True, "4", None])
def test_prefix_cache_rejects_bad_capacity(bad):
    with pytest.raises(ValueError):
        PrefixCache(bad, make_policy("lru"))


# ----------------------------------------------------------------------------------------------------------------
# The loop


def test_hit_is_the_longest_cached_prefix():
    cache = PrefixCache(10, make_policy("lru"))
    assert run(cache, [1, 2, 3]) == 0
    assert cache.match([1, 2, 9]) == 2 and cache.match([9, 1]) == 0
    assert len(cache) == 3  # match has no side effect
    assert run(cache, [1, 2, 4]) == 2
    assert run(cache, [1, 2, 3]) == 3
    assert cache.blocks[1].hits == 2 and cache.blocks[3].hits == 1 and cache.blocks[4].hits == 0
    assert cache.blocks[3].parent is cache.blocks[2] and cache.blocks[3].depth == 2
    assert cache.inserted == 4 and cache.evictions == 0 and cache.bypasses == 0


def test_lru_evicts_the_deepest_block_of_a_request_first():
    """Blocks are released deepest first, so the request's last block is the least recently released."""
    cache = PrefixCache(3, make_policy("lru"))
    run(cache, [1, 2, 3])
    run(cache, [4])
    assert set(cache.blocks) == {1, 2, 4}
    run(cache, [5])
    assert set(cache.blocks) == {1, 4, 5}
    run(cache, [6])
    assert set(cache.blocks) == {4, 5, 6}  # 1 went last: it was released last of request [1, 2, 3]
    assert cache.evictions == 3 and len(cache.ghosts) == 3


def test_bypass_when_everything_is_pinned():
    cache = PrefixCache(3, make_policy("lru"))
    p1, h1 = cache.admit([1, 2], [USER] * 2, 0.0)  # in flight: pinned
    p2, h2 = cache.admit([3, 4, 5], [USER] * 3, 0.0)  # one slot left, then everything is pinned
    assert (h1, h2) == (0, 0)
    assert set(cache.blocks) == {1, 2, 3}
    assert cache.bypasses == 2 and cache.evictions == 0
    assert [b.key for b in p2] == [3]
    cache.check_invariants()
    # request 2 is not fully cached: its outputs are not inserted
    cache.complete(p2, 3, [6], [ASSISTANT], 0.0)
    assert 6 not in cache
    cache.complete(p1, 2, [7], [ASSISTANT], 0.0)  # request 1 has its whole prompt: its output evicts block 3
    assert set(cache.blocks) == {1, 2, 7} and cache.evictions == 1
    assert all(b.pins == 0 for b in cache.blocks.values())
    cache.check_invariants()


def test_the_same_request_twice_in_flight_pins_twice():
    cache = PrefixCache(2, make_policy("fifo"))
    p1, _ = cache.admit([1, 2], [USER] * 2, 0.0)
    p2, h = cache.admit([1, 2], [USER] * 2, 0.0)
    assert h == 2 and cache.blocks[2].pins == 2
    assert cache.evictable() == []
    p3, _ = cache.admit([3], [USER], 0.0)
    assert p3 == [] and cache.bypasses == 1
    cache.complete(p1, 2, [], [], 0.0)
    assert cache.evictable() == []
    cache.complete(p2, 2, [], [], 0.0)
    assert [b.key for b in cache.evictable()] == [2]
    cache.check_invariants()


def test_outputs_are_cached_only_after_a_whole_prompt():
    cache = PrefixCache(10, make_policy("lru"))
    run(cache, [1, 2], out=[3, 4])
    assert set(cache.blocks) == {1, 2, 3, 4}
    assert cache.blocks[3].parent is cache.blocks[2] and cache.blocks[4].depth == 3
    assert cache.blocks[3].type == ASSISTANT
    assert run(cache, [1, 2, 3, 4, 5]) == 4  # the next turn hits the previous output
    # a prompt longer than the cache is cut: its outputs are not cached
    small = PrefixCache(2, make_policy("lru"))
    path, _ = small.admit([1, 2, 3], [USER] * 3, 0.0)
    small.complete(path, 3, [4], [ASSISTANT], 0.0)
    assert set(small.blocks) == {1, 2} and small.bypasses == 1


def test_outputs_fill_the_cache_then_bypass():
    cache = PrefixCache(3, make_policy("lru"))
    run(cache, [1, 2], out=[3, 4, 5])
    assert set(cache.blocks) == {1, 2, 3} and cache.bypasses == 2


def test_cache_outputs_false_never_caches_outputs():
    cache = PrefixCache(10, make_policy("lru"), cache_outputs=False)
    run(cache, [1, 2], out=[3, 4])
    assert set(cache.blocks) == {1, 2} and cache.inserted == 2


def test_an_output_already_cached_is_shared_and_counted_as_a_hit():
    cache = PrefixCache(10, make_policy("lfu"))
    run(cache, [1], out=[2])
    run(cache, [1], out=[2])  # same prompt, same output: block 2 is shared, not inserted again
    assert cache.inserted == 2 and len(cache) == 2
    assert cache.blocks[1].hits == 1 and cache.blocks[2].hits == 1
    assert all(b.pins == 0 for b in cache.blocks.values())


def test_ghosts_are_bounded_and_misses_after_eviction_are_counted_per_type():
    cache = PrefixCache(2, make_policy("fifo"), ghost_capacity=2)
    run(cache, [10], types=[SYSTEM])
    run(cache, [20])
    run(cache, [30])  # evicts 10 (SYSTEM)
    run(cache, [40])  # evicts 20
    run(cache, [50])  # evicts 30; the ghost record (2 keys) forgets 10
    assert list(cache.ghosts) == [20, 30]
    cache.reset_counters()
    # Inserting 30 first evicts 40 (ghosts: 30, 40), then finds 30 among the ghosts: a miss after eviction.
    run(cache, [30])
    assert cache.miss_after_eviction[USER] == 1 and sum(cache.miss_after_eviction) == 1
    assert cache.miss_after_eviction_queue == {0: 1}
    run(cache, [10], types=[SYSTEM])  # evicted long ago and forgotten: not counted
    assert cache.miss_after_eviction[SYSTEM] == 0
    assert list(cache.ghosts) == [40, 50]
    cache.check_invariants()


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 5), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 15)),
                                                max_size=120))
def test_ghost_record_behaves_as_a_bounded_ordered_dict(capacity, ops):
    """add = ``od[k] = code`` then drop the oldest beyond the bound; take = ``od.pop(k)`` of a present key. Long
    runs of takes and re-adds exercise the stale entries and the deque's compaction."""
    ghosts, reference = GhostRecord(capacity), OrderedDict()
    for is_add, key, code in ops:
        if is_add:
            ghosts.add(key, code)
            if capacity > 0:
                reference[key] = code
                if len(reference) > capacity:
                    reference.popitem(last=False)
        elif key in reference:
            assert ghosts.take(key) == reference.pop(key)
        assert (key in ghosts) == (key in reference)
        assert list(ghosts.items()) == list(reference.items())
        ghosts.check()
    assert len(ghosts._order) <= 2 * capacity + 17


def test_ghost_record_compacts_the_entries_that_came_back():
    """Ghosts that keep coming back never fill the record, so nothing is dropped: the deque is compacted instead."""
    ghosts, reference = GhostRecord(2), OrderedDict()
    for i in range(200):
        ghosts.add(i % 5, 1)
        reference[i % 5] = 1
        if len(reference) > 2:
            reference.popitem(last=False)
        if i % 50:  # mostly back at once: stale entries pile up
            assert ghosts.take(i % 5) == reference.pop(i % 5) == 1
        assert list(ghosts.items()) == list(reference.items())
        assert len(ghosts._order) <= 2 * 2 + 17
        ghosts.check()


def test_ghost_record_check_catches_a_broken_order():
    ghosts = GhostRecord(3)
    for k in (1, 2, 3):
        ghosts.add(k, 0)
    ghosts._order.rotate(1)
    with pytest.raises(RuntimeError, match="order"):
        ghosts.check()


def test_ghost_type_is_the_evicted_blocks_type():
    cache = PrefixCache(2, make_policy("lru"))
    run(cache, [1], types=[SYSTEM])
    run(cache, [2])
    run(cache, [3])  # evicts 1
    run(cache, [1], types=[USER])  # same key comes back with another type: counted under the evicted type
    assert cache.miss_after_eviction[SYSTEM] == 1 and cache.miss_after_eviction[USER] == 0


def test_a_returning_key_is_looked_up_among_the_ghosts_before_its_insertion_evicts():
    """Capacity 1 (ghost record of 1 key): 1, 2 (evicts 1), 1 again is a miss after eviction. Inserting 1 must
    evict 2, which pushes 1 out of the one-key ghost record: the cache looks 1 up first, so it is still counted."""
    cache = PrefixCache(1, make_policy("lru"))
    run(cache, [1])
    run(cache, [2])
    run(cache, [1])
    assert cache.miss_after_eviction[USER] == 1


def test_ghost_capacity_zero_and_default():
    cache = PrefixCache(1, make_policy("lru"), ghost_capacity=0)
    run(cache, [1])
    run(cache, [2])
    run(cache, [1])
    assert len(cache.ghosts) == 0 and sum(cache.miss_after_eviction) == 0
    assert PrefixCache(5, make_policy("lru")).ghost_capacity == 5


def test_s3fifo_misses_after_eviction_are_counted_per_queue():
    cache = PrefixCache(10, make_policy("s3fifo"))
    for k in range(1, 12):  # 11 one-hit wonders: 1 leaves S for the ghosts
        run(cache, [k])
    run(cache, [1])  # back from S's ghost: counted under queue 0 (S), and inserted into M
    assert cache.miss_after_eviction_queue == {0: 1}
    assert cache.blocks[1].queue == 1


def test_occupancy_by_type_and_queue():
    cache = PrefixCache(4, make_policy("lru"))
    run(cache, [1, 2], out=[3], types=[SYSTEM, USER])
    assert cache.occupancy_by_type[SYSTEM] == 1 and cache.occupancy_by_type[USER] == 1
    assert cache.occupancy_by_type[ASSISTANT] == 1
    assert cache.occupancy_by_queue() == {0: 3}


def test_check_invariants_detects_corruption():
    cache = PrefixCache(4, make_policy("lru"))
    run(cache, [1, 2, 3])
    cache.blocks[2].n_children = 0
    with pytest.raises(RuntimeError, match="children"):
        cache.check_invariants()
    cache.blocks[2].n_children = 1
    cache.blocks[3].depth = 5
    with pytest.raises(RuntimeError, match="depth"):
        cache.check_invariants()
    cache.blocks[3].depth = 2
    cache.occupancy_by_type[USER] += 1
    with pytest.raises(RuntimeError, match="occupancy"):
        cache.check_invariants()
    cache.occupancy_by_type[USER] -= 1
    del cache.blocks[2]
    with pytest.raises(RuntimeError):
        cache.check_invariants()


def test_policy_structures_are_checked_too():
    cache = PrefixCache(4, make_policy("lru"))
    run(cache, [1, 2])
    cache.blocks[1].pins = 1  # the LRU free queue still holds block 1
    with pytest.raises(RuntimeError):
        cache.check_invariants()


# ----------------------------------------------------------------------------------------------------------------
# serve (the instant fast path) == admit + complete


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=40, deadline=None, report_multiple_bugs=False)
@given(trace=prefix_traces(), capacity=st.integers(1, 20))
def test_serve_equals_admit_then_complete(name, trace, capacity):
    pa, pb = make_policy(name), make_policy(name)
    a, b = PrefixCache(capacity, pa), PrefixCache(capacity, pb)
    pa.bind(trace)
    pb.bind(trace)
    for i in range(len(trace)):
        keys, types = (x.tolist() for x in trace.prompt_blocks(i))
        okeys, otypes = (x.tolist() for x in trace.output_blocks(i))
        now = float(trace.t[i])
        pa.on_request(trace, i, now)
        pb.on_request(trace, i, now)
        pa.on_complete(trace, i, now)  # belady: the context is per request; setting it early changes nothing
        pb.on_complete(trace, i, now)
        h1 = a.serve(keys, types, okeys, otypes, now)
        path, h2 = b.admit(keys, types, now)
        b.complete(path, len(keys), okeys, otypes, now)
        assert h1 == h2
        a.check_invariants()
        assert list(a.blocks) == list(b.blocks)
        assert (a.evictions, a.bypasses, a.inserted) == (b.evictions, b.bypasses, b.inserted)
        assert [(x.hits, x.queue, x.pins) for x in a.blocks.values()] == [
            (x.hits, x.queue, x.pins) for x in b.blocks.values()]
