"""Seeded mutations of real input lines, for every source, through the command line (issue 15).

Each source starts from a few real lines (records) of its embedded data: Mooncake, Bailian, WildChat conversations,
GSM8K, tau-bench trajectories, Azure CSV rows, the project's own trace (``.jsonl`` and ``.npz``) and a mix config
over them. Each case mutates one of them with a seeded operator (a hostile value put at a random place of a parsed
record: huge and negative integers, NaN, infinities, booleans, nested lists, wrong types; a key deleted; bytes
flipped, deleted, inserted or cut; a BOM, a gzip stream broken), writes it to a file and runs ``train.py replay`` or
``train.py characterize`` on it in this process. The only acceptable outcomes:

* exit status 0 (the mutation left a valid trace, which then replays or is characterised), or
* exit status 2 with one ``error:`` line that names the mutated file;

never an exception out of the command line (a traceback), another status, or a hang (a case is stopped after
:data:`CASE_SECONDS`). The suite runs :data:`PER_SOURCE` cases per source; a larger run is the slow test, or::

    python tests/test_fuzz_sources.py --per-source 1000 [--seed 0]

which prints the counts (tried, exit 2, valid, tracebacks, hangs) per source.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import io
import json
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from agents.cli import main  # noqa: E402
from sae_env import data  # noqa: E402

PER_SOURCE = 100  # cases per source in the suite
CASE_SECONDS = 30.0  # a case still running after this is a hang

# Values put in place of a parsed field: past every bound, of every wrong type, and a few valid edge values.
HOSTILE: list[Any] = [-1, 0, 1, 1.5, -1e-9, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, 1e300, -1e300,
                      float("nan"), float("inf"), float("-inf"), True, False, None, "", "x", "1", "\ufeff", "\udcff",
                      [], {}, [[1]], [True], [1.5], [-1], [2**64], ["1"], {"a": 1}, "9999-12-31", "-1"]
HOSTILE_TEXT = ["", "-1", "0", "1e10", "9" * 30, "NaN", "inf", "2023-13-45 00:00:00", "9999-12-31", "1000-01-01",
                "-1", " ", "1,2", "\ufeff2023-11-16 18:17:03", "\x00", "12.5", "0x10", "１２"]
HOSTILE_BYTES = [b"\xff", b"\x00", b"\xef\xbb\xbf", b"\n", b'"', b"{", b"]", b",", b"\xc3", b"\r\n", b"\\", b"NaN"]


# -- inputs: a few real records per source ---------------------------------------------------------------------

def _lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


@dataclass
class Source:
    """One source under test: how its input is written and how the command line is asked to read it."""

    name: str
    kind: str  # "jsonl", "json", "csv", "npz", "yaml"
    suffix: str
    records: Any  # lines, a JSON document, or arrays
    argv: list[str] = field(default_factory=list)  # after the path: --source and options


def sources(base: Path) -> list[Source]:
    """The real starting points (written under ``base`` where a source needs companion files)."""
    from sae_env.sources import load_source

    out = [
        Source("mooncake", "jsonl", ".jsonl", _lines(data.MOONCAKE_ARXIV, 12), ["--source", "mooncake"]),
        Source("bailian", "jsonl", ".jsonl", _lines(data.BAILIAN, 10), ["--source", "bailian"]),
        Source("conversations", "jsonl", ".jsonl", _lines(data.WILDCHAT, 3), ["--source", "conversations"]),
        Source("gsm8k", "jsonl", ".jsonl", _lines(data.GSM8K, 4), ["--source", "gsm8k", "--opt", "shots=1"]),
        Source("azure", "csv", ".csv", _lines(data.AZURE_CODE, 15), ["--source", "azure"]),
    ]
    with gzip.open(data.TAUBENCH, "rt", encoding="utf-8") as f:
        trajectories = json.load(f)[:2]
    out.append(Source("taubench", "json", ".json", trajectories, ["--source", "taubench", "--opt", "tools=none"]))
    trace, _ = load_source("bailian", data.BAILIAN)
    trace.save(base / "native.jsonl")
    trace.save(base / "native.npz")
    out.append(Source("trace.jsonl", "jsonl", ".jsonl", (base / "native.jsonl").read_text().splitlines(), []))
    with np.load(base / "native.npz", allow_pickle=False) as z:
        out.append(Source("trace.npz", "npz", ".npz", {k: z[k] for k in z.files}, []))
    mooncake = base / "mooncake.jsonl"
    mooncake.write_text("\n".join(out[0].records) + "\n")
    mix = {"seed": 1, "block_size": 512,
           "components": [{"name": "m", "source": "mooncake", "path": str(mooncake)},
                          {"name": "s", "source": "synthetic", "options": {"preset": "tiny", "block_size": 512}}],
           "phases": [{"duration": 60, "rate": 0.5, "weights": {"m": 1, "s": 1}, "name": "one"}]}
    out.append(Source("mix", "yaml", ".yaml", mix, ["--source", "mix"]))
    return out


# -- mutations -------------------------------------------------------------------------------------------------

def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document (the document itself included)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:50]):  # long id lists: their first elements are enough
            out += _paths(v, (*prefix, i))
    return out


def mutate_json(doc: Any, rng: np.random.Generator) -> Any:
    """One hostile change at a random place: a value replaced, a key deleted or added, a list emptied or grown."""
    doc = copy.deepcopy(doc)
    places = _paths(doc)
    place = places[int(rng.integers(len(places)))]
    if not place:
        return HOSTILE[int(rng.integers(len(HOSTILE)))]
    parent = doc
    for k in place[:-1]:
        parent = parent[k]
    key = place[-1]
    op = rng.integers(5)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, dict):
        parent["extra_" + str(rng.integers(9))] = HOSTILE[int(rng.integers(len(HOSTILE)))]
    elif op == 2 and isinstance(parent, list):
        parent.insert(int(key), copy.deepcopy(parent[key]))
    else:
        parent[key] = copy.deepcopy(HOSTILE[int(rng.integers(len(HOSTILE)))])
    return doc


def _dumps(doc: Any, rng: np.random.Generator) -> str:
    # NaN, infinities and lone surrogates as Python writes them (what a careless writer produces), escaped or raw
    return json.dumps(doc, ensure_ascii=bool(rng.integers(2)))


def _mutate_bytes(blob: bytes, rng: np.random.Generator) -> bytes:
    n = len(blob)
    op = rng.integers(6)
    i = int(rng.integers(max(n, 1)))
    if op == 0 and n:
        return blob[:i] + bytes([int(rng.integers(256))]) + blob[i + 1:]
    if op == 1:
        return blob[:i] + HOSTILE_BYTES[int(rng.integers(len(HOSTILE_BYTES)))] + blob[i:]
    if op == 2:
        return blob[:i] + blob[i + int(rng.integers(1, 64)):]
    if op == 3:
        return blob[:i]  # cut short
    if op == 4:
        return b"\xef\xbb\xbf" + blob  # a byte-order mark: valid, every source must read it
    return blob + blob[i:]  # a tail repeated


def _mutate_csv(lines: list[str], rng: np.random.Generator) -> list[str]:
    lines = list(lines)
    row = int(rng.integers(len(lines)))
    parts = lines[row].split(",")
    col = int(rng.integers(len(parts)))
    parts[col] = HOSTILE_TEXT[int(rng.integers(len(HOSTILE_TEXT)))]
    lines[row] = ",".join(parts)
    return lines


def _mutate_npz(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = {k: v.copy() for k, v in arrays.items()}
    name = sorted(arrays)[int(rng.integers(len(arrays)))]
    a = arrays[name]
    op = rng.integers(7)
    if name == "header" and op < 4:
        header = mutate_json(json.loads(a.tobytes()), rng)
        arrays[name] = np.frombuffer(_dumps(header, rng).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    elif op == 0:
        del arrays[name]
    elif op == 1:
        with np.errstate(all="ignore"):  # wrapping and overflow are the point
            arrays[name] = a.astype([str, np.float64, np.float16, bool, np.int8, np.uint64, np.int32][
                int(rng.integers(7))])
    elif op == 2:
        arrays[name] = a.reshape(-1, 1) if a.size else a.reshape(0, 1)
    elif op == 3 and a.size:
        if a.dtype.kind == "f":
            values = [np.nan, np.inf, -1.0, 1e300, -1e-9]
        elif a.dtype.kind in "iu":
            values = [np.iinfo(a.dtype).max, np.iinfo(a.dtype).min, 0, 1]
        else:
            values = [0]
        a[int(rng.integers(a.size))] = values[int(rng.integers(len(values)))]
    elif op == 4:
        arrays[name] = a[: int(rng.integers(a.size + 1))]
    elif op == 5:
        arrays["extra"] = np.arange(3)
    else:
        arrays[name] = np.concatenate([a, a[:1]]) if a.ndim == 1 else a
    return arrays


def write_case(src: Source, rng: np.random.Generator, folder: Path, index: int) -> Path:
    """One mutated input of ``src`` as a file; returns its path."""
    gz = rng.random() < 0.15 and src.kind != "npz"
    path = folder / f"case{index}{src.suffix}{'.gz' if gz else ''}"
    if src.kind == "npz":
        if rng.random() < 0.2:  # the file's bytes themselves
            buf = io.BytesIO()
            np.savez(buf, **src.records)
            path.write_bytes(_mutate_bytes(buf.getvalue(), rng))
            return path
        np.savez(path, **_mutate_npz(src.records, rng))
        return path
    if rng.random() < 0.25:
        text = _text(src, src.records, rng)
        blob = _mutate_bytes(text.encode("utf-8", "surrogatepass"), rng)
    else:
        if src.kind == "csv":
            body = src.records[:1] + _mutate_csv(src.records[1:], rng)
            blob = ("\n".join(body) + "\n").encode()
        elif src.kind == "jsonl":
            lines = list(src.records)
            i = int(rng.integers(len(lines)))
            lines[i] = _dumps(mutate_json(json.loads(lines[i]), rng), rng)
            blob = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
        else:  # a whole JSON document (tau-bench) or a YAML mapping (mix; JSON is YAML)
            doc = mutate_json(src.records, rng)
            if src.kind == "yaml" and rng.random() < 0.1:  # a component that is this very config
                doc = copy.deepcopy(src.records)
                doc["components"][0] = {"name": "m", "source": "mix", "path": str(path)}
            blob = _dumps(doc, rng).encode("utf-8", "surrogatepass")
    if gz:
        blob = gzip.compress(blob)
        if rng.random() < 0.3:
            blob = blob[: int(rng.integers(len(blob)))]  # a broken gzip stream
    path.write_bytes(blob)
    return path


def _text(src: Source, records: Any, rng: np.random.Generator) -> str:
    if src.kind in ("jsonl", "csv"):
        return "\n".join(records) + "\n"
    return _dumps(records, rng)


# -- running a case --------------------------------------------------------------------------------------------

class Hang(BaseException):
    """Raised by the alarm: a BaseException, so that no ``except Exception`` on the way can swallow it."""


@dataclass
class Outcome:
    kind: str  # "valid", "exit2", "traceback", "hang", "other"
    detail: str = ""


def run_case(path: Path, src: Source, command: str) -> Outcome:
    argv = (["replay", "--trace", str(path), "--policy", "lru", "--capacity", "1", "--window", "1000"]
            if command == "replay" else ["characterize", str(path)]) + src.argv
    err, out = io.StringIO(), io.StringIO()

    def alarm(signum: int, frame: Any) -> None:
        raise Hang()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(argv)
    except Hang:
        return Outcome("hang", " ".join(argv))
    except BaseException as e:  # noqa: BLE001 - anything out of the command line is a finding
        return Outcome("traceback", f"{' '.join(argv)}\n{''.join(traceback.format_exception(e))[-3000:]}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    if rc == 0:
        return Outcome("valid")
    if rc == 2 and len(errors) == 1 and path.name in errors[0]:
        return Outcome("exit2", errors[0])
    return Outcome("other", f"rc={rc} {' '.join(argv)}: {err.getvalue()[-500:]}")


def fuzz(per_source: int, seed: int, folder: Path, only: str | None = None,
         report: Callable[[str], None] | None = None) -> tuple[dict[str, Counter], list[str]]:
    """Run ``per_source`` cases per source; returns counts per source and the findings (anything but valid or a
    clean exit 2)."""
    counts: dict[str, Counter] = {}
    findings: list[str] = []
    for k, src in enumerate(sources(folder)):
        if only and src.name != only:
            continue
        rng = np.random.default_rng([seed, k])
        c = counts[src.name] = Counter()
        case_dir = folder / src.name.replace(".", "_")
        case_dir.mkdir(exist_ok=True)
        for i in range(per_source):
            path = write_case(src, rng, case_dir, i)
            outcome = run_case(path, src, "replay" if i % 2 == 0 else "characterize")
            c["tried"] += 1
            c[outcome.kind] += 1
            if outcome.kind not in ("valid", "exit2"):
                findings.append(f"{src.name} case {i} ({path}): {outcome.kind}: {outcome.detail}")
            else:
                path.unlink()
        if report:
            report(f"{src.name:14s} " + " ".join(f"{k}={c[k]}" for k in ("tried", "exit2", "valid", "traceback",
                                                                           "hang", "other")))
    return counts, findings


# -- the tests ---------------------------------------------------------------------------------------------------

def _check(per_source: int, seed: int, tmp_path: Path) -> None:
    counts, findings = fuzz(per_source, seed, tmp_path, report=print)
    assert not findings, "\n\n".join(findings[:5])
    for name, c in counts.items():
        assert c["tried"] == per_source and c["exit2"] + c["valid"] == per_source, (name, c)
        assert c["exit2"] > 0, f"{name}: no mutation was refused: the fuzzer does not reach the checks"
    assert sum(c["valid"] for c in counts.values()) > 0


def test_mutated_real_inputs_exit_2_or_load(tmp_path):
    _check(PER_SOURCE, 0, tmp_path)


@pytest.mark.slow
def test_mutated_real_inputs_exit_2_or_load_many(tmp_path):
    _check(400, 1, tmp_path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-source", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="one source (mooncake, bailian, conversations, gsm8k, azure, taubench, "
                    "trace.jsonl, trace.npz, mix)")
    ap.add_argument("--keep", metavar="DIR", help="keep the cases that are findings in DIR")
    args = ap.parse_args()
    import tempfile

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        counts, findings = fuzz(args.per_source, args.seed, folder, args.only, report=print)
    total = sum(counts.values(), Counter())
    print(f"{'all':14s} " + " ".join(f"{k}={total[k]}" for k in ("tried", "exit2", "valid", "traceback", "hang",
                                                                  "other"))
          + f" ({time.perf_counter() - t0:.0f} s)")
    for f in findings[:20]:
        print("\n" + f)
    sys.exit(1 if findings else 0)
