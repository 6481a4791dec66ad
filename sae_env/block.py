"""One cached KV block (:class:`Block`), and the one small integer that names a block's queue and token type.

**Queue-type code.** Wherever a block's queue and token type travel together as one int (the ghost record's value,
SAECache's group ids, the compiled engine's ghost table), they are ``queue * TYPE_SLOTS + type``:
:func:`queue_type_code` makes it, :func:`split_queue_type` takes it apart. ``TYPE_SLOTS`` = 8 is the power of two
above the number of token types, so ``code >> 3`` is the queue and ``code & 7`` the type where a hot loop spells it
out.
"""

from __future__ import annotations

from sae_env.trace import N_TOKEN_TYPES

__all__ = ["TYPE_SLOTS", "Block", "queue_type_code", "split_queue_type"]

TYPE_SLOTS = 8  # token types a queue-type code leaves room for: a power of two, so shifts and masks work
if N_TOKEN_TYPES > TYPE_SLOTS:  # pragma: no cover - a new token type past 8 must widen the code
    raise RuntimeError(f"{N_TOKEN_TYPES} token types do not fit the queue-type code's {TYPE_SLOTS} slots")


def queue_type_code(queue: int, btype: int) -> int:
    """One int for a (queue, token type) pair: ``queue * TYPE_SLOTS + btype``."""
    return queue * TYPE_SLOTS + btype


def split_queue_type(code: int) -> tuple[int, int]:
    """``(queue, token type)`` of a :func:`queue_type_code` (of an array of codes too: two arrays)."""
    return divmod(code, TYPE_SLOTS)


class Block:
    """One cached KV block. Slotted: a cache may hold millions of these.

    The cache owns ``key`` .. ``hits``; ``queue``, ``stamp`` and ``pdata`` belong to the policy. ``stamp`` is an
    int (0 = none) that names the block's live heap entry (:class:`~sae_env.policies.base.KeyedPolicy`, LPC, the
    oracles) or its release (SAECache; negative while a scan has parked it). ``pdata`` is one slot of
    policy-private data, ``None`` until the policy sets it:

    ==================  ===========================================================================================
    lru                 unused (it keeps its own free queue)
    fifo                insertion order (int), its eviction key
    lfu                 release order (int), the recency tie-break after the hit count
    s3fifo              access frequency, 0 .. ``max_freq`` (int)
    lpc                 ``(logit p, session)`` of the request that last used it (``session`` a shared marker for
                        blocks two sessions use)
    belady              the request index of the key's next use (int; ``NEVER`` when there is none)
    reuse-oracle        the next use (int) while pinned; ``(next use, release order)`` once released
    when-oracle         the bucketed next use (float) while pinned; ``(estimate, release order)`` once released
    session-oracle      the request that last used it, or -1 when another session shares it (int) while pinned;
                        ``(that, release order)`` once released
    saecache            structural blocks: the block's relative offset in its prompt, in [0, 1] (float); chat and
                        agent blocks: their group id once released (int: queue-type code plus the releasing
                        request's continuation bin); other blocks: unused
    ==================  ===========================================================================================
    """

    __slots__ = ("key", "parent", "depth", "n_children", "pins", "type", "queue", "last_access", "hits", "stamp",
                 "pdata")

    def __init__(self, key: int, parent: Block | None, depth: int, btype: int, now: float):
        self.key = key  # prefix-chained block key
        self.parent = parent  # the cached block before this one (None for a prompt's first block)
        self.depth = depth  # position of the block in its sequence, 0 = first block
        self.n_children = 0  # number of cached children; 0 = leaf
        self.pins = 0  # number of in-flight requests using this block; > 0 = not evictable
        self.type = btype  # TokenType value
        self.queue = 0  # queue the policy put it in (0 for single-queue policies)
        self.last_access = now  # trace time of the last use: hit or insertion, and the release by its last user
        self.hits = 0  # number of hits since insertion
        self.stamp = 0  # policy bookkeeping (see the class docstring)
        self.pdata = None  # policy-private data (see the class docstring)

    def __repr__(self) -> str:
        return (f"Block(key={self.key}, depth={self.depth}, type={self.type}, queue={self.queue}, "
                f"pins={self.pins}, children={self.n_children})")
