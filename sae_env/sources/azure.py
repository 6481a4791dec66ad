"""Azure LLM inference trace 2023 (AzurePublicDataset): an arrival-and-length process, no content.

Format: a CSV with the header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (columns in any order) and one request a
row, e.g. ``2023-11-16 18:17:03.9799600,4808,10``: an absolute timestamp (100 ns resolution), the prompt length
and the generated length in tokens. There are no sessions and no hashes of the content, so nothing says which
requests share a prefix: the trace is good for arrival burstiness and length shapes only.

Two ways to use it:

* :func:`load_process` -> :class:`AzureProcess`: numpy arrays ``t`` (seconds since the first row),
  ``context_tokens`` and ``generated_tokens``, with samplers that other sources borrow: :meth:`~AzureProcess.
  start_times` (the first ``n`` arrivals, tiled past the end), :meth:`~AzureProcess.window_times` (the arrivals in
  a time window of the tiled trace: a stretch of the real process), :meth:`~AzureProcess.sample_start_times`
  (inter-arrival gaps resampled with replacement) -- all three optionally rescaled to a target rate -- and
  :meth:`~AzureProcess.sample_lengths` (rows resampled with replacement, keeping each request's pair of lengths).
* :func:`load` -> a :class:`~sae_env.trace.Trace` of single-turn requests (session -1, turn 1, app SINGLE_TURN)
  whose ``ContextTokens // block_size`` full prompt blocks all have unique keys of type UNKNOWN: a no-reuse
  baseline that can be replayed (every lookup misses). Each key is ``chain_keys`` of a distinct content id (offset
  by a fixed 64-bit tag) taken as a one-block prefix, so keys are unique and never coincide with another source's
  keys, even under the same salt. No
  output blocks are inserted (they could never be reused either).

Parsing is vectorised: the timestamp column is converted in one ``np.array(..., dtype="datetime64[ns]")`` call and
the token columns in one ``astype(np.int64)`` each; only when a column fails is it re-examined row by row to name
the bad line. Bad rows (wrong number of fields, a timestamp that does not parse, a non-integer or negative token
count) raise :class:`~sae_env.trace.TraceFormatError` naming file, line and field, or with ``on_error="skip"`` are
dropped and counted. Rows out of time order are sorted (stably) and counted in the report's notes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from sae_env.inputs import check_options, open_text
from sae_env.sources.hashonly import check_on_error, int_option
from sae_env.trace import (
    MAX_TOKENS,
    AppType,
    LoadReport,
    TokenType,
    Trace,
    TraceFormatError,
    chain_keys,
    csr_offsets,
)

__all__ = ["COLUMNS", "DEFAULTS", "AzureProcess", "load", "load_process"]

SOURCE = "azure"
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
DEFAULTS = {"block_size": 16, "salt": 0, "on_error": "raise"}
# The window a TIMESTAMP must lie in: from the Unix epoch to the last instant a nanosecond clock (datetime64[ns])
# holds. Outside it numpy's nanosecond datetimes wrap silently (year 9999 reads as 1816), so the bound is checked on
# a microsecond parse, which holds any year.
EARLIEST = np.datetime64("1970-01-01T00:00:00", "us")
LATEST = np.datetime64("2262-04-11T00:00:00", "us")
_WINDOW = "1970-01-01 and 2262-04-11"
# Offset of this source's content ids: keeps its (unique) keys apart from small-integer ids of other sources.
_CONTENT_TAG = np.uint64(0xA2_0E_C5_17_D3_4B_96_F1)


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _rescale(t: np.ndarray, rate: float | None) -> np.ndarray:
    """Scale arrival times (starting at 0) so that their mean rate, (n - 1) / span, is ``rate`` requests/s."""
    if rate is None:
        return t
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not np.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    if t.size < 2 or t[-1] <= 0:
        return t
    return t * ((t.size - 1) / rate / t[-1])


def _count(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    return int(n)


@dataclass(frozen=True)
class AzureProcess:
    """Arrival times and lengths of an Azure trace, in arrival order."""

    t: np.ndarray  # float64 [n] seconds since the first request (t[0] == 0), non-decreasing
    context_tokens: np.ndarray  # int64 [n] prompt lengths
    generated_tokens: np.ndarray  # int64 [n] output lengths
    start: str  # absolute time of the first request (ISO 8601, as in the file)
    path: str
    report: LoadReport = field(repr=False)

    def __len__(self) -> int:
        return int(self.t.size)

    @property
    def duration(self) -> float:
        return float(self.t[-1]) if self.t.size else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests per second ((n - 1) / duration)."""
        return (self.t.size - 1) / self.duration if self.duration > 0 else float("nan")

    def start_times(self, n: int, rate: float | None = None) -> np.ndarray:
        """The first ``n`` arrival times (from 0), tiled past the end of the trace (each copy starts one mean gap
        after the previous one ends); with ``rate``, scaled so that their mean rate is ``rate`` requests/s."""
        n = _count(n)
        if self.t.size == 0:
            raise ValueError("the process has no arrivals")
        reps = -(-n // self.t.size)
        period = self.duration + (self.duration / (self.t.size - 1) if self.t.size > 1 else 1.0)
        t = (self.t[None, :] + period * np.arange(reps)[:, None]).ravel()[:n]
        return _rescale(t, rate)

    def window_times(self, start: float, duration: float, rate: float | None = None) -> np.ndarray:
        """The arrivals that fall in ``[start, start + duration)`` of the trace scaled so that its mean rate is
        ``rate`` requests/s and then tiled without end (each copy starts one mean gap after the previous one ends;
        :meth:`period` is one copy), as times from ``start``: a stretch of the real process, its burstiness and
        order kept."""
        for name, v in (("start", start), ("duration", duration)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0 s, got {v!r}")
        if self.t.size < 2:
            raise ValueError("the process needs at least two arrivals to be tiled")
        t = _rescale(self.t, rate)
        period = self._period(t)
        first, last = int(start // period), int((start + duration) // period)
        copies = t[None, :] + period * np.arange(first, last + 1)[:, None]
        flat = copies.ravel()
        lo, hi = np.searchsorted(flat, [start, start + duration], side="left")
        return flat[lo:hi] - start

    def period(self, rate: float | None = None) -> float:
        """Seconds between the starts of two copies when the trace is tiled (scaled to ``rate`` requests/s)."""
        return self._period(_rescale(self.t, rate))

    @staticmethod
    def _period(t: np.ndarray) -> float:
        return float(t[-1] + (t[-1] / (t.size - 1) if t.size > 1 and t[-1] > 0 else 1.0))

    def sample_start_times(self, n: int, rng: np.random.Generator | int | None = None,
                           rate: float | None = None) -> np.ndarray:
        """``n`` arrival times (from 0) whose gaps are the trace's inter-arrival gaps resampled with replacement:
        the same gap distribution (burstiness) without the trace's order; ``rate`` rescales as in
        :meth:`start_times`."""
        n = _count(n)
        gaps = np.diff(self.t)
        if gaps.size == 0:
            raise ValueError("the process needs at least two arrivals to resample gaps")
        t = np.zeros(n, dtype=np.float64)
        if n > 1:
            np.cumsum(_rng(rng).choice(gaps, size=n - 1, replace=True), out=t[1:])
        return _rescale(t, rate)

    def sample_lengths(self, n: int, rng: np.random.Generator | int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(context_tokens, generated_tokens)`` of ``n`` requests drawn with replacement (pairs kept together)."""
        n = _count(n)
        if self.t.size == 0:
            raise ValueError("the process has no requests")
        idx = _rng(rng).integers(0, self.t.size, size=n)
        return self.context_tokens[idx], self.generated_tokens[idx]


def _short(v: str) -> str:
    return repr(v) if len(v) <= 40 else f"{v[:20]!r}...({len(v)} characters)"


def _bad_rows_int(values: list[str]) -> dict[int, str]:
    """Slow path: row index -> why the token count is invalid."""
    bad = {}
    for i, v in enumerate(values):
        try:
            x = int(v)
        except ValueError:
            bad[i] = f"must be an integer, got {_short(v)}"
            continue
        if x < 0:
            bad[i] = f"must be >= 0, got {x}"
        elif x > MAX_TOKENS:
            bad[i] = f"must be at most {MAX_TOKENS:,} tokens, got {_short(v)}"
    return bad


def _bad_rows_time(values: list[str]) -> dict[int, str]:
    bad = {}
    for i, v in enumerate(values):
        try:
            with _quiet_timezones():
                x = np.datetime64(v, "us")
        except ValueError:
            bad[i] = f"not a timestamp like '2023-11-16 18:17:03.9799600': {_short(v)}"
            continue
        if np.isnat(x):
            bad[i] = f"not a timestamp: {_short(v)}"
        elif not EARLIEST <= x <= LATEST:
            bad[i] = f"must lie between {_WINDOW}, got {_short(v)}"
    return bad


def _parse_times(values: list[str]) -> np.ndarray:
    """datetime64[ns] of the strings; ValueError when one does not parse or lies outside [EARLIEST, LATEST]."""
    with _quiet_timezones():
        us = np.array(values, dtype="datetime64[us]")
        if np.isnat(us).any() or (us < EARLIEST).any() or (us > LATEST).any():
            raise ValueError("NaT or out of range")
        return np.array(values, dtype="datetime64[ns]")  # parsed again: ns keeps the file's 100 ns digits exactly


@contextmanager
def _quiet_timezones() -> Iterator[None]:
    """numpy turns a timestamp with an offset (``+05:00``, ``Z``) into UTC, as it should, and warns each time that
    datetime64 has no time zone: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no explicit representation of timezones")
        yield


def load_process(path: str | os.PathLike, *, on_error: str = "raise") -> AzureProcess:
    """Read an Azure CSV into an :class:`AzureProcess` (``.gz`` transparently); see the module docstring."""
    check_on_error(on_error)
    report = LoadReport(source=SOURCE, path=str(path))
    with open_text(path) as f:
        lines = f.read().splitlines()
    numbered = [(i, s) for i, s in enumerate(lines, start=1) if s.strip()]
    if not numbered:
        raise TraceFormatError("empty file", path=path)
    head_line, header = numbered[0]
    names = [c.strip().lstrip("\ufeff") for c in header.split(",")]
    if sorted(names) != sorted(COLUMNS):
        raise TraceFormatError(f"expected the header {','.join(COLUMNS)}, got {header!r}", path=path,
                               line=head_line)
    col = [names.index(c) for c in COLUMNS]
    body = numbered[1:]
    report.rows_read = len(body)
    if not body:
        raise TraceFormatError("no rows after the header", path=path)

    line_no = np.fromiter((i for i, _ in body), dtype=np.int64, count=len(body))
    parts = [s.split(",") for _, s in body]
    errors: dict[int, tuple[str | None, str, str]] = {}  # row -> (field, message, reason)
    shape_ok = np.fromiter((len(p) == len(COLUMNS) for p in parts), dtype=bool, count=len(parts))
    for i in np.flatnonzero(~shape_ok).tolist():
        errors[i] = (None, f"expected {len(COLUMNS)} comma-separated fields, got {len(parts[i])}",
                     "wrong number of fields")
    ok_rows = np.flatnonzero(shape_ok).tolist()
    columns = {name: [parts[i][c].strip() for i in ok_rows] for name, c in zip(COLUMNS, col, strict=True)}

    try:
        ts = _parse_times(columns["TIMESTAMP"])
    except ValueError:
        ts = None
        for k, why in _bad_rows_time(columns["TIMESTAMP"]).items():
            errors.setdefault(ok_rows[k], ("TIMESTAMP", why, "TIMESTAMP: bad value"))
    counts = {}
    for name in COLUMNS[1:]:
        try:
            v = np.array(columns[name]).astype(np.int64) if columns[name] else np.zeros(0, dtype=np.int64)
            if (v < 0).any() or (v > MAX_TOKENS).any():
                raise ValueError("out of range")
            counts[name] = v
        except (ValueError, OverflowError):
            counts[name] = None
            for k, why in _bad_rows_int(columns[name]).items():
                errors.setdefault(ok_rows[k], (name, why, f"{name}: bad value"))

    if errors:
        if on_error == "raise":
            i = min(errors)
            fld, msg, _ = errors[i]
            raise TraceFormatError(msg, path=path, line=int(line_no[i]), field=fld)
        for _, _, reason in errors.values():
            report.reject(reason)
        ok_rows = [i for i in ok_rows if i not in errors]
        if not ok_rows:
            raise TraceFormatError(f"no valid rows ({report.rows_rejected} rejected: {dict(report.rejected)})",
                                   path=path)
        # Re-convert the surviving rows (they all parse now).
        ts = _parse_times([parts[i][col[0]].strip() for i in ok_rows])
        counts = {name: np.array([parts[i][c].strip() for i in ok_rows]).astype(np.int64)
                  for name, c in zip(COLUMNS[1:], col[1:], strict=True)}

    ctx, gen = counts["ContextTokens"], counts["GeneratedTokens"]
    order = np.argsort(ts, kind="stable")
    moved = int((order != np.arange(order.size)).sum())
    if moved:
        report.notes.append(f"rows not in time order: sorted stably by TIMESTAMP ({moved} rows moved)")
        ts, ctx, gen = ts[order], ctx[order], gen[order]
    t = (ts - ts[0]).astype(np.int64) / 1e9
    report.notes.append("no sessions and no content hashes in this format: arrival times and lengths only")
    return AzureProcess(t=t, context_tokens=ctx, generated_tokens=gen, start=str(ts[0]), path=str(path),
                        report=report)


def load(path: str | os.PathLike, **options) -> tuple[Trace, LoadReport]:
    """A replayable no-reuse Trace of the Azure requests (unique keys, see the module docstring)."""
    check_options(SOURCE, options, set(DEFAULTS))
    opt = {**DEFAULTS, **options}
    bs = int_option(SOURCE, "block_size", opt["block_size"], 1)
    salt = int_option(SOURCE, "salt", opt["salt"], 0)
    proc = load_process(path, on_error=opt["on_error"])
    report = proc.report
    n = len(proc)
    n_blocks = proc.context_tokens // bs
    offsets = csr_offsets(n_blocks)
    n_keys = int(offsets[-1])
    with np.errstate(over="ignore"):
        content = np.arange(n_keys, dtype=np.uint64) + _CONTENT_TAG
    # Every block hashed as a one-block prefix: one vectorised pass instead of one per block position, and as the
    # contents are distinct, so are the keys (nothing here is shared, so nothing needs the chain).
    keys = chain_keys(content, np.arange(n_keys + 1, dtype=np.int64), salt=salt)
    report.notes += [
        f"no content hashes: every full {bs}-token prompt block gets a unique key (a no-reuse baseline); block "
        f"types UNKNOWN; no output blocks",
        "requests are single-turn (session -1, turn 1, app SINGLE_TURN): the trace has no sessions",
    ]
    meta = {"source": SOURCE, "path": str(path), "format": "azure-llm-2023-csv", "time_unit": "s",
            "start": proc.start, "block_size": bs, "keys": "unique (no content in the trace)", "salt": salt,
            "sessions": "none", "types": "unknown", "rows_rejected": report.rows_rejected}
    trace = Trace(t=proc.t, session=np.full(n, -1, dtype=np.int64), turn=np.ones(n, dtype=np.int32),
                  app=np.full(n, int(AppType.SINGLE_TURN), dtype=np.int8), prompt_tokens=proc.context_tokens,
                  output_tokens=proc.generated_tokens, prompt_offsets=offsets, prompt_keys=keys,
                  prompt_types=np.full(keys.size, int(TokenType.UNKNOWN), dtype=np.int8), block_size=bs,
                  meta=meta)
    return trace, report
