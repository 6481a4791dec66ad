"""A calibration table: prefill times measured on real hardware, interpolated, and the files they come in.

**Calibration table** (:class:`CalibrationTable`): measured prefill times at ``new_tokens`` points (1-D, linear
interpolation) or on a full ``new_tokens x cached_tokens`` grid (bilinear). Validation: every time positive and
finite, non-decreasing in new tokens (for each cached value), no duplicate point, a full grid; a ValueError names
the offending row. Outside the table: below the smallest ``new_tokens`` the first time (a short prefill costs the
weight read, not less), above the largest the last segment's slope continues; the cached axis is clamped to its
range (extrapolating it could break monotonicity in new tokens). ``new_tokens == 0`` costs 0. A batch of chunks
costs the table's time at ``(sum k, sum(k * ctx) / sum k)``: a batched prefill of ``K`` tokens is one ``K``-token
forward pass (weights once), and its attention work grows with the token-weighted mean context. Files: CSV with a
header (``new_tokens``, optional ``cached_tokens``, ``time_s`` or ``time_ms``; ``#`` comment lines), JSON or YAML
(a list of such rows, or ``{"points": [...], "decode_step_s": x}``); ``.gz`` is opened transparently. Decode
times come from ``decode_step_s`` (seconds per decode step) or from a roofline handed over as ``decode_model``.
"""

from __future__ import annotations

import bisect
import csv
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.files import parse_document
from sae_env.inputs import open_text
from sae_env.serving.cost import CostModel, check_tokens, tokens_array

__all__ = ["CalibrationTable"]


