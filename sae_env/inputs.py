"""Reading input files, and the error that names what is wrong in one.

Every reader (the sources, the native trace format, calibration tables) opens its input through :func:`open_text` or
:func:`open_binary`, so all of them agree on what a file may look like: a name ending in ``.gz`` is gunzipped
(``.jsonl.gz``, ``.csv.gz``, ``.json.gz``), a UTF-8 byte-order mark at the start is skipped, and a folder, a missing
file, text that is not UTF-8 or a corrupt or truncated gzip stream is a :class:`TraceFormatError` (or
FileNotFoundError) that names the file, never a bare ``UnicodeDecodeError`` or ``EOFError`` from deep inside a reader.
A malformed value is a :class:`TraceFormatError` too, naming the file, line and field.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["TraceFormatError", "UnknownOptionError", "brief", "check_input_file", "check_options", "iter_json_lines",
           "lone_surrogate", "open_binary", "open_text", "unreadable"]

BOM = "\ufeff"
_DECODE_ERRORS = (UnicodeDecodeError, gzip.BadGzipFile, EOFError, zlib.error)


class TraceFormatError(ValueError):
    """A trace file or a trace's arrays are malformed; the message names the file, line and field."""

    def __init__(self, reason: str, *, path: str | os.PathLike | None = None, line: int | None = None,
                 field: str | None = None):
        self.reason, self.path, self.line, self.field = reason, path, line, field
        where = [str(path)] if path is not None else []
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)

    def located(self, path: str | os.PathLike | None = None, line: int | None = None) -> TraceFormatError:
        """The same error with the file and line filled in (keeps what is already known)."""
        return TraceFormatError(self.reason, path=self.path if self.path is not None else path,
                                line=self.line if self.line is not None else line, field=self.field)


def check_input_file(path: str | os.PathLike) -> Path:
    """``path`` as an existing regular file: FileNotFoundError when missing, TraceFormatError for a folder."""
    if path is None:
        raise ValueError("no file given (this source reads a file: give its path)")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise TraceFormatError("is a folder, not a trace file", path=path)
    return path


def _is_gzip(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


@contextmanager
def unreadable(path: str | os.PathLike, last_line: Callable[[], int | None]) -> Iterator[None]:
    """Turn a failure to decode the file as a whole (text that is not UTF-8, a corrupt or truncated gzip stream)
    into a TraceFormatError. Decoding runs ahead in chunks, so the place is given as "after" the last line read."""
    try:
        yield
    except _DECODE_ERRORS as e:
        raise _decode_error(path, e, last_line()) from e


def _decode_error(path: str | os.PathLike, e: BaseException, last: int | None) -> TraceFormatError:
    what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "unreadable gzip stream"
    where = f" after line {last}" if last else ""
    return TraceFormatError(f"{what}{where} ({e})", path=path)


class _Text:
    """A text file whose decoding errors name the file (see the module docstring); counts the lines read."""

    def __init__(self, raw: IO[str], path: Path):
        self._f, self.path, self.lines = raw, path, 0

    def __enter__(self) -> _Text:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def close(self) -> None:
        self._f.close()

    def read(self, size: int = -1) -> str:
        try:
            return self._f.read(size)
        except _DECODE_ERRORS as e:
            raise _decode_error(self.path, e, self.lines) from e

    def readline(self) -> str:
        try:
            line = self._f.readline()
        except _DECODE_ERRORS as e:
            raise _decode_error(self.path, e, self.lines) from e
        self.lines += bool(line)
        return line

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = self.readline()
        if not line:
            raise StopIteration
        return line


def open_text(path: str | os.PathLike) -> _Text:
    """Open a text file for reading (module docstring: gzip by name, BOM skipped, errors that name the file)."""
    path = check_input_file(path)
    raw = gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")
    return _Text(io.TextIOWrapper(raw, encoding="utf-8-sig"), path)


def open_binary(path: str | os.PathLike) -> IO[bytes]:
    """Open a file for reading bytes, gunzipping it when its name ends with ``.gz``; a clear error when missing or a
    folder. (``json.loads`` of bytes skips a leading byte-order mark itself.)"""
    path = check_input_file(path)
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


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


def lone_surrogate(obj: Any, where: str = "") -> str | None:
    """Where a parsed JSON value holds a string with half a UTF-16 surrogate pair (``"\\udcff"`` escaped alone:
    valid JSON, but not text, and the tokenizer cannot encode it), as a field path (``messages[2].content``); None
    when it holds none. Callers look only when the line holds a ``\\u`` escape."""
    if isinstance(obj, str):
        if not obj.isascii():
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError:
                return where or "(the value)"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        found = lone_surrogate(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None


class UnknownOptionError(ValueError):
    """A source was given an option it does not take (a ``ValueError``; callers that try an option on several
    sources, such as ``benchmarks/gap_table.py --opt``, tell it from a bad value by this type)."""


def check_options(source: str, options: dict[str, Any], allowed: set[str]) -> None:
    """Reject unknown options by name, listing the valid ones."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise UnknownOptionError(f"source '{source}' got unknown option(s) {unknown}; "
                                 f"valid options: {sorted(allowed)}")


def brief(v: Any) -> str:
    """``repr`` of a value, cut short: a 400-digit number must not fill the error line."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
