"""Rollout engines that die or hang in a run are replaced, get the current weights, and the run goes on
(:mod:`miles.core.recovery`): SIGSTOP of one engine, SIGKILL of every engine, and the clear error once
no restart is left. A trainer rank SIGKILLed mid-run (FSDP and Megatron), or stopped (SIGSTOP: found by
the step's probes and killed), is restarted with its group and restored from the last checkpoint; without
a checkpoint, the run ends.

The default run keeps one test per fault kind; the variants marked ``faults`` (a replacement started in the
background, a tenant run, an async schedule, Megatron ranks, a rank restored after a hang, a hang in the
weight push, a second death after a restore, the bench's non-finite step) run with ``pytest -m faults``, and
``python -m miles.bench faults`` injects every kind into one run of the default task (``trainer=megatron``,
``--engine sglang`` or a schedule as overrides)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import psutil
import pytest

from miles.bench.e2e import compose
from miles.core.ledger import OUTCOMES
from miles.rollout.dispatch import AllEnginesDeadError

pytestmark = pytest.mark.slow

TINY = ["algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4", "trainer.num_steps=3",
        "trainer.eval_every=0", "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=1",
        "warm_start.steps=20", "tracking=none", "placement.num_engines=2", "cluster.reuse_actors=false",
        "plugins.allow=[test_recovery.,miles.]"]


def _cmd0(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return (p.cmdline() or [""])[0]
    return ""


def _status(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return p.status()
    return psutil.STATUS_DEAD


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


class Fault:
    """Hook: ``faults`` lists ``[step, point, signal, count]``: at that step's ``point`` (``after_rollout``
    or ``before_train``), send ``signal`` to ``count`` of this run's engine actor processes."""

    def __init__(self, faults: list[list]) -> None:
        self.faults = [tuple(f) for f in faults]

    def _fire(self, ctx, point: str) -> None:
        for step, at, sig, count in self.faults:
            if (step, at) != (ctx.step, point):
                continue
            # this run's engines: the module's runs do not keep their actors (cluster.reuse_actors=false), and
            # the engines of this test process's Ray cluster (its raylet's children) are this run's, never those
            # of another test process on the machine; an engine an earlier fault stopped is not one of them any
            # more (replaced, and killed when Ray gets to it: until then it is still a stopped process)
            mine = [p for p in psutil.Process().children(recursive=True)
                    if _cmd0(p).startswith("ray::TorchEngine")
                    and _status(p) not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)]
            assert len(mine) >= count, f"found engine processes {mine}"
            for p in sorted(mine, key=lambda p: p.pid)[:count]:
                os.kill(p.pid, sig)
            ctx.add_metrics({"signalled": float(count)})

    def after_rollout(self, ctx, groups) -> None:
        self._fire(ctx, "after_rollout")

    def before_train(self, ctx, batch) -> None:
        self._fire(ctx, "before_train")


class WaitForEngines:
    """Hook: after the rollout of ``step``, wait until ``count`` engine actors of this run are up (alive in
    Ray's actor table: constructed), and a second more for their first health check to answer."""

    def __init__(self, step: int, count: int) -> None:
        self.step, self.count = step, count

    def after_rollout(self, ctx, groups) -> None:
        if ctx.step != self.step:
            return
        import time

        import ray

        job = ray.get_runtime_context().get_job_id()
        deadline = time.monotonic() + 120
        while sum(1 for a in ray._private.state.actors().values() if a["ActorClassName"] == "TorchEngine"
                  and a["State"] == "ALIVE" and a["JobID"] == job) < self.count:
            assert time.monotonic() < deadline, f"fewer than {self.count} engines up after 120 s"
            time.sleep(0.2)
        time.sleep(1.0)


def _run(overrides: list[str], fault: str, cache: Path, more_hooks: str = "") -> list[dict[str, float]]:
    from miles.core.run import run_job

    hooks = f"hooks=[{{_target_: test_recovery.Fault, {fault}}}{', ' + more_hooks if more_hooks else ''}]"
    run, resolved = compose(TINY + [f"warm_start.cache_dir={cache}", hooks] + overrides)
    seen: list[dict[str, float]] = []
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.append(dict(m)))
    return seen


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warm_start")


