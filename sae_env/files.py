"""Small file helpers shared by the command line, the experiment runner and the agents: atomic JSON writes and
YAML / JSON mappings read with errors that name the file.

Writes are atomic (a temporary file in the same folder, then a rename): a reader, or a rerun that resumes, sees the
whole file or none. Reads use ``yaml.safe_load`` (JSON is YAML), never pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["json_default", "parse_document", "read_mapping", "write_json"]


def json_default(o: Any) -> Any:
    """``json.dumps(default=...)`` for numpy scalars and arrays."""
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2, allow_nan: bool = True) -> str:
    """Write ``obj`` as JSON atomically (parents created); returns the text written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share a temp file
    text = json.dumps(obj, indent=indent, default=json_default, allow_nan=allow_nan) + "\n"
    tmp.write_text(text)
    os.replace(tmp, path)
    return text


def parse_document(text: str, kind: str, where: str) -> Any:
    """Parse a JSON (``kind == ".json"``) or YAML document; ValueError naming ``where`` (and the line, for JSON)."""
    if kind == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: line {e.lineno}: malformed JSON ({e.msg})") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: malformed YAML ({e})") from None


def read_mapping(source: str | os.PathLike, what: str, inline: bool = False) -> tuple[dict[str, Any], str]:
    """The mapping in a YAML / JSON file, or (``inline``) in the text itself when it names no file.

    Returns the mapping (an empty file is ``{}``) and where it came from (the path, or ``what``, for messages).
    FileNotFoundError for a missing file, ValueError for malformed YAML or a top level that is not a mapping.
    """
    path = Path(source)
    is_file = not inline or path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists()
    if is_file:
        if not path.exists():
            raise FileNotFoundError(f"{what}: no such file {path}")
        data, where = parse_document(path.read_text(), path.suffix.lower(), str(path)), str(path)
    else:
        data, where = parse_document(str(source), ".yaml", what), what
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    return dict(data), where
