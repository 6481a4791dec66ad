"""MissRatioCurve: LRU's hit rates at every cache size from one pass over a trace (Mattson's stack algorithm).

Why it is exact. In instant mode :class:`~sae_env.policies.lru.LRUPolicy` on a :class:`~sae_env.cache.PrefixCache`
is a *stack algorithm*: at every capacity ``C`` the cache after each request holds exactly the top
``min(C, |S|)`` blocks of one recency stack ``S`` that does not depend on ``C``. The stack is updated per request by
moving the request's *path* (its prompt blocks, then its output blocks when ``cache_outputs``) to the top, root
highest and deepest lowest (the order vLLM's free queue gets: a request releases deepest first, so its root is
the most recently released). By induction over requests, with the cache at ``C`` equal to the top of ``S``:

* a block's parent is above it in ``S`` (every reference to a block references its parent in the same request,
  placed above it), so the path's blocks in the top ``C`` are a leading run of the path: the hit is the number of
  prompt blocks whose stack position is ``<= C``;
* each insertion evicts the LRU free queue's head, which is the least recent cached block outside the pinned path
  (it is a leaf: its children are less recent, hence not cached, and none is pinned, or it would be too);
  when every cached block is on the path (path longer than ``C``) the rest is bypassed, and the cache is the first
  ``C`` path blocks, the top ``C`` of the new stack; otherwise it is the path plus the ``C - len(path)`` most recent
  other blocks, again the top ``C`` of the new stack.

So one pass computes each path block's stack position before its request (a Fenwick tree over last-access stamps,
O(log n) per reference), and every figure at any ``C`` follows from positions and path lengths without replaying:
the hits (a request's prompt positions ``<= C``), the bypasses (``len(path) - C`` when the prompt, or the prompt
plus its outputs, exceed ``C``), the insertions (path blocks reached and not found cached; an output block is found
cached only after a whole-prompt hit, so no insertion of its request came before it), the occupancy
(``min(C, |S|)``) and so the evictions. ``tests/test_mrc.py`` checks all of them against separate replays, request
for request.

The argument needs each key to have one parent (chained keys, as every source builds them) and no request to name
a key twice; :meth:`MissRatioCurve.build` raises ``ValueError`` for a trace without them (a replay is the way then).
Not covered, and left to a replay: misses after eviction (the ghost record's bound and a bypassed run's unread
ghosts depend on the capacity) and timed serving, where LRU is not a stack algorithm at all (requests in flight
together pin their paths until completion and insert outputs later; ``tests/test_mrc.py`` has a trace whose LRU hits
are lower at 12 blocks than at 11 or 13, which inclusion forbids).

numba (the ``fast`` extra) compiles the kernels; without it they run as plain Python, correct but slow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sae_env.fast_engine.keys import dense_ids
from sae_env.trace import Trace

try:  # optional, as for the compiled replay engine
    import numba

    _jit = numba.njit(cache=True, nogil=True)
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    def _jit(f):
        return f

__all__ = ["DEFAULT_POINTS", "CurvePoint", "MissRatioCurve", "capacity_range", "experiment_curves", "is_range",
           "lru_curve"]

DEFAULT_POINTS = 20  # capacities in a range LO:HI given without a count
MAX_POINTS = 10_000
COLD = np.iinfo(np.int64).max  # the stack position of a key never referenced before: a miss at every capacity


@dataclass(frozen=True)
class CurvePoint:
    """LRU at one capacity over the whole trace: the totals a replay's windows add up to."""

    capacity: int
    requests: int
    prompt_blocks: int
    hit_blocks: int
    prompt_tokens: int
    hit_tokens: int
    inserted: int
    bypasses: int
    evictions: int
    occupancy: int  # cached blocks at the end

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "block_hit_rate": self.block_hit_rate, "token_hit_rate": self.token_hit_rate}


