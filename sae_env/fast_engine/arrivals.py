"""Compiled twin of SAECache's arrivals (:meth:`~sae_env.policies.arrivals.Arrivals.arrive` with the continuation
model's ``arrive`` and ``p``): a window's requests in one call, the same floats in the same order.

The continuation model's refits (at the update offers, every ``REFIT_EVERY`` arrivals, that its ``refit_growth``
schedule makes due, counted here as the model counts them) and refreshes (at an arrival where its last refit lies
more than its ``stale_after`` back) settle the pending requests here too: their gap survival (libm's ``log`` and
``erfc``, as :meth:`~sae_env.policies.survival.LognormalGaps.sf_array`), the ended ones labelled and the rates' EM
steps (``settle_loops`` of :mod:`sae_env.policies.continuation_refit`, the same floats as the Python model's numpy
form). What stays in Python is what numpy's BLAS computes: a refit's Newton steps of the correction ``beta`` and the
block of ``z @ beta`` that ``p`` reads (1024 requests at a time). :func:`run` stops at the request that needs one of
them, :class:`CompiledArrivals` does it through the Python model's own methods, and the loop goes on from there.

The per-arrival state lives here while the compiled engine holds the replay, as arrays, taken from the Python
objects through the state contract (``export_state``) and given back the same way (``import_state``); the Python
side offers only public hand-over methods (``Arrivals.routes``, the model's ``counts`` / ``set_counts`` /
``agent_flags`` / ``horizons`` / ``fit_settled`` / ``labelled_buffer`` / ``labelled_count`` / ``zb_at``):

* sessions by dense id (this trace's session ids, sorted): the last arrival and its queue, the latest request, each
  with its place in the Python dict's insertion order (the exported state lists them in that order); the entries of
  sessions that this trace does not hold are kept aside and given back unchanged;
* the pending requests in arrival order, i.e. by increasing request index: a request is found by binary search,
  and one that got its label has a NaN weight until the next refit compacts the arrays;
* the per-turn counts and rates, the labelled buffer and the shared prefixes' last uses (the Python objects' own
  arrays, updated in place), the gap statistics and the shared prefixes' counts.

SAECache's ``rebin`` trigger (arrivals.model_moved) is checked here too, at the refits that may rebin, so that the
window's arrivals run in one call and stop only where the model has moved (:meth:`CompiledArrivals.set_rebin`).

Why one piece (~540 lines): the kernel, its inlined helpers and :class:`CompiledArrivals`, which builds the state
from the Python objects and gives it back, all read one packed layout (the index constants below: rows of shared
arrays, slots of the scalar arrays). Split apart, that layout would be shared by name across modules, and each
field added to it (the rebin trigger's were the last) would touch all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from sae_env.fast_engine.jit import borrow, inline, jit
from sae_env.policies.arrivals import AG, CH, LOGIT_BIN, LOGIT_MAX, PE, REFIT_EVERY, ST, Arrivals
from sae_env.policies.continuation import MAX_REFIT_GAP, P_CLIP
from sae_env.policies.continuation_refit import settle_loops
from sae_env.policies.survival import LognormalGaps

__all__ = ["CompiledArrivals"]

DONE, FIT_DUE, NEED_ZB, NEED_ROOM, REBIN_DUE = range(5)  # why run() returned
# Integer scalars: arrivals so far, shared-prefix uses and reuses, pending entries, labelled entries, the z @ beta
# block's first request and length, whether the update offer at the next arrival was counted (run() may stop there
# more than once), the next insertion rank of the sessions' dict and of the model's latest-request dict, and the
# model's refit schedule: update offers so far, the offer it refits at next (ContinuationModel.update_due).
ARRIVALS, PREFIX_USES, PREFIX_REUSED, PQ_N, LAB_N, ZB_FROM, ZB_LEN, REFIT_DONE, SESS_NEXT, LAST_NEXT, OFFERS, \
    NEXT_REFIT = range(12)
# Float scalars: the structural continuation rate, the model's last refit (NaN: none yet) and how long after it
# the model is stale (ContinuationModel.stale_after, set by CompiledArrivals.run: the gaps move between windows).
P_ST, REFIT_T, STALE_AFTER = range(3)
# Options, after the integer scalars: a continuation model, the hit density, PE routing, multi_queue, censoring,
# features, buffer, the model's EM steps; after the float scalars: continue_threshold, the prior's two pseudo-counts,
# refit_growth, end_below, then what the settling reads of the gaps (set by CompiledArrivals.run, as the gaps move
# between windows): each queue's log-normal mu and sigma * sqrt 2, and its horizon.
HAS_MODEL, DENSITY, PE_ROUTING, MULTI, CENSORING, FEATURES, BUFFER, STEPS = range(12, 20)
THRESHOLD, PRIOR_A, PRIOR_B, GROWTH, END_BELOW, MU_CH, S2_CH, MU_AG, S2_AG, HORIZON_CH, HORIZON_AG = range(3, 14)
# SAECache's rebin trigger (CompiledArrivals.set_rebin; 0: off), after the options: check every this many refits,
# fire at the next check (none yet, or beta refitted since the last rebinning), fire at any move of a rate; and the
# odds-ratio bound of a rate's move (arrivals.model_moved).
REBIN_EVERY, REBIN_FIRE, REBIN_ANY, REBIN_BOUND = 20, 21, 22, 14
# Packed rows (a kernel loads and unboxes every array of its state tuple: each costs ~55 us at a process's first
# replay, so fields of one length and type share an array). Per turn bucket (float64): the continuation rate, the
# pending requests' soft weights summed, the continued and the ended counts; the rates at the last rebinning.
RATES, ALIVE, CONTINUED, ENDED, REBIN_LAST = range(5)
# Per session (int64): its place in the Python dict's order (insertion order), its latest request (-1: none) and
# that entry's place in the model's dict, the queue of its last arrival.
S_RANK, S_LAST, S_LAST_RANK, S_QUEUE = range(4)
# Per pending request (float64): its arrival, its soft weight (NaN: labelled since the refit), its gap survival at the
# kernel's last settling (what a fit after it reads).
PQ_T, PQ_W, PQ_S = range(3)
REFIT, STRUCTURAL = 1, 2  # request flags, as the compiled SAECache reads them


class ArrivalState(NamedTuple):
    queue_of: np.ndarray  # int8 per request: its queue by routing
    session: np.ndarray  # int32 (int64 past 2**31 sessions) per request: its dense session id (-1: unknown)
    prefix_of: np.ndarray  # int32 per request: its shared prefix (-1: none)
    bucket: np.ndarray  # int per request: its turn bucket
    agent: np.ndarray  # bool per request: its gaps are the agent queue's (else chat's), as the model has it
    sess_t: np.ndarray  # float64 per session: its last arrival (NaN: none yet)
    sess: np.ndarray  # int64 [S_*, session]
    prefix_last: np.ndarray  # float64 per shared prefix: its last use (NaN: none), Arrivals' own array
    gap: np.ndarray  # float64 [queue, (n, sum ln gap, sum ln^2 gap)]
    pq_req: np.ndarray  # int64: pending requests, increasing ...
    pq: np.ndarray  # float64 [PQ_T | PQ_W | PQ_S, pending] ... their arrivals, soft weights, survivals
    counts: np.ndarray  # float64 [RATES | ALIVE | CONTINUED | ENDED | REBIN_LAST, turn bucket]
    n_pending: np.ndarray  # int64 per turn bucket
    lab_i: np.ndarray  # int64: the model's labelled requests ...
    lab_y: np.ndarray  # float64 ... and their labels
    zb: np.ndarray  # float64: z @ beta of requests ZB_FROM .. ZB_FROM + ZB_LEN - 1
    ai: np.ndarray  # int64 scalars, then options (above)
    af: np.ndarray  # float64 scalars, then options


# The helpers are inlined into run(), which borrows the state: a call that passes the state tuple copies its arrays'
# descriptors (26 then) and counts a reference per field read (together 1.5 ms of a 4,000-request replay).
@inline
def _find(keys, n, x):
    """The position of ``x`` among the increasing ``keys[:n]``, or -1."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < n and keys[lo] == x else -1


