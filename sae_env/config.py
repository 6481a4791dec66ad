"""The experiment config: what an experiment runs, checked key by key before any cell runs.

A config names workloads, cache capacities, serving loads, agents and seeds; every combination is a **cell**
(workload x capacity x load x agent x seed), one episode of one agent on one trace. Schema (``configs/*.yaml``)::

    name: quickstart                 # the experiment (folder name under ``output``, W&B group)
    description: one line            # optional
    workloads:                       # name + trace spec (sae_env.sources.trace_from_spec)
      - {name: taubench, trace: taubench}
      - {name: shift, trace: {source: synthetic, preset: shift}, reseed: true}
    capacities: [0.05, 0.15]         # fraction of the trace's distinct blocks, blocks (int), '15%' or KV bytes
    agents:                          # a shorthand (a policy name, or a preset of the runner, e.g. saecache-fixed)
      - lru                          #   or {name, policy, agent, options, policy_options}
      - {name: saecache-no-weights, policy: saecache, agent: sae_online, policy_options: {type_weights: false}}
      - {name: mine, policy: 'my_policies:MyPolicy'}   # an unregistered policy class, importable where cells run
    serving: {model: qwen2.5-1.5b@a40, loads: [0.8]}   # model 'instant' = hit rates only; loads: target utilisation
    window: 100                      # requests per window (or '30s'): metric granularity and learning period
    seeds: [0]
    reward: hit_rate                 # the env's reward (hit_rate, hit_tokens, neg_ttft)
    reference: saecache              # the report pairs this agent with each other one per seed (default: saecache)
    lru_curve: 40                    # also LRU's exact hit rates at 40 capacities from the smallest to the largest,
                                     #   from one pass per trace (instant serving; sae_env.mrc): lru_curve.json
    ray: {address: null, num_cpus: null, retries: 1, gpus_per_cell: 0}  # GPUs of a cell with a torch model
    wandb: {mode: offline, project: saecache-gym, entity: null, group: null, dir: null}  # unset: WANDB_* variables
    output: runs

Unknown keys raise :class:`ConfigError` naming the key and listing the valid ones. ``reseed`` (default: on for the
generated sources ``synthetic`` and ``mix``, and the embedded workloads built by them such as ``real_shift``, unless
the spec fixes ``seed``) sets the trace generator's seed to the cell's seed, so that seeds vary the workload and not
only the agent (for a real mix: its session start times, drawn from Azure's arrival process, and which component
each start takes; the sessions themselves stay as recorded). ``reseed: true`` also reseeds the recorded-session
sources that draw their arrival times and turn gaps (``conversations`` such as ``wildchat``, ``taubench``, ``gsm8k``):
the sessions stay as recorded, their timing changes.

:func:`load_config` reads one (a file, a shipped config by name through the command line, or a mapping) with
``--set`` overrides; :mod:`sae_env.experiment` expands it into cells and runs them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sae_env.files import apply_overrides, read_mapping, resolve_paths
from sae_env.inputs import brief
from sae_env.trace import Trace
from sae_env.tracking import WANDB_MODES

__all__ = ["GENERATED_SOURCES", "TIMED_SOURCES", "AgentSpec", "CellRunner", "ConfigError", "ExperimentConfig",
           "RayConfig", "ServingConfig", "WandbConfig", "WorkloadSpec", "check_name", "is_ppo_config", "load_config"]

GENERATED_SOURCES = frozenset({"synthetic", "mix"})  # sources whose trace comes from a seed
# Recorded sessions whose arrival times and turn gaps the source draws from a seed (the data have none): reseeded only
# when a workload says ``reseed: true`` (as shipped, an embedded trace keeps its seed-0 times).
TIMED_SOURCES = frozenset({"conversations", "taubench", "gsm8k"})
_MAX_CPUS = 65536  # of a local Ray cluster: more is a typo, and Ray would fail deep inside


class ConfigError(ValueError):
    """A bad experiment config: the message names the key (``agents[2].policy``) and what is valid."""


class CellRunner(Protocol):
    """Runs one cell (an episode of one agent on one trace). Picklable: Ray ships it to the workers.

    ``kinds``: valid ``agent`` values of an agent spec; ``presets``: agent shorthands (``{"saecache-fixed":
    {"policy": "saecache", "agent": "fixed"}}``); a bare policy name means that policy under the ``baseline`` kind,
    unless a preset of that name exists. ``__call__`` returns a JSON-able dict with at least ``summary`` (the keys
    of :func:`sae_env.metrics.summarize`), ``history`` (one dict per window with ``t_start``, ``t_end``,
    ``token_hit_rate``, ``params`` ...) and ``timing`` (wall-clock seconds; excluded from comparisons).

    Optionally ``uses_model(task) -> bool``: whether the cell runs a torch model (a learned agent, the session
    predictor), so that ``ray.gpus_per_cell`` gives it a GPU share; such a task then carries ``device: cuda``.
    """

    kinds: Sequence[str]
    presets: Mapping[str, Mapping[str, Any]]

    def __call__(self, cell: Mapping[str, Any], trace: Trace) -> dict[str, Any]: ...


# ----------------------------------------------------------------------------------------------------------------
# The config: typed, validated, with errors that name the key


def _check_keys(data: Any, valid: Sequence[str], where: str, required: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} ({data!r})")
    unknown = sorted(set(map(str, data)) - set(valid))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(valid)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    return dict(data)


def _as_list(value: Any, where: str) -> list[Any]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ConfigError(f"{where}: must not be empty")
    return items


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def check_name(value: Any, where: str) -> str:
    """``value`` if it is a plain name (it names folders and W&B runs), else a ConfigError at ``where``."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(f"{where}: {value!r} is not a valid name (letters, digits, '_', '.', '+', '-'; it names "
                          "folders and W&B runs)")
    return value