def test_hung_and_killed_engines_are_replaced_and_the_run_goes_on(ray_cluster, cache: Path) -> None:
    """Step 1: one engine stopped (SIGSTOP) after the rollout; the train step's memory offload finds it
    hung within rollout.engine_timeout_s and the push puts a new engine in its place. Step 2: both engines
    SIGKILLed after the rollout; the push's health check takes them out and replaces them. Each new
    engine gets the step's version before any request, and every step rolls out its whole batch."""
    seen = _run(["rollout.engine_timeout_s=2"], "faults: [[1, after_rollout, 19, 1], [2, after_rollout, 9, 2]]",
                cache)
    assert [m.get("hooks/fault/signalled") for m in seen[1:]] == [1.0, 2.0, None]
    assert [m["fault/engine_restarts"] for m in seen[1:]] == [1, 3, 3] and seen[2]["fault/engine_outage_s"] > 0
    assert [m["rollout/samples"] for m in seen[1:]] == [16, 16, 16] and seen[-1]["rollout/engines_alive"] == 2
    assert (seen[1]["weight_sync/version"], seen[3]["weight_sync/version"]) == (1, 3)  # step 2: new engines only


@pytest.mark.faults
def test_a_replacement_starts_while_the_run_goes_on(ray_cluster, cache: Path) -> None:
    """placement=disaggregated: engine 0 of 2 SIGKILLed after step 1's rollout. Step 1's push starts its
    replacement and returns without waiting for it; step 2 rolls out its whole batch on the other engine
    alone; once the replacement is up, step 2's push gives it the weights and step 3 rolls out on both."""
    seen = _run(["placement=disaggregated", "placement.cpus_per_engine=0.5", "placement.cpus_per_trainer_rank=0.5"],
                "faults: [[1, after_rollout, 9, 1]]", cache, "{_target_: test_recovery.WaitForEngines, step: 2, count: 2}")
    assert seen[1]["hooks/fault/signalled"] == 1.0
    assert (seen[1]["fault/engines_starting"], seen[1]["fault/engine_blocked_s"]) == (1, 0)  # the push did not wait
    assert [m["rollout/engines_alive"] for m in seen[1:]] == [2, 1, 2]  # step 1's was read before the kill
    assert [m["fault/engine_restarts"] for m in seen[1:]] == [1, 1, 1] and seen[2]["fault/engines_starting"] == 0
    assert [m["rollout/samples"] for m in seen[1:]] == [16, 16, 16] and seen[2]["fault/engine_outage_s"] > 0
    assert seen[3]["weight_sync/version"] == 3


def test_no_restart_left_is_one_clear_error(ray_cluster, cache: Path) -> None:
    """Without restarts, engines that die stay out; when none is left the run ends, saying why."""
    with pytest.raises(AllEnginesDeadError, match=r"all 2 rollout engine\(s\) died .*rollout.max_engine_restarts=0; "
                                                  "no restarts left"):
        _run(["rollout.max_engine_restarts=0"], "faults: [[1, before_train, 9, 2]]", cache)


def test_bench_faults_needs_a_step_per_fault(capsys) -> None:
    from miles.bench.faults import main

    with pytest.raises(SystemExit) as exit_:
        main(["--steps", "3"])
    assert exit_.value.code == 2 and "--steps 3: at least 6 steps for 5 faults" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--faults", "trainer_kill,server_kill"])
    assert exit_.value.code == 2 and ("--faults trainer_kill,server_kill: choose from engine_kill, engine_hang, "
                                      "trainer_kill, trainer_hang, nonfinite_step (with --engine torch)"
                                      ) in capsys.readouterr().err


