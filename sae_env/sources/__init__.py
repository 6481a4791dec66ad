"""Trace sources: one module per input format, each with ``load(path, **options) -> (Trace, LoadReport)``.

The registry maps a source name to its module; modules are imported lazily so that loading one format never
pulls in another's dependencies. Every loader validates its input and either rejects a bad row with a counted
reason (``on_error="skip"``) or raises :class:`~sae_env.trace.TraceFormatError` naming file, line and field
(``on_error="raise"``, the default).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sae_env.trace import LoadReport, Trace, TraceFormatError

SOURCES: dict[str, str] = {
    "mooncake": "sae_env.sources.mooncake",
    "bailian": "sae_env.sources.bailian",
    "conversations": "sae_env.sources.conversations",
    "taubench": "sae_env.sources.taubench",
    "gsm8k": "sae_env.sources.gsm8k",
    "azure": "sae_env.sources.azure",
    "synthetic": "sae_env.sources.synthetic",
    "mix": "sae_env.sources.mix",
    "trace": "sae_env.sources.native",
}


def source_names() -> list[str]:
    return sorted(SOURCES)


def load_source(source: str, path: str | os.PathLike | None, **options: Any) -> tuple[Trace, LoadReport]:
    """Load ``path`` with the named source; ``ValueError`` (listing valid names) for an unknown source."""
    if source not in SOURCES:
        raise ValueError(f"unknown source '{source}'; valid sources: {', '.join(source_names())}")
    module = importlib.import_module(SOURCES[source])
    return module.load(path, **options)


# Sources that cut token sequences into blocks themselves, so they can honour any block size.
RECUT_SOURCES = frozenset({"conversations", "taubench", "gsm8k", "synthetic", "mix", "azure"})


def open_trace(trace: str, source: str | None = None, options: Mapping[str, Any] | None = None,
               block_size: int | None = None) -> tuple[Trace, LoadReport]:
    """A trace by name: ``"synthetic"`` / ``"mix"`` (generated from ``options``), an embedded trace (``taubench``,
    ``wildchat``, ``mooncake_arxiv``, ... see :data:`sae_env.data.ALL`) or a file in ``source``'s format (inferred for
    native ``.npz`` / ``.jsonl`` traces). ``block_size`` re-cuts the sources in :data:`RECUT_SOURCES`; the others keep
    the block size of their data (callers check). ``"-"`` reads standard input.
    """
    from sae_env import data

    options = dict(options or {})

    def load(src: str, path: Any) -> tuple[Trace, LoadReport]:
        if block_size is not None and src in RECUT_SOURCES:
            options.setdefault("block_size", block_size)
        return load_source(src, path, **options)

    if trace == "-":
        return _load_stdin(source, load)
    if trace in ("synthetic", "mix") and not Path(trace).exists():
        return load(trace, None)
    if Path(trace).is_dir():
        raise TraceFormatError("is a folder, not a trace file", path=trace)
    if trace in data.ALL and not Path(trace).exists():
        path, default_source = data.ALL[trace]
        if trace == "taubench":
            options.setdefault("tools", str(data.TAUBENCH_TOOLS))  # the tool schemas that open every prompt
        source = source or default_source
        trace = str(path)
    if source is None:
        if _is_native(trace):
            source = "trace"
        else:
            raise ValueError(f"say which format {trace} is in (source: one of {', '.join(source_names())}); "
                             f"embedded traces: {', '.join(data.ALL)}")
    return load(source, trace)


def _load_stdin(source: str | None, load: Any) -> tuple[Trace, LoadReport]:
    """Standard input, copied to a temporary file that the source reads like any other (not gzipped)."""
    import sys
    import tempfile

    if source is None:
        raise ValueError("reading a trace from standard input ('-') needs its format (source / --source)")
    with tempfile.TemporaryDirectory(prefix="sae-stdin") as folder:
        path = Path(folder) / "stdin"
        path.write_bytes(sys.stdin.buffer.read())
        return load(source, path)


def trace_from_spec(spec: str | Mapping[str, Any], block_size: int | None = None) -> tuple[Trace, LoadReport]:
    """A trace from a config spec: a name for :func:`open_trace`, or a mapping ``{trace: NAME_OR_PATH | path: PATH,
    source: NAME, **options}`` (``trace`` defaults to the source's name, so ``{source: synthetic, preset: shift}``
    generates).
    """
    if isinstance(spec, str):
        return open_trace(spec, block_size=block_size)
    if not isinstance(spec, Mapping):
        raise ValueError(f"a trace spec is a name, a path or a mapping with 'source' / 'trace'; got {spec!r}")
    options = dict(spec)
    name, path, source = options.pop("trace", None), options.pop("path", None), options.pop("source", None)
    if name is not None and path is not None:
        raise ValueError(f"trace spec {dict(spec)!r}: give 'trace' or 'path', not both")
    target = name if name is not None else path if path is not None else source
    if target is None:
        raise ValueError(f"trace spec {dict(spec)!r} needs 'trace' (an embedded name or a file), 'path' or 'source'")
    return open_trace(str(target), source, options, block_size)


def _is_native(path: str) -> bool:
    if path.endswith(".npz"):
        return True
    if not path.endswith((".jsonl", ".jsonl.gz")):
        return False
    from sae_env.inputs import open_text

    try:
        with open_text(path) as f:
            return '"format": "sae-trace"' in f.readline()
    except (OSError, ValueError):  # missing, a folder, not UTF-8, broken gzip: the loader will say so
        return False
