"""The servers behind one :class:`Server` protocol: the FIFO chunked-prefill scheduler and the instant server.

A server turns a request's uncached prompt tokens into a time to first token on the trace clock; the replay
(:mod:`sae_env.replay`) submits requests in arrival order and collects completions as its clock advances.

**Prefill server** (:class:`PrefillServer`): vLLM-style FIFO scheduling with chunked prefill. Iteration ``i`` starts at
``s = max(end of iteration i-1, arrival of the queue head)`` and takes, in arrival order, the requests that have
arrived by ``s`` (arrival ``<= s``), up to ``token_budget`` new tokens and ``max_num_seqs`` requests; only the last
request of a batch may be cut (chunked), and its rest heads the next iteration. The iteration lasts the cost
model's ``batch_time`` of its chunks (for the roofline: the batch's FLOPs and bytes with the weights read once).
Defaults: ``token_budget = 8192`` (vLLM V1's ``max_num_batched_tokens`` for the offline ``LLM`` class on an A40, and
for ``vllm serve`` on >= 70 GiB GPUs such as the H200; ``vllm serve`` on an A40 defaults to 2048, pass that to
mimic it) and ``max_num_seqs = 256`` (vLLM's default below 70 GiB). Decode tokens of running requests are not
modelled (they would take one budget slot each): this is a prefill server, and TTFT is prefill-dominated.
A request with 0 new tokens (a full cache hit) is prefilled as 1 token after ``cached - 1``: vLLM always recomputes
the last prompt token to get its logits.

- ``t_first_token`` = end of the iteration holding the request's last chunk (no extra decode step: the first token
  is sampled from that pass); ``TTFT = t_first_token - arrival``; ``queue_delay`` = start of the first iteration
  holding one of its chunks ``- arrival``.
- **FIFO guarantee**: in submission (= arrival) order, first-chunk starts and first-token times are both
  non-decreasing. Two requests finish in the same iteration or the earlier-arrived one finishes first; at most one
  request is partly prefilled at any time.
- Event API for the replay: ``submit`` requests in non-decreasing arrival order; ``advance_to(t)`` forms every
  iteration that starts strictly before ``t`` (a request arriving at ``t`` could still join an iteration that
  starts at ``t``) and returns, in time order, the completions with ``t_first_token <= t``; formed completions
  past ``t`` are returned by a later call. ``drain()`` runs everything queued and returns all completions.
  An arrival earlier than the last ``advance_to`` time is a ValueError (it would rewrite formed iterations).

**Instant server** (:class:`InstantServer`, mode "instant"): no time passes; each request completes at its
arrival with ``queue_delay = NaN``, ``timed = False`` and ``simulate`` returns NaN TTFTs: a replay reports no TTFT.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from sae_env.serving.cost import CostModel

__all__ = ["DEFAULT_MAX_NUM_SEQS", "DEFAULT_TOKEN_BUDGET", "Completion", "InstantServer", "PrefillServer", "Server"]

DEFAULT_TOKEN_BUDGET = 8192
DEFAULT_MAX_NUM_SEQS = 256


class Completion(NamedTuple):
    """A request whose first token is out."""

    req_id: Any
    t_first_token: float
    queue_delay: float


@runtime_checkable
class Server(Protocol):
    """What the replay needs from a server: the event API, decode times, and whether time passes at all.

    ``timed`` False (the instant server) means no TTFT: the replay then serves every request at its arrival.
    """

    timed: bool
    cost: CostModel | None

    def reset(self) -> None:
        """Forget every request; the clock goes back to the beginning."""

    def submit(self, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int = 0) -> None:
        """Queue a request (arrivals non-decreasing, not before the last ``advance_to`` time)."""

    def advance_to(self, t: float) -> list[Completion]:
        """Completions with ``t_first_token <= t``, in time order."""

    def drain(self) -> list[Completion]:
        """Run everything queued; every outstanding completion."""

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill one request alone."""

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        """Seconds from a request's first output token to its last (how long it pins its blocks)."""

    @property
    def kv_bytes_per_token(self) -> int | None:
        """KV cache bytes per token of the served model, if known (a capacity in bytes needs it)."""


