"""The Grafana dashboard of a run's live metrics, generated with grafana-foundation-sdk.

:data:`ROWS` says what the dashboard shows: one row per metric family of docs/observability.md, each
panel a list of PromQL queries over the exporter's series (:mod:`miles.tracking.prometheus`). The
variables ``$datasource``, ``$run``, ``$model``, ``$engine`` and ``$actor`` drill down to one run, one
model, one engine or one process. :func:`build` turns the rows into the dashboard's JSON with the SDK's
builders; the file shipped at ``miles/tracking/grafana/miles.json`` is its output (provisioning-ready:
point a Grafana file provider at the directory), and ``python -m miles.tracking.dashboard`` writes it
again. tests/test_observability.py checks the file is current and runs every query against a real
Prometheus that scraped a real run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).with_name("grafana") / "miles.json"
UID = "miles-run"

RUN = 'run=~"$run", model=~"$model"'
ENGINE = RUN + ', engine=~"$engine"'
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]
    """(PromQL, legend) pairs."""
    kind: str = "timeseries"
    """``timeseries``, or ``heatmap`` (one histogram query, its buckets by ``le``)."""
    description: str = ""


def _q(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(pairs)


def _quantiles(key: str, qs: tuple[int, ...] = (10, 50, 90)) -> tuple[tuple[str, str], ...]:
    return tuple((f"miles_{key}_p{q}{{{RUN}}}", f"p{q}") for q in qs)


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Rollout latency",
        (
            Panel(
                "Request latency (heatmap)",
                "s",
                _q(
                    (
                        f"sum by (le) (rate(miles_rollout_request_latency_seconds_bucket{{{RUN}}}{RATE}))",
                        "{{le}}",
                    )
                ),
                kind="heatmap",
                description="From a request's arrival in the dispatcher's queue to its answer",
            ),
            Panel(
                "Request latency quantiles",
                "s",
                tuple(
                    (
                        f"histogram_quantile({q}, sum by (le) (rate(miles_rollout_request_latency_seconds_bucket{{{RUN}}}{RATE})))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.9, 0.99)
                ),
            ),
            Panel(
                "Request latency per step (as MLflow has it)",
                "s",
                _quantiles("rollout_request_latency_s", (50, 90, 99)),
            ),
        ),
    ),
    (
        "Engines",
        (
            Panel(
                "Tokens/s per engine",
                "short",
                _q(
                    (
                        f"sum by (engine) (rate(miles_rollout_generated_tokens_total{{{ENGINE}}}{RATE}))",
                        "engine {{engine}}",
                    )
                ),
            ),
            Panel(
                "Requests in flight per engine",
                "short",
                _q((f"miles_rollout_requests_in_flight{{{ENGINE}}}", "engine {{engine}}")),
            ),
            Panel("Queue depth", "short", _q((f"miles_rollout_requests_queued{{{RUN}}}", "queued"))),
            Panel(
                "Engines in rotation, lost and restarted",
                "short",
                _q(
                    (f"miles_rollout_engines_in_rotation{{{RUN}}}", "in rotation"),
                    (f"miles_rollout_engine_deaths_total{{{RUN}}}", "lost"),
                    (f"miles_fault_engine_restarts{{{RUN}}}", "restarted"),
                ),
            ),
        ),
    ),
    (
        "Rewards",
        (
            Panel("Reward distribution", "short", _quantiles("train_reward", (0, 10, 50, 90, 100))),
            Panel(
                "Mean reward and held-out accuracy",
                "short",
                _q(
                    (f"miles_train_reward_mean{{{RUN}}}", "reward mean"),
                    (f"miles_eval_accuracy{{{RUN}}}", "eval accuracy"),
                ),
            ),
        ),
    ),
    (
        "KL, entropy and log-prob mismatch",
        (
            Panel("Entropy", "short", _q((f"miles_train_entropy{{{RUN}}}", "entropy"))),
            Panel("KL to the reference (algo.kl_coef > 0)", "short", _q((f"miles_train_kl{{{RUN}}}", "kl"))),
            Panel(
                "Rollout vs trainer log-probs",
                "short",
                _q(
                    (f"miles_train_logp_mismatch_abs_mean{{{RUN}}}", "mean |diff|"),
                    (f"miles_train_tis_clip_frac{{{RUN}}}", "TIS-clipped share"),
                ),
            ),
        ),
    ),
    (
        "Clipping and response lengths",
        (
            Panel(
                "Clip fractions",
                "percentunit",
                _q(
                    (f"miles_train_clip_frac_low{{{RUN}}}", "low"),
                    (f"miles_train_clip_frac_high{{{RUN}}}", "high"),
                ),
            ),
            Panel("Response length", "short", _quantiles("rollout_response_len", (10, 50, 90, 100))),
        ),
    ),
    (
        "Time per phase",
        (
            Panel(
                "Step time by phase",
                "s",
                _q(
                    (f"miles_perf_rollout_s{{{RUN}}}", "rollout"),
                    (f"miles_perf_train_s{{{RUN}}}", "train"),
                    (f"miles_perf_sync_s{{{RUN}}}", "sync"),
                    (f"miles_perf_step_time_s{{{RUN}}}", "step"),
                ),
            ),
            Panel(
                "Engines busy (share of the step)",
                "percentunit",
                _q((f"miles_perf_engine_busy_frac{{{RUN}}}", "busy")),
            ),
            Panel("Steps", "short", _q((f"miles_step{{{RUN}}}", "step"))),
        ),
    ),
    (
        "Staleness (asynchronous schedules)",
        (
            Panel(
                "Sample staleness",
                "short",
                _q(
                    (f"miles_train_staleness_mean{{{RUN}}}", "mean"),
                    (f"miles_train_staleness_max{{{RUN}}}", "max"),
                ),
            ),
            Panel(
                "Stale samples dropped, partial rollouts, engine version lag",
                "short",
                _q(
                    (f"miles_train_stale_dropped_frac{{{RUN}}}", "dropped share"),
                    (f"miles_train_partial_rollout_frac{{{RUN}}}", "partial-rollout share"),
                    (f"miles_async_engine_version_lag{{{RUN}}}", "engine lag (versions)"),
                ),
            ),
        ),
    ),
    (
        "Weight sync",
        (
            Panel("Weight sync time", "s", _q((f"miles_weight_sync_seconds{{{RUN}}}", "seconds"))),
            Panel("Weight sync bytes", "bytes", _q((f"miles_weight_sync_bytes{{{RUN}}}", "bytes"))),
        ),
    ),
    (
        "Memory",
        (
            Panel(
                "Resident memory per process",
                "bytes",
                _q((f'miles_mem_rss_bytes{{{RUN}, actor=~"$actor"}}', "{{actor}}")),
            ),
        ),
    ),
)


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query on the dashboard."""
    return [(p.title, q) for _, panels in ROWS for p in panels for q, _ in p.queries]


