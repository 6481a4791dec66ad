"""Mix: interleave the sessions of several sources on one timeline, with per-phase weights.

Config (a YAML / JSON file, or the same keys as options)::

    seed: 0
    on_exhausted: cycle          # cycle | repeat | stop
    after_schedule: keep         # keep | drop: requests that arrive after the last phase ends
    arrivals: poisson            # or {process: azure, trace: azure_conv | azure_code} or {process: azure, path: CSV}
    components:
      - {name: chat,  source: conversations, path: wildchat_multiturn.jsonl.gz, options: {block_size: 16}}
      - {name: agent, source: taubench,      path: airline_gpt4o_trajectories.json.gz}
      - {name: tmpl,  source: synthetic,     options: {preset: tiny, phases: [{duration: 600, rate: 1,
                                                                             mix: {templated: 1}}]}}
    phases:
      - {duration: 600, rate: 2.0, weights: {chat: 0.6, agent: 0.2, tmpl: 0.2}, name: chatty}
      - {duration: 600, rate: 2.0, weights: {chat: 0.1, agent: 0.8, tmpl: 0.1}, name: agentic}

Algorithm:

1. Load each component through :func:`sae_env.sources.load_source` (relative paths in a config file are resolved
   against the file's folder). All components must have one block size (ValueError naming both otherwise).
2. Group each component's requests into sessions (unknown session -1 = each request its own session), ordered by
   their first arrival; keep each request's offset from its session's first arrival (intra-session gaps are kept
   exactly).
3. Session starts, per phase at ``rate`` sessions/s on average: ``poisson`` (default; count Poisson(rate x duration),
   starts uniform in the phase window) or ``azure``: a stretch of Azure's recorded LLM-inference arrival process
   (:meth:`sae_env.sources.azure.AzureProcess.window_times`: the trace scaled to the phase's mean rate and tiled, the
   stretch starting at an offset drawn uniformly over one copy), so starts keep the real process's burstiness and
   order; the seed picks the stretch. Each start picks a component by the phase's weights and takes that component's
   next unused session, in order. When a component runs out: ``cycle`` (default) starts over with a fresh key salt per
   pass, so a replayed session shares nothing with its earlier copy (but shares, within its pass, whatever the
   component's sessions share with each other, e.g. a system prompt); ``repeat`` starts over with the same keys (a
   replay can hit its earlier copy); ``stop`` drops the start (counted). A session runs on past its phase's end,
   and past the schedule's end unless ``after_schedule: drop``, which ends the trace with the schedule, as a recorded
   excerpt ends: later turns of the sessions still running are dropped (counted in the stats).
4. Keys are salted per component (and per pass for ``cycle``) with ``key -> mix64(key XOR h(salt))``: a bijection of
   64-bit keys for each salt, so every equality and every inequality between keys of one component (prompt and
   output keys alike) is kept exactly, and keys of different components (or passes) meet only by a 64-bit accident.
   This needs no assumption on how the component chained its keys (re-chaining per request would give the same
   equalities for prefix-chained keys).
5. Sessions are renumbered 0, 1, ... in start order. ``meta["session_component"]``, ``meta["session_origin"]`` (the
   session id in its component, unknown sessions as :meth:`Trace.session_ids` numbers them) and
   ``meta["session_pass"]`` are indexed by the new session id; :func:`component_of` maps requests to components and
   :func:`sae_env.sources.synthetic.phase_of` to phases (``meta["phases"]``: ``{start, end, name, weights}``).

Why one piece (~540 lines): one source, one module, as for every source; the config, the session schedule and the
key salting are the one algorithm above, each step feeding the next.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sae_env.inputs import check_options
from sae_env.sources.azure import AzureProcess, load_process
from sae_env.sources.synthetic import phase_of, poisson_arrivals
from sae_env.sources.synthetic_config import integer, number, read_config_file
from sae_env.trace import LoadReport, Trace, csr_offsets, mix64

__all__ = ["AFTER_SCHEDULE", "ARRIVAL_PROCESSES", "Component", "MixArrivals", "MixConfig", "MixPhase", "ON_EXHAUSTED",
           "azure_arrivals", "component_of", "interleave", "load", "phase_of"]

ON_EXHAUSTED = ("cycle", "repeat", "stop")
AFTER_SCHEDULE = ("keep", "drop")
ARRIVAL_PROCESSES = ("poisson", "azure")
_MAX_EXPECTED_SESSIONS = 5_000_000


@dataclass(frozen=True)
class Component:
    """One input: a name used by the phase weights, a registered source, its path and its options."""

    name: str
    source: str
    path: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from sae_env.sources import SOURCES  # noqa: PLC0415 - the registry imports nothing eagerly; keep it so

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"component name must be a non-empty string, got {self.name!r}")
        if self.source not in SOURCES:
            raise ValueError(f"component '{self.name}': unknown source {self.source!r}; "
                             f"valid sources: {sorted(SOURCES)}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"component '{self.name}': path must be a string or null, got {self.path!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"component '{self.name}': options must be a mapping, got {self.options!r}")
        object.__setattr__(self, "path", None if self.path is None else str(self.path))
        object.__setattr__(self, "options", dict(self.options))


@dataclass(frozen=True)
class MixPhase:
    """``duration`` s of Poisson session starts at ``rate`` sessions/s; ``weights``: component name -> weight."""

    duration: float
    rate: float
    weights: dict[str, float]
    name: str = ""

    def __post_init__(self) -> None:
        if number(self.duration, "duration") <= 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration}")
        if number(self.rate, "rate") < 0:
            raise ValueError(f"rate must be >= 0 sessions/s, got {self.rate}")
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"weights must be a mapping of component name -> weight, got {self.weights!r}")
        w = {str(k): number(v, f"weights[{k!r}]") for k, v in self.weights.items()}
        bad = [k for k, v in w.items() if v < 0]
        if bad:
            raise ValueError(f"weights {bad} must be >= 0")
        if self.rate > 0 and sum(w.values()) <= 0:
            raise ValueError("weights must not all be 0 when rate > 0")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        object.__setattr__(self, "weights", w)


@dataclass(frozen=True)
class MixArrivals:
    """How session starts arrive: ``poisson``, or ``azure`` from an Azure LLM-inference CSV (``path``) or an
    embedded one (``trace``: ``azure_conv``, the default, or ``azure_code``)."""

    process: str = "poisson"
    trace: str | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        from sae_env import data  # noqa: PLC0415 - paths of the embedded traces

        if self.process not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrivals: process must be one of {list(ARRIVAL_PROCESSES)}, got {self.process!r}")
        if self.process == "poisson" and (self.trace is not None or self.path is not None):
            raise ValueError("arrivals: a poisson process takes no trace or path")
        if self.trace is not None and self.path is not None:
            raise ValueError("arrivals: give trace (an embedded Azure trace) or path (a CSV file), not both")
        azure = sorted(k for k, (_, src) in data.ALL.items() if src == "azure")
        if self.trace is not None and self.trace not in azure:
            raise ValueError(f"arrivals: trace must be an embedded Azure trace ({azure}), got {self.trace!r}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"arrivals: path must be a string, got {self.path!r}")
        if self.process == "azure" and self.trace is None and self.path is None:
            object.__setattr__(self, "trace", "azure_conv")
        object.__setattr__(self, "path", None if self.path is None else str(self.path))

    def file(self, base: Path | None = None) -> Path | None:
        """The Azure CSV to read (None for Poisson); a relative ``path`` is taken against ``base``."""
        from sae_env import data  # noqa: PLC0415

        if self.process != "azure":
            return None
        if self.trace is not None:
            return data.ALL[self.trace][0]
        path = Path(self.path)
        return base / path if base is not None and not path.is_absolute() else path


@dataclass(frozen=True)
class MixConfig:
    components: tuple[Component, ...]
    phases: tuple[MixPhase, ...]
    seed: int = 0
    on_exhausted: str = "cycle"
    block_size: int | None = None  # if set, every component must have this block size
    arrivals: MixArrivals = field(default_factory=MixArrivals)
    after_schedule: str = "keep"

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", tuple(self.components))
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.components:
            raise ValueError("components must list at least one component")
        names = [c.name for c in self.components]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"component names must be unique, got {dup} more than once")
        if not self.phases:
            raise ValueError("phases must list at least one phase")
        for i, p in enumerate(self.phases):
            unknown = sorted(set(p.weights) - set(names))
            if unknown:
                raise ValueError(f"phases[{i}].weights: unknown component(s) {unknown}; components: {names}")
        seed = integer(self.seed, "seed")
        if seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        object.__setattr__(self, "seed", seed)
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {list(ON_EXHAUSTED)}, got {self.on_exhausted!r}")
        if self.after_schedule not in AFTER_SCHEDULE:
            raise ValueError(f"after_schedule must be one of {list(AFTER_SCHEDULE)}, got {self.after_schedule!r}")
        if self.block_size is not None:
            bs = integer(self.block_size, "block_size")
            if bs < 1:
                raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
            object.__setattr__(self, "block_size", bs)
        expected = sum(p.rate * p.duration for p in self.phases)
        if expected > _MAX_EXPECTED_SESSIONS:
            raise ValueError(f"phases expect {expected:.3g} sessions, more than the limit {_MAX_EXPECTED_SESSIONS}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "mix config") -> MixConfig:
        """Build and validate from plain data; errors name the offending key and list the valid ones."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {data!r}")
        kw = dict(_checked(data, cls, where))
        for key in ("components", "phases"):
            if key not in kw:
                raise ValueError(f"{where}: missing required key '{key}'")
            if isinstance(kw[key], (str, bytes, Mapping)) or not isinstance(kw[key], Sequence):
                raise ValueError(f"{where}.{key}: expected a list, got {kw[key]!r}")
        kw["components"] = tuple(_sub(Component, c, f"{where}.components[{i}]")
                                 for i, c in enumerate(kw["components"]))
        kw["phases"] = tuple(_sub(MixPhase, p, f"{where}.phases[{i}]") for i, p in enumerate(kw["phases"]))
        if "arrivals" in kw:
            arrivals = kw["arrivals"]
            kw["arrivals"] = _sub(MixArrivals, {"process": arrivals} if isinstance(arrivals, str) else arrivals,
                                  f"{where}.arrivals")
        try:
            return cls(**kw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["components"] = [asdict(c) for c in self.components]
        d["phases"] = [asdict(p) for p in self.phases]
        d["arrivals"] = asdict(self.arrivals)
        return d


def _checked(data: Mapping[str, Any], cls: type, where: str) -> Mapping[str, Any]:
    valid = list(cls.__dataclass_fields__)
    unknown = sorted(str(k) for k in set(data) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {valid}")
    return data


def _sub(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {data!r}")
    try:
        return cls(**_checked(data, cls, where))
    except TypeError as e:  # a missing required key
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# Key salting

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT_BASE = np.uint64(0x6A09E667F3BCC909)


def salt_keys(keys: np.ndarray, salt: np.ndarray | int) -> np.ndarray:
    """``key -> mix64(key ^ h(salt))`` per key: a bijection for each salt value (keeps all (in)equalities)."""
    keys = np.asarray(keys, dtype=np.int64).view(np.uint64)
    s = np.broadcast_to(np.asarray(salt, dtype=np.uint64), keys.shape)
    with np.errstate(over="ignore"):
        h = mix64(s * _GOLDEN + _SALT_BASE)
    return mix64(keys ^ h).view(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Interleaving


def _ranks(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    owner = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    pos = np.arange(owner.size, dtype=np.int64) - np.repeat(csr_offsets(lengths)[:-1], lengths)
    return owner, pos


def _gather(offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat positions of CSR rows ``idx`` concatenated in that order, and the rows' lengths."""
    lengths = offsets[idx + 1] - offsets[idx]
    owner, pos = _ranks(lengths)
    return offsets[idx][owner] + pos, lengths


@dataclass
class _Sessions:
    """One component's requests grouped by session (sessions in first-arrival order)."""

    order: np.ndarray  # request indices, session by session, time order inside
    offsets: np.ndarray  # CSR per session into order
    rel_t: np.ndarray  # per request (trace order): seconds since its session's first arrival
    origin: np.ndarray  # per session: its id in the component (unknown sessions numbered as Trace.session_ids)


def _sessions(trace: Trace) -> _Sessions:
    sid = trace.session_ids()
    uniq, first, inv = np.unique(sid, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[by_first] = np.arange(uniq.size)
    srank = rank[inv]
    order = np.lexsort((np.arange(len(trace)), srank))
    counts = np.bincount(srank, minlength=uniq.size)
    rel_t = trace.t - trace.t[first[by_first]][srank]
    return _Sessions(order=order, offsets=csr_offsets(counts), rel_t=rel_t, origin=uniq[by_first])


def azure_arrivals(rng: np.random.Generator, process: AzureProcess, durations: Sequence[float],
                   rates: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Session start times from stretches of a recorded arrival process, and the phase index of each (sorted).

    Phase ``i`` takes the stretch of ``durations[i]`` seconds that starts at an offset drawn uniformly over one copy
    of the process scaled to ``rates[i]`` per second (:meth:`AzureProcess.window_times`)."""
    times, phase = [], []
    start = 0.0
    for i, (d, r) in enumerate(zip(durations, rates, strict=True)):
        t = np.zeros(0)
        if r > 0:
            offset = float(rng.uniform(0.0, process.period(r)))
            t = process.window_times(offset, d, r)
        times.append(start + t)
        phase.append(np.full(t.size, i, dtype=np.int64))
        start += d
    return np.concatenate(times), np.concatenate(phase)


def interleave(traces: Sequence[Trace], config: MixConfig,
               process: AzureProcess | None = None) -> tuple[Trace, dict[str, Any]]:
    """Re-time and interleave the sessions of ``traces`` (one per ``config.components``, same order).

    ``process``: the arrival process of ``config.arrivals`` when it is ``azure`` (:func:`load` reads it). Returns
    the mixed trace and statistics (sessions used / dropped per component, passes). ``trace.meta`` records the
    config, the phases and the per-session component, origin and pass.
    """
    comps = config.components
    names = [c.name for c in comps]
    if len(traces) != len(comps):
        raise ValueError(f"mix: {len(traces)} traces for {len(comps)} components")
    ref = config.block_size if config.block_size is not None else traces[0].block_size
    ref_name = "the mix option block_size" if config.block_size is not None else f"component '{names[0]}'"
    for name, tr in zip(names, traces, strict=True):
        if tr.block_size != ref:
            raise ValueError(f"mix: component '{name}' has block_size {tr.block_size} but {ref_name} has block_size "
                             f"{ref}; every component must use one block size (ask the component's source for "
                             f"block_size={ref} in its options if it accepts one, e.g. conversations)")
    n_comp = len(comps)
    weights = np.array([[p.weights.get(n, 0.0) for n in names] for p in config.phases])
    groups = [_sessions(tr) for tr in traces]
    n_sess = np.array([g.origin.size for g in groups], dtype=np.int64)
    empty = [names[c] for c in range(n_comp) if n_sess[c] == 0 and (weights[:, c] > 0).any()]
    if empty:
        raise ValueError(f"mix: component(s) {empty} have no requests but a positive weight in some phase")

    rng = np.random.default_rng(config.seed)
    durations, rates = [p.duration for p in config.phases], [p.rate for p in config.phases]
    if config.arrivals.process == "azure":
        if process is None:
            raise ValueError("mix: arrivals 'azure' need the Azure arrival process (mix.load reads it)")
        starts, phase = azure_arrivals(rng, process, durations, rates)
    else:
        starts, phase = poisson_arrivals(rng, durations, rates)
    comp = np.zeros(starts.size, dtype=np.int64)
    for i in range(len(config.phases)):
        sel = np.flatnonzero(phase == i)
        if sel.size:
            comp[sel] = rng.choice(n_comp, size=sel.size, p=weights[i] / weights[i].sum())

    # k-th start that picks component c takes its session k mod n_c, in pass k // n_c.
    rank = np.zeros(starts.size, dtype=np.int64)
    for c in range(n_comp):
        sel = np.flatnonzero(comp == c)
        rank[sel] = np.arange(sel.size)
    n_c = np.maximum(n_sess[comp], 1)
    sess, pass_ = rank % n_c, rank // n_c
    keep = pass_ == 0 if config.on_exhausted == "stop" else np.ones(starts.size, dtype=bool)
    dropped = np.bincount(comp[~keep], minlength=n_comp)
    starts, phase, comp, sess, pass_ = starts[keep], phase[keep], comp[keep], sess[keep], pass_[keep]
    salt = comp + n_comp * pass_ if config.on_exhausted == "cycle" else comp

    # A library of all components' requests, stacked (component c's request j is lib index base[c] + j).
    req_base = csr_offsets(np.array([len(tr) for tr in traces], dtype=np.int64))
    sess_base = csr_offsets(n_sess)
    lib_order = np.concatenate([g.order + req_base[c] for c, g in enumerate(groups)])
    lib_sess_off = csr_offsets(np.concatenate([np.diff(g.offsets) for g in groups]))
    lib_rel_t = np.concatenate([g.rel_t for g in groups])

    pos_in_lib, n_req = _gather(lib_sess_off, sess_base[comp] + sess)
    req = lib_order[pos_in_lib]  # library request of every output request, instance by instance
    inst = np.repeat(np.arange(starts.size, dtype=np.int64), n_req)
    t = starts[inst] + lib_rel_t[req]
    end = float(sum(p.duration for p in config.phases))
    late = t >= end if config.after_schedule == "drop" else np.zeros(t.size, dtype=bool)
    late_by_comp = np.bincount(comp[inst[late]], minlength=n_comp)
    req, inst, t = req[~late], inst[~late], t[~late]  # a session's first request starts within the schedule
    order = np.argsort(t, kind="stable")  # ties keep session start order, then the session's own order
    req, inst, t = req[order], inst[order], t[order]

    def col(name: str) -> np.ndarray:
        return np.concatenate([getattr(tr, name) for tr in traces])[req]

    cols: dict[str, np.ndarray] = {}
    for kind in ("prompt", "output"):
        off = csr_offsets(np.concatenate([np.diff(getattr(tr, f"{kind}_offsets")) for tr in traces]))
        keys = np.concatenate([getattr(tr, f"{kind}_keys") for tr in traces])
        types = np.concatenate([getattr(tr, f"{kind}_types") for tr in traces])
        flat, lengths = _gather(off, req)
        cols[f"{kind}_keys"] = salt_keys(keys[flat], np.repeat(salt[inst], lengths))
        cols[f"{kind}_types"] = types[flat]
        cols[f"{kind}_offsets"] = csr_offsets(lengths)

    widths = {None if tr.features is None else tr.features.shape[1] for tr in traces}
    features = None
    if len(widths) == 1 and None not in widths:
        features = np.concatenate([tr.features for tr in traces])[req]

    win = np.concatenate([[0.0], np.cumsum([p.duration for p in config.phases])])
    phases = [{"start": float(win[i]), "end": float(win[i + 1]), "name": p.name or f"phase{i}",
               "weights": {n: p.weights.get(n, 0.0) for n in names}, "rate": p.rate}
              for i, p in enumerate(config.phases)]
    origin = np.concatenate([g.origin for g in groups]) if groups else np.zeros(0, dtype=np.int64)
    used = np.zeros((len(config.phases), n_comp), dtype=np.int64)
    np.add.at(used, (phase, comp), 1)
    stats = {
        "sessions_available": {n: int(n_sess[c]) for c, n in enumerate(names)},
        "sessions_used": {n: int((comp == c).sum()) for c, n in enumerate(names)},
        "sessions_per_phase": [{n: int(used[i, c]) for c, n in enumerate(names)} for i in range(len(phases))],
        "passes": {n: int(pass_[comp == c].max() + 1) if (comp == c).any() else 0 for c, n in enumerate(names)},
        "dropped_exhausted": {n: int(dropped[c]) for c, n in enumerate(names)},
        "dropped_after_schedule": {n: int(late_by_comp[c]) for c, n in enumerate(names)},
        "features_dropped": len(widths) > 1,
    }
    meta = {"source": "mix", "seed": config.seed, "config": config.to_dict(), "components": names,
            "phases": phases, "session_component": comp.tolist(),
            "session_origin": origin[sess_base[comp] + sess].tolist(), "session_pass": pass_.tolist(),
            "component_meta": {n: tr.meta for n, tr in zip(names, traces, strict=True)}, "stats": stats}
    trace = Trace(t=t, session=inst, turn=col("turn"), app=col("app"), prompt_tokens=col("prompt_tokens"),
                  output_tokens=col("output_tokens"), features=features, block_size=ref, meta=meta, **cols)
    return trace, stats


def component_of(trace: Trace) -> np.ndarray:
    """Component index (into ``trace.meta["components"]``) of every request of a mix trace."""
    sc = trace.meta.get("session_component")
    if sc is None:
        raise ValueError("trace.meta has no 'session_component' (not a mix trace)")
    return np.asarray(sc, dtype=np.int64)[trace.session]


# ----------------------------------------------------------------------------------------------------------------
# Source entry point

_OPTIONS = {"components", "phases", "seed", "on_exhausted", "block_size", "arrivals", "after_schedule", "on_error"}
# The mix config files being loaded, outermost first: a component that is a mix may not include one of them again.
_LOADING: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("mix_loading", default=())
_MAX_DEPTH = 8  # mixes of mixes: deeper nesting is a mistake, not a workload


def load(path: str | os.PathLike | None = None, **options: Any) -> tuple[Trace, LoadReport]:
    """Mix the components of a config file (``path``) and / or ``options`` (top-level keys override the file's).

    ``on_error`` (``raise`` / ``skip``), when given, is passed to every component that does not set its own
    (except the native ``trace`` source, which takes no options).
    """
    from sae_env.sources import load_source  # noqa: PLC0415 - the registry imports the sources lazily

    check_options("mix", options, _OPTIONS)
    on_error = options.pop("on_error", None)
    if on_error not in (None, "raise", "skip"):
        raise ValueError(f"source 'mix': on_error must be 'raise' or 'skip', got {on_error!r}")
    data: dict[str, Any] = {}
    where, base = "mix options", None
    if path is not None:
        data = read_config_file(path)
        where, base = str(path), Path(path).resolve().parent
    data.update(options)
    config = MixConfig.from_dict(data, where=where)

    outer = _LOADING.get()
    if path is not None:
        me = Path(path).resolve()
        if me in outer:
            chain = " -> ".join(str(p) for p in (*outer, me))
            raise ValueError(f"{path}: a mix config cannot include itself ({chain})")
        outer = (*outer, me)
    if len(outer) > _MAX_DEPTH:
        raise ValueError(f"{where}: mix configs nested more than {_MAX_DEPTH} deep")
    token = _LOADING.set(outer)
    try:
        traces, reports = [], []
        for comp in config.components:
            cpath = comp.path
            if cpath is not None and base is not None and not Path(cpath).is_absolute():
                cpath = str(base / cpath)
            copts = dict(comp.options)
            if on_error is not None and comp.source != "trace":
                copts.setdefault("on_error", on_error)
            try:
                tr, rep = load_source(comp.source, cpath, **copts)
            except (ValueError, OSError) as e:  # named by the config that asked for it, as well as by its own file
                raise ValueError(f"{where}: component {comp.name!r}: {e}") from None
            traces.append(tr)
            reports.append(rep)
    finally:
        _LOADING.reset(token)
    try:
        arrivals_file = config.arrivals.file(base)
        process = None if arrivals_file is None else load_process(arrivals_file, on_error=on_error or "raise")
        trace, stats = interleave(traces, config, process)
    except (ValueError, OSError) as e:
        raise ValueError(e if str(e).startswith(where) else f"{where}: {e}") from None

    report = LoadReport(source="mix", path=str(path) if path is not None else "<options>",
                        rows_read=sum(r.rows_read for r in reports))
    for comp, rep in zip(config.components, reports, strict=True):
        for why, n in rep.rejected.items():
            report.reject(f"{comp.name}: {why}", n)
        report.notes += [f"{comp.name}: {note}" for note in rep.notes]
    report.notes.append(f"{len(trace)} requests in {len(trace.meta['session_component'])} sessions; "
                        f"sessions used per component {stats['sessions_used']} of {stats['sessions_available']}")
    start_note = ("Poisson per phase" if process is None else
                  f"stretches of the Azure arrival process in {arrivals_file.name} ({len(process)} arrivals over "
                  f"{process.duration:.0f} s), scaled to each phase's rate")
    report.notes.append(f"session starts: {start_note}, component by the phase's weights; when a component runs "
                        f"out: {config.on_exhausted} (passes {stats['passes']}, dropped {stats['dropped_exhausted']})")
    if config.after_schedule == "drop":
        end = trace.meta["phases"][-1]["end"]
        report.notes.append(f"the trace ends with the schedule ({end:g} s): later requests of sessions still "
                            f"running dropped ({stats['dropped_after_schedule']})")
    report.notes.append("keys salted per component" + (" and pass" if config.on_exhausted == "cycle" else "")
                        + " (a bijection per salt: equalities within a component kept, none added across)")
    if stats["features_dropped"]:
        report.notes.append("features dropped: the components' features are missing or of different widths")
    return trace, report