# -- kernels -------------------------------------------------------------------------------------------------------
@_jit
def _stack_positions(ids, path_offsets, n_keys):
    """Each path reference's LRU stack position (1 = most recent) before its request, COLD if never seen; and the
    stack size before each request. Returns (positions, sizes, error): error 1 = a request names a key twice,
    2 = a key has two parents."""
    n_refs = ids.size
    n_req = path_offsets.size - 1
    pos = np.empty(n_refs, dtype=np.int64)
    sizes = np.empty(n_req + 1, dtype=np.int64)
    last = np.full(n_keys, -1, dtype=np.int64)  # the key's last-access stamp (0-based), -1 = never
    last_req = np.full(n_keys, -1, dtype=np.int64)
    parent = np.full(n_keys, -2, dtype=np.int64)  # -2 unknown, -1 root
    tree = np.zeros(n_refs + 1, dtype=np.int64)  # Fenwick tree over stamps: 1 where a key's last access is
    live = 0
    stamp = 0
    for r in range(n_req):
        a, b = path_offsets[r], path_offsets[r + 1]
        sizes[r] = live
        prev = -1
        for x in range(a, b):
            k = ids[x]
            if last_req[k] == r:
                return pos, sizes, 1
            last_req[k] = r
            if parent[k] == -2:
                parent[k] = prev
            elif parent[k] != prev:
                return pos, sizes, 2
            prev = k
            s = last[k]
            if s < 0:
                pos[x] = COLD
            else:
                below = 0  # stamps < s
                i = s
                while i > 0:
                    below += tree[i]
                    i -= i & -i
                pos[x] = live - below
        # The path goes on top, root most recent: the deepest block gets the smallest new stamp.
        for x in range(a, b):
            k = ids[x]
            s = last[k]
            if s >= 0:
                i = s + 1
                while i <= n_refs:
                    tree[i] -= 1
                    i += i & -i
            else:
                live += 1
            s = stamp + (b - 1 - x)
            last[k] = s
            i = s + 1
            while i <= n_refs:
                tree[i] += 1
                i += i & -i
        stamp += b - a
    sizes[n_req] = live
    return pos, sizes, 0


@_jit
def _at_capacity(c, pos, path_offsets, n_prompt, prompt_tokens, block_size, hits):
    """Fill ``hits`` (per request) at capacity ``c``; returns (hit tokens, inserted, bypasses)."""
    hit_tokens = 0
    inserted = 0
    bypasses = 0
    for r in range(path_offsets.size - 1):
        a = path_offsets[r]
        lp = n_prompt[r]
        lt = path_offsets[r + 1] - a
        h = 0
        while h < lp and pos[a + h] <= c:
            h += 1
        hits[r] = h
        hit_tokens += min(h * block_size, prompt_tokens[r])
        if lp > c:  # the prompt alone fills the cache: the rest of it is bypassed, outputs never tried
            inserted += c - h
            bypasses += lp - c
            continue
        # Output blocks found cached when reached: a leading run of the outputs, and only after a whole-prompt hit
        # (an output's parent is the last prompt block), so no insertion came before them to evict one.
        found = 0
        while lp + found < lt and pos[a + lp + found] <= c:
            found += 1
        inserted += lp - h + min(lt, c) - lp - found
        bypasses += max(0, lt - c)
    return hit_tokens, inserted, bypasses


