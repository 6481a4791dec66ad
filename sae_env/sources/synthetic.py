"""Synthetic heterogeneous workloads: a seeded parametric generator of the SAECache paper's workload kinds.

Three kinds of *sessions* arrive on one timeline, driven by a **phase schedule** (a list of phases, each with a
duration in seconds, a session arrival rate in sessions/s and a mix of kinds). Session starts in a phase form a
Poisson process (the count is Poisson(rate x duration), the starts uniform in the phase window); each start picks its
kind by the phase's mix weights. A session may run on past its phase's end (and, with ``drain=True``, past the end of
the schedule).

* ``templated`` (AppType.SINGLE_TURN): one request = system prompt (SYSTEM, from a pool of ``n_system``) + template
  (TEMPLATE, one of ``n_templates``, drawn with Zipf popularity ``P(rank k) ~ k ** -zipf_s``) + a unique user tail
  (USER); a short output (ASSISTANT).
* ``chat`` (AppType.CHAT): a system prompt from a small pool (SYSTEM), a number of turns (geometric / log-normal /
  fixed with a given mean), per turn a user message (USER) and a response (ASSISTANT), with probability
  ``reasoning_prob`` preceded by reasoning (REASONING). Turn k's prompt is turn k-1's prompt + turn k-1's response
  (without its reasoning) + the new user message; its output is [reasoning] + response. Reasoning is generated (so
  its blocks are output blocks) but dropped from the next turn's history, so those blocks are never reused.
  Gaps between consecutive turns' arrivals are log-normal(``gap_mu``, ``gap_sigma``) in ln seconds (defaults
  4.88 / 0.98, fitted on the Mooncake conversation trace, see data/README.md).
* ``agent`` (AppType.AGENT): system prompt (SYSTEM) + tool schemas (TEMPLATE), the pair drawn from a small pool of
  ``n_agents`` agent definitions shared across sessions, then the user task (USER); then steps: each step's output is
  a tool call (ASSISTANT), followed in the next prompt by the tool's output (TOOL_OUTPUT; with probability
  ``user_prob`` a user message instead), and so on; the last step's output is the final answer. Gaps are
  log-normal with agent parameters (defaults mu 1.0, sigma 0.8: seconds, not minutes).

Token content is not materialised. Every sequence is a list of *segments* (a segment table entry: length in tokens and
TokenType); a segment's content is fixed by its uid (a hash of the seed and its index in the segment table, so traces
of different seeds share no content by accident): a shared system prompt or template is one segment reused by many
sequences, a user message is a fresh segment. A block covers tokens
``[b * block_size, (b + 1) * block_size)`` of its request's sequence; its content id hashes exactly the token content it
covers: for a block inside one segment ``(uid, start offset)``, for a block that spans ``k >= 2`` segments
``(k, first uid, its start offset, every further uid, end offset in the last segment)``. Two blocks therefore get equal
content ids iff they hold equal tokens. A block's type is the dominant type of its tokens (ties go to the lower
TokenType value, as :func:`sae_env.trace.token_blocks`). Prompt blocks are the full blocks of the prompt; output
blocks are the full blocks of the whole sequence (prompt + output) beyond them, so the block straddling the end of the
prompt is an output block (it completes during decode). All requests are then chained in one vectorised call of
:func:`sae_env.trace.chain_requests`.

Prefix growth inside a chat / agent session (turn k -> k+1; exact, up to 64-bit hash collisions): turn k's prompt keys
are a prefix of turn k+1's prompt keys; if turn k has no reasoning, turn k's prompt keys followed by *all* its output
keys are a prefix of turn k+1's prompt keys (the straddling block holds the same tokens in both); if it has reasoning,
*none* of its output keys (the straddling block included, whatever its dominant type) appears in any prompt.

Lengths are drawn per segment from a log-normal parameterised by its mean (``mu = ln(mean) - sigma**2 / 2``), rounded
and clipped to ``[min, max]`` (``sigma = 0``: constant). Pool members (system prompts, templates, agent definitions)
draw their lengths once. Everything comes from one ``numpy.random.Generator(seed)``, drawn in a fixed order, so the
same configuration and seed give an identical trace.

Request phase: ``trace.meta["phases"]`` lists ``{start, end, name, mix}``; :func:`phase_of` returns each request's
phase index (by its session's start, or by its own arrival time).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.inputs import check_options, open_text
from sae_env.trace import (
    AppType,
    LoadReport,
    TokenType,
    Trace,
    TraceFormatError,
    chain_requests,
    content_hash,
    csr_offsets,
)

__all__ = [
    "AgentConfig",
    "ChatConfig",
    "Count",
    "KINDS",
    "Length",
    "PRESETS",
    "Phase",
    "Plan",
    "SyntheticConfig",
    "TemplatedConfig",
    "generate",
    "load",
    "make_config",
    "phase_of",
    "plan",
    "poisson_arrivals",
    "read_config_file",
    "trace_from_plan",
]

KINDS = ("templated", "chat", "agent")
_APP_OF_KIND = np.array([AppType.SINGLE_TURN, AppType.CHAT, AppType.AGENT], dtype=np.int8)
_MAX_EXPECTED_SESSIONS = 5_000_000  # guard against a schedule that would exhaust memory deep inside numpy


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an integer past float range (1e308)
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {str(value)[:40]}")
    return x


def _integer(value: Any, name: str) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        v = int(value)  # exact: a float would round integers past 2**53
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"{name} must fit in 64 bits, got {str(value)[:40]}")
        return v
    v = _number(value, name)
    if v != int(v):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return _integer(int(v), name)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _coerce_ints(obj: Any, *names: str) -> None:
    """Store integer-valued fields as int (a YAML ``4.0`` is fine, ``4.5`` is not) on a frozen dataclass."""
    for name in names:
        object.__setattr__(obj, name, _integer(getattr(obj, name), name))


# ----------------------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Length:
    """A token-length distribution: log-normal with the given *mean* and shape ``sigma`` (ln units), clipped.

    In a config file either a number (a constant length) or ``{mean, sigma, min, max}``.
    """

    mean: float
    sigma: float = 0.0
    min: int = 1
    max: int = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", _number(self.mean, "mean"))
        object.__setattr__(self, "sigma", _number(self.sigma, "sigma"))
        object.__setattr__(self, "min", _integer(self.min, "min"))
        object.__setattr__(self, "max", _integer(self.max, "max"))
        _require(self.mean >= 1, f"mean must be >= 1 token, got {self.mean}")
        _require(0 <= self.sigma <= 5, f"sigma must lie in [0, 5], got {self.sigma}")
        _require(self.min >= 1, f"min must be >= 1 token, got {self.min}")
        _require(self.max >= self.min, f"max ({self.max}) must be >= min ({self.min})")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma == 0:
            x = np.full(n, self.mean)
        else:
            x = rng.lognormal(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma, n)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)


_COUNT_DISTS = ("geometric", "lognormal", "fixed")


@dataclass(frozen=True)
class Count:
    """A number of turns / steps (>= 1): ``geometric`` (on 1, 2, ...), ``lognormal`` (rounded) or ``fixed``.

    In a config file either a number (fixed) or ``{dist, mean, sigma, max}``.
    """

    mean: float
    dist: str = "geometric"
    sigma: float = 0.8  # only for dist="lognormal"
    max: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", _number(self.mean, "mean"))
        object.__setattr__(self, "sigma", _number(self.sigma, "sigma"))
        object.__setattr__(self, "max", _integer(self.max, "max"))
        _require(self.dist in _COUNT_DISTS, f"dist must be one of {list(_COUNT_DISTS)}, got {self.dist!r}")
        _require(self.mean >= 1, f"mean must be >= 1, got {self.mean}")
        _require(0 <= self.sigma <= 5, f"sigma must lie in [0, 5], got {self.sigma}")
        _require(self.max >= 1, f"max must be >= 1, got {self.max}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "geometric":
            x = rng.geometric(1.0 / self.mean, n)
        elif self.dist == "lognormal":
            x = np.rint(rng.lognormal(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma, n))
        else:
            x = np.full(n, round(self.mean))
        return np.clip(x, 1, self.max).astype(np.int64)


def _prob(v: float, name: str) -> None:
    _require(0.0 <= v <= 1.0, f"{name} must lie in [0, 1], got {v}")


def _gap(mu: float, sigma: float) -> None:
    _require(-20 <= mu <= 20, f"gap_mu must lie in [-20, 20] (ln seconds), got {mu}")
    _require(0 < sigma <= 5, f"gap_sigma must lie in (0, 5], got {sigma}")


@dataclass(frozen=True)
class TemplatedConfig:
    """Single-turn templated requests (API-style): SYSTEM + TEMPLATE (Zipf) + USER -> short ASSISTANT output."""

    n_system: int = 1
    system_tokens: Length = Length(300, 0.3)
    n_templates: int = 64
    template_tokens: Length = Length(1200, 0.6)
    zipf_s: float = 1.1
    user_tokens: Length = Length(120, 0.8)
    output_tokens: Length = Length(16, 0.5)

    def __post_init__(self) -> None:
        _coerce_ints(self, "n_system", "n_templates")
        _require(self.n_system >= 1, f"n_system must be >= 1, got {self.n_system}")
        _require(self.n_templates >= 1, f"n_templates must be >= 1, got {self.n_templates}")
        _require(0 <= _number(self.zipf_s, "zipf_s") <= 10, f"zipf_s must lie in [0, 10], got {self.zipf_s}")


@dataclass(frozen=True)
class ChatConfig:
    """Multi-turn chat sessions with optional reasoning that is dropped from the next turn's history."""

    n_system: int = 8
    system_tokens: Length = Length(250, 0.5)
    turns: Count = Count(4.0, "geometric", max=64)
    user_tokens: Length = Length(100, 1.0)
    response_tokens: Length = Length(350, 0.8)
    reasoning_prob: float = 0.3
    reasoning_tokens: Length = Length(800, 0.8)
    gap_mu: float = 4.88
    gap_sigma: float = 0.98

    def __post_init__(self) -> None:
        _coerce_ints(self, "n_system")
        _require(self.n_system >= 1, f"n_system must be >= 1, got {self.n_system}")
        _prob(_number(self.reasoning_prob, "reasoning_prob"), "reasoning_prob")
        _gap(_number(self.gap_mu, "gap_mu"), _number(self.gap_sigma, "gap_sigma"))


