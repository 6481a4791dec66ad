"""Compiled twin of SAECache's arrivals (:meth:`~sae_env.policies.arrivals.Arrivals.arrive` with the continuation
model's ``arrive`` and ``p``): a window's requests in one call, the same floats in the same order.

What stays in Python is what runs once per many arrivals: the continuation model's refit (at the update offers,
every ``REFIT_EVERY`` arrivals, that its ``refit_growth`` schedule makes due, counted here as the model counts them,
and its refresh at an arrival where its last refit lies more than its ``stale_after`` back: the gap survival of the
pending requests, the ended ones labelled and the rates' EM steps (:mod:`sae_env.policies.continuation_refit`, whose
loops are compiled once a process has spent their load time in numpy) and, at a refit, the Newton steps of the
correction, in numpy) and the block of ``z @ beta`` that ``p`` reads (1024 requests at a time). :func:`run` stops at
the request that needs one of them, :class:`CompiledArrivals` does it through the Python model's own methods, and the
loop goes on from that request.

The per-arrival state lives here while the compiled engine holds the replay, as arrays, taken from the Python
objects through the state contract (``export_state``) and given back the same way (``import_state``); the Python
side offers only public hand-over methods (``Arrivals.routes``, the model's ``counts`` / ``set_counts`` /
``update_counts`` / ``labelled_buffer`` / ``labelled_count`` / ``zb_at``):

* sessions by dense id (this trace's session ids, sorted): the last arrival and its queue, the latest request, each
  with its place in the Python dict's insertion order (the exported state lists them in that order); the entries of
  sessions that this trace does not hold are kept aside and given back unchanged;
* the pending requests in arrival order, i.e. by increasing request index: a request is found by binary search,
  and one that got its label has a NaN weight until the next refit compacts the arrays;
* the per-turn counts and rates, the labelled buffer and the shared prefixes' last uses (the Python objects' own
  arrays, updated in place), the gap statistics and the shared prefixes' counts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from sae_env.fast_engine.jit import borrow, inline, jit
from sae_env.policies.arrivals import AG, CH, LOGIT_BIN, LOGIT_MAX, PE, REFIT_EVERY, ST, Arrivals
from sae_env.policies.continuation import MAX_REFIT_GAP, P_CLIP

__all__ = ["CompiledArrivals"]

DONE, REFIT_DUE, NEED_ZB, NEED_ROOM, STALE = range(5)  # why run() returned
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
# features, buffer; after the float scalars: continue_threshold, the prior's two pseudo-counts, refit_growth.
HAS_MODEL, DENSITY, PE_ROUTING, MULTI, CENSORING, FEATURES, BUFFER = range(12, 19)
THRESHOLD, PRIOR_A, PRIOR_B, GROWTH = range(3, 7)
# Packed rows (a kernel loads and unboxes every array of its state tuple: each costs ~55 us at a process's first
# replay, so fields of one length and type share an array). Per turn bucket (float64): the continuation rate, the
# pending requests' soft weights summed, the continued and the ended counts.
RATES, ALIVE, CONTINUED, ENDED = range(4)
# Per session (int64): its place in the Python dict's order (insertion order), its latest request (-1: none) and
# that entry's place in the model's dict, the queue of its last arrival.
S_RANK, S_LAST, S_LAST_RANK, S_QUEUE = range(4)
PQ_T, PQ_W = range(2)  # per pending request (float64): its arrival, its soft weight (NaN: labelled since the refit)
REFIT, STRUCTURAL = 1, 2  # request flags, as the compiled SAECache reads them


class ArrivalState(NamedTuple):
    queue_of: np.ndarray  # int8 per request: its queue by routing
    session: np.ndarray  # int32 (int64 past 2**31 sessions) per request: its dense session id (-1: unknown)
    prefix_of: np.ndarray  # int32 per request: its shared prefix (-1: none)
    bucket: np.ndarray  # int per request: its turn bucket
    sess_t: np.ndarray  # float64 per session: its last arrival (NaN: none yet)
    sess: np.ndarray  # int64 [S_*, session]
    prefix_last: np.ndarray  # float64 per shared prefix: its last use (NaN: none), Arrivals' own array
    gap: np.ndarray  # float64 [queue, (n, sum ln gap, sum ln^2 gap)]
    pq_req: np.ndarray  # int64: pending requests, increasing ...
    pq: np.ndarray  # float64 [PQ_T | PQ_W, pending] ... their arrivals and soft weights
    counts: np.ndarray  # float64 [RATES | ALIVE | CONTINUED | ENDED, turn bucket]
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
def slot_of(p):
    """sae_env.policies.arrivals.slot_of, compiled (the same libm: the same bins)."""
    if 0.0 < p < 1.0:
        x = math.log(p / (1.0 - p))
    else:
        x = LOGIT_MAX if p >= 1.0 else -LOGIT_MAX
    x = min(max(x, -LOGIT_MAX), LOGIT_MAX)
    return 1 + int(round((x + LOGIT_MAX) / LOGIT_BIN))


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
    anything of it was done, to have its due refit run (REFIT_DUE) or its refresh (STALE), its z @ beta block computed
    (NEED_ZB) or the pending arrays grown (NEED_ROOM)."""
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
                    return i, REFIT_DUE
            if now - st.af[REFIT_T] > st.af[STALE_AFTER]:  # ContinuationModel.stale (False while REFIT_T is NaN)
                return i, STALE
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
    (``import_state``). At a refit the continuation model updates the counts held here in place
    (``update_counts``); the labelled buffer is the model's own arrays."""

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
            pq_req, pq = np.zeros(cap, dtype=np.int64), np.zeros((2, cap))
            pq_req[:pend.size], pq[PQ_T, :pend.size], pq[PQ_W, :pend.size] = pend, state["model_pending_t"], \
                state["model_pending_w"]
            *counts, n_pending, lab_n = model.counts()
            counts = np.array(counts)
            lab_i, lab_y = model.labelled_buffer
            zb = np.zeros(1024)
            zb_from, zb_len = 0, 0
            if state["model_zb_from"] >= 0:
                zb_from = int(state["model_zb_from"])
                block = model.zb_at(zb_from)  # the block p() reads now: the same floats
                zb_len = block.size
                zb[:zb_len] = block
            bucket, prior = model.turn_buckets, model.prior
            censoring, features, buffer = model.censoring, model.features, model.buffer
            offers, next_refit, growth = int(state["model_offers"]), int(state["model_next_refit"]), model.refit_growth
            refit_t = model.last_refit
        else:
            pq_req, pq, counts = np.zeros(1, dtype=np.int64), np.zeros((2, 1)), np.zeros((4, 1))
            n_pending, lab_n = np.zeros(1, dtype=np.int64), 0
            lab_i, lab_y, zb = np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1)
            zb_from = zb_len = 0
            bucket = np.zeros(1, dtype=np.int8)
            prior, censoring, features, buffer = (1.0, 1.0), False, False, 1
            offers, next_refit, growth = 0, 1, 0.0
            refit_t = math.nan
        ai = np.array([state["arrivals"], state["prefix_uses"], state["prefix_reused"],
                       pend.size if model is not None else 0, lab_n, zb_from, zb_len, 0, ids.size, n_last, offers,
                       next_refit, model is not None, arrivals.density, arrivals.pe_routing, arrivals.multi_queue,
                       censoring, features, buffer], dtype=np.int64)
        af = np.array([state["p_structural"], refit_t, math.inf, arrivals.continue_threshold, prior[0], prior[1],
                       growth])
        self.state = ArrivalState(
            queue_of=queue_of, session=session, prefix_of=prefix_of, bucket=bucket, sess_t=sess_t, sess=sess,
            prefix_last=prefix_last, gap=gap, pq_req=pq_req, pq=pq, counts=counts, n_pending=n_pending, lab_i=lab_i,
            lab_y=lab_y, zb=zb, ai=ai, af=af)

    def run(self, a: int, b: int, out_q: np.ndarray, out_slot: np.ndarray, out_flags: np.ndarray,
            out_pst: np.ndarray) -> None:
        """Requests ``a .. b-1`` arrive (at their trace times): what :meth:`Arrivals.arrive` returns for each, in
        ``out_*[i]`` (the structural rate after it in ``out_pst``)."""
        times = self.arrivals.trace.t
        if self.arrivals.model is not None:
            self.state.af[STALE_AFTER] = self.arrivals.model.stale_after(self.arrivals.gaps)
        i = a
        while True:
            i, why = run(self.state, i, b, times, out_q, out_slot, out_flags, out_pst)
            if why == DONE:
                return
            if why == REFIT_DUE or why == STALE:
                self._refit(float(times[i]), fit=why == REFIT_DUE)
            elif why == NEED_ZB:
                zb = self.arrivals.model.zb_at(i)
                self.state.zb[:zb.size] = zb
                self.state.ai[ZB_FROM], self.state.ai[ZB_LEN] = i, zb.size
            else:
                self._grow()

    def _grow(self) -> None:
        st = self.state
        n = int(st.ai[PQ_N])
        pq_req, pq = np.zeros(2 * n, dtype=np.int64), np.zeros((2, 2 * n))
        pq_req[:n], pq[:, :n] = st.pq_req[:n], st.pq[:, :n]
        self.state = st._replace(pq_req=pq_req, pq=pq)

    @property
    def rates(self) -> np.ndarray:
        """The model's per-turn continuation rates as the arrivals run so far left them (a view: copy to keep)."""
        return self.state.counts[RATES]

    def _counts_to_model(self) -> None:
        st = self.state
        self.arrivals.model.set_counts(*st.counts, st.n_pending, st.ai[LAB_N])

    def _pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        st = self.state
        n = int(st.ai[PQ_N])
        live = ~np.isnan(st.pq[PQ_W, :n])
        return st.pq_req[:n][live], st.pq[PQ_T, :n][live], st.pq[PQ_W, :n][live]

    def _refit(self, now: float, fit: bool = True) -> None:
        """ContinuationModel.update at an arrival where run() found an offer its schedule makes due (``fit``) or the
        model stale, on the pending arrays and the per-turn counts held here (the model's update_counts, in place)."""
        st, model = self.state, self.arrivals.model
        pend, t_pend, w_pend = self._pending()
        keep, soft = model.update_counts(now, self.arrivals.gaps, pend, t_pend, w_pend, st.counts, st.n_pending,
                                         st.ai[LAB_N], fit=fit, compiled=True)
        m = soft.size
        st.pq_req[:m], st.pq[PQ_T, :m], st.pq[PQ_W, :m] = pend[keep], t_pend[keep], soft
        st.ai[PQ_N] = m
        st.ai[LAB_N] = model.labelled_count
        st.af[REFIT_T] = model.last_refit
        if model.zb_block_start < 0:  # the fit moved beta: p asks for a new block
            st.ai[ZB_LEN] = 0

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

