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


def test_replay_with_a_serving_model_reports_ttft(tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", "mooncake_arxiv", "--policy", "saecache", "--capacity", "15%",
                 "--serving", "qwen2.5-1.5b@h200", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"]
    assert r["adaptive"] is True and r["requests"] == 1000


@pytest.mark.parametrize("argv, message", [
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
