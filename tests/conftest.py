"""Shared trace-building helpers for the cache, policy and replay tests (imported as ``from conftest import ...``).

* :func:`build_trace` turns per-request *content* lists (prompt blocks, output blocks) into a valid
  :class:`~sae_env.trace.Trace` with prefix-chained keys (outputs continue their prompt's chain, as in vLLM).
* :func:`flat_trace` builds a trace of one raw block id per request (no prefix sharing): the classic cache setting.
* :func:`prefix_traces` is a hypothesis strategy of small traces with heavy prefix sharing: a 3-letter content
  alphabet, and follow-up turns that extend an earlier request's prompt and outputs (so output blocks are reused).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

from sae_env import fast_engine
from sae_env.trace import AppType, Trace, chain_requests

BS = 16  # tokens per block: the engine's timed mode turns blocks into tokens with it


class ShownTrace(Trace):
    """A Trace whose repr is the :func:`build_trace` call that made it, so that hypothesis reports reproduce."""

    __slots__ = ("recipe",)

    def __repr__(self) -> str:
        return getattr(self, "recipe", None) or super().__repr__()


def build_trace(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]] | None = None,
                times: Sequence[float] | None = None, *, tails: Sequence[int] | None = None,
                out_extra: Sequence[int] | None = None, types: Sequence[Sequence[int]] | None = None,
                block_size: int = BS) -> Trace:
    """A trace from per-request content ids; keys are chained over prompt then output blocks.

    ``tails`` adds a partial block of that many tokens to each prompt (default 0); ``out_extra`` adds tokens to
    the output count beyond its full blocks (decode time in timed mode); ``types`` gives each prompt block's
    TokenType (default USER = 2; output blocks are ASSISTANT = 3).
    """
    n = len(prompts)
    outputs = [[] for _ in range(n)] if outputs is None else outputs
    times = np.arange(n, dtype=np.float64) if times is None else np.asarray(times, dtype=np.float64)
    tails = [0] * n if tails is None else tails
    out_extra = [0] * n if out_extra is None else out_extra
    seq = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
    lens = np.array([len(s) for s in seq], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    content = np.array([c for s in seq for c in s], dtype=np.uint64)
    n_prompt = np.array([len(p) for p in prompts], dtype=np.int64)
    pk, po, ok, oo = chain_requests(content, offsets, n_prompt)
    if types is None:
        pt = np.full(pk.size, 2, dtype=np.int8)
    else:
        pt = np.array([x for tt in types for x in tt], dtype=np.int8)
    trace = ShownTrace(t=times, session=np.arange(n), turn=np.ones(n, dtype=np.int32),
                       app=np.full(n, int(AppType.CHAT), dtype=np.int8),
                       prompt_tokens=n_prompt * block_size + np.asarray(tails, dtype=np.int64),
                       output_tokens=np.array([len(o) for o in outputs], dtype=np.int64) * block_size
                       + np.asarray(out_extra, dtype=np.int64),
                       prompt_offsets=po, prompt_keys=pk, prompt_types=pt, output_offsets=oo, output_keys=ok,
                       output_types=np.full(ok.size, 3, dtype=np.int8), block_size=block_size)
    trace.recipe = (f"build_trace({[list(p) for p in prompts]}, {[list(o) for o in outputs]}, "
                    f"times={times.tolist()}, tails={list(tails)}, out_extra={list(out_extra)})")
    return trace


def flat_trace(ids: Sequence[int], block_size: int = BS) -> Trace:
    """One request per id, each with exactly one prompt block whose key is the id itself (no chaining)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = ids.size
    return Trace(t=np.arange(n, dtype=np.float64), session=np.arange(n), turn=np.ones(n, dtype=np.int32),
                 app=np.zeros(n, dtype=np.int8), prompt_tokens=np.full(n, block_size, dtype=np.int64),
                 output_tokens=np.zeros(n, dtype=np.int64), prompt_offsets=np.arange(n + 1, dtype=np.int64),
                 prompt_keys=ids, prompt_types=np.full(n, 2, dtype=np.int8), block_size=block_size)


