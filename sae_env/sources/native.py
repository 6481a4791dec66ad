"""The project's own trace files (``.npz`` or ``.jsonl`` written by :meth:`Trace.save`)."""

from __future__ import annotations

import os

from sae_env.trace import LoadReport, Trace


def load(path: str | os.PathLike, **options) -> tuple[Trace, LoadReport]:
    if options:
        raise ValueError(f"source 'trace' takes no options, got {sorted(options)}")
    trace = Trace.load(path)
    return trace, LoadReport(source="trace", path=str(path), rows_read=len(trace))
