"""W&B tracking of an experiment: one run per cell, one summary run; offline by default; never fatal.

Every cell becomes a W&B run (group = the experiment, job type = the agent, name = the cell id, config = the cell)
with, per window, metrics stepped on **simulated time** (``define_metric("window/*", step_metric="sim_time_s")``):
``window/token_hit_rate``, ``window/block_hit_rate``, ``window/ttft_mean_ms``, ``window/ttft_p99_ms``,
``window/evictions``, ``window/occupancy``, ``window/reward``, ``window/hit_rate/<TokenType>``; the agent's
parameters in effect (``params/<name>``: alpha per queue, type weights, mu / sigma, gamma for SAECache) and the
workload ``phase`` (index into the trace's phase schedule; -1 none). The run's config holds the cell (workload,
capacity, load, **seed**, agent spec) and ``phases`` (the schedule's phase names), so that dashboards group and
filter by them; its summary holds the cell's totals (``final/token_hit_rate``, ``final/ttft_p99_ms``, ...) and each
phase's (``final/phase/<name>/token_hit_rate``, ``.../ttft_mean_ms``, ``.../requests``). A last run (job type
``summary``) holds a ``wandb.Table`` of every cell (``cells``), one of every (cell, phase) (``phases``: workload,
capacity, load, agent, seed, phase, token hit rate, TTFT mean) and the report's plots as images.

Modes: ``offline`` (default: no network, not even a DNS lookup; ``wandb sync <run-dir>/wandb/offline-run-*``
uploads later), ``online`` (the user's account), ``disabled`` (no run is written). Runs go under
``<run-dir>/wandb``. W&B's own variables are honoured where the command line and the config say nothing
(:func:`resolve_target`): ``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_ENTITY`` and ``WANDB_DIR`` (runs then go under
``$WANDB_DIR/wandb``). If W&B cannot be imported or fails, the tracker warns once and turns itself off: the local
files of the experiment are the record that always exists.
Runs are written by one background thread, in the order the cells finish: a W&B run costs ~0.7 s (mostly waiting
on W&B's service process), which then overlaps with the cells still running; :meth:`Tracker.close` waits for it.

Training jobs (``train.py ppo``, ``train.py predictor``) log through :class:`TrainingRun`: one run per job, metrics
namespaced as CleanRL does (``charts/...``, ``losses/...``) against a step metric (``global_step``, ``epoch``).

Offline runs are one binary ``run-<id>.wandb`` file (LevelDB-log framing, protobuf records) that ``wandb.Api``
cannot read without a server; :func:`read_offline_run` parses it so that tests (and users) can check what was
logged.

Why one piece (~500 lines): the cell runs, the summary run and the training runs share one never-fatal W&B wrapper
(warn once, turn off, keep the local files) and one background writer; the offline-run reader reads back exactly the
records they write, so what is logged and how it is checked stay side by side.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROJECT", "WANDB_MODES", "Tracker", "TrainingRun", "WandbTarget", "init_run", "offline_run_files",
           "finish_run", "read_offline_run", "resolve_target", "run_file_status", "run_folders", "table_columns"]

WANDB_MODES = ("offline", "online", "disabled")
DEFAULT_PROJECT = "saecache-gym"
_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # W&B's older spellings of WANDB_MODE


@dataclass(frozen=True)
class WandbTarget:
    """Where and how W&B runs are written (see :func:`resolve_target`)."""

    mode: str
    project: str
    entity: str | None
    dir: Path  # wandb adds its own "wandb/" folder under it


def resolve_target(mode: str | None = None, project: str | None = None, entity: str | None = None,
                   dir: str | os.PathLike | None = None, default_dir: str | os.PathLike = ".",
                   environ: Mapping[str, str] | None = None) -> WandbTarget:
    """Each setting as given (the command line, then the config), else W&B's variable (``WANDB_MODE``,
    ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_DIR``), else the default (offline, :data:`DEFAULT_PROJECT`, the
    account's default entity, ``default_dir``). ValueError for a mode that W&B does not have."""
    env = os.environ if environ is None else environ
    source = "the mode"
    if mode is None and env.get("WANDB_MODE"):
        mode, source = env["WANDB_MODE"].strip().lower(), "WANDB_MODE"
        mode = _MODE_ALIASES.get(mode, mode)
    mode = mode or "offline"
    if mode not in WANDB_MODES:
        raise ValueError(f"W&B: {source} {mode!r} is not one of {', '.join(WANDB_MODES)}")
    return WandbTarget(mode=mode, project=project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                       entity=entity or env.get("WANDB_ENTITY") or None,
                       dir=Path(dir or env.get("WANDB_DIR") or default_dir))


def _import_wandb(mode: str) -> Any:
    """The W&B module, set up so that an offline run touches no network (imported on first use: it costs ~1 s)."""
    # W&B mistakes our ``agents`` package for the OpenAI Agents SDK and advertises Weave on every init.
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
    if mode == "offline":
        # W&B's service process resolves the default server's host name at start-up even offline (a DNS query off
        # the machine, seen with strace); a loopback server address, read from the environment when the service
        # starts, stops it. Nothing is sent there offline, and the address is not stored in the run: `wandb sync`
        # later uses the syncing user's settings.
        os.environ.setdefault("WANDB_BASE_URL", "http://127.0.0.1")
    import wandb

    return wandb


def init_run(target: WandbTarget, *, name: str, job_type: str, group: str | None,
             config: Mapping[str, Any], run_id: str | None = None) -> Any:
    """A new W&B run (``mode`` passed explicitly: W&B reads ``WANDB_MODE`` only once per process); ``run_id``: its
    id, chosen by the caller (default: W&B's)."""
    wandb = _import_wandb(target.mode)
    target.dir.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True,
                              disable_git=True, save_code=False, disable_job_creation=True)
    return wandb.init(mode=target.mode, project=target.project, entity=target.entity, group=group,
                      job_type=job_type, name=name, config=dict(config), dir=str(target.dir), settings=settings,
                      reinit="create_new", id=run_id)