@pytest.mark.faults
def test_the_benchs_nonfinite_step_is_skipped_and_the_run_goes_on(ray_cluster, cache: Path) -> None:
    """bench faults' ``nonfinite_step``: step 1's batch gets NaN advantages before its train step; the
    trainer skips that update and counts it, and step 2 updates as usual."""
    from miles.bench.faults import FaultInjector
    from miles.core.run import run_job

    overrides = [*TINY, "placement.num_engines=1", "trainer.num_steps=2", f"warm_start.cache_dir={cache}",
                 "hooks=[{_target_: miles.bench.faults.FaultInjector, engine_class: TorchEngine, "
                 "faults: [[1, nonfinite_step]]}]"]
    run, resolved = compose(overrides)
    seen: dict[int, dict[str, float]] = {}
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.__setitem__(s, dict(m)))
    assert [name for name, _ in FaultInjector.sent.values()] == ["nonfinite_step"] and 1 in FaultInjector.sent
    assert seen[1]["train/nonfinite_skipped"] >= 1 and seen[2]["train/nonfinite_skipped"] == 0


@pytest.mark.faults
def test_the_engines_and_trainer_of_a_tenant_run_are_replaced(ray_cluster, plugin_engines, cache: Path,
                                                              tmp_path: Path) -> None:
    """Multi-LoRA tenants share one engine pool. Step 2: the trainer rank SIGKILLed before its train step;
    it is restarted and restored from step 1's checkpoint (both adapters, and each tenant's prompt
    sampler), and step 2 runs again with the same batch. Both engines die (once each) at their first
    generate call with step 2's adapters, in tenant a's rollout of step 3: both are replaced, get the base
    and both adapters, a's rollout runs again with the same prompts, and every tenant rolls out its whole
    batch at every step; the ledger counts each prompt trained once."""
    import json

    from miles.config import validate
    from miles.core.run import run_job

    cfg = {"seed": 1, "tracking": {"backend": "none"}, "plugins": {"allow": ["plugin_backends.", "test_recovery."]},
           "warm_start": {"steps": 20, "cache_dir": str(cache)},
           "trainer": {"num_steps": 3, "eval_every": 0, "save_every": 1, "save_dir": str(tmp_path / "ckpt")},
           "hooks": [{"_target_": "test_recovery.KillTrainerRank", "step": 2}],
           "algo": {"num_prompts_per_step": 4, "num_samples_per_prompt": 4}, "cluster": {"reuse_actors": False},
           "adapter": {"kind": "lora", "rank": 4, "alpha": 8.0}, "placement": {"num_engines": 2},
           "rollout": {"engine": {"_target_": "plugin_backends.DiesAtVersion", "die_at_version": 2,
                                  "die_engines": [0, 1], "once_marker": str(tmp_path / "died_{engine}")}},
           "tenants": [{"name": "a", "task": "count"}, {"name": "b", "task": "largest"}]}
    seen: dict[int, dict[str, float]] = {}
    final = run_job(validate(cfg), resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.__setitem__(s, dict(m)))
    assert (tmp_path / "died_0").exists() and (tmp_path / "died_1").exists()
    assert [seen[s]["fault/engine_restarts"] for s in (1, 2, 3)] == [0, 0, 2]
    assert all(seen[s][f"tenant/{t}/rollout/samples"] == 16 and seen[s][f"tenant/{t}/rollout/failed"] == 0
               for s in (1, 2, 3) for t in ("a", "b"))
    assert seen[3]["tenant/b/rollout/engines_alive"] == 2  # the replacements serve the next tenant too
    assert [seen[s]["fault/trainer_restarts"] for s in (1, 2, 3)] == [0, 1, 1]
    # the retry rolls out the same prompts from the same weights: the same tokens, and log-probs equal up to
    # float rounding (two engines batch the tenants' rows as they arrive, so the batch shapes may differ)
    first, retried = KillTrainerRank.batches
    assert first[:2] == retried[:2]
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(first[2], retried[2], strict=True))
    assert (final["ledger/drawn"], final["ledger/trained"], final["ledger/open"]) == (24, 24, 0)
    samplers = json.loads((tmp_path / "ckpt" / "step_000003" / "loop_state.json").read_text())["tenants"]
    assert sorted(samplers) == ["a", "b"] and samplers["a"] != samplers["b"]