class CalibrationTable:
    """Measured prefill times, interpolated (see the module docstring for the rules and file formats).

    ``new_tokens``, ``times_s`` and optional ``cached_tokens`` are parallel sequences of points. ``rows`` names
    each point in error messages (defaults to ``"point i"``); ``source`` prefixes them (e.g. the file name).
    """

    def __init__(self, new_tokens: Sequence[float], times_s: Sequence[float],
                 cached_tokens: Sequence[float] | None = None, *, decode_step_s: float | None = None,
                 decode_model: CostModel | None = None, rows: Sequence[str] | None = None,
                 source: str = "calibration table"):
        n_pts = len(new_tokens)
        if len(times_s) != n_pts or (cached_tokens is not None and len(cached_tokens) != n_pts):
            raise ValueError(f"{source}: new_tokens, times and cached_tokens must have the same length")
        rows = list(rows) if rows is not None else [f"point {i}" for i in range(n_pts)]
        self.source = source
        self.two_d = cached_tokens is not None
        pts: dict[tuple[float, float], tuple[float, str]] = {}
        for i in range(n_pts):
            where = f"{source}: {rows[i]}"
            n = _finite(new_tokens[i], where, "new_tokens")
            c = _finite(cached_tokens[i], where, "cached_tokens") if self.two_d else 0.0
            t = _finite(times_s[i], where, "time")
            if n <= 0 or c < 0:
                raise ValueError(f"{where}: new_tokens must be > 0 and cached_tokens >= 0, got {n}, {c}")
            if t <= 0:
                raise ValueError(f"{where}: time must be positive, got {t}")
            if (n, c) in pts:
                raise ValueError(f"{where}: duplicate point new_tokens={n:g}, cached_tokens={c:g} "
                                 f"(also {pts[(n, c)][1]})")
            pts[(n, c)] = (t, rows[i])
        self._xs = sorted({n for n, _ in pts})
        self._cs = sorted({c for _, c in pts})
        if len(self._xs) < 2:
            raise ValueError(f"{source}: need at least two distinct new_tokens values, got {len(self._xs)}")
        self._rows: list[list[float]] = []  # one list of times per cached value, over self._xs
        for c in self._cs:
            row = []
            for n in self._xs:
                if (n, c) not in pts:
                    raise ValueError(f"{source}: the points must form a full grid; missing new_tokens={n:g} at "
                                     f"cached_tokens={c:g}")
                t, name = pts[(n, c)]
                if row and t < row[-1]:
                    raise ValueError(f"{source}: {name}: time {t:g} s at new_tokens={n:g}"
                                     f"{f', cached_tokens={c:g}' if self.two_d else ''} is below {row[-1]:g} s at "
                                     f"a smaller new_tokens: times must be non-decreasing in new tokens")
                row.append(t)
            self._rows.append(row)
        # slope of the last segment of each row, continued above the largest new_tokens
        self._tail = [(r[-1] - r[-2]) / (self._xs[-1] - self._xs[-2]) for r in self._rows]
        if decode_step_s is not None:
            decode_step_s = _finite(decode_step_s, source, "decode_step_s")
            if decode_step_s <= 0:
                raise ValueError(f"{source}: decode_step_s must be positive, got {decode_step_s}")
        self.decode_step_s = decode_step_s
        self.decode_model = decode_model
        # Measured times say nothing of the model's KV size (so a capacity in bytes needs a roofline preset).
        self.kv_bytes_per_token: int | None = None

    def __repr__(self) -> str:
        return (f"CalibrationTable({self.source!r}, {len(self._xs)} new_tokens x {len(self._cs)} cached_tokens "
                f"points)")

    # -- interpolation ----------------------------------------------------------------------------------------

    def grid(self) -> tuple[list[float], list[float], list[list[float]], list[float]]:
        """The table as :meth:`prefill_time` reads it: new-token points, cached-token points, one row of times per
        cached-token point, and each row's slope past its last point (the compiled server interpolates the same)."""
        return list(self._xs), list(self._cs), [list(r) for r in self._rows], list(self._tail)

    def _row_at(self, j: int, n: float) -> float:
        xs, row = self._xs, self._rows[j]
        if n <= xs[0]:
            return row[0]
        if n >= xs[-1]:
            return row[-1] + self._tail[j] * (n - xs[-1])
        i = bisect.bisect_right(xs, n)  # xs[i-1] <= n < xs[i]
        x0 = xs[i - 1]
        return row[i - 1] + (row[i] - row[i - 1]) * (n - x0) / (xs[i] - x0)

    def prefill_time(self, new_tokens: float, cached_tokens: float = 0) -> float:
        if new_tokens <= 0 or cached_tokens < 0:
            check_tokens(new_tokens, cached_tokens)
            return 0.0
        cs = self._cs
        if len(cs) == 1 or cached_tokens <= cs[0]:
            return self._row_at(0, new_tokens)
        if cached_tokens >= cs[-1]:
            return self._row_at(len(cs) - 1, new_tokens)
        j = bisect.bisect_right(cs, cached_tokens)
        w = (cached_tokens - cs[j - 1]) / (cs[j] - cs[j - 1])
        return (1.0 - w) * self._row_at(j - 1, new_tokens) + w * self._row_at(j, new_tokens)

    def prefill_times(self, new_tokens: Any, cached_tokens: Any = 0) -> np.ndarray:
        n, c = np.broadcast_arrays(tokens_array(new_tokens, "new_tokens"),
                                   tokens_array(cached_tokens, "cached_tokens"))
        xs = np.asarray(self._xs)
        rows = []
        for j, r in enumerate(self._rows):
            v = np.interp(n, xs, r)  # clamps at both ends
            rows.append(np.where(n > xs[-1], r[-1] + self._tail[j] * (n - xs[-1]), v))
        if len(self._cs) == 1:
            out = rows[0]
        else:
            cs = np.asarray(self._cs)
            cc = np.clip(c, cs[0], cs[-1])
            j = np.clip(np.searchsorted(cs, cc, side="right"), 1, len(cs) - 1)
            w = (cc - cs[j - 1]) / (cs[j] - cs[j - 1])
            stack = np.stack(rows)
            idx = np.arange(n.size).reshape(n.shape)
            out = (1.0 - w) * stack[j - 1, idx] + w * stack[j, idx]
        return np.where(n > 0, out, 0.0)

    def batch_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        n_sum = 0
        nc = 0
        for k, ctx in chunks:
            n_sum += k
            nc += k * ctx
        if n_sum <= 0:
            return 0.0
        return self.prefill_time(n_sum, nc / n_sum)

    def decode_time(self, output_tokens: int, context_tokens: int, batch: int = 1) -> float:
        if self.decode_step_s is not None:
            if output_tokens < 0 or context_tokens < 0 or batch < 1:
                raise ValueError("decode_time needs output_tokens >= 0, context_tokens >= 0, batch >= 1")
            return max(output_tokens - 1, 0) * self.decode_step_s
        if self.decode_model is not None:
            return self.decode_model.decode_time(output_tokens, context_tokens, batch)
        raise ValueError(f"{self.source}: no decode timing: give 'decode_step_s' in the table or a preset "
                         f"(make_server({{'calibration': ..., 'preset': ...}})) for decode times")

    # -- loading ----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, decode_model: CostModel | None = None) -> CalibrationTable:
        """Read a table from ``.csv``, ``.json`` or ``.yaml`` / ``.yml`` (each optionally ``.gz``)."""
        path = Path(path)
        suffixes = [s.lower() for s in path.suffixes]
        if suffixes and suffixes[-1] == ".gz":
            suffixes = suffixes[:-1]
        kind = suffixes[-1] if suffixes else ""
        if kind not in (".csv", ".json", ".yaml", ".yml"):
            raise ValueError(f"{path}: unknown calibration format '{kind}'; use .csv, .json, .yaml or .yml")
        with open_text(path) as f:
            if kind == ".csv":
                return cls._from_csv(f, str(path), decode_model)
            doc = parse_document(f.read(), kind, str(path))
        return cls._from_doc(doc, str(path), decode_model)

    _COLUMNS = ("new_tokens", "cached_tokens", "time_s", "time_ms")

    @classmethod
    def _from_rows(cls, rows: list[tuple[str, dict[str, Any]]], source: str, decode_step_s: Any,
                   decode_model: CostModel | None) -> CalibrationTable:
        if not rows:
            raise ValueError(f"{source}: no calibration points")
        keys0 = set(rows[0][1])
        two_d = "cached_tokens" in keys0
        news, cached, times, names = [], [], [], []
        for name, row in rows:
            unknown = sorted(set(row) - set(cls._COLUMNS))
            if unknown:
                raise ValueError(f"{source}: {name}: unknown field(s) {unknown}; valid: {list(cls._COLUMNS)}")
            if ("cached_tokens" in row) != two_d:
                raise ValueError(f"{source}: {name}: 'cached_tokens' must be given on every row or on none")
            if "new_tokens" not in row:
                raise ValueError(f"{source}: {name}: field 'new_tokens' missing")
            if ("time_s" in row) == ("time_ms" in row):
                raise ValueError(f"{source}: {name}: give exactly one of 'time_s' and 'time_ms'")
            t = _number(row.get("time_s", row.get("time_ms")), f"{source}: {name}",
                        "time_s" if "time_s" in row else "time_ms")
            times.append(t if "time_s" in row else t / 1e3)
            news.append(_number(row["new_tokens"], f"{source}: {name}", "new_tokens"))
            if two_d:
                cached.append(_number(row["cached_tokens"], f"{source}: {name}", "cached_tokens"))
            names.append(name)
        return cls(news, times, cached if two_d else None, decode_step_s=decode_step_s, decode_model=decode_model,
                   rows=names, source=source)

    @classmethod
    def _from_csv(cls, f: Iterable[str], source: str, decode_model: CostModel | None) -> CalibrationTable:
        lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip() and not line.lstrip().startswith("#")]
        if not lines:
            raise ValueError(f"{source}: empty calibration file")
        reader = csv.reader([line for _, line in lines])
        header = [h.strip() for h in next(reader)]
        rows = []
        for (lineno, _), values in zip(lines[1:], reader, strict=True):
            if len(values) != len(header):
                raise ValueError(f"{source}: line {lineno}: {len(values)} values for {len(header)} columns")
            rows.append((f"line {lineno}", {h: v.strip() for h, v in zip(header, values, strict=True)}))
        return cls._from_rows(rows, source, None, decode_model)

    @classmethod
    def _from_doc(cls, doc: Any, source: str, decode_model: CostModel | None) -> CalibrationTable:
        decode_step_s = None
        if isinstance(doc, dict):
            unknown = sorted(set(doc) - {"points", "decode_step_s", "name", "notes"})
            if unknown:
                raise ValueError(f"{source}: unknown key(s) {unknown}; valid: ['decode_step_s', 'name', 'notes', "
                                 f"'points']")
            if "points" not in doc:
                raise ValueError(f"{source}: key 'points' missing")
            decode_step_s = doc.get("decode_step_s")
            doc = doc["points"]
        if not isinstance(doc, list):
            raise ValueError(f"{source}: expected a list of points or a mapping with 'points'")
        rows = []
        for i, row in enumerate(doc):
            if not isinstance(row, dict):
                raise ValueError(f"{source}: point {i}: expected a mapping, got {type(row).__name__}")
            rows.append((f"point {i}", row))
        return cls._from_rows(rows, source, decode_step_s, decode_model)


def _number(v: Any, where: str, field: str) -> float:
    if isinstance(v, bool):
        raise ValueError(f"{where}: field '{field}': expected a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field '{field}': expected a number, got {v!r}") from None


def _finite(v: Any, where: str, field: str) -> float:
    x = _number(v, where, field)
    if not math.isfinite(x):
        raise ValueError(f"{where}: field '{field}' must be finite, got {x}")
    return x
