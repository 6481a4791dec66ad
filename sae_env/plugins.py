"""A class named ``"module:Class"`` in a registry or in a user's input (a policy, an agent), imported and checked
against the base class it must derive from before anything of it is called: a config or a command line cannot make
the program call ``subprocess:run`` or any other callable.

A module of the user's own is found where Python finds modules, and in the current working directory too (as ``python
-m`` and ASGI servers' ``module:app`` find it), searched last so that it shadows nothing installed: a policy in
``./my_policies.py`` is ``my_policies:MyPolicy`` wherever ``train.py`` lives. Ray workers of the private local cluster
start in the driver's working directory, so they find it the same way."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping


def registered_class(kind: str, name: str, registry: Mapping[str, str], base: type, base_path: str) -> type:
    """The class ``registry[name]`` names, or the one ``name`` names as ``module:Class``; ValueError (starting
    ``unknown {kind}``, or naming ``name``) for an unknown name, an import that fails, or a class that does not derive
    from ``base`` (``base_path`` its dotted name, for the message)."""
    if not isinstance(name, str) or (name not in registry and ":" not in name):
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"  # policies, agents
        raise ValueError(f"unknown {kind} {name!r}; valid {plural}: {', '.join(registry)} (or 'module:Class')")
    module, cls = registry.get(name, name).split(":", 1)
    if name not in registry:
        _search_working_directory()
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{kind} '{name}': cannot import {module}:{cls} ({e})") from None
    if not (inspect.isclass(factory) and issubclass(factory, base)):
        raise ValueError(f"{kind} '{name}': {module}:{cls} is not {'an' if kind[0] in 'aeiou' else 'a'} {kind} class "
                         f"(a 'module:Class' {kind} must be a class deriving from {base_path}, got "
                         f"{type(factory).__name__})")
    return factory


def _search_working_directory() -> None:
    """Put the current working directory last on the module search path, unless it is there already (as ``""`` or by
    its path)."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)