@inline
def _record(st, j, y):
    """ContinuationModel._record."""
    ai = st.ai
    n = ai[LAB_N]
    st.lab_i[n] = j
    st.lab_y[n] = y
    n += 1
    buffer = st.ai[BUFFER]
    if n > 2 * buffer:
        for m in range(buffer):
            st.lab_i[m] = st.lab_i[n - buffer + m]
            st.lab_y[m] = st.lab_y[n - buffer + m]
        n = buffer
    ai[LAB_N] = n


@inline
def _model_arrive(st, i, now):
    """ContinuationModel.arrive (with p): returns p_i."""
    ai, af, sess, pq, cn, n_pending = st.ai, st.af, st.sess, st.pq, st.counts, st.n_pending
    a, b = af[PRIOR_A], af[PRIOR_B]
    s = st.session[i]
    if s >= 0:
        j = sess[S_LAST, s]
        if j < 0:
            sess[S_LAST_RANK, s] = ai[LAST_NEXT]
            ai[LAST_NEXT] += 1
        else:
            pos = _find(st.pq_req, ai[PQ_N], j)
            if pos >= 0 and pq[PQ_W, pos] == pq[PQ_W, pos]:  # still pending: labelled continued
                w = pq[PQ_W, pos]
                pq[PQ_W, pos] = np.nan
                k = st.bucket[j]
                n_pending[k] -= 1
                cn[ALIVE, k] -= w
                c = cn[CONTINUED, k] + 1
                cn[CONTINUED, k] = c
                cn[RATES, k] = (c + cn[ALIVE, k] + a) / (c + cn[ENDED, k] + n_pending[k] + a + b)
                _record(st, j, 1.0)
        sess[S_LAST, s] = i
    k = st.bucket[i]
    w = cn[RATES, k] if ai[CENSORING] else 0.0
    n = ai[PQ_N]
    st.pq_req[n] = i
    pq[PQ_T, n] = now
    pq[PQ_W, n] = w
    ai[PQ_N] = n + 1
    n_pending[k] += 1
    cn[ALIVE, k] += w
    c = cn[CONTINUED, k]
    r = (c + cn[ALIVE, k] + a) / (c + cn[ENDED, k] + n_pending[k] + a + b)
    cn[RATES, k] = r
    if not ai[FEATURES]:
        return r
    if P_CLIP <= r <= 1.0 - P_CLIP:
        x = math.log(r / (1.0 - r))
    else:
        rc = min(max(r, P_CLIP), 1.0 - P_CLIP)
        x = math.log(rc / (1.0 - rc))
    x += st.zb[i - ai[ZB_FROM]]
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


