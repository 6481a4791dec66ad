"""Experiments: a YAML config expanded into cells, run on Ray (or serially), written as they finish, resumable.

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
    serving: {model: qwen2.5-1.5b@a40, loads: [0.8]}   # model 'instant' = hit rates only; loads: target utilisation
    window: 100                      # requests per window (or '30s'): metric granularity and learning period
    seeds: [0]
    reward: hit_rate                 # the env's reward (hit_rate, hit_tokens, neg_ttft)
    reference: saecache              # the report pairs this agent with each other one per seed (default: saecache)
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

Running (:func:`run_experiment`): traces are built once per (workload, seed) in the driver and put once into Ray's
object store; cells run as Ray tasks (one CPU each) on a private local cluster (:mod:`sae_env.ray_local`: nothing
leaves the machine) or on the cluster at ``ray.address``; ``serial=True`` runs them in this process. A finished cell
is written at once (``cells/<cell-id>.json``, atomic rename), so rerunning the same config resumes: the run folder
is ``<output>/<name>/<run-id>`` with the run id a hash of everything that decides the results (or a plain name given
as ``run_id``). One process at a time holds a run folder (:func:`run_lock`). On resuming, a damaged cell file is
named, moved to ``<run-dir>/aside/`` and computed again, and every finished cell whose W&B run is missing or
incomplete is logged again (:meth:`sae_env.tracking.Tracker.resume`). Every field of the config is checked before
any cell runs, capacities against each workload's trace once the traces are built. A cell whose task
(trace spec, agent spec, capacity, load, seed, serving, window, reward) is identical in another run folder of the
same experiment is copied from there, so adding an agent or a capacity to a config runs only the new cells. A cell
that raises is retried ``ray.retries`` times, then reported (``failures.json``, report.md) while the others finish.

What runs a cell is the **cell runner** handed in by the caller (:class:`CellRunner`; the ``agents`` package's
``agents.evaluate.CellRunner``): this module never imports ``agents``. Cell results are deterministic (same config
and seed, same numbers, serial or Ray); wall-clock values live under ``timing`` only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from sae_env.files import apply_overrides, read_mapping, resolve_paths, set_aside, write_json, write_text
from sae_env.trace import Trace
from sae_env.tracking import WANDB_MODES

__all__ = ["AgentSpec", "Cell", "CellRunner", "ConfigError", "ExperimentConfig", "ExperimentRun", "RayConfig",
           "ServingConfig", "WandbConfig", "WorkloadSpec", "cell_uses_gpu", "expand", "is_ppo_config", "load_config",
           "load_results", "remote_options", "run_experiment"]

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


def _name(value: Any, where: str) -> str:
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
                raise ConfigError(f"{where}.trace.{key}: expected a name or a path, got {_short(trace[key])}")
        source = _embedded_source(source)
        generated = source in GENERATED_SOURCES and not (isinstance(trace, dict) and "seed" in trace)
        reseed = d.get("reseed", generated)
        if not isinstance(reseed, bool):
            raise ConfigError(f"{where}.reseed: expected true or false, got {reseed!r}")
        if reseed and source not in GENERATED_SOURCES | TIMED_SOURCES:
            raise ConfigError(f"{where}.reseed: only sources that draw from a seed "
                              f"({', '.join(sorted(GENERATED_SOURCES | TIMED_SOURCES))}) take one; {source!r} is data")
        return cls(_name(name, f"{where}.name"), trace, reseed)

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
        from sae_env.policies import policy_names

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
        if d["policy"] not in policy_names():
            raise ConfigError(f"{where}.policy: unknown policy {d['policy']!r}; valid policies: "
                              f"{', '.join(policy_names())}")
        agent = d.get("agent", "baseline")
        if runner is not None and agent not in runner.kinds and ":" not in str(agent):
            raise ConfigError(f"{where}.agent: unknown agent kind {agent!r}; valid: {', '.join(runner.kinds)} "
                              "(or 'module:Class')")
        for key in ("options", "policy_options"):
            if not isinstance(d.get(key, {}), Mapping):
                raise ConfigError(f"{where}.{key}: expected a mapping, got {d[key]!r}")
        spec = cls(_name(d.get("name", d["policy"]), f"{where}.name"), d["policy"], str(agent),
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
                              f"{_short(out.num_cpus)}")
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
             "ray", "wandb", "output", "reference")


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
                raise ConfigError(f"seeds: {_short(s)} is not an integer >= 0 (and below 2**63)")
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
        return cls(name=_name(d["name"], "name"), workloads=workloads, capacities=capacities, agents=agents,
                   serving=serving, window=window, seeds=seeds, reward=reward,
                   ray=RayConfig.from_config(d.get("ray")), wandb=WandbConfig.from_config(d.get("wandb")),
                   output=output, description=str(description or ""), reference=reference)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    def results_key(self) -> str:
        """A short hash of everything that decides the cells' results (not where or how they run)."""
        d = self.to_dict()
        for k in ("ray", "wandb", "output", "description", "reference"):
            d.pop(k)
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def _check_capacity(c: Any) -> None:
    """The form of a capacity (whether it fits a trace is checked once the traces are built)."""
    from sae_env.cache import resolve_capacity

    try:
        # Stand-in sizes: any fraction, percentage or byte size parses against them; the real ones come later.
        resolve_capacity(c, distinct_blocks=2**62, kv_bytes_per_token=1, block_size=1)
    except ValueError as e:
        raise ConfigError(f"capacities: {_short(c)} is not a capacity (blocks as an integer, a fraction of the "
                          f"distinct blocks such as 0.15, '15%', or KV bytes such as '2GiB'): {e}") from None


