"""One job: build the components from the validated config, start Ray, run the loop, clean up."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from miles.config import ConfigError, MilesConfig, TargetConfig, build
from miles.config.schema import to_yaml_dict

log = logging.getLogger("miles")


def build_components(run: MilesConfig) -> dict[str, Any]:
    """Everything that comes from a ``_target_``: task, reward, advantage estimator, model spec.

    All targets are checked against the allowlist before any of them is imported.
    """
    allow = run.plugins.allow
    model_node = TargetConfig(target=run.model.target, kwargs={"flavor": run.model.flavor, "path": run.model.path})
    parts = {
        "spec": build(model_node, allow=allow, key="model._target_"),
        "task": build(run.task.source, allow=allow, key="task.source._target_"),
        "reward_fn": build(run.task.reward, allow=allow, key="task.reward._target_"),
        "advantage_fn": build(run.algo.advantage, allow=allow, key="algo.advantage._target_"),
    }
    # let the estimator reject the batch shape now (e.g. a group baseline with one sample per
    # prompt), before any model is built or Ray starts
    try:
        parts["advantage_fn"](torch.zeros(run.algo.num_prompts_per_step, run.algo.num_samples_per_prompt))
    except ValueError as e:
        raise ConfigError(f"algo.advantage: {e}") from None
    return parts


def run_job(
    run: MilesConfig,
    *,
    resolved_yaml: str,
    overrides: list[str],
    on_metrics: Callable[[dict[str, float], int], None] | None = None,
) -> dict[str, float]:
    """Run one training job end to end; returns the final metrics.

    ``on_metrics(metrics, step)`` is called with every step's metrics after the tracker got them.
    """
    import ray
    from transformers import AutoTokenizer

    from miles.core.cluster import check_fits_locally, create_actors, start_ray
    from miles.core.loop import LoopContext, train
    from miles.models.checkpoint import ensure_checkpoint
    from miles.rollout.manager import RolloutManager
    from miles.tracking.mlflow_tracker import make_tracker

    t_start = time.perf_counter()
    random.seed(run.seed)
    torch.manual_seed(run.seed)
    check_fits_locally(run)
    parts = build_components(run)
    checkpoint = ensure_checkpoint(run, parts["spec"], parts["task"])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tracker = make_tracker(run, resolved_yaml=resolved_yaml, overrides=overrides,
                           config_dict=to_yaml_dict(dataclasses.asdict(run)))
    started_ray = start_ray(run)
    actors = None
    status = "FAILED"
    try:
        actors = create_actors(run, str(checkpoint))
        log.info("cluster ready in %.1fs: %d engine(s), %d trainer rank(s), %d torch thread(s) per actor",
                 time.perf_counter() - t_start, len(actors.engines), len(actors.trainers), actors.num_threads)
        ctx = LoopContext(
            run=run, task=parts["task"], rollout=RolloutManager(actors.engines, tokenizer, parts["reward_fn"]),
            trainers=actors.trainers, engines=actors.engines, advantage_fn=parts["advantage_fn"],
            log_metrics=tracker.log_metrics if on_metrics is None else _tee(tracker.log_metrics, on_metrics),
        )
        final = train(ctx)
        final["perf/wall_time_s"] = time.perf_counter() - t_start
        tracker.log_metrics({"perf/wall_time_s": final["perf/wall_time_s"]}, run.trainer.num_steps)
        status = "FINISHED"
        log.info("done in %.1fs: eval/accuracy %.3f (greedy %.3f)", final["perf/wall_time_s"],
                 final.get("eval/accuracy", float("nan")), final.get("eval/greedy_accuracy", float("nan")))
        return final
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.finish(status)
        if actors is not None:
            actors.shutdown()
        if started_ray:
            ray.shutdown()


def _tee(*fns: Callable[[dict[str, float], int], None]) -> Callable[[dict[str, float], int], None]:
    def call(metrics: dict[str, float], step: int) -> None:
        for fn in fns:
            fn(metrics, step)

    return call
