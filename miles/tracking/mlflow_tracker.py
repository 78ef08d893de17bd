"""MLflow tracking: one run per job, on a local SQLite file unless told otherwise.

Each run logs a snapshot of itself (:mod:`miles.tracking.snapshot`: resolved and
composed config, overrides, command line, code version and diff, packages,
machine, seed), the flattened config as params (within MLflow's limits: the full
config is always in ``config/resolved.yaml``), per-step metrics, and at the end
PNG plots of the run (:mod:`miles.tracking.plots`). Optionally MLflow's system
metrics (CPU, memory, disk, network; GPU where present) every
``tracking.system_metrics_interval_s``.

Everything is sent by a background thread (:mod:`miles.tracking.outbox`): a slow
or unreachable tracking server never stops or slows training; metrics wait in
memory and are sent when it is back.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.config.schema import MilesConfig, TrackingConfig
from miles.tracking import timeline
from miles.tracking.outbox import Outbox, RunSpec
from miles.tracking.plots import History, write_plots
from miles.tracking.snapshot import REDACTED, Launch, is_secret_key, write_snapshot

log = logging.getLogger(__name__)

# MLflow 3.x limits (mlflow.utils.validation): param key 250 chars (MAX_ENTITY_KEY_LENGTH), param value
# 6000 chars (MAX_PARAM_VAL_LENGTH), tag value 8000 chars, 100 params+tags and 1000 metrics per log_batch.
MAX_PARAM_KEY = 250
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000


def default_uri(cfg: TrackingConfig) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlruns.db`` in the working directory."""
    return cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"


def artifact_location(uri: str) -> str | None:
    """Artifacts of a SQLite store go next to the database file (``mlartifacts/``); other stores decide."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None


def bound_http_retries(timeout_s: float) -> None:
    """Keep MLflow's own HTTP retries short (its defaults retry 7 times with backoff, for minutes).

    The outbox retries on its own schedule, so one request should fail fast. Values the user set
    in the environment win.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(timeout_s))))


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys to string values; values under secret-looking keys are redacted."""
    out: dict[str, str] = {}
    if isinstance(d, Mapping):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list | tuple) and any(isinstance(x, Mapping) for x in d):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}.{i}"))
    else:
        out[prefix] = REDACTED if d is not None and is_secret_key(prefix) else str(d)
    return out


def clamp_params(params: Mapping[str, str]) -> dict[str, str]:
    """Keep keys and values within MLflow's limits (long keys are skipped; long values truncated)."""
    out = {}
    for k, v in params.items():
        if len(k) > MAX_PARAM_KEY:
            log.warning("param key longer than %d chars not logged (it is in config/resolved.yaml): %s", MAX_PARAM_KEY, k[:80])
            continue
        out[k] = v if len(v) <= MAX_PARAM_VALUE else v[: MAX_PARAM_VALUE - 3] + "..."
    return out


def clamp_tags(tags: Mapping[str, str]) -> dict[str, str]:
    return {k[:MAX_PARAM_KEY]: (v if len(v) <= MAX_TAG_VALUE else v[: MAX_TAG_VALUE - 3] + "...")
            for k, v in tags.items()}


def default_run_name(run: MilesConfig) -> str:
    """``tracking.run_name``, else algo-model-precision-seed."""
    return run.tracking.run_name or f"{run.algo.name}-{run.model.flavor}-{run.precision.name}-seed{run.seed}"


