"""Will this session send another request? A continuation model learned online from the replay's own past.

SAECache's session predictor (the paper's) answers at a session's first request only; this model answers at every
request, from what a server sees when it arrives, and learns from the continuations the replay has already
observed. It never reads the future: a request's label is known only when its session's next request arrives
(continued) or when the session has been idle past a horizon (ended); until then it is *censored* (pending).

Model. ``logit p_i = logit r_k(i) + beta . z_i``:

* ``r_k``: the continuation rate of requests at turn ``k`` (turns ``max_turn`` and beyond pooled), a Beta(1, 1)
  posterior mean over the labelled requests of that turn plus the pending ones, each pending request counted by the
  posterior that its session is still alive after idling ``c``: ``r S(c) / (1 - r + r S(c))`` with ``S`` the
  log-normal gap survival of its queue (the EM step of a cure-rate model, repeated a few times at each update).
  This corrects the bias of counting a session that has not come back *yet* as ended (which LPC's counting has).
  The counts move at every arrival (a new request is pending with weight ``r``, a continued one becomes a label),
  the soft weights are recomputed at each :meth:`update` (once a window).
* ``beta``: a logistic correction on features ``z_i`` (below), fitted by a few Newton steps with an L2 penalty on
  the latest labelled and pending requests (soft labels for the pending ones), the turn rate as offset. With little
  data the penalty keeps ``beta`` near 0, so the model starts as the per-turn rates.

Features (known at arrival; none depends on a later request): prompt length, tokens new since the session's
previous request, the gap since that request, the prompt's token-type mix (user / assistant / tool output /
system + template shares), whether the request carries tool schemas (``app == AGENT``; other app labels are not
used, as hash-only and conversation sources derive them from the session's whole length), and, when a session
predictor is given, its logit for first requests (the pre-trained predictor as a prior).

When is a pending request labelled ended? When the posterior that its session is still alive, ``r S(c) / (1 - r + r
S(c))`` with its turn's rate ``r``, has fallen below ``end_below`` (1 %), or at the latest once it has idled past the
horizon ``exp(mu + horizon_sigmas * sigma)`` of its queue's gap distribution (with ``horizon_sigmas = 3``, 0.13 % of
log-normal gaps are longer). A label given at posterior ``w`` is wrong with probability ``w``, so each such label
biases its turn's counts by less than ``end_below``: the error the horizon alone already accepts for a persistent turn
(``r = 0.9`` at ``S = 0.13 %``: 1.2 %), now accepted for every turn and no more. Where sessions rarely continue (a
trace of one-request sessions: ``r = 0.12``) the posterior falls below 1 % at ``S = 7 %``, about 1.5 sigma, where the
horizon waits for 3 sigma: that turn's pending requests (which every refit and refresh works through) are then about a
tenth as many (mooncake_synthetic made four times longer: a third as many in all; docs/saecache-real-traces.md,
"Decision time"). Without ``censoring`` there is no posterior and the horizon alone ends them.

Refit schedule. The policy offers an update every few dozen arrivals; a refit costs time in proportion to the
requests it rests on (the labelled buffer and the pending requests), which grow with the replay, so refitting at
every offer costs time quadratic in the trace's length until the buffer is full. With ``refit_growth = g`` the
model refits only once the offers (the arrivals) have grown by the fraction ``g`` since its last refit (at every
offer while they are few, at most ``MAX_REFIT_GAP`` offers apart). The refits' total work is then a geometric series:
about ``1 + 1/g`` refits on everything seen (3 at SAECache's ``g = 0.5``), and the last refit always rested on at
least ``1 / (1 + g)`` of the arrivals so far (two thirds). Between refits the counts still move at every arrival (a
new request is pending, a returning session labels its previous request continued), so the per-turn rates do; what
waits for the next refit is the pending requests' soft weights, the horizon's "ended" labels and ``beta``.

Those three are functions of time as well as of the arrivals: a pending request's weight ``r S(c) / (1 - r + r
S(c))`` falls as its idle time ``c`` grows, whether or not anything arrives. Counted in arrivals alone, the schedule
leaves them as they were at the last refit for as long as arrivals are sparse (at the end of a trace, when sessions
stop starting and the open ones wind down: every session that has ended since counts as alive with the weight it had
then, and the late turns' rates stay high). With ``timed_refit`` (the default) the model also refreshes them at the
first arrival after the clock has moved on by the chat queue's typical gap ``exp(mu)`` (the log-normal's median; the
exponential's mean) since its last refit, the time over which those weights change by a large step: the sessions idle
past the horizon labelled ended, then the EM steps of the rates and soft weights; not ``beta``, whose data (the
labels) grow with the arrivals and whose fit is most of a refit's cost. It adds at most one refresh per typical gap,
and none while refits come more often than that (early in a trace); late in a long trace, where refits are up to 4,096
arrivals apart, it fires once per typical gap even where arrivals are dense, and each refresh works through every
pending request (docs/saecache-real-traces.md, "Decision time": the cost this has on long traces).

Arithmetic. A refit's settling of the pending requests (their gap survival, which ended, their soft weights, the
rates' EM steps) is numpy here (:func:`~sae_env.policies.continuation_refit.settle_numpy`); the compiled arrivals
(:mod:`sae_env.fast_engine.arrivals`) settle in their kernel, the same floats (the survival through libm's ``log``
and ``erfc`` in both), and hand the Newton steps back (:meth:`fit_settled`), which stay numpy.

Why one piece (~560 lines): the per-turn counts, the pending requests with their soft weights, the labelled buffer and
the cached feature rows are one state that every arrival, refit and refresh updates together; the hand-over methods
the compiled arrivals use (``counts`` / ``set_counts`` / ``fit_settled`` / ``labelled_buffer`` / ``zb_at``) and the
state contract read and write that same state, so split apart each piece would reach into the others' fields.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence

import numpy as np

from sae_env.policies.base import request_array
from sae_env.policies.continuation_refit import RATES, settle_numpy
from sae_env.policies.survival import LognormalGaps
from sae_env.trace import N_TOKEN_TYPES, AppType, TokenType, Trace

__all__ = ["MAX_REFIT_GAP", "P_CLIP", "ContinuationModel"]

_N_FEATURES = 9
P_CLIP = 1e-3  # probabilities are clipped to [P_CLIP, 1 - P_CLIP] before a logit
# Most update offers between two refits under ``refit_growth``: SAECache offers one every 64 arrivals, so at most 4,096
# arrivals apart, one labelled buffer (4096): ``beta`` lags its data by at most one turnover of the buffer it is fitted
# on. The per-turn rates, the offset ``beta`` corrects, move at every arrival, so a shift in how often sessions continue
# is followed at once; ``beta`` only says how the features move ``p`` around its turn's rate. Refits a quarter of a
# buffer apart (1,024 arrivals, the earlier bound) gave the same hits on the Mooncake traces made 4 and 16 times longer
# (within 0.3 points, both signs) with 23 fits where this bound makes 14 (mooncake_arxiv made 16 times longer;
# docs/saecache-real-traces.md, "Decision time"). The two schedules part only after 3,712 arrivals.
MAX_REFIT_GAP = 64


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


class ContinuationModel:
    """Online P(session continues after request i). See the module docstring.

    Args:
        features: fit the logistic correction (off: per-turn rates only).
        censoring: weigh a pending request by the posterior that its session is alive (off: count it as ended
            until its session comes back, as LPC counts).
        max_turn: turns at and beyond this one share a rate.
        prior: Beta pseudo-counts (continued, ended) of every turn's rate.
        horizon_sigmas: a session idle longer than ``exp(mu + horizon_sigmas * sigma)`` is taken as ended.
        end_below: a pending request whose session is alive with a posterior below this is taken as ended (module
            docstring; 0: the horizon alone; needs ``censoring``).
        l2: L2 penalty of the logistic correction (per coefficient).
        buffer: labelled requests (the most recent) the correction is fitted on.
        steps: EM steps (rates and soft labels) and Newton steps (correction) per refit, each refit starting from the
            previous one's rates and ``beta``: with few new labels between refits, fewer steps track the same fit
            at less cost (1: an online EM / Newton method).
        refit_growth: refit at an :meth:`update` offer only once the offers (the arrivals) have grown by this
            fraction since the last refit (module docstring; 0: at every offer).
        predictor: optional ``f(trace, i) -> (p_chat, p_agent)`` for first requests, used as a feature.
    """

    def __init__(self, *, features: bool = True, censoring: bool = True, max_turn: int = 8,
                 prior: tuple[float, float] = (1.0, 1.0), horizon_sigmas: float = 3.0, end_below: float = 0.01,
                 l2: float = 1.0, buffer: int = 4096, steps: int = 2, refit_growth: float = 0.0,
                 timed_refit: bool = True, predictor: Callable[[Trace, int], Sequence[float]] | None = None):
        if isinstance(max_turn, bool) or not isinstance(max_turn, int) or max_turn < 1:
            raise ValueError(f"continuation: max_turn must be an integer >= 1, got {max_turn!r}")
        if len(prior) != 2 or min(prior) <= 0:
            raise ValueError(f"continuation: prior must be two positive pseudo-counts, got {prior!r}")
        if not (horizon_sigmas > 0 and math.isfinite(horizon_sigmas)):
            raise ValueError(f"continuation: horizon_sigmas must be positive, got {horizon_sigmas!r}")
        if isinstance(end_below, bool) or not (isinstance(end_below, (int, float)) and 0 <= end_below < 0.5):
            raise ValueError(f"continuation: end_below must be a probability in [0, 0.5), got {end_below!r}")
        if not l2 > 0:
            raise ValueError(f"continuation: l2 must be positive, got {l2!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
            raise ValueError(f"continuation: steps must be an integer in [1, 100], got {steps!r}")
        if isinstance(refit_growth, bool) or not (isinstance(refit_growth, (int, float)) and 0 <= refit_growth <= 10):
            raise ValueError(f"continuation: refit_growth must be a number in [0, 10], got {refit_growth!r}")
        self.features = bool(features)
        self.censoring = bool(censoring)
        self.max_turn = max_turn
        self.prior = (float(prior[0]), float(prior[1]))
        self.horizon_sigmas = float(horizon_sigmas)
        self.end_below = float(end_below)
        self.l2 = float(l2)
        self.buffer = int(buffer)
        self.steps = steps
        self.refit_growth = float(refit_growth)
        self.timed_refit = bool(timed_refit)
        self.predictor = predictor
        self.beta = np.zeros(_N_FEATURES)
        k = max_turn + 1
        self._continued = [0.0] * k  # labelled requests by turn bucket: continued ...
        self._ended = [0.0] * k  # ... and ended (idle past the horizon)
        self._n_pending = [0] * k  # pending requests by turn bucket ...
        self._alive = [0.0] * k  # ... and the sum of their soft weights (posterior alive)
        self._rates = [self.prior[0] / sum(self.prior)] * k  # r_k by turn bucket (index 0 unused); see ``rates``
        # Pending requests (until labelled), in arrival order: request -> its arrival, and request -> its soft
        # weight (two dicts with the same keys: a refit replaces every weight in place, the arrivals stay).
        self._pend_t: dict[int, float] = {}
        self._pend_w: dict[int, float] = {}
        self._last_of: dict[int, int] = {}  # session (of known id) -> its latest request
        # The latest ``buffer`` labelled requests and their labels, oldest first, in the first ``_lab_n`` entries
        # (between ``buffer`` and twice as many are kept: trimmed in bulk). Arrays, which a refit reads without a
        # copy and the compiled arrivals (sae_env.fast_engine.arrivals) append to.
        self._lab_i = np.zeros(2 * self.buffer + 1, dtype=np.int64)
        self._lab_y = np.zeros(2 * self.buffer + 1)
        self._lab_n = 0
        self._offers = 0  # update offers so far (see update_due)
        self._next_refit = 1  # the offer at which the model refits next
        self._refit_t = math.nan  # the trace time of the last refit (NaN: none yet; see stale)
        self._trace: Trace | None = None

    # -- features ----------------------------------------------------------------------------------------------
    def bind(self, trace: Trace, sessions: array | None = None) -> None:
        """Per-request facts and features, each computed from the request and its session's earlier requests.
        ``sessions``: ``trace.session`` as a ``request_array`` of type "q", if the caller holds it already."""
        self._trace = trace
        n = len(trace)
        sid = trace.session_ids()
        # Per-request facts as array.array (read one at a time on the per-arrival path, as fast as a list and a few
        # bytes per request) with numpy views of the same memory for the refits.
        self._session = request_array(trace.session, "q") if sessions is None else sessions  # -1: unknown
        turn = np.maximum(trace.turn.astype(np.int64), 1)
        self._bucket = request_array(np.minimum(turn, self.max_turn), "b" if self.max_turn < 128 else "i")
        self._bucket_a = np.frombuffer(self._bucket, dtype=np.dtype(self._bucket.typecode))
        self._agent_a = trace.app == AppType.AGENT  # gaps of the agent queue (else chat)
        # The session's previous request, by a stable sort on session id (requests are in arrival order).
        order = np.lexsort((np.arange(n), sid))
        prev = np.full(n, -1, dtype=np.int64)
        same = sid[order[1:]] == sid[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
        self._prev = prev.astype(np.int32) if n < 2**31 else prev
        first_logit = None  # the session predictor's answer for first requests (a feature), asked once each
        if self.predictor is not None:
            prepare = getattr(self.predictor, "prepare", None)
            if prepare is not None:
                prepare(trace)
            first_logit = np.zeros(n)
            for i in np.flatnonzero(turn == 1).tolist():  # each answer reads request i alone
                first_logit[i] = self._predictor_logit(trace, i) / 5.0
        # Every request's feature row, computed here at once: each is a few elementwise operations on what the request
        # carries (what a server computes in O(1) at its arrival), and one pass over the whole trace costs less than
        # the same arithmetic a block of rows at a time inside the replay. 72 bytes a request: a tenth or less of what
        # the trace itself holds for it (8-byte keys of every prompt block). Without ``features`` none are used.
        self._z = self._compute_rows(first_logit) if self.features else np.zeros((n, _N_FEATURES))
        self._zb: np.ndarray | None = None  # z @ beta, recomputed after each fit
        self._zb_from = 0

    def feature_rows(self, idx: np.ndarray | slice) -> np.ndarray:
        """The feature rows ``z`` of requests ``idx`` (an index array or a slice), one row of ``_N_FEATURES``
        floats each, as a new array (computed at :meth:`bind`; a row is the same floats whichever rows are asked for
        together)."""
        if isinstance(idx, slice):
            return self._z[idx].copy()
        return np.take(self._z, idx, axis=0)  # the rows fancy indexing copies, at a quarter of its time

    @property
    def feature_table(self) -> np.ndarray:
        """Every request's feature row, the array :meth:`bind` computed (not a copy, 72 bytes a request: read it, do
        not write it); SAECache's compiled ``rebin`` reads the rows of the requests it asks about from it."""
        return self._z

    def _compute_rows(self, first_logit: np.ndarray | None) -> np.ndarray:
        """Every request's feature row (module docstring), ``first_logit`` the predictor's feature (None: 0)."""
        trace = self._trace
        n = len(trace)
        pt = trace.prompt_tokens
        prev = self._prev
        has_prev = prev >= 0
        before = np.maximum(prev, 0)
        p_prev = np.where(has_prev, pt[before], 0)
        gap = np.where(has_prev, trace.t - trace.t[before], 0.0)
        lengths = np.diff(trace.prompt_offsets)
        n_blocks = np.maximum(lengths, 1)
        # Blocks of each token-type group per request (user, assistant, tool output, system + template), in one
        # pass over the blocks: the token-type mix.
        req_of = np.repeat(np.arange(n, dtype=np.int64), lengths)
        counts = np.bincount(req_of * N_TOKEN_TYPES + trace.prompt_types, minlength=n * N_TOKEN_TYPES)
        counts = counts.reshape(n, N_TOKEN_TYPES)
        groups = [[TokenType.USER], [TokenType.ASSISTANT], [TokenType.TOOL_OUTPUT],
                  [TokenType.SYSTEM, TokenType.TEMPLATE]]
        type_counts = np.stack([counts[:, [int(t) for t in g]].sum(axis=1) for g in groups], axis=1)
        z = np.zeros((n, _N_FEATURES))
        z[:, 0] = np.log1p(pt) / 10.0
        z[:, 1] = np.log1p(np.maximum(pt - p_prev, 0)) / 10.0
        z[:, 2] = np.log1p(np.maximum(gap, 0.0)) / 10.0
        np.divide(type_counts, n_blocks[:, None], out=z[:, 3:7])
        z[:, 7] = self._agent_a
        if first_logit is not None:
            z[:, 8] = first_logit
        return z

    def fresh(self) -> ContinuationModel:
        """A model with the same options, bound to the same trace (its features shared, read-only), that has learned
        nothing yet: a copy to :meth:`import_state` into without computing the features again."""
        m = ContinuationModel(features=self.features, censoring=self.censoring, max_turn=self.max_turn,
                              prior=self.prior, horizon_sigmas=self.horizon_sigmas, end_below=self.end_below,
                              l2=self.l2, buffer=self.buffer, steps=self.steps, refit_growth=self.refit_growth,
                              timed_refit=self.timed_refit, predictor=self.predictor)
        if self._trace is not None:
            for name in ("_trace", "_session", "_bucket", "_bucket_a", "_agent_a", "_prev", "_z"):
                setattr(m, name, getattr(self, name))
            m._zb, m._zb_from = None, 0
        return m

    def _predictor_logit(self, trace: Trace, i: int) -> float:
        r = self.predictor(trace, i)
        p = float(r) if isinstance(r, (int, float)) else float(r[0]) + float(r[1])
        if not 0.0 <= p <= 1.0 + 1e-6:
            raise ValueError(f"continuation: the predictor gave {p!r} for request {i} (need a probability)")
        return _logit(min(max(p, P_CLIP), 1.0 - P_CLIP))

    @property
    def rates(self) -> np.ndarray:
        """The continuation rate ``r_k`` of each turn bucket (index 0 unused), as an array (a copy)."""
        return np.array(self._rates)

    # -- online use ------------------------------------------------------------------------------------------
    def arrive(self, i: int, now: float) -> float:
        """Request ``i`` arrived: its session's previous request is labelled continued; returns ``p_i``. (The
        compiled engine runs a copy of this, sae_env.fast_engine.arrivals.)"""
        s = self._session[i]
        j = self._last_of.get(s)
        if j is not None:
            w = self._pend_w.pop(j, None)
            if w is not None:  # j continued: pending -> labelled
                del self._pend_t[j]
                self._unpend(j, w)
                self._label(j, 1.0)
        if s >= 0:  # a request of unknown session (-1) has no next request to wait for
            self._last_of[s] = i
        k = self._bucket[i]
        w = self._rates[k] if self.censoring else 0.0  # a fresh request is alive with the prior probability
        self._pend_t[i] = now
        self._pend_w[i] = w
        self._n_pending[k] += 1
        self._alive[k] += w
        self._refresh_rate(k)
        return self.p(i)

    def _unpend(self, i: int, w: float) -> None:
        k = self._bucket[i]
        self._n_pending[k] -= 1
        self._alive[k] -= w

    def _refresh_rate(self, k: int) -> None:
        a, b = self.prior
        c, e = self._continued[k], self._ended[k]
        self._rates[k] = (c + self._alive[k] + a) / (c + e + self._n_pending[k] + a + b)

    def p(self, i: int) -> float:
        """The current model's continuation probability of request ``i``."""
        r = self._rates[self._bucket[i]]
        if not self.features:
            return float(r)
        zb = self._zb
        if zb is None or not (self._zb_from <= i < self._zb_from + zb.size):
            zb = self.zb_at(i)
        x = _logit(min(max(r, P_CLIP), 1.0 - P_CLIP)) + float(zb[i - self._zb_from])
        return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0

    def p_many(self, idx: np.ndarray) -> np.ndarray:
        """:meth:`p` of the requests ``idx`` at once (float64), without moving the block of ``z @ beta`` that
        :meth:`p` reads: SAECache's ``rebin`` asks about many scattered earlier requests at a time. ``z @ beta`` is
        summed feature by feature (elementwise, each step rounded as a scalar loop rounds it) and the logistic takes
        libm's ``log`` and ``exp`` one request at a time, so the compiled engine's copy (``_p_now`` in
        :mod:`sae_env.fast_engine.saecache`) gives the same floats from the same rates and ``beta``; a value may
        differ from :meth:`p`'s (a matrix product) in its last bits."""
        idx = np.asarray(idx, dtype=np.int64)
        r = np.asarray(self._rates)[self._bucket_a[idx]]
        if not self.features:
            return r
        z, beta = self.feature_rows(idx), self.beta
        zb = z[:, 0] * beta[0]
        for j in range(1, z.shape[1]):
            zb += z[:, j] * beta[j]
        r = np.clip(r, P_CLIP, 1.0 - P_CLIP)
        log, exp = math.log, math.exp
        return np.array([1.0 / (1.0 + exp(-max(log(a / (1.0 - a)) + b, -700.0)))
                         for a, b in zip(r.tolist(), zb.tolist(), strict=True)], dtype=np.float64)

    def zb_at(self, i: int) -> np.ndarray:
        """``z @ beta`` of the block of requests from ``i`` (1024 of them, fewer at the trace's end), kept for
        :meth:`p` until a fit or a request outside it: computed a block at a time, as the same floats whatever
        asks (the compiled arrivals too)."""
        self._zb_from = i
        self._zb = self.feature_rows(slice(i, i + 1024)) @ self.beta
        return self._zb

    def _label(self, i: int, y: float) -> None:
        k = self._bucket[i]
        if y:
            self._continued[k] += 1
        else:
            self._ended[k] += 1
        self._refresh_rate(k)
        self._record(i, y)

    def _record(self, i: int, y: float) -> None:
        """Request ``i`` got label ``y``: the refits' buffer keeps it."""
        n = self._lab_n
        self._lab_i[n] = i
        self._lab_y[n] = y
        n += 1
        if n > 2 * self.buffer:  # keep the latest ``buffer``
            self._lab_i[:self.buffer] = self._lab_i[n - self.buffer:n]
            self._lab_y[:self.buffer] = self._lab_y[n - self.buffer:n]
            n = self.buffer
        self._lab_n = n

    def _record_many(self, idx: np.ndarray, y: float) -> None:
        """``_record(i, y)`` of each of ``idx`` in turn: the buffer then holds the latest entries, as many as the
        one-at-a-time truncation leaves."""
        n, m, keep = self._lab_n, idx.size, self.buffer
        first = 2 * keep + 1 - n  # entries until the first truncation to ``keep``
        final = n + m if m < first else keep + (m - first) % (keep + 1)
        old = max(final - m, 0)  # entries of the buffer that stay
        if old and old != n:
            self._lab_i[:old] = self._lab_i[n - old:n]
            self._lab_y[:old] = self._lab_y[n - old:n]
        self._lab_i[old:final] = idx[m - (final - old):]
        self._lab_y[old:final] = y
        self._lab_n = final

    def update_due(self) -> bool:
        """An update is offered (the policy's every ``REFIT_EVERY`` arrivals): counts the offer and says whether the
        model refits at it (:meth:`update_pending`), by the schedule of ``refit_growth`` (module docstring). The
        compiled arrivals (:mod:`sae_env.fast_engine.arrivals`) count the offers by the same rule and hand the count
        back with the rest of the state."""
        self._offers += 1
        if self._offers < self._next_refit:
            return False
        self._next_refit = self._offers + max(1, min(MAX_REFIT_GAP, int(self._offers * self.refit_growth)))
        return True

    def stale_after(self, gaps: Sequence[LognormalGaps]) -> float:
        """How long after its last refit the model is :meth:`stale` (infinite without ``timed_refit``)."""
        return math.exp(gaps[0].mu) if self.timed_refit else math.inf

    def stale(self, now: float, gaps: Sequence[LognormalGaps]) -> bool:
        """Whether the last refit (or refresh) lies more than :meth:`stale_after` back at ``now`` (never before the
        first refit): the model then refreshes at this arrival unless an update offer makes a refit due (module
        docstring)."""
        return now - self._refit_t > self.stale_after(gaps)  # False while _refit_t is NaN

    @property
    def last_refit(self) -> float:
        """The trace time of the last refit or refresh (NaN: none yet)."""
        return self._refit_t

    def update(self, now: float, gaps: Sequence[LognormalGaps], offer: bool = True) -> None:
        """An arrival at ``now``, an update offer if ``offer``: when the offer is due (:meth:`update_due`), label
        sessions idle past the horizon as ended, then refit the rates and the correction; when it is not but the
        model is :meth:`stale`, the same without the correction (a refresh).

        ``gaps[q]`` is the gap distribution of queue ``q`` (0: chat, 1: agent)."""
        due = offer and self.update_due()
        if not due and not self.stale(now, gaps):
            return
        pend_t, pend_w = self._pend_t, self._pend_w
        n = len(pend_t)
        pend = np.fromiter(pend_t.keys(), dtype=np.int64, count=n)
        t_pend = np.fromiter(pend_t.values(), dtype=np.float64, count=n)
        w_pend = np.fromiter(pend_w.values(), dtype=np.float64, count=n)
        keep, soft = self.update_pending(now, gaps, pend, t_pend, w_pend, fit=due)
        for i in pend[~keep].tolist():
            del pend_t[i], pend_w[i]
        pend_w.update(zip(pend[keep].tolist(), soft.tolist(), strict=True))  # the same keys: only the weights change

    def _fit(self, pend: np.ndarray, surv: np.ndarray, rates: np.ndarray) -> None:
        n_lab = min(self._lab_n, self.buffer)
        idx = np.empty(n_lab + pend.size, dtype=np.int64)
        y = np.zeros(idx.size)
        idx[:n_lab] = self._lab_i[self._lab_n - n_lab:self._lab_n]
        y[:n_lab] = self._lab_y[self._lab_n - n_lab:self._lab_n]
        idx[n_lab:] = pend
        z = self.feature_rows(idx)
        r = np.clip(rates, P_CLIP, 1.0 - P_CLIP)
        offset = np.log(r / (1.0 - r))[self._bucket_a[idx]]  # per turn bucket, then per row: the same floats
        beta = self.beta
        ridge = self.l2 * np.eye(_N_FEATURES)
        for _ in range(self.steps):
            p = 1.0 / (1.0 + np.exp(-np.clip(offset + z @ beta, -700, 700)))
            if pend.size and self.censoring:  # soft labels: the posterior that the pending session is alive
                pp = p[n_lab:]
                y[n_lab:] = pp * surv / np.maximum(1.0 - pp + pp * surv, 1e-300)
            grad = z.T @ (p - y) + self.l2 * beta
            hess = (z * (p * (1.0 - p))[:, None]).T @ z + ridge
            beta = beta - np.linalg.solve(hess, grad)
        self.beta = beta
        self._zb = None

    # -- for a compiled copy of arrive() (sae_env.fast_engine.arrivals) ------------------------------------------
    # It keeps the pending requests and the sessions' latest requests itself (taken and given back through the
    # state contract) and hands the counts over at each refit.
    @property
    def turn_buckets(self) -> np.ndarray:
        """Each request's turn bucket (read-only view)."""
        return self._bucket_a

    @property
    def agent_flags(self) -> np.ndarray:
        """Whether each request's gaps are the agent queue's (else the chat queue's): bool, read-only view."""
        return self._agent_a

    def horizons(self, gaps: Sequence[LognormalGaps]) -> tuple[float, float]:
        """The idle time past which a pending request of the chat, of the agent queue counts as ended."""
        return gaps[0].upper(self.horizon_sigmas), gaps[1].upper(self.horizon_sigmas)

    @property
    def zb_block_start(self) -> int:
        """The first request of the block of ``z @ beta`` that :meth:`p` reads (-1: none, computed when asked)."""
        return -1 if self._zb is None else self._zb_from

    @property
    def labelled_buffer(self) -> tuple[np.ndarray, np.ndarray]:
        """The labelled buffer's arrays (requests, labels; ``counts`` says how many entries are used): the model's
        own, which a compiled copy of :meth:`arrive` appends to in place (ask again after an ``import_state``)."""
        return self._lab_i, self._lab_y

    def counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """The per-turn counts (rates, alive, continued, ended: float64; pending: int64), as copies, and the
        labelled buffer's length."""
        return (np.array(self._rates), np.array(self._alive, dtype=np.float64), np.array(self._continued),
                np.array(self._ended), np.array(self._n_pending, dtype=np.int64), self._lab_n)

    def set_counts(self, rates: np.ndarray, alive: np.ndarray, continued: np.ndarray, ended: np.ndarray,
                   n_pending: np.ndarray, lab_n: int, last_refit: float) -> None:
        """Take back what :meth:`counts` gave, as a compiled copy of :meth:`arrive` left it, with the time of the
        last refit or refresh (:attr:`last_refit`: a compiled copy may settle the pending requests itself)."""
        self._rates, self._alive = rates.tolist(), alive.tolist()
        self._continued, self._ended, self._n_pending = continued.tolist(), ended.tolist(), n_pending.tolist()
        self._lab_n = int(lab_n)
        self._refit_t = float(last_refit)

    def update_pending(self, now: float, gaps: Sequence[LognormalGaps], pend: np.ndarray, t_pend: np.ndarray,
                       w_pend: np.ndarray, fit: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`update` for a caller that keeps the pending requests ``pend`` (arrived at ``t_pend``, soft weights
        ``w_pend``, in arrival order) itself, once :meth:`update_due` said so (``fit``: a refit) or :meth:`stale`
        did (a refresh): the requests that ended are labelled, the rest's soft weights and the rates refitted
        (:func:`~sae_env.policies.continuation_refit.settle_numpy`), then with ``fit`` the correction. Returns which
        stay pending and their new soft weights."""
        counts = np.array([self._rates, self._alive, self._continued, self._ended], dtype=np.float64)
        n_pend = np.array(self._n_pending, dtype=np.int64)
        idle = now - t_pend
        agent = self._agent_a[pend]
        bucket = self._bucket_a[pend]
        if agent.any():  # each request's survival under its own queue's gaps, computed once
            surv = np.empty(idle.size)
            surv[~agent] = gaps[0].sf_array(idle[~agent])
            surv[agent] = gaps[1].sf_array(idle[agent])
        else:
            surv = gaps[0].sf_array(idle)
        keep, soft = settle_numpy(idle, surv, w_pend, agent, bucket, self.horizons(gaps), counts, n_pend, self.prior,
                                  self.end_below, self.censoring, self.steps)
        self.set_counts(*counts, n_pend, self._lab_n, now)
        if soft.size < pend.size:
            self._record_many(pend[~keep], 0.0)
            pend, surv = pend[keep], surv[keep]
        if fit:
            self.fit_settled(now, pend, surv, counts[RATES], self._lab_n)
        return keep, soft

    def fit_settled(self, now: float, pend: np.ndarray, surv: np.ndarray, rates: np.ndarray, lab_n: int) -> None:
        """The end of a refit at ``now`` once its pending requests are settled (by :meth:`update_pending`, or by a
        compiled copy of it): ``beta`` fitted on the labelled buffer's first ``lab_n`` entries and the requests
        ``pend`` still pending (their gap survival ``surv``), with the per-turn ``rates`` as the offset."""
        self._refit_t = now
        self._lab_n = int(lab_n)
        if self.features and (self._lab_n or pend.size):
            self._fit(pend, surv, rates)

    @property
    def labelled_count(self) -> int:
        """Entries of the labelled buffer in use."""
        return self._lab_n

    # -- the state contract (sae_env.state): everything but what bind() derives from the trace ---------------
    def export_state(self) -> dict[str, object]:
        pend_t, pend_w = self._pend_t, self._pend_w
        return {"beta": self.beta.copy(), "rates": self.rates, "continued": np.array(self._continued),
                "ended": np.array(self._ended), "n_pending": np.array(self._n_pending, dtype=np.int64),
                "alive": np.array(self._alive, dtype=np.float64),
                "pending": np.fromiter(pend_t.keys(), dtype=np.int64, count=len(pend_t)),
                "pending_t": np.fromiter(pend_t.values(), dtype=np.float64, count=len(pend_t)),
                "pending_w": np.fromiter(pend_w.values(), dtype=np.float64, count=len(pend_w)),
                "last_sessions": np.fromiter(self._last_of.keys(), dtype=np.int64, count=len(self._last_of)),
                "last_requests": np.fromiter(self._last_of.values(), dtype=np.int64, count=len(self._last_of)),
                "labelled": self._lab_i[:self._lab_n].copy(), "labels": self._lab_y[:self._lab_n].copy(),
                # p() reads z @ beta computed over a block of rows from here: the same block, the same floats
                "zb_from": self.zb_block_start, "offers": self._offers, "next_refit": self._next_refit,
                "refit_t": self._refit_t}

    def import_state(self, state: dict[str, object]) -> None:
        """Take back an exported state; :meth:`bind` must have been called with the same trace."""
        self.beta = np.array(state["beta"], dtype=np.float64)
        self._rates = np.asarray(state["rates"], dtype=np.float64).tolist()
        self._continued, self._ended = state["continued"].tolist(), state["ended"].tolist()
        self._n_pending, self._alive = state["n_pending"].tolist(), state["alive"].tolist()
        pending = state["pending"].tolist()
        self._pend_t = dict(zip(pending, state["pending_t"].tolist(), strict=True))
        self._pend_w = dict(zip(pending, state["pending_w"].tolist(), strict=True))
        self._last_of = dict(zip(state["last_sessions"].tolist(), state["last_requests"].tolist(), strict=True))
        lab_i, lab_y = np.asarray(state["labelled"], dtype=np.int64), np.asarray(state["labels"], dtype=np.float64)
        self._lab_n = lab_i.size
        self._lab_i = np.zeros(max(2 * self.buffer, lab_i.size) + 1, dtype=np.int64)
        self._lab_y = np.zeros(self._lab_i.size)
        self._lab_i[:lab_i.size], self._lab_y[:lab_y.size] = lab_i, lab_y
        self._offers, self._next_refit = int(state["offers"]), int(state["next_refit"])
        self._refit_t = float(state["refit_t"])
        zb_from = int(state["zb_from"])
        self._zb, self._zb_from = None, 0
        if zb_from >= 0:
            self.zb_at(zb_from)

    def stats(self) -> dict[str, object]:
        return {"rates": self.rates[1:].tolist(), "beta": self.beta.tolist(), "pending": int(sum(self._n_pending)),
                "labelled": int(sum(self._continued) + sum(self._ended))}
