"""Compiled twin of ``saecache`` (:class:`~sae_env.policies.saecache.SAECachePolicy`: under its hit density, the
default, and under the paper's ranking, ``saecache-paper``), with the same victims as the Python policy at every
eviction.

What the arrivals alone decide (each request's queue and continuation bin, the continuation model and its refits,
the shared prefixes' reuse rate, the gap statistics; :class:`~sae_env.policies.arrivals.Arrivals`) does not depend
on the cache: the twin runs it ahead of each window (compiled: :mod:`sae_env.fast_engine.arrivals`, where a
replay's own state allows) and hands the kernel one row per request (queue, bin,
whether the policy refits there, the structural continuation rate after it). Whatever depends on the cache is in
the kernel, applied at the same request as the Python policy applies it: the turnover time (capacity over the
insertion rate) re-estimated at each refit, the occupancy and hits per queue.

One question mixes both: under ``rebin`` a refit (one where the model has moved by ``rebin_move`` since the last
rebinning: the twin asks ``arrivals.model_moved`` as the policy does, on the same floats) moves each evictable chat or
agent block to the bin of its releasing request as the model sees that request at the refit. The model's answer must
be the Python policy's, to the last bit, and the question (which requests released the cached blocks) depends on the
cache. So the twin, running the arrivals ahead, keeps what the answer needs from the model as each rebinning refit
leaves it (its per-turn rates and ``beta``: a row each), and the kernel, at that refit, computes
``ContinuationModel.p_many`` itself (_p_now: the same operations, libm's log and exp) for the requests that released
the cached blocks, from every request's turn bucket and feature row (copied at load), and moves the blocks
(_rebin_blocks: the evictable chat and agent blocks are found from their groups' ranges of the treap, not among all
slots). Each block keeps its releasing request (``relby``); the bins of the last rebinning are the requests whose
``bmark`` is the current one.

Under ``empirical_gaps`` each refit rebuilds the chat and agent queues' gap distributions from the gaps completed so
far (survival.EmpiricalGaps). The twin runs the window's arrivals ahead (in pieces that end at each rebinning under
rebin), collects the gaps the compiled arrivals count but do not keep, with how many there are after each request
(_record_gaps), and builds each refit's tables in numpy from the gaps up to it, a row of ``emp`` each; the kernel
moves to the next row at each refit and scores chat and agent blocks by the same bisection and interpolation as
EmpiricalGaps.density, bit for bit, with a lower bound that holds for any survival (such a density need not rise,
then fall: see _emp_density). ``gap_mixture`` rides on the same rows: a mixture's
survival is tabulated like an empirical one (survival.MixtureGaps), and a queue for which BIC kept one log-normal gets a
row marked -1, where the kernel scores by the log-normal's closed form, as for the default.

Under ``gap_select`` (sae_env/policies/gap_shape.py) the kernel keeps what the Python policy's GapShapeChoice keeps:
the release time of each idle block of its sample (relt: release stamp a multiple of IDLE_EVERY), the likelihood sums
over their hits and evictions (gll, whole units, so that any order of adding them gives the policy's sums) and, per
queue, whether it reads the exponential (gaps[q, GAP_EXP]), which a score then takes (_exp_density); at each refit
_choose_shapes adds the sample's idle blocks (a set kept as they are released, hit and evicted, while the census
lasts) and chooses.

Victims. The Python policy keeps, per group (queue, type when typed, continuation bin, value bin under hit_value),
its released leaves in a recency list and the blocks that became leaves later in returned-heaps, and scores three
candidates per group: the list's head, the heaps' oldest top, and the group's newest block (its score rises, then
falls, with idle time); the least ``(PE flag, score, release stamp)`` over the groups goes. Here both sets live in
one treap over the slots keyed ``(group, set, stamp)`` (:mod:`sae_env.fast_engine.treap`), which gives each of those
candidates in O(log n); scores are computed by the same operations in the same order as
:meth:`~sae_env.policies.survival.LognormalGaps.density` (numba calls the same libm). The Python policy's caches
of candidates and scores are pure speed-ups (a fresh scan chooses the same); its shortcut (the parent of the last
victim, released right after it into the same group, is taken without a scan when nothing moved since) is not
always what a scan would choose on exact ties, so it is reproduced as is. Each group's candidates are kept until
one of them leaves (a block that joins moves them without a search: _join), their best until the clock moves or the
constants change.

The scan over the groups is the twin's hot path: at every new instant each group's candidates are scored again (on
mooncake_synthetic made four times longer, 14 groups at a time and 15 scores a request). Two exact shortcuts spare
most of that work without changing a victim. Each scoring also gives a lower bound on the group's scores over the
next ``BOUND_SPAN`` of the turnover horizon (_bound); a later scan skips a group whose bound is above the least score it
has found so far, and it starts from the group it chose last, whose score is usually the least again. Few groups can
be skipped for long, though: eviction keeps every group's oldest blocks near the same score (on the trace made 16
times longer, 84 % of the groups rescored end within 10 % of the least), so about a third of the scores remain
(15 -> 4.4 a request). What spares most of the rest is the policy's own clock step (``clock_step``,
SAECachePolicy.clock, the same rounding here): the arrivals within one step of the ranking's clock are one instant to
the scan (mooncake_synthetic made 16 times longer: 3.75 -> 1.56 group rescorings and 5.6 -> 3.0 scores a request).

Under the paper's ranking (``density=False``) a group's score falls with idle time, so its candidates are its
oldest listed and oldest returned blocks, except in structural groups, which are *sampled*: their lists hold inner
nodes too, and a scan takes the first ``sample`` leaves from the head, parking the inner nodes it meets, as the
Python policy's scan does (see :func:`_walk`; it must run exactly as often, as parking changes later samples).

Row columns: the release stamp, the group (set at release; -1 before), where the block waits (0: pinned or parked,
1: its group's list, 2: its returned set) and the treap's links.

Why one piece (~1,000 lines): the hooks, the candidate scan and the state's load and export share one row layout and
one set of scalars, and each hook is the compiled copy of the Python hook of the same name; split, every module
would import every other's column and scalar names.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from sae_env.fast_engine import treap as tp
from sae_env.fast_engine.arrivals import compiled, slot_of
from sae_env.fast_engine.jit import implements, inline, jit
from sae_env.fast_engine.loop import BTYPE, DEPTH, LAST, NCHILD, PARENT, PIN, QUEUE, N
from sae_env.fast_engine.treap import GROUP, STAMP, WHERE
from sae_env.fast_engine.twin import Twin, register
from sae_env.policies.arrivals import (
    AG,
    CH,
    N_QUEUES,
    N_SLOTS,
    PE,
    REFIT_EVERY,
    ST,
    model_moved,
    rebin_last,
    rebin_last_state,
    slot_p,
)
from sae_env.policies.continuation import P_CLIP
from sae_env.policies.gap_shape import census_on, cure_loglik, idle_every, loglik_units
from sae_env.policies.saecache import (
    GROUP_SLOT,
    VALUE_STRIDE,
    EmpiricalShapes,
    SAECachePaperPolicy,
    SAECachePolicy,
    gap_models,
    value_bins,
    value_weight,
    window_stats,
)
from sae_env.policies.survival import EMPIRICAL_GRID
from sae_env.trace import TokenType

# Groups of one value bin (hit_value: group id + N_GROUPS * bin, as the policy's VALUE_STRIDE; off: bin 0 only).
N_GROUPS = VALUE_STRIDE
_REASONING, _TEMPLATE = int(TokenType.REASONING), int(TokenType.TEMPLATE)
_TYPES = 8  # TYPE_SLOTS: queue_type_code = queue * 8 + type
_TINY = 1e-300
# A group's lower bound holds for BOUND_SPAN horizons (the turnover time) after its scoring; it lets a scan skip a group
# whose bound, shrunk by BOUND_MARGIN against rounding, is above the least score found so far (see _bound).
# Speed only, no victim depends on it: a longer span is looser, a shorter one expires sooner (mooncake_synthetic made
# four times longer: 7.0 / 6.4 / 6.2 / 6.7 scores a request at 1/16, 1/32, 1/64 and 1/128).
BOUND_SPAN = 1 / 32
BOUND_MARGIN = 1.0 - 1e-6
# Integer scalars: releases so far, the next victim's shortcut (slot, stamp), the deferred block, acquires or
# releases since the last scan, whether the scan instant is set, groups seen, the constants'
# epoch, blocks inserted since the last turnover estimate, whether the window's start / the insertion rate / the
# horizon are known, multi_queue, type_weights, the request context (prompt and output queue, bin, prompt blocks,
# reasoning output), then the ranking's switches: the hit density, sampled structural groups, position decay; last, the
# group a scan chose last (scanned first: the least score found early lets the bounds skip more groups; -1: none),
# whether a chat or agent block's group carries its value bin (hit_value); rebin: whether it is on, the request the
# last completion served (whose blocks the next release frees: SAECachePolicy._completing), and the rebinnings so far
# plus one (a request's bin is current when its bmark is this), the model's row the next rebinning reads (rbr, rbb:
# counted from 0 in each window, as Twin.prepare writes them), whether the model has features (continuation.features);
# empirical_gaps: whether it is on, and the row of tables (emp) the scores read now (0 at a window's start, one more at
# each refit); gap_select: whether it is on, the changes of shape it made so far, its idle blocks' sampling step (a
# power of two), the idle blocks in its sample now, the cache's evictions so far (GapShapeChoice.evicted).
SEQ, NEXT_UP, NEXT_STAMP, DEFERRED, STALE, CAND_OK, N_SEEN, EPOCH, WIN_INS, HAS_T0, HAS_RATE, HAS_HOR, \
    MULTI, TYPED, PQ, OQ, SLOT, NPROMPT, OREASON, DENS, SAMPLED, DECAY, LAST_G, VALUED, REBIN, COMPLETING, \
    RB_MARK, RB_NEXT, RB_FEAT, EMP, EMP_ROW, SELECT, SHAPE_SWITCHES, IDLE_EVERY, N_SAMPLED, SHAPE_EVICTED = range(36)
NOT_RELEASED = -2  # rebin: a slot's releasing request when none (-1: released before any completion)
# gap_mixture: a queue's row of tables where BIC kept the learners' log-normal (its survival row starts below 0: the
# kernel scores that queue by the log-normal's closed form, as the Python policy does)
_LOGNORMAL_ROWS = (np.full(EMPIRICAL_GRID.size, -1.0), np.zeros(EMPIRICAL_GRID.size))
# Float scalars: the scan instant, the latest arrival, the horizon, the insertion rate, the window's start, the
# structural continuation rate, min_dt, the chat queue's mean gap (the horizon before any estimate), the capacity,
# the position decay's power gamma, the ranking clock's step as a fraction of the horizon (clock_step), gap_select's
# census (turnovers).
CAND_NOW, NOW, HORIZON, INS_RATE, WIN_T0, PST, MIN_DT, EXP_MEAN_CH, CAPACITY, GAMMA, CLOCK, CENSUS = range(12)
N_ST = 16  # structural groups are queue-type codes 8 .. 15 (they carry no continuation bin)
REFIT, STRUCTURAL, REBIN_AT = 1, 2, 4  # request flags (REBIN_AT: the refit there rebins, set by Twin.prepare)
_SHAPED = [CH, AG, ST]  # gap_select's queues, in GapShapeChoice.queues' order
GAP_SIGMA, GAP_EXP = 4, 5  # SAEState.gaps' columns after LognormalGaps.constants


def _shaped(switches: dict[str, bool]) -> bool:
    """Whether the chat and agent queues rank by gap tables rebuilt at every refit (empirical_gaps, gap_mixture: as
    SAECachePolicy._empirical)."""
    return switches["empirical_gaps"] or switches["gap_mixture"]


# The state's packed rows (a kernel loads and unboxes every array of its state tuple: each costs ~55 us at a
# process's first replay, so fields of one length and type share an array). Per request (int8): its queue and
# continuation bin (set at its arrival), REFIT | STRUCTURAL, whether its output holds reasoning, whether it arrived
# and has not completed. (Its prompt blocks need int32 and are an array of their own: int32 rows for all six fields
# would cost 15 bytes a request more.)
R_Q, R_SLOT, R_FLAGS, R_REASON, R_LIVE = range(5)
# Per group (int32): blocks in its list and returned set, the groups seen in order (N_SEEN of them, by position, not
# by group), its best candidate's slot, whether it was seen, whether its candidates are up to date (0: no, searched
# again; 1: yes, and its best too; 2: yes, its best to be rescored: see _join), whether it is dirty
# (SAECachePolicy._dirty: blocks joined since its last scan), the candidates a sampled structural group holds from its
# last scan (-1: never scanned), then its three candidates (-1: none).
# Then the newest block of its list when known, and its release stamp (valid while that slot is listed in this group
# with that stamp; see _add).
G_COUNT, G_ORDER, G_SLOT, G_SEEN, G_FRESH, G_DIRTY, G_HN, G_CAND = range(8)
G_TAIL, G_TAILSTAMP = G_CAND + 3, G_CAND + 4
# Per group (int64): its best candidate's release stamp, the constants' epoch then, and each candidate's release stamp
# when its bound (G_CLB) was computed.
G_STAMP, G_EPOCH, G_CSTAMP = range(3)
# Per group (float64): its best candidate's score, the instant it was computed at, a lower bound on every one of its
# candidates' scores until the instant G_UNTIL (see _bound), then each candidate's own bound and its end.
G_SCORE, G_NOW, G_LB, G_UNTIL = range(4)
G_CLB, G_CUNTIL = 4, 7
Q_HITS, Q_OCC = range(2)  # per queue (int64): hits this window, cached blocks


class SAEState(NamedTuple):
    req: np.ndarray  # int8 [R_*, request]
    n_prompt: np.ndarray  # int32 per request: prompt blocks (at least 1)
    req_pst: np.ndarray  # float64 per request: the structural continuation rate after its arrival
    gi: np.ndarray  # int32 [G_*, group] (G_CAND + 0 .. 2: the candidates; G_TAIL, G_TAILSTAMP)
    gl: np.ndarray  # int64 [G_STAMP | G_EPOCH | G_CSTAMP + 0 .. 2, group]
    gf: np.ndarray  # float64 [G_SCORE | G_NOW | G_LB | G_UNTIL | G_CLB + 0 .. 2 | G_CUNTIL + 0 .. 2, group]
    slotp: np.ndarray  # float64 per bin: the continuation probability it stands for
    # float64 [queue, (mu, sigma sqrt 2, mean, mu + sigma^2: LognormalGaps.constants; GAP_SIGMA: sigma; GAP_EXP: 1.0
    # where the queue reads the exponential of that mean, gap_select)]; the mean is SAECachePolicy._exp_mean to the bit
    gaps: np.ndarray
    coef: np.ndarray  # float64 per value bin and queue-type code (bin * GROUP_SLOT + code): alpha_q * w_type * value
    vbin: np.ndarray  # int32 per depth: the value bin of a block there (hit_value; [0] when off)
    root: np.ndarray  # int64 [1]: the treap's root (sae_env.fast_engine.treap)
    qn: np.ndarray  # int64 [Q_HITS | Q_OCC, queue]
    # Sampled structural groups (the paper's ranking, or position decay): see _walk.
    offset: np.ndarray  # float64 per slot: a structural block's relative offset x_b (one entry when unsampled)
    hslot: np.ndarray  # int32 [structural group, candidate]: the candidates held from its last scan ...
    hstamp: np.ndarray  # int64 ... and their release stamps then
    si: np.ndarray
    sf: np.ndarray
    # rebin (one entry each when off): the request that last released each slot's block (NOT_RELEASED: none); per
    # request, its bin at the last rebinning that asked about it and that rebinning (RB_MARK: the last one, whose
    # bins are SAECachePolicy._bin_now); what the model's answer needs: per request, its turn bucket and feature row;
    # per rebinning refit of the window, the model's rates and beta after that arrival
    relby: np.ndarray  # int32 per slot
    bslot: np.ndarray  # int8 per request
    bmark: np.ndarray  # int64 per request
    rbucket: np.ndarray  # int32 per request (ContinuationModel.turn_buckets)
    rz: np.ndarray  # float64 [request, feature] (ContinuationModel.feature_rows; one entry without features)
    rbr: np.ndarray  # float64 [rebinning, turn bucket]: ContinuationModel.rates
    rbb: np.ndarray  # float64 [rebinning, feature]: ContinuationModel.beta
    # empirical_gaps ([1, 1] when off): the grid (EMPIRICAL_GRID), then for each row of the window (its start, then each
    # refit) the chat queue's survival and its integral, then the agent queue's (EmpiricalGaps.table)
    emp: np.ndarray  # float64 [1 + 4 * row, grid point]
    # gap_select (one entry when off): each idle block's release (NaN: pinned, not idle since its last hit, or not in
    # the sample the switch follows: release stamp a multiple of IDLE_EVERY), and
    # the likelihood sums of the hits and evictions so far (gap_shape.GapShapeChoice.loglik, in its units)
    relt: np.ndarray  # float64 per slot
    # ... and the sample's idle blocks a refit counts while the census lasts, as a set: its first N_SAMPLED entries,
    # and each slot's place there (-1: not in it); a refit reads them without a scan of the cache (which cost
    # mooncake_synthetic made 16 times longer, 64,000 slots at 10 %, 3 us a request)
    sidx: np.ndarray  # int32
    spos: np.ndarray  # int32 per slot
    gll: np.ndarray  # int64 [queue, (log-normal, exponential)]
    shm: np.ndarray  # float64 [M_HIT | M_EVICT, M_*]: the last term each computed (see M_Q)


# -- the groups' sets ------------------------------------------------------------------------------------------------
@inline
def _add(ps, rec, s, where):
    """Slot ``s`` joins its group's list (where=1) or returned set (where=2)."""
    g = rec[s, GROUP]
    gi = ps.gi
    tail = gi[G_TAIL, g] if where == 1 else -1
    if tail >= 0 and not (rec[tail, WHERE] == 1 and rec[tail, GROUP] == g and rec[tail, STAMP] == gi[G_TAILSTAMP, g]):
        tail = -1  # it left the list since (or its slot holds another block now): not known
    rec[s, WHERE] = where
    if tail >= 0 and rec[s, STAMP] > rec[tail, STAMP]:
        # A release, the common case: its stamp is the newest, so the list's newest block is its predecessor in the
        # treap's order, and the insertion starts there instead of at the root (the same tree: treap.insert_after).
        tp.insert_after(ps.root, rec, np.int64(s), np.int64(tail))
        tail = s
    else:
        tp.insert(ps.root, rec, np.int64(s))  # one compiled insert for every caller's slot type
        if where == 1 and tail < 0:  # the newest if its successor is not in this list
            nxt = tp.after(rec, s)
            if nxt < 0 or rec[nxt, GROUP] != g or rec[nxt, WHERE] != 1:
                tail = s
    if tail >= 0:
        gi[G_TAIL, g] = tail
        gi[G_TAILSTAMP, g] = rec[tail, STAMP]
    ps.gi[G_COUNT, g] += 1
    if ps.gi[G_FRESH, g]:
        _join(ps, rec, g, s, where)
    if not ps.gi[G_SEEN, g]:
        ps.gi[G_SEEN, g] = 1
        ps.gi[G_ORDER, ps.si[N_SEEN]] = g
        ps.si[N_SEEN] += 1


