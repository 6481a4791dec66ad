"""Tests of the LPC-style baseline (sae_env.policies.lpc).

* Hand-built scenarios where the answer is known: a conversation predicted to continue keeps its blocks where LRU
  loses them; a shared head outlives fresher single-use blocks; with a vanishing time scale LPC *is* LRU by last
  access (hit for hit on random prefix-sharing traces).
* Invariants after every request (instant and timed), with and without a predictor, through set_params re-keying.
* Online learning: the per-turn continuation rate and the idle time scale on traces where both are known.
* The dependency rule: ``make_policy("lpc")`` works in a process where torch cannot be imported.
"""

from __future__ import annotations

import subprocess
import sys
import zlib

import numpy as np
import pytest
from conftest import prefix_traces
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.policies import make_policy
from sae_env.policies.lpc import SHARED, LPCPolicy
from sae_env.replay import replay
from sae_env.serving import make_server
from sae_env.trace import AppType, Trace, chain_requests


def session_trace(rows: list[tuple[float, int, int, list[int]]], outputs: list[list[int]] | None = None,
                  bs: int = 16) -> Trace:
    """Requests ``(time, session, turn, prompt content ids)``; keys chained per request (prompt then outputs)."""
    n = len(rows)
    outputs = outputs or [[] for _ in rows]
    seq = [list(r[3]) + list(o) for r, o in zip(rows, outputs, strict=True)]
    off = np.concatenate([[0], np.cumsum([len(s) for s in seq])]).astype(np.int64)
    n_prompt = np.array([len(r[3]) for r in rows], dtype=np.int64)
    pk, po, ok, oo = chain_requests(np.array([c for s in seq for c in s], dtype=np.uint64), off, n_prompt)
    return Trace(t=[r[0] for r in rows], session=[r[1] for r in rows], turn=[r[2] for r in rows],
                 app=np.full(n, int(AppType.CHAT)), prompt_tokens=n_prompt * bs,
                 output_tokens=np.array([len(o) for o in outputs]) * bs, prompt_offsets=po, prompt_keys=pk,
                 prompt_types=np.full(pk.size, 2, dtype=np.int8), output_offsets=oo, output_keys=ok,
                 output_types=np.full(ok.size, 3, dtype=np.int8), block_size=bs)


class Stub:
    """A predictor: p_chat per session id (default ``other``); counts its calls and prepare()s."""

    def __init__(self, p: dict[int, float], other: float = 0.01):
        self.p, self.other = p, other
        self.calls: list[int] = []
        self.prepared = 0

    def prepare(self, trace: Trace) -> None:
        self.prepared += 1

    def __call__(self, trace: Trace, i: int) -> tuple[float, float]:
        self.calls.append(i)
        return self.p.get(int(trace.session[i]), self.other), 0.0


def hits(trace: Trace, policy, capacity: int, **kw) -> list[int]:
    r = replay(trace, policy, capacity, window_requests=1, check=True, **kw)
    return [w.hit_blocks for w in r.windows]


# A (predicted to continue) and B start, three one-off requests push them out of a 6-block cache, A comes back.
SCENARIO = [(0.0, 0, 1, [1, 2]), (1.0, 1, 1, [3, 4]), (2.0, 2, 1, [5, 6]), (3.0, 3, 1, [7, 8]),
            (4.0, 4, 1, [9, 10]), (5.0, 0, 2, [1, 2, 11])]


def test_keeps_a_conversation_predicted_to_continue():
    tr = session_trace(SCENARIO)
    assert hits(tr, make_policy("lru"), 6)[-1] == 0  # LRU evicted A's blocks first (oldest)
    stub = Stub({0: 0.9})
    lpc = make_policy("lpc", predictor=stub, tau=10.0)
    assert hits(tr, lpc, 6)[-1] == 2  # LPC kept A's two blocks, evicted B's and the first one-off's
    assert stub.prepared == 1 and stub.calls == [0, 1, 2, 3, 4]  # asked at first requests only
    # without the prediction (every first request alike) LPC behaves like LRU here
    assert hits(tr, make_policy("lpc", predictor=Stub({}), tau=10.0), 6)[-1] == 0
    # and a time scale so large that recency is irrelevant keeps A as well; so small that only recency counts
    assert hits(tr, make_policy("lpc", predictor=Stub({0: 0.9}), tau=1e6), 6)[-1] == 2
    assert hits(tr, make_policy("lpc", predictor=Stub({0: 0.9}), tau=1e-6), 6)[-1] == 0


