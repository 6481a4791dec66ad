"""The house rules of the code base (issue 14), checked on the source itself: no import circle between the modules
of ``sae_env`` and ``agents`` (every import counts: module level, inside a function, under ``TYPE_CHECKING``), no
private name imported across modules, ``sae_env`` never imports ``agents``, and every module of the two packages is
at most ~450 lines or its docstring says why it must be one piece.

Each check is also run on a small planted counter-example, so that a check that can no longer see anything fails
here instead of passing forever."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sae_env", "agents")
MAX_LINES = 500  # "~450": a module past this says "Why one piece" in its docstring
# Modules another issue is rewriting right now; each names that issue. Remove an entry when it lands.
PENDING: dict[str, str] = {}


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the two packages (a package is its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """Every absolute import in a module: (module imported from, names imported, line)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names], node.lineno))
    return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    def resolve(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, text in sources.items():
        for target, names, _ in imports(ast.parse(text)):
            for full in [f"{target}.{n}" for n in names] or [target]:
                found = resolve(full)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def private_imports(text: str) -> list[str]:
    """``from sae_env... import _name`` / ``from agents... import _name`` and imports of ``_module`` files."""
    out = []
    for target, names, line in imports(ast.parse(text)):
        if target.split(".")[0] not in PACKAGES:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        private += [part for part in target.split(".") if part.startswith("_") and not part.startswith("__")]
        if private:
            out.append(f"line {line}: from {target} import {private}")
    return out


def test_no_import_circle():
    sources = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    assert cycles(import_graph(sources)) == []
    planted = {"sae_env.a": "from sae_env.b import x\n", "sae_env.b": "def f():\n    from sae_env import a\n"}
    assert cycles(import_graph(planted)) == [["sae_env.a", "sae_env.b"]]


@pytest.mark.parametrize("folder", ["sae_env", "agents", "tests", "benchmarks"])
def test_no_private_name_imported_across_modules(folder):
    bad = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / folder).rglob("*.py"))
           if (found := private_imports(p.read_text(encoding="utf-8")))}
    assert bad == {}
    assert private_imports("from sae_env.cache import _x, y\nfrom sae_env.sources._io import open_text\n") == [
        "line 1: from sae_env.cache import ['_x']", "line 2: from sae_env.sources._io import ['_io']"]


def test_sae_env_never_imports_agents():
    graph = import_graph({m: p.read_text(encoding="utf-8") for m, p in modules().items()})
    assert {m: sorted(t) for m, ts in graph.items() if m.startswith("sae_env")
            if (t := {x for x in ts if x.split(".")[0] == "agents"})} == {}


def unjustified(text: str) -> bool:
    """A module past MAX_LINES whose docstring does not say why it is one piece."""
    return text.count("\n") > MAX_LINES and "Why one piece" not in (ast.get_docstring(ast.parse(text)) or "")


def test_long_modules_say_why_they_are_one_piece():
    long = {m: p.read_text(encoding="utf-8").count("\n") for m, p in modules().items()
            if m not in PENDING and unjustified(p.read_text(encoding="utf-8"))}
    assert long == {}
    body = "x = 1\n" * (MAX_LINES + 1)
    assert unjustified('"""A module."""\n' + body)
    assert not unjustified('"""A module.\n\nWhy one piece: a reason.\n"""\n' + body)
