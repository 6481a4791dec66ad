"""Dashboards as code: the W&B report of an experiment run, with the panels its runs feed.

:func:`dashboard_spec` reads a run folder (``config.json``, ``cells/``) and returns a **spec**: a JSON-able report in
the structure of W&B's report API (``wandb_workspaces.reports.v2``): sections of panel grids, each grid a runset
(filters on the run's group, job type and config) with its panels. Four sections, as the README describes them:

* **Who wins**, one grid per workload x capacity x load: bars of ``final/token_hit_rate`` (and
  ``final/ttft_p99_ms`` under timed serving) by job type (the agent), mean and spread over seeds; then the summary
  run's ``cells`` table (every number of the run);
* **Adaptation over simulated time**, one grid per workload x capacity x load: ``window/token_hit_rate`` against
  ``sim_time_s`` by job type, and the workload ``phase`` against ``sim_time_s`` to mark the shifts;
* **Learned parameters**, one grid per agent whose parameters move: ``params/alpha_*``, ``params/w_*``,
  ``params/mu_*`` / ``params/sigma_*``, ``params/gamma`` (the names the runs hold) against ``sim_time_s``;
* **TTFT against load** (timed serving with several loads): ``final/ttft_p99_ms`` against ``config.load`` by job
  type, one grid per workload x capacity.

Every panel names its keys with where they live (``history``, ``summary``, ``config``), so a test can hold them
against what the runs really logged (:func:`sae_env.tracking.read_offline_run`).

:func:`build_report` turns a spec into a ``wandb_workspaces`` Report (the ``dashboards`` extra) and
:func:`save_report` saves it to the user's project (online). Offline, ``train.py dashboard RUN_DIR`` writes the spec
as ``RUN_DIR/dashboard.json``; after ``wandb sync`` of the runs, ``--wandb online`` builds the report from it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["SPEC_FORMAT", "build_report", "dashboard_spec", "panel_keys", "save_report", "spec_filters_match"]

SPEC_FORMAT = "saecache-dashboard"
SPEC_VERSION = 1
_PARAM_FAMILIES = (("Queue weights (alpha)", ("alpha_",)), ("Token-type weights", ("w_",)),
                   ("Re-access gaps (log-normal mu, sigma)", ("mu_", "sigma_")), ("Position decay", ("gamma",)))


def _eq(section: str, key: str, value: Any) -> dict[str, Any]:
    return {"section": section, "key": key, "op": "==", "value": value}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _label(workload: str, capacity: Any, load: Any) -> str:
    return f"{workload}, capacity {capacity}" + ("" if load is None else f", load {load:g}")


def dashboard_spec(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The report spec of an experiment run folder (module docstring). ValueError when it holds no finished cell."""
    from sae_env.experiment import load_results

    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise ValueError(f"{run_dir}: not an experiment run folder (no config.json); give runs/<experiment>/<run-id>")
    config = json.loads(config_path.read_text())
    results = load_results(run_dir)
    if not results:
        raise ValueError(f"{run_dir}: no finished cell yet (cells/ is empty)")
    group = (config.get("wandb") or {}).get("group") or config["name"]
    cells = [r["cell"] for r in results.values()]
    combos: list[tuple[str, Any, Any]] = []
    for c in cells:
        key = (c["workload"], c["capacity"], c.get("load"))
        if key not in combos:
            combos.append(key)
    timed = any(_is_number(r["summary"].get("ttft_p99_ms")) for r in results.values())
    runs = [{"section": "run", "key": "Group", "op": "==", "value": group},
            {"section": "run", "key": "JobType", "op": "!=", "value": "summary"}]

    def grid(title: str, filters: list[dict[str, Any]], panels: list[dict[str, Any]]) -> dict[str, Any]:
        return {"title": title, "runset": {"name": title, "filters": filters, "groupby": ["JobType"]},
                "panels": panels}

    def cell_filters(workload: str, capacity: Any, load: Any) -> list[dict[str, Any]]:
        return runs + [_eq("config", "workload", workload), _eq("config", "capacity", capacity),
                       _eq("config", "load", load)]

    bars = [{"type": "bar", "title": "Token hit rate", "metrics": ["final/token_hit_rate"], "source": "summary"}]
    if timed:
        bars.append({"type": "bar", "title": "TTFT p99 (ms)", "metrics": ["final/ttft_p99_ms"], "source": "summary"})
    who = [grid(_label(*k), cell_filters(*k), bars) for k in combos]
    who.append({"title": "Every cell", "runset": {"name": "summary run", "filters": [
        {"section": "run", "key": "Group", "op": "==", "value": group}, _eq("run", "JobType", "summary")],
        "groupby": []}, "panels": [{"type": "table", "title": "cells", "table": "cells"}]})
    adapt = [grid(_label(*k), cell_filters(*k), [
        {"type": "line", "title": "Window token hit rate", "x": "sim_time_s", "y": ["window/token_hit_rate"],
         "source": "history"},
        {"type": "line", "title": "Workload phase", "x": "sim_time_s", "y": ["phase"], "source": "history"}])
        for k in combos]
    learned = []
    for agent in dict.fromkeys(c["agent"]["name"] for c in cells):
        names = _moving_params([r for r in results.values() if r["cell"]["agent"]["name"] == agent])
        panels = []
        for title, prefixes in _PARAM_FAMILIES:
            keys = [f"params/{n}" for n in names if n.startswith(prefixes)]
            if keys:
                panels.append({"type": "line", "title": title, "x": "sim_time_s", "y": keys, "source": "history"})
        other = [f"params/{n}" for n in names if not any(n.startswith(p) for _, ps in _PARAM_FAMILIES for p in ps)]
        if other:
            panels.append({"type": "line", "title": "Other parameters", "x": "sim_time_s", "y": other,
                           "source": "history"})
        if panels:
            learned.append(grid(f"{agent}: parameters over simulated time",
                                runs[:1] + [_eq("run", "JobType", agent)], panels))
    sections = [{"name": "Who wins", "grids": who},
                {"name": "Adaptation over simulated time (phases mark the workload's shifts)", "grids": adapt}]
    if learned:
        sections.append({"name": "Learned parameters", "grids": learned})
    loads = {c.get("load") for c in cells} - {None}
    if timed and len(loads) > 1:
        pairs = list(dict.fromkeys((w, cap) for w, cap, _ in combos))
        sections.append({"name": "TTFT against load", "grids": [
            grid(f"{w}, capacity {cap}", runs + [_eq("config", "workload", w), _eq("config", "capacity", cap)],
                 [{"type": "scatter", "title": "TTFT p99 (ms) against load", "x": "config.load",
                   "y": "final/ttft_p99_ms", "source": "summary"}]) for w, cap in pairs]})
    return {"format": SPEC_FORMAT, "version": SPEC_VERSION, "title": f"{config['name']}: who wins, adaptation, "
            "learned parameters, latency", "description": config.get("description") or "", "group": group,
            "project": (config.get("wandb") or {}).get("project"), "run_dir": str(run_dir), "sections": sections}


