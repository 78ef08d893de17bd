"""Live metrics for Prometheus: an HTTP exporter on 127.0.0.1, off by default (``tracking.prometheus_port``).

MLflow stays the run's record; the exporter shows the run while it goes on. It serves two kinds of series:

- **Step metrics.** Every metric the loop logs (``train/loss``, ``perf/step_time_s``, ...) becomes a gauge
  with its latest value, named ``miles_`` + the key with every character outside ``[a-zA-Z0-9_]`` made
  ``_`` (``train/loss`` -> ``miles_train_loss``); a multi-LoRA tenant's key ``tenant/<name>/<key>`` is served
  in the family of ``<key>`` with the label ``tenant="<name>"``. Non-finite values are exported as they are (NaN, +Inf),
  so that an alert can see them; MLflow skips them. Per-sample distributions (``train/reward``, ...)
  are exported as ``<name>_p0 .. _p100``. ``miles_step`` is the last step logged and
  ``miles_step_timestamp_seconds`` when (Unix time). Process memory (``mem/<actor>/<field>``,
  :mod:`miles.tracking.memory`) is one family per field with an ``actor`` label:
  ``miles_mem_rss_bytes{actor="engine0"}``.
- **Live rollout metrics**, updated by the dispatcher (:mod:`miles.rollout.dispatch`) as requests
  come and go: requests queued, requests in flight per engine, request latency and time to first token
  (histograms, from the request's arrival to its answer or first token, retries included, labelled by
  ``tenant``: the adapter the request named, empty without tenants), tokens generated per engine,
  retries, engines alive and lost.

Every series carries the labels ``run`` (the run name) and ``model``. ``tracking.prometheus_port: 0``
takes a free port, printed at start. docs/observability.md lists the families and the alert rules
(``miles/tracking/alerts.yml``).
"""

from __future__ import annotations

import logging
import math
import re
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from miles.tracking.memory import MEM_PREFIX, split_key
from miles.tracking.plots import quantiles

log = logging.getLogger(__name__)

PREFIX = "miles_"
HOST = "127.0.0.1"
# request latency buckets, seconds: a tiny model on CPU answers in tens of ms, a long reasoning trace in minutes
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# the families RolloutMetrics serves (a counter's samples end in _total, a histogram's in _bucket/_sum/_count)
LIVE_FAMILIES = (
    "miles_rollout_requests_queued",
    "miles_rollout_engines_in_rotation",
    "miles_rollout_engine_deaths",
    "miles_rollout_request_retries",
    "miles_rollout_request_latency_seconds",
    "miles_rollout_time_to_first_token_seconds",
    "miles_rollout_requests_in_flight",
    "miles_rollout_generated_tokens",
    "miles_rollout_requests",
)
RESERVED = {f + s for f in LIVE_FAMILIES for s in ("", "_total", "_created", "_bucket", "_sum", "_count")}

_active: RolloutMetrics | None = None  # the running exporter's rollout metrics, fed by the dispatcher


