"""The synthetic generator's configuration: session kinds, their lengths and gaps, the phase schedule, presets.

Every value is checked when a config is built (:meth:`SyntheticConfig.from_dict`, :func:`make_config`), and an error
names the offending key. What the values mean is the generator's docstring (:mod:`sae_env.sources.synthetic`); the
mixer (:mod:`sae_env.sources.mix`) reads its config files and checks its numbers with the same helpers.
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
from sae_env.trace import TraceFormatError

__all__ = ["KINDS", "OPTIONS", "PRESETS", "AgentConfig", "ChatConfig", "Count", "Length", "Phase", "SyntheticConfig",
           "TemplatedConfig", "config_from_options", "integer", "make_config", "merge", "number", "read_config_file"]

KINDS = ("templated", "chat", "agent")
_MAX_EXPECTED_SESSIONS = 5_000_000  # guard against a schedule that would exhaust memory deep inside numpy


def number(value: Any, name: str) -> float:
    """``value`` as a finite float; ValueError naming ``name`` otherwise (a bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an integer past float range (1e308)
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {str(value)[:40]}")
    return x


def integer(value: Any, name: str) -> int:
    """``value`` as a 64-bit int (``4.0`` is fine, ``4.5`` is not); ValueError naming ``name`` otherwise."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        v = int(value)  # exact: a float would round integers past 2**53
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"{name} must fit in 64 bits, got {str(value)[:40]}")
        return v
    v = number(value, name)
    if v != int(v):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return integer(int(v), name)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _coerce_ints(obj: Any, *names: str) -> None:
    """Store integer-valued fields as int (a YAML ``4.0`` is fine, ``4.5`` is not) on a frozen dataclass."""
    for name in names:
        object.__setattr__(obj, name, integer(getattr(obj, name), name))


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
        object.__setattr__(self, "mean", number(self.mean, "mean"))
        object.__setattr__(self, "sigma", number(self.sigma, "sigma"))
        object.__setattr__(self, "min", integer(self.min, "min"))
        object.__setattr__(self, "max", integer(self.max, "max"))
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
        object.__setattr__(self, "mean", number(self.mean, "mean"))
        object.__setattr__(self, "sigma", number(self.sigma, "sigma"))
        object.__setattr__(self, "max", integer(self.max, "max"))
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
        _require(0 <= number(self.zipf_s, "zipf_s") <= 10, f"zipf_s must lie in [0, 10], got {self.zipf_s}")


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
        _prob(number(self.reasoning_prob, "reasoning_prob"), "reasoning_prob")
        _gap(number(self.gap_mu, "gap_mu"), number(self.gap_sigma, "gap_sigma"))


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
        _prob(number(self.user_prob, "user_prob"), "user_prob")
        _prob(number(self.reasoning_prob, "reasoning_prob"), "reasoning_prob")
        _gap(number(self.gap_mu, "gap_mu"), number(self.gap_sigma, "gap_sigma"))


def _check_mix(mix: Any, valid: Sequence[str] | None, what: str) -> dict[str, float]:
    if not isinstance(mix, Mapping):
        raise ValueError(f"{what} must be a mapping of name -> weight, got {mix!r}")
    out = {}
    for k, v in mix.items():
        if valid is not None and k not in valid:
            raise ValueError(f"{what} has unknown key '{k}'; valid keys: {list(valid)}")
        w = number(v, f"{what}[{k!r}]")
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
        _require(number(self.duration, "duration") > 0, f"duration must be > 0 s, got {self.duration}")
        _require(number(self.rate, "rate") >= 0, f"rate must be >= 0 sessions/s, got {self.rate}")
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


def merge(base: Any, over: Any) -> Any:
    """Deep-merge mappings (``over`` wins); lists and scalars are replaced whole."""
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
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
    data = merge(PRESETS[preset] if preset else {}, overrides)
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


OPTIONS = {f.name for f in fields(SyntheticConfig)} | {"preset", "on_error"}  # what the source's load takes


def config_from_options(path: str | os.PathLike | None, options: dict[str, Any]) -> tuple[SyntheticConfig, str | None]:
    """The config and preset name the synthetic source's options stand for: a preset, overridden by a config file
    (``path``), overridden by the options (see :func:`sae_env.sources.synthetic.load`)."""
    options = dict(options)
    check_options("synthetic", options, OPTIONS)
    on_error = options.pop("on_error", "raise")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"source 'synthetic': on_error must be 'raise' or 'skip', got {on_error!r}")
    data: dict[str, Any] = {}
    where = "synthetic options"
    if path is not None:
        data = read_config_file(path)
        where = f"{path}"
        check_options(f"synthetic (config file {path})", data, OPTIONS - {"on_error"})
    preset = options.pop("preset", data.pop("preset", None))
    if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
        raise ValueError(f"{where}: unknown synthetic preset {preset!r}; valid presets: {sorted(PRESETS)}")
    merged = merge(merge(PRESETS[preset] if preset else {}, data), options)
    config = SyntheticConfig.from_dict(merged, where=where)
    return config, preset