@dataclass(frozen=True)
class AgentConfig:
    """Multi-step tool-using agent sessions (tau-bench-like: a ~4 k-token system + tools prefix shared by all)."""

    n_agents: int = 4
    system_tokens: Length = Length(1500, 0.2)
    tools_tokens: Length = Length(2500, 0.2)
    task_tokens: Length = Length(120, 0.6)
    steps: Count = Count(10.0, "geometric", max=64)
    call_tokens: Length = Length(80, 0.6)
    tool_output_tokens: Length = Length(300, 1.0)
    user_prob: float = 0.0
    user_tokens: Length = Length(60, 0.8)
    reasoning_prob: float = 0.0
    reasoning_tokens: Length = Length(300, 0.8)
    gap_mu: float = 1.0
    gap_sigma: float = 0.8

    def __post_init__(self) -> None:
        _coerce_ints(self, "n_agents")
        _require(self.n_agents >= 1, f"n_agents must be >= 1, got {self.n_agents}")
        _prob(_number(self.user_prob, "user_prob"), "user_prob")
        _prob(_number(self.reasoning_prob, "reasoning_prob"), "reasoning_prob")
        _gap(_number(self.gap_mu, "gap_mu"), _number(self.gap_sigma, "gap_sigma"))


def _check_mix(mix: Any, valid: Sequence[str] | None, what: str) -> dict[str, float]:
    if not isinstance(mix, Mapping):
        raise ValueError(f"{what} must be a mapping of name -> weight, got {mix!r}")
    out = {}
    for k, v in mix.items():
        if valid is not None and k not in valid:
            raise ValueError(f"{what} has unknown key '{k}'; valid keys: {list(valid)}")
        w = _number(v, f"{what}[{k!r}]")
        _require(w >= 0, f"{what}[{k!r}] must be >= 0, got {w}")
        out[str(k)] = w
    return out


