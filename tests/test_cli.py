"""The command line: subcommands, JSON outputs, and bad input that exits with status 2 and one clear line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agents.cli import main

ROOT = Path(__file__).resolve().parents[1]
REPLAY_KEYS = {"policy", "capacity_blocks", "requests", "prompt_tokens", "hit_tokens", "token_hit_rate",
               "block_hit_rate", "evictions", "bypasses", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms"}


def test_characterize_writes_the_study(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["characterize", "bailian", "--json", str(out), "--plots", str(tmp_path / "plots")]) == 0
    assert "token type" in capsys.readouterr().out
    result = json.loads(out.read_text())
    for key in ("requests", "sessions", "block_refs", "distinct_blocks", "reuse_ratio", "by_token_type", "by_app",
                "gaps"):
        assert key in result
    assert result["requests"] == 22
    assert sorted(p.name for p in (tmp_path / "plots").iterdir())  # PNGs written


def test_replay_instant_has_no_ttft_and_lists_policies_side_by_side(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "bailian", "--policy", "lru,belady", "--capacity", "0.5",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "lru" in table and "belady" in table
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["lru", "belady"]
    for r in rows:
        assert REPLAY_KEYS <= set(r)
        assert r["ttft_mean_ms"] is None and r["ttft_p99_ms"] is None
    assert rows[1]["hit_tokens"] >= rows[0]["hit_tokens"]  # the oracle bound


def test_replay_takes_a_policy_by_module_and_class(tmp_path, capsys):
    """--policy module:Class replays an unregistered policy class: a registered one named so gives its numbers; a name
    that imports nothing, or no policy class, exits with status 2 and one line naming it."""
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "bailian", "--policy", "lru,sae_env.policies.lru:LRUPolicy", "--capacity", "0.2",
                 "--json", str(out)]) == 0
    named, by_class = json.loads(out.read_text())
    assert by_class["policy"] == "sae_env.policies.lru:LRUPolicy" and by_class["hit_tokens"] == named["hit_tokens"]
    capsys.readouterr()
    for bad, said in (("no_such_module:X", "cannot import"), ("sae_env.trace:Trace", "not a policy class")):
        assert main(["replay", "--trace", "bailian", "--policy", f"lru,{bad}", "--capacity", "0.2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and bad in err[0] and said in err[0], err


def test_replay_with_a_serving_model_reports_ttft(tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "mooncake_arxiv", "--policy", "saecache", "--capacity", "15%",
                 "--serving", "qwen2.5-1.5b@h200", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"]
    assert r["adaptive"] is True and r["requests"] == 1000


def test_replay_says_which_engine_timed_each_policy(tmp_path, capsys):
    """decision_us_per_request is the time of the engine that ran the replay: the JSON names it, and a policy the
    compiled engine declines (while it runs the others) is named on a line of its own, with the reason."""
    from sae_env.fast_engine import AVAILABLE

    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "bailian", "--policy", "lru,saecache", "--capacity", "0.5",
                 "--policy-opt", "lognormal=false", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    lru, sae = json.loads(out.read_text())
    assert sae["engine"] == "python" and "lognormal=False" in sae["engine_note"]
    if AVAILABLE:
        assert lru["engine"] == "fast" and "engine_note" not in lru
        assert "saecache ran on the Python engine: saecache: exponential gaps" in said
        assert "lru ran on the Python engine" not in said
    else:
        assert lru["engine"] == "python" and "ran on the Python engine" not in said
    assert sae["prepare_us_per_request"] is None  # the Python engine does that work inside each request


def test_replay_gives_the_part_of_the_decision_time_spent_ahead_of_the_loop(tmp_path):
    """prepare_us_per_request: the compiled engine's time in a policy's per-window work ahead of its loop, a part of
    decision_us_per_request; SAECache's arrivals and continuation model have some, LRU none."""
    from sae_env.fast_engine import AVAILABLE

    if not AVAILABLE:
        pytest.skip("needs the compiled engine (numba)")
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "mooncake_arxiv", "--policy", "lru,saecache", "--capacity", "0.1", "--json",
                 str(out)]) == 0
    lru, sae = json.loads(out.read_text())
    assert lru["engine"] == sae["engine"] == "fast"
    assert lru["prepare_us_per_request"] < 0.05 * lru["decision_us_per_request"]  # a call that does nothing
    assert 0 < sae["prepare_us_per_request"] < sae["decision_us_per_request"]