def _variables() -> list[Any]:
    """``$datasource``, then ``$run``, ``$model``, ``$engine``, ``$actor`` from the series' labels (several
    or all at once)."""
    from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    out = [DatasourceVariable("datasource").label("Prometheus").type("prometheus")]
    for name, label, query in (
        ("run", "Run", "label_values(miles_step, run)"),
        ("model", "Model", 'label_values(miles_step{run=~"$run"}, model)'),
        ("engine", "Engine", 'label_values(miles_rollout_requests_total{run=~"$run"}, engine)'),
        ("actor", "Process", 'label_values(miles_mem_rss_bytes{run=~"$run"}, actor)'),
    ):
        out.append(
            QueryVariable(name)
            .label(label)
            .datasource(ds)
            .query(query)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    return out


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict)."""
    from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
    from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        Dashboard("miles: a run")
        .uid(UID)
        .tags(["miles"])
        .refresh("15s")
        .time("now-1h", "now")
        .description("A miles run's live metrics (docs/observability.md)")
    )
    for variable in _variables():
        board = board.with_variable(variable)
    for row_title, panels in ROWS:
        board = board.with_row(Row(row_title))
        for p in panels:
            builder = heatmap.Panel() if p.kind == "heatmap" else timeseries.Panel()
            builder = builder.title(p.title).datasource(ds).unit(p.unit).height(8).span(8)
            if p.description:
                builder = builder.description(p.description)
            for i, (expr, legend) in enumerate(p.queries):
                target = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
                if p.kind == "heatmap":
                    target = target.format("heatmap")
                builder = builder.with_target(target)
            board = board.with_panel(builder)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if (
    __name__ == "__main__"
):  # python -m miles.tracking.dashboard [PATH]: write the dashboard (default: the shipped file)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(f"wrote {path}")
