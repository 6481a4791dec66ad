"""Trace sources: one module per input format, each with ``load(path, **options) -> (Trace, LoadReport)``.

The registry maps a source name to its module; modules are imported lazily so that loading one format never
pulls in another's dependencies. Every loader validates its input and either rejects a bad row with a counted
reason (``on_error="skip"``) or raises :class:`~sae_env.trace.TraceFormatError` naming file, line and field
(``on_error="raise"``, the default).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from sae_env.trace import LoadReport, Trace

SOURCES: dict[str, str] = {
    "mooncake": "sae_env.sources.mooncake",
    "bailian": "sae_env.sources.bailian",
    "conversations": "sae_env.sources.conversations",
    "taubench": "sae_env.sources.taubench",
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
