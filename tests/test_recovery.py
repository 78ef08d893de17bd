"""Rollout engines that die or hang in a run are replaced, get the current weights, and the run goes on
(:mod:`miles.core.recovery`): SIGKILL of every engine mid-run, SIGKILL during the train step (the
engines' memory offload), SIGSTOP of one engine, and the clear error once no restart is left."""

from __future__ import annotations

import os
import signal
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
    """Hook: at step ``step``, at ``point`` (``after_rollout`` or ``before_train``), send ``sig`` to
    ``count`` of this run's engine actor processes."""

    def __init__(self, step: int, point: str, sig: int = signal.SIGKILL, count: int = 1) -> None:
        self.step, self.point, self.sig, self.count = step, point, sig, count
        self.hit: list[int] = []

    def _fire(self, ctx, point: str) -> None:
        if ctx.step != self.step or point != self.point or self.hit:
            return
        # this run's engines: the module's runs do not keep their actors (cluster.reuse_actors=false)
        mine = [p for p in psutil.process_iter(["cmdline", "status"])
                if (p.info["cmdline"] or [""])[0].startswith("ray::TorchEngine") and p.info["status"] != "zombie"]
        assert len(mine) >= self.count, f"found engine processes {mine}"
        for p in sorted(mine, key=lambda p: p.pid)[: self.count]:
            os.kill(p.pid, self.sig)
            self.hit.append(p.pid)
        ctx.add_metrics({"signalled": float(len(self.hit))})

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


def test_every_engine_killed_mid_run_is_replaced_and_the_run_goes_on(ray_cluster, cache: Path) -> None:
    """Both engines SIGKILLed after step 2's rollout: the push's health check takes them out and
    replaces them (each with version 2 before any request), and step 3 rolls out on the new ones."""
    seen = _run([], "step: 2, point: after_rollout, count: 2", cache)
    assert [m.get("hooks/fault/signalled") for m in seen[1:]] == [None, 2.0, None]
    assert [m["fault/engine_restarts"] for m in seen[1:]] == [0, 2, 2] and seen[2]["fault/engine_outage_s"] > 0
    assert seen[-1]["rollout/samples"] == 16 and seen[-1]["rollout/engines_alive"] == 2


def test_a_hung_engine_is_taken_out_and_replaced(ray_cluster, cache: Path) -> None:
    """One engine stopped (SIGSTOP) after step 1's rollout: the push's health check finds it hung within
    rollout.engine_health_timeout_s, and a new engine takes its place before the weights go out."""
    seen = _run(["rollout.engine_health_timeout_s=2", "rollout.request_timeout_s=5", "rollout.max_retries=3"],
                "step: 1, point: after_rollout, sig: 19", cache)
    assert seen[1]["fault/engine_restarts"] == 1
    assert seen[-1]["fault/engine_restarts"] == 1 and seen[-1]["rollout/samples"] == 16


def test_no_restart_left_is_one_clear_error(ray_cluster, cache: Path) -> None:
    """Without restarts, engines that die stay out; when none is left the run ends, saying why."""
    with pytest.raises(AllEnginesDeadError, match=r"all 2 rollout engine\(s\) died .*rollout.max_engine_restarts=0; "
                                                  "no restarts left"):
        _run(["rollout.max_engine_restarts=0"], "step: 1, point: before_train, count: 2", cache)