class MlflowTracker:
    """Logs one miles job as one MLflow run; never raises because of the tracking server."""

    def __init__(self, run: MilesConfig, *, resolved_yaml: str, overrides: Sequence[str],
                 config_dict: Mapping[str, Any], launch: Launch | None = None):
        launch = launch or Launch()
        self.cfg = run.tracking
        self.uri = default_uri(run.tracking)
        bound_http_retries(run.tracking.request_timeout_s)
        self.history = History()
        self._tmp = Path(tempfile.mkdtemp(prefix="miles-tracking-"))
        tags = write_snapshot(self._tmp / "snapshot", resolved_yaml=resolved_yaml, overrides=overrides, launch=launch)
        tags["miles.seed"] = str(run.seed)
        if launch.parent_run_id:
            tags["mlflow.parentRunId"] = launch.parent_run_id
        if launch.sweep_job is not None:
            tags["miles.sweep.job"] = str(launch.sweep_job)
        if launch.source_run_id:
            tags["miles.reproduced_from"] = launch.source_run_id
        if run.trainer.resume_from is not None:
            tags["miles.resumed_from"] = str(run.trainer.resume_from)
        tags.update(launch.tags)
        name = default_run_name(run)
        if launch.sweep_job is not None and not run.tracking.run_name:
            name += f"-job{launch.sweep_job}"
        self._monitor_stop = threading.Event()
        self._monitor: threading.Thread | None = None
        spec = RunSpec(
            uri=self.uri, experiment=run.tracking.experiment, run_name=name, tags=clamp_tags(tags),
            params=clamp_params(flatten(config_dict)), artifact_dir=self._tmp / "snapshot",
            artifact_location=artifact_location(self.uri),
        )
        self._outbox = Outbox(spec)
        if run.tracking.system_metrics:
            self._start_system_metrics(run.tracking.system_metrics_interval_s)

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the run exists on the server (None while it is unreachable)."""
        return self._outbox.run_id

    @property
    def buffered(self) -> int:
        """Metrics not yet sent."""
        return self._outbox.buffered

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue one step's metrics (non-finite values are skipped); returns at once."""
        now = int(time.time() * 1000)
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self.history.add(finite, step)
        self._outbox.put_metrics([(k, v, now, step) for k, v in finite.items()])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags while the run goes on (e.g. ``miles.stop_reason``); returns at once."""
        self._outbox.put_tags(clamp_tags(tags))

    def log_distributions(self, values: Mapping[str, Sequence[float]], step: int) -> None:
        """Per-sample values of one step (e.g. ``train/reward``, ``rollout/response_len``).

        Logged as quantile metrics ``<key>/p0 .. /p100`` that the MLflow UI charts per step, and kept
        for the distribution plots at the end of the run.
        """
        out = {}
        for key, vals in values.items():
            vals = [float(v) for v in vals if math.isfinite(float(v))]
            if vals:
                out |= {f"{key}/p{q}": v for q, v in self.history.add_distribution(key, vals, step).items()}
        if out:
            self.log_metrics(out, step)

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        """Upload the files of ``local_dir`` under ``artifact_path`` (in the background; ``local_dir`` must
        stay until the run ends)."""
        self._outbox.put_artifacts(local_dir, artifact_path)

    def log_timeline(self, trace: Mapping[str, Any]) -> None:
        """A step's timeline (:mod:`miles.tracking.timeline`) as artifacts: ``timeline/step_<N>.json`` and
        ``plots/timeline_step_<N>.png``; returns once they are written locally (the upload is queued)."""
        dest = self._tmp / f"timeline-{trace['otherData']['step']}"
        timeline.write(dict(trace), dest)
        self._outbox.put_artifacts(dest)

    def finish(self, status: str = "FINISHED") -> None:
        """Plots and the metrics history as artifacts, then end the run (waiting at most ``tracking.flush_timeout_s``)."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        if self.cfg.plots:
            try:
                self.history.write_csv(self._tmp / "final" / "metrics")
                write_plots(self.history, self._tmp / "final" / "plots")
                self._outbox.put_artifacts(self._tmp / "final")
            except Exception as e:  # noqa: BLE001 - a plot must never fail the run
                log.warning("could not draw the run's plots: %s: %s", type(e).__name__, e)
        t0 = time.monotonic()
        self._outbox.close(status, timeout_s=self.cfg.flush_timeout_s)
        log.debug("tracking closed in %.2fs", time.monotonic() - t0)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _start_system_metrics(self, interval_s: float) -> None:
        """Sample CPU/memory/disk/network (and GPU) with MLflow's monitors; logged as ``system/*`` metrics."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id=None, sampling_interval=interval_s, tracking_uri=self.uri)
        except Exception as e:  # noqa: BLE001 - psutil missing, or an MLflow without system metrics
            log.warning("tracking.system_metrics: MLflow's system metrics are unavailable (%s: %s); "
                        "install psutil (and nvidia-ml-py for GPUs)", type(e).__name__, e)
            return

        def sample() -> None:
            step = 0
            while not self._monitor_stop.wait(interval_s):
                try:
                    monitor.collect_metrics()
                    metrics = {f"system/{k}": v for k, v in monitor.aggregate_metrics().items()}
                    for m in monitor.monitors:
                        m.clear_metrics()
                except Exception as e:  # noqa: BLE001
                    log.warning("system metrics sampling stopped: %s: %s", type(e).__name__, e)
                    return
                self.log_metrics(metrics, step)
                step += 1

        self._monitor = threading.Thread(target=sample, name="miles-system-metrics", daemon=True)
        self._monitor.start()


class ConsoleTracker:
    """``tracking=none``: nothing is stored; the loop's log lines are the record."""

    run_id = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def log_distributions(self, values: Mapping[str, Sequence[float]], step: int) -> None:
        pass

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


def make_tracker(run: MilesConfig, **kwargs: Any) -> Any:
    """MLflow (or the console) per ``tracking.backend``; with ``tracking.prometheus_port`` set, also live
    metrics for Prometheus (:class:`miles.tracking.prometheus.LiveTracker`)."""
    exporter = None
    if run.tracking.prometheus_port is not None:  # first: a port in use fails the run before MLflow starts
        from miles.tracking.prometheus import Exporter

        exporter = Exporter(run.tracking.prometheus_port, {"run": default_run_name(run), "model": run.model.flavor})
    try:
        tracker = MlflowTracker(run, **kwargs) if run.tracking.backend == "mlflow" else ConsoleTracker()
    except BaseException:
        if exporter is not None:
            exporter.close()
        raise
    if exporter is None:
        return tracker
    from miles.tracking.prometheus import LiveTracker

    return LiveTracker(tracker, exporter)