@dataclass(frozen=True)
class Phase:
    """One phase of the schedule: ``duration`` s, Poisson session arrivals at ``rate`` sessions/s, kind weights."""

    duration: float
    rate: float
    mix: dict[str, float] = field(default_factory=lambda: {"templated": 1.0})
    name: str = ""

    def __post_init__(self) -> None:
        _require(_number(self.duration, "duration") > 0, f"duration must be > 0 s, got {self.duration}")
        _require(_number(self.rate, "rate") >= 0, f"rate must be >= 0 sessions/s, got {self.rate}")
        object.__setattr__(self, "mix", _check_mix(self.mix, KINDS, "mix"))
        _require(self.rate == 0 or sum(self.mix.values()) > 0, "mix weights must not all be 0 when rate > 0")
        _require(isinstance(self.name, str), f"name must be a string, got {self.name!r}")


_DEFAULT_MIX = {"templated": 0.4, "chat": 0.35, "agent": 0.25}


@dataclass(frozen=True)
class SyntheticConfig:
    """The whole generator configuration. Defaults = the ``heterogeneous`` preset (one 600 s phase)."""

    seed: int = 0
    block_size: int = 16
    phases: tuple[Phase, ...] = (Phase(600.0, 1.0, dict(_DEFAULT_MIX), "heterogeneous"),)
    drain: bool = True  # keep requests of sessions still running after the last phase ends
    templated: TemplatedConfig = TemplatedConfig()
    chat: ChatConfig = ChatConfig()
    agent: AgentConfig = AgentConfig()

    def __post_init__(self) -> None:
        _coerce_ints(self, "seed", "block_size")
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _require(1 <= self.block_size <= 1 << 16,
                 f"block_size must lie in [1, 65536], got {self.block_size}")
        _require(isinstance(self.drain, bool), f"drain must be true or false, got {self.drain!r}")
        object.__setattr__(self, "phases", tuple(self.phases))
        _require(len(self.phases) >= 1, "phases must list at least one phase")
        expected = sum(p.rate * p.duration for p in self.phases)
        _require(expected <= _MAX_EXPECTED_SESSIONS,
                 f"phases expect {expected:.3g} sessions, more than the limit {_MAX_EXPECTED_SESSIONS}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "synthetic config") -> SyntheticConfig:
        """Build and validate from plain data (a parsed YAML / JSON file); errors name the offending key."""
        return _build(cls, data, where)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = [asdict(p) for p in self.phases]
        return d


# Which nested fields are themselves configs (the rest are scalars or the phase list).
_NESTED: dict[type, dict[str, type]] = {
    TemplatedConfig: {"system_tokens": Length, "template_tokens": Length, "user_tokens": Length,
                      "output_tokens": Length},
    ChatConfig: {"system_tokens": Length, "turns": Count, "user_tokens": Length, "response_tokens": Length,
                 "reasoning_tokens": Length},
    AgentConfig: {"system_tokens": Length, "tools_tokens": Length, "task_tokens": Length, "steps": Count,
                  "call_tokens": Length, "tool_output_tokens": Length, "user_tokens": Length,
                  "reasoning_tokens": Length},
    SyntheticConfig: {"templated": TemplatedConfig, "chat": ChatConfig, "agent": AgentConfig},
    Phase: {},
    Length: {},
    Count: {},
}


def _build(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, cls):
        return data
    if cls in (Length, Count) and isinstance(data, (int, float)) and not isinstance(data, bool):
        data = {"mean": data, "dist": "fixed"} if cls is Count else {"mean": data}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {data!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(str(k) for k in set(data) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {names}")
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f.name not in data]
    if missing:
        raise ValueError(f"{where}: missing required key(s) {missing}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = _NESTED[cls].get(name)
        if sub is not None:
            kwargs[name] = _build(sub, value, f"{where}.{name}")
        elif cls is SyntheticConfig and name == "phases":
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
                raise ValueError(f"{where}.phases: expected a list of phases, got {value!r}")
            kwargs[name] = tuple(_build(Phase, p, f"{where}.phases[{i}]") for i, p in enumerate(value))
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except TypeError as e:  # e.g. a list where a number belongs, caught by comparisons
        raise ValueError(f"{where}: {e}") from None


def _merge(base: Any, over: Any) -> Any:
    """Deep-merge mappings (``over`` wins); lists and scalars are replaced whole."""
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    return copy.deepcopy(over)


PRESETS: dict[str, dict[str, Any]] = {
    # The defaults: templated + chat with reasoning + agent sessions in one phase.
    "heterogeneous": {},
    # The same three kinds at 3 sessions/s with long reasoning, long unique user tails and bulky tool outputs: a
    # contended cache, where what a policy keeps matters (LRU and Belady differ by ~5 points at 10 % capacity).
    "contended": {
        "phases": [{"duration": 600.0, "rate": 3.0, "mix": {"templated": 0.3, "chat": 0.4, "agent": 0.3},
                    "name": "contended"}],
        "chat": {"turns": {"mean": 5.0}, "response_tokens": {"mean": 500, "sigma": 0.8}, "reasoning_prob": 0.5,
                 "reasoning_tokens": {"mean": 1500, "sigma": 0.8}},
        "templated": {"user_tokens": {"mean": 600, "sigma": 0.8}, "n_templates": 256, "zipf_s": 0.9},
        "agent": {"steps": {"mean": 5.0}, "tool_output_tokens": {"mean": 800, "sigma": 1.0}, "n_agents": 8},
    },
    # Workload shift: templated-heavy -> chat-heavy -> agent-heavy, 600 s each.
    "shift": {"phases": [
        {"duration": 600.0, "rate": 1.0, "mix": {"templated": 0.8, "chat": 0.1, "agent": 0.1}, "name": "templated"},
        {"duration": 600.0, "rate": 1.0, "mix": {"templated": 0.1, "chat": 0.8, "agent": 0.1}, "name": "chat"},
        {"duration": 600.0, "rate": 1.0, "mix": {"templated": 0.1, "chat": 0.1, "agent": 0.8}, "name": "agent"},
    ]},
    # A few dozen sessions with short gaps and small prompts, for tests.
    "tiny": {
        "phases": [{"duration": 60.0, "rate": 0.5, "mix": {"templated": 0.4, "chat": 0.3, "agent": 0.3},
                    "name": "tiny"}],
        "templated": {"n_templates": 6, "system_tokens": {"mean": 40, "sigma": 0.3},
                      "template_tokens": {"mean": 120, "sigma": 0.5}, "user_tokens": {"mean": 30, "sigma": 0.8},
                      "output_tokens": {"mean": 8, "sigma": 0.5}},
        "chat": {"n_system": 3, "system_tokens": {"mean": 50, "sigma": 0.5}, "turns": {"mean": 3.0, "max": 8},
                 "user_tokens": {"mean": 30, "sigma": 0.8}, "response_tokens": {"mean": 60, "sigma": 0.8},
                 "reasoning_prob": 0.4, "reasoning_tokens": {"mean": 50, "sigma": 0.8},
                 "gap_mu": 1.5, "gap_sigma": 0.6},
        "agent": {"n_agents": 2, "system_tokens": {"mean": 100, "sigma": 0.2},
                  "tools_tokens": {"mean": 150, "sigma": 0.2}, "task_tokens": {"mean": 30, "sigma": 0.5},
                  "steps": {"mean": 4.0, "max": 10}, "call_tokens": {"mean": 20, "sigma": 0.5},
                  "tool_output_tokens": {"mean": 50, "sigma": 1.0}},
    },
}


def make_config(preset: str | None = None, **overrides: Any) -> SyntheticConfig:
    """A validated config: the named preset (default: the plain defaults) deep-merged with ``overrides``."""
    if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
        raise ValueError(f"unknown synthetic preset {preset!r}; valid presets: {sorted(PRESETS)}")
    data = _merge(PRESETS[preset] if preset else {}, overrides)
    return SyntheticConfig.from_dict(data, where=f"synthetic config (preset {preset!r})" if preset else
                                     "synthetic config")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML (``.yaml`` / ``.yml``) or JSON (``.json``, optionally ``.gz``) config file into a mapping."""
    path = Path(path)
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    kind = suffixes[-1] if suffixes else ""
    if kind not in (".yaml", ".yml", ".json"):
        raise ValueError(f"{path}: config files must be .yaml, .yml or .json, got '{kind or path.name}'")
    with open_text(path) as f:
        text = f.read()
    if kind == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"malformed JSON ({e.msg}, column {e.colno})", path=path, line=e.lineno) from e
    else:
        import yaml  # noqa: PLC0415 - only configs written in YAML need it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            raise TraceFormatError(f"malformed YAML ({getattr(e, 'problem', e)})", path=path,
                                   line=None if mark is None else mark.line + 1) from e
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise TraceFormatError(f"the top level must be a mapping of options, got {type(data).__name__}", path=path)
    return dict(data)


# ----------------------------------------------------------------------------------------------------------------
# Arrivals


def poisson_arrivals(rng: np.random.Generator, durations: Sequence[float],
                     rates: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Session start times of a piecewise-constant Poisson process, and the phase index of each (sorted)."""
    times, phase = [], []
    start = 0.0
    for i, (d, r) in enumerate(zip(durations, rates, strict=True)):
        n = int(rng.poisson(r * d)) if r > 0 else 0
        times.append(start + np.sort(rng.uniform(0.0, d, n)))
        phase.append(np.full(n, i, dtype=np.int64))
        start += d
    return np.concatenate(times), np.concatenate(phase)


def _phase_windows(durations: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(durations, dtype=np.float64))])


def phase_of(trace: Trace, by: str = "session") -> np.ndarray:
    """Phase index of every request, from ``trace.meta["phases"]`` (``{start, end, ...}`` in order).

    ``by="session"``: the phase whose window holds the request's session start (the arrival of the session's earliest
    request in the trace); this is the phase whose mix chose the session. ``by="time"``: the phase whose window holds
    the request's own arrival. Requests outside every window get -1.
    """
    phases = trace.meta.get("phases")
    if not phases:
        raise ValueError("trace.meta has no 'phases' (only synthetic and mix traces record a phase schedule)")
    if by not in ("session", "time"):
        raise ValueError(f"by must be 'session' or 'time', got {by!r}")
    starts = np.array([float(p["start"]) for p in phases])
    ends = np.array([float(p["end"]) for p in phases])
    t = trace.t
    if by == "session" and len(trace):
        _, inv = np.unique(trace.session_ids(), return_inverse=True)
        first = np.full(inv.max() + 1, np.inf)
        np.minimum.at(first, inv, t)
        t = first[inv]
    idx = np.searchsorted(starts, t, side="right") - 1
    ok = (idx >= 0) & (t < ends[np.clip(idx, 0, None)])
    return np.where(ok, idx, -1).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# The plan: sessions, requests and their segment lists


def _ranks(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For CSR groups of the given lengths: the group index and the position within the group of each element."""
    lengths = np.asarray(lengths, dtype=np.int64)
    owner = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    pos = np.arange(owner.size, dtype=np.int64) - np.repeat(csr_offsets(lengths)[:-1], lengths)
    return owner, pos


class _SegmentTable:
    def __init__(self) -> None:
        self._len: list[np.ndarray] = []
        self._type: list[np.ndarray] = []
        self.n = 0

    def add(self, lengths: np.ndarray, types: int | np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.int64)
        idx = np.arange(self.n, self.n + lengths.size, dtype=np.int64)
        self._len.append(lengths)
        self._type.append(np.broadcast_to(np.asarray(types, dtype=np.int8), lengths.shape).copy())
        self.n += lengths.size
        return idx

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._len:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8)
        return np.concatenate(self._len), np.concatenate(self._type)


@dataclass
class Plan:
    """A generated workload before blocks are cut: segment table and per-request segment lists (time order).

    Request ``i``'s sequence is segments ``segs[seg_offsets[i]:seg_offsets[i+1]]`` (indices into ``seg_len`` /
    ``seg_type``; segment content uid = hash(seed, index + 1)); the first ``n_prompt_segs[i]`` form its prompt, the
    rest its output.
    """

    block_size: int
    seed: int  # with the segment index, fixes each segment's content uid
    seg_len: np.ndarray  # int64 [S] tokens
    seg_type: np.ndarray  # int8 [S] TokenType
    t: np.ndarray  # float64 [R]
    session: np.ndarray  # int64 [R], ids in session start order
    turn: np.ndarray  # int32 [R]
    kind: np.ndarray  # int8 [R], index into KINDS
    phase: np.ndarray  # int64 [R], phase of the session's start
    reasoning: np.ndarray  # bool [R], the output starts with a reasoning segment
    template: np.ndarray  # int64 [R], template index (Zipf rank - 1) of templated requests, else -1
    segs: np.ndarray  # int64 flat segment indices
    seg_offsets: np.ndarray  # int64 [R+1] CSR into segs
    n_prompt_segs: np.ndarray  # int64 [R]
    session_start: np.ndarray  # float64 [n_sessions]
    session_kind: np.ndarray  # int8 [n_sessions]
    session_phase: np.ndarray  # int64 [n_sessions]

    def __len__(self) -> int:
        return int(self.t.size)


@dataclass
class _KindRequests:
    """Requests of the sessions of one kind, in local session order; streams are session segment histories."""

    stream: np.ndarray  # flat segment indices of each session's history stream
    stream_off: np.ndarray  # CSR per session
    session: np.ndarray  # local session index per request
    turn: np.ndarray
    rel_t: np.ndarray  # seconds since the session start
    n_prompt: np.ndarray  # prompt = stream[start : start + n_prompt]; output = [reasoning] + stream[start + n_prompt]
    reasoning_seg: np.ndarray  # segment index or -1
    template: np.ndarray


def _turn_times(rng: np.random.Generator, counts: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    """Arrival offsets of each turn from its session's start: cumulative log-normal gaps, the first at 0."""
    owner, pos = _ranks(counts)
    gaps = rng.lognormal(mu, sigma, owner.size)
    gaps[pos == 0] = 0.0
    cum = np.cumsum(gaps)  # counts are >= 1, so every session owns its first entry
    return cum - np.repeat(cum[csr_offsets(counts)[:-1]], counts) if owner.size else cum


def _reasoning(rng: np.random.Generator, table: _SegmentTable, n: int, prob: float, length: Length) -> np.ndarray:
    seg = np.full(n, -1, dtype=np.int64)
    flag = rng.random(n) < prob
    seg[flag] = table.add(length.sample(rng, int(flag.sum())), TokenType.REASONING)
    return seg


def _templated(rng: np.random.Generator, cfg: TemplatedConfig, table: _SegmentTable, n: int) -> _KindRequests:
    sys_pool = table.add(cfg.system_tokens.sample(rng, cfg.n_system), TokenType.SYSTEM)
    tpl_pool = table.add(cfg.template_tokens.sample(rng, cfg.n_templates), TokenType.TEMPLATE)
    popularity = np.arange(1, cfg.n_templates + 1, dtype=np.float64) ** -cfg.zipf_s
    tpl = rng.choice(cfg.n_templates, size=n, p=popularity / popularity.sum())
    sys = rng.integers(cfg.n_system, size=n)
    user = table.add(cfg.user_tokens.sample(rng, n), TokenType.USER)
    out = table.add(cfg.output_tokens.sample(rng, n), TokenType.ASSISTANT)
    stream = np.stack([sys_pool[sys], tpl_pool[tpl], user, out], axis=1).ravel()
    return _KindRequests(stream=stream, stream_off=4 * np.arange(n + 1, dtype=np.int64),
                         session=np.arange(n, dtype=np.int64), turn=np.ones(n, dtype=np.int64), rel_t=np.zeros(n),
                         n_prompt=np.full(n, 3, dtype=np.int64), reasoning_seg=np.full(n, -1, dtype=np.int64),
                         template=tpl.astype(np.int64))


def _chat(rng: np.random.Generator, cfg: ChatConfig, table: _SegmentTable, n: int) -> _KindRequests:
    # Stream of a session with T turns: [system, user_1, response_1, ..., user_T, response_T].
    sys_pool = table.add(cfg.system_tokens.sample(rng, cfg.n_system), TokenType.SYSTEM)
    turns = cfg.turns.sample(rng, n)
    sys = rng.integers(cfg.n_system, size=n)
    owner, k = _ranks(turns)
    users = table.add(cfg.user_tokens.sample(rng, owner.size), TokenType.USER)
    resp = table.add(cfg.response_tokens.sample(rng, owner.size), TokenType.ASSISTANT)
    reason = _reasoning(rng, table, owner.size, cfg.reasoning_prob, cfg.reasoning_tokens)
    rel_t = _turn_times(rng, turns, cfg.gap_mu, cfg.gap_sigma)
    off = csr_offsets(1 + 2 * turns)
    stream = np.empty(off[-1], dtype=np.int64)
    stream[off[:-1]] = sys_pool[sys]
    stream[off[owner] + 1 + 2 * k] = users
    stream[off[owner] + 2 + 2 * k] = resp
    return _KindRequests(stream=stream, stream_off=off, session=owner, turn=k + 1, rel_t=rel_t, n_prompt=2 * k + 2,
                         reasoning_seg=reason, template=np.full(owner.size, -1, dtype=np.int64))


def _agent(rng: np.random.Generator, cfg: AgentConfig, table: _SegmentTable, n: int) -> _KindRequests:
    # Stream of a session with T steps: [system, tools, task, call_1, obs_1, ..., obs_{T-1}, call_T]; step k's
    # prompt is everything before call_k, its output call_k (the last call is the final answer).
    sys_pool = table.add(cfg.system_tokens.sample(rng, cfg.n_agents), TokenType.SYSTEM)
    tools_pool = table.add(cfg.tools_tokens.sample(rng, cfg.n_agents), TokenType.TEMPLATE)
    steps = cfg.steps.sample(rng, n)
    agent = rng.integers(cfg.n_agents, size=n)
    task = table.add(cfg.task_tokens.sample(rng, n), TokenType.USER)
    owner, k = _ranks(steps)
    calls = table.add(cfg.call_tokens.sample(rng, owner.size), TokenType.ASSISTANT)
    n_obs = int((steps - 1).sum())
    is_user = rng.random(n_obs) < cfg.user_prob
    obs_len = cfg.tool_output_tokens.sample(rng, n_obs)
    obs_len[is_user] = cfg.user_tokens.sample(rng, int(is_user.sum()))
    obs = table.add(obs_len, np.where(is_user, TokenType.USER, TokenType.TOOL_OUTPUT))
    reason = _reasoning(rng, table, owner.size, cfg.reasoning_prob, cfg.reasoning_tokens)
    rel_t = _turn_times(rng, steps, cfg.gap_mu, cfg.gap_sigma)
    off = csr_offsets(2 * steps + 2)
    stream = np.empty(off[-1], dtype=np.int64)
    stream[off[:-1]] = sys_pool[agent]
    stream[off[:-1] + 1] = tools_pool[agent]
    stream[off[:-1] + 2] = task
    stream[off[owner] + 3 + 2 * k] = calls
    has_obs = k < steps[owner] - 1
    stream[off[owner[has_obs]] + 4 + 2 * k[has_obs]] = obs
    return _KindRequests(stream=stream, stream_off=off, session=owner, turn=k + 1, rel_t=rel_t, n_prompt=3 + 2 * k,
                         reasoning_seg=reason, template=np.full(owner.size, -1, dtype=np.int64))


_KIND_BUILDERS = (("templated", _templated), ("chat", _chat), ("agent", _agent))


def plan(config: SyntheticConfig) -> Plan:
    """Draw sessions and requests (no blocks yet); deterministic given the config (its seed included)."""
    rng = np.random.default_rng(config.seed)
    starts, sess_phase = poisson_arrivals(rng, [p.duration for p in config.phases], [p.rate for p in config.phases])
    weights = np.array([[p.mix.get(k, 0.0) for k in KINDS] for p in config.phases])
    sess_kind = np.zeros(starts.size, dtype=np.int8)
    for i in range(len(config.phases)):
        sel = np.flatnonzero(sess_phase == i)
        if sel.size:
            sess_kind[sel] = rng.choice(len(KINDS), size=sel.size, p=weights[i] / weights[i].sum())

    table = _SegmentTable()
    parts: list[tuple[int, _KindRequests, np.ndarray]] = []
    for kind_idx, (name, builder) in enumerate(_KIND_BUILDERS):
        ids = np.flatnonzero(sess_kind == kind_idx)
        parts.append((kind_idx, builder(rng, getattr(config, name), table, ids.size), ids))
    seg_len, seg_type = table.arrays()

    stream = np.concatenate([p.stream for _, p, _ in parts])
    stream_base = np.cumsum([0] + [p.stream.size for _, p, _ in parts])
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("session", "turn", "t", "n_prompt", "reason", "template",
                                                         "kind", "start")}
    for (kind_idx, p, ids), base in zip(parts, stream_base[:-1], strict=True):
        sid = ids[p.session]
        cols["session"].append(sid)
        cols["turn"].append(p.turn)
        cols["t"].append(starts[sid] + p.rel_t)
        cols["n_prompt"].append(p.n_prompt)
        cols["reason"].append(p.reasoning_seg)
        cols["template"].append(p.template)
        cols["kind"].append(np.full(sid.size, kind_idx, dtype=np.int8))
        cols["start"].append(base + p.stream_off[p.session])
    c = {k: np.concatenate(v) for k, v in cols.items()}
    keep = np.ones(c["t"].size, dtype=bool)
    if not config.drain:
        keep = c["t"] < sum(p.duration for p in config.phases)
    order = np.lexsort((c["turn"], c["session"], c["t"]))
    order = order[keep[order]]
    c = {k: v[order] for k, v in c.items()}

    # Request i's segments: stream[start : start + n_prompt], then its reasoning segment if any, then the response.
    has_r = c["reason"] >= 0
    n_segs = c["n_prompt"] + 1 + has_r
    owner, pos = _ranks(n_segs)
    n_prompt = c["n_prompt"][owner]
    segs = stream[c["start"][owner] + np.minimum(pos, n_prompt)]
    is_r = has_r[owner] & (pos == n_prompt)
    segs[is_r] = c["reason"][owner[is_r]]
    return Plan(block_size=config.block_size, seed=config.seed, seg_len=seg_len, seg_type=seg_type, t=c["t"],
                session=c["session"],
                turn=c["turn"].astype(np.int32), kind=c["kind"], phase=sess_phase[c["session"]], reasoning=has_r,
                template=c["template"], segs=segs, seg_offsets=csr_offsets(n_segs), n_prompt_segs=c["n_prompt"],
                session_start=starts, session_kind=sess_kind, session_phase=sess_phase)