class KillTrainerRank:
    """Hook: at ``step`` (before its train step, the first ``times`` times it runs) send ``sig`` (SIGKILL,
    or SIGSTOP: a hung rank) to one trainer rank of this run, found in Ray's actor table by its class
    name and job, the one started last (its process id)."""

    batches: list = []  # the batch of every attempt at ``step``, read by the test
    pids: list = []  # the processes signalled

    def __init__(self, step: int, times: int = 1, sig: str = "SIGKILL") -> None:
        self.step, self.times, self.sig = step, times, getattr(signal, sig)
        KillTrainerRank.batches, KillTrainerRank.pids = [], []

    def before_train(self, ctx, batch) -> None:
        if ctx.step != self.step:
            return
        KillTrainerRank.batches.append((batch.prompt_ids, batch.response_ids, batch.rollout_logprobs))
        if not self.times:
            return
        import ray

        job = ray.get_runtime_context().get_job_id()
        # this run's ranks are the newest trainer actors: the test session's other ones (a session fixture's
        # megatron pair) started earlier, and process ids wrap around, so they may be the larger ones
        ranks = [(a["StartTime"], a["Pid"]) for a in ray._private.state.actors().values()
                 if a["ActorClassName"] in ("FSDPTrainer", "MegatronTrainer") and a["State"] == "ALIVE"
                 and a["JobID"] == job]
        assert ranks, "no trainer rank process"
        pid = max(ranks)[1]
        os.kill(pid, self.sig)
        KillTrainerRank.pids.append(pid)
        self.times -= 1
        ctx.add_metrics({"killed": 1.0})


@pytest.mark.parametrize("trainer", ["fsdp", pytest.param("megatron", marks=[pytest.mark.faults, pytest.mark.megatron])])
def test_a_killed_trainer_rank_is_restored_from_the_last_checkpoint(ray_cluster, cache: Path, tmp_path: Path,
                                                                    trainer: str) -> None:
    """Step 2: one of two trainer ranks SIGKILLed before the train step. The step is abandoned, both ranks are
    restarted and restored from step 1's checkpoint, and step 2 runs again with the same prompts (group
    ids, sampling seeds and weights: the same tokens and log-probs): the run finishes, each step logged
    once, and the ledger counts every prompt trained once."""
    from miles.core.run import run_job

    overrides = [*TINY, "placement.num_engines=1", "placement.trainer_world_size=2", "trainer.num_steps=2",
                 "trainer.save_every=1", f"trainer.save_dir={tmp_path}", f"warm_start.cache_dir={cache}",
                 "hooks=[{_target_: test_recovery.KillTrainerRank, step: 2}]"]
    if trainer == "megatron":
        overrides.append("trainer=megatron")
    run, resolved = compose(overrides)
    seen: list[tuple[int, dict[str, float]]] = []
    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.append((s, dict(m))))
    steps = [s for s, _ in seen if s > 0]
    assert steps == [1, 2]
    by = dict(seen)
    assert by[2]["hooks/kill_trainer_rank/killed"] == 1.0
    assert [by[s]["fault/trainer_restarts"] for s in steps] == [0, 1] and by[2]["fault/trainer_restore_s"] > 0
    assert by[2]["rollout/samples"] == 16 and by[2]["train/trainable_samples"] > 0
    first, retried = KillTrainerRank.batches  # the retry rolls out the same prompts from the same weights
    assert first == retried
    assert (final["ledger/drawn"], final["ledger/trained"], final["ledger/open"]) == (8, 8, 0)


@pytest.mark.faults
def test_a_killed_trainer_rank_under_an_async_schedule_is_restored(ray_cluster, cache: Path, tmp_path: Path) -> None:
    """Under schedule=fully_async (one_step_off runs the same code with a smaller buffer), step 3: one of two FSDP ranks SIGKILLed before the train step while the
    stream generates ahead. The stream is stopped, the ranks restored from step 2's checkpoint, and a new
    stream regenerates the prompts open there before drawing new ones: the run finishes with one restart,
    each step logged once, and the ledger counts every prompt trained once or accounted for."""
    from miles.core.run import run_job

    overrides = [*TINY, "schedule=fully_async", "placement=disaggregated", "placement.num_engines=1",
                 "placement.cpus_per_engine=0.5", "placement.cpus_per_trainer_rank=0.5", "placement.trainer_world_size=2",
                 "trainer.num_steps=4",
                 "trainer.save_every=1", f"trainer.save_dir={tmp_path}", f"warm_start.cache_dir={cache}",
                 "hooks=[{_target_: test_recovery.KillTrainerRank, step: 3}]"]
    run, resolved = compose(overrides)
    seen: list[tuple[int, dict[str, float]]] = []
    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.append((s, dict(m))))
    steps = [s for s, _ in seen if s > 0]
    assert steps == [1, 2, 3, 4]
    by = dict(seen)
    assert by[3]["hooks/kill_trainer_rank/killed"] == 1.0
    assert [by[s]["fault/trainer_restarts"] for s in steps] == [0, 0, 1, 1] and by[3]["fault/trainer_restore_s"] > 0
    assert len(KillTrainerRank.batches) == 2 and by[3]["train/trainable_samples"] > 0
    assert final["ledger/open"] == 0 and final["ledger/trained"] == 16  # 4 steps x 4 prompts, each once
    assert final["ledger/drawn"] == sum(final[f"ledger/{o}"] for o in OUTCOMES)