def finish_run(run: Any, timeout_s: float = 30.0) -> bool:
    """``run.finish()``, then wait until the run's file on disk holds W&B's exit record: ``finish`` returns while
    W&B's service process may still be writing (seen here: a 7-byte file right after ``finish``, complete ~1 s
    later), and a process killed in that gap would lose the run. True when the file is complete in time."""
    run.finish()
    try:
        folder = Path(run.dir).parent  # <...>/wandb/offline-run-<date>-<id>/files -> the run's folder
    except Exception:  # noqa: BLE001 - a disabled run has no folder
        return True
    if not any(folder.glob("run-*.wandb")):  # nothing is written for this run (disabled mode)
        return True
    deadline = time.monotonic() + timeout_s
    while not run_file_status(folder)["complete"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


_RUN_LIST = "wandb-runs.txt"  # in an experiment's run folder: the ids of the W&B runs it started


class Tracker:
    """Logs cells and the summary of an experiment to W&B (see the module docstring)."""

    def __init__(self, config: Any, run_dir: str | Path, mode: str | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        w = config.wandb
        self.target = resolve_target(mode or w.mode, w.project, w.entity, getattr(w, "dir", None), self.run_dir)
        self.mode = self.target.mode
        self.enabled = self.mode != "disabled"
        self.group = config.wandb.group or config.name
        self._log = log
        self._wandb: Any = None
        self._pool: Any = None  # one writer thread, started on first use

    # -- the W&B module, imported once and on first use (it costs ~1 s)
    def _module(self) -> Any:
        if self._wandb is None:
            self._wandb = _import_wandb(self.mode)
        return self._wandb

    def _init(self, name: str, job_type: str, config: Mapping[str, Any]) -> Any:
        # The run's id is chosen and listed in this run folder before W&B starts writing: a run killed while it
        # starts holds no record of whose it is, and its folder is named after the id.
        run_id = secrets.token_hex(4)  # 8 characters of [0-9a-f], as W&B's own ids
        with open(self.run_dir / _RUN_LIST, "a") as f:
            f.write(f"{run_id}\n")
        return init_run(self.target, name=name, job_type=job_type, group=self.group, config=config, run_id=run_id)

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        if not self.enabled:
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wandb")

        def job() -> None:
            if not self.enabled:
                return
            try:
                fn()
            except Exception as e:  # W&B must never cost the experiment: warn once, keep the local files
                self.enabled = False
                self._log(f"warning: W&B {what} failed ({type(e).__name__}: {e}); W&B logging is off for the rest "
                          f"of this run, the local results in {self.run_dir} are complete")

        self._pool.submit(job)

    def log_cell(self, cell: Any, result: Mapping[str, Any]) -> None:
        """One W&B run for a finished cell: per-window metrics on simulated time, params, phase, totals."""
        self._guard("logging", lambda: self._log_cell(cell, result))

    def resume(self, done: Mapping[str, tuple[Any, Mapping[str, Any]]], todo: Sequence[str] = ()) -> None:
        """Before new cells run, make the W&B folder hold exactly one complete run per finished cell (``done``:
        cell id -> (cell, result)): runs cut short by a kill (no exit record) and second copies are moved aside to
        ``<run-dir>/aside/wandb/``, as are the runs of cells in ``todo`` (they are computed and logged again), and
        every finished cell without a complete run is logged again. Offline and online runs alike (both keep a
        ``run-<id>.wandb`` file here); nothing happens when W&B is disabled."""
        self._guard("resume", lambda: self._resume(done, set(todo)))

    def _resume(self, done: Mapping[str, tuple[Any, Mapping[str, Any]]], todo: set[str]) -> None:
        from sae_env.files import set_aside

        keep: dict[str, Path] = {}
        for folder, info in self._own_runs():
            name = info.get("name")
            if info["complete"] and name in done and name not in keep and info.get("job_type") != "summary":
                keep[name] = folder
            elif not info["complete"] or name in done or name in todo:
                set_aside(self.run_dir, folder, under=self.target.dir)
        missing = [cid for cid in done if cid not in keep]
        if missing:
            self._log(f"W&B: logging {len(missing)} finished cell(s) again (their runs were missing or incomplete)")
        for cid in missing:
            cell, result = done[cid]
            self._log_cell(cell, result)

    def _own_runs(self) -> list[tuple[Path, dict[str, Any]]]:
        """This run folder's W&B runs, oldest first: (folder, :func:`run_file_status`). With the runs in the run
        folder itself every run there is its own; under a shared ``WANDB_DIR`` those this run folder started (listed
        by id in its ``wandb-runs.txt``) or whose config names it (a run of another experiment is left alone)."""
        own_folder = self.target.dir.resolve() == self.run_dir.resolve()
        try:
            listed = set((self.run_dir / _RUN_LIST).read_text().split())
        except OSError:
            listed = set()
        out = []
        for folder in sorted(run_folders(self.target.dir), key=lambda f: f.name.split("run-", 1)[-1]):
            info = run_file_status(folder)
            if own_folder or folder.name.rsplit("-", 1)[-1] in listed or info.get("run_dir") == str(self.run_dir):
                out.append((folder, info))
        return out

    def _log_cell(self, cell: Any, result: Mapping[str, Any]) -> None:
        from sae_env.report import phase_rows

        # seed and the phase names in the config: dashboards group and filter runs by config keys.
        config = {"experiment": self.config.name, "run_dir": str(self.run_dir), **result.get("cell", {}),
                  "phases": [p["name"] for p in result.get("phases") or []]}
        run = self._init(cell.id, cell.agent, config)
        try:
            run.define_metric("sim_time_s")
            for pattern in ("window/*", "params/*", "phase"):
                run.define_metric(pattern, step_metric="sim_time_s")
            for row in result.get("history", []):
                run.log(window_metrics(row))
            run.summary.update({f"final/{k}": v for k, v in result.get("summary", {}).items()
                                if _is_number(v)})
            for p in phase_rows({cell.id: result}, [cell.id]):
                run.summary.update({f"final/phase/{p['phase']}/{k}": p[k] for k in ("token_hit_rate", "ttft_mean_ms",
                                                                                   "requests") if _is_number(p[k])})
        finally:
            finish_run(run)

    def log_summary(self, experiment_run: Any, plots: Sequence[str | Path]) -> None:
        """The summary run: a table of every cell (the rows of summary.csv) and the plots as images."""
        self._guard("summary", lambda: self._log_summary(experiment_run, plots))

    def _log_summary(self, experiment_run: Any, plots: Sequence[str | Path]) -> None:
        from sae_env.files import set_aside
        from sae_env.report import PHASE_COLUMNS, SUMMARY_COLUMNS, phase_rows, summary_rows

        wandb = self._module()
        rows = summary_rows(experiment_run.results, [c.id for c in experiment_run.cells])
        for folder, info in self._own_runs():  # one summary run per run folder: the latest
            if info.get("job_type") == "summary":
                set_aside(self.run_dir, folder, under=self.target.dir)
        run = self._init(f"{self.config.name}-summary", "summary", {"experiment": self.config.name,
                                                                      "run_dir": str(self.run_dir),
                                                                      "cells": len(experiment_run.cells)})
        try:
            if rows:
                # The rows of summary.csv with their types: numbers stay numbers, so W&B can plot the table.
                columns = table_columns(rows, SUMMARY_COLUMNS)
                run.log({"cells": wandb.Table(columns=list(SUMMARY_COLUMNS),
                                              data=[list(r) for r in zip(*columns.values(), strict=True)])})
            order = [c.id for c in experiment_run.cells]
            phases = phase_rows(experiment_run.results, order)
            if phases:  # one row per (cell, phase): a table panel groups it by phase, seed and agent
                columns = table_columns(phases, PHASE_COLUMNS)
                run.log({"phases": wandb.Table(columns=list(PHASE_COLUMNS),
                                               data=[list(r) for r in zip(*columns.values(), strict=True)])})
            images = {f"plots/{Path(p).stem}": wandb.Image(str(p)) for p in plots if str(p).endswith(".png")}
            if images:
                run.log(images)
        finally:
            finish_run(run)

    def close(self) -> None:
        """Wait until every queued run is written (each run is finished where it starts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class TrainingRun:
    """One W&B run of a training job (PPO, the session predictor); never fatal, like :class:`Tracker`.

    ``log(row)`` logs a row's numbers (keys as given: ``charts/...``, ``losses/...``, ``perf/...``) against
    ``step_metric``, which every row carries; ``summarize(values)`` sets summary values; ``finish()`` closes the
    run. Rows are written synchronously (a training job logs a row per iteration or epoch, not per window).
    """

    NAMESPACES = ("charts/*", "losses/*", "perf/*", "eval/*")

    def __init__(self, target: WandbTarget, *, name: str, job_type: str, config: Mapping[str, Any],
                 step_metric: str, group: str | None = None, log: Callable[[str], None] = print) -> None:
        self.target = target
        self.step_metric = step_metric
        self._log = log
        self.run: Any = None
        if target.mode == "disabled":
            return
        self._try("start", lambda: self._start(name, job_type, group, config))

    def _start(self, name: str, job_type: str, group: str | None, config: Mapping[str, Any]) -> None:
        self.run = init_run(self.target, name=name, job_type=job_type, group=group, config=config)
        self.run.define_metric(self.step_metric)
        for pattern in self.NAMESPACES:
            self.run.define_metric(pattern, step_metric=self.step_metric)

    def _try(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # W&B must never cost the training: warn once, keep the local files
            self._log(f"warning: W&B {what} failed ({type(e).__name__}: {e}); W&B logging is off for the rest of "
                      "this job, its local files are complete")
            run, self.run = self.run, None
            if run is not None and what != "finish":
                try:
                    run.finish()
                except Exception:  # noqa: BLE001 - already reported
                    pass

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def log(self, row: Mapping[str, Any]) -> None:
        if self.run is not None:
            values = {k: v for k, v in row.items() if _is_number(v)}
            self._try("logging", lambda: self.run.log(values))

    def summarize(self, values: Mapping[str, Any]) -> None:
        if self.run is not None:
            self._try("summary", lambda: self.run.summary.update({k: v for k, v in values.items()
                                                                   if _is_number(v)}))

    def finish(self) -> None:
        if self.run is not None:
            run = self.run
            self._try("finish", lambda: finish_run(run))
            self.run = None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def table_columns(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, list[Any]]:
    """Columns of a W&B table, one type each (W&B types a column by its values): a column whose values are all
    numbers (or missing) keeps them (NaN and infinities become missing); any other column becomes text."""
    out: dict[str, list[Any]] = {}
    for name in names:
        values = [row.get(name) for row in rows]
        numeric = all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values)
        if numeric:
            out[name] = [v if v is not None and math.isfinite(v) else None for v in values]
        else:
            out[name] = [None if v is None else str(v) for v in values]
    return out


def window_metrics(row: Mapping[str, Any]) -> dict[str, Any]:
    """The W&B metrics of one history row (see the module docstring for the names)."""
    out: dict[str, Any] = {"sim_time_s": row["t_end"], "phase": row.get("phase", -1)}
    for key in ("token_hit_rate", "block_hit_rate", "ttft_mean_ms", "ttft_p99_ms", "evictions", "occupancy",
                "reward"):
        if _is_number(row.get(key)):
            out[f"window/{key}"] = row[key]
    for t, rate in (row.get("hit_rate_by_type") or {}).items():
        if _is_number(rate):
            out[f"window/hit_rate/{t}"] = rate
    for name, value in (row.get("params") or {}).items():
        if _is_number(value):
            out[f"params/{name}"] = value
    return out


# ----------------------------------------------------------------------------------------------------------------
# Reading an offline run back (no server needed)

_BLOCK = 32768  # LevelDB log blocks
_HEADER = 7  # record header: crc32c (4 B) | length (2 B, little endian) | type (1 B)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def offline_run_files(run_dir: str | Path) -> list[Path]:
    """The ``run-*.wandb`` files of the offline runs under an experiment's run folder."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))


def run_folders(wandb_parent: str | Path) -> list[Path]:
    """The run folders (offline and online) under ``<wandb_parent>/wandb``."""
    base = Path(wandb_parent) / "wandb"
    return sorted(f for pattern in ("offline-run-*", "run-*") for f in base.glob(pattern) if f.is_dir())


def run_file_status(folder: str | Path) -> dict[str, Any]:
    """What a run folder's ``run-<id>.wandb`` file says about the run: ``name``, ``job_type``, ``run_dir`` (from
    its config; None when absent) and ``complete`` (the file reads to the end and holds W&B's exit record, written
    by ``finish``; a run cut short by a kill has none)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"name": None, "job_type": None, "run_dir": None, "complete": False}
    files = sorted(Path(folder).glob("run-*.wandb"))
    if len(files) != 1:
        return out
    try:
        payloads = _records(files[0].read_bytes())
    except (ValueError, OSError, struct.error):
        return out
    for payload in payloads:
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: a torn record
            return {**out, "complete": False}
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["job_type"] = rec.run.display_name, rec.run.job_type
            for item in rec.run.config.update:
                if item.key == "run_dir":
                    out["run_dir"] = json.loads(item.value_json)
        elif kind == "exit":
            out["complete"] = True
    return out


def _records(data: bytes) -> list[bytes]:
    """The payloads of a W&B data file (a 7-byte file header, then LevelDB-log records in 32 KiB blocks)."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B data file (bad magic)")
    out, pending = [], b""
    pos = _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload = data[pos + _HEADER: pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(payload)
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            out.append(pending + payload)
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end of a file being written
            break
        else:
            raise ValueError(f"corrupt W&B data file: record type {kind} at byte {pos}")
    return out


def read_offline_run(path: str | Path) -> dict[str, Any]:
    """What an offline run file holds: ``run`` (name, group, job_type, project, entity), ``config``, ``history``
    (one dict per ``log`` call), ``summary`` and ``metrics`` (the ``define_metric`` definitions: name -> step
    metric). A logged table is a reference (``<key>/path``) to a JSON file under the run folder's ``files/``."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"run": {}, "config": {}, "history": [], "summary": {}, "metrics": {}}
    for payload in _records(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {"id": rec.run.run_id, "name": rec.run.display_name, "group": rec.run.run_group,
                          "job_type": rec.run.job_type, "project": rec.run.project, "entity": rec.run.entity}
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][_key(item)] = json.loads(item.value_json)
        elif kind == "metric":
            m = rec.metric
            out["metrics"][m.name or m.glob_name] = m.step_metric
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)
