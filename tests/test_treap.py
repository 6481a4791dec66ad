"""The compiled treap of SAECache's groups' sets (sae_env.fast_engine.treap): a reference sorted list, and a finger
insertion that must build the tree the root's descent builds, link for link."""

from __future__ import annotations

import bisect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.fast_engine import jit, treap
from sae_env.fast_engine.loop import P5

pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed")

N = 48
LINKS = [treap.LEFT, treap.RIGHT, treap.UP]


def _empty() -> tuple[np.ndarray, np.ndarray]:
    return np.array([-1], dtype=np.int64), np.zeros((N, P5 + 1), dtype=np.int32)


def _key(group: int, where: int, stamp: int) -> int:
    return (group << 33) | ((where - 1) << 32) | stamp


def _in_order(root: np.ndarray, rec: np.ndarray) -> list[int]:
    out, stack, x = [], [], int(root[0])
    while stack or x >= 0:
        while x >= 0:
            stack.append(x)
            x = int(rec[x, treap.LEFT])
        x = stack.pop()
        out.append(x)
        x = int(rec[x, treap.RIGHT])
    return out


# Operations: ("add", group, where) gives a free slot the next stamp (a release: the newest of its set) or, with
# "old", a stamp below every one given so far (a returned block, a moved one); ("drop", i) takes the i-th member out.
_ops = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 2), st.booleans()),
                          st.tuples(st.just("drop"), st.integers(0, N - 1))), max_size=120)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_insert_after_builds_the_tree_insert_builds(ops):
    """Two treaps take the same members; in one, each slot whose predecessor is a member goes in by insert_after
    from it. Their links agree after every step, and their order is the reference's sorted keys."""
    (r1, t1), (r2, t2) = _empty(), _empty()
    members: list[tuple[int, int]] = []  # (key, slot), sorted
    free = list(range(N))
    new, old = 1 << 20, 1 << 20
    for op in ops:
        if op[0] == "add" and free:
            _, group, where, is_old = op
            if is_old:
                old -= 1
                stamp = old
            else:
                new += 1
                stamp = new
            s = free.pop()
            for rec in (t1, t2):
                rec[s, treap.GROUP], rec[s, treap.WHERE], rec[s, treap.STAMP] = group, where, stamp
            k = _key(group, where, stamp)
            i = bisect.bisect(members, (k, -1))
            treap.insert(r1, t1, np.int64(s))
            if i > 0:
                treap.insert_after(r2, t2, np.int64(s), np.int64(members[i - 1][1]))
            else:
                treap.insert(r2, t2, np.int64(s))
            members.insert(i, (k, s))
        elif op[0] == "drop" and members:
            k, s = members.pop(op[1] % len(members))
            treap.delete(r1, t1, np.int64(s))
            treap.delete(r2, t2, np.int64(s))
            free.append(s)
        assert r1[0] == r2[0]
        assert np.array_equal(t1[:, LINKS], t2[:, LINKS])
        assert _in_order(r1, t1) == [s for _, s in members]


def test_after_and_lower_agree_with_the_sorted_keys():
    """after() walks the members in key order; lower() finds the least key at or above any key, below() the
    greatest under it."""
    root, rec = _empty()
    rng = np.random.default_rng(0)
    keys = {}
    for s in rng.permutation(N)[:40].tolist():
        g, w, t = int(rng.integers(0, 3)), int(rng.integers(1, 3)), int(rng.integers(0, 1000)) * N + s
        rec[s, treap.GROUP], rec[s, treap.WHERE], rec[s, treap.STAMP] = g, w, t
        keys[s] = _key(g, w, t)
        treap.insert(root, rec, np.int64(s))
    order = sorted(keys, key=keys.get)
    walk, x = [], int(treap.lower(root, rec, np.int64(0)))
    while x >= 0:
        walk.append(x)
        x = int(treap.after(rec, np.int64(x)))
    assert walk == order
    ks = sorted(keys.values())
    for probe in rng.integers(0, 4 << 33, size=200).tolist():
        i = bisect.bisect_left(ks, probe)
        lo = treap.lower(root, rec, np.int64(probe))
        assert (keys[lo] if lo >= 0 else None) == (ks[i] if i < len(ks) else None)
        b = treap.below(root, rec, np.int64(probe))
        assert (keys[b] if b >= 0 else None) == (ks[i - 1] if i > 0 else None)