@pytest.mark.faults
def test_a_hung_trainer_rank_is_killed_and_restored(ray_cluster, cache: Path, tmp_path: Path) -> None:
    """Step 2: one of two FSDP ranks stopped (SIGSTOP) before the train step; its peer waits on it in a
    collective. The step's probes find it (trainer.hang_timeout_s=5), it is killed, and the run goes on
    as after a death: restored from step 1's checkpoint, step 2 retried with the same batch."""
    from miles.core.run import run_job

    overrides = [*TINY, "placement.num_engines=1", "placement.trainer_world_size=2", "trainer.num_steps=2",
                 "trainer.save_every=1", f"trainer.save_dir={tmp_path}", f"warm_start.cache_dir={cache}",
                 "trainer.hang_timeout_s=5", "hooks=[{_target_: test_recovery.KillTrainerRank, step: 2, sig: SIGSTOP}]"]
    run, resolved = compose(overrides)
    seen: list[tuple[int, dict[str, float]]] = []
    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.append((s, dict(m))))
    assert [s for s, _ in seen if s > 0] == [1, 2]
    by = dict(seen)
    assert by[2]["fault/trainer_restarts"] == 1
    assert 0 < by[2]["fault/trainer_detect_s"] < 60  # probes every 5 s, answered within 5 s, or killed
    assert _gone(KillTrainerRank.pids[0])  # the stopped process was killed, not left behind
    first, retried = KillTrainerRank.batches
    assert first == retried
    assert (final["ledger/drawn"], final["ledger/trained"], final["ledger/open"]) == (8, 8, 0)


@pytest.mark.faults
def test_a_rank_hung_in_the_weight_push_is_killed_and_restored(ray_cluster, plugin_engines, cache: Path,
                                                               tmp_path: Path) -> None:
    """Step 2: FSDP rank 1 of 2 stops (SIGSTOP) inside the weight push while rank 0 waits on it in the gather.
    The push's probes find it (trainer.hang_timeout_s=5) and kill it, and the run goes on as after a death:
    restored from step 1's checkpoint, step 2 retried and its push sent."""
    from miles.core.run import run_job

    overrides = [*TINY, "placement.num_engines=1", "placement.trainer_world_size=2", "trainer.num_steps=2",
                 "trainer.save_every=1", f"trainer.save_dir={tmp_path}", f"warm_start.cache_dir={cache}",
                 "trainer.hang_timeout_s=5", "trainer._target_=plugin_backends.StopsInPush",
                 "plugins.allow=[plugin_backends.,miles.]", "hooks=[]"]
    run, resolved = compose(overrides)
    seen: list[tuple[int, dict[str, float]]] = []
    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.append((s, dict(m))))
    assert (tmp_path / "stopped-in-push").exists()
    assert [s for s, _ in seen if s > 0] == [1, 2]
    by = dict(seen)
    assert by[2]["fault/trainer_restarts"] == 1 and by[2]["weight_sync/version"] == 2
    assert 0 < by[2]["fault/trainer_detect_s"] < 60  # probes every 5 s, answered within 5 s, or killed
    assert (final["ledger/drawn"], final["ledger/trained"], final["ledger/open"]) == (8, 8, 0)