def _short(v: Any) -> str:
    """``repr`` cut short: a 400-digit number must not fill the error line."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


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


# ----------------------------------------------------------------------------------------------------------------
# Cells


@dataclass(frozen=True)
class Cell:
    """One episode: ``agent`` on ``workload`` (under ``seed``) with cache ``capacity`` at ``load``."""

    workload: str
    capacity: float | int | str
    load: float | None
    agent: str
    seed: int

    @property
    def id(self) -> str:
        load = "" if self.load is None else f"__load{self.load:g}"
        return _slug(f"{self.workload}__cap{self.capacity}{load}__{self.agent}__s{self.seed}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


def expand(config: ExperimentConfig) -> list[Cell]:
    """All cells, in a fixed order: workload, capacity, load, seed, agent (the agents of a group side by side)."""
    return [Cell(w.name, c, u, a.name, s) for w in config.workloads for c in config.capacities
            for u in config.serving.loads for s in config.seeds for a in config.agents]


def cell_task(config: ExperimentConfig, cell: Cell) -> dict[str, Any]:
    """What a cell runner receives: the cell plus everything needed to build its env and agent."""
    agent = next(a for a in config.agents if a.name == cell.agent)
    workload = next(w for w in config.workloads if w.name == cell.workload)
    return {"id": cell.id, "workload": cell.workload, "trace": workload.spec_for(cell.seed),
            "capacity": cell.capacity, "load": cell.load, "seed": cell.seed, "agent": asdict(agent),
            "serving": config.serving.model, "window": config.window, "reward": config.reward}


def cell_uses_gpu(config: ExperimentConfig, runner: CellRunner, task: Mapping[str, Any], gpus: float) -> bool:
    """Whether a cell gets ``ray.gpus_per_cell`` GPUs: it runs a torch model (the runner's ``uses_model``), the
    config asks for GPUs, and ``gpus`` (the cluster's, or this machine's for a serial run) is not zero."""
    uses_model = getattr(runner, "uses_model", None)
    return config.ray.gpus_per_cell > 0 and gpus > 0 and uses_model is not None and bool(uses_model(task))


def remote_options(config: ExperimentConfig, runner: CellRunner, task: Mapping[str, Any],
                   gpus: float) -> dict[str, Any]:
    """The Ray options of a cell's task: one CPU, the retries (a raising cell and a dead worker), and
    ``ray.gpus_per_cell`` GPUs for a cell with a torch model when the cluster has ``gpus`` > 0."""
    options: dict[str, Any] = {"num_cpus": 1, "max_retries": config.ray.retries, "retry_exceptions": True}
    if cell_uses_gpu(config, runner, task, gpus):
        options["num_gpus"] = config.ray.gpus_per_cell
    return options


def _on_device(config: ExperimentConfig, runner: CellRunner, task: dict[str, Any], gpus: float) -> dict[str, Any]:
    """The task, with ``device: cuda`` when the cell gets a GPU (serially or on Ray alike: same numbers)."""
    return {**task, "device": "cuda"} if cell_uses_gpu(config, runner, task, gpus) else task


def _local_gpus(config: ExperimentConfig) -> int:
    """CUDA devices of this machine, looked up only when the config asks for GPUs (it imports torch)."""
    if config.ray.gpus_per_cell <= 0:
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _reusable(config: ExperimentConfig, run_dir: Path, cells: list[Cell],
              log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Finished cells of this experiment's other run folders whose task is exactly this config's (same trace spec,
    agent spec, capacity, load, seed, serving, window, reward): adding an agent or a capacity to a config reruns
    only the new cells."""
    wanted = {c.id: json.loads(json.dumps(cell_task(config, c))) for c in cells}
    found: dict[str, dict[str, Any]] = {}
    for other in sorted(run_dir.parent.glob("*/cells")):
        if other.parent == run_dir:
            continue
        for cid, result in load_results(other.parent, log).items():
            if cid in wanted and cid not in found and result.get("cell") == wanted[cid]:
                found[cid] = result
    return found


# ----------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class ExperimentRun:
    """What :func:`run_experiment` did: the run folder, every cell's result (by cell id) and the failures."""

    config: ExperimentConfig
    run_dir: Path
    cells: list[Cell]
    results: dict[str, dict[str, Any]]
    failures: dict[str, dict[str, Any]]
    resumed: int  # cells found finished from an earlier invocation
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.failures


def run_dir_for(config: ExperimentConfig, run_id: str | None = None) -> Path:
    """``<output>/<name>/<run-id>``; a given ``run_id`` must be a plain name (no folders: it stays under
    ``output``, and the reuse scan reads only this experiment's folders)."""
    if run_id is not None:
        _name(run_id, "--run-id")
    return Path(config.output) / config.name / (run_id or config.results_key())


class RunFolderBusy(ConfigError):
    """Another process is running the same run folder."""


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run folder for this process: a second run of the same folder exits at once with a clear message
    (it would compute every cell again and log every W&B run twice). An OS lock (``flock``) on ``.lock``: it goes
    away with the process, however it ends, so a killed run never leaves a stale lock."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise RunFolderBusy(f"{run_dir} is in use by another run of this experiment (process {holder}); wait "
                                "for it to finish (rerunning then resumes), or give another --run-id") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_json(path: Path, obj: Any) -> str:
    """Result files: atomic, strict JSON (no NaN), compact."""
    return write_json(path, obj, indent=1, allow_nan=False)