@dataclass(frozen=True)
class WorkloadSpec:
    """A named trace: ``trace`` is a spec for :func:`sae_env.sources.trace_from_spec`."""

    name: str
    trace: str | dict[str, Any]
    reseed: bool  # the cell's seed becomes the source's seed

    @classmethod
    def from_config(cls, data: Any, where: str) -> WorkloadSpec:
        if isinstance(data, str):
            data = {"name": data, "trace": data}
        d = _check_keys(data, ("name", "trace", "reseed"), where, required=("trace",))
        trace = d["trace"]
        if isinstance(trace, Mapping):
            trace = dict(trace)
            if not any(k in trace for k in ("trace", "path", "source")):
                raise ConfigError(f"{where}.trace: a mapping needs 'source' (e.g. synthetic), 'trace' (an embedded "
                                  "name or file) or 'path'")
        elif not isinstance(trace, str):
            raise ConfigError(f"{where}.trace: expected a name, a path or a mapping, got {trace!r}")
        name = d.get("name", trace if isinstance(trace, str) else trace.get("trace") or trace.get("source"))
        source = trace if isinstance(trace, str) else trace.get("source") or trace.get("trace")
        for key in ("source", "trace", "path"):
            if isinstance(trace, dict) and key in trace and not isinstance(trace[key], str):
                raise ConfigError(f"{where}.trace.{key}: expected a name or a path, got {brief(trace[key])}")
        source = _embedded_source(source)
        generated = source in GENERATED_SOURCES and not (isinstance(trace, dict) and "seed" in trace)
        reseed = d.get("reseed", generated)
        if not isinstance(reseed, bool):
            raise ConfigError(f"{where}.reseed: expected true or false, got {reseed!r}")
        if reseed and source not in GENERATED_SOURCES | TIMED_SOURCES:
            raise ConfigError(f"{where}.reseed: only sources that draw from a seed "
                              f"({', '.join(sorted(GENERATED_SOURCES | TIMED_SOURCES))}) take one; {source!r} is data")
        return cls(check_name(name, f"{where}.name"), trace, reseed)

    def spec_for(self, seed: int) -> str | dict[str, Any]:
        """The trace spec of this workload under ``seed``."""
        if not self.reseed:
            return self.trace
        if isinstance(self.trace, str):  # a generated source's name, or an embedded workload of one (real_shift)
            spec = {"source": self.trace} if self.trace in GENERATED_SOURCES else {"trace": self.trace}
        else:
            spec = dict(self.trace)
        return {**spec, "seed": int(seed)}


def _embedded_source(name: Any) -> Any:
    """The source of an embedded trace's name (``real_shift`` -> ``mix``); anything else as it is."""
    from sae_env import data

    return data.ALL[name][1] if isinstance(name, str) and name in data.ALL else name


