"""Send tracking data from a background thread, so that a slow or dead server never stops training.

The training loop only appends to the outbox (microseconds). One daemon thread
creates the MLflow run (experiment, tags, params, config artifacts) and sends
metrics in ``log_batch`` calls of up to 1,000. When the server cannot be reached
the data stays buffered, one warning says so (one per outage, not per step),
and the thread retries with a growing pause (1 s doubling to ``retry_max_s``);
when the server is back everything buffered is sent and an info line says so.
:meth:`Outbox.close` gives the thread ``flush_timeout_s`` to send the rest and
end the run; whatever is still unsent then is written to a JSON-lines file
next to the working directory and named in a warning.

Errors that retrying cannot fix (MLflow rejecting a value: ``INVALID_PARAMETER_VALUE``
and the like) drop the offending item with a warning instead of blocking the queue.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
MAX_PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH: params and tags together
# MLflow error codes that mean "this request is wrong", not "the server is unavailable"
PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS",
                    "RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED", "UNAUTHENTICATED"}


def is_permanent(e: BaseException) -> bool:
    """True for an error that a retry cannot fix (MLflow rejected the request itself)."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.error_code in PERMANENT_ERRORS


@dataclass
class RunSpec:
    """What creating the run needs: where, under which experiment and name, and what to log first."""

    uri: str
    experiment: str
    run_name: str
    tags: dict[str, str]
    params: dict[str, str]
    artifact_dir: Path | None
    artifact_location: str | None = None