def test_replay_policy_options_go_to_the_policies_that_take_them(tmp_path, capsys):
    """--policy-opt reaches the constructor of the listed policies that take it (the same hit rate as
    make_policy(..., continuation=False) replayed as replay runs it) and no other; the summary records it."""
    from replaying import replay_like_train, token_hit_rate

    from sae_env.cache import resolve_capacity
    from sae_env.policies import make_policy
    from sae_env.sources import open_trace

    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "wildchat", "--policy", "lpc,saecache", "--capacity", "0.05",
                 "--policy-opt", "continuation=false", "--json", str(out)]) == 0
    assert "saecache ran with continuation=False" in capsys.readouterr().out
    lpc, sae = json.loads(out.read_text())
    assert lpc["policy_options"] == {} and sae["policy_options"] == {"continuation": False}
    trace, _ = open_trace("wildchat", None, {}, None)
    capacity = resolve_capacity(0.05, trace.distinct_blocks())

    def rate(**options):
        return token_hit_rate(replay_like_train(trace, capacity, make_policy("saecache", **options)))

    assert sae["token_hit_rate"] == rate(continuation=False) != rate()


@pytest.mark.parametrize("argv, message", [
    (["replay", "--trace", "bailian", "--policy", "lru,lpc", "--policy-opt", "continuation=false"],
     "--policy-opt continuation: none of lru, lpc takes it"),
    (["replay", "--trace", "bailian", "--policy", "saecache", "--policy-opt", "continuation"],
     "--policy-opt expects KEY=VALUE"),
    (["replay", "--trace", "bailian", "--policy", "saecache", "--policy-opt", "sample=0"], "sample must be >= 1"),
    (["replay", "--trace", "bailian", "--policy", "saecache", "--policy-opt", "timed_refit=maybe"],
     "timed_refit must be true or false, got 'maybe'"),
    (["replay", "--trace", "bailian", "--policy", "nope"], "valid policies: lru"),
    (["replay", "--trace", "bailian", "--capacity", "0"], "capacity"),
    (["replay", "--trace", "bailian", "--capacity", "-3"], "capacity"),
    (["replay", "--trace", "bailian", "--capacity", "lots"], "capacity"),
    (["replay", "--trace", "bailian", "--capacity", "1000000000"], "more than 100x"),
    (["replay", "--trace", "bailian", "--block-size", "32"], "block size"),
    (["replay", "--trace", "bailian", "--load", "0.5"], "timed serving model"),
    (["replay", "--trace", "bailian", "--serving", "qwen9@tpu"], "valid"),
    (["characterize", "/no/such/file.jsonl", "--source", "mooncake"], "no such file"),
    (["characterize", "bailian", "--source", "nope"], "valid sources"),
])
def test_bad_input_exits_2_with_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