def test_shared_head_outlives_fresher_one_off_blocks():
    """Blocks hit by another session are a shared head (p_shared): kept over later low-probability blocks."""
    rows = [(0.0, 0, 1, [1, 2, 3]), (1.0, 1, 1, [1, 2, 4]),  # sessions 0 and 1 share the head [1, 2]
            (2.0, 2, 1, [20, 21]), (3.0, 3, 1, [30, 31]), (3.5, 5, 1, [40, 41]), (4.0, 4, 1, [1, 2, 5])]
    tr = session_trace(rows)
    pol = make_policy("lpc", predictor=Stub({}, other=0.05), tau=1.0)
    r = replay(tr, pol, 6, window_requests=1, check=True)
    assert [w.hit_blocks for w in r.windows] == [0, 2, 0, 0, 0, 2]
    assert hits(tr, make_policy("lru"), 6) == [0, 2, 0, 0, 0, 0]  # LRU evicted the head at t = 3.5
    head = [r.to_python().blocks[k] for k in tr.prompt_blocks(5)[0][:2].tolist()]
    assert all(b.pdata[1] is SHARED for b in head)
    own = r.to_python().blocks[int(tr.prompt_blocks(5)[0][2])]
    assert own.pdata[1] == 4  # the request's own block carries its session


@settings(max_examples=60, deadline=None)
@given(trace=prefix_traces(), capacity=st.integers(1, 30))
def test_tiny_time_scale_is_lru(trace, capacity):
    """With tau -> 0 the key is the last access time (ties: deepest first), which is LRU's order in instant mode
    (distinct arrival times)."""
    assert hits(trace, make_policy("lpc", tau=1e-9), capacity) == hits(trace, make_policy("lru"), capacity)


def _hash_predictor(trace: Trace, i: int) -> tuple[float, float]:
    h = zlib.crc32(str(i).encode())
    return (h % 1000) / 2000.0, ((h >> 10) % 1000) / 2000.0


@st.composite
def session_traces(draw, timed: bool = False):
    tr = draw(prefix_traces(timed=timed))
    n = len(tr)
    sess = draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n))
    seen: dict[int, int] = {}
    turn = []
    for s in sess:
        seen[s] = seen.get(s, 0) + 1
        turn.append(1 if s < 0 else seen[s])
    tr.session = np.asarray(sess, dtype=np.int64)
    tr.turn = np.asarray(turn, dtype=np.int32)
    return tr


@pytest.mark.parametrize("predictor", [None, _hash_predictor])
@settings(max_examples=40, deadline=None)
@given(trace=session_traces(), capacity=st.integers(1, 30), scale=st.floats(0.01, 100))
def test_invariants_instant(predictor, trace, capacity, scale):
    pol = LPCPolicy(predictor=predictor)
    pol.set_params({"tau_scale": scale})
    r = replay(trace, pol, capacity, window_requests=3, check=True)
    assert all(w.occupancy <= capacity for w in r.windows)
    pol.set_params({"tau_scale": 1.0, "p_shared": 0.6})  # re-keys the heap
    r.to_python().check_invariants()
    live = [(k, seq, b) for k, seq, b in pol._heap if b.stamp == seq]
    assert all(k == pol.priority(b, 0.0) for k, _, b in live)


@pytest.mark.parametrize("predictor", [None, _hash_predictor])
@settings(max_examples=30, deadline=None)
@given(trace=session_traces(timed=True), capacity=st.integers(1, 30))
def test_invariants_timed(predictor, trace, capacity):
    r = replay(trace, LPCPolicy(predictor=predictor), capacity, server=make_server("qwen2.5-1.5b@a40"),
               window_requests=1, check=True)
    assert all(b.pins == 0 for b in r.to_python().blocks.values())


