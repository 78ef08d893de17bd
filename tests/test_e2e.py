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


def test_product_card_moe_fp8_on_two_trainer_ranks_and_two_engines_with_dynamic_sampling(tmp_path: Path) -> None:
    """The product card's ``model=qwen3_moe algo=grpo precision=fp8`` on two trainer ranks and two engines,
    with DAPO's filter: every step trains on a full batch of groups."""
    from mlflow.tracking import MlflowClient

    p = _miles(["model=qwen3_moe", "algo=grpo", "precision=fp8", "placement.trainer_world_size=2",
                "placement.num_engines=2", "cluster.num_cpus=2", "placement.cpus_per_bundle=1",
                "trainer.num_steps=2", "trainer.eval_every=0", "warm_start.steps=20", "task.num_eval_prompts=16",
                f"warm_start.cache_dir={tmp_path / 'cache'}",
                "rollout.filters=[{_target_:miles.rollout.filters.nonzero_reward_std,_partial_:true}]",
                "rollout.max_oversample_rounds=1"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert "2 engine(s), 2 trainer rank(s)" in out and "step 2/2" in out and "done in" in out
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    (r,) = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    assert r.data.params["model._target_"] == "miles.models.qwen3.qwen3_moe_spec"
    assert r.data.params["precision.rollout_quant"] == "fp8_block"
    m = {k: [v.value for v in client.get_metric_history(r.info.run_id, k)] for k in (
        "rollout/engines_alive", "rollout/groups", "rollout/filtered_groups", "rollout/padded_groups",
        "rollout/failed", "train/trainable_samples", "train/excluded_samples")}
    assert m["rollout/engines_alive"] == [2.0, 2.0] and m["rollout/failed"] == [0.0, 0.0]
    for step in range(2):  # 32 groups of 8 enter the batch; filtered ones that pad it are excluded
        assert m["rollout/groups"][step] >= 32
        assert m["train/trainable_samples"][step] + m["train/excluded_samples"][step] == 256
        assert m["train/excluded_samples"][step] == 8 * m["rollout/padded_groups"][step]


def test_placement_too_big_fails_fast_with_the_numbers(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "miles", "placement.trainer_world_size=4", "placement.cpus_per_bundle=2",
            "cluster.num_cpus=2", "tracking=none", f"warm_start.cache_dir={tmp_path / 'cache'}"]
    p = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    out = p.stdout + p.stderr
    assert "asks for 4 bundle(s) x 2 CPU = 8 CPU" in out and "has 2 CPU" in out
    assert not (tmp_path / "cache").exists(), "nothing is built before the placement is known to fit"


def test_placement_that_never_becomes_ready_fails_within_its_timeout(ray_cluster) -> None:
    """A joined cluster that cannot hold the placement: reserve() gives up after ready_timeout_s."""
    import time

    from miles.config import ConfigError
    from miles.core.cluster import reserve
    from miles.core.plan import make_plan
    from miles.machine import Machine

    run = validate({"placement": {"trainer_world_size": 4, "cpus_per_bundle": 2.0, "ready_timeout_s": 2.0},
                    "cluster": {"address": "auto"}})
    run = make_plan(run, Machine(cpus=4))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"asks for 4 bundle\(s\) x 2 CPU = 8 CPU, but the cluster has"):
        reserve(run)
    assert time.perf_counter() - t0 < 30


def test_eval_standard_error_is_over_prompts() -> None:
    from miles.core.evaluate import _standard_error

    assert _standard_error([1.0, 0.0, 1.0, 0.0]) == pytest.approx(0.57735 / 2, abs=1e-5)
    assert _standard_error([0.5]) == 0.0 and _standard_error([0.3, 0.3, 0.3]) == 0.0


def test_short_seeded_run_improves(ray_cluster, tmp_path: Path) -> None:
    """The default recipe, shortened to 80 steps: reward and held-out accuracy rise from the start."""
    from miles.core.run import run_job

    run = validate({"seed": 0, "tracking": {"backend": "none"}, "trainer": {"num_steps": 80, "eval_every": 0},
                    "warm_start": {"cache_dir": str(tmp_path / "cache")}})
    seen: list[tuple[int, dict]] = []
    final = run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.append((s, dict(m))))
    start = next(m for s, m in seen if s == 0)
    rewards = [m["train/reward_mean"] for s, m in seen if s > 0]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    print(f"eval/accuracy {start['eval/accuracy']:.3f} -> {final['eval/accuracy']:.3f}, "
          f"reward (20-step means) {first:.3f} -> {last:.3f}")
    assert final["eval/accuracy"] > start["eval/accuracy"] + 0.03
    # the noise of that figure: per-prompt means over 128 prompts, 4 samples each
    assert 0.01 < final["eval/accuracy_se"] < 0.06
    assert last > first + 0.03
    lrs = {s: m["train/lr"] for s, m in seen if s > 0}  # linear warmup over trainer.lr_warmup_steps
    assert lrs[1] == pytest.approx(run.trainer.lr / run.trainer.lr_warmup_steps)
    assert lrs[run.trainer.lr_warmup_steps] == pytest.approx(run.trainer.lr) == lrs[80]


def test_rendezvous_is_a_store_this_driver_holds_open(ray_cluster) -> None:
    """The group's store is bound when its port is picked (no other process can take the port before the
    ranks connect): loopback on a local cluster, this node's address on a joined one."""
    import socket

    from miles.core.cluster import rendezvous
    from miles.core.plan import make_plan
    from miles.machine import Machine

    addr, store = rendezvous(make_plan(validate({}), Machine(cpus=4)))
    assert addr == "127.0.0.1"
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((addr, store.port))  # taken: by the store itself
    store.set("k", "v")
    assert store.get("k") == b"v"
    joined, store2 = rendezvous(make_plan(validate({"cluster": {"address": "auto"}}), Machine(cpus=4)))
    assert joined == ray_cluster.util.get_node_ip_address() and store2.port != store.port


ALGO_OWN_METRICS = {"ppo": {"critic/value_loss", "critic/explained_var", "critic/vf_clip_frac"},
                    "dapo": {"train/overlong_penalty_mean", "train/clip_frac_high",
                             "rollout/filtered_by/nonzero_reward_std"},
                    "sft": {"train/sft_weighted_frac"},
                    "opd": {"distill/reverse_kl", "distill/teacher_logprob", "perf/teacher_s"}}


def test_every_shipped_algo_runs_end_to_end(ray_cluster, tmp_path: Path) -> None:
    """`python -m miles algo=X` for every X in conf/algo: a real step each, its own metrics logged."""
    import math

    from miles.bench.e2e import compose
    from miles.config.validate import group_options
    from miles.core.run import run_job

    algos = group_options("algo")
    assert {"grpo", "dr_grpo", "gspo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo",
            "sft", "opd"} <= set(algos)
    for algo in algos:
        overrides = [f"algo={algo}", "algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4",
                     "trainer.num_steps=1", "trainer.eval_every=0", "task.num_eval_prompts=4",
                     "rollout.eval_samples_per_prompt=2", "warm_start.steps=40", "tracking=none",
                     f"warm_start.cache_dir={tmp_path / 'cache'}"]
        if algo == "opd":  # the teacher: the policy's own start
            overrides.append("teacher.model={_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: null}")
        run, resolved = compose(overrides)
        seen: dict[int, dict] = {}
        run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s, seen=seen: seen.setdefault(s, dict(m)))
        last = seen[1]
        assert math.isfinite(last["train/loss"]) and last["train/trainable_samples"] > 0, algo
        assert ALGO_OWN_METRICS.get(algo, set()) <= set(last), f"{algo}: {sorted(last)}"