class _ArrivalClock:
    """The arrival order both servers enforce: arrivals non-decreasing, none before the last ``advance_to``."""

    def _reset_clock(self) -> None:
        self._min_arrival = -math.inf  # arrivals before this would change formed iterations
        self._last_arrival = -math.inf

    def _check_submit(self, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int) -> None:
        if not t_arrival >= self._last_arrival or t_arrival < self._min_arrival:
            raise ValueError(f"request {req_id!r}: arrival {t_arrival} is before an earlier arrival "
                             f"({self._last_arrival}) or the server clock ({self._min_arrival}); submit in "
                             f"arrival order and before advancing past it")
        if new_tokens < 0 or cached_tokens < 0:
            raise ValueError(f"request {req_id!r}: token counts must be non-negative, got new_tokens={new_tokens}, "
                             f"cached_tokens={cached_tokens}")
        self._last_arrival = t_arrival

    def _advance_clock(self, t: float) -> None:
        if t < self._min_arrival:
            raise ValueError(f"advance_to({t}): time goes backwards (the server is at {self._min_arrival})")
        self._min_arrival = t

    @staticmethod
    def _due(done: deque[Completion], t: float) -> list[Completion]:
        """The completions at the front of ``done`` (time order) whose first token is out by ``t``, taken off."""
        out = []
        while done and done[0].t_first_token <= t:
            out.append(done.popleft())
        return out