@inline
def _join(ps, rec, g, s, where):
    """_group_cands of group ``g`` after slot ``s`` joined its list (where=1) or returned set (where=2), from the
    candidates before: each set's oldest and the newest of both (-1 if it is one of those two, or without the hit
    density, or in the PE queue) move only if ``s`` is older or newer than they are. Its best is rescored."""
    gi = ps.gi
    a, b, n = gi[G_CAND, g], gi[G_CAND + 1, g], gi[G_CAND + 2, g]
    stamp = rec[s, STAMP]
    if where == 1:
        if a < 0 or stamp < rec[a, STAMP]:
            a = s
    elif b < 0 or stamp < rec[b, STAMP]:
        b = s
    if ps.si[DENS] and (g % GROUP_SLOT) // _TYPES != PE:
        top = n  # the newest block before s joined: the newest candidate, or else the newer of the other two
        if top < 0:
            x, y = gi[G_CAND, g], gi[G_CAND + 1, g]
            top = x if y < 0 or (x >= 0 and rec[x, STAMP] > rec[y, STAMP]) else y
        if top < 0 or stamp > rec[top, STAMP]:
            top = s
        n = top if top != a and top != b else -1
    gi[G_CAND, g], gi[G_CAND + 1, g], gi[G_CAND + 2, g] = a, b, n
    gi[G_FRESH, g] = 2


@inline
def _remove(ps, rec, s):
    g = rec[s, GROUP]
    k = tp.key(rec, s)
    gi = ps.gi
    cand = gi[G_FRESH, g] and (s == gi[G_CAND, g] or s == gi[G_CAND + 1, g] or s == gi[G_CAND + 2, g])
    nxt = tp.after(rec, s) if cand else -1  # the least key above k once s is gone: its successor now
    tp.delete(ps.root, rec, np.int64(s))
    rec[s, WHERE] = 0
    gi[G_COUNT, g] -= 1
    if cand:
        _leave(ps, rec, g, s, k, nxt)


@inline
def _leave(ps, rec, g, s, k, nxt):
    """_group_cands of group ``g`` after its candidate ``s`` (key ``k``, followed by ``nxt`` in the treap's order)
    left: the oldest of a set is followed by the next of that set; the newest leaving, or an oldest that was also the
    newest, and the group's candidates are searched again. Any other block leaves them as they are. Its best is
    rescored."""
    gi = ps.gi
    a, b, n = gi[G_CAND, g], gi[G_CAND + 1, g], gi[G_CAND + 2, g]
    if s == n:
        gi[G_FRESH, g] = 0
        return
    if n < 0 and ps.si[DENS] and (g % GROUP_SLOT) // _TYPES != PE:  # the newest is a or b: is it s?
        other = b if s == a else a
        if other < 0 or rec[s, STAMP] > rec[other, STAMP]:
            gi[G_FRESH, g] = 0
            return
    if nxt >= 0 and (tp.key(rec, nxt) >> 32) != (k >> 32):  # another set or group
        nxt = -1
    if s == a:
        a = nxt
    else:
        b = nxt
    if n == a or n == b:
        n = -1
    gi[G_CAND, g], gi[G_CAND + 1, g], gi[G_CAND + 2, g] = a, b, n
    gi[G_FRESH, g] = 2