def _finite(o: Any) -> Any:
    """Replace NaN / inf by None (JSON has neither; allow_nan=False would reject them)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def load_results(run_dir: str | os.PathLike, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """The finished cells of a run folder, by cell id.

    A cell file that is not a cell result (not UTF-8 JSON, not an object, no ``cell.id`` matching its name, no
    ``summary`` or ``history``: edited by hand, a disk error, a copy) is reported through ``log`` by name, moved
    aside to ``<run-dir>/aside/cells/`` and left out, so that the cell is computed again.
    """
    out = {}
    for p in sorted(Path(run_dir, "cells").glob("*.json")):
        try:
            data = _cell_file(p)
        except ValueError as e:
            moved = set_aside(Path(run_dir), p)
            if log is not None:
                log(f"warning: damaged cell file {p} ({e}); moved to {moved}; the cell will be computed again")
            continue
        out[data["cell"]["id"]] = data
    return out


def _cell_file(path: Path) -> dict[str, Any]:
    """The result in a cell file; ValueError saying what is wrong with it."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON, line {e.lineno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    cell = data.get("cell")
    if not isinstance(cell, dict) or cell.get("id") != path.stem:
        raise ValueError(f"'cell.id' must be the file's name {path.stem!r}")
    if not isinstance(data.get("summary"), dict) or not isinstance(data.get("history"), list):
        raise ValueError("missing 'summary' or 'history'")
    return data


def _run_one(runner: CellRunner, task: dict[str, Any], trace: Trace, worker: bool = False) -> dict[str, Any]:
    """A cell in a Ray worker or the driver: the runner's result with the cell description attached."""
    if worker:  # one thread per worker: cells run side by side, one per CPU (torch reads the variable at import)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
    result = runner(task, trace)
    return _finite({**result, "cell": task})


def _failure(cell: Cell, error: BaseException, attempts: int) -> dict[str, Any]:
    cause = getattr(error, "cause", None) or error  # a RayTaskError wraps the worker's exception
    return {"cell": cell.id, "attempts": attempts, "error": f"{type(cause).__name__}: {cause}",
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]}