@dataclass(frozen=True)
class AgentSpec:
    """An agent of the experiment: ``agent`` (a kind of the cell runner) driving ``policy``."""

    name: str
    policy: str
    agent: str
    options: dict[str, Any] = field(default_factory=dict)  # the agent's constructor options
    policy_options: dict[str, Any] = field(default_factory=dict)  # the policy's (switches, predictor, ...)

    @classmethod
    def from_config(cls, data: Any, where: str, runner: CellRunner | None) -> AgentSpec:
        from sae_env.policies import policy_class, policy_names

        presets = dict(runner.presets) if runner is not None else {}
        if isinstance(data, str):
            if data in presets:
                data = {"name": data, **presets[data]}
            elif data in policy_names():
                data = {"name": data, "policy": data}
            else:
                raise ConfigError(f"{where}: unknown agent {data!r}; shorthands: "
                                  f"{', '.join(sorted(set(presets) | set(policy_names())))}")
        d = _check_keys(data, ("name", "policy", "agent", "options", "policy_options"), where, required=("policy",))
        policy = d["policy"]
        try:  # a registered name, or a policy class of one's own (module:Class), importable wherever the cells run
            policy_class(policy)
        except ValueError as e:
            raise ConfigError(f"{where}.policy: {e}") from None
        agent = d.get("agent", "baseline")
        if runner is not None and agent not in runner.kinds and ":" not in str(agent):
            raise ConfigError(f"{where}.agent: unknown agent kind {agent!r}; valid: {', '.join(runner.kinds)} "
                              "(or 'module:Class')")
        for key in ("options", "policy_options"):
            if not isinstance(d.get(key, {}), Mapping):
                raise ConfigError(f"{where}.{key}: expected a mapping, got {d[key]!r}")
        spec = cls(check_name(d.get("name", policy.rsplit(":", 1)[-1]), f"{where}.name"), policy, str(agent),
                   dict(d.get("options", {})), dict(d.get("policy_options", {})))
        spec.check(where, runner)
        return spec

    def check(self, where: str, runner: CellRunner | None, files: bool = False) -> None:
        """What would fail every cell of this agent: the policy built with its options, and the agent checked by
        the runner (a ``module:Class`` agent must be an agent class taking the options; nothing of it is called).
        ``files`` (just before the cells run, not when a config is read: a config may name a predictor or a params
        file still to be made): the files the options name exist, and a registered agent is built once."""
        from sae_env.policies import make_policy

        options = dict(self.policy_options)
        predictor = options.get("predictor")
        if isinstance(predictor, str):  # a checkpoint path, loaded by the runner in each cell
            if files and not Path(predictor).is_file():
                raise ConfigError(f"{where}.policy_options.predictor: no such file {predictor}")
            options["predictor"] = None
        try:
            make_policy(self.policy, **options)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}.policy_options: {e}") from None
        check = getattr(runner, "check_agent", None)
        if check is not None:
            try:
                check(asdict(self), build=files)
            except (ValueError, OSError) as e:
                raise ConfigError(f"{where}.agent: {e}") from None


@dataclass(frozen=True)
class ServingConfig:
    model: str = "instant"  # 'instant' or a serving preset (sae_env.serving)
    loads: tuple[float | None, ...] = (None,)  # target utilisations of the prefill server (None: the trace's times)

    @classmethod
    def from_config(cls, data: Any, where: str = "serving") -> ServingConfig:
        from sae_env.serving import make_server

        if isinstance(data, str):
            data = {"model": data}
        d = _check_keys(data, ("model", "loads"), where)
        model = d.get("model", "instant")
        try:
            timed = make_server(model).timed
        except ValueError as e:
            raise ConfigError(f"{where}.model: {e}") from None
        loads = tuple(_as_list(d.get("loads", [None]), f"{where}.loads"))
        for u in loads:
            if u is None:
                continue
            if isinstance(u, bool) or not isinstance(u, (int, float)) or not (0 < u < 10 and math.isfinite(u)):
                raise ConfigError(f"{where}.loads: {u!r} is not a utilisation (a number in (0, 10), e.g. 0.8)")
            if not timed:
                raise ConfigError(f"{where}.loads: a load needs a timed model (e.g. qwen2.5-1.5b@a40), not "
                                  f"{model!r}")
        return cls(str(model), tuple(None if u is None else float(u) for u in loads))