def _moving_params(results: list[Mapping[str, Any]]) -> list[str]:
    """Parameter names whose value changes over some cell's windows (what an adaptive agent learned)."""
    moving: dict[str, None] = {}
    for r in results:
        history = r.get("history") or []
        names = dict.fromkeys(k for row in history for k in (row.get("params") or {}))
        for name in names:
            values = {row.get("params", {}).get(name) for row in history}
            if len(values) > 1:
                moving[name] = None
    return list(moving)


def panel_keys(panel: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (where, key) pairs a panel reads: ``history``, ``summary`` or ``config`` keys, or a ``table``."""
    if panel["type"] == "table":
        return [("table", panel["table"])]
    if panel["type"] == "bar":
        return [("summary", k) for k in panel["metrics"]]
    if panel["type"] == "line":
        return [("history", panel["x"])] + [("history", k) for k in panel["y"]]
    if panel["type"] == "scatter":
        out = []
        for axis in (panel["x"], panel["y"]):
            out.append(("config", axis.split(".", 1)[1]) if axis.startswith("config.") else (panel["source"], axis))
        return out
    raise ValueError(f"unknown panel type {panel['type']!r}")


def spec_filters_match(filters: list[Mapping[str, Any]], run: Mapping[str, Any]) -> bool:
    """Whether a run read back by :func:`sae_env.tracking.read_offline_run` passes a runset's filters."""
    fields = {"Group": run["run"].get("group"), "JobType": run["run"].get("job_type"), "Name": run["run"].get("name")}
    for f in filters:
        value = fields.get(f["key"]) if f["section"] == "run" else run.get(f["section"], {}).get(f["key"])
        if (value == f["value"]) != (f["op"] == "=="):
            return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# W&B's report API (online)


def build_report(spec: Mapping[str, Any], project: str, entity: str | None = None) -> Any:
    """The spec as a ``wandb_workspaces`` Report (not saved). ImportError without the ``dashboards`` extra."""
    import wandb_workspaces.expr as ex
    import wandb_workspaces.reports.v2 as wr

    def expr(f: Mapping[str, Any]) -> Any:
        field = {"run": ex.Metric, "config": ex.Config, "summary": ex.Summary}[f["section"]](f["key"])
        return field == f["value"] if f["op"] == "==" else field != f["value"]

    def panel(p: Mapping[str, Any]) -> Any:
        if p["type"] == "bar":
            return wr.BarPlot(title=p["title"], metrics=[wr.SummaryMetric(k) for k in p["metrics"]],
                              groupby_aggfunc="mean", groupby_rangefunc="stddev")
        if p["type"] == "line":
            return wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]), groupby_aggfunc="mean",
                               groupby_rangefunc="stddev")
        if p["type"] == "scatter":
            axes = [wr.Config(a.split(".", 1)[1]) if a.startswith("config.") else wr.SummaryMetric(a)
                    for a in (p["x"], p["y"])]
            return wr.ScatterPlot(title=p["title"], x=axes[0], y=axes[1])
        if p["type"] == "table":
            return wr.WeavePanelSummaryTable(table_name=p["table"])
        raise ValueError(f"unknown panel type {p['type']!r}")

    owner = {} if entity is None else {"entity": entity}
    blocks: list[Any] = []
    if spec.get("description"):
        blocks.append(wr.P(spec["description"]))
    for section in spec["sections"]:
        blocks.append(wr.H1(section["name"]))
        for g in section["grids"]:
            blocks.append(wr.H2(g["title"]))
            rs = g["runset"]
            runset = wr.Runset(project=project, name=rs["name"], filters=ex.And(*(expr(f) for f in rs["filters"])),
                               groupby=list(rs["groupby"]), **owner)
            blocks.append(wr.PanelGrid(runsets=[runset], panels=[panel(p) for p in g["panels"]]))
    return wr.Report(project=project, title=spec["title"], description=f"W&B group {spec['group']}",
                     blocks=blocks, **owner)


def save_report(spec: Mapping[str, Any], project: str, entity: str | None = None) -> str:
    """Build and save the report to the user's W&B project (online, logged in); returns its URL."""
    report = build_report(spec, project, entity)
    report.save()
    return str(report.url)
