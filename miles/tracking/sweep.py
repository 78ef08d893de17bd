"""Sweeps in MLflow: one parent run per ``-m`` sweep, one child run per job, and a summary table.

A Hydra callback (registered under ``hydra.callbacks`` in ``conf/config.yaml``):

- ``on_multirun_start`` (driver process) creates the parent run and writes its id to
  ``<sweep dir>/.miles/sweep.json``. Jobs read it from there (:func:`job_launch`), which works for
  the basic launcher (jobs in this process, one after another) and for launchers that run jobs in
  other processes (``hydra/launcher=joblib``) alike. Each job's run gets the tag
  ``mlflow.parentRunId`` (the MLflow UI nests it under the parent) and ``miles.sweep.job``.
- ``on_job_end`` (the job's process) writes ``<sweep dir>/.miles/jobs/<num>.json``: overrides, status,
  the task's return value (``eval/accuracy``, the objective of the Optuna sweeper) or the error.
- ``on_multirun_end`` (driver) joins these with the children's final metrics into
  ``summary/summary.csv``, ``summary.md`` and ``summary.html`` on the parent and ends it: FINISHED,
  or FAILED when a job failed. When a failing job ends the sweep early, Hydra skips
  ``on_multirun_end``; an exit handler then writes the summary and ends the parent as FAILED.
"""

from __future__ import annotations

import atexit
import csv
import html
import json
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from miles.tracking.snapshot import Launch, command_line, git_info, redact_argv

log = logging.getLogger(__name__)

STATE_DIR = ".miles"
# columns of the markdown/html table (the CSV has every final metric)
SUMMARY_METRICS = ("eval/accuracy", "eval/greedy_accuracy", "train/reward_mean", "train/loss", "perf/wall_time_s")


def _tracking(config: DictConfig) -> tuple[str | None, str]:
    """(tracking URI or None when tracking is off, experiment) of a composed config."""
    if OmegaConf.select(config, "tracking.backend") != "mlflow":
        return None, ""
    uri = (OmegaConf.select(config, "tracking.uri") or os.environ.get("MLFLOW_TRACKING_URI")
           or f"sqlite:///{Path.cwd() / 'mlruns.db'}")
    return str(uri), str(OmegaConf.select(config, "tracking.experiment") or "miles")


def _state_dir(config: DictConfig) -> Path:
    return Path(str(config.hydra.sweep.dir)) / STATE_DIR