@inline
def _settle(st, now):
    """ContinuationModel.update_pending up to its fit, on LognormalGaps: the pending requests' survival (libm's log and
    erfc, as LognormalGaps.sf_array), settle_loops, the ended ones recorded in arrival order (_record_many: one
    _record after another); the kept ones stay, compacted, with their new weights and survivals."""
    ai, af, pq, pq_req = st.ai, st.af, st.pq, st.pq_req
    n = ai[PQ_N]
    idle, surv = np.empty(n), np.empty(n)
    agent, bucket = np.empty(n, dtype=np.bool_), np.empty(n, dtype=st.bucket.dtype)
    m = 0
    for j in range(n):
        w = pq[PQ_W, j]
        if w != w:  # labelled continued since the last settling
            continue
        r, dt = pq_req[j], now - pq[PQ_T, j]
        pq_req[m], pq[PQ_T, m], pq[PQ_W, m] = r, pq[PQ_T, j], w
        ag = st.agent[r]
        idle[m], agent[m], bucket[m] = dt, ag, st.bucket[r]
        mu, s2 = (af[MU_AG], af[S2_AG]) if ag else (af[MU_CH], af[S2_CH])
        surv[m] = 0.5 * math.erfc((math.log(dt) - mu) / s2) if dt > 0.0 else 1.0
        m += 1
    keep, soft = np.empty(m, dtype=np.bool_), np.empty(m)
    settle_loops(idle[:m], surv[:m], pq[PQ_W, :m], agent[:m], bucket[:m], af[HORIZON_CH], af[HORIZON_AG], st.counts,
                 st.n_pending, af[PRIOR_A], af[PRIOR_B], af[END_BELOW], ai[CENSORING] != 0, ai[STEPS], keep, soft)
    k = 0
    for j in range(m):
        if keep[j]:
            pq_req[k], pq[PQ_T, k], pq[PQ_W, k], pq[PQ_S, k] = pq_req[j], pq[PQ_T, j], soft[k], surv[j]
            k += 1
        else:
            _record(st, pq_req[j], 0.0)
    ai[PQ_N] = k
    af[REFIT_T] = now