class Outbox:
    """A queue of metrics and artifact uploads for one MLflow run, drained by a daemon thread."""

    def __init__(self, spec: RunSpec, *, retry_max_s: float = 30.0):
        self.spec = spec
        self.retry_max_s = retry_max_s
        self.run_id: str | None = None
        self.down_since: float | None = None
        self.warnings = 0
        self._metrics: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self._uploads: list[tuple[Path, str | None]] = []
        self._status: str | None = None  # set by close(): the run's final status
        self._terminated = False
        self._rest_tags: list[Any] = []  # tags past the first 100, params: sent after the run exists
        self._tags: dict[str, str] = {}  # tags set while the run goes on (put_tags)
        self._params: list[Any] = []
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._client: Any = None
        self._thread = threading.Thread(target=self._loop, name="miles-tracking", daemon=True)
        self._thread.start()

    # -- producer side (the training loop) ---------------------------------------------------
    def put_metrics(self, metrics: list[tuple[str, float, int, int]]) -> None:
        """Queue ``(key, value, timestamp_ms, step)`` tuples."""
        with self._cond:
            self._metrics.extend(metrics)
            self._cond.notify()

    def put_tags(self, tags: dict[str, str]) -> None:
        """Queue tags set while the run goes on (a tag set twice keeps its last value)."""
        with self._cond:
            self._tags.update(tags)
            self._cond.notify()

    def put_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        with self._cond:
            self._uploads.append((local_dir, artifact_path))
            self._cond.notify()

    @property
    def buffered(self) -> int:
        """Metrics waiting to be sent."""
        with self._cond:
            return len(self._metrics)

    def close(self, status: str, timeout_s: float) -> bool:
        """End the run with ``status`` after sending what is buffered; wait at most ``timeout_s``.

        Returns True when everything reached the server. Otherwise the unsent metrics are written
        to ``mlflow_unsent_<time>.jsonl`` in the working directory.
        """
        with self._cond:
            self._status = status
            self._cond.notify()
        self._closing.set()
        self._thread.join(timeout_s)
        if self._terminated:
            return True
        with self._cond:
            unsent, self._metrics = self._metrics, []
            self._status = "ABANDONED"  # the thread stops at its next turn
            self._cond.notify()
        path = Path.cwd() / f"mlflow_unsent_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.jsonl"
        with path.open("w") as f:
            for m in unsent:
                f.write(json.dumps(dict(zip(("key", "value", "timestamp", "step"), m, strict=True))) + "\n")
        log.warning("tracking server %s did not take the run's last data within %.0fs: %d metric(s) not sent "
                    "(saved to %s)%s", self.spec.uri, timeout_s, len(unsent), path,
                    "" if self.run_id else "; the MLflow run was never created")
        return False

    # -- consumer side (the thread) ------------------------------------------------------------
    def _loop(self) -> None:
        pause = 1.0
        while True:
            with self._cond:
                if self._status == "ABANDONED":
                    return
                if not (self._metrics or self._uploads or self._tags or self._status or self.run_id is None):
                    self._cond.wait(timeout=5.0)
                    continue
            try:
                self._send_once()
            except Exception as e:  # noqa: BLE001 - anything the server or the network throws
                self._went_down(e)
                if self._status is None:
                    self._closing.wait(timeout=pause)  # new metrics do not shorten the pause; close() does
                else:
                    time.sleep(min(pause, 2.0))  # closing: retry at least every 2 s
                if self._status == "ABANDONED":
                    return
                pause = min(pause * 2, self.retry_max_s)
                continue
            pause = 1.0
            if self.down_since is not None:
                log.info("tracking server %s is reachable again after %.0fs; buffered data sent (run %s)",
                         self.spec.uri, time.monotonic() - self.down_since, self.run_id)
                self.down_since = None
            if self._terminated:
                return

    def _went_down(self, e: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.warnings += 1
            log.warning("tracking server %s unreachable (%s: %s); training continues, metrics are buffered "
                        "(%d so far) and sent when it is back", self.spec.uri, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "", self.buffered)

    def _send_once(self) -> None:
        """One pass: create the run if needed, then send uploads and metrics; end the run when closing."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        if self._client is None:
            self._client = MlflowClient(self.spec.uri)
        client, spec = self._client, self.spec
        if self.run_id is None:
            exp = client.get_experiment_by_name(spec.experiment)
            if exp is None:
                try:
                    exp_id = client.create_experiment(spec.experiment, artifact_location=spec.artifact_location)
                except Exception:  # another process created it meanwhile
                    exp = client.get_experiment_by_name(spec.experiment)
                    if exp is None:
                        raise
                    exp_id = exp.experiment_id
            else:
                exp_id = exp.experiment_id
            tags = dict(spec.tags)
            head = {k: tags.pop(k) for k in list(tags)[:MAX_PARAMS_PER_BATCH]}
            self.run_id = client.create_run(exp_id, run_name=spec.run_name, tags=head).info.run_id
            self._rest_tags = [RunTag(k, v) for k, v in tags.items()]
            self._params = [Param(k, v) for k, v in spec.params.items()]
            log.info("MLflow run %s (%s) at %s", self.run_id, spec.run_name, spec.uri)
        while self._rest_tags:
            client.log_batch(self.run_id, tags=self._rest_tags[:MAX_PARAMS_PER_BATCH])
            del self._rest_tags[:MAX_PARAMS_PER_BATCH]
        while self._params:
            self._guard("params", client.log_batch, self.run_id, params=self._params[:MAX_PARAMS_PER_BATCH])
            del self._params[:MAX_PARAMS_PER_BATCH]
        if spec.artifact_dir is not None:
            self._guard("artifacts", client.log_artifacts, self.run_id, str(spec.artifact_dir))
            spec.artifact_dir = None
        while True:
            with self._cond:
                tags = dict(list(self._tags.items())[:MAX_PARAMS_PER_BATCH])
            if not tags:
                break
            self._guard("tags", client.log_batch, self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            with self._cond:
                for k, v in tags.items():
                    if self._tags.get(k) == v:  # unless set again meanwhile
                        del self._tags[k]
        while True:
            with self._cond:
                batch = self._metrics[:MAX_METRICS_PER_BATCH]
                upload = self._uploads[0] if self._uploads else None
                closing = self._status
            if upload is not None:
                self._guard("artifacts", client.log_artifacts, self.run_id, str(upload[0]), artifact_path=upload[1])
                with self._cond:
                    self._uploads.pop(0)
                continue
            if not batch:
                break
            self._guard("metrics", client.log_batch, self.run_id, metrics=[Metric(*m) for m in batch])
            with self._cond:
                del self._metrics[:len(batch)]
        if closing and closing != "ABANDONED":
            client.set_terminated(self.run_id, status=closing)
            self._terminated = True

    def _guard(self, what: str, send: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``send(*args, **kwargs)``; an error a retry cannot fix drops the item with a warning, others propagate."""
        try:
            send(*args, **kwargs)
        except Exception as e:
            if not is_permanent(e):
                raise
            log.warning("MLflow rejected the run's %s and they are dropped: %s", what, str(e)[:300])