def run_experiment(config: ExperimentConfig, runner: CellRunner, *, serial: bool | None = None,
                   ray_address: str | None = None, num_cpus: int | None = None, run_id: str | None = None,
                   wandb_mode: str | None = None, progress: bool = True, report: bool = True,
                   reuse: bool = True, log: Callable[[str], None] | None = None) -> ExperimentRun:
    """Run every unfinished cell of ``config`` and write the run folder; see the module docstring.

    ``serial`` / ``ray_address`` / ``num_cpus`` / ``wandb_mode`` override the config's ``ray`` and ``wandb``
    sections; ``run_id`` names the run folder (default: the config's results hash, so reruns resume); ``reuse``
    copies identical finished cells from the experiment's other run folders (off: every cell not in this folder is
    computed, e.g. after a code change).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    run_dir = run_dir_for(config, run_id)
    with run_lock(run_dir):
        return _run_locked(config, runner, run_dir, serial=serial, ray_address=ray_address, num_cpus=num_cpus,
                           wandb_mode=wandb_mode, progress=progress, report=report, reuse=reuse, log=log)


def _run_locked(config: ExperimentConfig, runner: CellRunner, run_dir: Path, *, serial: bool | None,
                ray_address: str | None, num_cpus: int | None, wandb_mode: str | None, progress: bool, report: bool,
                reuse: bool, log: Callable[[str], None]) -> ExperimentRun:
    from sae_env.tracking import Tracker

    t0 = time.perf_counter()
    _write_json(run_dir / "config.json", config.to_dict())
    write_text(run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
    cells = expand(config)
    done = {k: v for k, v in load_results(run_dir, log).items() if k in {c.id for c in cells}}
    reused = _reusable(config, run_dir, [c for c in cells if c.id not in done], log) if reuse else {}
    for cid, result in reused.items():
        done[cid] = json.loads(_write_json(run_dir / "cells" / f"{cid}.json", result))
    todo = [c for c in cells if c.id not in done]
    log(f"experiment {config.name}: {len(cells)} cells ({len(done) - len(reused)} already done, {len(reused)} "
        f"reused from earlier runs of this experiment) -> {run_dir}")
    tracker = Tracker(config, run_dir, mode=wandb_mode, log=log)
    results = dict(done)
    failures: dict[str, dict[str, Any]] = {}
    by_id = {c.id: c for c in cells}
    # Cells finished earlier (or reused) whose W&B run is missing or was cut short by a kill are logged again.
    tracker.resume({cid: (by_id[cid], result) for cid, result in done.items()}, [c.id for c in todo])

    def finished(cell: Cell, result: dict[str, Any]) -> None:
        # Kept as written (string dict keys, lists): fresh, resumed, serial and Ray results compare equal.
        results[cell.id] = json.loads(_write_json(run_dir / "cells" / f"{cell.id}.json", result))
        tracker.log_cell(cell, results[cell.id])

    try:
        if todo:
            traces = _build_traces(config, todo, log)
            _preflight(config, runner, todo, traces)
            use_ray = (config.ray.enabled if serial is None else not serial) or ray_address is not None
            bar = _progress(len(cells), len(done), progress)
            try:
                if use_ray:
                    _run_on_ray(config, runner, todo, traces, finished, failures, bar,
                                address=ray_address or config.ray.address,
                                num_cpus=num_cpus or config.ray.num_cpus)
                else:
                    _run_serial(config, runner, todo, traces, finished, failures, bar)
            finally:
                bar.close()
        if failures:
            _write_json(run_dir / "failures.json", failures)
            for cid, f in failures.items():
                log(f"cell {cid} FAILED after {f['attempts']} attempt(s): {f['error']}")
        elif (run_dir / "failures.json").exists():
            (run_dir / "failures.json").unlink()
        run = ExperimentRun(config, run_dir, cells, results, failures, len(done), 0.0)
        if report:
            from sae_env.report import write_report

            paths = write_report(run)
            tracker.log_summary(run, paths)
    finally:
        tracker.close()  # waits for the W&B writer thread
    run.wall_s = time.perf_counter() - t0
    return run


def _trace_key(config: ExperimentConfig, cell: Cell) -> str:
    """The cell's trace spec, canonical: cells whose specs are equal (a data workload under every seed) share one
    trace, built once and put once into Ray's object store."""
    workload = next(w for w in config.workloads if w.name == cell.workload)
    return json.dumps(workload.spec_for(cell.seed), sort_keys=True)


