"""Which gap shape each of SAECache's chat, agent and structural queues reads (the ``gap_select`` switch): the
log-normal of its learners' parameters, or the exponential of the same mean, whichever the cure model's likelihood of
this cache's own re-accesses prefers so far.

Why: the hit density ranks a block by the hits it brings over the cache's turnover time ``H``, so at a small cache
(``H`` a few seconds) it is the gaps' hazard over the first seconds that orders the blocks. One log-normal per queue,
fitted to every session gap, says that hazard rises there; where the re-use of blocks falls from the first second
instead (on mooncake_synthetic, whose later turns are fast and first turns slow: a mixture one fit smooths over),
recency, which exponential gaps give within each continuation bin, ranks better. Where gaps are tight the
log-normal's rise is real, and so is its gain (docs/saecache-real-traces.md: "Where mooncake_synthetic's 2 % cells
go").

How: a block is idle from its release until it is hit (an event after idling ``t``: ``log p + log f(t)``) or evicted
(a censored time: ``log(1 - p + p S(t))``), with the block's continuation probability ``p`` (its group's bin; the
shared prefixes' reuse rate for structural blocks) and its queue's current parameters, once under the log-normal and
once under the exponential. At every refit each queue reads the shape with the larger sum over the events and
evictions so far and the blocks idle in the cache now (censored at their idle time so far: without them, before
the first evictions only hits would count, and hits alone favour whichever density is higher where they fall). The
idle times are the ones this cache reaches, so the choice follows its size; its evictions depend on idle time and
bin only, which the likelihood conditions on. No constant is fitted: the data decide between two shapes of the
same mean.

The sums are kept in whole units of ``2**-20`` (each term rounded, then added as integers): a sum is then the same
whatever order its terms come in, so the compiled engine, which visits the idle blocks by slot, chooses as this
module does, to the last unit.

Cost. Every block followed costs a term at its hit or eviction (the compiled engine reuses the last term for the runs
of blocks released together), and the idle blocks are the cache's whole content at every refit: counted one by one,
they cost a replay of mooncake_synthetic at 10 % 11 us a request (four times LPC's whole decision time), and more as
caches grow. So the blocks are sampled: only those whose release stamp is a multiple of ``every`` (:func:`idle_every`:
a power of two that leaves ``IDLE_SAMPLE`` to twice as many of a full cache's blocks) are followed from their release
to their hit or eviction, and each counts ``every`` times, idle, hit or evicted. Release stamps are given in release
order, so the sample is spread over every age and group the cache holds. 128 to 256 idle terms a refit make the
choices of counting every idle block on the shipped traces' halves (docs/saecache-real-traces.md, "The gap shape
chosen by the cache's own re-accesses"); 64 to 128 did not (mooncake_synthetic's late half at 5 % flapped between
shapes, 15.32 -> 14.60 %). Sampling the hits and evictions too moved the wide-cell means of the shipped traces, both
halvings and the traces made four times longer by 0.02 at most, and took about half a microsecond a request off
mooncake_synthetic made 16 times longer.

The census. The idle blocks stand in for the evictions that have not happened yet: before the cache has turned over
they are most of the censored times there are, and they are what keeps the first choices from reading hits alone. Once
the cache has evicted ``CENSUS`` times its capacity, the evictions counted so far are at least four times the idle
blocks a census could add (a full cache holds at most ``capacity`` of them), and the choices read the hits and
evictions only (:func:`census_on`; a term of the census costs 100-200 nanoseconds in the compiled engine, five libm
calls and the sampled block's scattered rows: about a fifth of a microsecond a request on mooncake_synthetic made 16
times longer, where the census lasts four of its nine turnovers). Stopping it after one turnover instead made the
choices of the start halves' mooncake_synthetic late half at 5 % worse (15.27 -> 14.15 %); after four or sixteen the
wide-cell means of the start and alternate halves were +0.80 / +0.91 and +0.78 / +0.90, against +0.78 / +0.88 counting
at every choice (every block followed, then; docs/saecache-real-traces.md, "The gap shape chosen by the cache's own
re-accesses").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from sae_env.block import Block
from sae_env.policies.base import block_array

__all__ = ["CENSUS", "IDLE_SAMPLE", "LOGLIK_UNIT", "GapShapeChoice", "census_on", "cure_loglik", "idle_every",
           "loglik_units"]

IDLE_SAMPLE = 128  # the sample: 128 to 256 blocks of a full cache (a cost knob; see Cost above)
CENSUS = 4.0  # the idle blocks are counted until the cache has evicted four caches' worth (a cost knob; see Cost)

LOGLIK_UNIT = 2.0 ** -20  # the sums' resolution: a millionth of a nat
_PER_UNIT = 2.0 ** 20
_TERM_BOUND = 1e6  # a term's magnitude is clamped here (nats; real terms are tens): 9 million such terms fit int64
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_SQRT2 = math.sqrt(2.0)
_P_EDGE = 1e-9  # p is kept inside (0, 1): log p and log(1 - p + ...) stay finite


def cure_loglik(event: bool, t: float, p: float, mu: float, sigma: float, mean: float) -> tuple[float, float]:
    """The cure model's log-likelihood of one idle time ``t > 0`` (a re-access if ``event``, else censored) of a
    block whose session continues with probability ``p``: under ``LN(mu, sigma)`` and under the exponential of mean
    ``mean`` (the log-normal's). Plain arithmetic and libm calls: the compiled engine runs this very function."""
    p = min(max(p, _P_EDGE), 1.0 - _P_EDGE)
    if event:
        z = (math.log(t) - mu) / sigma
        log_p = math.log(p)
        return (log_p - 0.5 * z * z - math.log(t * sigma) - _HALF_LOG_2PI,
                log_p - t / mean - math.log(mean))
    s_ln = 0.5 * math.erfc((math.log(t) - mu) / (sigma * _SQRT2))
    return math.log(1.0 - p + p * s_ln), math.log(1.0 - p + p * math.exp(-t / mean))


def loglik_units(x: float) -> int:
    """``x`` nats in whole units of ``LOGLIK_UNIT`` (rounded; clamped to +-``_TERM_BOUND`` nats)."""
    x = min(max(x, -_TERM_BOUND), _TERM_BOUND)
    return int(math.floor(x * _PER_UNIT + 0.5))


def census_on(evicted: int, capacity: float, turnovers: float) -> bool:
    """Whether a choice still counts the idle blocks: until the cache has evicted ``turnovers`` times its
    ``capacity`` (:class:`GapShapeChoice`, "The census"). Plain arithmetic: the compiled engine runs it too."""
    return evicted < turnovers * capacity


def idle_every(capacity: int, sample: int = IDLE_SAMPLE) -> int:
    """The sample's step for a cache of ``capacity`` blocks: the largest power of two at most
    ``capacity / sample`` (1 for small caches: every block)."""
    return 1 << max(0, (int(capacity) // sample).bit_length() - 1)


class GapShapeChoice:
    """The likelihood sums of one cache and the shape each queue reads now.

    ``loglik[q]``: ``[log-normal, exponential]`` over the hits and evictions so far, in units (the idle blocks are
    added at each choice, not kept); ``exponential[q]``: the current choice; ``idle``: the release time of each idle
    block in the sample (a block hit or evicted leaves it); ``evicted``: the cache's evictions so far."""

    __slots__ = ("queues", "loglik", "exponential", "idle", "switches_made", "evicted")

    def __init__(self, queues: tuple[int, ...]):
        self.queues = queues
        self.loglik = {q: [0, 0] for q in queues}
        self.exponential = {q: False for q in queues}
        self.idle: dict[Block, float] = {}
        self.switches_made = 0
        self.evicted = 0  # the cache's evictions so far, of any queue (census_on)

    def add(self, sums: dict[int, list[int]], q: int, event: bool, t: float, p: float,
            shape: tuple[float, float, float], weight: int = 1) -> None:
        """Score one idle time of a block of queue ``q`` (``shape``: its queue's ``mu, sigma, mean``) into ``sums``,
        ``weight`` times."""
        if q in sums and t > 0.0:
            ln, ex = cure_loglik(event, t, p, *shape)
            s = sums[q]
            s[0] += weight * loglik_units(ln)
            s[1] += weight * loglik_units(ex)

    def released(self, blocks: list[Block], now: float, every: int = 1) -> None:
        """``blocks`` were released at ``now``: those in the sample (release stamp a multiple of ``every``) are idle
        from here."""
        idle = self.idle
        for b in blocks:
            if every == 1 or not abs(b.stamp) % every:
                idle[b] = now

    def ended(self, b: Block, now: float, event: bool, p_of: Callable[[Block], float],
              shape_of: Callable[[int], tuple[float, float, float]], every: int = 1) -> None:
        """Block ``b`` is hit (``event``) or evicted at ``now``: if it is in the sample, idle since its release, its
        idle time counts ``every`` times."""
        if not event:
            self.evicted += 1
        t0 = self.idle.pop(b, None)
        if t0 is not None and b.queue in self.loglik:
            self.add(self.loglik, b.queue, event, now - t0, p_of(b), shape_of(b.queue), every)

    def totals(self, now: float, p_of: Callable[[Block], float],
               shape_of: Callable[[int], tuple[float, float, float]], every: int = 1,
               census: bool = True) -> dict[int, list[int]]:
        """The sums with the idle blocks counted censored at ``now`` (those whose release stamp is a multiple of
        ``every``, ``every`` times each; none unless ``census``)."""
        total = {q: list(s) for q, s in self.loglik.items()}
        if not census:
            return total
        for b, t0 in self.idle.items():
            q = b.queue
            if q in total and not abs(b.stamp) % every:
                self.add(total, q, False, now - t0, p_of(b), shape_of(q), every)
        return total

    def choose(self, now: float, p_of: Callable[[Block], float],
               shape_of: Callable[[int], tuple[float, float, float]], every: int = 1, census: bool = True) -> bool:
        """Each queue reads the shape ahead in :meth:`totals` (without the idle blocks unless ``census``); whether
        any choice changed."""
        total = self.totals(now, p_of, shape_of, every, census)
        changed = False
        for q in self.queues:
            exp_now = total[q][1] > total[q][0]
            if exp_now != self.exponential[q]:
                self.exponential[q] = exp_now
                self.switches_made += 1
                changed = True
        return changed

    # -- the state contract (the policy's export_state / import_state) ----------------------------------------
    def export_state(self, blocks: Any, index: dict[int, int]) -> dict[str, Any]:
        return {"idle_since": block_array(blocks, index, self.idle.get, np.float64, default=math.nan),
                "gap_loglik": np.array([self.loglik[q] for q in self.queues], dtype=np.int64),
                "gap_exponential": np.array([self.exponential[q] for q in self.queues], dtype=np.int64),
                "gap_switches": self.switches_made, "gap_evicted": self.evicted}

    def import_state(self, state: dict[str, Any], blocks: list[Block]) -> None:
        self.idle = {b: t for b, t in zip(blocks, state["idle_since"].tolist(), strict=True) if not math.isnan(t)}
        self.loglik = {q: [int(a), int(b)] for q, (a, b) in zip(self.queues, state["gap_loglik"].tolist(),
                                                                 strict=True)}
        self.exponential = {q: bool(e) for q, e in zip(self.queues, state["gap_exponential"].tolist(), strict=True)}
        self.switches_made = int(state["gap_switches"])
        self.evicted = int(state["gap_evicted"])
