"""The prefill server compiled: :class:`sae_env.serving.PrefillServer` over arrays, with its cost model.

The same FIFO chunked-prefill scheduler, iteration for iteration (see :mod:`sae_env.serving` for the rules): a
request's queue entry is its row of per-request arrays (requests are submitted in index order, so the queue is the
range ``QHEAD .. QTAIL`` of request ids and the formed completions the range ``DHEAD .. DTAIL``); an iteration's
duration is the cost model's ``batch_time`` of its chunks, computed with the same arithmetic in the same order (a
roofline, :class:`~sae_env.serving.RooflineCost`, or a calibration table, :class:`~sae_env.serving.
CalibrationTable`), so every first-token time is the same float. Decode times do not depend on the cache: they are
computed once per trace by the cost model itself (:func:`decode_times`).

``Srv`` also holds the replay's own timed state: the completion events (a binary heap of ``(time, request)``, the
order of the Python replay's ``heapq`` of ``(time, request, 0)``), each in-flight request's deepest held slot and
path length (its path is the chain of parents above that slot), and the window's TTFT and queueing delays.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from sae_env.fast_engine.jit import inline, jit

__all__ = ["Srv", "decode_times", "load_server", "new_server", "reset_server", "save_server", "server_reason"]

# Integer scalars: queue range, formed-completion range, events in the heap, iterations, prefilled tokens, TTFTs
# recorded this window; the token budget and the sequence limit.
QHEAD, QTAIL, DHEAD, DTAIL, EVSIZE, ITERS, PREFILLED, NOUT, BUDGET, MAXSEQS = range(10)
# Float scalars: end of the last iteration, the clock (no arrival before it), the last arrival, busy time.
FREE_AT, MIN_ARR, LAST_ARR, BUSY = range(4)
# Cost model kinds and the roofline's constants (RooflineCost's private products, recomputed from its public
# fields by the same expressions).
ROOFLINE, TABLE = 0, 1
NOT_HELD = -2  # a request's held slot when it is not in flight
LIN, PAIR, WBYTES, KVB, FLOP_RATE, BYTE_RATE = range(6)


class Srv(NamedTuple):
    timed: bool
    ptok: np.ndarray  # int64 prompt tokens per request
    decode: np.ndarray  # float64 decode time per request
    block_size: int
    rem: np.ndarray  # int64 new tokens left to prefill
    ctx: np.ndarray  # int64 tokens before the next chunk (cached + prefilled)
    t_start: np.ndarray  # float64 start of its first chunk's iteration (NaN before)
    t_first: np.ndarray  # float64 first-token time (end of the iteration with its last chunk)
    qdelay: np.ndarray  # float64 queueing delay (start of its first chunk - arrival), once it is finished
    held: np.ndarray  # int32 deepest slot an in-flight request holds (-1: none; NOT_HELD: not in flight)
    held_len: np.ndarray  # int32 its path length
    ev_t: np.ndarray  # float64 completion events (heap)
    ev_i: np.ndarray  # int64
    si: np.ndarray  # int64 scalars
    sf: np.ndarray  # float64 scalars
    kind: int
    cf: np.ndarray  # float64 roofline constants
    xs: np.ndarray  # float64 table: new-token points
    cs: np.ndarray  # float64 table: cached-token points
    rows: np.ndarray  # float64 [cs, xs] times
    tail: np.ndarray  # float64 [cs] slope past the last point
    ttft_out: np.ndarray  # float64 this window's TTFTs (ms), in the order the Python replay records them
    queue_out: np.ndarray  # float64 and queueing delays (ms)


def server_reason(server: Any) -> str | None:
    """Why the compiled server cannot stand in for ``server`` (None if it can)."""
    from sae_env.serving import CalibrationTable, PrefillServer, RooflineCost

    if type(server) is not PrefillServer:
        return f"the compiled engine models sae_env.serving.PrefillServer, not {type(server).__name__}"
    if type(server.cost) not in (RooflineCost, CalibrationTable):
        return f"the compiled engine computes RooflineCost and CalibrationTable costs, not {type(server.cost).__name__}"
    return None


def decode_times(server: Any, trace: Any) -> np.ndarray:
    """Each request's decode time, as the replay asks the server for it."""
    out_tok = trace.output_tokens.tolist()
    ctx = (trace.prompt_tokens + trace.output_tokens).tolist()
    decode = server.decode_time
    return np.array([decode(o, c) for o, c in zip(out_tok, ctx, strict=True)], dtype=np.float64)


