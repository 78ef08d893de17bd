"""The Grafana dashboard of a run's live metrics, generated with grafana-foundation-sdk.

:data:`ROWS` says what the dashboard shows: one row per metric family of docs/observability.md, each
panel a list of PromQL queries over the exporter's series (:mod:`miles.tracking.prometheus`). The
variables ``$datasource``, ``$run``, ``$model``, ``$engine``, ``$actor`` and ``$tenant`` drill down to one run,
one model, one engine, one process or one multi-LoRA tenant. :func:`build` turns the rows into the dashboard's JSON with the SDK's
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
TENANT = RUN + ', tenant=~"$tenant"'  # series without a tenant label match it too (All is .*)
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


def _histogram_quantiles(family: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            f"histogram_quantile({q}, sum by (le) (rate({family}_bucket{{{TENANT}}}{RATE})))",
            f"p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Rollout latency",
        (
            Panel(
                "Request latency (heatmap)",
                "s",
                _q(
                    (
                        f"sum by (le) (rate(miles_rollout_request_latency_seconds_bucket{{{TENANT}}}{RATE}))",
                        "{{le}}",
                    )
                ),
                kind="heatmap",
                description="From a request's arrival in the dispatcher's queue to its answer",
            ),
            Panel(
                "Request latency quantiles",
                "s",
                _histogram_quantiles("miles_rollout_request_latency_seconds"),
            ),
            Panel(
                "Time to first token quantiles",
                "s",
                _histogram_quantiles("miles_rollout_time_to_first_token_seconds"),
                description="From a request's arrival in the dispatcher's queue to its first token (the engine's "
                "measure plus the wait before the call)",
            ),
            Panel(
                "Request latency and time to first token per tenant (p90)",
                "s",
                tuple(
                    (
                        f"histogram_quantile(0.9, sum by (le, tenant) (rate({family}_bucket{{{TENANT}}}{RATE})))",
                        f"{what} {{{{tenant}}}}",
                    )
                    for family, what in (
                        ("miles_rollout_request_latency_seconds", "latency"),
                        ("miles_rollout_time_to_first_token_seconds", "first token"),
                    )
                ),
                description="Multi-LoRA tenants: one series each (the tenant label is empty without tenants)",
            ),
            Panel(
                "Request latency and time to first token per step (as MLflow has it)",
                "s",
                tuple(
                    (f"miles_rollout_{key}_p{q}{{{TENANT}}}", f"{what} p{q} {{{{tenant}}}}")
                    for key, what in (
                        ("request_latency_s", "latency"),
                        ("time_to_first_token_s", "first token"),
                    )
                    for q in (50, 90, 99)
                ),
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
                "Weight version per engine (of its last answer)",
                "short",
                _q((f"miles_rollout_engine_weight_version{{{ENGINE}}}", "engine {{engine}}")),
            ),
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
            Panel(
                "Reward distribution (per tenant with tenants)",
                "short",
                tuple(
                    (f"miles_train_reward_p{q}{{{TENANT}}}", f"p{q} {{{{tenant}}}}")
                    for q in (0, 10, 50, 90, 100)
                ),
            ),
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
        "Agent tool calls",
        (
            Panel(
                "Turns and tool calls per step",
                "short",
                _q(
                    (f"miles_rollout_agent_turns{{{RUN}}}", "policy turns"),
                    (f"miles_rollout_agent_tool_calls{{{RUN}}}", "tool calls"),
                    (f"miles_rollout_agent_tool_calls_ok{{{RUN}}}", "returned without error"),
                ),
                description="Multi-turn generate functions (miles.agent.rollout.tool_loop): counts of the step's samples",
            ),
            Panel(
                "Tool call failures per step",
                "short",
                _q(
                    (
                        f"miles_rollout_agent_tool_calls{{{RUN}}} - miles_rollout_agent_tool_calls_ok{{{RUN}}}",
                        "failed calls",
                    ),
                    (
                        f'{{__name__=~"miles_rollout_agent_tool_(malformed|unknown_tool|timeout|raised|too_many)", {RUN}}}',
                        "{{__name__}}",
                    ),
                    (f"miles_rollout_agent_turn_failures{{{RUN}}}", "turns whose request failed"),
                ),
            ),
            Panel(
                "Tool call success rate",
                "percentunit",
                _q(
                    (
                        f"miles_rollout_agent_tool_calls_ok{{{RUN}}} / miles_rollout_agent_tool_calls{{{RUN}}}",
                        "returned without error / calls",
                    )
                ),
            ),
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
    """``$datasource``, then ``$run``, ``$model``, ``$engine``, ``$actor``, ``$tenant`` from the series' labels
    (several or all at once)."""
    from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    out = [DatasourceVariable("datasource").label("Prometheus").type("prometheus")]
    for name, label, query in (
        ("run", "Run", "label_values(miles_step, run)"),
        ("model", "Model", 'label_values(miles_step{run=~"$run"}, model)'),
        ("engine", "Engine", 'label_values(miles_rollout_requests_total{run=~"$run"}, engine)'),
        ("actor", "Process", 'label_values(miles_mem_rss_bytes{run=~"$run"}, actor)'),
        (
            "tenant",
            "Tenant",
            'label_values(miles_rollout_request_latency_seconds_count{run=~"$run"}, tenant)',
        ),
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