# ----------------------------------------------------------------------------------------------------------------
# Blocks


def _blocks(p: Plan) -> dict[str, np.ndarray]:
    """Cut every request's sequence into full blocks: content ids, dominant types, chained keys (vectorised)."""
    bs = p.block_size
    flen = p.seg_len[p.segs]
    fend = np.cumsum(flen)  # global token coordinate: every request's sequence laid end to end
    fstart = fend - flen
    r_first = p.seg_offsets[:-1]
    seq_tokens = np.add.reduceat(flen, r_first) if len(p) else np.zeros(0, dtype=np.int64)
    prompt_seg_end = r_first + p.n_prompt_segs  # first output segment
    prompt_tokens = fstart[prompt_seg_end] - fstart[r_first] if len(p) else np.zeros(0, dtype=np.int64)
    output_tokens = seq_tokens - prompt_tokens
    n_blocks = seq_tokens // bs
    n_prompt_blocks = prompt_tokens // bs

    owner, b = _ranks(n_blocks)
    bstart = fstart[r_first][owner] + b * bs
    s0 = np.searchsorted(fstart, bstart, side="right") - 1
    n_seg = p.seg_len.size
    seg_uid = content_hash(np.stack([np.full(n_seg, p.seed, dtype=np.uint64),
                                     np.arange(1, n_seg + 1, dtype=np.uint64)], axis=1))
    uid = seg_uid[p.segs]
    content = np.empty(bstart.size, dtype=np.uint64)
    types = np.empty(bstart.size, dtype=np.int8)

    single = bstart + bs <= fend[s0]
    q = s0[single]
    content[single] = content_hash(np.stack([uid[q], (bstart[single] - fstart[q]).astype(np.uint64)], axis=1))
    types[single] = p.seg_type[p.segs[q]]

    # Blocks spanning k >= 2 segments: few; grouped by k so that each row's layout depends on its content only.
    multi = np.flatnonzero(~single)
    if multi.size:
        m0 = s0[multi]
        m1 = np.searchsorted(fstart, bstart[multi] + bs - 1, side="right") - 1
        k = m1 - m0 + 1
        counts = np.zeros((multi.size, len(TokenType)), dtype=np.int64)
        rows = np.arange(multi.size)
        lo, hi = bstart[multi], bstart[multi] + bs
        for j in range(int(k.max())):
            a = np.flatnonzero(k > j)
            s = m0[a] + j
            n_tok = np.minimum(fend[s], hi[a]) - np.maximum(fstart[s], lo[a])
            counts[rows[a], p.seg_type[p.segs[s]]] += n_tok
        types[multi] = counts.argmax(axis=1)
        for kk in np.unique(k):
            a = np.flatnonzero(k == kk)
            cols = [np.full(a.size, kk, dtype=np.uint64), uid[m0[a]], (lo[a] - fstart[m0[a]]).astype(np.uint64)]
            cols += [uid[m0[a] + j] for j in range(1, int(kk))]
            cols.append((hi[a] - fstart[m1[a]]).astype(np.uint64))
            content[multi[a]] = content_hash(np.stack(cols, axis=1))

    seq_off = csr_offsets(n_blocks)
    pk, po, ok, oo = chain_requests(content, seq_off, n_prompt_blocks)
    is_prompt = b < n_prompt_blocks[owner]
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "prompt_keys": pk, "prompt_offsets": po,
            "prompt_types": types[is_prompt], "output_keys": ok, "output_offsets": oo,
            "output_types": types[~is_prompt]}