def _build_traces(config: ExperimentConfig, cells: list[Cell], log: Callable[[str], None]) -> dict[str, Trace]:
    from sae_env.sources import trace_from_spec

    traces: dict[str, Trace] = {}
    for cell in cells:
        key = _trace_key(config, cell)
        if key in traces:
            continue
        try:
            trace, _ = trace_from_spec(json.loads(key))
        except (ValueError, OSError) as e:
            raise ConfigError(f"workload {cell.workload!r}: {e}") from None
        log(f"workload {cell.workload} ({key}): {len(trace)} requests, {trace.n_blocks} prompt blocks, "
            f"{trace.distinct_blocks()} distinct")
        traces[key] = trace
    return traces


def _preflight(config: ExperimentConfig, runner: CellRunner, cells: list[Cell], traces: dict[str, Trace]) -> None:
    """What would fail every cell of an agent or a capacity, found before any cell runs: the files agents' options
    name, registered agents built once, and every capacity resolved against its workload's trace (one that holds
    less than a block, or a size in bytes without a timed serving model)."""
    from sae_env.cache import resolve_capacity
    from sae_env.serving import make_server

    used = {c.agent for c in cells}
    for i, agent in enumerate(config.agents):
        if agent.name in used:
            agent.check(f"agents[{i}]", runner, files=True)

    kv_bytes = make_server(config.serving.model).kv_bytes_per_token
    seen = set()
    for cell in cells:
        key = (_trace_key(config, cell), repr(cell.capacity))
        if key in seen:
            continue
        seen.add(key)
        trace = traces[key[0]]
        try:
            resolve_capacity(cell.capacity, trace.distinct_blocks(), kv_bytes, trace.block_size)
        except ValueError as e:
            raise ConfigError(f"capacities: {_short(cell.capacity)} on workload {cell.workload!r}: {e}") from None


class _NoBar:
    def update(self, n: int = 1) -> None: ...

    def set_postfix_str(self, s: str) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="cell", desc="cells", file=sys.stderr, dynamic_ncols=True)


def _run_serial(config: ExperimentConfig, runner: CellRunner, todo: list[Cell], traces: dict,
                finished: Callable[[Cell, dict], None], failures: dict, bar: Any) -> None:
    gpus = _local_gpus(config)
    for cell in todo:
        task = _on_device(config, runner, cell_task(config, cell), gpus)
        for attempt in range(1, config.ray.retries + 2):
            try:
                result = _run_one(runner, task, traces[_trace_key(config, cell)])
            except Exception as e:  # a cell's failure must not lose the others
                if attempt == config.ray.retries + 1:
                    failures[cell.id] = _failure(cell, e, attempt)
                continue
            finished(cell, result)
            break
        bar.set_postfix_str(cell.id[-40:])
        bar.update()


def _run_on_ray(config: ExperimentConfig, runner: CellRunner, todo: list[Cell], traces: dict,
                finished: Callable[[Cell, dict], None], failures: dict, bar: Any, *, address: str | None,
                num_cpus: int | None) -> None:
    from sae_env.ray_local import ray_cluster

    with ray_cluster(num_cpus=num_cpus, address=address) as ray:
        gpus = float(ray.cluster_resources().get("GPU", 0)) if config.ray.gpus_per_cell > 0 else 0.0
        if config.ray.gpus_per_cell > 0 and gpus == 0:
            print("note: ray.gpus_per_cell is set but the cluster has no GPU: every cell runs on the CPU",
                  file=sys.stderr)
        task_fn = ray.remote(_run_one)
        runner_ref = ray.put(runner)
        trace_refs = {key: ray.put(trace) for key, trace in traces.items()}  # once each, shared by its cells
        pending = {}
        for cell in todo:
            task = _on_device(config, runner, cell_task(config, cell), gpus)
            ref = task_fn.options(**remote_options(config, runner, task, gpus)).remote(
                runner_ref, task, trace_refs[_trace_key(config, cell)], True)
            pending[ref] = cell
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                cell = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:
                    failures[cell.id] = _failure(cell, e, config.ray.retries + 1)
                else:
                    finished(cell, result)
                bar.set_postfix_str(cell.id[-40:])
                bar.update()