@pytest.mark.parametrize("argv, message", [
    # issue 15: each of these was a traceback
    (["replay", "--trace", "synthetic", "--opt", "seed=[1"], "seed=[1: the value is not YAML"),
    (["replay", "--trace", "synthetic", "--opt", "preset=tiny", "--opt", f"seed={2**64}"], "seed must fit in 64"),
    (["replay", "--trace", "synthetic", "--opt", "preset=tiny", "--opt", f"seed={10**400}"], "seed must fit"),
    (["replay", "--trace", "bailian", "--capacity", str(10**400)], "below 2**63, got 1000"),
    (["replay", "--trace", "bailian", "--capacity", str(2**63)], "below 2**63"),
    (["replay", "--trace", "bailian", "--json", "/tmp"], "--json /tmp is a folder"),
    (["characterize", "bailian", "--json", "/tmp"], "--json /tmp is a folder"),
    # issue 15: silently one block
    (["replay", "--trace", "bailian", "--capacity", "0.0000001"], "less than one"),
    # found by the fuzz test and the probes of issue 15
    (["replay", "--trace", "wildchat", "--block-size", str(10**20)], "--block-size must lie in [1, 100,000,000]"),
    (["replay", "--trace", "synthetic", "--opt", "preset=[1]"], "unknown synthetic preset [1]"),
    (["tune", "--env", "{trace: {source: synthetic, preset: tiny}}", "--trials", str(10**30), "--out", "/tmp/t.json",
      "--serial"], "n_trials must lie in [1, 1,000,000]"),
])
def test_user_errors_are_one_line_not_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1
    assert "Traceback" not in err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    """``--plots`` on an existing file; ``--json`` on a folder left a temp file in ``/`` (issue 15)."""
    out = tmp_path / "out"
    out.mkdir()
    existing = out / "plots.png"
    existing.write_text("x")
    assert main(["characterize", "bailian", "--plots", str(existing)]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err
    before = {p.name for p in Path("/").iterdir()}
    assert main(["replay", "--trace", "bailian", "--json", str(out)]) == 2
    assert {p.name for p in Path("/").iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["plots.png"]


def test_paths_that_cannot_be_what_they_must(tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main(["run", "--config", str(folder)]) == 2
    assert f"{folder} is a folder, not a file" in capsys.readouterr().err
    assert main(["predictor", "--train", "bailian", "--out", str(folder)]) == 2  # before training, not after
    assert f"--out {folder} is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # was silently "all CPUs"
        main(["run", "--num-cpus", "0"])
    assert exit_.value.code == 2 and "--num-cpus: expected an integer >= 1" in capsys.readouterr().err


def test_folders_and_self_including_mixes_as_traces(tmp_path, capsys):
    for source in ("mooncake", "azure", "conversations", "bailian", "trace"):
        assert main(["replay", "--trace", str(tmp_path), "--source", source]) == 2
        assert "is a folder, not a trace file" in capsys.readouterr().err
    assert main(["replay", "--trace", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    mix = tmp_path / "m.yaml"
    mix.write_text("components:\n  - {name: me, source: mix, path: m.yaml}\n"
                   "phases:\n  - {duration: 10, rate: 1, weights: {me: 1}}\n")
    assert main(["replay", "--trace", str(mix), "--source", "mix"]) == 2
    assert "cannot include itself" in capsys.readouterr().err


def test_a_trace_on_standard_input(tmp_path):
    """``--trace -`` reads standard input (it loaded the embedded data of the source instead)."""
    rows = "".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1 + i]}) + "\n"
                   for i in range(5))
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "train.py", "replay", "--trace", "-", "--source", "mooncake", "--capacity",
                          "2", "--json", str(out)], cwd=ROOT, input=rows, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["requests"] == 5
    run = subprocess.run([sys.executable, "train.py", "replay", "--trace", "-"], cwd=ROOT, input=rows,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "needs its format" in run.stderr


def test_malformed_trace_names_file_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1, "input_length": "x", "output_length": 5, "hash_ids": [1]}\n')
    assert main(["characterize", str(bad), "--source", "mooncake"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "line 2" in err and "input_length" in err


def test_train_py_entry_point_and_help():
    run = subprocess.run([sys.executable, "train.py", "replay", "--trace", "bailian", "--policy", "bogus"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "valid policies" in run.stderr
    for sub in ([], ["characterize"], ["replay"], ["predictor"]):
        h = subprocess.run([sys.executable, "train.py", *sub, "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert h.returncode == 0 and "usage" in h.stdout