def trace_from_plan(p: Plan, meta: dict[str, Any] | None = None) -> Trace:
    """Cut a plan's sequences into blocks and build the Trace."""
    cols = _blocks(p)
    return Trace(t=p.t, session=p.session, turn=p.turn, app=_APP_OF_KIND[p.kind], block_size=p.block_size,
                 meta=meta, **cols)


def _meta(config: SyntheticConfig, p: Plan, preset: str | None) -> dict[str, Any]:
    win = _phase_windows([ph.duration for ph in config.phases])
    phases = [{"start": float(win[i]), "end": float(win[i + 1]), "name": ph.name or f"phase{i}",
               "mix": {k: ph.mix.get(k, 0.0) for k in KINDS}, "rate": ph.rate}
              for i, ph in enumerate(config.phases)]
    sessions = {k: int((p.session_kind == i).sum()) for i, k in enumerate(KINDS)}
    return {"source": "synthetic", "preset": preset, "seed": config.seed, "config": config.to_dict(),
            "phases": phases, "kinds": list(KINDS), "sessions_per_kind": sessions}


def generate(config: SyntheticConfig | None = None, preset: str | None = None) -> Trace:
    """Generate the trace of a config (default: the defaults); same config and seed -> an identical trace."""
    config = config if config is not None else make_config(preset)
    p = plan(config)
    return trace_from_plan(p, _meta(config, p, preset))


