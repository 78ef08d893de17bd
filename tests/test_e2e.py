"""End to end: `python -m miles` through Hydra, Ray, the actors and MLflow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import validate

pytestmark = pytest.mark.slow


def _miles(args: list[str], cwd: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    env.pop("MLFLOW_TRACKING_URI", None)
    p = subprocess.run([sys.executable, "-m", "miles", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def test_sweep_runs_two_jobs_and_logs_each_to_mlflow(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    cache = tmp_path / "cache"
    _miles(["-m", "seed=0,1", "trainer.num_steps=2", "trainer.eval_every=1", "warm_start.steps=20",
            f"warm_start.cache_dir={cache}", "task.num_eval_prompts=16"], cwd=tmp_path)
    db = tmp_path / "mlruns.db"
    assert db.is_file(), "the default tracking URI is sqlite:///mlruns.db in the working directory"
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("miles")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2
    assert sorted(r.data.params["seed"] for r in runs) == ["0", "1"]
    for r in runs:
        assert r.info.status == "FINISHED"
        assert r.data.tags["miles.overrides"].startswith("seed=")
        history = {k: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, k)]
                   for k in ("train/reward_mean", "eval/accuracy", "perf/step_time_s", "weight_sync/seconds")}
        assert [s for s, _ in history["train/reward_mean"]] == [1, 2]
        assert [s for s, _ in history["eval/accuracy"]] == [0, 1, 2]
        assert all(v > 0 for _, v in history["perf/step_time_s"] + history["weight_sync/seconds"])
        assert {a.path for a in client.list_artifacts(r.info.run_id, "config")} >= {"config/resolved.yaml"}
    assert len(list(cache.iterdir())) == 2, "one cached checkpoint per seed"


def test_product_card_moe_fp8_with_two_trainer_ranks(tmp_path: Path) -> None:
    p = _miles(["model=qwen3_moe", "algo=grpo", "precision=fp8", "placement.trainer_world_size=2",
                "trainer.num_steps=2", "warm_start.steps=10", f"warm_start.cache_dir={tmp_path / 'cache'}",
                "task.num_eval_prompts=16", "tracking=none", "cluster.num_cpus=2",
                "placement.cpus_per_bundle=1"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert "2 trainer rank(s)" in out and "step 2/2" in out and "done in" in out


def test_placement_too_big_fails_within_its_timeout(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "miles", "placement.trainer_world_size=4", "placement.cpus_per_bundle=2",
         "placement.ready_timeout_s=3", "cluster.num_cpus=2", "tracking=none", "warm_start.steps=5",
         f"warm_start.cache_dir={tmp_path / 'cache'}", "trainer.num_steps=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert "asked for 4 bundle(s) x 2 CPU = 8 CPU" in err and "of 2 CPU" in err


def test_short_seeded_run_improves(ray_cluster, tmp_path: Path) -> None:
    """The default recipe, shortened: held-out accuracy rises from step 0 within a short seeded run."""
    from miles.core.run import run_job

    run = validate({"seed": 0, "tracking": {"backend": "none"}, "trainer": {"num_steps": 60, "eval_every": 0},
                    "warm_start": {"cache_dir": str(tmp_path / "cache")}})
    seen: list[tuple[int, dict]] = []
    final = run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.append((s, dict(m))))
    start = next(m for s, m in seen if s == 0)["eval/accuracy"]
    rewards = [m["train/reward_mean"] for s, m in seen if s > 0]
    assert final["eval/accuracy"] > start + 0.05, (start, final["eval/accuracy"])
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10
