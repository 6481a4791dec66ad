"""Small file helpers shared by the command line, the experiment runner and the agents: atomic JSON writes,
YAML / JSON mappings read with errors that name the file, and what every config file gets: ``--set`` overrides with
dotted keys (:func:`apply_overrides`) and relative paths taken against the config's folder (:func:`resolve_paths`).

Writes are atomic (a temporary file in the same folder, then a rename): a reader, or a rerun that resumes, sees the
whole file or none. Reads use ``yaml.safe_load`` (JSON is YAML), never pickle.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["PATH_KEYS", "apply_overrides", "atomic_path", "check_output_file", "json_default", "parse_document",
           "read_mapping", "relative_to", "resolve_paths", "set_aside", "write_json", "write_text"]


def check_output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """``path`` as a file to write: ValueError when it is a folder (or its parent is a file), before any work."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file name")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what} {path}: {parent} is a file, not a folder")
            break
    return path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to ``path``, renamed onto ``path`` when the body succeeds and removed when it fails
    (parents are created). The temporary name ends in ``.tmp``, so globs for the real suffix never see a half-written
    file; writers that infer a format from the suffix must be told it (``savefig(..., format="png")``)."""
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share a temp file
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def set_aside(run_dir: str | os.PathLike, path: str | os.PathLike, under: str | os.PathLike | None = None) -> Path:
    """Move ``path`` (a damaged or superseded file or folder) to ``<run_dir>/aside/``, at its place relative to
    ``under`` (default ``run_dir``), never overwriting (a numbered name when taken); returns where it went."""
    run_dir, path = Path(run_dir), Path(path)
    try:
        rel = path.resolve().relative_to(Path(under or run_dir).resolve())
    except ValueError:
        rel = Path(path.name)
    dest = run_dir / "aside" / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{rel.name}.{n}")
        n += 1
    shutil.move(str(path), dest)
    return dest


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` atomically (parents created)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


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
    text = json.dumps(obj, indent=indent, default=json_default, allow_nan=allow_nan) + "\n"
    write_text(path, text)
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
        if path.is_dir():
            raise ValueError(f"{what}: {path} is a folder, not a file")
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        data, where = parse_document(text, path.suffix.lower(), str(path)), str(path)
    else:
        data, where = parse_document(str(source), ".yaml", what), what
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    return dict(data), where


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any], where: str = "--set") -> dict[str, Any]:
    """``data`` with each override applied: a key is a dotted path (``serving.model``, ``ppo.total_steps``,
    ``agents.1.name``) whose missing mappings are created; a list is indexed by position. ValueError naming the key
    when a step of the path is neither (``serving`` given as a string, an index out of range). Returns a copy."""
    import copy

    out = copy.deepcopy(dict(data))
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if not all(parts):
            raise ValueError(f"{where} {dotted}: empty part in the key (write it as a.b.c)")
        node: Any = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            here = ".".join(parts[:i]) or "the config"
            if isinstance(node, list):
                if not (part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node)):
                    raise ValueError(f"{where} {dotted}: {here} is a list of {len(node)}; {part!r} is not an index "
                                     "of it")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
            else:
                raise ValueError(f"{where} {dotted}: {here} is {node!r}, not a mapping; set {here} itself "
                                 f"(e.g. {where} {here}={{...}})")
    return out


# Keys of a config whose relative paths name files (trace specs, agent and policy options).
PATH_KEYS = frozenset({"trace", "path", "tools", "params", "checkpoint", "predictor"})


def relative_to(base: str | os.PathLike | None, value: Any) -> Any:
    """A relative path of a config file, taken against the file's folder ``base`` when it names something there;
    anything else unchanged (absolute paths, embedded trace names, presets, and paths that exist only relative to
    the working folder, as they were read before configs had a folder of their own)."""
    if base is None or not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    candidate = Path(base) / value
    return str(candidate) if candidate.exists() else value


def resolve_paths(data: Any, base: str | os.PathLike | None) -> Any:
    """``data`` (a config's mapping, or part of it) with the values of :data:`PATH_KEYS` at any depth taken through
    :func:`relative_to`; a copy."""
    if isinstance(data, Mapping):
        return {k: relative_to(base, v) if k in PATH_KEYS and isinstance(v, str) else resolve_paths(v, base)
                for k, v in data.items()}
    if isinstance(data, list):
        return [resolve_paths(v, base) for v in data]
    return data