def test_a_hang_without_recovery_is_one_clear_error(ray_cluster, cache: Path, tmp_path: Path) -> None:
    """trainer.max_failures=0: the stopped rank is found and killed, and the run ends with an error that
    says it hung, instead of waiting out the process group's timeout."""
    from miles.core.recovery import TrainerRankHungError
    from miles.core.run import run_job

    overrides = [*TINY, "placement.num_engines=1", "placement.trainer_world_size=2", "trainer.num_steps=2",
                 "trainer.max_failures=0", f"warm_start.cache_dir={cache}", "trainer.hang_timeout_s=3",
                 "hooks=[{_target_: test_recovery.KillTrainerRank, step: 1, sig: SIGSTOP}]"]
    run, resolved = compose(overrides)
    with pytest.raises(TrainerRankHungError, match=r"trainer rank\(s\) [01] did not answer a liveness probe within "
                                                   r"trainer.hang_timeout_s=3 s .*: stopped or hung; killed"):
        run_job(run, resolved_yaml=resolved, overrides=overrides)


@pytest.mark.faults
def test_no_recovery_left_is_one_clear_error(ray_cluster, cache: Path, tmp_path: Path) -> None:
    """trainer.max_failures=1: the rank killed at step 2 is recovered once; killed again in the retried
    step, the run ends with an error naming the rank and the key."""
    from miles.core.recovery import TrainerRankDiedError
    from miles.core.run import run_job

    overrides = [*TINY, "placement.num_engines=1", "trainer.num_steps=2", "trainer.max_failures=1",
                 "trainer.save_every=1", f"trainer.save_dir={tmp_path}", f"warm_start.cache_dir={cache}",
                 "hooks=[{_target_: test_recovery.KillTrainerRank, step: 2, times: 2}]"]
    run, resolved = compose(overrides)
    with pytest.raises(TrainerRankDiedError, match=r"step 2: trainer rank\(s\) 0 died \(.*\); the step was abandoned. "
                                                   r"No restart left \(trainer.max_failures=1\)"):
        run_job(run, resolved_yaml=resolved, overrides=overrides)
    assert len(KillTrainerRank.batches) == 2  # the first attempt at step 2, and its one retry


def test_no_checkpoint_to_restore_is_one_clear_error() -> None:
    """A dead rank with no run checkpoint yet: the run stops, naming the ranks and trainer.save_every."""
    from miles.core.recovery import TrainerRankDiedError
    from miles.core.step import LoopContext, restore_point

    run, _ = compose(TINY)
    ctx = LoopContext(run=run, task=None, rollout=None, trainers=[], engines=[], advantage_fn=None,
                      log_metrics=None)
    died = TrainerRankDiedError(1, {"trainer": [1], "critic": []}, RuntimeError("ActorDiedError: gone"))
    with pytest.raises(TrainerRankDiedError, match=r"step 1: trainer rank\(s\) 1 died \(RuntimeError: ActorDiedError: "
                                                   r"gone\); the step was abandoned. There is no run checkpoint .* set "
                                                   r"trainer.save_every"):
        restore_point(ctx, died)
    ctx.last_checkpoint = "/ckpt/step_1"
    assert restore_point(ctx, died) == "/ckpt/step_1"


def test_a_checkpoint_of_other_tenants_is_refused() -> None:
    """A run with tenants a and b resumes only from a checkpoint that holds a sampler for each of them."""
    import random
    from types import SimpleNamespace

    from miles.core.tenants import _restore_samplers

    rng = {"a": random.Random(1), "b": random.Random(2)}
    for held in (None, {"a": random.Random(3).getstate()}):
        with pytest.raises(ValueError, match=r"prompt samplers are \['a'\]|prompt samplers are \[\]"):
            _restore_samplers(rng, SimpleNamespace(tenants=held, path="step_000001"))
    _restore_samplers(rng, SimpleNamespace(tenants={"a": random.Random(3).getstate(), "b": random.Random(4).getstate()},
                                           path="step_000001"))
    assert rng["a"].random() == random.Random(3).random()


def test_max_failures_below_0_is_refused() -> None:
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.max_failures: must be 0"):
        compose(["trainer.max_failures=-1"])