@inline
def _return(ps, rec, s):
    """SAECachePolicy._return: an unpinned block became a leaf; it joins its group's returned set (a sampled
    structural block still listed stays there; a parked one gets its release stamp back)."""
    if ps.si[SAMPLED] and rec[s, QUEUE] == ST:
        if rec[s, STAMP] > 0:
            return
        rec[s, STAMP] = -rec[s, STAMP]
    elif ps.si[REBIN] and (rec[s, QUEUE] == CH or rec[s, QUEUE] == AG):
        rec[s, GROUP] = _current_group(ps, rec, s)  # a parked block takes its request's bin of the last rebinning
    _add(ps, rec, s, 2)
    ps.gi[G_DIRTY, rec[s, GROUP]] = 1


@inline
def _current_group(ps, rec, s):
    """SAECachePolicy._group of a chat or agent block under rebin: its group at release (or at its last move), in
    the bin its releasing request had at the last rebinning if that request was asked then."""
    return _rebinned(rec[s, GROUP], ps.relby[s], ps.bmark, ps.bslot, ps.si[RB_MARK])


@inline
def _rebinned(g, r, bmark, bslot, mark):
    """_current_group of a block in group ``g`` released by request ``r``, from the arrays themselves (a loop that
    reads the state's fields each time runs about three times slower)."""
    if g >= 0 and r >= 0 and bmark[r] == mark:
        g += (bslot[r] - g % N_GROUPS // GROUP_SLOT) * GROUP_SLOT
    return g


class Sets(NamedTuple):
    """The part of the state that moving a block into its group's sets touches (what _return reads and writes), for
    the compiled functions the kernel calls rather than inlines: a call copies every array it is passed (passing
    the whole state, then 31 arrays, to flush and _group_cands cost about 0.2 us a call: 2 ms of a warm
    4,000-request replay, 9,000 calls)."""
    root: np.ndarray
    gi: np.ndarray
    si: np.ndarray
    relby: np.ndarray
    bslot: np.ndarray
    bmark: np.ndarray


@inline
def sets(ps):
    """The Sets of state ``ps`` (the same arrays)."""
    return Sets(ps.root, ps.gi, ps.si, ps.relby, ps.bslot, ps.bmark)


@jit
def flush(st, rec):
    """SAECachePolicy._flush: the deferred block joins its returned set if it is still evictable (``st``: the
    state's Sets)."""
    d = st.si[DEFERRED]
    if d >= 0:
        st.si[DEFERRED] = -1
        if rec[d, STAMP] != 0 and rec[d, PIN] == 0 and rec[d, NCHILD] == 0:
            _return(st, rec, d)


@inline
def _flush(ps, rec):
    if ps.si[DEFERRED] >= 0:
        flush(sets(ps), rec)


# -- scores ----------------------------------------------------------------------------------------------------------
@jit
def density_and_bound(mu, s2, mean, shift, p, dt, horizon, dt_b):
    """LognormalGaps.density at idle time ``dt``, operation for operation (dt > 0 and horizon > 0 here), and a lower
    bound on it over the idle times ``[dt, dt_b]`` (see _bound)."""
    log_now = math.log(dt)
    s_now = 0.5 * math.erfc((log_now - mu) / s2)
    if s_now < _TINY:
        return 0.0, 0.0
    alive = p * s_now
    pi = alive / (1.0 - p + alive) if alive > 0.0 else 0.0
    end = dt + horizon
    log_end = math.log(end)
    s_end = 0.5 * math.erfc((log_end - mu) / s2)
    hit = pi * (s_now - s_end) / s_now
    alive_time = (mean * 0.5 * math.erfc((log_now - shift) / s2) - mean * 0.5 * math.erfc((log_end - shift) / s2)
                  + end * s_end) / s_now - dt
    held = pi * max(alive_time, 0.0) + (1.0 - pi) * horizon
    f = hit / held if held > 0.0 else 0.0
    return f, _bound(mu, s2, mean, p, horizon, s_now, s_end, s_now * max(alive_time, 0.0), dt_b)


@inline
def _bound(mu, s2, mean, p, horizon, s_now, s_end, alive, dt_b):
    """A lower bound on the hit density over the idle times ``[dt, dt_b]``, from its parts at ``dt`` (``s_now``,
    ``s_end``: the survival at ``dt`` and ``dt + horizon``; ``alive``: the expected time alive within the horizon,
    unconditioned) and one survival more.

    The density is ``p D / (p M + (1 - p) H)`` (the ``pi`` and ``1 - pi`` of LognormalGaps.density cancel), with
    ``D(t) = S(t) - S(t + H)`` the chance of a return within the horizon and ``M(t)`` the integral of ``S`` over
    ``[t, t + H]``. ``M`` falls with ``t`` (its derivative is ``S(t + H) - S(t)``), and ``S`` falls, so on the
    interval ``D(t) >= S(dt_b) - S(dt + H)``. Hence the density is at least ``p (S(dt_b) - S(dt + H)) / (p M(dt) +
    (1 - p) H)`` there: exact, for any gap distribution (_emp_density's bound is the same). ``min(D(dt), D(dt_b))``,
    which the log-normal's unimodal density allows, is tighter by ``S(dt + H) - S(dt_b + H)``; it skipped the same
    groups but for 0.03 % of the scores on mooncake_arxiv made 16 times longer (0.9 % on mooncake_synthetic), at a
    logarithm and an ``erfc`` more for every score."""
    s_b = 0.5 * math.erfc((math.log(dt_b) - mu) / s2)
    if s_b < 1e-290:  # the density may be cut to 0 within the interval
        return 0.0
    d = s_b - s_end
    # Where the scores' own floats lose digits, no bound (0): D a difference of survivals a millionth apart, a horizon
    # a millionth of the times that alive_time's differences cancel, or the product pi * D subnormal.
    if not (d > 1e-6 * s_now and horizon > 1e-6 * (mean + dt_b) and p * s_b * d > 1e-280):
        return 0.0
    den = p * alive + (1.0 - p) * horizon
    return p * d / den if den > 0.0 else 0.0


@inline
def _emp_at(emp, r, t):
    """EmpiricalGaps._at over table ``r`` of ``emp`` (its survival row; the integral's is the next): the same
    bisection and operations, the same floats."""
    grid = emp[0]
    n = grid.size
    lo, hi = 0, n
    while lo < hi:  # bisect.bisect_right
        mid = (lo + hi) >> 1
        if t < grid[mid]:
            hi = mid
        else:
            lo = mid + 1
    k = lo - 1
    if k >= n - 1:
        last = emp[r, n - 1]
        return last, emp[r + 1, n - 1] + last * (t - grid[n - 1])
    t0, t1 = grid[k], grid[k + 1]
    s0, s1 = emp[r, k], emp[r, k + 1]
    x = t - t0
    sx = s0 + (s1 - s0) * x / (t1 - t0)
    return sx, emp[r + 1, k] + 0.5 * (s0 + sx) * x


@jit
def _emp_density(emp, r, p, dt, horizon, dt_b):
    """EmpiricalGaps.density over table ``r`` of ``emp`` (dt > 0 here), and a lower bound on it over the idle times
    ``[dt, dt_b]``: as in _bound, the density is ``p D / (p M + (1 - p) H)``, ``M`` falls with idle time, and for
    any survival ``D(t) = S(t) - S(t + H) >= S(dt_b) - S(dt + H)`` on the interval (``S`` does not rise, nor does
    its linear interpolation). Looser than the log-normal's, and void (0) once the interval reaches a horizon. Called,
    not inlined: only empirical_gaps and gap_mixture read it (see _exp_density_and_bound)."""
    if horizon <= 0.0:
        return 0.0, 0.0
    s_now, c_now = _emp_at(emp, r, dt)
    if s_now < _TINY:
        return 0.0, 0.0
    alive = p * s_now
    pi = alive / (1.0 - p + alive) if alive > 0.0 else 0.0
    s_end, c_end = _emp_at(emp, r, dt + horizon)
    hit = pi * (s_now - s_end) / s_now
    held = pi * max((c_end - c_now) / s_now, 0.0) + (1.0 - pi) * horizon
    f = hit / held if held > 0.0 else 0.0
    s_b, _ = _emp_at(emp, r, dt_b)
    d = s_b - s_end
    m = c_end - c_now
    # no bound where the floats lose digits: D a millionth of the survival, M cancelling in its integral's difference
    if not (d > 1e-6 * s_now and m > 1e-6 * c_end and p * s_b * d > 1e-280):
        return f, 0.0
    den = p * m + (1.0 - p) * horizon
    return f, p * d / den if den > 0.0 else 0.0


@inline
def _exp_density(mean, p, dt, horizon):
    """ExponentialGaps.density (through LognormalGaps._density) at idle time ``dt > 0``, operation for operation. It
    falls with ``dt`` (the posterior does, and a memoryless return does not depend on it), so its value at the end of an
    interval bounds it over the interval."""
    s_now = math.exp(-dt / mean)
    if s_now < _TINY:
        return 0.0
    alive = p * s_now
    pi = alive / (1.0 - p + alive) if alive > 0.0 else 0.0
    end = dt + horizon
    s_end = math.exp(-end / mean) if end > 0.0 else 1.0
    hit = pi * (s_now - s_end) / s_now
    held = pi * max(mean * -math.expm1(-(end - dt) / mean), 0.0) + (1.0 - pi) * horizon
    return hit / held if held > 0.0 else 0.0


@jit
def _exp_density_and_bound(mean, p, dt, horizon, dt_b):
    """_exp_density at ``dt``, and a lower bound over ``[dt, dt_b]``: its value at ``dt_b``, except where a return
    within the horizon is a difference of survivals a millionth apart (``horizon`` under a millionth of the mean),
    whose rounding could put a later score below it (no bound: 0). Called, not inlined, as _emp_density is: a score
    reads it only under gap_select's exponential, and inlined at the scores' two sites the two took 19 s of SAECache's
    instant kernel's 74-second compile (scalars in, two out: the call costs nothing measurable)."""
    f = _exp_density(mean, p, dt, horizon)
    return f, _exp_density(mean, p, dt_b, horizon) if horizon > 1e-6 * mean else 0.0


@inline
def _score(ps, recf, g, s, now, until):
    """SAECachePolicy._least's score of slot ``s`` of group ``g`` at ``now``, and a lower bound on it until the
    instant ``until`` (-inf: none)."""
    code = g % GROUP_SLOT + GROUP_SLOT * (g // N_GROUPS)  # its coef: queue-type code and value bin
    q = (g % GROUP_SLOT) // _TYPES
    min_dt = ps.sf[MIN_DT]
    dt = now - recf[s, LAST]
    if q == PE:  # a constant ranking term: 1 / dt
        if dt < min_dt:
            dt = min_dt
        dt_b = max(until - recf[s, LAST], min_dt)
        return ps.coef[code] * (1.0 / dt), ps.coef[code] * (1.0 / dt_b)
    if not ps.si[DENS]:  # the paper's p_q / dt
        if dt < min_dt:
            dt = min_dt
        if q == ST:
            if ps.si[DECAY]:
                return ps.coef[code] * ((1.0 - ps.offset[s] ** ps.sf[GAMMA]) / dt), -math.inf
            return ps.coef[code] * (1.0 / dt), -math.inf
        return ps.coef[code] * (0.5 * math.erfc((math.log(dt) - ps.gaps[q, 0]) / ps.gaps[q, 1]) / dt), -math.inf
    if not dt > min_dt:
        dt = min_dt
    dt_b = until - recf[s, LAST]
    if not dt_b > min_dt:
        dt_b = min_dt
    p = ps.sf[PST] if q == ST else ps.slotp[g % N_GROUPS // GROUP_SLOT]
    horizon = ps.sf[HORIZON] if ps.si[HAS_HOR] else ps.sf[EXP_MEAN_CH]
    if ps.si[EMP] and (q == CH or q == AG):  # an empirical density need not rise, then fall: its own bound
        r = 1 + 4 * ps.si[EMP_ROW] + 2 * (q - CH)
        if ps.emp[r, 0] >= 0.0:  # (gap_mixture: -1 where BIC kept one log-normal, scored below)
            f, lb = _emp_density(ps.emp, r, p, dt, horizon, dt_b)
            return ps.coef[code] * f, ps.coef[code] * lb
    gp = ps.gaps
    if gp[q, GAP_EXP] != 0.0:  # gap_select chose the exponential (of the log-normal's mean)
        f, lb = _exp_density_and_bound(gp[q, 2], p, dt, horizon, dt_b)
    else:
        f, lb = density_and_bound(gp[q, 0], gp[q, 1], gp[q, 2], gp[q, 3], p, dt, horizon, dt_b)
    return ps.coef[code] * f, ps.coef[code] * lb


@inline
def _consider(ps, c, g, s, now, best, bscore, bstamp):
    if s < 0:
        return best, bscore, bstamp
    score, _ = _score(ps, c.recf, g, s, now, now)  # a sampled group keeps no bound
    stamp = np.int64(c.rec[s, STAMP])
    if best < 0 or score < bscore or (score == bscore and stamp < bstamp):
        return s, score, stamp
    return best, bscore, bstamp


@jit
def _group_cands(root, rec, gi, dens, g):
    """SAECachePolicy._candidates of group ``g``: its list's head, its returned set's oldest, and under the hit
    density the newest of both (if another block); kept until the group changes. (The arrays it needs, not the
    whole state: a call copies what it is passed.)"""
    base = np.int64(g) << 33
    one = np.int64(1) << 32
    a = tp.lower(root, rec, base)
    if a >= 0 and tp.key(rec, a) >= base + one:
        a = -1
    b = tp.lower(root, rec, base + one)
    if b >= 0 and tp.key(rec, b) >= base + 2 * one:
        b = -1
    newest = -1
    if dens and (g % GROUP_SLOT) // _TYPES != PE and (a >= 0 or b >= 0):
        lt = tp.below(root, rec, base + one)
        if lt >= 0 and tp.key(rec, lt) < base:
            lt = -1
        rt = tp.below(root, rec, base + 2 * one)
        if rt >= 0 and tp.key(rec, rt) < base + one:
            rt = -1
        newest = lt
        if rt >= 0 and (lt < 0 or rec[rt, STAMP] > rec[lt, STAMP]):
            newest = rt
        if newest == a or newest == b:
            newest = -1
    gi[G_CAND, g] = a
    gi[G_CAND + 1, g] = b
    gi[G_CAND + 2, g] = newest
    gi[G_FRESH, g] = 1


@inline
def _group_best(ps, c, g, now):
    """SAECachePolicy._least of group ``g``'s candidates at ``now``, stored per group, with the group's lower bound
    (the least of its candidates'). A candidate whose own bound still holds (scored in this epoch, in its place then,
    within its interval) and is above the least score found is not scored again: it cannot be the least. The group's
    last best and the candidates without a bound are scored first."""
    gi, gf, gl, rec = ps.gi, ps.gf, ps.gl, c.rec
    best, bscore, bstamp = -1, 0.0, np.int64(0)
    until = now + BOUND_SPAN * (ps.sf[HORIZON] if ps.si[HAS_HOR] else ps.sf[EXP_MEAN_CH])
    same_epoch = gl[G_EPOCH, g] == ps.si[EPOCH]
    scored = 0
    for t in range(6):  # two rounds over the three candidates, as one loop: one copy of the inlined score
        k = t % 3
        s = gi[G_CAND + k, g]
        if s < 0 or scored & (1 << k):
            continue
        held = same_epoch and gl[G_CSTAMP + k, g] == rec[s, STAMP] and now <= gf[G_CUNTIL + k, g]
        if t < 3:
            if held and s != gi[G_SLOT, g]:
                continue
        elif best >= 0 and gf[G_CLB + k, g] * BOUND_MARGIN > bscore:
            continue
        scored |= 1 << k
        score, low = _score(ps, c.recf, g, s, now, until)
        gf[G_CLB + k, g] = low
        gf[G_CUNTIL + k, g] = until
        gl[G_CSTAMP + k, g] = rec[s, STAMP]
        stamp = np.int64(rec[s, STAMP])
        if best < 0 or score < bscore or (score == bscore and stamp < bstamp):
            best, bscore, bstamp = s, score, stamp
    lb, lb_until = math.inf, math.inf
    for k in range(3):
        if gi[G_CAND + k, g] >= 0:
            lb = min(lb, gf[G_CLB + k, g])
            lb_until = min(lb_until, gf[G_CUNTIL + k, g])
    gi[G_SLOT, g] = best
    gf[G_SCORE, g] = bscore
    gl[G_STAMP, g] = bstamp
    gf[G_NOW, g] = now
    gf[G_LB, g] = lb
    gf[G_UNTIL, g] = lb_until
    gl[G_EPOCH, g] = ps.si[EPOCH]
    gi[G_FRESH, g] = 1


@inline
def _held_best(ps, c, g, now):
    """_group_best over a sampled structural group's held candidates."""
    best, bscore, bstamp = -1, 0.0, np.int64(0)
    for k in range(ps.gi[G_HN, g]):
        best, bscore, bstamp = _consider(ps, c, g, ps.hslot[g, k], now, best, bscore, bstamp)
    ps.gi[G_SLOT, g] = best
    ps.gf[G_SCORE, g] = bscore
    ps.gl[G_STAMP, g] = bstamp


@jit
def _walk(ps, c, g, now):
    """SAECachePolicy._best of a sampled structural group: _structural_candidates, then _least.

    The sample is what the Python scan takes: from the head of the group's list (which holds its inner nodes too),
    leaves are counted until ``sample``; an inner node met is parked (out of the list, stamp negated: it comes back
    through on_leaf) and the count goes on as the original scan's restart from the head counted it. Then the
    ``sample`` oldest blocks of its returned set. The scan has side effects (the parking), so it runs exactly when
    the Python policy runs it (see _select)."""
    rec = c.rec
    want = ps.hslot.shape[1] // 2
    base = np.int64(g) << 33
    one = np.int64(1) << 32
    n, leaves, counted = 0, 0, 0
    k = base
    while True:
        x = tp.lower(ps.root, rec, k)
        if x < 0 or tp.key(rec, x) >= base + one:
            break
        k = tp.key(rec, x) + 1
        if rec[x, NCHILD] != 0:
            _remove(ps, rec, x)
            rec[x, STAMP] = -rec[x, STAMP]
            if counted + leaves >= want:
                break
            counted += leaves
            continue
        ps.hslot[g, n] = x
        ps.hstamp[g, n] = rec[x, STAMP]
        n += 1
        leaves += 1
        counted += 1
        if counted >= want:
            break
    k = base + one
    for _ in range(want):
        x = tp.lower(ps.root, rec, k)
        if x < 0 or tp.key(rec, x) >= base + 2 * one:
            break
        k = tp.key(rec, x) + 1
        ps.hslot[g, n] = x
        ps.hstamp[g, n] = rec[x, STAMP]
        n += 1
    ps.gi[G_HN, g] = n
    _held_best(ps, c, g, now)


@inline
def _held_invalid(ps, rec, g):
    """A held candidate was pinned, re-released, evicted or gained a child since the scan."""
    for k in range(ps.gi[G_HN, g]):
        s = ps.hslot[g, k]
        if rec[s, STAMP] != ps.hstamp[g, k] or rec[s, PIN] != 0 or rec[s, NCHILD] != 0:
            return True
    return False


@inline
def _select(ps, c, now, full, rescore):
    """The least (PE flag, score, stamp) over the groups' best candidates: SAECachePolicy.evict's scan (``full``:
    its branch that goes over every group, at a new instant (``rescore``) or after acquires and releases)."""
    si = ps.si
    epoch = si[EPOCH]
    multi = si[MULTI]
    sampled = si[SAMPLED]
    best, bflag, bscore, bstamp = -1, 2, 0.0, np.int64(0)
    first = si[LAST_G]
    if first >= 0 and sampled and first < N_ST and first // _TYPES == ST:
        first = -1
    for k in range(-1, si[N_SEEN]):  # the order changes nothing: the least (flag, score, stamp) is unique
        if k < 0:
            if first < 0:
                continue
            g = first
        else:
            g = ps.gi[G_ORDER, k]
            if g == first:
                continue
        flag = 0 if (multi and (g % GROUP_SLOT) // _TYPES == PE) else 1
        if sampled and g < N_ST and g // _TYPES == ST:
            if ps.gi[G_DIRTY, g] or (full and (ps.gi[G_HN, g] < 0 or rescore or _held_invalid(ps, c.rec, g))):
                _walk(ps, c, g, now)
                ps.gi[G_DIRTY, g] = 0
            if ps.gi[G_HN, g] < 0 or ps.gi[G_SLOT, g] < 0:
                continue
        elif ps.gi[G_COUNT, g] == 0:
            continue
        else:
            fresh = ps.gi[G_FRESH, g]
            if not fresh:
                _group_cands(ps.root, c.rec, ps.gi, si[DENS], g)
            elif fresh == 1 and ps.gl[G_EPOCH, g] == epoch and ps.gf[G_NOW, g] == now:
                fresh = -1  # its best is up to date
            elif best >= 0:
                held = fresh == 1 and ps.gl[G_EPOCH, g] == epoch and now <= ps.gf[G_UNTIL, g]
                if flag > bflag or (flag == bflag and held and ps.gf[G_LB, g] * BOUND_MARGIN > bscore):
                    continue  # none of its candidates can be the least (see _bound); its best is left stale
            if fresh >= 0:  # one call site: the kernel inlines it, and each copy costs compile time
                _group_best(ps, c, g, now)
        score, stamp = ps.gf[G_SCORE, g], ps.gl[G_STAMP, g]
        if best < 0 or flag < bflag or (flag == bflag and (score < bscore or (score == bscore and stamp < bstamp))):
            best, bflag, bscore, bstamp = ps.gi[G_SLOT, g], flag, score, stamp
    return best


@inline
def _changed(ps):
    """SAECachePolicy._changed: the ranking constants moved."""
    ps.si[EPOCH] += 1
    ps.si[CAND_OK] = 0


@inline
def _p_now(rates, beta, bucket, z, features, r):
    """ContinuationModel.p_many of request ``r`` from the model's ``rates`` and ``beta`` (a row of rbr and of rbb),
    the requests' turn buckets and feature rows (rbucket, rz): the same operations in the same order (``z @ beta``
    feature by feature, then libm's log and exp)."""
    rate = rates[bucket[r]]
    if not features:
        return rate
    rate = min(max(rate, P_CLIP), 1.0 - P_CLIP)
    zb = z[r, 0] * beta[0]
    for f in range(1, z.shape[1]):
        zb += z[r, f] * beta[f]
    return 1.0 / (1.0 + math.exp(-max(math.log(rate / (1.0 - rate)) + zb, -700.0)))


@jit
def _rebin_blocks(ps, rec, n, k):
    """SAECachePolicy._rebin_blocks: every evictable chat or agent block moves to its current group
    (_current_group: in the bin of its releasing request's probability under the model's row ``k``, the model as
    this arrival left it) and into its group's list, as the Python policy rebuilds its lists. Only the blocks whose
    place changes move, and only their groups' candidates are searched again; the treap's order is the lists' order,
    so nothing else is needed. A rare call (every REFIT_EVERY arrivals): compiled apart, not inlined into the
    kernel. Its loops read the state's arrays from locals (see _rebinned)."""
    _flush(ps, rec)
    ps.si[NEXT_UP] = -1
    relby, bmark, bslot = ps.relby, ps.bmark, ps.bslot
    released = False
    for s in range(n):
        if relby[s] != NOT_RELEASED:
            released = True
            break
    if not released:  # as the Python policy: its dict of releasing requests is empty, nothing moves
        return
    mark = ps.si[RB_MARK] + 1  # the releasing requests of the cached blocks (of slots 0 .. n-1), each asked once
    ps.si[RB_MARK] = mark
    rates, beta, bucket, z, features = ps.rbr[k], ps.rbb[k], ps.rbucket, ps.rz, ps.si[RB_FEAT]
    for s in range(n):
        r = relby[s]
        if r >= 0 and bmark[r] != mark:
            bmark[r] = mark
            bslot[r] = slot_of(_p_now(rates, beta, bucket, z, features, r))
    # the evictable chat and agent blocks, from their groups' ranges of the treap (on mooncake_synthetic at 10 %,
    # 70 of 4,015 slots): gathered first, as the moves reshape the treap
    gi, gl, root = ps.gi, ps.gl, ps.root
    seen = gi[G_ORDER, :ps.si[N_SEEN]]  # the groups that ever held a block, as _select goes over them
    m = 0
    for g in seen:
        q = (g % GROUP_SLOT) // _TYPES
        if q == CH or q == AG:
            m += gi[G_COUNT, g]
    members = np.empty(m, dtype=np.int64)
    m = 0
    for g in seen:
        q = (g % GROUP_SLOT) // _TYPES
        if (q == CH or q == AG) and gi[G_COUNT, g]:
            s = tp.lower(root, rec, np.int64(g) << 33)
            while s >= 0 and rec[s, GROUP] == g:
                members[m] = s
                m += 1
                s = tp.after(rec, s)
    if m != members.size:
        raise RuntimeError("saecache twin: the groups' counts disagree with the treap")
    for i in range(m):
        s = members[i]
        g = _rebinned(rec[s, GROUP], relby[s], bmark, bslot, mark)
        if g != rec[s, GROUP] or rec[s, WHERE] != 1:
            for t in range(2):  # both groups' candidates searched again (so _remove and _add leave them alone)
                h = rec[s, GROUP] if t == 0 else g
                gi[G_FRESH, h] = 0
                gl[G_EPOCH, h] = -1
            _remove(ps, rec, s)
            rec[s, GROUP] = g
            _add(ps, rec, s, 1)
    ps.si[STALE] = 1


# -- gap_select ------------------------------------------------------------------------------------------------------
_cure = inline(cure_loglik)
_units = inline(loglik_units)
_census_on = inline(census_on)


# A memo row (shm): the last term computed, by (queue, whether an event, idle time, p), and its two units. The blocks
# of one request's path are released together and hit, evicted and left idle in runs of one group: most terms repeat
# the last (the same function of the same floats, so the same units).
M_Q, M_EVENT, M_T, M_P, M_LN, M_EX = range(6)
M_HIT, M_EVICT = range(2)  # a row per caller (the census keeps its own: _census)


@inline
def _shape_p(rec, s, q, pst, slotp, relby, bmark, bslot, mark):
    """The continuation probability slot ``s`` (of queue ``q``) counts with in gap_select's sums, the one its score
    reads (SAECachePolicy._p_of): ``pst`` for a structural block, else its current group's bin's (``mark``: RB_MARK
    under rebin, else -1: the group it was released into). From the arrays, for _shape_add and _census alike."""
    if q == ST:
        return pst
    g = _rebinned(rec[s, GROUP], relby[s], bmark, bslot, mark) if mark >= 0 else rec[s, GROUP]
    return slotp[g % N_GROUPS // GROUP_SLOT]


@inline
def _shape_add(rec, s, event, t, sums, pst, memo, weight, slotp, relby, bmark, bslot, mark, gaps):
    """GapShapeChoice.add of slot ``s``'s idle time ``t`` into ``sums``, ``weight`` times, with the continuation
    probability its score reads (_shape_p; ``pst``: the structural one); ``memo``: a row of shm."""
    q = rec[s, QUEUE]
    if not (q == CH or q == AG or q == ST) or not t > 0.0:
        return
    p = _shape_p(rec, s, q, pst, slotp, relby, bmark, bslot, mark)
    ev = 1.0 if event else 0.0
    if not (memo[M_T] == t and memo[M_P] == p and memo[M_Q] == q and memo[M_EVENT] == ev):
        ln, ex = _cure(event, t, p, gaps[q, 0], gaps[q, GAP_SIGMA], gaps[q, 2])
        memo[M_Q], memo[M_EVENT], memo[M_T], memo[M_P] = q, ev, t, p
        memo[M_LN], memo[M_EX] = _units(ln), _units(ex)  # (whole units below 2**53: exact as floats)
    sums[q, 0] += weight * np.int64(memo[M_LN])
    sums[q, 1] += weight * np.int64(memo[M_EX])


@inline
def _unsample(si, spos, sidx, s):
    """Slot ``s`` leaves the idle sample (its place taken by the sample's last entry)."""
    k = spos[s]
    if k >= 0:
        last = si[N_SAMPLED] - 1
        t = sidx[last]
        sidx[k] = t
        spos[t] = k
        spos[s] = -1
        si[N_SAMPLED] = last


@inline
def _idle(ps, s, now, stamp):
    """GapShapeChoice.released: slot ``s`` is idle from ``now`` if its release ``stamp`` is in the sample (relt: NaN
    where it is not)."""
    if stamp & (ps.si[IDLE_EVERY] - 1) != 0:
        # most blocks: off the sample, and already NaN (a hit or an eviction ended their last idle time); a slot in the
        # census's set is never NaN, so the set is left alone then (the two stores skipped: at most 0.1 us a request on
        # mooncake_synthetic made 16 times longer, where one release in 256 is in the sample: within this VM's noise)
        if ps.relt[s] == ps.relt[s]:
            _unsample(ps.si, ps.spos, ps.sidx, s)
            ps.relt[s] = math.nan
        return
    _unsample(ps.si, ps.spos, ps.sidx, s)
    ps.relt[s] = now
    # (once the census is over no choice reads the census's set: it is left to empty as its blocks are hit or evicted)
    if _census_on(ps.si[SHAPE_EVICTED], ps.sf[CAPACITY], ps.sf[CENSUS]):
        k = ps.si[N_SAMPLED]
        ps.sidx[k] = s
        ps.spos[s] = k
        ps.si[N_SAMPLED] = k + 1


@inline
def _ended(ps, rec, s, now, event, memo):
    """GapShapeChoice.ended: slot ``s``, idle since its release (in the sample), is hit (``event``) or evicted at
    ``now``: its idle time counts IDLE_EVERY times. Only a block in the sample (``relt`` not NaN) calls out."""
    t0 = ps.relt[s]
    if t0 == t0:
        _sampled_ended(rec, s, now - t0, event, memo, ps.relt, ps.si, ps.spos, ps.sidx, ps.gll, ps.sf[PST],
                       ps.slotp, ps.relby, ps.bmark, ps.bslot, ps.si[RB_MARK] if ps.si[REBIN] else -1, ps.gaps)


@jit
def _sampled_ended(rec, s, t, event, memo, relt, si, spos, sidx, sums, pst, slotp, relby, bmark, bslot, mark, gaps):
    """_ended of a block in the sample, called rather than inlined: a kernel inlines a helper at each of its call
    sites, and this one's likelihood terms (libm's log, erfc and exp) at three sites, with _take inlined at two, took
    16 s of SAECache's instant kernel's 90-second compile; it runs for one block in IDLE_EVERY, so the call costs
    nothing measurable. It takes the arrays it uses, not the state (a call copies what it is passed)."""
    relt[s] = math.nan
    _unsample(si, spos, sidx, s)
    _shape_add(rec, s, event, t, sums, pst, memo, si[IDLE_EVERY], slotp, relby, bmark, bslot, mark, gaps)


@jit
def _census(total, rec, now, pst, sidx, n, relt, relby, bmark, bslot, mark, slotp, gaps):
    """The census of _choose_shapes: _shape_add of each of the ``n`` sampled idle blocks, censored at ``now``, into
    ``total``, once each, with its own memo row. The state's arrays are passed in rather than read from the state at
    each block (in a function the kernel calls rather than inlines, each such read counts a reference: jit.borrow):
    read there, the census took three to ten times as long (mooncake_synthetic at 10 %: 0.22-0.26 us a request against
    0.01-0.08; made 16 times longer, 0.67 against 0.16-0.36). ``mark``: RB_MARK under rebin, else -1 (no request
    carries it)."""
    mq, mp, mt, mln, mex = -1, -1.0, -1.0, 0, 0
    for k in range(n):
        s = sidx[k]
        q = rec[s, QUEUE]
        t = now - relt[s]
        if not (q == CH or q == AG or q == ST) or not t > 0.0:
            continue
        p = _shape_p(rec, s, q, pst, slotp, relby, bmark, bslot, mark)
        if not (t == mt and p == mp and q == mq):
            ln, ex = _cure(False, t, p, gaps[q, 0], gaps[q, GAP_SIGMA], gaps[q, 2])
            mq, mp, mt, mln, mex = q, p, t, _units(ln), _units(ex)
        total[q, 0] += mln
        total[q, 1] += mex


@jit
def _choose_shapes(ps, rec, now, pst):
    """GapShapeChoice.choose at a refit: the idle blocks of the sample (release stamp a multiple of IDLE_EVERY)
    counted censored at ``now``, IDLE_EVERY times each (the sums are integers: the order does not matter); each
    queue's choice in gaps[q, GAP_EXP] (the caller recomputes the ranking's constants whatever it chose)."""
    total = np.zeros_like(ps.gll)
    if _census_on(ps.si[SHAPE_EVICTED], ps.sf[CAPACITY], ps.sf[CENSUS]):
        _census(total, rec, now, pst, ps.sidx, ps.si[N_SAMPLED], ps.relt, ps.relby, ps.bmark, ps.bslot,
                ps.si[RB_MARK] if ps.si[REBIN] else -1, ps.slotp, ps.gaps)
        total *= ps.si[IDLE_EVERY]
    total += ps.gll
    for q in (CH, AG, ST):
        e = 1.0 if total[q, 1] > total[q, 0] else 0.0
        if e != ps.gaps[q, GAP_EXP]:
            ps.gaps[q, GAP_EXP] = e
            ps.si[SHAPE_SWITCHES] += 1


# -- hooks -------------------------------------------------------------------------------------------------------
@implements(SAEState, "on_request")
def _request(ps, c, j, now):
    si, sf = ps.si, ps.sf
    sf[NOW] = now
    if not si[HAS_T0]:
        sf[WIN_T0] = now
        si[HAS_T0] = 1
    f = ps.req[R_FLAGS, j]
    if f & REFIT:  # SAECachePolicy._refit: the turnover time
        elapsed = now - sf[WIN_T0]
        if elapsed > 0 and si[WIN_INS]:
            rate = si[WIN_INS] / elapsed
            sf[INS_RATE] = 0.7 * sf[INS_RATE] + 0.3 * rate if si[HAS_RATE] else rate
            si[HAS_RATE] = 1
            si[WIN_INS] = 0
            sf[WIN_T0] = now
        if si[HAS_RATE] and sf[INS_RATE] != 0.0:
            sf[HORIZON] = sf[CAPACITY] / sf[INS_RATE]
            si[HAS_HOR] = 1
        if f & REBIN_AT:
            k = si[RB_NEXT]
            si[RB_NEXT] = k + 1
            _rebin_blocks(ps, c.rec, c.sc[N], k)
        if si[EMP]:  # SAECachePolicy._empirical_gaps: the next row of tables, built by Twin.prepare
            si[EMP_ROW] += 1
        if si[SELECT]:  # the arrival moved the structural rate before the policy's refit
            _choose_shapes(ps, c.rec, now, ps.req_pst[j] if f & STRUCTURAL else sf[PST])
        _changed(ps)
    q = ps.req[R_Q, j]
    ps.req[R_LIVE, j] = 1
    si[PQ] = q
    si[OQ] = q
    si[SLOT] = ps.req[R_SLOT, j]
    si[NPROMPT] = ps.n_prompt[j]
    if f & STRUCTURAL:  # SAECachePolicy.on_request: the structural groups' density moved, no other group's
        sf[PST] = ps.req_pst[j]
        for g in range(ST * _TYPES, (ST + 1) * _TYPES):
            ps.gl[G_EPOCH, g] = -1  # rescored at the next selection
            ps.gi[G_DIRTY, g] = 1  # a sampled one scanned again (an unsampled one is rescored over its candidates)
        si[STALE] = 1


@implements(SAEState, "on_complete")
def _complete(ps, c, j, now):
    si = ps.si
    si[COMPLETING] = j
    si[OREASON] = ps.req[R_REASON, j]
    if ps.req[R_LIVE, j]:
        ps.req[R_LIVE, j] = 0
        si[OQ] = ps.req[R_Q, j]
        si[SLOT] = ps.req[R_SLOT, j]
    si[NPROMPT] = ps.n_prompt[j]


@implements(SAEState, "on_insert")
def _insert(ps, c, s, now):
    si = ps.si
    rec = c.rec
    t = rec[s, BTYPE]
    output = rec[s, DEPTH] >= si[NPROMPT]
    if not si[MULTI]:
        q = CH
    elif t == _REASONING or (output and si[OREASON]):
        q = PE
    elif t <= _TEMPLATE:
        q = ST
    else:
        q = si[OQ] if output else si[PQ]
    rec[s, QUEUE] = q
    rec[s, STAMP] = 0
    rec[s, GROUP] = -1
    rec[s, WHERE] = 0
    if si[SAMPLED]:  # x_b, the block's relative offset
        ps.offset[s] = min(rec[s, DEPTH] / si[NPROMPT], 1.0) if q == ST else 0.0
    ps.qn[Q_OCC, q] += 1
    si[WIN_INS] += 1


@implements(SAEState, "on_hit")
def _hit(ps, c, path, i0, i1, now):
    rec, qn = c.rec, ps.qn
    for i in range(i0, i1):
        qn[Q_HITS, rec[path[i], QUEUE]] += 1
    if ps.si[SELECT]:
        memo = ps.shm[M_HIT]
        for i in range(i0, i1):
            _ended(ps, rec, path[i], now, True, memo)


@implements(SAEState, "on_acquire")
def _acquire(ps, c, path, i0, i1):
    rec = c.rec
    _flush(ps, rec)
    ps.si[STALE] = 1
    for i in range(i0, i1):
        s = path[i]
        if rec[s, WHERE] != 0:
            _remove(ps, rec, s)


@implements(SAEState, "on_release")
def _release(ps, c, path, i0, i1, now):
    rec = c.rec
    si = ps.si
    _flush(ps, rec)
    si[STALE] = 1
    seq = si[SEQ]
    slot = si[SLOT] * GROUP_SLOT
    typed = si[TYPED]
    by = si[COMPLETING] if si[REBIN] else NOT_RELEASED
    for i in range(i1 - 1, i0 - 1, -1):
        s = path[i]
        seq += 1
        rec[s, STAMP] = seq
        q = rec[s, QUEUE]
        g = q * _TYPES + (rec[s, BTYPE] if typed else 0)
        if q == CH or q == AG:
            g += slot
            if si[VALUED]:
                g += N_GROUPS * ps.vbin[rec[s, DEPTH]]
            if by != NOT_RELEASED:
                ps.relby[s] = by
        rec[s, GROUP] = g
        if rec[s, NCHILD] == 0 or (q == ST and si[SAMPLED]):  # a sampled structural group lists inner nodes too
            _add(ps, rec, s, 1)
            ps.gi[G_DIRTY, g] = 1
        if si[SELECT]:
            _idle(ps, s, now, seq)
    si[SEQ] = seq


@implements(SAEState, "on_leaf")
def _leaf(ps, c, s):
    rec = c.rec
    if rec[s, PIN] != 0:
        return
    if s == ps.si[NEXT_UP]:
        ps.si[DEFERRED] = s  # evict will most likely take it next
        return
    _flush(ps, rec)
    _return(ps, rec, s)


@inline
def _take(ps, c, v, now):
    """SAECachePolicy._take: forget the victim (evicted at ``now``); note its parent as the likely next one."""
    rec = c.rec
    si = ps.si
    if si[SELECT]:  # (before rebin forgets its releasing request, which its bin needs)
        si[SHAPE_EVICTED] += 1
        _ended(ps, rec, v, now, False, ps.shm[M_EVICT])
    q = rec[v, QUEUE]
    ps.qn[Q_OCC, q] -= 1
    stamp = rec[v, STAMP]
    if rec[v, WHERE] != 0:
        _remove(ps, rec, v)
    rec[v, STAMP] = 0
    group = rec[v, GROUP]
    if si[REBIN]:
        group = _current_group(ps, rec, v)  # SAECachePolicy._take: a parent the shortcut took never returned
        ps.relby[v] = NOT_RELEASED
    p = rec[v, PARENT]
    if p >= 0 and rec[p, QUEUE] == q:
        if q == CH or q == AG:  # rebin: the parent's group if it returned now
            same = (_current_group(ps, rec, p) if si[REBIN] else rec[p, GROUP]) == group
        else:  # a sampled structural group weighs each block's offset: its parent scores apart
            same = not (q == ST and si[SAMPLED]) and (not si[TYPED] or rec[p, BTYPE] == rec[v, BTYPE])
        if same:
            si[NEXT_UP] = p
            si[NEXT_STAMP] = stamp + 1
    return v


@implements(SAEState, "evict")
def _evict(ps, c, now):
    si, sf = ps.si, ps.sf
    at = now  # gap_select: the victim's idle time ends here (the ranking reads the clock's step)
    step = sf[CLOCK] * (sf[HORIZON] if si[HAS_HOR] else sf[EXP_MEAN_CH])  # SAECachePolicy.clock
    if 0.0 < step < math.inf:
        now = np.ceil(now / step) * step
    rec = c.rec
    v = -1
    up = si[NEXT_UP]
    if up >= 0:
        si[NEXT_UP] = -1
        if si[CAND_OK] and sf[CAND_NOW] == now and not si[STALE] and rec[up, STAMP] == si[NEXT_STAMP] \
                and rec[up, PIN] == 0 and rec[up, NCHILD] == 0:
            if si[DEFERRED] == up:
                si[DEFERRED] = -1
            v = up
    if v < 0:
        _flush(ps, rec)
        rescore = not (si[CAND_OK] and sf[CAND_NOW] == now)
        full = rescore or si[STALE]
        if full:
            si[CAND_OK] = 1
            sf[CAND_NOW] = now
            si[STALE] = 0
        v = _select(ps, c, now, full, rescore)
        if v < 0:
            return -1
        si[LAST_G] = rec[v, GROUP]
        ps.gi[G_DIRTY, rec[v, GROUP]] = 1
    return _take(ps, c, v, at)  # one call site: the kernel inlines it once (each copy costs compile time)


@jit
def _build(ps, rec, slots):
    for s in slots:
        _add(ps, rec, s, rec[s, WHERE])


def _opt(x: float) -> tuple[float, int]:
    """A state's optional number (NaN: none) as (value, known)."""
    return (0.0, 0) if math.isnan(x) else (float(x), 1)


@register
class SAECacheTwin(Twin):
    classes = (SAECachePolicy, SAECachePaperPolicy)

    @classmethod
    def reason(cls, policy: Any) -> str | None:
        sw = policy.switches
        if not sw["lognormal"]:
            return "saecache: exponential gaps (lognormal=False) have no compiled engine"
        if sw["density"] and sw["position_decay"]:
            return "saecache: position decay under the hit density (density=True) has no compiled engine"
        return None

    def load(self, state: dict[str, Any], n: int, core: Any) -> None:
        policy, trace = self.policy, self.trace
        self._core = core
        sw = policy.switches
        # The policy's arrivals model, fresh (its facts about the trace shared), holds the state from here on.
        arrivals = self.arrivals = policy.arrivals.fresh()
        if arrivals.trace is not trace:
            arrivals.bind(trace)
        arrivals.import_state(state)
        m = len(trace)
        horizon, has_hor = _opt(state["horizon"])
        ins_rate, has_rate = _opt(state["ins_rate"])
        win_t0, has_t0 = _opt(state["window_t0"])
        cand_now, cand_ok = _opt(state["cand_now"])
        sampled = not sw["density"] or sw["position_decay"]  # as SAECachePolicy._st_sampled
        si = np.zeros(36, dtype=np.int64)
        si[LAST_G], si[REBIN], si[COMPLETING], si[EMP] = -1, sw["rebin"], -1, _shaped(sw)
        select = sw["gap_select"]
        si[SELECT], si[SHAPE_SWITCHES] = select, state["gap_switches"] if select else 0
        si[SHAPE_EVICTED] = state["gap_evicted"] if select else 0
        si[IDLE_EVERY] = idle_every(self.capacity, policy.idle_sample)
        si[[SEQ, NEXT_UP, NEXT_STAMP, DEFERRED, STALE, CAND_OK, WIN_INS, HAS_T0, HAS_RATE, HAS_HOR, MULTI,
            TYPED, PQ, OQ, SLOT, NPROMPT, OREASON, DENS, SAMPLED, DECAY, VALUED]] = [
            state["released"], state["next_up"], state["next_stamp"], state["deferred"], state["stale"], cand_ok,
            state["window_inserted"], has_t0, has_rate, has_hor, sw["multi_queue"], sw["type_weights"],
            state["prompt_queue"], state["output_queue"], state["slot"], state["n_prompt"],
            state["output_reasoning"], sw["density"], sampled, sw["position_decay"], sw["hit_value"]]
        sf = np.zeros(12)
        sf[[CAND_NOW, NOW, HORIZON, INS_RATE, WIN_T0, PST, MIN_DT, CAPACITY, CLOCK, CENSUS]] = [
            cand_now, state["now"], horizon, ins_rate, win_t0, arrivals.p_structural, policy.min_dt,
            float(self.capacity), policy.clock_step, policy.census]
        req = np.zeros((5, m), dtype=np.int8)
        req[R_REASON] = arrivals.reasoning_of
        live = state["inflight"]
        req[R_LIVE, live], req[R_Q, live], req[R_SLOT, live] = 1, state["inflight_queue"], state["inflight_slot"]
        # a block's depth is below its request's blocks (prompt and output): the value bins of every depth
        depths = int(np.max(np.diff(trace.prompt_offsets) + np.diff(trace.output_offsets), initial=1))
        vbin = np.array(value_bins(depths, trace.block_size, policy.value_context) if sw["hit_value"] else [0],
                        dtype=np.int32)
        groups = N_GROUPS * (int(vbin.max()) + 1)
        gi = np.zeros((G_TAILSTAMP + 1, groups), dtype=np.int32)
        gi[G_DIRTY], gi[G_HN, :N_ST], gi[G_CAND:] = 1, -1, -1
        gl = np.zeros((G_CSTAMP + 3, groups), dtype=np.int64)
        gl[G_EPOCH] = -1
        qn = np.zeros((2, N_QUEUES), dtype=np.int64)
        qn[Q_OCC], qn[Q_HITS] = state["occupancy"], state["queue_hits"]
        self.state = SAEState(
            req=req, n_prompt=np.asarray(arrivals.n_prompt_of, dtype=np.int32), req_pst=np.zeros(m), gi=gi, gl=gl,
            gf=np.zeros((G_CUNTIL + 3, groups)),
            slotp=np.array([slot_p(k) for k in range(N_SLOTS + 1)]), gaps=np.zeros((N_QUEUES, GAP_EXP + 1)),
            coef=np.zeros(groups // N_GROUPS * GROUP_SLOT), vbin=vbin, root=np.full(1, -1, dtype=np.int64), qn=qn,
            offset=np.zeros(core.rec.shape[0] if sampled else 1),
            hslot=np.zeros((N_ST, 2 * policy.sample), dtype=np.int32),
            hstamp=np.zeros((N_ST, 2 * policy.sample), dtype=np.int64), si=si, sf=sf,
            relby=np.full(core.rec.shape[0] if sw["rebin"] else 1, NOT_RELEASED, dtype=np.int32),
            bslot=np.zeros(m if sw["rebin"] else 1, dtype=np.int8),
            bmark=np.zeros(m if sw["rebin"] else 1, dtype=np.int64), emp=np.zeros((1, 1)),
            relt=np.full(core.rec.shape[0] if select else 1, math.nan), gll=np.zeros((N_QUEUES, 2), dtype=np.int64),
            sidx=np.zeros(core.rec.shape[0] if select else 1, dtype=np.int32),
            spos=np.full(core.rec.shape[0] if select else 1, -1, dtype=np.int32),
            shm=np.full((2, 6), math.nan),
            **self._model_rows(m))
        if select:  # gap_shape.GapShapeChoice's state: each idle block's release, the sums, the choices
            self.state.relt[:n] = state["idle_since"]
            kept = np.flatnonzero(~np.isnan(state["idle_since"]) & (np.abs(state["stamp"]) & (si[IDLE_EVERY] - 1) == 0))
            self.state.sidx[:kept.size], self.state.spos[kept] = kept, np.arange(kept.size)
            si[N_SAMPLED] = kept.size
            self.state.gll[_SHAPED] = state["gap_loglik"]
            self.state.gaps[_SHAPED, GAP_EXP] = state["gap_exponential"]
        si[RB_MARK] = 1
        si[RB_FEAT] = sw["rebin"] and arrivals.model.features
        if sw["rebin"]:  # as SAECachePolicy.import_state: releasing requests before any completion are forgotten
            by = state["released_by"]
            self.state.relby[:n] = np.where(by >= 0, by, NOT_RELEASED)
            asked = np.asarray(state["rebin_requests"], dtype=np.int64)
            self.state.bslot[asked], self.state.bmark[asked] = state["rebin_bins"], 1
        self._rebin_last = rebin_last(state) if sw["rebin"] else None  # SAECachePolicy._rebin_last
        self._rb_rows = 0  # rows of rbr, rbb the window's rebinnings filled
        if sampled and "offset" in state:
            self.state.offset[:n] = state["offset"]
        self.compiled = compiled(arrivals)  # the per-arrival state, as arrays (None: Python arrivals)
        self._constants()
        # empirical_gaps or gap_mixture: the twin's own, on its arrivals' raw gaps
        self._emp_shapes = EmpiricalShapes(mixture=sw["gap_mixture"], growth=policy.refit_growth)
        if _shaped(sw):  # the tables the policy ranked with when it exported its state
            used = state.get("empirical_used")
            prior = state.get("mixture_prior")
            self._emp_now = self._emp_tables(None if used is None else (int(used[0]), int(used[1])), prior)
        rec = core.rec
        queue, types = rec[:n, QUEUE], rec[:n, BTYPE]
        code = queue * _TYPES + (types if sw["type_weights"] else 0)
        temporal = (queue == CH) | (queue == AG)
        rec[:n, STAMP] = state["stamp"]
        rec[:n, GROUP] = np.where(temporal, state["group"], np.where(state["stamp"] != 0, code, -1))
        rec[:n, WHERE] = state["where"]
        # the treap in stamp order: the same shape whatever the order, this one is cheap
        members = np.flatnonzero(state["where"])
        _build(self.state, rec, members[np.argsort(state["stamp"][members], kind="stable")].astype(np.int64))

    def _constants(self) -> None:
        """SAECachePolicy.params_changed: the gap distributions and weights of the current parameters."""
        policy, ps = self.policy, self.state
        params, sw = policy.params, policy.switches
        gaps = gap_models(params, sw["lognormal"])
        self.arrivals.gaps = (gaps[CH], gaps[AG])
        for q, g in gaps.items():  # (gaps[q, GAP_EXP], gap_select's choice, stays: SAECachePolicy._read_shapes)
            ps.gaps[q, :4] = g.constants()
            ps.gaps[q, GAP_SIGMA] = g.sigma
        ps.shm[:] = math.nan  # gap_select's memo: its terms were of the old parameters
        mu, sigma = params["mu_chat"], params["sigma_chat"]
        ps.sf[EXP_MEAN_CH] = math.exp(mu + sigma * sigma / 2)
        ps.sf[GAMMA] = params["gamma"]
        alpha = [1.0, params["alpha_st"], params["alpha_ch"], params["alpha_ag"]] if sw["adaptive_alpha"] \
            else [1.0] * N_QUEUES
        w = [params[f"w_{t.name.lower()}"] for t in TokenType] if sw["type_weights"] else [1.0] * len(TokenType)
        for k in range(ps.coef.size // GROUP_SLOT):  # as SAECachePolicy._constants: structural blocks weigh 1
            for q in range(N_QUEUES):
                for t in range(len(TokenType)):
                    c = alpha[q] * w[t]
                    if sw["hit_value"] and (q == CH or q == AG):
                        c *= value_weight(k)
                    ps.coef[k * GROUP_SLOT + q * _TYPES + t] = c

    def _model_rows(self, m: int) -> dict[str, np.ndarray]:
        """rebin's arrays for the model's answers (SAEState: rbucket, rz, rbr, rbb), sized for ``m`` requests: a row
        of rates and beta for each rebinning a window can hold (one entry each when off)."""
        if not self.policy.switches["rebin"]:
            return {"rbucket": np.zeros(1, dtype=np.int32), "rz": np.zeros((1, 1)), "rbr": np.zeros((1, 1)),
                    "rbb": np.zeros((1, 1))}
        model = self.arrivals.model
        features = model.features
        rows = m // (REFIT_EVERY * self.policy.rebin_every) + 1
        return {"rbucket": np.asarray(model.turn_buckets, dtype=np.int32),
                "rz": model.feature_table[:m] if features else np.zeros((1, 1)),
                "rbr": np.zeros((rows, model.rates.size)), "rbb": np.zeros((rows, model.beta.size))}

    def prepare(self, a: int, b: int) -> None:
        """The arrivals of requests ``a .. b-1``, run ahead of the kernel (module docstring). Under rebin, in pieces
        that end at each rebinning refit, where the model's rates and beta are kept for the kernel (rbr, rbb) and the
        request is flagged REBIN_AT. Under empirical_gaps or gap_mixture every refit rebuilds the gap tables, a row
        of emp each (row 0: those of the window's start); they rest on the gaps completed by that refit and on the
        window's parameters alone (they move between windows), so they are built after the arrivals, from the gaps
        counted per request."""
        sw = self.policy.switches
        shaped = _shaped(sw)
        counts = self._arrive_rebinning(a, b, shaped) if sw["rebin"] else self._arrive(a, b, shaped)
        if not shaped:
            return
        rows = [self._emp_now[0]]
        for j in np.flatnonzero(self.state.req[R_FLAGS, a:b] & REFIT).tolist():
            self._emp_now = self._emp_tables(upto=(int(counts[0, j]), int(counts[1, j])))
            rows.append(self._emp_now[0])
        self._emp_rows(rows)

    def _arrive_rebinning(self, a: int, b: int, gaps: bool) -> np.ndarray | None:
        """_arrive, keeping the model's rates and beta at each refit that rebins (rebin: where the model has moved
        enough since the last rebinning, SAECachePolicy._model_moved). The compiled arrivals check that in their
        kernel and stop only there (set_rebin); the Python arrivals run in pieces that end at each refit that may
        rebin, checked here."""
        ps = self.state
        ps.si[RB_NEXT] = 0
        self._rb_rows = 0
        if self.compiled is not None:
            self.compiled.set_rebin(self.policy.rebin_every, self.policy.rebin_move, self._rebin_last, self._rebinned)
            out = self._arrive(a, b, gaps)
            self.compiled.set_rebin(0, 0.0, self._rebin_last, self._rebinned)
            return out
        done = self.arrivals.arrivals
        every = REFIT_EVERY * self.policy.rebin_every
        x, parts = a, []
        for y in range(a + (-(done + 1)) % every, b, every):  # request i is arrival done + 1 + i - a
            parts.append(self._arrive(x, y + 1, gaps))
            x = y + 1
            if model_moved(self.arrivals.model.rates, self.arrivals.model.beta, self._rebin_last,
                           self.policy.rebin_move):
                self._rebinned(y)
        parts.append(self._arrive(x, b, gaps))
        return np.concatenate(parts, axis=1) if gaps else None

    def _rebinned(self, y: int) -> None:
        """The refit at request ``y`` rebins: its model (rates and beta) is the last rebinning's from now on, and a
        row of rbr, rbb for the kernel."""
        ps = self.state
        if not ps.req[R_FLAGS, y] & REFIT:
            raise RuntimeError(f"saecache twin: a rebinning at request {y}, which does not refit")
        rates = np.array(self.compiled.rates if self.compiled is not None else self.arrivals.model.rates)  # a copy
        beta = self.arrivals.model.beta.copy()
        self._rebin_last = (rates, beta)
        ps.req[R_FLAGS, y] |= REBIN_AT
        ps.rbr[self._rb_rows], ps.rbb[self._rb_rows] = rates, beta
        self._rb_rows += 1
        if self.compiled is not None:
            self.compiled.set_rebin(self.policy.rebin_every, self.policy.rebin_move, self._rebin_last, self._rebinned)

    def _emp_tables(self, used: tuple[int, int] | None = None, prior: Any = None,
                    upto: tuple[int, int] | None = None) -> tuple[list[np.ndarray], Any, Any]:
        """SAECachePolicy._empirical_gaps: the chat and agent tables (survival, integral; GridGaps.table, or the
        log-normal's mark) from the gaps the arrivals completed so far (each queue's first ``upto``: so far as of an
        earlier arrival; or its first ``used``, under ``prior`` when given: as a state had them), and how many each
        rests on and its prior (EmpiricalShapes.used, priors)."""
        shapes = self._emp_shapes.update(self.arrivals.raw_gaps, self.policy.params, used, prior, upto)
        rows = [x for q in (CH, AG) for x in (shapes[q].table() if shapes[q] is not None else _LOGNORMAL_ROWS)]
        return rows, self._emp_shapes.used, self._emp_shapes.priors

    def _emp_rows(self, rows: list[list[np.ndarray]]) -> None:
        """Write the window's rows of tables into emp (grown in doublings) and start at row 0."""
        ps = self.state
        need = 1 + 4 * len(rows)
        if ps.emp.shape[0] < need or ps.emp.shape[1] != EMPIRICAL_GRID.size:
            emp = np.zeros((max(need, 2 * ps.emp.shape[0]), EMPIRICAL_GRID.size))
            emp[0] = EMPIRICAL_GRID
            self.state = ps = ps._replace(emp=emp)
        for r, tables in enumerate(rows):
            ps.emp[1 + 4 * r:5 + 4 * r] = tables
        ps.si[EMP_ROW] = 0

    def _arrive(self, a: int, b: int, gaps: bool = False) -> np.ndarray | None:
        """Requests ``a .. b-1`` arrive; with ``gaps`` (empirical_gaps, gap_mixture), the chat and agent gaps they
        complete join the arrivals' raw gaps (the Python arrivals keep them themselves), and the chat and agent raw
        gaps there are after each request are returned (int64 [2, b - a])."""
        ps = self.state
        if self.compiled is not None:
            st = self.compiled.state
            if gaps:  # each request's session's last arrival before this piece (Arrivals.arrive's gap reads it)
                sess = st.session[a:b]
                before = np.full(sess.size, np.nan)  # a request of no session (-1) completes no gap
                known = sess >= 0
                before[known] = st.sess_t[sess[known]]
            self.compiled.run(a, b, ps.req[R_Q], ps.req[R_SLOT], ps.req[R_FLAGS], ps.req_pst)
            return self._record_gaps(a, b, sess, before) if gaps else None
        arrivals, trace = self.arrivals, self.trace
        t = trace.t[a:b].tolist()
        q, slot, flags, pst, counts = [], [], [], [], []
        raw = arrivals.raw_gaps
        for i, now in zip(range(a, b), t, strict=True):
            qi, si, refit, structural = arrivals.arrive(trace, i, now)
            q.append(qi)
            slot.append(si)
            flags.append(REFIT * refit + STRUCTURAL * structural)
            pst.append(arrivals.p_structural)
            if gaps:
                counts.append((len(raw[CH]), len(raw[AG])))
        ps.req[R_Q, a:b], ps.req[R_SLOT, a:b], ps.req[R_FLAGS, a:b], ps.req_pst[a:b] = q, slot, flags, pst
        return np.array(counts, dtype=np.int64).reshape(-1, 2).T if gaps else None

    def _record_gaps(self, a: int, b: int, sess: np.ndarray, before: np.ndarray) -> np.ndarray:
        """Arrivals.arrive's raw gaps of requests ``a .. b-1`` (sessions ``sess``, whose last arrivals before them
        were ``before``), which the compiled arrivals count but do not keep: a request of a known session in the chat
        or agent queue completes the gap since its session's previous arrival, that in this piece or before it.
        Returns the chat and agent raw gaps there are after each request (int64 [2, b - a])."""
        t = self.trace.t[a:b]
        last = before.copy()
        order = np.lexsort((np.arange(sess.size), sess))
        same = sess[order[1:]] == sess[order[:-1]]
        last[order[1:][same]] = t[order[:-1][same]]  # the previous request of the same session in the piece
        q = self.state.req[R_Q, a:b]
        gap = t - last  # NaN where the session had no arrival before
        keep = (sess >= 0) & (gap > 0)
        raw = self.arrivals.raw_gaps
        counts = np.empty((2, b - a), dtype=np.int64)
        for k, queue in enumerate((CH, AG)):
            mine = keep & (q == queue)
            counts[k] = len(raw[queue]) + np.cumsum(mine)
            raw[queue].extend(gap[mine].tolist())
        return counts

    def _python_arrivals(self):
        """The arrivals object, with the compiled arrivals' state written back into it."""
        if self.compiled is not None:
            self.compiled.save()
        return self.arrivals

    def export(self, n: int, core: Any) -> dict[str, Any]:
        ps = self.state
        flush(sets.py_func(ps), core.rec)
        si, sf = ps.si, ps.sf
        rec = core.rec[:n]
        queue = rec[:, QUEUE]
        temporal = (queue == CH) | (queue == AG)
        inflight = np.flatnonzero(ps.req[R_LIVE])
        nan = math.nan
        return {"stamp": rec[:, STAMP].astype(np.int64), "where": rec[:, WHERE].astype(np.int64),
                "group": np.where(temporal, rec[:, GROUP], -1).astype(np.int64),
                "released": int(si[SEQ]), "next_up": int(si[NEXT_UP]),
                "next_stamp": int(si[NEXT_STAMP]), "deferred": int(si[DEFERRED]), "stale": int(si[STALE]),
                "cand_now": float(sf[CAND_NOW]) if si[CAND_OK] else nan, "now": float(sf[NOW]),
                "prompt_queue": int(si[PQ]), "output_queue": int(si[OQ]), "slot": int(si[SLOT]),
                "n_prompt": int(si[NPROMPT]), "output_reasoning": int(si[OREASON]), "occupancy": ps.qn[Q_OCC].copy(),
                "queue_hits": ps.qn[Q_HITS].copy(), "horizon": float(sf[HORIZON]) if si[HAS_HOR] else nan,
                "ins_rate": float(sf[INS_RATE]) if si[HAS_RATE] else nan, "window_inserted": int(si[WIN_INS]),
                "window_t0": float(sf[WIN_T0]) if si[HAS_T0] else nan, "inflight": inflight.astype(np.int64),
                "inflight_queue": ps.req[R_Q, inflight].astype(np.int64),
                "inflight_slot": ps.req[R_SLOT, inflight].astype(np.int64), **self._python_arrivals().export_state(),
                **({"offset": np.where(queue == ST, ps.offset[:n], 0.0)} if self.policy.switches["position_decay"]
                   else {}),
                **(self._rebin_state(n) if self.policy.switches["rebin"] else {}),
                **({"empirical_used": np.array(self._emp_now[1], dtype=np.int64), "mixture_prior": self._emp_now[2]}
                   if _shaped(self.policy.switches) else {}),
                **({"idle_since": ps.relt[:n].copy(), "gap_loglik": ps.gll[_SHAPED].copy(),
                    "gap_exponential": ps.gaps[_SHAPED, GAP_EXP].astype(np.int64),
                    "gap_switches": int(si[SHAPE_SWITCHES]), "gap_evicted": int(si[SHAPE_EVICTED])}
                   if si[SELECT] else {})}

    def _rebin_state(self, n: int) -> dict[str, np.ndarray]:
        ps = self.state
        asked = np.flatnonzero(ps.bmark == ps.si[RB_MARK])
        return {"released_by": np.maximum(ps.relby[:n], -1).astype(np.int64), "rebin_requests": asked.astype(np.int64),
                "rebin_bins": ps.bslot[asked].astype(np.int64), **rebin_last_state(self._rebin_last)}

    def begin_window(self) -> None:  # SAECachePolicy.reset_window
        self.state.qn[Q_HITS] = 0
        if self.compiled is not None:
            self.compiled.reset_window()
        else:
            self.arrivals.reset_window()

    def params_changed(self) -> None:
        self._constants()
        if _shaped(self.policy.switches):  # SAECachePolicy.params_changed rebuilds them on every gap so far
            self._emp_now = self._emp_tables()
        # as Python: an inlined kernel called from Python is compiled afresh in every process (0.2 s; numba's
        # cache keeps only the functions it is asked to cache)
        _changed.py_func(self.state)

    def window_stats(self) -> dict[str, Any]:
        ps = self.state
        horizon = float(ps.sf[HORIZON]) if ps.si[HAS_HOR] else float(ps.sf[EXP_MEAN_CH])
        if not ps.si[DENS]:
            horizon = None
        if self.compiled is not None:
            self.compiled.stats_to_python()
        return window_stats(self.arrivals, ps.qn[Q_HITS].tolist(), ps.qn[Q_OCC].tolist(), self.policy.params, horizon,
                            ps.gaps[_SHAPED, GAP_EXP].astype(np.int64).tolist() if ps.si[SELECT] else None)

    def occupancy_by_queue(self, n: int) -> dict[int, int]:
        return {q: k for q, k in enumerate(self.state.qn[Q_OCC].tolist()) if k}