@dataclass(frozen=True)
class RayConfig:
    enabled: bool = True  # False: run the cells serially in the driver (as --serial)
    address: str | None = None  # an existing cluster (theirs to configure); None: a private local one
    num_cpus: int | None = None  # CPUs of the local cluster (None: all)
    retries: int = 1  # extra attempts of a failed cell
    # GPUs requested by each cell that runs a torch model (a fraction shares a GPU), when there are GPUs: on a
    # machine or cluster without any, every cell runs on the CPU as with 0.
    gpus_per_cell: float = 0.0

    @classmethod
    def from_config(cls, data: Any, where: str = "ray") -> RayConfig:
        d = _check_keys(data or {}, ("enabled", "address", "num_cpus", "retries", "gpus_per_cell"), where)
        out = cls(**d)
        g = out.gpus_per_cell
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 <= g <= 1 or float(g).is_integer()
                                                                          and 1 <= g <= 64):
            raise ConfigError(f"{where}.gpus_per_cell: expected a GPU fraction in [0, 1] or a whole number of GPUs "
                              f"(Ray's rule), got {g!r}")
        if not isinstance(out.enabled, bool):
            raise ConfigError(f"{where}.enabled: expected true or false, got {out.enabled!r}")
        if out.address is not None and not (isinstance(out.address, str) and out.address):
            raise ConfigError(f"{where}.address: expected a string such as 'ray://host:10001', got {out.address!r}")
        if out.num_cpus is not None and (isinstance(out.num_cpus, bool) or not isinstance(out.num_cpus, int)
                                         or not 1 <= out.num_cpus <= _MAX_CPUS):
            raise ConfigError(f"{where}.num_cpus: expected an integer >= 1 (at most {_MAX_CPUS}) or null, got "
                              f"{brief(out.num_cpus)}")
        if isinstance(out.retries, bool) or not isinstance(out.retries, int) or not 0 <= out.retries <= 10:
            raise ConfigError(f"{where}.retries: expected an integer in [0, 10], got {out.retries!r}")
        return out


@dataclass(frozen=True)
class WandbConfig:
    """W&B settings; a key left out (None) falls back to W&B's variable (``WANDB_MODE``, ``WANDB_PROJECT``,
    ``WANDB_ENTITY``, ``WANDB_DIR``), then to the default (:func:`sae_env.tracking.resolve_target`)."""

    mode: str | None = None  # offline (the default; `wandb sync` later), online, or disabled
    project: str | None = None  # default: saecache-gym
    entity: str | None = None
    group: str | None = None  # default: the experiment's name
    dir: str | None = None  # runs go under <dir>/wandb; default: the run folder

    @classmethod
    def from_config(cls, data: Any, where: str = "wandb") -> WandbConfig:
        d = _check_keys(data or {}, ("mode", "project", "entity", "group", "dir"), where)
        out = cls(**d)
        if out.mode is not None and out.mode not in WANDB_MODES:
            raise ConfigError(f"{where}.mode: {out.mode!r} is not one of {', '.join(WANDB_MODES)}")
        for key in ("project", "entity", "group", "dir"):
            v = getattr(out, key)
            if v is not None and not (isinstance(v, str) and v):
                raise ConfigError(f"{where}.{key}: expected a non-empty string, got {v!r}")
        return out


_TOP_KEYS = ("name", "description", "workloads", "capacities", "agents", "serving", "window", "seeds", "reward",
             "ray", "wandb", "output", "reference", "lru_curve")