def zipf_ids(n: int, n_objects: int, alpha: float, seed: int) -> np.ndarray:
    """``n`` object ids drawn from a Zipf(alpha) popularity over ``n_objects`` objects (ids shuffled)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_objects + 1) ** alpha
    ids = rng.choice(n_objects, size=n, p=p / p.sum())
    return rng.permutation(n_objects)[ids].astype(np.int64) + 1


@st.composite
def prefix_traces(draw, max_requests: int = 24, max_prompt: int = 6, max_output: int = 3, timed: bool = False,
                  outputs: bool = True) -> Trace:
    """Small traces with shared prefixes; ``timed`` draws dense arrivals (ms apart) so that requests overlap."""
    n = draw(st.integers(1, max_requests))
    letter = st.integers(0, 2)
    prompts: list[list[int]] = []
    outs: list[list[int]] = []
    for _ in range(n):
        if prompts and draw(st.booleans()):
            # a follow-up turn: an earlier request's prompt and outputs, then new blocks
            j = draw(st.integers(0, len(prompts) - 1))
            base = prompts[j] + outs[j]
            p = (base + draw(st.lists(letter, max_size=2)))[:max_prompt + max_output]
        else:
            p = draw(st.lists(letter, max_size=max_prompt))
        o = draw(st.lists(letter, max_size=max_output)) if outputs else []
        prompts.append(p)
        outs.append(o)
    tails = draw(st.lists(st.integers(0, BS - 1), min_size=n, max_size=n))
    if timed:
        gaps = draw(st.lists(st.sampled_from([0.0, 0.001, 0.005, 0.02, 0.1, 1.0]), min_size=n, max_size=n))
        times = np.cumsum(gaps)
        out_extra = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    else:
        times, out_extra = None, None
    return build_trace(prompts, outs, times, tails=tails, out_extra=out_extra)


# SAECache's timed kernel first: it takes the longest to compile (about a minute) and the suite's first tests need it
# second, right after SAECache's instant kernel, which a worker compiles then. The others in the reverse of the order in
# which the suite first needs them (tests/test_agents.py, then tests/test_env.py: measured). A second process takes the
# kernels in the opposite order, so that the two meet halfway. A kernel's first call in a process holds a lock file of
# its own (jit._compiled_once): a process that needs a kernel another is compiling waits for it and loads it, rather
# than compile it a second time beside it.
WARM_ORDER = ("saecache:timed,lpc:timed,when-oracle:instant,session-oracle:instant,reuse-oracle:instant,"
              "belady:instant,s3fifo:instant,fifo:instant,lfu:instant,lru:instant,when-oracle:timed,"
              "session-oracle:timed,reuse-oracle:timed,belady:timed,s3fifo:timed,fifo:timed,lfu:timed,lru:timed,"
              "lpc:instant,saecache:instant")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the compiled engine's kernels in two processes of their own while the tests run (in the controller
    when the suite runs on workers, so once): a clean checkout spends minutes compiling kernels (5-15 s each,
    SAECache's two about a minute each: 2026-12-07, this project's 2-core machine), and without this every worker
    compiles each kernel it needs inside the test that first needs it; a test then loads its kernel from the disk
    cache instead, or waits on the kernel's lock while one of them compiles it. Measured on a clean clone with two
    workers, before the lock: 369.5 s with one such process, 454.1 s without; with the lock and one process, the whole
    suite took 11:25-13:03 in three runs, and with two (one in each order) and the end-to-end tests merged, 10:48-13:16
    in five (2026-12-07; the machine varies by more than that difference). While the suite's first tests wait on
    kernels, one process leaves a core idle. It changes no result (a kernel compiled here or in the test is the same
    machine code), only when the compiling happens. SAECACHE_GYM_NO_WARM=1 turns it off."""
    if os.environ.get("SAECACHE_GYM_NO_WARM") or not fast_engine.AVAILABLE or hasattr(session.config, "workerinput"):
        return
    order = WARM_ORDER.split(",")
    session.config._warm = [
        subprocess.Popen([sys.executable, "-m", "sae_env.precompile", "--kernels", ",".join(kernels)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         cwd=Path(__file__).resolve().parent.parent)
        for kernels in (order, order[::-1])]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for warm in getattr(session.config, "_warm", ()):
        if warm.poll() is None:
            warm.kill()
            warm.wait()


@pytest.fixture(scope="session")
def _wandb_home(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("wandb-home")
    dirs = {name: str(base / name.lower()) for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    for path in dirs.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    return dirs


@pytest.fixture(autouse=True)
def wandb_dirs(_wandb_home, monkeypatch) -> dict[str, str]:
    """W&B's own folders in a temporary folder of the session (nothing lands in the home folder), and none of the
    user's W&B choices (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR: runs go where the code puts them,
    offline); returns the variables set. Every test gets it: training commands log offline W&B runs by default."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, path in _wandb_home.items():
        monkeypatch.setenv(name, path)
    return dict(_wandb_home)
