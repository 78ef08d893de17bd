"""Per-step timelines (``tracking.timeline_steps``): the Chrome trace of a real run's step, its MLflow
artifacts and Gantt PNG, and the trace format itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import ConfigError, validate
from miles.tracking import timeline
from miles.tracking.timeline import Span


def test_chrome_trace_rows_lanes_and_busy_time() -> None:
    """Overlapping calls on one actor get rows of their own; busy time is the union of a track's spans,
    clipped to the step; the format check accepts the trace and rejects broken ones."""
    spans = [
        Span("driver", "rollout", 10.0, 10.5),
        Span("driver", "generate wait", 10.1, 10.4),
        Span("engine 0", "generate", 10.1, 10.3),
        Span("engine 0", "generate", 10.2, 10.4),
        Span("trainer rank 1", "train_step", 10.6, 11.5),
        Span("trainer rank 0", "train_step", 9.0, 10.9),
        Span("reward worker 0", "score", 10.3, 10.35, {"calls": 8}),
    ]
    trace = timeline.chrome_trace(spans, 10.0, 11.0, step=3)
    timeline.check_chrome_trace(trace)
    json.loads(json.dumps(trace))
    rows = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert rows == [
        "driver",
        "engine 0",
        "engine 0 #1",
        "trainer rank 0",
        "trainer rank 1",
        "reward worker 0",
    ]
    procs = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["driver", "engine", "trainer rank", "reward worker"]
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = next(e for e in x if e["name"] == "train_step" and e["ts"] == 0)  # rank 0's call, clipped at 0
    assert first["dur"] == pytest.approx(0.9e6)
    busy = trace["otherData"]["busy_idle"]
    assert busy["engine 0"]["busy_s"] == pytest.approx(0.3) and busy["engine 0"]["idle_s"] == pytest.approx(
        0.7
    )
    assert busy["trainer rank 1"]["busy_s"] == pytest.approx(0.4)
    assert "step 3 timeline" in timeline.summary(trace)
    for broken in (
        {},
        {"traceEvents": [{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": -1, "dur": 1}]},
        {"traceEvents": [{"name": "a", "ph": "B", "pid": 1, "tid": 1}]},
        {"traceEvents": [{"name": "a", "ph": "X", "pid": "1", "tid": 1, "ts": 0, "dur": 1}]},
    ):
        with pytest.raises(ValueError):
            timeline.check_chrome_trace(broken)


def test_timeline_steps_must_count_from_one() -> None:
    with pytest.raises(ConfigError, match="tracking.timeline_steps"):
        validate({"tracking": {"backend": "none", "timeline_steps": [0]}})
    assert validate({"tracking": {"backend": "none"}}).tracking.timeline_steps == ()


def test_timeline_of_a_real_step(ray_cluster, tmp_path: Path) -> None:
    """A real 3-step run with ``tracking.timeline_steps=[2]``: step 2's trace has spans of the driver, the engine,
    the trainer ranks and the reward workers, in the order of the loop and inside the driver's phases;
    it is an MLflow artifact with its Gantt PNG, and also written to ``tracking.timeline_dir``."""
    from mlflow.tracking import MlflowClient

    from miles.core.run import run_job

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run = validate(
        {
            "seed": 0,
            "trainer": {"num_steps": 3, "eval_every": 0},  # step 2: no eval in it
            "algo": {"num_prompts_per_step": 4, "num_samples_per_prompt": 4},
            "task": {"num_eval_prompts": 4, "reward_num_workers": 2},
            "placement": {"trainer_world_size": 2},
            "cluster": {"reuse_actors": False},
            "tracking": {
                "uri": uri,
                "experiment": "timeline",
                "plots": False,
                "timeline_steps": [2],
                "timeline_dir": str(tmp_path / "out"),
            },
        }
    )
    run_job(run, resolved_yaml="", overrides=[])

    trace = json.loads((tmp_path / "out" / "timeline" / "step_2.json").read_text())
    timeline.check_chrome_trace(trace)
    assert (tmp_path / "out" / "plots" / "timeline_step_2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert trace["otherData"]["step"] == 2 and trace["otherData"]["step_s"] > 0
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kinds = {e["cat"] for e in x}
    assert kinds == {"driver", "engine", "trainer rank", "reward worker"}, kinds
    rows = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    tracks = {rows[e["pid"], e["tid"]].split(" #")[0] for e in x}
    assert {"trainer rank 0", "trainer rank 1", "engine 0", "driver"} <= tracks, tracks
    step_us = trace["otherData"]["step_s"] * 1e6
    assert all(0 <= e["ts"] and e["ts"] + e["dur"] <= step_us + 1 for e in x)

    def driver(name: str) -> dict:
        (found,) = [e for e in x if e["cat"] == "driver" and e["name"] == name]
        return found

    def inside(e: dict, outer: dict) -> bool:
        return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1

    rollout, learn, sync = driver("rollout"), driver("learn"), driver("sync")
    assert rollout["ts"] + rollout["dur"] <= learn["ts"] and learn["ts"] + learn["dur"] <= sync["ts"]
    assert inside(driver("train_step"), learn) and inside(driver("advantages"), learn)
    generate = [e for e in x if e["cat"] == "engine" and e["name"] == "generate"]
    assert generate and all(inside(e, rollout) for e in generate)
    scores = [e for e in x if e["cat"] == "reward worker"]
    assert (
        scores
        and all(inside(e, rollout) for e in scores)
        and sum(e["args"]["calls"] for e in scores) == (16 if run.task.reward_kind == "sample" else 4)
    )
    train = [e for e in x if e["cat"] == "trainer rank" and e["name"] == "train_step"]
    assert len(train) == 2 and all(inside(e, learn) for e in train)
    assert any(e["cat"] == "trainer rank" and inside(e, sync) for e in x)  # the weights go out in the sync
    # the engine's answer to the memory offload is the push's health check, and the push's answers are the
    # next step's first reading: no health call of its own in a step without eval
    calls = sorted(e["name"] for e in x if e["cat"] == "engine")
    assert "health" not in calls and {"release_memory", "update_weights_from"} <= set(calls), calls

    client = MlflowClient(uri)
    run_id = client.search_runs([client.get_experiment_by_name("timeline").experiment_id])[0].info.run_id
    artifacts = {a.path for d in ("timeline", "plots") for a in client.list_artifacts(run_id, d)}
    assert {"timeline/step_2.json", "plots/timeline_step_2.png"} <= artifacts, artifacts
    got = json.loads(
        Path(client.download_artifacts(run_id, "timeline/step_2.json", str(tmp_path))).read_text()
    )
    assert got == trace
