"""Tests of the gap analysis (sae_env/explain.py, ``train.py explain``) and the cache counts it rests on.

* Golden: a hand-built trace whose misses (compulsory, capacity, regret), regret details and Belady-kept blocks are
  worked out by hand.
* Invariants under hypothesis, instant and timed: the three classes add up to the misses for every policy; the
  compulsory misses are the same for all and are exactly what an unbounded cache misses; the observer's regret
  equals the cache's own count (explain raises otherwise); an observer changes no result.
* Differential: misses after eviction on output blocks against the reference cache; explain's hit rates equal
  ``train.py replay``'s, adaptive SAECache included (same windows, same online learners).
* The compiled engine refuses a cache with an observer; the command line's errors exit with status 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import build_trace, flat_trace, prefix_traces
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_cache import reference_replay_instant, reference_replay_timed
from replaying import replay_like_train, token_hit_rate

from sae_env import fast_engine
from sae_env.cache import PrefixCache
from sae_env.explain import MissRecorder, explain, first_references, format_table, write_outputs
from sae_env.policies import make_policy
from sae_env.replay import Replay, replay
from sae_env.serving import make_server

SERVER = "qwen2.5-1.5b@a40"
SETTINGS = settings(max_examples=30, deadline=None, report_multiple_bugs=False)
POLICIES = ("lru", "lpc", "saecache", "session-oracle", "reuse-oracle", "belady")


# ----------------------------------------------------------------------------------------------------------------
# Golden


def test_golden_miss_split():
    """Capacity 2, one block per request (key = id), request i at time i: a b c a d e b a.

    LRU (ghost record of 2 keys): a, b, c, d, e are first references (compulsory). Request 2 evicts a (ghost: a);
    request 3 misses a while the ghost holds it (regret; idle at eviction 2 s: last used at 0, evicted at 2) and
    evicts b (ghost: b); request 4 evicts c (ghost: b c); request 5 evicts a (ghost: c a: b forgotten); request 6
    misses b, which the ghost no longer holds (capacity), and evicts d (ghost: a d); request 7 misses a, held
    (regret; idle 2 s again: last used at 3, evicted at 5). So 8 misses: 5 compulsory, 1 capacity, 2 regret.
    Belady evicts b at request 2 (next use 6, a's is 3), then the dead c, d, e: it hits a at 3 and 7, both of them
    LRU's regrets, 3 s and 4 s after a's previous reference.
    """
    a, b, c, d, e = 1, 2, 3, 4, 5
    trace = flat_trace([a, b, c, a, d, e, b, a])
    r = explain(trace, "lru", 2, references=("lru", "belady"), window=3)
    rows = {p["policy"]: p for p in r["policies"]}
    assert (rows["lru"]["misses"], rows["lru"]["compulsory"], rows["lru"]["capacity"], rows["lru"]["regret"]) \
        == (8, 5, 1, 2)
    assert (rows["belady"]["misses"], rows["belady"]["compulsory"]) == (6, 5)
    assert rows["lru"]["gap_share"] == 0.0 and rows["belady"]["gap_share"] == 1.0
    assert r["regret_by"]["idle_at_eviction"] == [{"bucket": "1-10 s", "regret": 2}]
    assert r["regret_by"]["queue"] == [{"bucket": "cache", "regret": 2}]  # the queue by its policy's name
    assert r["regret_by"]["token_type"] == [{"bucket": "USER", "references": 8, "misses": 8, "regret": 2}]
    assert r["regret_by"]["depth"] == [{"bucket": "0", "references": 8, "misses": 8, "regret": 2}]
    keeps = r["belady_keeps"]
    assert (keeps["blocks"], keeps["regret"], keeps["capacity"], keeps["policy_keeps_belady_misses"]) == (2, 2, 0, 0)
    assert keeps["by_age"] == [{"bucket": "1-10 s", "blocks": 2, "misses_seen_before": 3}]


def test_first_references():
    """Outputs count as references when they are cached: request 1's prompt a-b reuses request 0's output b."""
    trace = build_trace([[0], [0, 1], [2], [0, 1, 2]], [[1], [], [], []])
    assert first_references(trace).tolist() == [True, False, False, True, False, False, True]
    assert first_references(trace, include_outputs=False).tolist() == [True, False, True, True, False, False,
                                                                       True]


# ----------------------------------------------------------------------------------------------------------------
# Invariants


def unbounded_misses(trace) -> int:
    """Prompt references whose key no earlier request held (prompt or outputs)."""
    seen: set[int] = set()
    misses = 0
    for i in range(len(trace)):
        keys = trace.prompt_blocks(i)[0].tolist()
        misses += sum(k not in seen for k in keys)
        seen.update(keys)
        seen.update(trace.output_blocks(i)[0].tolist())
    return misses


@pytest.mark.parametrize("timed", [False, True])
@SETTINGS
@given(data=st.data(), capacity=st.integers(1, 30), window=st.integers(1, 5))
def test_miss_classes_add_up(timed, data, capacity, window):
    trace = data.draw(prefix_traces(timed=timed))
    r = explain(trace, "saecache", capacity, references=POLICIES, window=window,
                server=(lambda: make_server(SERVER)) if timed else None)
    compulsory = unbounded_misses(trace)
    for p in r["policies"]:
        assert p["compulsory"] + p["capacity"] + p["regret"] == p["misses"], p
        assert p["compulsory"] == compulsory and min(p["capacity"], p["regret"]) >= 0, p
    rows = r["regret_by"]
    regret = next(p["regret"] for p in r["policies"] if p["policy"] == "saecache")
    for dim in ("token_type", "queue", "turn", "depth", "idle_at_eviction"):
        assert sum(b["regret"] for b in rows[dim]) == regret, dim
    assert sum(b["references"] for b in rows["depth"]) == trace.n_blocks
    keeps = r["belady_keeps"]
    assert keeps["capacity"] + keeps["regret"] == keeps["blocks"] == sum(b["blocks"] for b in keeps["by_age"])


@SETTINGS
@given(trace=prefix_traces(), extra=st.integers(0, 3))
def test_an_unbounded_cache_misses_only_first_references(trace, extra):
    capacity = max(1, trace.distinct_blocks()) + extra
    r = explain(trace, "lru", capacity, window=4)
    for p in r["policies"]:
        assert (p["capacity"], p["regret"]) == (0, 0) and p["misses"] == p["compulsory"], p


@pytest.mark.parametrize("timed", [False, True])
@SETTINGS
@given(data=st.data(), capacity=st.integers(1, 30), name=st.sampled_from(["lru", "belady", "saecache"]))
def test_an_observer_changes_nothing(timed, data, capacity, name):
    trace = data.draw(prefix_traces(timed=timed))

    def run(observe: bool) -> Replay:
        cache = PrefixCache(capacity, make_policy(name))
        if observe:
            MissRecorder(cache)
        r = Replay(trace, cache, make_server(SERVER) if timed else None, window_requests=3, engine="python")
        r.run()
        return r

    assert run(True).windows == run(False).windows


@pytest.mark.parametrize("timed", [False, True])
@SETTINGS
@given(data=st.data(), capacity=st.integers(1, 30), ghosts=st.sampled_from([None, 0, 3]),
       name=st.sampled_from(["lru", "lfu", "fifo", "belady"]))
def test_output_misses_after_eviction_match_the_reference(timed, data, capacity, ghosts, name):
    """Both engines (the compiled one in instant mode) count the misses after eviction on output blocks as the
    reference cache does."""
    trace = data.draw(prefix_traces(timed=timed))
    server = make_server(SERVER) if timed else None
    r = replay(trace, make_policy(name), capacity, server=server, window_requests=1, ghost_capacity=ghosts)
    if timed:
        ref = reference_replay_timed(trace, name, capacity, make_server(SERVER), ghost_capacity=ghosts)
    else:
        ref = reference_replay_instant(trace, name, capacity, ghost_capacity=ghosts)
    assert [w.output_miss_after_eviction for w in r.windows] == [c.output_miss_after_eviction for c in ref.counters]


def test_output_misses_after_eviction_by_hand():
    """Capacity 2: request 0 decodes b after its prompt a; request 1 (c, then d) evicts b, then a; request 2 (a,
    decoding b again) misses a while the ghost record holds it (a prompt miss after eviction) and inserts b, also
    held there (an output one)."""
    trace = build_trace([[0], [2, 3], [0]], [[1], [], [1]])
    w = replay(trace, make_policy("lru"), 2, window_requests=3, engine="python").windows[0]
    assert sum(w.miss_after_eviction_by_type) == 2 and w.output_miss_after_eviction == 1


# ----------------------------------------------------------------------------------------------------------------
# Engines and the command line


def test_the_compiled_engine_refuses_an_observer():
    pytest.importorskip("numba")
    cache = PrefixCache(4, make_policy("lru"))
    MissRecorder(cache)
    assert "observer" in fast_engine.unsupported_reason(cache)
    with pytest.raises(ValueError, match="observer"):
        Replay(flat_trace([1, 2, 3]), cache, engine="fast")
    assert Replay(flat_trace([1, 2, 3]), cache).engine == "python"
    with pytest.raises(ValueError, match="already has an observer"):
        MissRecorder(cache)


def test_explain_equals_replay_for_adaptive_saecache(tmp_path, capsys):
    """Same trace, capacity and window: explain's hit rates are replay's, for SAECache with its online learners
    (which act between windows) and for the references."""
    from agents.cli import main

    common = ["--trace", "mooncake_arxiv", "--capacity", "0.05", "--window", "100"]
    assert main(["replay", *common, "--policy", "saecache,lru,reuse-oracle,belady", "--json",
                 str(tmp_path / "replay.json")]) == 0
    replayed = {r["policy"]: r["token_hit_rate"] for r in json.loads((tmp_path / "replay.json").read_text())}
    assert main(["explain", *common, "--policy", "saecache", "--out", str(tmp_path / "ex")]) == 0
    result = json.loads((tmp_path / "ex" / "explain.json").read_text())
    assert result["adaptive"]
    explained = {p["policy"]: p["token_hit_rate"] for p in result["policies"]}
    assert {p: explained[p] for p in replayed} == replayed
    table = capsys.readouterr().out
    assert "gap share" in table and "saecache" in table and "Belady hits" in table
    for name in ("explain.md", "plots/gap_bar.png", "plots/miss_split.png", "plots/regret_by.png",
                 "plots/belady_keeps.png"):
        assert (tmp_path / "ex" / name).stat().st_size > 0, name
    assert "## saecache's regret" in (tmp_path / "ex" / "explain.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--policy", "lru,lpc"], "one policy"),
    (["--policy", "nope"], "unknown policy"),
    (["--policy", "lru", "--compare", "lru,reuse-oracle"], "must include belady"),
])
def test_explain_usage_errors(argv, message, capsys, tmp_path):
    from agents.cli import main

    assert main(["explain", "--trace", "bailian", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_write_outputs_and_table(tmp_path):
    trace = flat_trace([1, 2, 3, 1, 4, 5, 2, 1])
    r = explain(trace, "lpc", 2, window=2, label="hand")
    paths = write_outputs(r, tmp_path)
    assert {p.name for p in paths} == {"explain.md", "explain.json", "gap_bar.png", "miss_split.png",
                                       "regret_by.png", "belady_keeps.png"}
    assert json.loads((tmp_path / "explain.json").read_text())["policies"][1]["policy"] == "lpc"
    assert format_table(r).splitlines()[0].startswith("lpc on hand: 8 requests")
    with pytest.raises(ValueError, match="belady"):
        explain(trace, "lpc", 2, references=("lru",))
    assert np.isclose(sum(p["gap_share"] is not None for p in r["policies"]), len(r["policies"]))


# ----------------------------------------------------------------------------------------------------------------
# The experiment report's gap section


def test_report_gap_section_agrees_with_explain(tmp_path):
    """A serial run of the oracles as agents (instant serving): summary.csv and report.md carry each agent's gap
    share and miss split, the classes add up to the misses, and they equal explain's on the same trace (the cells
    replay LRU on the compiled engine, explain on the Python one with its observer)."""
    import csv

    from agents.evaluate import CellRunner
    from sae_env.experiment import load_config, run_experiment
    from sae_env.sources import trace_from_spec

    spec = {"source": "synthetic", "preset": "tiny", "seed": 3}
    agents = ["lru", "session-oracle", "reuse-oracle", "belady"]
    runner = CellRunner()
    config = load_config({"name": "gap", "workloads": [{"name": "tiny", "trace": spec}], "capacities": [0.1],
                          "agents": agents, "serving": "instant", "window": 50, "seeds": [0],
                          "wandb": {"mode": "disabled"}, "output": str(tmp_path / "runs")}, runner)
    run = run_experiment(config, runner, serial=True, progress=False, log=lambda m: None)
    with (run.run_dir / "summary.csv").open() as f:
        rows = {r["agent"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(agents)
    for r in rows.values():
        misses = int(r["prompt_blocks"]) - round(float(r["block_hit_rate"]) * int(r["prompt_blocks"]))
        assert int(r["compulsory_misses"]) + int(r["capacity_misses"]) + int(r["regret_misses"]) == misses
    assert float(rows["lru"]["gap_share"]) == 0.0 and float(rows["belady"]["gap_share"]) == 1.0
    trace, _ = trace_from_spec(spec)
    capacity = int(rows["lru"]["capacity_blocks"])
    explained = {p["policy"]: p for p in explain(trace, "lru", capacity, window=50)["policies"]}
    for a in agents:
        got = (int(rows[a]["compulsory_misses"]), int(rows[a]["capacity_misses"]), int(rows[a]["regret_misses"]))
        assert got == (explained[a]["compulsory"], explained[a]["capacity"], explained[a]["regret"]), a
    report = (run.run_dir / "report.md").read_text()
    section = report.split("## Gap analysis")[1]
    assert "| lru | 0.0 |" in section and "| belady | 100.0 |" in section
    share = 100 * explained["reuse-oracle"]["gap_share"]
    assert f"| reuse-oracle | {share:.1f} |" in section


def test_gap_table_script_runs():
    """benchmarks/gap_table.py on the smallest embedded trace: one row per capacity, LRU at 0 % and Belady at 100 %
    of the gap; a policy list without belady exits with status 2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    out = subprocess.run([sys.executable, str(script), "--traces", "bailian", "--capacities", "0.2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| bailian")]
    assert "(0 %)" in row.split("|")[4] and row.rstrip(" |").endswith("(100 %)")
    bad = subprocess.run([sys.executable, str(script), "--policies", "lru,lpc"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "belady" in bad.stderr


def test_gap_table_source_options(tmp_path):
    """--opt sets a source option on the traces whose source takes it (WildChat's session rate: other numbers than
    as shipped) and leaves the others as shipped (Bailian takes no rate); a value the source rejects exits with
    status 2 and one line."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"

    def rows(*extra):
        out = tmp_path / "rows.json"
        run = subprocess.run([sys.executable, str(script), "--traces", "wildchat,bailian", "--capacities", "0.05",
                              "--policies", "lru,belady", "--json", str(out), *extra],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return {r["trace"]: r for r in json.loads(out.read_text())}, run.stdout

    shipped, _ = rows()
    slow, text = rows("--opt", "rate=0.1")
    assert slow["wildchat"]["options"] == {"rate": 0.1} and slow["bailian"]["options"] == {}
    assert "| wildchat (rate=0.1) |" in text and "| bailian |" in text
    assert slow["wildchat"]["token_hit_rate"]["lru"] != shipped["wildchat"]["token_hit_rate"]["lru"]
    assert slow["bailian"]["token_hit_rate"] == shipped["bailian"]["token_hit_rate"]
    for bad in (["--opt", "rate=fast"], ["--opt", "rate"]):
        run = subprocess.run([sys.executable, str(script), "--traces", "wildchat", *bad], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 2 and "--opt" in run.stderr and len(run.stderr.strip().splitlines()) == 1, bad
        assert run.stdout == "", bad


def test_gap_table_variant_of_a_probe_class(tmp_path):
    """--variant NAME:policy=module:Class takes a policy class of one's own, as the probes of benchmarks/probes/: with
    its switch at the default's value it gives SAECache's figure exactly (the probe changes only what it says), at
    another value another figure (the hindsight rates over an empty span of the replay: SAECache; over all of it:
    another); a class that cannot be imported, or options it refuses, exit with status 2 and one line."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(script), "--traces", "wildchat", "--capacities", "0.1", "--policies",
                          "lru,saecache,belady", "--json", str(out),
                          "--variant", "h3:policy=probes.horizon:Horizon,horizon_sigmas=3",
                          "--variant", "h15:policy=probes.horizon:Horizon,horizon_sigmas=1.5",
                          "--variant", "r0:policy=probes.relabel:Relabel,relabel=false",
                          "--variant", "t0:policy=probes.true_rates:TrueRates,start=0.5,stop=0.5",
                          "--variant", "t1:policy=probes.true_rates:TrueRates"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())
    rate = row["token_hit_rate"]
    assert rate["h3"] == rate["saecache"] == rate["r0"] == rate["t0"]
    assert rate["h15"] != rate["saecache"] and rate["t1"] != rate["saecache"]
    bad_span = subprocess.run([sys.executable, str(script), "--traces", "wildchat", "--variant",
                               "x:policy=probes.true_rates:TrueRates,start=0.8,stop=0.2"],
                              capture_output=True, text=True, timeout=300)
    assert bad_span.returncode == 2 and bad_span.stderr.count("\n") == 1 and "start=0.8" in bad_span.stderr
    bad = subprocess.run([sys.executable, str(script), "--traces", "wildchat", "--variant",
                          "x:policy=probes.nope:Nope"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "probes.nope" in bad.stderr
    assert bad.stdout == ""


def test_discrimination_probe():
    """benchmarks/probes/discrimination.py: its AUC is 1 for a score that puts every positive first, 0 for the reverse,
    0.5 for ties, NaN without both labels; the script runs on a real trace and reports each turn bucket with both
    outcomes, its shares within (0, 1) and its AUCs within [0, 1]."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "probes" / "discrimination.py"
    spec = importlib.util.spec_from_file_location("discrimination", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    y = np.array([True, True, False, False, False])
    assert probe.auc(y, np.array([5.0, 4.0, 3.0, 2.0, 1.0])) == 1.0
    assert probe.auc(y, np.array([1.0, 2.0, 3.0, 4.0, 5.0])) == 0.0
    assert probe.auc(y, np.zeros(5)) == 0.5
    assert np.isnan(probe.auc(np.ones(3, dtype=bool), np.arange(3.0)))
    run = subprocess.run([sys.executable, str(path), "--traces", "wildchat"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split(" | ") for line in run.stdout.splitlines()[2:]]
    assert [r[1] for r in rows] == ["2", "3", "4", "5", "6", "7", "8"]  # every WildChat session has a second turn
    for r in rows:
        assert 0 < float(r[3]) < 1 and all(0 <= float(x) <= 1 for x in (r[4], r[5], r[6].rstrip(" |")))


def test_true_rates_probe_shares():
    """benchmarks/probes/true_rates.py: each turn bucket's hindsight rate is the share of that bucket's requests whose
    session has a later request, counted here directly; the learned rates are untouched, and outside the span (or
    with the answers' span empty) the model answers as SAECache's."""
    import importlib.util
    from pathlib import Path

    from sae_env.policies import make_policy
    from sae_env.sources import open_trace

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "probes" / "true_rates.py"
    spec = importlib.util.spec_from_file_location("true_rates", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    trace, _ = open_trace("wildchat")
    policy = probe.TrueRates(start=0.0, stop=0.5)
    model = policy.arrivals.model
    model.bind(trace)
    sid = trace.session_ids()
    later = np.zeros(len(trace), dtype=bool)
    seen: set[int] = set()
    for i in range(len(trace) - 1, -1, -1):
        later[i] = int(sid[i]) in seen
        seen.add(int(sid[i]))
    bucket = np.minimum(np.maximum(trace.turn.astype(np.int64), 1), model.max_turn)
    for k in np.unique(bucket).tolist():
        assert model._true[k] == pytest.approx(later[bucket == k].mean())
    plain = make_policy("saecache").arrivals.model
    plain.bind(trace)
    n, differ = len(trace), 0
    for i in range(n):
        p, q = model.arrive(i, float(trace.t[i])), plain.arrive(i, float(trace.t[i]))
        if i >= n // 2:  # past the span: the same answers
            assert p == q
        else:
            differ += p != q
    assert differ > n // 4  # within it, the hindsight rates'
    assert model.rates.tolist() == plain.rates.tolist()  # the counts learn as SAECache's


def test_gap_select_probe():
    """benchmarks/probes/gap_select.py: its log-likelihoods are the cure model's under scipy's log-normal and
    exponential; with select=false it makes SAECache's decisions (the compiled engine's figure, to the last digit);
    where the log-normal describes the block re-use (the arXiv excerpt's tight gaps) it never switches and is
    SAECache; on mooncake_synthetic's late half at 2 %, where SAECache is below LRU, it switches and lifts the cell
    above LRU (golden figures: 7.02 % against 5.74 % and LRU's 6.49 %; 7.01 % without the blocks idle in the cache in
    the likelihood, pending=false); a bad option is a ValueError."""
    import importlib.util
    from pathlib import Path

    from scipy import stats

    from sae_env.cache import resolve_capacity
    from sae_env.sources import open_trace
    from sae_env.trace import session_halves

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "probes" / "gap_select.py"
    spec = importlib.util.spec_from_file_location("gap_select", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    mu, sigma, p, t = 3.4, 1.3, 0.3, 7.5
    mean = np.exp(mu + sigma ** 2 / 2)
    ln, ex = probe.cure_loglik(True, t, p, mu, sigma)
    assert ln == pytest.approx(np.log(p) + stats.lognorm.logpdf(t, sigma, scale=np.exp(mu)), rel=1e-12)
    assert ex == pytest.approx(np.log(p) + stats.expon.logpdf(t, scale=mean), rel=1e-12)
    ln, ex = probe.cure_loglik(False, t, p, mu, sigma)
    assert ln == pytest.approx(np.log(1 - p + p * stats.lognorm.sf(t, sigma, scale=np.exp(mu))), rel=1e-12)
    assert ex == pytest.approx(np.log(1 - p + p * stats.expon.sf(t, scale=mean)), rel=1e-12)

    def cell(trace, fraction, policy):
        return token_hit_rate(replay_like_train(trace, resolve_capacity(fraction, trace.distinct_blocks()), policy))

    late = session_halves(open_trace("mooncake_synthetic")[0], "start")[1]
    default, off, on = make_policy("saecache"), probe.GapSelect(select=False), probe.GapSelect()
    assert cell(late, 0.02, off) == cell(late, 0.02, default)  # Python engine against the compiled one
    assert off.switches_made == 0 and off.loglik[probe.CH][1] > off.loglik[probe.CH][0]  # exponential ahead, unused
    lru, selected = cell(late, 0.02, make_policy("lru")), cell(late, 0.02, on)
    assert on.switches_made > 0 and round(100 * selected, 2) == 7.02 and selected > lru
    assert round(100 * cell(late, 0.02, probe.GapSelect(pending=False)), 2) == 7.01  # the idle blocks count
    arxiv = open_trace("mooncake_arxiv")[0]
    tight = probe.GapSelect()
    assert cell(arxiv, 0.1, tight) == cell(arxiv, 0.1, make_policy("saecache")) and tight.switches_made == 0
    for bad in ({"decay": 0}, {"decay": 1.5}, {"select": "yes"}, {"pending": 1}, {"lognormal": False},
                {"gap_mixture": True}):
        with pytest.raises(ValueError):
            probe.GapSelect(**bad)


def test_gap_table_variants(tmp_path):
    """--variant adds a column of SAECache built with other options (the same number as make_policy with them,
    replayed as the table replays) and --criteria checks it; a malformed, duplicate or unknown variant exits with
    status 2 and one line before any replay."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(script), "--traces", "wildchat", "--capacities", "0.05", "--policies",
                          "lru,lpc,saecache,belady", "--criteria", "--variant", "no-cont:continuation=false",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())

    from sae_env.sources import open_trace

    trace, _ = open_trace("wildchat")
    rep = replay_like_train(trace, row["capacity_blocks"], make_policy("saecache", continuation=False))
    assert row["token_hit_rate"]["no-cont"] == token_hit_rate(rep)
    assert row["token_hit_rate"]["no-cont"] != row["token_hit_rate"]["saecache"]
    assert "no-cont minus max(LRU, LPC)" in run.stdout and "(no-cont / lpc)" in run.stdout
    for bad in (["--variant", "no-cont"], ["--variant", "lpc:censoring=false"], ["--variant", "a:bogus=1"],
                ["--variant", "a:sample=0"], ["--variant", "a:policy=nope"],
                ["--variant", "a:censoring=false", "--variant", "a:density=false"]):
        run = subprocess.run([sys.executable, str(script), "--traces", "wildchat", *bad], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 2 and "--variant" in run.stderr and len(run.stderr.strip().splitlines()) == 1, bad
        assert run.stdout == "", bad


def test_explain_a_trace_file_in_timed_mode(tmp_path, capsys):
    """A trace file (--source, as for replay) with a serving model: the output folder is complete and the default
    folder name comes from the file's name."""
    from agents.cli import main
    from sae_env.sources import trace_from_spec

    trace, _ = trace_from_spec({"source": "synthetic", "preset": "tiny", "seed": 1})
    path = trace.save(tmp_path / "tiny.jsonl")
    assert main(["explain", "--trace", str(path), "--source", "trace", "--policy", "lpc", "--capacity", "0.1",
                 "--serving", SERVER, "--window", "50", "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "explain.json").read_text())
    assert result["serving"] == SERVER and result["trace"] == "tiny" and result["requests"] == len(trace)
    assert "lpc on tiny" in capsys.readouterr().out


def _gap_table_halves(tmp_path, split: str, *extra: str) -> tuple[list, str]:
    """gap_table.py --halves SPLIT on WildChat at 5 %: its rows and output, each row checked against the number of its
    half replayed here under LRU."""
    import subprocess
    import sys
    from pathlib import Path

    from sae_env.cache import resolve_capacity
    from sae_env.metrics import summarize
    from sae_env.sources import open_trace
    from sae_env.trace import session_halves

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(script), "--traces", "wildchat", "--capacities", "0.05", "--halves",
                          split, "--json", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())
    trace, _ = open_trace("wildchat")
    for row, half in zip(rows, session_halves(trace, split), strict=True):
        assert row["capacity_blocks"] == resolve_capacity(0.05, half.distinct_blocks())
        rep = Replay(half, PrefixCache(row["capacity_blocks"], make_policy("lru")), None, window_requests=200)
        rep.run()
        assert row["token_hit_rate"]["lru"] == summarize(rep.windows)["token_hit_rate"]
    return rows, run.stdout


def test_gap_table_halves(tmp_path):
    """--halves replays each trace as its two halves by session start (each row the number of that half replayed on
    its own) and --criteria names the half of a cell; the criteria's WildChat line is given per half."""
    rows, text = _gap_table_halves(tmp_path, "start", "--policies", "lru,lpc,saecache,belady", "--criteria")
    assert [r["half"] for r in rows] == ["early half", "late half"]
    assert "| wildchat early half | 5% (" in text and "| wildchat late half | 5% (" in text
    assert "on the traces in halves (seed 0)" in text
    assert "gap closed on wildchat early half at 5 %" in text


def test_gap_table_alternate_halves(tmp_path):
    """--halves alternate: the odd and the even half of the sessions by start, not the early and the late half."""
    from sae_env.sources import open_trace
    from sae_env.trace import session_halves

    rows, text = _gap_table_halves(tmp_path, "alternate", "--policies", "lru,belady")
    assert [r["half"] for r in rows] == ["odd half", "even half"]
    assert "| wildchat odd half | 5% (" in text and "| wildchat even half | 5% (" in text
    trace, _ = open_trace("wildchat")
    assert [len(h) for h in session_halves(trace, "alternate")] != [len(h) for h in session_halves(trace)]


def test_gap_table_seed_summary_keeps_halves_apart(capsys):
    """Over seeds, the halves of one seed are two cells, not two seeds: one line per trace, half and capacity, each
    over the seeds given, with the mean of that half's margins alone."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    spec = importlib.util.spec_from_file_location("gap_table", script)
    gap_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gap_table)

    def row(seed, half, saecache):
        return {"trace": "wildchat", "half": half, "capacity": 0.05, "seed": seed,
                "token_hit_rate": {"lru": 0.10, "lpc": 0.12, "saecache": saecache}}

    rows = [row(s, h, v) for s, v_early, v_late in ((0, 0.13, 0.11), (1, 0.14, 0.10), (2, 0.15, 0.09))
            for h, v in (("early half", v_early), ("late half", v_late))]
    gap_table.print_seed_summary(rows)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("- ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("- wildchat early half 5%: +2.00 [") and lines[0].endswith("min +1.00 over 3 seeds")
    assert lines[1].startswith("- wildchat late half 5%: -2.00 [") and lines[1].endswith("min -3.00 over 3 seeds")


def test_gap_table_criteria_put_seeded_cells_at_their_seed_means(capsys):
    """--criteria over several seeds adds the wide-cell mean with each cell whose gaps a seed draws at its mean over
    the seeds (wide as seed 0 has it), and a recorded trace's cell (no seed) as it is."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    spec = importlib.util.spec_from_file_location("gap_table", script)
    gap_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gap_table)

    def row(trace, seed, saecache, belady=0.30):
        return {"trace": trace, "half": None, "capacity": 0.05, "seed": seed,
                "gap_share": {"saecache": 0.2, "lpc": 0.1},
                "token_hit_rate": {"lru": 0.10, "lpc": 0.12, "saecache": saecache, "belady": belady}}

    rows = [row("wildchat", 0, 0.13), row("wildchat", 1, 0.15), row("wildchat", 2, 0.17), row("mooncake", None, 0.11)]
    gap_table.print_criteria(rows, {}, "in a test")
    out = capsys.readouterr().out
    assert "the traces in a test, seed 0): +0.00" in out  # seed 0's +1.00 and the recorded -1.00
    assert "at its mean over the seeds (3): +1.00" in out  # WildChat at +3.00 and the recorded -1.00
    narrow = [row("wildchat", s, 0.2, belady=0.12) for s in (0, 1)] + [row("mooncake", None, 0.11)]
    gap_table.print_criteria(narrow, {}, "in a test")
    assert "(2): -1.00" in capsys.readouterr().out  # WildChat's cell is narrow at seed 0: not among the wide


def test_gap_table_repeat(tmp_path):
    """--repeat N replays each trace made N times longer (sae_env.trace.repeated, --pause seconds apart): each row the
    number of the longer trace replayed here, its cache the same fraction of the longer trace's distinct blocks, the
    rows and the criteria labelled so. Bad values, or --repeat with --halves, exit 2 with one line."""
    import subprocess
    import sys
    from pathlib import Path

    from sae_env.cache import resolve_capacity
    from sae_env.metrics import summarize
    from sae_env.sources import open_trace
    from sae_env.trace import repeated

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(script), "--traces", "wildchat", "--capacities", "0.05", "--repeat", "2",
                          "--pause", "600", "--policies", "lru,lpc,saecache,belady", "--criteria", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())
    trace, _ = open_trace("wildchat")
    longer = repeated(trace, 2, pause=600.0)
    assert len(longer) == 2 * len(trace) and longer.distinct_blocks() == 2 * trace.distinct_blocks()
    assert row["repeat"] == 2 and row["pause"] == 600.0
    assert row["capacity_blocks"] == resolve_capacity(0.05, longer.distinct_blocks())
    rep = Replay(longer, PrefixCache(row["capacity_blocks"], make_policy("lru")), None, window_requests=200)
    rep.run()
    assert row["token_hit_rate"]["lru"] == summarize(rep.windows)["token_hit_rate"]
    assert "| wildchat x2 | 5% (" in run.stdout
    assert "on the traces made 2 times longer (600 s apart) (seed 0)" in run.stdout
    for bad in (["--repeat", "0"], ["--pause", "-1"], ["--pause", "nan"], ["--repeat", "2", "--halves"]):
        done = subprocess.run([sys.executable, str(script), "--traces", "wildchat", *bad], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (bad, done.stderr)
        assert done.stdout == "", bad


def test_gap_table_takes_trace_files(tmp_path):
    """--traces FILE --source FORMAT: the embedded mooncake_arxiv's own file read as a Mooncake trace gives the rows of
    the embedded name (the same trace), and the criteria say "as given"; a file without --source, or with a format it
    is not in, exits 2 with one line naming the file."""
    import subprocess
    import sys
    from pathlib import Path

    from sae_env import data

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gap_table.py"
    path = str(data.ALL["mooncake_arxiv"][0])
    rows = []
    for traces, extra in ((path, ["--source", "mooncake", "--criteria"]), ("mooncake_arxiv", [])):
        out = tmp_path / "rows.json"
        run = subprocess.run([sys.executable, str(script), "--traces", traces, "--capacities", "0.05", "--policies",
                              "lru,lpc,saecache,belady", "--json", str(out), *extra], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        rows.append(json.loads(out.read_text()))
        if extra:
            assert "on the traces as given (seed 0)" in run.stdout
    assert rows[0][0]["token_hit_rate"] == rows[1][0]["token_hit_rate"]
    assert rows[0][0]["capacity_blocks"] == rows[1][0]["capacity_blocks"]
    for extra in ([], ["--source", "bailian"], ["--source", "nope"]):
        done = subprocess.run([sys.executable, str(script), "--traces", path, "--capacities", "0.05", "--policies",
                               "lru,belady", *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (extra, done.stderr)
        assert path in done.stderr and done.stdout == "", extra


def test_rate_bias_probe():
    """benchmarks/probes/rate_bias.py: its EM is the cure model's fixed point under Beta(1, 1): requests with no
    survival left count as ended ((3 + 1) / (8 + 2)); with survival 1 each counts by the rate itself, p = (3 + 5 p + 1)
    / 10, so 0.8; between, between. The script runs on a real trace's early half with the online learners, and
    reports each turn bucket, the EM over the requests so far under three gap laws and the gaps by arrival time."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "probes" / "rate_bias.py"
    spec = importlib.util.spec_from_file_location("rate_bias", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    back = np.array([True] * 3 + [False] * 5)
    assert probe.em_rate(back, np.zeros(5)) == pytest.approx(4 / 10)
    assert probe.em_rate(back, np.ones(5)) == pytest.approx(0.8, abs=1e-6)
    assert 0.4 < probe.em_rate(back, np.full(5, 0.3)) < 0.8
    run = subprocess.run([sys.executable, str(path), "--trace", "taubench", "--buckets", "3", "--learners", "--half",
                          "early"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("taubench (early half): 1229 requests") and "(learned)" in out
    assert "| after request | learned |" in out and "- bucket 1 (100 requests)" in out
    assert "| after request | policy's gaps | pooled | own |" in out and "| 0-59 | 25 / 15 / 14 |" in out