def new_server(server: Any, trace: Any, timed: bool) -> Srv:
    """The compiled state of a fresh ``server`` for ``trace`` (a placeholder of empty arrays when not ``timed``)."""
    from sae_env.serving import CalibrationTable

    n = len(trace) if timed else 0
    f64, i64, i32 = np.float64, np.int64, np.int32
    kind, cf = ROOFLINE, np.zeros(6)
    xs = cs = tail = np.zeros(0)
    rows = np.zeros((0, 0))
    if timed:
        cost = server.cost
        if isinstance(cost, CalibrationTable):
            kind = TABLE
            xs, cs, rows, tail = (np.array(a, dtype=f64) for a in cost.grid())
        else:
            cf = np.array(cost.terms(), dtype=f64)
    si = np.zeros(10, dtype=i64)
    sf = np.array([-math.inf, -math.inf, -math.inf, 0.0])
    if timed:
        si[BUDGET], si[MAXSEQS] = server.token_budget, server.max_num_seqs
    return Srv(timed=bool(timed), ptok=trace.prompt_tokens.astype(i64) if timed else np.zeros(0, i64),
               decode=decode_times(server, trace) if timed else np.zeros(0),
               block_size=int(trace.block_size), rem=np.zeros(n, i64), ctx=np.zeros(n, i64),
               t_start=np.full(n, np.nan), t_first=np.zeros(n), qdelay=np.zeros(n), held=np.full(n, NOT_HELD, i32),
               held_len=np.zeros(n, i32), ev_t=np.zeros(n), ev_i=np.zeros(n, i64), si=si, sf=sf, kind=kind, cf=cf,
               xs=xs, cs=cs, rows=rows, tail=tail, ttft_out=np.zeros(n), queue_out=np.zeros(n))


def reset_server(sv: Srv) -> None:
    """Back to a fresh server with nothing in flight (the decode times stay: they belong to the trace)."""
    sv.si[:BUDGET] = 0
    sv.sf[:] = -math.inf, -math.inf, -math.inf, 0.0
    sv.held[:] = NOT_HELD
    sv.held_len[:] = 0


def load_server(sv: Srv, state: dict[str, Any], t: np.ndarray) -> None:
    """Take a :meth:`~sae_env.serving.PrefillServer.export_state` (its queue and formed completions are ranges of
    request ids: requests are submitted in order, finished from the queue's head, returned from the completions')."""
    q, d = state["queue_req"], state["done_req"]
    for ids in (q, d):
        if ids.size and not np.array_equal(ids, np.arange(ids[0], ids[0] + ids.size)):
            raise ValueError("compiled server: the queue is not a range of consecutive requests")
    head = int(q[0]) if q.size else (int(d[-1]) + 1 if d.size else 0)
    if d.size and int(d[-1]) + 1 != head:
        raise ValueError("compiled server: the formed completions do not precede the queue")
    if q.size and not np.array_equal(state["queue_arrival"], t[q]):
        raise ValueError("compiled server: the queue's arrivals are not the trace's")
    sv.rem[q], sv.ctx[q], sv.t_start[q] = state["queue_rem"], state["queue_ctx"], state["queue_start"]
    sv.t_first[d], sv.qdelay[d] = state["done_first"], state["done_delay"]
    si, sf = sv.si, sv.sf
    si[QHEAD], si[QTAIL] = head, head + q.size
    si[DHEAD], si[DTAIL] = head - d.size, head
    si[ITERS], si[PREFILLED] = state["iterations"], state["prefilled_tokens"]
    sf[FREE_AT], sf[MIN_ARR], sf[LAST_ARR] = state["free_at"], state["min_arrival"], state["last_arrival"]
    sf[BUSY] = state["busy_time"]