@inline
def slot_of(p):
    """sae_env.policies.arrivals.slot_of, compiled (the same libm: the same bins)."""
    if 0.0 < p < 1.0:
        x = math.log(p / (1.0 - p))
    else:
        x = LOGIT_MAX if p >= 1.0 else -LOGIT_MAX
    x = min(max(x, -LOGIT_MAX), LOGIT_MAX)
    return 1 + int(round((x + LOGIT_MAX) / LOGIT_BIN))


@inline
def _moved(st):
    """sae_env.policies.arrivals.model_moved on the kernel's rates, the same floats; its beta part (beta moves only
    at a fit, in Python) is REBIN_FIRE."""
    if st.ai[REBIN_FIRE]:
        return True
    cn, bound = st.counts, st.af[REBIN_BOUND]
    for k in range(1, cn.shape[1]):
        a, b = min(max(cn[RATES, k], P_CLIP), 1.0 - P_CLIP), min(max(cn[REBIN_LAST, k], P_CLIP), 1.0 - P_CLIP)
        if a == b:
            continue
        if st.ai[REBIN_ANY]:
            return True
        ratio = a * (1.0 - b) / (b * (1.0 - a))
        if ratio > bound or ratio * bound < 1.0:
            return True
    return False


@inline
def _add_gap(gap, q, dt):
    lg = math.log(dt)
    gap[q, 0] += 1.0
    gap[q, 1] += lg
    gap[q, 2] += lg * lg


