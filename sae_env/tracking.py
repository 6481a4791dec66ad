"""W&B tracking of an experiment: one run per cell, one summary run; offline by default; never fatal.

Every cell becomes a W&B run (group = the experiment, job type = the agent, name = the cell id, config = the cell)
with, per window, metrics stepped on **simulated time** (``define_metric("window/*", step_metric="sim_time_s")``):
``window/token_hit_rate``, ``window/block_hit_rate``, ``window/ttft_mean_ms``, ``window/ttft_p99_ms``,
``window/evictions``, ``window/occupancy``, ``window/reward``, ``window/hit_rate/<TokenType>``; the agent's
parameters in effect (``params/<name>``: alpha per queue, type weights, mu / sigma, gamma for SAECache) and the
workload ``phase`` (index into the trace's phase schedule; -1 none). The run's summary holds the cell's totals
(``final/token_hit_rate``, ``final/ttft_p99_ms``, ...). A last run (job type ``summary``) holds a ``wandb.Table``
of every cell and the report's plots as images.

Modes: ``offline`` (default: no network, not even a DNS lookup; ``wandb sync <run-dir>/wandb/offline-run-*``
uploads later), ``online``
(the user's account), ``disabled``. Runs go under ``<run-dir>/wandb``. If W&B cannot be imported or fails, the
tracker warns once and turns itself off: the local files of the experiment are the record that always exists.
Runs are written by one background thread, in the order the cells finish: a W&B run costs ~0.7 s (mostly waiting
on W&B's service process), which then overlaps with the cells still running; :meth:`Tracker.close` waits for it.

Offline runs are one binary ``run-<id>.wandb`` file (LevelDB-log framing, protobuf records) that ``wandb.Api``
cannot read without a server; :func:`read_offline_run` parses it so that tests (and users) can check what was
logged.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "offline_run_files", "read_offline_run"]


class Tracker:
    """Logs cells and the summary of an experiment to W&B (see the module docstring)."""

    def __init__(self, config: Any, run_dir: str | Path, mode: str | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.mode = mode or config.wandb.mode
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb mode must be offline, online or disabled, got {self.mode!r}")
        self.enabled = self.mode != "disabled"
        self.group = config.wandb.group or config.name
        self._log = log
        self._wandb: Any = None
        self._pool: Any = None  # one writer thread, started on first use

    # -- the W&B module, imported once and on first use (it costs ~1 s)
    def _module(self) -> Any:
        if self._wandb is None:
            # W&B mistakes our ``agents`` package for the OpenAI Agents SDK and advertises Weave on every init.
            os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
            if self.mode == "offline":
                # W&B's service process resolves the default server's host name at start-up even offline (a DNS
                # query off the machine, seen with strace); a loopback server address, read from the environment
                # when the service starts, stops it. Nothing is sent there offline, and the address is not stored
                # in the run: `wandb sync` later uses the syncing user's settings.
                os.environ.setdefault("WANDB_BASE_URL", "http://127.0.0.1")
            import wandb

            self._wandb = wandb
        return self._wandb

    def _init(self, name: str, job_type: str, config: Mapping[str, Any]) -> Any:
        wandb = self._module()
        wandb_dir = self.run_dir  # wandb adds its own "wandb/" folder under it
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True,
                                  disable_git=True, save_code=False, disable_job_creation=True)
        return wandb.init(mode=self.mode, project=self.config.wandb.project, entity=self.config.wandb.entity,
                          group=self.group, job_type=job_type, name=name, config=dict(config),
                          dir=str(wandb_dir), settings=settings, reinit="create_new")

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

    def _log_cell(self, cell: Any, result: Mapping[str, Any]) -> None:
        config = {"experiment": self.config.name, "run_dir": str(self.run_dir), **result.get("cell", {})}
        run = self._init(cell.id, cell.agent, config)
        try:
            run.define_metric("sim_time_s")
            for pattern in ("window/*", "params/*", "phase"):
                run.define_metric(pattern, step_metric="sim_time_s")
            for row in result.get("history", []):
                run.log(window_metrics(row))
            run.summary.update({f"final/{k}": v for k, v in result.get("summary", {}).items()
                                if _is_number(v)})
        finally:
            run.finish()

    def log_summary(self, experiment_run: Any, plots: Sequence[str | Path]) -> None:
        """The summary run: a table of every cell (the rows of summary.csv) and the plots as images."""
        self._guard("summary", lambda: self._log_summary(experiment_run, plots))

    def _log_summary(self, experiment_run: Any, plots: Sequence[str | Path]) -> None:
        import csv

        wandb = self._module()
        path = self.run_dir / "summary.csv"
        if not path.exists():
            return
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
        run = self._init(f"{self.config.name}-summary", "summary", {"experiment": self.config.name,
                                                                      "cells": len(experiment_run.cells)})
        try:
            if rows:
                run.log({"cells": wandb.Table(columns=rows[0], data=rows[1:])})
            images = {f"plots/{Path(p).stem}": wandb.Image(str(p)) for p in plots if str(p).endswith(".png")}
            if images:
                run.log(images)
        finally:
            run.finish()

    def close(self) -> None:
        """Wait until every queued run is written (each run is finished where it starts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    """What an offline run file holds: ``run`` (name, group, job_type), ``config``, ``history`` (one dict per
    ``log`` call), ``summary`` and ``metrics`` (the ``define_metric`` definitions: name -> step metric)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"run": {}, "config": {}, "history": [], "summary": {}, "metrics": {}}
    for payload in _records(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {"id": rec.run.run_id, "name": rec.run.display_name, "group": rec.run.run_group,
                          "job_type": rec.run.job_type, "project": rec.run.project}
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