def save_server(sv: Srv, t: np.ndarray) -> dict[str, Any]:
    """The state in :meth:`~sae_env.serving.PrefillServer.import_state`'s form."""
    si, sf = sv.si, sv.sf
    q = np.arange(si[QHEAD], si[QTAIL], dtype=np.int64)
    d = np.arange(si[DHEAD], si[DTAIL], dtype=np.int64)
    return {"queue_req": q, "queue_arrival": t[q], "queue_rem": sv.rem[q].copy(), "queue_ctx": sv.ctx[q].copy(),
            "queue_start": sv.t_start[q].copy(), "done_req": d, "done_first": sv.t_first[d].copy(),
            "done_delay": sv.qdelay[d].copy(), "free_at": float(sf[FREE_AT]), "min_arrival": float(sf[MIN_ARR]),
            "last_arrival": float(sf[LAST_ARR]), "iterations": int(si[ITERS]), "busy_time": float(sf[BUSY]),
            "prefilled_tokens": int(si[PREFILLED])}


# -- cost models ---------------------------------------------------------------------------------------------------
@inline
def _row_at(sv, j, n):
    """CalibrationTable._row_at."""
    xs, row = sv.xs, sv.rows[j]
    m = xs.size
    if n <= xs[0]:
        return row[0]
    if n >= xs[m - 1]:
        return row[m - 1] + sv.tail[j] * (n - xs[m - 1])
    i = np.searchsorted(xs, n, side="right")  # bisect_right: xs[i-1] <= n < xs[i]
    x0 = xs[i - 1]
    return row[i - 1] + (row[i] - row[i - 1]) * (n - x0) / (xs[i] - x0)


@inline
def _table_time(sv, new, cached):
    """CalibrationTable.prefill_time."""
    if new <= 0 or cached < 0:
        return 0.0
    cs = sv.cs
    m = cs.size
    if m == 1 or cached <= cs[0]:
        return _row_at(sv, 0, new)
    if cached >= cs[m - 1]:
        return _row_at(sv, m - 1, new)
    j = np.searchsorted(cs, cached, side="right")
    w = (cached - cs[j - 1]) / (cs[j] - cs[j - 1])
    return (1.0 - w) * _row_at(sv, j - 1, new) + w * _row_at(sv, j, new)


@inline
def _batch_time(sv, n_sum, pairs, kv, nc):
    """The cost model's batch_time of the iteration's chunks, from their sums (as the Python models sum them)."""
    if n_sum <= 0:
        return 0.0
    if sv.kind == TABLE:
        return _table_time(sv, n_sum, nc / n_sum)
    cf = sv.cf
    f = cf[LIN] * n_sum + cf[PAIR] * pairs
    b = cf[WBYTES] + cf[KVB] * kv
    return max(f / cf[FLOP_RATE], b / cf[BYTE_RATE])


# -- the scheduler ---------------------------------------------------------------------------------------------------
class Sched(NamedTuple):
    """The part of the server that forming an iteration reads and writes (the queue's rows, the scalars, the cost
    model), for :func:`_run_iteration`, which the kernels call rather than inline: a call copies every array it is
    passed, and the whole server holds 20 (inlining it instead made each timed kernel compile for longer)."""
    rem: np.ndarray
    ctx: np.ndarray
    t_start: np.ndarray
    t_first: np.ndarray
    qdelay: np.ndarray
    si: np.ndarray
    sf: np.ndarray
    kind: int
    cf: np.ndarray
    xs: np.ndarray
    cs: np.ndarray
    rows: np.ndarray
    tail: np.ndarray


@inline
def sched(sv):
    """The Sched of server ``sv`` (the same arrays)."""
    return Sched(sv.rem, sv.ctx, sv.t_start, sv.t_first, sv.qdelay, sv.si, sv.sf, sv.kind, sv.cf, sv.xs, sv.cs,
                 sv.rows, sv.tail)


@inline
def submit(sv, i, t_arrival, new_tokens, cached_tokens):
    """PrefillServer.submit (request ``i`` is the next one: the queue is a range of request ids)."""
    if not t_arrival >= sv.sf[LAST_ARR] or t_arrival < sv.sf[MIN_ARR]:
        raise ValueError("compiled server: an arrival before an earlier arrival or the server clock")
    if new_tokens == 0:  # vLLM recomputes the last prompt token of a full hit to get its logits
        new_tokens = 1
        cached_tokens = max(cached_tokens - 1, 0)
    sv.sf[LAST_ARR] = t_arrival
    sv.rem[i] = new_tokens
    sv.ctx[i] = cached_tokens
    sv.t_start[i] = np.nan
    sv.si[QTAIL] = i + 1