def test_online_continuation_rate_and_time_scale():
    """30 sessions of exactly two turns, 7 s apart: turn 1 continues always, turn 2 never; tau = 7 s."""
    rows = []
    for s in range(30):
        rows += [(10.0 * s, s, 1, [100 * s + 1]), (10.0 * s + 7.0, s, 2, [100 * s + 1, 100 * s + 2])]
    rows.sort(key=lambda r: r[0])
    pol = make_policy("lpc")
    replay(session_trace(rows), pol, 1000, window_requests=len(rows))
    stats = pol.window_stats()
    assert stats["tau_s"] == pytest.approx(7.0)
    assert stats["gaps_seen"] == 30
    assert stats["p_continue_by_turn"][0] == pytest.approx(31 / 32)  # (30 + 1) / (30 + 2)
    assert stats["p_continue_by_turn"][1] == pytest.approx(1 / 32)
    assert stats["first_requests"] == 30 and stats["predicted"] == 0
    assert stats["mean_p_first"] == pytest.approx(np.mean([(s + 1) / (s + 2) for s in range(30)]))


def test_bad_options_and_predictions():
    with pytest.raises(ValueError, match="predictor must be callable"):
        make_policy("lpc", predictor=3)
    with pytest.raises(ValueError, match="tau"):
        make_policy("lpc", tau=-1)
    with pytest.raises(ValueError, match="prior"):
        make_policy("lpc", prior=(0, 1))
    tr = session_trace(SCENARIO)
    with pytest.raises(ValueError, match="continuation probability"):
        replay(tr, make_policy("lpc", predictor=lambda trace, i: (0.9, 0.9)), 6)


def test_with_a_trained_session_predictor(tmp_path):
    from agents.session_predictor import train_predictor
    from sae_env.sources import load_source

    tr, _ = load_source("synthetic", None, preset="tiny", seed=2)
    out = tmp_path / "p.pt"
    train_predictor([tr], out, epochs=2, measure_throughput=False)
    from agents.session_predictor import SessionPredictor

    f = SessionPredictor.load(out).as_policy_callable()
    pol = make_policy("lpc", predictor=f)
    r = replay(tr, pol, max(8, tr.distinct_blocks() // 10), window_requests=len(tr), check=True)
    stats = pol.window_stats()
    assert stats["predicted"] == stats["first_requests"] == int((tr.turn == 1).sum())
    assert 0.0 < stats["mean_p_first"] < 1.0
    assert r.windows[0].hit_blocks > 0


def test_works_without_torch():
    """sae_env never imports torch: LPC runs (with its online fallback) where torch cannot be imported."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from sae_env.policies import make_policy\n"
            "from sae_env.replay import replay\n"
            "from sae_env.sources import load_source\n"
            "tr, _ = load_source('synthetic', None, preset='tiny', seed=1)\n"
            "r = replay(tr, make_policy('lpc'), 50, check=True)\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(sum(w.hit_blocks for w in r.windows))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


def test_outputs_inserted_late_carry_their_own_session():
    """Timed mode: request 0's output blocks are inserted when it completes, after request 1 (another session)
    arrived; they inherit request 0's context through their parent, not the latest arrival's."""
    tr = session_trace([(0.0, 0, 1, [1, 2]), (0.001, 1, 1, [7, 8])], outputs=[[3, 4], [9]])
    stub = Stub({0: 0.9, 1: 0.2})
    r = replay(tr, make_policy("lpc", predictor=stub), 100, server=make_server("qwen2.5-1.5b@a40"), check=True)
    for i, p in ((0, 0.9), (1, 0.2)):
        for k in np.concatenate([tr.prompt_blocks(i)[0], tr.output_blocks(i)[0]]).tolist():
            d = r.to_python().blocks[k].pdata
            assert d[1] == i and d[0] == pytest.approx(np.log(p / (1 - p))), (i, k)


def test_setting_unchanged_parameters_is_a_no_op():
    """Agents send parameters every window: re-sending the current ones must not change a single hit."""
    from sae_env.replay import replay as run
    from sae_env.sources import load_source

    trace, _ = load_source("synthetic", None, preset="contended")
    trace = trace[:800]  # chat and agent gaps: the learned tau drifts between windows
    cap = int(0.05 * trace.distinct_blocks())

    def hits(callbacks):
        r = run(trace, make_policy("lpc"), cap, window_requests=20, callbacks=callbacks)
        return [h for w in r.windows for h in w.hits_per_request]

    resend = [lambda stats, rep: rep.policy.set_params(rep.policy.params)]
    assert hits(resend) == hits([])