# ----------------------------------------------------------------------------------------------------------------
# Source entry point

_OPTIONS = {f.name for f in fields(SyntheticConfig)} | {"preset", "on_error"}


def load(path: str | os.PathLike | None = None, **options: Any) -> tuple[Trace, LoadReport]:
    """Generate a synthetic trace. ``path``: None, or a YAML / JSON file of the same options as ``options``.

    Options: ``preset`` (one of :data:`PRESETS`), the :class:`SyntheticConfig` fields (nested mappings are merged into
    the preset's / file's, lists replace), ``on_error`` (accepted for the common source interface; a generator reads no
    data rows, and a bad config always raises ValueError).
    """
    check_options("synthetic", options, _OPTIONS)
    on_error = options.pop("on_error", "raise")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"source 'synthetic': on_error must be 'raise' or 'skip', got {on_error!r}")
    data: dict[str, Any] = {}
    where = "synthetic options"
    if path is not None:
        data = read_config_file(path)
        where = f"{path}"
        check_options(f"synthetic (config file {path})", data, _OPTIONS - {"on_error"})
    preset = options.pop("preset", data.pop("preset", None))
    if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
        raise ValueError(f"{where}: unknown synthetic preset {preset!r}; valid presets: {sorted(PRESETS)}")
    merged = _merge(_merge(PRESETS[preset] if preset else {}, data), options)
    config = SyntheticConfig.from_dict(merged, where=where)
    p = plan(config)
    trace = trace_from_plan(p, _meta(config, p, preset))
    report = LoadReport(source="synthetic", path=str(path) if path is not None else f"<preset {preset or 'default'}>",
                        rows_read=len(trace))
    report.notes += [
        f"generated {p.session_start.size} sessions ({trace.meta['sessions_per_kind']}) and {len(trace)} requests "
        f"from seed {config.seed}, block_size {config.block_size}, {len(config.phases)} phase(s)",
        "session starts: Poisson per phase; kind by the phase's mix; sessions run on past their phase's end"
        + ("" if config.drain else "; requests after the last phase's end dropped (drain=false)"),
        "token content is synthetic: segments with content uids; blocks hash the exact segment content they cover",
        f"chat gaps log-normal(mu={config.chat.gap_mu}, sigma={config.chat.gap_sigma}); agent gaps log-normal("
        f"mu={config.agent.gap_mu}, sigma={config.agent.gap_sigma}); from the previous turn's arrival",
        "reasoning is an output segment dropped from the next turn's history (its blocks are never reused)",
    ]
    return trace, report
