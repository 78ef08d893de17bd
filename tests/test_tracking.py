"""MLflow tracking on a real SQLite store (and a dead HTTP one): snapshot, limits, redaction, plots, outages."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from miles.config import validate
from miles.config.schema import to_yaml_dict
from miles.tracking.mlflow_tracker import (
    MAX_PARAM_KEY,
    MAX_PARAM_VALUE,
    MAX_TAG_VALUE,
    MlflowTracker,
    clamp_params,
    default_uri,
    flatten,
)
from miles.tracking.snapshot import (
    Launch,
    command_line,
    git_info,
    is_secret_key,
    redact_argv,
    redact_text,
    redact_yaml,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module (creating its tables takes seconds)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlruns.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def _tracker(uri: str, resolved: str = "seed: 3\n", overrides=("seed=3",),
             launch: Launch | None = None, config_dict=None, **tracking) -> MlflowTracker:
    run = validate({"tracking": {"uri": uri, "experiment": "t", **tracking}, "seed": 3})
    return MlflowTracker(run, resolved_yaml=resolved, overrides=list(overrides),
                         config_dict=config_dict if config_dict is not None else to_yaml_dict(dataclasses.asdict(run)),
                         launch=launch)


def _artifact_texts(client, run_id: str, dest: Path) -> dict[str, str]:
    local = Path(client.download_artifacts(run_id, "", str(dest)))
    return {str(p.relative_to(local)): p.read_text(errors="replace") for p in local.rglob("*") if p.is_file()}


def test_secret_keys() -> None:
    for key in ("hf_token", "a.b.api_key", "db.password", "client_secret", "token", "OPENAI_API_KEY",
                "access-token", "aws_secret_access_key", "credentials"):
        assert is_secret_key(key), key
    for key in ("rollout.max_new_tokens", "tokenizer_path", "max_tokens_per_microbatch", "token_budget",
                "model.path", "seed"):
        assert not is_secret_key(key), key


def test_flatten_dotted_keys_and_redaction() -> None:
    flat = flatten({"a": {"b": 1, "api_key": "sk-123", "hf_token": "t", "c": [1, 2], "max_new_tokens": 8},
                    "d": None})
    assert flat == {"a.b": "1", "a.api_key": "***", "a.hf_token": "***", "a.c": "[1, 2]",
                    "a.max_new_tokens": "8", "d": "None"}


def test_redact_command_line_text_and_yaml() -> None:
    argv = ["miles", "seed=1", "+task.api_key=sk-1", "--password", "hunter2", "--hf-token=abc", "tokenizer=x"]
    assert redact_argv(argv) == ["miles", "seed=1", "+task.api_key=***", "--password", "***",
                                 "--hf-token=***", "tokenizer=x"]
    line = command_line(["/x/miles/__main__.py", "-m", "x.secret=s3", "seed=0,1"])
    assert line.endswith("-m miles -m 'x.secret=***' seed=0,1") and "s3" not in line
    text = 'HF_TOKEN = "abc123"\napi_key: sk-9\nmax_new_tokens: 8\nurl=http://h?token=zz&x=1\n'
    out = redact_text(text)
    assert "abc123" not in out and "sk-9" not in out and "zz" not in out and "max_new_tokens: 8" in out
    y = redact_yaml("a:\n  hf_token: abc\n  lr: 0.0005\n  max_new_tokens: 8\n")
    assert y == "a:\n  hf_token: '***'\n  lr: 0.0005\n  max_new_tokens: 8\n"


def test_clamp_params_respects_mlflow_limits() -> None:
    from mlflow.utils import validation

    assert (MAX_PARAM_KEY, MAX_PARAM_VALUE, MAX_TAG_VALUE) == (
        validation.MAX_ENTITY_KEY_LENGTH, validation.MAX_PARAM_VAL_LENGTH, validation.MAX_TAG_VAL_LENGTH)
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


def test_tracker_logs_run_snapshot_metrics_and_plots(tmp_path: Path, store: str) -> None:
    from mlflow.tracking import MlflowClient

    tracker = _tracker(store, launch=Launch(argv=("miles", "seed=3"), composed_yaml="seed: ${oc.env:S,3}\n"))
    for step in (1, 2, 3):
        tracker.log_metrics({"train/reward_mean": step / 4, "train/reward_std": 0.1, "eval/accuracy": step / 8,
                             "perf/rollout_s": 0.2, "perf/train_s": 0.3, "perf/sync_s": 0.01,
                             "rollout/response_len_mean": 5.0 + step, "nan_metric": float("nan")}, step=step)
        tracker.log_distributions({"train/reward": [0.0, 1.0, step / 3], "rollout/response_len": [3, 4, 5 + step]},
                                  step=step)
    tracker.finish()

    client = MlflowClient(store)
    r = client.get_run(tracker.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["seed"] == "3" and r.data.params["algo.clip_high"] == "0.2"
    assert r.data.params["algo.advantage._target_"] == "miles.algos.advantages.group_normalized"
    assert r.data.params["rollout.max_new_tokens"] != "***"
    tags = r.data.tags
    assert tags["miles.overrides"] == "seed=3" and tags["miles.command"] == "miles seed=3"
    assert tags["miles.seed"] == "3" and tags["miles.pkg.torch"].startswith("2.")
    assert tags["miles.git_commit"] == git_info()["git_commit"]
    hist = client.get_metric_history(tracker.run_id, "train/reward_mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.value for m in client.get_metric_history(tracker.run_id, "train/reward/p100")] == [1.0, 1.0, 1.0]
    assert [m.value for m in client.get_metric_history(tracker.run_id, "rollout/response_len/p50")] == [4.0] * 3
    assert client.get_metric_history(tracker.run_id, "nan_metric") == []
    files = _artifact_texts(client, tracker.run_id, tmp_path / "dl")
    assert files["config/resolved.yaml"] == "seed: 3\n"
    assert files["config/composed.yaml"] == "seed: ${oc.env:S,3}\n"
    assert files["config/overrides.yaml"] == "- seed=3\n"
    packages = files["env/packages.txt"].splitlines()
    assert any(line.startswith("torch==") for line in packages) and len(packages) > 20
    assert '"cpu_count"' in files["env/machine.json"] and '"memory_gib"' in files["env/machine.json"]
    assert ("env/git_diff.patch" in files) == (git_info()["git_dirty"] == "true")
    assert {"plots/reward.png", "plots/response_length.png", "plots/phase_times.png",
            "metrics/history.csv", "metrics/distributions.csv"} <= set(files)
    assert list((Path(store.removeprefix("sqlite:///")).parent / "mlartifacts").rglob("resolved.yaml")), \
        "artifacts live next to mlruns.db"


def test_params_over_the_limits_are_batched_and_clamped(store: str) -> None:
    from mlflow.tracking import MlflowClient

    config = {"group": {f"p{i:03d}": i for i in range(250)},
              "long_value": "v" * (MAX_PARAM_VALUE + 100), "k" * (MAX_PARAM_KEY + 1): 1}
    tracker = _tracker(store, config_dict=config, plots=False)
    tracker.finish()
    params = MlflowClient(store).get_run(tracker.run_id).data.params
    assert len(params) == 251 and params["group.p249"] == "249"
    assert len(params["long_value"]) == MAX_PARAM_VALUE and params["long_value"].endswith("...")


def test_secrets_are_redacted_in_params_tags_and_artifacts(tmp_path: Path, store: str) -> None:
    from mlflow.tracking import MlflowClient

    secrets = [f"sk-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}", f"hf_{uuid.uuid4().hex}"]  # not in any source
    resolved = f"seed: 3\ntask:\n  source:\n    kwargs:\n      api_key: {secrets[0]}\n"
    tracker = _tracker(
        store, resolved=resolved, overrides=[f"+task.source.kwargs.api_key={secrets[0]}"],
        config_dict={"seed": 3, "task": {"source": {"kwargs": {"api_key": secrets[0]}}}, "db": {"password": secrets[1]}},
        launch=Launch(argv=("miles", f"+task.source.kwargs.api_key={secrets[0]}", "--hf-token", secrets[2]),
                      composed_yaml=resolved),
    )
    tracker.finish()
    client = MlflowClient(store)
    r = client.get_run(tracker.run_id)
    assert r.data.params["task.source.kwargs.api_key"] == "***" and r.data.params["db.password"] == "***"
    assert "***" in r.data.tags["miles.command"]
    texts = [*r.data.params.values(), *r.data.tags.values(),
             *_artifact_texts(client, tracker.run_id, tmp_path / "dl").values()]
    for s in secrets:
        assert not any(s in t for t in texts), f"secret {s} was logged"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_tracking_server_never_stops_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    caplog.set_level(logging.WARNING, logger="miles.tracking")
    tracker = _tracker(f"http://127.0.0.1:{_closed_port()}", flush_timeout_s=2.0, plots=False)
    t0 = time.perf_counter()
    for step in range(1, 51):
        tracker.log_metrics({"train/reward_mean": 0.1 * step, "train/loss": 1.0 / step}, step)
    log_s = time.perf_counter() - t0
    assert tracker.buffered == 100, "nothing can have been sent"
    deadline = time.monotonic() + 20
    while not any("unreachable" in r.message for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    tracker.finish()
    finish_s = time.perf_counter() - t0
    warnings = [r.message for r in caplog.records if "unreachable" in r.message]
    assert len(warnings) == 1, "one warning per outage, not one per step"
    assert "training continues" in warnings[0]
    assert log_s < 5, f"50 log_metrics calls took {log_s:.1f}s against a dead server"
    assert finish_s < 2.0 + 5, f"finish waited {finish_s:.1f}s with flush_timeout_s=2"
    assert tracker.run_id is None
    unsent = list(tmp_path.glob("mlflow_unsent_*.jsonl"))
    assert len(unsent) == 1 and len(unsent[0].read_text().splitlines()) == 100
    assert any("not sent" in r.message for r in caplog.records)


@pytest.mark.slow
def test_metrics_buffered_during_an_outage_reach_the_server_when_it_comes_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="miles.tracking")
    port = _closed_port()
    uri = f"http://127.0.0.1:{port}"
    tracker = _tracker(uri, flush_timeout_s=60.0, plots=False)
    for step in (1, 2, 3):
        tracker.log_metrics({"train/reward_mean": step / 10}, step)
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--default-artifact-root", str(tmp_path / "server_artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import requests

        deadline = time.monotonic() + 300  # the server takes ~7 s to start on an idle machine
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{uri}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        for step in (4, 5):
            tracker.log_metrics({"train/reward_mean": step / 10}, step)
        tracker.finish()
        client = MlflowClient(uri)
        assert tracker.run_id is not None
        hist = client.get_metric_history(tracker.run_id, "train/reward_mean")
        assert [(m.step, m.value) for m in hist] == [(s, s / 10) for s in range(1, 6)]
        assert client.get_run(tracker.run_id).info.status == "FINISHED"
        assert any("reachable again" in r.message for r in caplog.records)
        assert not list(tmp_path.glob("mlflow_unsent_*.jsonl"))
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its worker processes
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def test_system_metrics_are_logged_when_switched_on(store: str) -> None:
    from mlflow.tracking import MlflowClient

    tracker = _tracker(store, system_metrics=True, system_metrics_interval_s=0.2, plots=False)
    deadline = time.monotonic() + 30
    while len(tracker.history.scalars.get("system/cpu_utilization_percentage", [])) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    tracker.finish()
    metrics = MlflowClient(store).get_run(tracker.run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)
    assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100


def test_hydra_saved_configs_are_redacted(tmp_path: Path) -> None:
    """The job's .hydra/config.yaml, hydra.yaml and overrides.yaml keep no secret (a real Hydra app)."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "app.yaml").write_text(textwrap.dedent("""
        db: {host: localhost, password: hunter2}
        lr: 0.1
        hydra:
          run: {dir: out}
          callbacks:
            redact_outputs: {_target_: miles.tracking.snapshot.RedactHydraOutputs}
    """))
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import hydra

        @hydra.main(version_base="1.3", config_path=".", config_name="app")
        def main(cfg):
            assert cfg.db.password == "hunter2" and cfg.svc.api_key == "sk-123"  # the job itself sees them
        main()
    """))
    subprocess.run([sys.executable, "app.py", "+svc.api_key=sk-123", "lr=0.2"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    saved = {p.name: p.read_text() for p in (tmp_path / "out" / ".hydra").glob("*.yaml")}
    assert set(saved) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    for name, text in saved.items():
        assert "hunter2" not in text and "sk-123" not in text, name
    assert "lr=0.2" in saved["overrides.yaml"] and "+svc.api_key=***" in saved["overrides.yaml"]
    assert "host: localhost" in saved["config.yaml"] and "password: '***'" in saved["config.yaml"]


def test_miles_config_registers_the_redaction_callback() -> None:
    from hydra import compose, initialize_config_module

    with initialize_config_module("miles.conf", version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    targets = {c._target_ for c in cfg.hydra.callbacks.values()}
    assert "miles.tracking.snapshot.RedactHydraOutputs" in targets


def test_a_run_that_fails_to_start_ends_failed_not_running(tmp_path: Path, store: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    import miles.core.cluster
    from miles.core.run import run_job

    def unreachable(run, keep=False):  # what ray.init raises for a cluster address nobody answers
        raise ConnectionError("could not reach a Ray cluster at 10.9.9.9:6379")

    monkeypatch.setattr(miles.core.cluster, "start_ray", unreachable)
    run = validate({"tracking": {"uri": store, "experiment": "start-fails", "plots": False},
                    "warm_start": {"steps": 10, "cache_dir": str(tmp_path)}, "trainer": {"num_steps": 1}})
    with pytest.raises(ConnectionError, match="10.9.9.9"):
        run_job(run, resolved_yaml="", overrides=[])
    client = MlflowClient(store)
    (found,) = client.search_runs([client.get_experiment_by_name("start-fails").experiment_id])
    assert found.info.status == "FAILED"


def test_tenant_curves_are_drawn_per_tenant(tmp_path) -> None:
    from miles.tracking.plots import History, write_plots

    history = History()
    for step in range(4):
        history.add({"tenant/a/train/reward_mean": 0.1 * step, "tenant/b/train/reward_mean": 0.2}, step)
        if step % 2 == 0:
            history.add({"tenant/a/eval/accuracy": 0.5, "tenant/b/eval/accuracy": 0.3 + 0.1 * step}, step)
    written = {p.name for p in write_plots(history, tmp_path)}
    assert "tenants.png" in written and (tmp_path / "tenants.png").stat().st_size > 0
    assert "tenants.png" not in {p.name for p in write_plots(History(), tmp_path / "none")}
