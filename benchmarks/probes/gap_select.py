"""Probe: each queue's hit density reads log-normal gaps or exponential gaps of the same mean, whichever has predicted
better the re-accesses this cache has seen of its own blocks. docs/saecache-real-traces.md: "Where
mooncake_synthetic's 2 % cells go".

    python benchmarks/gap_table.py [--halves [alternate]] --capacities 0.02,0.05,0.1,0.2 \\
        --policies lru,lpc,saecache,belady --criteria --variant sel:policy=probes.gap_select:GapSelect

Why: the hit density ranks a block by the hits it brings over the cache's turnover time ``H``, so at a small cache
(``H`` a few seconds) it is the gaps' hazard over the first seconds that orders the blocks. One log-normal per queue,
fitted to every session gap, says that hazard rises there; on mooncake_synthetic the re-use of blocks falls from the
first second (its later turns are fast, its first turns slow: a mixture a pooled fit smooths over), and recency,
which exponential gaps give within each continuation bin, ranks better. On traces whose gaps are tight (the arXiv
excerpt) the log-normal's rise is real, and so is its gain.

How: every block of a chat, agent or structural queue is scored under the cure model of its own queue at each event
the cache sees: a hit after idling ``t`` is an event (``log p + log f(t)``), an eviction after idling ``t`` a censored
time (``log(1 - p + p S(t))``), with the block's continuation probability ``p`` (its group's bin; the shared
prefixes' reuse rate for structural blocks) and the queue's current gap parameters, once under the log-normal and
once under the exponential of the same mean. At every refit (``REFIT_EVERY`` arrivals) and every change of the
learners' parameters each queue's density reads the distribution with the larger log-likelihood so far (each sum
multiplied by ``decay`` per refit: 1 keeps every event), the blocks idle in the cache then counted too, censored at
their idle time so far (``pending``; without them, before the cache's first evictions only the hits would count,
and hits alone favour whichever density is higher where they fall). The data are the idle times this cache
reaches, so the choice follows its size; its evictions depend on the idle time and the bin only, which the
likelihood conditions on.
``select=False`` is SAECache itself (the sums are kept, never acted on).

Python engine only (a subclass; the compiled twin mirrors SAECache's class exactly). The policy's ``gap_select`` switch
(sae_env/policies/gap_shape.py, on both engines) is this probe made part of SAECache: it chooses at the refits only
(not also when the learners set parameters), keeps its sums in whole units (the compiled engine's sums are then the
same), ends a block's idle time at its first hit, and has no ``decay`` or ``pending`` option. This probe stays for the
figures it made (docs/saecache-real-traces.md).
"""

from __future__ import annotations

import math
from typing import Any

from sae_env.block import Block
from sae_env.policies import gap_shape
from sae_env.policies.arrivals import AG, CH, ST
from sae_env.policies.saecache import SAECachePolicy
from sae_env.policies.survival import ExponentialGaps, LognormalGaps

QUEUES = (CH, AG, ST)


def cure_loglik(event: bool, t: float, p: float, mu: float, sigma: float) -> tuple[float, float]:
    """The cure model's log-likelihood of one block's idle time ``t`` (a re-access if ``event``, else censored) with
    continuation probability ``p``, under ``LN(mu, sigma)`` and under the exponential of the same mean
    (gap_shape.cure_loglik, the policy's)."""
    return gap_shape.cure_loglik(event, t, p, mu, sigma, math.exp(mu + sigma * sigma / 2.0))


class GapSelect(SAECachePolicy):
    """SAECache whose chat, agent and structural densities read whichever gap shape has predicted this cache's
    re-accesses better (``exponential[q]``: the current choice; ``loglik[q]``: the two sums over the hits and
    evictions so far, the idle blocks not included)."""

    def __init__(self, select: bool = True, decay: float = 1.0, pending: bool = True, **options: Any):
        for name, flag in (("select", select), ("pending", pending)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"decay must be a number in (0, 1], got {decay!r}")
        self._ready = False  # params_changed runs inside SAECachePolicy.__init__
        super().__init__(**options)
        if not (self._density and self.switches["lognormal"]) or self._empirical:
            raise ValueError("gap_select chooses between the log-normal and the exponential of the hit density: it "
                             "needs density=True and lognormal=True, without empirical_gaps or gap_mixture")
        self.select, self.decay, self.pending = select, float(decay), pending
        self.loglik = {q: [0.0, 0.0] for q in QUEUES}  # [log-normal, exponential]
        self.exponential = {q: False for q in QUEUES}
        self.switches_made = 0
        self._idle_since: dict[int, tuple[float, Block]] = {}  # block key -> (its last release, the block)
        self._ready = True

    def _score(self, b: Block, t: float, event: bool, into: dict[int, list[float]] | None = None) -> None:
        q = b.queue
        if q not in self.loglik or not t > 0:
            return
        ln, ex = cure_loglik(event, t, self._p_of(b), *self._ln[q])  # (cure_loglik keeps p inside (0, 1))
        ll = (self.loglik if into is None else into)[q]
        ll[0] += ln
        ll[1] += ex

    def on_hit(self, blocks: list[Block], now: float) -> None:
        since = self._idle_since
        for b in blocks:
            seen = since.get(b.key)
            if seen is not None:
                self._score(b, now - seen[0], True)
        super().on_hit(blocks, now)

    def on_release(self, blocks: list[Block], now: float) -> None:
        since = self._idle_since
        for b in blocks:
            since[b.key] = (now, b)
        super().on_release(blocks, now)

    def evict(self, now: float) -> Block | None:
        victim = super().evict(now)
        if victim is not None:
            seen = self._idle_since.pop(victim.key, None)
            if seen is not None:
                self._score(victim, now - seen[0], False)
        return victim

    def _choose(self) -> bool:
        """Each queue's density reads the shape ahead so far; whether any choice changed."""
        if not self._ready:
            return False
        total = {q: list(ll) for q, ll in self.loglik.items()}
        if self.pending:  # the blocks idle in the cache now: censored at their idle time so far
            now = self._now
            for t0, b in self._idle_since.values():
                self._score(b, now - t0, False, total)
        changed = False
        for q in QUEUES:
            exp_now = self.select and total[q][1] > total[q][0]
            mu, sigma = self._ln[q]
            self._gaps[q] = ExponentialGaps(self._exp_mean[q]) if exp_now else LognormalGaps(mu, sigma)
            if exp_now != self.exponential[q]:
                self.exponential[q] = exp_now
                self.switches_made += 1
                changed = True
        return changed

    def params_changed(self) -> None:
        super().params_changed()  # rebuilds the gaps (log-normal) and clears the constants
        self._choose()

    def _refit(self, now: float) -> None:
        super()._refit(now)
        if self.decay < 1.0:
            for ll in self.loglik.values():
                ll[0] *= self.decay
                ll[1] *= self.decay
        if self._choose():
            self._changed()