class PrefillServer(_ArrivalClock):
    """FIFO chunked-prefill server under a token budget (see the module docstring for the exact rules)."""

    timed = True

    def __init__(self, cost: CostModel, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS):
        for name, v in (("token_budget", token_budget), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.cost = cost
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.reset()

    def __repr__(self) -> str:
        return f"PrefillServer({self.cost!r}, token_budget={self.token_budget}, max_num_seqs={self.max_num_seqs})"

    def reset(self) -> None:
        """Forget every request; the clock goes back to the beginning."""
        # queue entries: [req_id, t_arrival, remaining new tokens, context (cached + prefilled), t_start or None]
        self._queue: deque[list[Any]] = deque()
        self._done: deque[Completion] = deque()  # formed, not yet returned; in time order
        self._free_at = -math.inf  # end of the last formed iteration
        self._reset_clock()
        self.iterations = 0
        self.busy_time = 0.0  # sum of iteration durations
        self.prefilled_tokens = 0

    @property
    def kv_bytes_per_token(self) -> int | None:
        return self.cost.kv_bytes_per_token

    def submit(self, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int = 0) -> None:
        """Queue a request. Arrivals must be non-decreasing and not before the last ``advance_to`` time."""
        self._check_submit(req_id, t_arrival, new_tokens, cached_tokens)
        if new_tokens == 0:  # vLLM recomputes the last prompt token of a full hit to get its logits
            new_tokens, cached_tokens = 1, max(cached_tokens - 1, 0)
        self._queue.append([req_id, t_arrival, new_tokens, cached_tokens, None])

    def _run_iteration(self) -> float:
        """Form and run the next iteration; returns its start time."""
        q = self._queue
        s = max(self._free_at, q[0][1])
        budget = self.token_budget
        seqs = self.max_num_seqs
        chunks = []
        finished = 0
        for entry in q:
            if entry[1] > s or seqs == 0:
                break
            rem = entry[2]
            k = rem if rem <= budget else budget
            chunks.append((k, entry[3]))
            if entry[4] is None:
                entry[4] = s
            entry[2] = rem - k
            entry[3] += k
            budget -= k
            seqs -= 1
            if k == rem:
                finished += 1
            if budget == 0:
                break
        dur = self.cost.batch_time(chunks)
        if not 0.0 <= dur < math.inf:
            raise RuntimeError(f"cost model {self.cost!r} gave an iteration time of {dur} s for chunks {chunks}")
        e = s + dur
        self._free_at = e
        self.iterations += 1
        self.busy_time += dur
        self.prefilled_tokens += self.token_budget - budget
        done = self._done
        for _ in range(finished):
            req_id, t_arr, _rem, _ctx, t_start = q.popleft()
            done.append(Completion(req_id, e, t_start - t_arr))
        return s

    def advance_to(self, t: float) -> list[Completion]:
        """Run every iteration that starts before ``t``; return completions with ``t_first_token <= t``."""
        self._advance_clock(t)
        q = self._queue
        while q and max(self._free_at, q[0][1]) < t:
            self._run_iteration()
        return self._due(self._done, t)

    def drain(self) -> list[Completion]:
        """Run everything queued (no more arrivals before it is done) and return all outstanding completions."""
        s = None
        while self._queue:
            s = self._run_iteration()
        if s is not None:  # a later arrival at s would have joined that iteration
            self._min_arrival = max(self._min_arrival, math.nextafter(s, math.inf))
        out = list(self._done)
        self._done.clear()
        return out

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.cost.prefill_time(new_tokens, cached_tokens)

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        return self.cost.decode_time(output_tokens, context_tokens, batch)

    # -- the state contract (sae_env.state): a timed replay moves between engines with its server ------------------
    def export_state(self) -> dict[str, Any]:
        """The queue (request ids must be ints), the formed completions not yet returned, the clock and the totals,
        as arrays and numbers (a first chunk's start is NaN until it has one)."""
        q, d = self._queue, self._done
        return {"queue_req": np.array([e[0] for e in q], dtype=np.int64),
                "queue_arrival": np.array([e[1] for e in q], dtype=np.float64),
                "queue_rem": np.array([e[2] for e in q], dtype=np.int64),
                "queue_ctx": np.array([e[3] for e in q], dtype=np.int64),
                "queue_start": np.array([math.nan if e[4] is None else e[4] for e in q], dtype=np.float64),
                "done_req": np.array([c.req_id for c in d], dtype=np.int64),
                "done_first": np.array([c.t_first_token for c in d], dtype=np.float64),
                "done_delay": np.array([c.queue_delay for c in d], dtype=np.float64),
                "free_at": self._free_at, "min_arrival": self._min_arrival, "last_arrival": self._last_arrival,
                "iterations": self.iterations, "busy_time": self.busy_time, "prefilled_tokens": self.prefilled_tokens}

    def import_state(self, state: dict[str, Any]) -> None:
        """Take back a state written by :meth:`export_state` (or by the compiled engine)."""
        self._queue = deque([int(r), a, int(rem), int(ctx), None if math.isnan(s) else s] for r, a, rem, ctx, s in zip(
            state["queue_req"].tolist(), state["queue_arrival"].tolist(), state["queue_rem"].tolist(),
            state["queue_ctx"].tolist(), state["queue_start"].tolist(), strict=True))
        self._done = deque(Completion(int(r), f, q) for r, f, q in zip(
            state["done_req"].tolist(), state["done_first"].tolist(), state["done_delay"].tolist(), strict=True))
        self._free_at, self._min_arrival = float(state["free_at"]), float(state["min_arrival"])
        self._last_arrival = float(state["last_arrival"])
        self.iterations, self.busy_time = int(state["iterations"]), float(state["busy_time"])
        self.prefilled_tokens = int(state["prefilled_tokens"])


class InstantServer(_ArrivalClock):
    """Mode "instant": no time passes; requests complete at arrival with no TTFT (``queue_delay`` NaN)."""

    timed = False
    cost = None

    def __init__(self) -> None:
        self.reset()

    def __repr__(self) -> str:
        return "InstantServer()"

    def reset(self) -> None:
        self._queue: deque[Completion] = deque()
        self._reset_clock()
        self.iterations = 0
        self.busy_time = 0.0
        self.prefilled_tokens = 0

    @property
    def kv_bytes_per_token(self) -> int | None:
        return None

    def submit(self, req_id: Any, t_arrival: float, new_tokens: int, cached_tokens: int = 0) -> None:
        self._check_submit(req_id, t_arrival, new_tokens, cached_tokens)
        self._queue.append(Completion(req_id, t_arrival, math.nan))

    def advance_to(self, t: float) -> list[Completion]:
        self._advance_clock(t)
        return self._due(self._queue, t)

    def drain(self) -> list[Completion]:
        out = list(self._queue)
        self._queue.clear()
        return out

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 0.0

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        return 0.0
