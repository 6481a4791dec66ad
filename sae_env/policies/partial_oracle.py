"""Partial oracles: Belady's future knowledge cut down to one question, to split a policy's gap to Belady.

Each knows a little of the future and follows vLLM's LRU order (release order, deepest first among blocks freed
together) for everything its knowledge does not separate:

* ``reuse-oracle`` knows *whether* each block is referenced again, not when: dead leaves go first, then LRU. It is
  the bound of any policy that predicts reuse perfectly but has no sense of timing.
* ``session-oracle`` knows whether each request's *session* has another turn, not when, nor which blocks that turn
  will reuse: blocks last used by a session's final request go first, then LRU. Blocks another session has hit
  (shared heads: system prompts, templates) count as alive for good, as LPC and SAECache treat them. It is the bound
  of a perfect continuation predictor.
* ``when-oracle`` knows each block's next use only to within a bucket of ratio ``factor`` (default 2): the
  distance in requests from the use that brought the knowledge is placed in ``[factor**k, factor**(k+1))`` and
  estimated by the bucket's geometric middle; the furthest estimated next use goes first, then LRU. ``factor=1``
  is Belady's exact knowledge, so sweeping the factor reads off what timing precision is worth.

The knowledge is Belady's (:func:`sae_env.policies.belady.next_uses`, computed in ``bind``) and arrives with each
request, through the same hooks as every online policy. Time is counted in requests, as for Belady.

Per-block state in ``Block.pdata``: ``(next use, release order)`` for reuse- and when-oracle, ``(request that last
used it or -1 when shared, session of that request, release order)`` for session-oracle; the release order is set
in ``on_release`` and is the LRU tie-break.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sae_env.block import Block
from sae_env.policies.base import KeyedPolicy, block_array
from sae_env.policies.belady import NEVER, BeladyPolicy
from sae_env.trace import Trace, session_continues


class _ReleaseOrder(KeyedPolicy):
    """A keyed policy whose ties go in vLLM's LRU order: the order in which blocks were last released."""

    def __init__(self) -> None:
        super().__init__()
        self._released = 0

    knowledge_dtype: Any = np.int64  # of what knowledge() returns, for the state contract

    def knowledge(self, block: Block) -> object:
        """What the oracle knows of ``block`` when it is released (the first element of its pdata)."""
        raise NotImplementedError

    # State: each block's knowledge and release order (-1 while it is held since its last hit: then pdata is the
    # knowledge alone), the release counter, and the oracle's context (export_context).
    def export_pdata(self, index: dict[int, int]) -> dict[str, Any]:
        blocks = self.cache.blocks.values()
        return {"knowledge": block_array(blocks, index, self.knowledge, self.knowledge_dtype),
                "released_at": block_array(blocks, index, lambda b: b.pdata[1] if isinstance(b.pdata, tuple) else -1),
                "n_released": self._released, **self.export_context()}

    def import_pdata(self, state: dict[str, Any], blocks: list[Block]) -> None:
        self._released = int(state["n_released"])
        for b, k, r in zip(blocks, state["knowledge"].tolist(), state["released_at"].tolist(), strict=True):
            b.pdata = (k, r) if r >= 0 else k
        self.import_context(state)

    def export_context(self) -> dict[str, Any]:
        raise NotImplementedError

    def import_context(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def on_release(self, blocks: list[Block], now: float) -> None:
        seq = self._released
        for b in blocks:
            seq += 1
            b.pdata = (self.knowledge(b), seq)
        self._released = seq
        super().on_release(blocks, now)


class ReuseOraclePolicy(BeladyPolicy, _ReleaseOrder):
    """Dead leaves (never referenced again) first, the rest in LRU order."""

    name = "reuse-oracle"
    export_pdata, import_pdata = _ReleaseOrder.export_pdata, _ReleaseOrder.import_pdata  # not Belady's

    def knowledge(self, block: Block) -> object:
        nu = block.pdata
        return nu if isinstance(nu, int) else nu[0]

    def priority(self, block: Block, now: float) -> tuple[int, int]:
        nu, released = block.pdata
        return (0 if nu == NEVER else 1, released)


class WhenOraclePolicy(BeladyPolicy, _ReleaseOrder):
    """Furthest next use first, the next use known only to within a factor; ties in LRU order."""

    name = "when-oracle"
    knowledge_dtype = np.float64
    export_pdata, import_pdata = _ReleaseOrder.export_pdata, _ReleaseOrder.import_pdata  # not Belady's

    def __init__(self, factor: float = 2.0) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1 \
                or not math.isfinite(factor):
            raise ValueError(f"when-oracle: factor must be a finite number >= 1, got {factor!r}")
        super().__init__()
        self.factor = float(factor)
        self._log_factor = math.log(self.factor) if self.factor > 1 else 0.0
        self._mid = math.sqrt(self.factor)

    def _estimate(self, nu: int) -> float:
        """The bucketed next use, seen from the request that brought the knowledge (the frontier)."""
        if nu == NEVER or not self._log_factor:
            return float(nu)
        d = nu - self._frontier  # >= 1
        k = math.floor(math.log(d) / self._log_factor + 1e-12)
        return self._frontier + self.factor ** k * self._mid

    def on_insert(self, block: Block, now: float) -> None:
        block.pdata = self._estimate(self._next(block))

    def on_hit(self, blocks: list[Block], now: float) -> None:
        for b in blocks:
            b.pdata = self._estimate(self._next(b))

    def knowledge(self, block: Block) -> object:
        est = block.pdata
        return est if isinstance(est, float) else est[0]

    def priority(self, block: Block, now: float) -> tuple[float, int]:
        est, released = block.pdata
        return (-est, released)


class SessionOraclePolicy(_ReleaseOrder):
    """Blocks whose last user was its session's final request go first (unless shared), the rest in LRU order."""

    name = "session-oracle"
    oracle = True

    def __init__(self) -> None:
        super().__init__()
        self._trace: Trace | None = None
        # The same two per-request facts as lists, for the Python engine's per-block loops; built on its first hook
        # call, so that a replay on the compiled engine does not hold ~50 bytes a request of Python ints.
        self._has_next: list[bool] | None = None
        self._session: list[int] | None = None
        self._session_ids, self._has_next_arr = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        self._cur = -1  # the request whose hooks are running: its arrival or its completion

    def bind(self, trace: Trace) -> None:
        self._trace = trace
        sid = trace.session_ids()
        self._session = self._has_next = None
        has_next = session_continues(trace)  # a later request carries the same session id
        self._session_ids, self._has_next_arr = sid, has_next  # the same, as arrays for the state contract

    def _context(self, trace: Trace, i: int) -> None:
        if trace is not self._trace:
            raise RuntimeError("session-oracle: bind() was called with a different trace than the one being replayed")
        self._cur = i
        if self._session is None:
            self._session, self._has_next = self._session_ids.tolist(), self._has_next_arr.tolist()

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        self._context(trace, i)

    def on_complete(self, trace: Trace, i: int, now: float) -> None:
        self._context(trace, i)

    def on_insert(self, block: Block, now: float) -> None:
        block.pdata = self._cur

    def on_hit(self, blocks: list[Block], now: float) -> None:
        cur = self._cur
        session = self._session
        s = session[cur]
        for b in blocks:
            user = self.knowledge(b)
            b.pdata = -1 if user < 0 or session[user] != s else cur

    def knowledge(self, block: Block) -> object:
        user = block.pdata
        return user if isinstance(user, int) else user[0]

    def priority(self, block: Block, now: float) -> tuple[int, int]:
        user, released = block.pdata
        return (0 if user >= 0 and not self._has_next[user] else 1, released)

    def export_context(self) -> dict[str, Any]:
        return {"context": self._cur, "request_session": self._session_ids, "has_next": self._has_next_arr}

    def import_context(self, state: dict[str, Any]) -> None:
        self._cur = int(state["context"])
        self._session, self._has_next = self._session_ids.tolist(), self._has_next_arr.tolist()  # see __init__
