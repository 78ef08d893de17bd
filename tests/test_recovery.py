"""Rollout engines that die or hang in a run are replaced, get the current weights, and the run goes on
(:mod:`miles.core.recovery`): SIGSTOP of one engine, SIGKILL of every engine, and the clear error once
no restart is left."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from miles.bench.e2e import compose
from miles.rollout.dispatch import AllEnginesDeadError

pytestmark = pytest.mark.slow

TINY = ["algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4", "trainer.num_steps=3",
        "trainer.eval_every=0", "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=1",
        "warm_start.steps=20", "tracking=none", "placement.num_engines=2", "cluster.reuse_actors=false",
        "plugins.allow=[test_recovery.,miles.]"]


class Fault:
    """Hook: ``faults`` lists ``[step, point, signal, count]``: at that step's ``point`` (``after_rollout``
    or ``before_train``), send ``signal`` to ``count`` of this run's engine actor processes."""

    def __init__(self, faults: list[list]) -> None:
        self.faults = [tuple(f) for f in faults]

    def _fire(self, ctx, point: str) -> None:
        for step, at, sig, count in self.faults:
            if (step, at) != (ctx.step, point):
                continue
            # this run's engines: the module's runs do not keep their actors (cluster.reuse_actors=false)
            mine = [p for p in psutil.process_iter(["cmdline", "status"])
                    if (p.info["cmdline"] or [""])[0].startswith("ray::TorchEngine") and p.info["status"] != "zombie"]
            assert len(mine) >= count, f"found engine processes {mine}"
            for p in sorted(mine, key=lambda p: p.pid)[:count]:
                os.kill(p.pid, sig)
            ctx.add_metrics({"signalled": float(count)})

    def after_rollout(self, ctx, groups) -> None:
        self._fire(ctx, "after_rollout")

    def before_train(self, ctx, batch) -> None:
        self._fire(ctx, "before_train")


def _run(overrides: list[str], fault: str, cache: Path) -> list[dict[str, float]]:
    from miles.core.run import run_job

    run, resolved = compose(TINY + [f"warm_start.cache_dir={cache}", f"hooks=[{{_target_: test_recovery.Fault, {fault}}}]"]
                            + overrides)
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


def test_no_restart_left_is_one_clear_error(ray_cluster, cache: Path) -> None:
    """Without restarts, engines that die stay out; when none is left the run ends, saying why."""
    with pytest.raises(AllEnginesDeadError, match=r"all 2 rollout engine\(s\) died .*rollout.max_engine_restarts=0; "
                                                  "no restarts left"):
        _run(["rollout.max_engine_restarts=0"], "faults: [[1, before_train, 9, 2]]", cache)


def test_bench_faults_needs_a_step_per_fault(capsys) -> None:
    from miles.bench.faults import main

    with pytest.raises(SystemExit) as exit_:
        main(["--steps", "2"])
    assert exit_.value.code == 2 and "--steps 2: at least 3 steps for 2 faults" in capsys.readouterr().err
