"""MLflow tracking on a real SQLite store: params within limits, config artifact, metrics per step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miles.config import validate
from miles.config.schema import to_yaml_dict
from miles.tracking.mlflow_tracker import (
    MAX_PARAM_KEY,
    MAX_PARAM_VALUE,
    MlflowTracker,
    clamp_params,
    default_uri,
    flatten,
    git_info,
)


def test_flatten_dotted_keys_and_redaction() -> None:
    flat = flatten({"a": {"b": 1, "api_key": "sk-123", "hf_token": "t", "c": [1, 2]}, "d": None})
    assert flat == {"a.b": "1", "a.api_key": "***", "a.hf_token": "***", "a.c": "[1, 2]", "d": "None"}


def test_clamp_params_respects_mlflow_limits() -> None:
    params = {"k" * (MAX_PARAM_KEY + 1): "v", "long": "x" * (MAX_PARAM_VALUE + 50), "ok": "y"}
    out = clamp_params(params)
    assert set(out) == {"long", "ok"}
    assert len(out["long"]) == MAX_PARAM_VALUE and out["long"].endswith("...")


def test_default_uri(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run = validate({})
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_uri(run.tracking) == f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert default_uri(run.tracking) == "sqlite:///elsewhere.db"
    assert default_uri(validate({"tracking": {"uri": "sqlite:///x.db"}}).tracking) == "sqlite:///x.db"


def test_git_info_reads_the_repository() -> None:
    info = git_info()
    assert set(info) == {"git_commit", "git_dirty"}
    assert info["git_commit"] == "unknown" or len(info["git_commit"]) == 40


def test_tracker_logs_run_to_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run = validate({"tracking": {"uri": uri, "experiment": "t"}, "seed": 3})
    tracker = MlflowTracker(run, resolved_yaml="seed: 3\n", overrides=["seed=3"],
                            config_dict=to_yaml_dict(dataclasses.asdict(run)))
    tracker.log_metrics({"train/reward_mean": 0.5, "nan_metric": float("nan")}, step=1)
    tracker.log_metrics({"train/reward_mean": 0.75}, step=2)
    tracker.finish()

    client = MlflowClient(uri)
    r = client.get_run(tracker.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["seed"] == "3" and r.data.params["algo.clip_high"] == "0.2"
    assert r.data.params["algo.advantage._target_"] == "miles.algos.advantages.group_normalized"
    assert r.data.tags["miles.overrides"] == "seed=3"
    assert "miles.git_commit" in r.data.tags and "miles.command" in r.data.tags
    hist = client.get_metric_history(tracker.run_id, "train/reward_mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.5), (2, 0.75)]
    assert client.get_metric_history(tracker.run_id, "nan_metric") == []
    arts = {a.path for a in client.list_artifacts(tracker.run_id, "config")}
    assert arts == {"config/resolved.yaml", "config/overrides.yaml"}
    local = client.download_artifacts(tracker.run_id, "config/resolved.yaml", str(tmp_path / "dl"))
    assert Path(local).read_text() == "seed: 3\n"
    assert list((tmp_path / "mlartifacts").rglob("resolved.yaml")), "artifacts live next to mlruns.db"
