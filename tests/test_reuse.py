"""Jobs in one driver while Ray stays up: a finished job's actors serve the next job of the same shape."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from miles.bench.e2e import compose

TINY = ["algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4", "trainer.num_steps=2",
        "trainer.eval_every=1", "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=2",
        "warm_start.steps=40", "tracking=none"]


def _numbers(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics without the timings and process memory (those differ run to run)."""
    return {k: v for k, v in metrics.items()
            if not (k.startswith(("perf/", "mem/")) or k.endswith(("_s", "/seconds", "bytes_per_s")) or "_s/p" in k)}


def _job(overrides: list[str], on_metrics=None) -> list[tuple[int, dict[str, float]]]:
    from miles.core.run import run_job

    run, resolved = compose(overrides)
    seen: list[tuple[int, dict[str, float]]] = []

    def record(m: dict[str, float], step: int) -> None:
        seen.append((step, _numbers(m)))
        if on_metrics is not None:
            on_metrics(m, step)

    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=record)
    return seen


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One warm-start checkpoint for the module's jobs."""
    return tmp_path_factory.mktemp("warm_start")


def _ids(actors) -> list[str]:
    return [a._actor_id.hex() for a in actors.engines + actors.trainers + actors.critics]


@pytest.mark.slow
def test_reused_actors_compute_what_new_ones_do(ray_cluster, cache: Path) -> None:
    """A, then B (another algorithm, precision and weight transport) and A again on the same actors:
    the second A's numbers equal the first's, so nothing of a job stays in a reused actor."""
    from miles.core.actors import parked, release_parked

    release_parked()
    a = TINY + [f"warm_start.cache_dir={cache}"]
    first = _job(a)
    kept = parked()
    assert kept is not None, "a finished job's actors wait for the next job while Ray is up"
    ids = _ids(kept)
    _job(a + ["algo=gspo", "precision=bf16", "weight_sync=broadcast"])
    assert _ids(parked()) == ids
    again = _job(a)
    assert _ids(parked()) == ids and parked().reused
    assert {"train/loss", "train/reward_mean", "eval/accuracy"} <= set(first[-1][1])
    assert again == first


@pytest.mark.slow
def test_failed_jobs_and_reuse_off_leave_no_actors_behind(ray_cluster, cache: Path) -> None:
    """A job that fails shuts its actors down; with cluster.reuse_actors=false a job starts new ones
    and stops them; a job of another shape releases the parked set (whose CPUs it may need)."""
    import ray

    from miles.core.actors import parked

    a = TINY + ["trainer.num_steps=1", "trainer.eval_every=0", f"warm_start.cache_dir={cache}"]
    _job(a)
    kept = parked()
    assert kept is not None

    def fail(metrics: dict[str, float], step: int) -> None:
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        _job(a, on_metrics=fail)
    assert parked() is None
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(kept.engines[0].health.remote(), timeout=30)  # the failed job had them, and killed them

    _job(a)
    kept = parked()
    _job(a + ["cluster.reuse_actors=false"])
    assert parked() is None
    with pytest.raises(ray.exceptions.RayActorError):  # another shape (here: reuse off) frees the parked set
        ray.get(kept.engines[0].health.remote(), timeout=30)


@pytest.mark.slow
def test_two_trainer_ranks_and_their_critics_are_reused_too(ray_cluster, cache: Path) -> None:
    """PPO on two ranks: the ranks' and the critics' process groups are rebuilt on the new port."""
    from miles.core.actors import parked

    a = TINY + ["algo=ppo", "placement.trainer_world_size=2", "trainer.num_steps=1", "trainer.eval_every=0",
                f"warm_start.cache_dir={cache}"]
    first = _job(a)
    ids = _ids(parked())
    assert len(ids) == 5  # an engine, two ranks, two critic ranks
    again = _job(a)
    assert _ids(parked()) == ids and parked().reused
    assert {"critic/value_loss", "critic/explained_var", "train/loss"} <= set(first[-1][1])
    assert again == first


@pytest.mark.slow
def test_disaggregated_jobs_of_another_trainer_side_keep_the_engines(ray_cluster, cache: Path) -> None:
    """Disaggregated, a job whose trainer side differs (here: PPO adds critic ranks) keeps the last job's
    engines and their pool, and starts its trainer side anew; it computes what a job on new engines does."""
    import ray

    from miles.core.actors import parked, release_parked

    a = TINY + ["placement=disaggregated", "trainer.num_steps=1", "trainer.eval_every=0",
                f"warm_start.cache_dir={cache}"]
    release_parked()
    first = _job(a)
    grpo = parked()
    kept = _job(a + ["algo=ppo"])
    ppo = parked()
    assert _ids(ppo)[:1] == _ids(grpo)[:1] and len(ppo.critics) == 1  # the engine, kept
    assert not set(_ids(ppo)[1:]) & set(_ids(grpo)[1:])  # new trainer and critic ranks
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(grpo.trainers[0].__ray_ready__.remote(), timeout=30)  # the old trainer rank is gone
    ray.kill(ppo.engines[0])  # an engine that dies while parked: the next job starts a new one and runs
    assert _job(a) == first
    assert _ids(parked())[0] not in _ids(ppo)
    release_parked()
    assert _job(a + ["algo=ppo"]) == kept


_KEEP_SCRIPT = """
import logging
import ray
from miles.config import validate
from miles.core.cluster import start_ray, stop_ray

logging.basicConfig(level=logging.INFO)
two, three = validate({"cluster": {"num_cpus": 2}}).cluster, validate({"cluster": {"num_cpus": 3}}).cluster
assert start_ray(two, keep=True) and ray.cluster_resources()["CPU"] == 2
assert not start_ray(two, keep=True), "the kept cluster serves a job with the same cluster.* settings"
assert start_ray(three, keep=True) and ray.cluster_resources()["CPU"] == 3, "other settings: a new cluster"
stop_ray()
assert not ray.is_initialized()
assert start_ray(two, keep=True)
print(ray.get_runtime_context().gcs_address)
print("ok")
"""


def test_a_kept_cluster_serves_jobs_with_its_settings_and_ends_with_the_process() -> None:
    """start_ray(keep=True), as sweeps on the basic launcher use it, in a process of its own: the
    cluster serves later jobs with the same cluster.* settings, and none of it outlives the process."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _KEEP_SCRIPT], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
    assert "stopping the Ray cluster kept from the last job" in p.stderr
    gcs = p.stdout.split()[-2]  # the last cluster's processes (raylet, GCS, ...) name its address
    time.sleep(1)
    left = [c for c in _cmdlines() if gcs in c]
    assert not left, f"the kept cluster outlived the process: {left[:3]}"


def _cmdlines() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out
