"""Compile every kernel of the compiled engine into numba's disk cache now: ``python -m sae_env.precompile``.

A kernel compiles the first time a replay needs it (4-9 s each here, SAECache's 20-30 s; instant and timed
are two kernels) and loads from the disk cache afterwards, in any process. Compiling them in a process of their
own, next to other work, takes that time off the first replays: the test suite does so on its second core
(``tests/conftest.py``). Each kernel is compiled by a replay of a few requests, so it gets the signature real
replays use.
"""

from __future__ import annotations

import argparse
import sys
import time

from sae_env import fast_engine
from sae_env.cache import PrefixCache
from sae_env.fast_engine.twin import twin_class
from sae_env.policies import make_policy, policy_names
from sae_env.replay import Replay
from sae_env.serving import make_server
from sae_env.sources import open_trace

__all__ = ["MODES", "compiled_policies", "kernels", "parse_kernels", "warm"]

SERVER = "qwen2.5-1.5b@a40"
MODES = ("instant", "timed")


def compiled_policies() -> list[str]:
    """The registered policies that replay on the compiled engine in their default configuration (one name per
    twin: ``saecache-paper`` shares ``saecache``'s kernels)."""
    names, seen = [], set()
    for name in policy_names():
        twin = twin_class(make_policy(name))
        if twin is not None and twin not in seen:
            seen.add(twin)
            names.append(name)
    return names


def kernels() -> list[tuple[str, str]]:
    """Every kernel, as (policy, mode) with mode ``instant`` or ``timed``."""
    return [(name, mode) for name in compiled_policies() for mode in MODES]


def warm(order: list[tuple[str, str]] | None = None, *, log=None) -> list[tuple[str, str, float]]:
    """Compile the kernels ``order`` (default :func:`kernels`), in that order, each by replaying a few requests of
    the embedded taubench trace on the compiled engine (``timed``: on the prefill server); returns (policy, mode,
    seconds) each, loading from the disk cache included."""
    trace, _ = open_trace("taubench")
    trace = trace[:40]
    out = []
    for name, mode in kernels() if order is None else order:
        t = time.perf_counter()
        server = make_server(SERVER) if mode == "timed" else None
        Replay(trace, PrefixCache(400, make_policy(name)), server, engine="fast", window_requests=40).run()
        out.append((name, mode, time.perf_counter() - t))
        if log is not None:
            print(f"{name} {mode}: {out[-1][2]:.1f} s", file=log, flush=True)
    return out


def parse_kernels(text: str) -> list[tuple[str, str]]:
    """``"saecache:timed,lpc,..."`` (a bare name: both modes) as :func:`warm`'s order; ``ValueError`` names the first
    unknown policy or mode."""
    valid = compiled_policies()
    order = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, mode = part.partition(":")
        if name not in valid:
            raise ValueError(f"unknown compiled policy {name!r}; valid: {', '.join(valid)}")
        if mode and mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} in {part!r}; valid: {', '.join(MODES)}")
        order += [(name, m) for m in ((mode,) if mode else MODES)]
    return order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sae_env.precompile", description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", help="comma list of POLICY[:MODE] in the order to compile them (MODE instant or "
                                      "timed; default: every compiled policy, both modes)")
    args = ap.parse_args(argv)
    if not fast_engine.AVAILABLE:
        print("precompile: numba is not installed, so there is no compiled engine (pip install -e '.[fast]')",
              file=sys.stderr)
        return 2
    try:
        order = parse_kernels(args.kernels) if args.kernels else None
    except ValueError as e:
        print(f"precompile: --kernels: {e}", file=sys.stderr)
        return 2
    warm(order, log=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
