"""Every source treats its input file alike: gzip by name (``.gz``, ``.jsonl.gz`` included), a UTF-8 byte-order mark
skipped, and a folder, text that is not UTF-8 or a broken gzip stream reported as an error that names the file
(issue 15: some sources rejected a BOM or a ``.jsonl.gz`` that others accepted, and several failed with a bare
``UnicodeDecodeError`` or ``EOFError``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sae_env.sources import load_source, open_trace
from sae_env.trace import Trace, TraceFormatError

MOONCAKE = "".join(json.dumps({"timestamp": 1000 * i, "input_length": 1100, "output_length": 20,
                               "hash_ids": [0, 1 + i, 2 + i]}) + "\n" for i in range(4))
BAILIAN = "".join(json.dumps({"chat_id": i, "parent_chat_id": -1, "timestamp": float(i), "input_length": 40,
                              "output_length": 9, "type": "text", "turn": 1, "hash_ids": [1, 2, 3 + i]}) + "\n"
                  for i in range(4))
CONVERSATIONS = "".join(json.dumps({"messages": [{"role": "user", "content": f"question number {i} " * 8},
                                                 {"role": "assistant", "content": f"answer {i} " * 12}]}) + "\n"
                        for i in range(3))
TAUBENCH = json.dumps([{"task_id": i, "traj": [{"role": "system", "content": "you are an airline agent " * 4},
                                               {"role": "user", "content": f"change flight {i} " * 6},
                                               {"role": "assistant", "content": "sure, which booking? " * 5}]}
                       for i in range(3)])
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,480,10\n"
         "2023-11-16 18:17:04.0319600,318,8\n2023-11-16 18:17:05.0000000,100,3\n")

# source, file name, content, options
CASES = [
    ("mooncake", "t.jsonl", MOONCAKE, {}),
    ("bailian", "t.jsonl", BAILIAN, {}),
    ("conversations", "t.jsonl", CONVERSATIONS, {}),
    ("taubench", "t.json", TAUBENCH, {"tools": "none"}),
    ("azure", "t.csv", AZURE, {}),
]
IDS = [c[0] for c in CASES]


def _native(tmp_path: Path) -> str:
    trace, _ = load_source("bailian", _write(tmp_path / "src.jsonl", BAILIAN))
    trace.save(tmp_path / "n.jsonl")
    return (tmp_path / "n.jsonl").read_text()


def _write(path: Path, text: str | bytes) -> Path:
    data = text.encode("utf-8") if isinstance(text, str) else text
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _all_cases(tmp_path: Path) -> list[tuple[str, str, str, dict]]:
    return [*CASES, ("trace", "n.jsonl", _native(tmp_path), {})]


@pytest.mark.parametrize("index", range(len(CASES) + 1), ids=[*IDS, "trace"])
def test_plain_gzip_and_bom_give_the_same_trace(tmp_path, index):
    source, name, text, options = _all_cases(tmp_path)[index]
    ref, _ = load_source(source, _write(tmp_path / name, text), **options)
    assert len(ref) > 0
    for variant, content in ((name + ".gz", text), ("bom_" + name, "\ufeff" + text),
                             ("bom_" + name + ".gz", "\ufeff" + text)):
        trace, _ = load_source(source, _write(tmp_path / variant, content), **options)
        assert trace.equals(ref), variant


def test_native_jsonl_gz_is_recognised_without_a_source(tmp_path):
    trace, _ = load_source("bailian", _write(tmp_path / "src.jsonl", BAILIAN))
    trace.save(tmp_path / "n.jsonl.gz")
    back, _ = open_trace(str(tmp_path / "n.jsonl.gz"))
    assert back.equals(trace)
    assert Trace.load(tmp_path / "n.jsonl.gz").equals(trace)


@pytest.mark.parametrize("index", range(len(CASES) + 1), ids=[*IDS, "trace"])
def test_bad_files_name_the_file(tmp_path, index):
    source, name, text, options = _all_cases(tmp_path)[index]
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(TraceFormatError, match="is a folder") as exc:
        load_source(source, folder, **options)
    assert str(folder) in str(exc.value)

    data = text.encode()
    cut = data.rfind(b"\n", 0, len(data) - 2) + 1 if data.count(b"\n") > 1 else len(data) // 2
    not_utf8 = _write(tmp_path / ("x" + name), data[:cut] + b"\xff\xfe" + data[cut:])
    with pytest.raises(TraceFormatError, match="not UTF-8") as exc:
        load_source(source, not_utf8, **options)
    assert str(not_utf8) in str(exc.value)

    broken = tmp_path / ("broken_" + name + ".gz")
    broken.write_bytes(gzip.compress(data * 20)[:40])
    with pytest.raises(TraceFormatError, match="unreadable gzip stream") as exc:
        load_source(source, broken, **options)
    assert str(broken) in str(exc.value)

    not_gzip = _write(tmp_path / ("plain_" + name), text)
    renamed = not_gzip.rename(tmp_path / ("plain_" + name + ".gz"))
    with pytest.raises(TraceFormatError, match="unreadable gzip stream"):
        load_source(source, renamed, **options)


def test_a_folder_as_trace_names_it(tmp_path):
    with pytest.raises(TraceFormatError, match="is a folder"):
        open_trace(str(tmp_path))
    with pytest.raises(TraceFormatError, match="is a folder"):
        Trace.load(tmp_path)


GSM8K = "".join(json.dumps({"question": f"Tom has {i} apples and buys 3 more. How many?",
                            "answer": f"He has {i} + 3 = <<{i}+3={i + 3}>>{i + 3} apples.\n#### {i + 3}"}) + "\n"
                for i in range(3))


@pytest.mark.parametrize("source, name, text, options", [
    ("conversations", "t.jsonl", CONVERSATIONS, {}),
    ("taubench", "t.json", TAUBENCH, {"tools": "none"}),
    ("gsm8k", "t.jsonl", GSM8K, {"shots": 1}),
], ids=["conversations", "taubench", "gsm8k"])
def test_half_a_surrogate_pair_is_not_text(tmp_path, source, name, text, options):
    """A lone \\udcff escape is valid JSON but not text: the tokenizer could not encode it and the error named no
    file (found by the fuzz test). A whole pair (an emoji written escaped) is text and loads."""
    ref, _ = load_source(source, _write(tmp_path / name, text), **options)
    pair = text.replace("question number 1", "question \\ud83d\\ude00 1").replace(
        "change flight 1", "change flight \\ud83d\\ude00 1").replace("Tom has 1", "Tom \\ud83d\\ude00 has 1")
    assert pair != text
    trace, _ = load_source(source, _write(tmp_path / ("pair_" + name), pair), **options)
    assert len(trace) == len(ref)
    lone = pair.replace("\\ude00", "")
    with pytest.raises(TraceFormatError, match="surrogate") as exc:
        load_source(source, _write(tmp_path / ("lone_" + name), lone), **options)
    assert str(tmp_path / ("lone_" + name)) in str(exc.value) and exc.value.field
