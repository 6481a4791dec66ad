"""An ordered set of cache slots in their rows, compiled: a treap keyed ``(group, set, release stamp)`` whose links
live in three columns of each slot's row, so that a policy can ask, for any group, for the least and the greatest
stamp of each of its sets in O(log n) while blocks join and leave in any order (SAECache's twin:
:mod:`sae_env.fast_engine.saecache`).

A slot's key is read from its row (``GROUP``, ``WHERE`` = 1 or 2 for the two sets, ``STAMP``): it must not change
while the slot is in the set. Priorities are a fixed hash of the slot, so the shape is a function of the members
alone. ``root`` is a one-element int64 array (-1: empty).
"""

from __future__ import annotations

import numpy as np

from sae_env.fast_engine.jit import inline, jit
from sae_env.fast_engine.loop import P0, P1, P2, P3, P4, P5

__all__ = ["GROUP", "LEFT", "RIGHT", "STAMP", "UP", "WHERE", "after", "below", "delete", "insert", "insert_after",
           "key", "lower"]

STAMP, GROUP, WHERE, LEFT, RIGHT, UP = P0, P1, P2, P3, P4, P5


@inline
def key(rec, s):
    """Slot ``s``'s key: group, then set, then stamp."""
    return (np.int64(rec[s, GROUP]) << 33) | (np.int64(rec[s, WHERE] - 1) << 32) | np.int64(rec[s, STAMP])


@inline
def _prio(s):
    return ((np.int64(s) + 1) * 2654435761) & 0xFFFFFFFF


@inline
def _rotate_up(root, rec, s):
    p = rec[s, UP]
    g = rec[p, UP]
    if rec[p, LEFT] == s:
        x = rec[s, RIGHT]
        rec[p, LEFT] = x
        if x >= 0:
            rec[x, UP] = p
        rec[s, RIGHT] = p
    else:
        x = rec[s, LEFT]
        rec[p, RIGHT] = x
        if x >= 0:
            rec[x, UP] = p
        rec[s, LEFT] = p
    rec[p, UP] = s
    rec[s, UP] = g
    if g < 0:
        root[0] = s
    elif rec[g, LEFT] == p:
        rec[g, LEFT] = s
    else:
        rec[g, RIGHT] = s


@jit
def insert(root, rec, s):
    """Slot ``s`` joins (its key read from its row)."""
    rec[s, LEFT] = -1
    rec[s, RIGHT] = -1
    x = root[0]
    if x < 0:
        rec[s, UP] = -1
        root[0] = s
        return
    k = key(rec, s)
    while True:
        if k < key(rec, x):
            if rec[x, LEFT] < 0:
                rec[x, LEFT] = s
                break
            x = rec[x, LEFT]
        else:
            if rec[x, RIGHT] < 0:
                rec[x, RIGHT] = s
                break
            x = rec[x, RIGHT]
    rec[s, UP] = x
    _sift_up(root, rec, s)


@inline
def _sift_up(root, rec, s):
    """Slot ``s``, just hung at its key's place as a leaf, rotated up to its priority's."""
    ps_ = _prio(s)
    while rec[s, UP] >= 0 and ps_ > _prio(rec[s, UP]):
        _rotate_up(root, rec, s)


@jit
def insert_after(root, rec, s, p):
    """Slot ``s`` joins, given ``p``: the member whose key is the greatest below ``s``'s (a finger). The same tree
    as :func:`insert`, whose descent from the root ends at the same place, between ``p`` and its in-order successor:
    ``p``'s right link if it has no right child, else the successor's left link (the leftmost of that right subtree).
    From ``p`` that is a walk down one left spine, two nodes on average in a treap, against the root's depth (about
    twenty nodes for ten thousand slots). A caller that knows a group's newest member inserts the next one so."""
    rec[s, LEFT] = -1
    rec[s, RIGHT] = -1
    x = rec[p, RIGHT]
    if x < 0:
        rec[p, RIGHT] = s
        rec[s, UP] = p
    else:
        while rec[x, LEFT] >= 0:
            x = rec[x, LEFT]
        rec[x, LEFT] = s
        rec[s, UP] = x
    _sift_up(root, rec, s)


@jit
def delete(root, rec, s):
    """Slot ``s`` (a member) leaves: rotated down to a leaf, then cut off."""
    while rec[s, LEFT] >= 0 or rec[s, RIGHT] >= 0:
        a, b = rec[s, LEFT], rec[s, RIGHT]
        c = a if b < 0 or (a >= 0 and _prio(a) > _prio(b)) else b
        _rotate_up(root, rec, c)
    p = rec[s, UP]
    if p < 0:
        root[0] = -1
    elif rec[p, LEFT] == s:
        rec[p, LEFT] = -1
    else:
        rec[p, RIGHT] = -1


@jit
def lower(root, rec, k):
    """The slot of the least key >= k (-1: none)."""
    x = root[0]
    best = -1
    while x >= 0:
        if key(rec, x) >= k:
            best = x
            x = rec[x, LEFT]
        else:
            x = rec[x, RIGHT]
    return best


@jit
def below(root, rec, k):
    """The slot of the greatest key < k (-1: none)."""
    x = root[0]
    best = -1
    while x >= 0:
        if key(rec, x) < k:
            best = x
            x = rec[x, RIGHT]
        else:
            x = rec[x, LEFT]
    return best


@inline
def after(rec, s):
    """The slot of the next key after member ``s``'s (-1: none): in-order, O(1) amortised over a walk."""
    x = rec[s, RIGHT]
    if x >= 0:
        while rec[x, LEFT] >= 0:
            x = rec[x, LEFT]
        return x
    p = rec[s, UP]
    while p >= 0 and rec[p, RIGHT] == s:
        s, p = p, rec[p, UP]
    return p