@jit
def _run_iteration(sv, t):
    """PrefillServer._run_iteration: form and run the next iteration; returns its start time (``sv``: the server's
    Sched)."""
    si, sf = sv.si, sv.sf
    head = si[QHEAD]
    s = max(sf[FREE_AT], t[head])
    budget = si[BUDGET]
    seqs = si[MAXSEQS]
    n_sum = 0
    pairs = 0
    kv = 0
    nc = 0
    finished = 0
    for i in range(head, si[QTAIL]):
        if t[i] > s or seqs == 0:
            break
        rem = sv.rem[i]
        k = rem if rem <= budget else budget
        ctx = sv.ctx[i]
        n_sum += k
        pairs += k * ctx + k * (k + 1) // 2
        kv += ctx + k
        nc += k * ctx
        if np.isnan(sv.t_start[i]):
            sv.t_start[i] = s
        sv.rem[i] = rem - k
        sv.ctx[i] = ctx + k
        budget -= k
        seqs -= 1
        if k == rem:
            finished += 1
        if budget == 0:
            break
    dur = _batch_time(sv, n_sum, pairs, kv, nc)
    if not (0.0 <= dur < math.inf):
        raise RuntimeError("compiled server: the cost model gave an iteration time that is not finite")
    e = s + dur
    sf[FREE_AT] = e
    si[ITERS] += 1
    sf[BUSY] += dur
    si[PREFILLED] += si[BUDGET] - budget
    for i in range(head, head + finished):
        sv.t_first[i] = e
        sv.qdelay[i] = sv.t_start[i] - t[i]
    si[QHEAD] = head + finished
    si[DTAIL] = head + finished
    return s


@inline
def advance_to(sv, t, now):
    """PrefillServer.advance_to: form the iterations that start before ``now``; the completions with a first token
    by ``now`` are then ``DHEAD ..`` up to the first later one."""
    if now < sv.sf[MIN_ARR]:
        raise ValueError("compiled server: time goes backwards")
    sv.sf[MIN_ARR] = now
    while sv.si[QHEAD] < sv.si[QTAIL] and max(sv.sf[FREE_AT], t[sv.si[QHEAD]]) < now:
        _run_iteration(sched(sv), t)


@jit
def drain(sv, t):
    """PrefillServer.drain: run everything queued."""
    s = -1.0
    ran = False
    sc = sched(sv)
    while sv.si[QHEAD] < sv.si[QTAIL]:
        s = _run_iteration(sc, t)
        ran = True
    if ran:
        sv.sf[MIN_ARR] = max(sv.sf[MIN_ARR], np.nextafter(s, math.inf))


# -- completion events -------------------------------------------------------------------------------------------
@inline
def _ev_less(sv, i, j):
    if sv.ev_t[i] != sv.ev_t[j]:
        return sv.ev_t[i] < sv.ev_t[j]
    return sv.ev_i[i] < sv.ev_i[j]


@inline
def _ev_swap(sv, i, j):
    x = sv.ev_t[i]
    sv.ev_t[i] = sv.ev_t[j]
    sv.ev_t[j] = x
    y = sv.ev_i[i]
    sv.ev_i[i] = sv.ev_i[j]
    sv.ev_i[j] = y


@inline
def push_event(sv, t_done, i):
    n = sv.si[EVSIZE]
    sv.ev_t[n] = t_done
    sv.ev_i[n] = i
    sv.si[EVSIZE] = n + 1
    while n > 0:
        p = (n - 1) // 2
        if not _ev_less(sv, n, p):
            break
        _ev_swap(sv, n, p)
        n = p


@inline
def pop_event(sv):
    """Remove the earliest event; returns its request."""
    i = sv.ev_i[0]
    n = sv.si[EVSIZE] - 1
    sv.si[EVSIZE] = n
    sv.ev_t[0] = sv.ev_t[n]
    sv.ev_i[0] = sv.ev_i[n]
    k = 0
    while True:
        c = 2 * k + 1
        if c >= n:
            break
        if c + 1 < n and _ev_less(sv, c + 1, c):
            c += 1
        if not _ev_less(sv, c, k):
            break
        _ev_swap(sv, k, c)
        k = c
    return i


@jit
def push_event_py(sv, t_done, i):
    """push_event, callable from Python (a state handed over)."""
    push_event(sv, t_done, i)
