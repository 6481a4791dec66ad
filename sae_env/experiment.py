"""Experiments: a config (:mod:`sae_env.config`) expanded into cells, run on Ray (or serially), written as they
finish, resumable.

Every combination workload x capacity x load x agent x seed of a config is a **cell**, one episode of one agent on
one trace (the schema is :mod:`sae_env.config`'s docstring).

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

import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from sae_env.config import (
    AgentSpec,
    CellRunner,
    ConfigError,
    ExperimentConfig,
    RayConfig,
    ServingConfig,
    WandbConfig,
    WorkloadSpec,
    check_name,
    is_ppo_config,
    load_config,
)
from sae_env.files import set_aside, write_json, write_text
from sae_env.inputs import brief
from sae_env.trace import Trace

__all__ = ["AgentSpec", "Cell", "CellRunner", "ConfigError", "ExperimentConfig", "ExperimentRun", "RayConfig",
           "ServingConfig", "WandbConfig", "WorkloadSpec", "cell_uses_gpu", "expand", "is_ppo_config", "load_config",
           "load_results", "remote_options", "run_experiment"]

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
        check_name(run_id, "--run-id")
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
        if config.lru_curve:
            _write_lru_curves(config, run_dir, cells, results, traces if todo else {}, log)
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


def _write_lru_curves(config: ExperimentConfig, run_dir: Path, cells: list[Cell], results: dict[str, dict[str, Any]],
                      traces: dict[str, Trace], log: Callable[[str], None]) -> None:
    """``lru_curve.json``: LRU's curve per workload and seed, checked against the finished lru cells
    (:func:`sae_env.mrc.experiment_curves`)."""
    from sae_env.mrc import experiment_curves

    t0 = time.perf_counter()
    first: dict[tuple[str, int], Cell] = {}  # each trace's first cell, in the config's order
    for c in cells:
        first.setdefault((c.workload, c.seed), c)
    missing = [c for c in first.values() if _trace_key(config, c) not in traces]
    traces.update(_build_traces(config, missing, log) if missing else {})
    done = [(c.workload, c.seed, c.agent, results[c.id]["summary"]) for c in cells if c.id in results]
    plain = {a.name for a in config.agents if a.policy == "lru" and a.agent == "baseline" and not a.policy_options}
    rows, checked = experiment_curves(config.capacities, config.lru_curve, {k: traces[_trace_key(config, c)]
                                      for k, c in first.items()}, done, plain, log)
    _write_json(run_dir / "lru_curve.json", rows)
    log(f"lru_curve: {len(rows)} points from one pass per trace in {time.perf_counter() - t0:.2f} s; equal to the "
        f"{checked} lru cell(s) at their capacities -> {run_dir / 'lru_curve.json'}")


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
            raise ConfigError(f"capacities: {brief(cell.capacity)} on workload {cell.workload!r}: {e}") from None


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