def metric_name(key: str) -> str:
    """``train/loss`` -> ``miles_train_loss``: the Prometheus name of a logged metric key."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def split_tenant(key: str) -> tuple[str, str]:
    """``tenant/a/train/loss`` -> ``("a", "train/loss")``; a key of no tenant -> ``("", key)``."""
    parts = key.split("/", 2)
    if len(parts) == 3 and parts[0] == "tenant" and parts[1] and parts[2]:
        return parts[1], parts[2]
    return "", key


def active() -> RolloutMetrics | None:
    """The running exporter's rollout metrics, or None while no exporter runs (the dispatcher's test)."""
    return _active


class RolloutMetrics:
    """What the dispatcher reports as it happens; labelled by engine index."""

    def __init__(self, registry: Any, labels: Mapping[str, str]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        names, values = [*labels, "engine"], list(labels.values())
        self._values = values
        self.registry = registry
        common = dict(registry=registry, labelnames=list(labels))
        self._sessions: weakref.WeakSet = (
            weakref.WeakSet()
        )  # the dispatcher's request queues (one per rollout)
        self.queued = Gauge(
            "miles_rollout_requests_queued", "Requests waiting for an engine", **common
        ).labels(*values)
        self.queued.set_function(self._queued)
        self.alive = Gauge("miles_rollout_engines_in_rotation", "Engines in rotation", **common).labels(
            *values
        )
        self.lost = Counter("miles_rollout_engine_deaths", "Engines taken out of rotation", **common).labels(
            *values
        )
        self.retried = Counter(
            "miles_rollout_request_retries", "Requests sent again after a failed call", **common
        ).labels(*values)
        per_tenant = dict(registry=registry, labelnames=[*labels, "tenant"], buckets=LATENCY_BUCKETS)
        self._latency = Histogram(
            "miles_rollout_request_latency_seconds",
            "Seconds from a request's arrival to its answer (queueing and retries included), per tenant "
            "(the adapter the request named; empty without tenants)",
            **per_tenant,
        )
        self._first_token = Histogram(
            "miles_rollout_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token (queueing and retries included), per tenant",
            **per_tenant,
        )
        self._per_tenant: dict[str, tuple[Any, Any]] = {}
        per_engine = dict(registry=registry, labelnames=names)
        self._inflight = Gauge(
            "miles_rollout_requests_in_flight", "Requests in calls not yet answered", **per_engine
        )
        self._tokens = Counter("miles_rollout_generated_tokens", "Response tokens generated", **per_engine)
        self._requests = Counter("miles_rollout_requests", "Requests answered", **per_engine)
        self._version = Gauge(
            "miles_rollout_engine_weight_version", "The weight version of the engine's last answer", **per_engine
        )
        self._per_engine: dict[int, tuple[Any, Any, Any, Any]] = {}

    def watch(self, session: Any) -> None:
        """Count ``session.queue`` in ``miles_rollout_requests_queued`` while its event loop runs."""
        self._sessions.add(session)

    def _queued(self) -> float:
        for _ in range(3):  # a rollout may start a session while a scrape reads them
            try:
                return float(sum(len(s.queue) for s in list(self._sessions) if not s.loop.is_closed()))
            except RuntimeError:
                continue
        return math.nan

    def _engine(self, engine: int) -> tuple[Any, Any, Any, Any]:
        """The engine's (in flight, tokens, requests, weight version) series; looked up once (``labels()``
        takes a lock)."""
        got = self._per_engine.get(engine)
        if got is None:
            values = (*self._values, str(engine))
            got = self._per_engine[engine] = (
                self._inflight.labels(*values),
                self._tokens.labels(*values),
                self._requests.labels(*values),
                self._version.labels(*values),
            )
        return got

    def inflight(self, engine: int) -> Any:
        return self._engine(engine)[0]

    def _tenant(self, tenant: str) -> tuple[Any, Any]:
        """The tenant's (latency, time to first token) histograms."""
        got = self._per_tenant.get(tenant)
        if got is None:
            values = (*self._values, tenant)
            got = self._per_tenant[tenant] = (
                self._latency.labels(*values),
                self._first_token.labels(*values),
            )
        return got

    def answered(
        self, engine: int, latency_s: float, tokens: int, first_token_s: float | None = None, tenant: str = "",
        weight_version: int | None = None,
    ) -> None:
        """A request answered by ``engine``: its latency, tokens and time to first token (None: the engine
        did not say), under ``tenant`` (the adapter it named; "" without tenants), and the weight version
        its last token was sampled from (None: not known)."""
        latency, first_token = self._tenant(tenant)
        latency.observe(latency_s)
        if first_token_s is not None:
            first_token.observe(first_token_s)
        _, tokens_total, requests_total, version = self._engine(engine)
        tokens_total.inc(tokens)
        requests_total.inc()
        if weight_version is not None:
            version.set(weight_version)


