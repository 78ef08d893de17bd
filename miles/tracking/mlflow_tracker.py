"""MLflow tracking: one run per job, on a local SQLite file unless told otherwise.

Each run logs the resolved config (``config/resolved.yaml``), the Hydra
overrides, the command line, the git commit of the code, flattened params
(within MLflow's key/value length and count limits: the full config is always
in the artifact) and per-step metrics, batched into one ``log_batch`` call
per step.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.config.schema import MilesConfig, TrackingConfig

log = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation): param key 250 chars, value 6000 chars,
# 100 params and 1000 metrics per log_batch call.
MAX_PARAM_KEY = 250
MAX_PARAM_VALUE = 6000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey")


def default_uri(cfg: TrackingConfig) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlruns.db`` in the working directory."""
    return cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"


def artifact_location(uri: str) -> str | None:
    """Artifacts of a SQLite store go next to the database file (``mlartifacts/``); other stores decide."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None


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
        leaf = prefix.rsplit(".", 1)[-1].lower()
        out[prefix] = "***" if d is not None and any(w in leaf for w in SECRET_WORDS) else str(d)
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


def git_info() -> dict[str, str]:
    """Commit and dirty flag of the repository the miles package is imported from ("unknown" outside git)."""
    src = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return {"git_commit": commit, "git_dirty": str(dirty).lower()}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": "unknown"}


class MlflowTracker:
    """Logs one miles job as one MLflow run."""

    def __init__(self, run: MilesConfig, *, resolved_yaml: str, overrides: list[str], config_dict: Mapping[str, Any]):
        import mlflow
        from mlflow.tracking import MlflowClient

        import miles

        self.uri = default_uri(run.tracking)
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(run.tracking.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            run.tracking.experiment, artifact_location=artifact_location(self.uri)
        )
        name = run.tracking.run_name or f"{run.algo.name}-{run.model.flavor}-{run.precision.name}-seed{run.seed}"
        tags = {
            "miles.command": " ".join([Path(sys.executable).name, "-m", "miles", *sys.argv[1:]]),
            "miles.overrides": " ".join(overrides),
            "miles.version": miles.__version__,
            **{f"miles.{k}": v for k, v in git_info().items()},
        }
        self.run_id = self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id
        self._log_params(clamp_params(flatten(config_dict)))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "resolved.yaml").write_text(resolved_yaml)
            (Path(tmp) / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
            self.client.log_artifacts(self.run_id, tmp, artifact_path="config")
        log.info("MLflow run %s (%s) at %s", self.run_id, name, self.uri)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """All metrics of one step in as few ``log_batch`` calls as the limits allow; non-finite values skipped."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + MAX_METRICS_PER_BATCH])

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class ConsoleTracker:
    """``tracking=none``: nothing is stored; the loop's log lines are the record."""

    run_id = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


def make_tracker(run: MilesConfig, **kwargs: Any) -> MlflowTracker | ConsoleTracker:
    return MlflowTracker(run, **kwargs) if run.tracking.backend == "mlflow" else ConsoleTracker()