def job_launch(config: DictConfig | None = None) -> Launch:
    """What the running job knows about how it was launched (inside a Hydra job: also its sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    composed = None if config is None else OmegaConf.to_yaml(config, resolve=False)
    if not HydraConfig.initialized():
        return Launch(argv=tuple(sys.argv), composed_yaml=composed)
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return Launch(argv=tuple(sys.argv), composed_yaml=composed)
    parent = None
    state = Path(str(hc.sweep.dir)) / STATE_DIR / "sweep.json"
    if state.is_file():
        parent = json.loads(state.read_text()).get("parent_run_id")
    return Launch(argv=tuple(sys.argv), composed_yaml=composed, parent_run_id=parent,
                  sweep_job=int(hc.job.num))


class MlflowSweepCallback(Callback):
    """Hydra callback: a parent MLflow run per sweep with a summary table of its jobs."""

    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self._uri: str | None = None
        self._state: Path | None = None
        self._done = False

    # -- driver --------------------------------------------------------------------------------
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        uri, experiment = _tracking(config)
        if uri is None:
            return
        from mlflow.tracking import MlflowClient

        from miles.tracking.mlflow_tracker import artifact_location, bound_http_retries

        bound_http_retries(float(OmegaConf.select(config, "tracking.request_timeout_s") or 10.0))
        self._state = _state_dir(config)
        self._state.mkdir(parents=True, exist_ok=True)
        overrides = redact_argv(list(config.hydra.overrides.task))
        choices = config.hydra.runtime.choices
        try:
            client = MlflowClient(uri)
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(
                experiment, artifact_location=artifact_location(uri))
            tags = {
                "miles.sweep": "true",
                "miles.command": command_line(),
                "miles.overrides": " ".join(overrides),
                "miles.sweeper": str(choices.get("hydra/sweeper")),
                "miles.launcher": str(choices.get("hydra/launcher")),
                "miles.sweep_dir": str(Path(str(config.hydra.sweep.dir)).resolve()),
                **{f"miles.{k}": v for k, v in git_info().items()},
            }
            name = OmegaConf.select(config, "tracking.run_name") or f"sweep-{Path(str(config.hydra.sweep.dir)).name}"
            self.parent_run_id = client.create_run(exp_id, run_name=f"{name}", tags=tags).info.run_id
        except Exception as e:  # noqa: BLE001 - the sweep runs without a parent then
            log.warning("could not create the sweep's parent MLflow run at %s (%s: %s); the jobs log "
                        "their own runs without a parent", uri, type(e).__name__, e)
            return
        self._uri = uri
        (self._state / "sweep.json").write_text(json.dumps(
            {"parent_run_id": self.parent_run_id, "tracking_uri": uri, "experiment_id": exp_id}))
        atexit.register(self._finish, "FAILED")
        log.info("sweep parent MLflow run %s at %s", self.parent_run_id, uri)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish("FINISHED")

    # -- job process ---------------------------------------------------------------------------
    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return
        jobs = _state_dir(config) / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        ok = job_return.status == JobStatus.COMPLETED
        value = job_return._return_value  # noqa: SLF001 - .return_value re-raises a failure
        record = {
            "job": int(config.hydra.job.num),
            "overrides": redact_argv(list(job_return.overrides or [])),
            "status": "COMPLETED" if ok else "FAILED",
            "return_value": float(value) if ok and isinstance(value, int | float) else None,
            "error": None if ok else f"{type(value).__name__}: {value}",
        }
        (jobs / f"{record['job']}.json").write_text(json.dumps(record))

    # -- summary -------------------------------------------------------------------------------
    def _finish(self, status: str) -> None:
        if self._done or self.parent_run_id is None or self._state is None:
            return
        self._done = True
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self._uri)
        try:
            rows = summary_rows(client, self.parent_run_id, self._state / "jobs")
            if any(r["status"] != "COMPLETED" for r in rows):
                status = "FAILED"
            with tempfile.TemporaryDirectory() as tmp:
                write_summary(rows, Path(tmp))
                client.log_artifacts(self.parent_run_id, tmp, artifact_path="summary")
            returns = [(r["return_value"], r["job"]) for r in rows if isinstance(r["return_value"], float)]
            metrics = [Metric("sweep/num_jobs", len(rows), 0, 0),
                       Metric("sweep/num_failed", sum(r["status"] != "COMPLETED" for r in rows), 0, 0)]
            if returns:
                best, job = max(returns)
                metrics += [Metric("sweep/best_return", best, 0, 0), Metric("sweep/best_job", job, 0, 0)]
            client.log_batch(self.parent_run_id, metrics=metrics)
            log.info("sweep summary of %d job(s) logged to parent run %s", len(rows), self.parent_run_id)
        except Exception as e:  # noqa: BLE001
            log.warning("could not log the sweep summary to run %s: %s: %s", self.parent_run_id, type(e).__name__, e)
        try:
            client.set_terminated(self.parent_run_id, status=status)
        except Exception as e:  # noqa: BLE001
            log.warning("could not end the sweep's parent run %s: %s", self.parent_run_id, e)


def summary_rows(client: Any, parent_run_id: str, jobs_dir: Path) -> list[dict[str, Any]]:
    """One row per job: number, overrides, status, return value, child run id and final metrics."""
    parent = client.get_run(parent_run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=10000)
    by_job = {c.data.tags.get("miles.sweep.job"): c for c in children}
    records = {}
    if jobs_dir.is_dir():
        for p in jobs_dir.glob("*.json"):
            r = json.loads(p.read_text())
            records[str(r["job"])] = r
    rows = []
    for job in sorted(set(records) | {k for k in by_job if k is not None}, key=int):
        rec, child = records.get(job, {}), by_job.get(job)
        metrics = {k: v for k, v in (child.data.metrics if child else {}).items()
                   if not k.startswith("system/") and not re.fullmatch(r"p\d+", k.rsplit("/", 1)[-1])}
        rows.append({
            "job": int(job),
            "overrides": " ".join(rec.get("overrides") or (child.data.tags.get("miles.overrides", "").split() if child else [])),
            "status": rec.get("status") or (child.info.status if child else "UNKNOWN"),
            "return_value": rec.get("return_value"),
            "run_id": child.info.run_id if child else "",
            "error": rec.get("error") or "",
            "metrics": metrics,
        })
    # the overrides that differ between jobs (the swept ones), for the tables people read
    common = set.intersection(*(set(r["overrides"].split()) for r in rows)) if len(rows) > 1 else set()
    for r in rows:
        r["swept"] = " ".join(o for o in r["overrides"].split() if o not in common)
    return rows


def write_summary(rows: list[dict[str, Any]], dest: Path) -> list[Path]:
    """``summary.csv`` (all overrides, every final metric), ``summary.md`` and ``summary.html`` (swept overrides,
    the main metrics)."""
    all_metrics = sorted({k for r in rows for k in r["metrics"]})
    shown = [m for m in SUMMARY_METRICS if m in all_metrics]
    head = ["job", "swept", "overrides", "status", "return_value", "run_id"]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.4g}"
        return "" if v is None else str(v)

    with (dest / "summary.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head + ["error"] + all_metrics)
        for r in rows:
            w.writerow([r[h] if r[h] is not None else "" for h in head] + [r["error"]]
                       + [repr(r["metrics"][m]) if m in r["metrics"] else "" for m in all_metrics])
    brief = [h for h in head if h != "overrides"]
    table = [[fmt(r[h]) for h in brief] + [fmt(r["metrics"].get(m)) for m in shown] for r in rows]
    cols = brief + shown
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table]
    (dest / "summary.md").write_text("\n".join(md) + "\n")
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in table)
    (dest / "summary.html").write_text(
        "<table border='1' cellpadding='4'>\n<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        + "</tr>\n" + cells + "</table>\n")
    return [dest / "summary.csv", dest / "summary.md", dest / "summary.html"]