class _StepCollector:
    """Serves the latest value of every logged step metric as a gauge (built at scrape time)."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        # (Prometheus name, tenant) -> (key, value)
        self.latest: dict[tuple[str, str], tuple[str, float]] = {}
        self.memory: dict[tuple[str, str], float] = {}  # (field, actor) -> value, of mem/<actor>/<field>
        self.step = -1
        self.step_time = 0.0

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        latest = dict(self.latest)  # a snapshot: the loop may log while a scrape runs
        gauges: dict[str, Any] = {}
        for (name, tenant), (key, value) in sorted(latest.items()):
            g = gauges.get(name)
            if g is None:
                g = gauges[name] = GaugeMetricFamily(
                    name, f"miles metric {key} (latest logged value)", labels=names
                )
            if tenant:  # tenant/<name>/<key>: the family of <key>, with a tenant label
                g.add_sample(name, {**self.labels, "tenant": tenant}, value)
            else:
                g.add_metric(values, value)
        yield from gauges.values()
        families: dict[str, Any] = {}
        for (fld, actor), value in sorted(dict(self.memory).items()):
            g = families.get(fld)
            if g is None:
                g = families[fld] = GaugeMetricFamily(
                    metric_name(MEM_PREFIX + fld), f"Process memory, {fld} (miles.tracking.memory), per actor",
                    labels=[*names, "actor"])
            g.add_metric([*values, actor], value)
        yield from families.values()
        if self.step >= 0:
            for name, doc, value in (
                ("miles_step", "Last step logged", float(self.step)),
                ("miles_step_timestamp_seconds", "Unix time of the last step logged", self.step_time),
            ):
                g = GaugeMetricFamily(name, doc, labels=names)
                g.add_metric(values, value)
                yield g


class Exporter:
    """An HTTP server on 127.0.0.1:``port`` (0: a free one) serving ``/metrics``; :meth:`close` stops it."""

    def __init__(self, port: int, labels: Mapping[str, str]) -> None:
        global _active
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        if not 0 <= port <= 65535:
            raise ValueError(
                f"tracking.prometheus_port: expected a port in 0..65535 (0: a free one) or null "
                f"(off), found {port}"
            )
        self.registry = CollectorRegistry()
        ProcessCollector(
            registry=self.registry
        )  # process_resident_memory_bytes, cpu seconds, open fds (Linux)
        self.steps = _StepCollector(labels)
        self.registry.register(self.steps)
        self.rollout = RolloutMetrics(self.registry, labels)
        try:
            self._server, self._thread = start_http_server(port, addr=HOST, registry=self.registry)
        except OSError as e:
            raise OSError(
                f"tracking.prometheus_port={port}: cannot listen on {HOST}:{port} ({e}); pick another "
                "port, or 0 for a free one"
            ) from e
        self.port = self._server.server_address[1]
        _active = self.rollout
        log.info("Prometheus metrics at http://%s:%d/metrics", HOST, self.port)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/metrics"

    def set_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """The latest value of each step metric, and the step's number and time."""
        for k, v in metrics.items():
            actor_field = split_key(k)
            if actor_field is not None:  # mem/engine0/rss_bytes -> miles_mem_rss_bytes{actor="engine0"}
                self.steps.memory[(actor_field[1], actor_field[0])] = float(v)
                continue
            tenant, key = split_tenant(k)
            name = metric_name(key)
            if name in RESERVED:  # a live rollout family of that name is served instead
                continue
            self.steps.latest[(name, tenant)] = (key, float(v))
        if step >= self.steps.step:
            self.steps.step, self.steps.step_time = step, time.time()

    def set_distributions(self, values: Mapping[str, Sequence[float]], step: int) -> None:
        """Per-sample values of one step as quantile gauges ``<name>_p0 .. _p100``."""
        for key, vals in values.items():
            finite = [float(v) for v in vals if math.isfinite(float(v))]
            if finite:
                self.set_metrics({f"{key}/p{q}": v for q, v in quantiles(finite).items()}, step)

    def close(self) -> None:
        global _active
        if _active is self.rollout:
            _active = None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class LiveTracker:
    """A tracker (MLflow or console) that also feeds an :class:`Exporter`; everything else passes through."""

    def __init__(self, inner: Any, exporter: Exporter) -> None:
        self.inner, self.exporter = inner, exporter
        print(f"miles: Prometheus metrics at {exporter.url}", flush=True)

    def __getattr__(self, name: str) -> Any:  # run_id, buffered, history, ...
        return getattr(self.inner, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.exporter.set_metrics(metrics, step)
        self.inner.log_metrics(metrics, step)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.inner.set_tags(tags)

    def log_distributions(self, values: Mapping[str, Sequence[float]], step: int) -> None:
        self.exporter.set_distributions(values, step)
        self.inner.log_distributions(values, step)

    def finish(self, status: str = "FINISHED") -> None:
        try:
            self.inner.finish(status)
        finally:
            self.exporter.close()