@jit
def run(st, i0, i1, times, out_q, out_slot, out_flags, out_pst):
    """Arrivals.arrive for requests ``i0 .. i1-1`` (arriving at ``times[i]``): their queue, continuation bin, flags
    and structural rate in ``out_*[i]``. Returns ``(i, why)``: ``i`` the request it stopped at (``i1``: DONE), before
    anything else of it was done, to have the fit of a due refit run once its pending requests are settled here
    (FIT_DUE), its z @ beta block computed (NEED_ZB) or the pending arrays grown (NEED_ROOM). A refresh (the model
    stale) is settled here too, and needs nothing of Python."""
    st = borrow(st)  # no reference counting inside (jit.borrow says why)
    ai = st.ai
    has_model, density = ai[HAS_MODEL], ai[DENSITY]
    for i in range(i0, i1):
        now = times[i]
        nxt = ai[ARRIVALS] + 1
        refit = (density or has_model) and nxt % REFIT_EVERY == 0
        if has_model:
            if refit and not ai[REFIT_DONE]:  # an update offer, counted once whatever stops follow
                ai[REFIT_DONE] = 1
                o = ai[OFFERS] + 1
                ai[OFFERS] = o
                if o >= ai[NEXT_REFIT]:  # ContinuationModel.update_due
                    ai[NEXT_REFIT] = o + max(1, min(MAX_REFIT_GAP, int(o * st.af[GROWTH])))
                    _settle(st, now)
                    return i, FIT_DUE
            if now - st.af[REFIT_T] > st.af[STALE_AFTER]:  # ContinuationModel.stale (False while REFIT_T is NaN)
                _settle(st, now)  # a refresh
            if ai[FEATURES] and not (ai[ZB_FROM] <= i < ai[ZB_FROM] + ai[ZB_LEN]):
                return i, NEED_ZB
            if ai[PQ_N] == st.pq_req.size:
                return i, NEED_ROOM
        ai[REFIT_DONE] = 0
        ai[ARRIVALS] = nxt
        q = st.queue_of[i]
        slot = 0
        if has_model:
            p = _model_arrive(st, i, now)
            if ai[PE_ROUTING] and ai[MULTI] and p < st.af[THRESHOLD]:
                q = PE
            if density:
                slot = slot_of(p)
        s = st.session[i]
        if s >= 0:
            last = st.sess_t[s]
            if last != last:  # a new entry of the sessions' dict
                st.sess[S_RANK, s] = ai[SESS_NEXT]
                ai[SESS_NEXT] += 1
            elif q == CH or q == AG:
                gap = now - last
                if gap > 0:
                    _add_gap(st.gap, q, gap)
            st.sess_t[s] = now
            st.sess[S_QUEUE, s] = q
        structural = 0
        if density:
            key = st.prefix_of[i]
            if key >= 0:
                structural = STRUCTURAL
                ai[PREFIX_USES] += 1
                last_use = st.prefix_last[key]
                if last_use == last_use:
                    ai[PREFIX_REUSED] += 1
                    if now > last_use:
                        _add_gap(st.gap, ST, now - last_use)
                st.prefix_last[key] = now
                st.af[P_ST] = (ai[PREFIX_REUSED] + 1.0) / (ai[PREFIX_USES] + 2.0)
        out_q[i] = q
        out_slot[i] = slot
        out_flags[i] = (REFIT if refit else 0) + structural
        out_pst[i] = st.af[P_ST]
        if refit and ai[REBIN_EVERY] and nxt % (REFIT_EVERY * ai[REBIN_EVERY]) == 0 and _moved(st):
            return i + 1, REBIN_DUE  # a rebinning at request i: its model is kept in Python (set_rebin)
    return i1, DONE


