"""Small I/O helpers shared by the sources: transparent gzip, JSON lines with line numbers, option checks."""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from sae_env.trace import TraceFormatError


def open_text(path: str | os.PathLike) -> IO[str]:
    """Open a text file, gunzipping it when its name ends with ``.gz``; a clear error when it is missing."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)`` for each non-blank line; malformed JSON raises TraceFormatError."""
    with open_text(path) as f:
        empty = True
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            empty = False
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"malformed JSON ({e.msg}, column {e.colno})", path=path, line=lineno) from e
        if empty:
            raise TraceFormatError("empty file", path=path)


def check_options(source: str, options: dict[str, Any], allowed: set[str]) -> None:
    """Reject unknown options by name, listing the valid ones."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"source '{source}' got unknown option(s) {unknown}; valid options: {sorted(allowed)}")