# -- the curve -----------------------------------------------------------------------------------------------------
class MissRatioCurve:
    """The LRU stack positions of a trace, from which :meth:`at` gives LRU's figures at any capacity.

    Equal, figure for figure, to replaying ``lru`` on a fresh :class:`~sae_env.cache.PrefixCache` of that capacity
    in instant mode with the same ``cache_outputs`` (hits per request, hit blocks and tokens, insertions, bypasses,
    evictions, final occupancy); see the module docstring for why.
    """

    def __init__(self, trace: Trace, positions: np.ndarray, path_offsets: np.ndarray, n_prompt: np.ndarray,
                 sizes: np.ndarray, cache_outputs: bool):
        self.trace = trace
        self.positions = positions
        self.path_offsets = path_offsets
        self.n_prompt = n_prompt
        self.sizes = sizes  # stack size (distinct path blocks seen) before each request, then at the end
        self.cache_outputs = cache_outputs
        self.final_size = int(sizes[-1])

    @classmethod
    def build(cls, trace: Trace, cache_outputs: bool = True) -> MissRatioCurve:
        """One pass over ``trace``: O(references x log references). ValueError if a request names a key twice or
        a key follows two different parents (the stack argument needs a tree of keys)."""
        if len(trace) == 0:
            raise ValueError("the trace has no requests")
        po = np.asarray(trace.prompt_offsets, dtype=np.int64)
        n_prompt = np.diff(po)
        if cache_outputs:
            oo = np.asarray(trace.output_offsets, dtype=np.int64)
            n_out = np.diff(oo)
        else:
            oo = np.zeros(len(trace) + 1, dtype=np.int64)
            n_out = np.zeros(len(trace), dtype=np.int64)
        path_offsets = np.concatenate([[0], np.cumsum(n_prompt + n_out)]).astype(np.int64)
        # Each request's path, prompt then outputs, as one key array.
        keys = np.empty(int(path_offsets[-1]), dtype=np.int64)
        keys[np.repeat(path_offsets[:-1] - (po[:-1] - po[0]), n_prompt) + np.arange(po[-1] - po[0])] = \
            np.asarray(trace.prompt_keys)[po[0]:po[-1]]
        if n_out.any():
            keys[np.repeat(path_offsets[:-1] + n_prompt - (oo[:-1] - oo[0]), n_out) + np.arange(oo[-1] - oo[0])] = \
                np.asarray(trace.output_keys)[oo[0]:oo[-1]]
        ids, distinct = dense_ids(keys)
        pos, sizes, err = _stack_positions(ids, path_offsets, distinct)
        if err == 1:
            raise ValueError("a request of the trace names one key twice: LRU's curve needs distinct keys per "
                             "request (replay it instead)")
        if err == 2:
            raise ValueError("a key of the trace follows two different parent blocks: LRU's curve needs chained "
                             "keys (replay it instead)")
        return cls(trace, pos, path_offsets, n_prompt, sizes, cache_outputs)

    def hits_per_request(self, capacity: int) -> np.ndarray:
        """Hit blocks of each request at ``capacity`` (what a replay's windows list in ``hits_per_request``)."""
        return self._run(capacity)[0]

    def point(self, capacity: int) -> CurvePoint:
        """LRU's totals at one capacity (blocks >= 1)."""
        hits, hit_tokens, inserted, bypasses = self._run(capacity)
        tr = self.trace
        occupancy = min(capacity, self.final_size)
        return CurvePoint(capacity=capacity, requests=len(tr), prompt_blocks=int(self.n_prompt.sum()),
                          hit_blocks=int(hits.sum()), prompt_tokens=int(np.asarray(tr.prompt_tokens).sum()),
                          hit_tokens=hit_tokens, inserted=inserted, bypasses=bypasses,
                          evictions=inserted - occupancy, occupancy=occupancy)

    def at(self, capacities: Sequence[int]) -> list[CurvePoint]:
        """:meth:`point` at each capacity, in the order given."""
        return [self.point(c) for c in capacities]

    def _run(self, capacity: int) -> tuple[np.ndarray, int, int, int]:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity must be a whole number of blocks >= 1, got {capacity!r}")
        tr = self.trace
        hits = np.empty(len(tr), dtype=np.int64)
        hit_tokens, inserted, bypasses = _at_capacity(
            np.int64(capacity), self.positions, self.path_offsets, self.n_prompt,
            np.asarray(tr.prompt_tokens, dtype=np.int64), np.int64(tr.block_size), hits)
        return hits, int(hit_tokens), int(inserted), int(bypasses)


def lru_curve(trace: Trace, capacities: Sequence[int], cache_outputs: bool = True) -> list[CurvePoint]:
    """LRU's figures at each of ``capacities`` (blocks) from one pass: :meth:`MissRatioCurve.build` then
    :meth:`MissRatioCurve.at`."""
    return MissRatioCurve.build(trace, cache_outputs).at(capacities)


def is_range(text: str) -> bool:
    """Whether a capacity as given names several capacities (``LO:HI[:N]`` or a comma list)."""
    return isinstance(text, str) and (":" in text or "," in text)