def _split(ids: np.ndarray, known: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Map ``ids`` (a dict's keys) onto the sorted ``known`` ids: (positions among them, which are there, the indices
    of the others)."""
    at = np.minimum(np.searchsorted(known, ids), max(known.size - 1, 0))
    found = known[at] == ids if known.size else np.zeros(ids.size, dtype=bool)
    return at, found, np.flatnonzero(~found).tolist()


class CompiledArrivals:
    """An :class:`~sae_env.policies.arrivals.Arrivals` (bound to a trace) whose per-arrival state moved into an
    :class:`ArrivalState`, taken through the state contract (``export_state``); :meth:`save` gives it back
    (``import_state``). The kernel settles the continuation model's refits and refreshes on the counts held here,
    and the model fits ``beta`` after them (``fit_settled``); the labelled buffer is the model's own arrays."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        model = arrivals.model
        state = arrivals.export_state()
        sid = np.asarray(arrivals.trace.session, dtype=np.int64)
        known = sid >= 0
        self.ids, dense = np.unique(sid[known], return_inverse=True)
        session = np.full(sid.size, -1, dtype=np.int32 if self.ids.size < 2**31 else np.int64)  # 4 bytes a request
        session[known] = dense
        ns = self.ids.size
        # Sessions: the last arrival and its queue (the arrivals' dict), the latest request (the model's dict), each
        # with its place in its dict's order; the entries of sessions this trace does not hold are kept aside.
        sess_t, sess = np.full(ns, np.nan), np.zeros((4, ns), dtype=np.int64)
        sess[S_LAST] = -1
        ids = state["session_ids"]
        at, found, other = _split(ids, self.ids)
        sess_t[at[found]] = state["session_last"][found]
        sess[S_QUEUE, at[found]] = state["session_queue"][found]
        sess[S_RANK, at[found]] = np.flatnonzero(found)
        self._other_sessions = [(k, int(ids[k]), float(state["session_last"][k]), int(state["session_queue"][k]))
                                for k in other]  # (rank, id, last arrival, queue)
        queue_of, prefix_of, prefix_last = arrivals.routes()
        self._other_last: list[tuple[int, int, int]] = []
        n_last = 0
        gap = np.zeros((4, 3))
        gap[[CH, AG, ST]] = state["gap_stats"]
        if model is not None:
            lids, lreq = state["model_last_sessions"], state["model_last_requests"]
            at, found, other = _split(lids, self.ids)
            sess[S_LAST, at[found]] = lreq[found]
            sess[S_LAST_RANK, at[found]] = np.flatnonzero(found)
            self._other_last = [(j, int(lids[j]), int(lreq[j])) for j in other]
            n_last = lids.size
            pend = state["model_pending"]
            if pend.size > 1 and not np.all(np.diff(pend) > 0):
                raise ValueError("compiled arrivals: pending requests out of arrival order")
            cap = max(2 * pend.size, 1024)
            pq_req, pq = np.zeros(cap, dtype=np.int64), np.zeros((3, cap))
            pq_req[:pend.size], pq[PQ_T, :pend.size], pq[PQ_W, :pend.size] = pend, state["model_pending_t"], \
                state["model_pending_w"]
            *counts, n_pending, lab_n = model.counts()
            counts = np.array(counts + [np.zeros(counts[0].size)])
            lab_i, lab_y = model.labelled_buffer
            zb = np.zeros(1024)
            zb_from, zb_len = 0, 0
            if state["model_zb_from"] >= 0:
                zb_from = int(state["model_zb_from"])
                block = model.zb_at(zb_from)  # the block p() reads now: the same floats
                zb_len = block.size
                zb[:zb_len] = block
            bucket, agent, prior = model.turn_buckets, model.agent_flags, model.prior
            censoring, features, buffer = model.censoring, model.features, model.buffer
            offers, next_refit, growth = int(state["model_offers"]), int(state["model_next_refit"]), model.refit_growth
            refit_t = model.last_refit
        else:
            pq_req, pq, counts = np.zeros(1, dtype=np.int64), np.zeros((3, 1)), np.zeros((5, 1))
            n_pending, lab_n = np.zeros(1, dtype=np.int64), 0
            lab_i, lab_y, zb = np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1)
            zb_from = zb_len = 0
            bucket, agent = np.zeros(1, dtype=np.int8), np.zeros(1, dtype=np.bool_)
            prior, censoring, features, buffer = (1.0, 1.0), False, False, 1
            offers, next_refit, growth = 0, 1, 0.0
            refit_t = math.nan
        ai = np.array([state["arrivals"], state["prefix_uses"], state["prefix_reused"],
                       pend.size if model is not None else 0, lab_n, zb_from, zb_len, 0, ids.size, n_last, offers,
                       next_refit, model is not None, arrivals.density, arrivals.pe_routing, arrivals.multi_queue,
                       censoring, features, buffer, model.steps if model is not None else 0, 0, 1, 0], dtype=np.int64)
        af = np.array([state["p_structural"], refit_t, math.inf, arrivals.continue_threshold, prior[0], prior[1],
                       growth, model.end_below if model is not None else 0.0] + [math.nan] * 6 + [math.inf])
        self._rebin: tuple[bytes, Callable[[int], None]] | None = None  # set_rebin's last beta (bits) and hook
        self.state = ArrivalState(
            queue_of=queue_of, session=session, prefix_of=prefix_of, bucket=bucket, agent=agent, sess_t=sess_t,
            sess=sess, prefix_last=prefix_last, gap=gap, pq_req=pq_req, pq=pq, counts=counts, n_pending=n_pending,
            lab_i=lab_i, lab_y=lab_y, zb=zb, ai=ai, af=af)

    def run(self, a: int, b: int, out_q: np.ndarray, out_slot: np.ndarray, out_flags: np.ndarray,
            out_pst: np.ndarray) -> None:
        """Requests ``a .. b-1`` arrive (at their trace times): what :meth:`Arrivals.arrive` returns for each, in
        ``out_*[i]`` (the structural rate after it in ``out_pst``)."""
        times = self.arrivals.trace.t
        if self.arrivals.model is not None:
            self._take_gaps()
        i = a
        while True:
            i, why = run(self.state, i, b, times, out_q, out_slot, out_flags, out_pst)
            if why == DONE:
                return
            if why == FIT_DUE:
                self._fit(float(times[i]))
            elif why == REBIN_DUE:
                self._rebin[1](i - 1)
            elif why == NEED_ZB:
                zb = self.arrivals.model.zb_at(i)
                self.state.zb[:zb.size] = zb
                self.state.ai[ZB_FROM], self.state.ai[ZB_LEN] = i, zb.size
            else:
                self._grow()

    def _take_gaps(self) -> None:
        """What the kernel reads of the gaps (which move between windows): staleness, survival and horizons."""
        st, model, gaps = self.state, self.arrivals.model, self.arrivals.gaps
        if not (type(gaps[0]) is LognormalGaps and type(gaps[1]) is LognormalGaps):  # SAECacheTwin.reason
            raise RuntimeError(f"compiled arrivals: the continuation model's gaps must be log-normal, got "
                               f"{type(gaps[0]).__name__} and {type(gaps[1]).__name__}")
        st.af[STALE_AFTER] = model.stale_after(gaps)
        st.af[MU_CH], st.af[S2_CH] = gaps[0].constants()[:2]
        st.af[MU_AG], st.af[S2_AG] = gaps[1].constants()[:2]
        st.af[HORIZON_CH], st.af[HORIZON_AG] = model.horizons(gaps)

    def _grow(self) -> None:
        st = self.state
        n = int(st.ai[PQ_N])
        pq_req, pq = np.zeros(2 * n, dtype=np.int64), np.zeros((3, 2 * n))
        pq_req[:n], pq[:, :n] = st.pq_req[:n], st.pq[:, :n]
        self.state = st._replace(pq_req=pq_req, pq=pq)

    @property
    def rates(self) -> np.ndarray:
        """The model's per-turn continuation rates as the arrivals run so far left them (a view: copy to keep)."""
        return self.state.counts[RATES]

    def _counts_to_model(self) -> None:
        st = self.state
        self.arrivals.model.set_counts(*st.counts[:REBIN_LAST], st.n_pending, st.ai[LAB_N], float(st.af[REFIT_T]))

    def _pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        st = self.state
        n = int(st.ai[PQ_N])
        live = ~np.isnan(st.pq[PQ_W, :n])
        return st.pq_req[:n][live], st.pq[PQ_T, :n][live], st.pq[PQ_W, :n][live]

    def _fit(self, now: float) -> None:
        """A due refit's fit of beta, once the kernel settled its pending requests (FIT_DUE)."""
        st, model = self.state, self.arrivals.model
        m = int(st.ai[PQ_N])
        model.fit_settled(now, st.pq_req[:m], st.pq[PQ_S, :m], st.counts[RATES], int(st.ai[LAB_N]))
        if model.zb_block_start < 0:  # the fit moved beta: p asks for a new block
            st.ai[ZB_LEN] = 0
        if st.ai[REBIN_EVERY] and model.beta.tobytes() != self._rebin[0]:
            st.ai[REBIN_FIRE] = 1

    def set_rebin(self, every: int, move: float, last: tuple[np.ndarray, np.ndarray] | None,
                  hook: Callable[[int], None]) -> None:
        """SAECache's ``rebin`` trigger checked in the kernel at every ``every``-th refit (0: never): from the model at
        the last rebinning ``last`` (None: none yet), a move past ``move`` (arrivals.model_moved) stops run() after
        that refit's request ``y`` and calls ``hook(y)``, which keeps the model and calls this again with it."""
        st, beta = self.state, self.arrivals.model.beta
        st.ai[REBIN_EVERY], st.ai[REBIN_ANY] = every, move <= 0
        st.af[REBIN_BOUND] = math.exp(move) if move < 700 else math.inf
        st.ai[REBIN_FIRE] = last is None or beta.tobytes() != last[1].tobytes()
        if last is not None:
            st.counts[REBIN_LAST] = last[0]
        self._rebin = (b"" if last is None else last[1].tobytes(), hook)

    def reset_window(self) -> None:
        self.state.gap[:] = 0.0
        self.arrivals.reset_window()

    def stats_to_python(self) -> None:
        """What the window statistics read (gap statistics, structural rate, the model's counts) into the Python
        objects."""
        st, arrivals = self.state, self.arrivals
        arrivals.p_structural = float(st.af[P_ST])
        arrivals.gap_stats = {q: [int(st.gap[q, 0]), float(st.gap[q, 1]), float(st.gap[q, 2])] for q in (CH, AG, ST)}
        if arrivals.model is not None:
            self._counts_to_model()

    def save(self) -> Arrivals:
        """Give the per-arrival state back to the Python objects (``import_state``); returns the arrivals."""
        st, arrivals, model = self.state, self.arrivals, self.arrivals.model
        self.stats_to_python()
        state = arrivals.export_state()  # what the compiled state does not hold (the model's beta, labels, zb)
        # the dicts in the Python engine's order: insertion order, which the ranks record
        seen = np.flatnonzero(~np.isnan(st.sess_t))
        entries = sorted(self._other_sessions + list(zip(st.sess[S_RANK, seen].tolist(), self.ids[seen].tolist(),
                                                         st.sess_t[seen].tolist(), st.sess[S_QUEUE, seen].tolist(),
                                                         strict=True)))
        state.update({"arrivals": int(st.ai[ARRIVALS]), "prefix_uses": int(st.ai[PREFIX_USES]),
                      "prefix_reused": int(st.ai[PREFIX_REUSED]),
                      "session_ids": np.array([e[1] for e in entries], dtype=np.int64),
                      "session_last": np.array([e[2] for e in entries], dtype=np.float64),
                      "session_queue": np.array([e[3] for e in entries], dtype=np.int64)})
        if model is not None:
            has = np.flatnonzero(st.sess[S_LAST] >= 0)
            last = sorted(self._other_last + list(zip(st.sess[S_LAST_RANK, has].tolist(), self.ids[has].tolist(),
                                                      st.sess[S_LAST, has].tolist(), strict=True)))
            pend, t_pend, w_pend = self._pending()
            state.update({"model_last_sessions": np.array([e[1] for e in last], dtype=np.int64),
                          "model_last_requests": np.array([e[2] for e in last], dtype=np.int64),
                          "model_pending": pend, "model_pending_t": t_pend, "model_pending_w": w_pend,
                          "model_offers": int(st.ai[OFFERS]), "model_next_refit": int(st.ai[NEXT_REFIT])})
        arrivals.import_state(state)
        # import_state made new arrays of the prefixes' last uses and of the labelled buffer
        self.state = self.state._replace(prefix_last=arrivals.routes()[2])
        if model is not None:
            lab_i, lab_y = model.labelled_buffer
            self.state = self.state._replace(lab_i=lab_i, lab_y=lab_y)
        return arrivals


def compiled(arrivals: Arrivals) -> CompiledArrivals | None:
    """The compiled arrivals of ``arrivals`` (bound), or None where its state cannot move (pending requests out of
    arrival order, as after importing another trace's state)."""
    try:
        return CompiledArrivals(arrivals)
    except ValueError:
        return None