@dataclass(frozen=True)
class ExperimentConfig:
    """A validated experiment config (see the module docstring for the YAML schema)."""

    name: str
    workloads: tuple[WorkloadSpec, ...]
    capacities: tuple[float | int | str, ...]
    agents: tuple[AgentSpec, ...]
    serving: ServingConfig = ServingConfig()
    window: int | str = 100
    seeds: tuple[int, ...] = (0,)
    reward: str = "hit_rate"
    ray: RayConfig = RayConfig()
    wandb: WandbConfig = WandbConfig()
    output: str = "runs"
    description: str = ""
    reference: str | None = None  # the report's paired comparisons are against it (None: saecache if present)
    lru_curve: int | None = None  # capacities of LRU's one-pass miss-ratio curve (None: no curve)

    @classmethod
    def from_dict(cls, data: Any, runner: CellRunner | None = None, where: str = "config") -> ExperimentConfig:
        from sae_env.env import REWARDS

        d = _check_keys(data, _TOP_KEYS, where, required=("name", "workloads", "capacities", "agents"))
        workloads = tuple(WorkloadSpec.from_config(w, f"workloads[{i}]")
                          for i, w in enumerate(_as_list(d["workloads"], "workloads")))
        agents = tuple(AgentSpec.from_config(a, f"agents[{i}]", runner)
                       for i, a in enumerate(_as_list(d["agents"], "agents")))
        for label, items in (("workloads", workloads), ("agents", agents)):
            names = [x.name for x in items]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ConfigError(f"{label}: duplicate name(s) {dup}; give each entry its own 'name'")
        capacities = tuple(_as_list(d["capacities"], "capacities"))
        for c in capacities:
            _check_capacity(c)
        seeds = tuple(_as_list(d.get("seeds", [0]), "seeds"))
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63:
                raise ConfigError(f"seeds: {brief(s)} is not an integer >= 0 (and below 2**63)")
        if len(set(seeds)) != len(seeds):
            raise ConfigError(f"seeds: duplicates in {list(seeds)}")
        window = d.get("window", 100)
        try:
            from sae_env.env import parse_window

            parse_window(window)
        except ValueError as e:
            raise ConfigError(f"window: {e}") from None
        reward = d.get("reward", "hit_rate")
        if reward not in REWARDS:
            raise ConfigError(f"reward: {reward!r} is not one of {', '.join(REWARDS)}")
        serving = ServingConfig.from_config(d.get("serving", "instant"))
        if reward == "neg_ttft" and serving.model == "instant":
            raise ConfigError("reward: 'neg_ttft' needs a timed serving model, not 'instant'")
        description = d.get("description", "")
        output = d.get("output", "runs")
        if not isinstance(output, str) or not output:
            raise ConfigError(f"output: expected a folder, got {output!r}")
        reference = d.get("reference")
        if reference is not None and reference not in [a.name for a in agents]:
            raise ConfigError(f"reference: {reference!r} is not one of the agents "
                              f"({', '.join(a.name for a in agents)})")
        lru_curve = d.get("lru_curve")
        if lru_curve is not None:
            from sae_env.mrc import MAX_POINTS

            if isinstance(lru_curve, bool) or not isinstance(lru_curve, int) or not 2 <= lru_curve <= MAX_POINTS:
                raise ConfigError(f"lru_curve: the number of capacities must be a whole number in [2, "
                                  f"{MAX_POINTS:,}], got {brief(lru_curve)}")
            if serving.model != "instant":
                raise ConfigError(f"lru_curve: LRU's one-pass curve is exact in instant serving only, not with "
                                  f"serving model {serving.model!r} (leave lru_curve out)")
        return cls(name=check_name(d["name"], "name"), workloads=workloads, capacities=capacities, agents=agents,
                   serving=serving, window=window, seeds=seeds, reward=reward,
                   ray=RayConfig.from_config(d.get("ray")), wandb=WandbConfig.from_config(d.get("wandb")),
                   output=output, description=str(description or ""), reference=reference, lru_curve=lru_curve)

    def to_dict(self) -> dict[str, Any]:
        d = json.loads(json.dumps(asdict(self)))
        if d["lru_curve"] is None:  # left out: configs without a curve keep their results key (and run folders)
            del d["lru_curve"]
        return d

    def results_key(self) -> str:
        """A short hash of everything that decides the cells' results (not where or how they run)."""
        d = self.to_dict()
        for k in ("ray", "wandb", "output", "description", "reference", "lru_curve"):
            d.pop(k, None)
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def _check_capacity(c: Any) -> None:
    """The form of a capacity (whether it fits a trace is checked once the traces are built)."""
    from sae_env.cache import resolve_capacity

    try:
        # Stand-in sizes: any fraction, percentage or byte size parses against them; the real ones come later.
        resolve_capacity(c, distinct_blocks=2**62, kv_bytes_per_token=1, block_size=1)
    except ValueError as e:
        raise ConfigError(f"capacities: {brief(c)} is not a capacity (blocks as an integer, a fraction of the "
                          f"distinct blocks such as 0.15, '15%', or KV bytes such as '2GiB'): {e}") from None


def is_ppo_config(data: Mapping[str, Any]) -> bool:
    """A PPO training config (``train.py ppo --config``), not an experiment: it has ``ppo`` and no workloads."""
    return "ppo" in data and "workloads" not in data


def load_config(source: str | os.PathLike | Mapping[str, Any], runner: CellRunner | None = None,
                overrides: Mapping[str, Any] | None = None, where: str | None = None,
                base: str | os.PathLike | None = None) -> ExperimentConfig:
    """An :class:`ExperimentConfig` from a YAML file or a mapping (read from ``where``, for messages).

    Relative paths of input files in the config (traces, parameter files, checkpoints:
    :data:`sae_env.files.PATH_KEYS`) are taken against the config file's folder (``base`` for a mapping read from a
    file) when they name something there; ``output`` and ``wandb.dir`` stay relative to the working folder.
    ``overrides`` then set keys, dotted for nested ones (``{"serving.model": "instant", "seeds": [0, 1]}``, as
    ``--set``).
    """
    if isinstance(source, Mapping):
        data, where = dict(source), where or "config"
    else:
        try:
            data, where = read_mapping(source, "config")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        base = Path(source).parent
    if is_ppo_config(data):
        raise ConfigError(f"{where} is a PPO training config: run it with `python train.py ppo --config {where}`")
    data = resolve_paths(data, base)
    if isinstance(data.get("serving"), str):  # the shorthand, spelled out so that --set serving.model=... applies
        data["serving"] = {"model": data["serving"]}
    try:
        data = apply_overrides(data, overrides or {})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return ExperimentConfig.from_dict(data, runner, where)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None