def capacity_range(text: str, distinct_blocks: int, kv_bytes_per_token: int | None = None,
                   block_size: int | None = None) -> list[int]:
    """Capacities in blocks from ``LO:HI[:N]`` (N capacities spaced geometrically from LO to HI, both included,
    default :data:`DEFAULT_POINTS`; whole blocks, duplicates after rounding dropped) or a comma list; each end or
    item in any form :func:`~sae_env.cache.resolve_capacity` takes (``1%``, ``0.01``, ``128``, ``2GiB``).
    ValueError naming the part that is wrong."""
    from sae_env.cache import resolve_capacity

    def one(part: str, what: str) -> int:
        if not part.strip():
            raise ValueError(f"capacity range {text!r}: the {what} is empty (e.g. 1%:40% or 1%:40%:20)")
        try:
            return resolve_capacity(part, distinct_blocks, kv_bytes_per_token, block_size)
        except ValueError as e:
            raise ValueError(f"capacity range {text!r}, {what} {part!r}: {e}") from None

    if "," in text:
        if ":" in text:
            raise ValueError(f"capacity {text!r}: give a range LO:HI[:N] or a comma list, not both")
        return sorted({one(p, "item") for p in text.split(",")})
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"capacity range {text!r} must be LO:HI or LO:HI:N (e.g. 1%:40% or 1%:40%:20)")
    lo, hi = one(parts[0], "low end"), one(parts[1], "high end")
    n = DEFAULT_POINTS
    if len(parts) == 3:
        try:
            n = int(parts[2])
        except ValueError:
            n = 0
        if not 2 <= n <= MAX_POINTS:
            raise ValueError(f"capacity range {text!r}: the count N after the second ':' must be a whole number in "
                             f"[2, {MAX_POINTS:,}], got {parts[2][:40]!r}")
    if lo >= hi:
        raise ValueError(f"capacity range {text!r}: the low end ({lo} blocks) must be below the high end ({hi} "
                         "blocks)")
    return sorted({int(round(c)) for c in np.geomspace(lo, hi, n)} | {lo, hi})


def experiment_curves(capacities: Sequence[Any], points: int, traces: Mapping[tuple[str, int], Trace],
                      done: Sequence[tuple[str, int, str, Mapping[str, Any]]], plain_lru: set[str],
                      log: Callable[[str], None]) -> tuple[list[dict[str, Any]], int]:
    """An experiment's ``lru_curve``: per (workload, seed) trace, LRU at ``points`` capacities spaced geometrically
    from the smallest to the largest of the config's ``capacities`` (which are included, labelled ``capacity``).
    ``done`` lists the finished cells as (workload, seed, agent, summary): each one whose agent is in ``plain_lru``
    (lru, default options) must equal the curve at its capacity, or RuntimeError (the curve's exactness is checked
    in every run that has one). Returns the rows and how many cells were checked."""
    from sae_env.cache import resolve_capacity

    figures = ("hit_tokens", "hit_blocks", "evictions", "bypasses", "inserted")
    rows: list[dict[str, Any]] = []
    checked = 0
    for (workload, seed), trace in traces.items():
        try:
            curve = MissRatioCurve.build(trace)
        except ValueError as e:
            log(f"lru_curve: workload {workload}: no curve ({e})")
            continue
        configured = {resolve_capacity(c, trace.distinct_blocks()): c for c in capacities}
        lo, hi = min(configured), max(configured)
        dense = {int(round(c)) for c in np.geomspace(lo, hi, points)} if hi > lo else set()
        for c in sorted(dense | set(configured)):
            point = {k: v for k, v in curve.point(c).to_dict().items() if k != "capacity"}
            rows.append({"workload": workload, "seed": seed, "capacity": configured.get(c), "capacity_blocks": c,
                         **point})
        for w, s, agent, summary in done:
            if (w, s) != (workload, seed) or agent not in plain_lru:
                continue
            p = curve.point(summary["capacity_blocks"])
            if any(summary[f] != getattr(p, f) for f in figures):
                diff = {f: (getattr(p, f), summary[f]) for f in figures}
                raise RuntimeError(f"lru_curve disagrees with the {agent} cell of {w}, seed {s}, capacity "
                                   f"{summary['capacity_blocks']}: {diff} (curve, cell)")
            checked += 1
    return rows, checked
