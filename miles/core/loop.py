"""The RL post-training loop: rollout -> reward -> advantages -> train -> sync -> log.

One step, synchronously:

1. **Rollout.** Draw prompts from the task; the engines sample
   ``num_samples_per_prompt`` responses per prompt with the current weights and
   return token ids plus the log-prob of each sampled token.
2. **Reward.** The task's rule scores each decoded response. Optional filters
   drop groups with nothing to learn from (DAPO: all rewards equal) and fresh
   prompts replace them. A response whose generation or reward failed stays in
   its group, marked FAILED, and is left out of everything below.
3. **Advantages.** Each response is compared with the others for the same
   prompt (GRPO: reward minus group mean, over group std).
4. **Train.** Trainer ranks recompute log-probs on the same tokens and take a
   policy-gradient step (PPO-clip; optional KL, entropy, TIS).
5. **Sync.** The new weights reach every engine as version ``step``; the next
   rollout samples from them.
6. **Log.** Reward, losses, mismatch, timings (``perf/engine_busy_frac``: the share of the step
   the engines spent generating, :func:`~miles.core.step.engine_busy`) and weight-sync cost go to the tracker;
   evaluation on held-out prompts runs at step 0, every ``trainer.eval_every`` steps, and at the
   end.

With ``trainer.save_every`` the loop writes run checkpoints, and ``trainer.resume_from`` continues
from one (:mod:`miles.core.resume`). The ``hooks:`` chain is called at named points of every step
(:mod:`miles.hooks`); a hook may add metrics or end the run after the current step. Steps 3-4 on a
batch (:func:`~miles.core.step.learn`) and the checkpoints are shared with the async schedules (:mod:`miles.core.step`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from miles.core.evaluate import evaluate
from miles.core.schedules import train_async
from miles.core.step import (
    LoopContext,
    begin_profile,
    collect_through_outage,
    end_profile,
    engine_busy,
    engine_busy_metrics,
    learn,
    log_batch_sizes,
    push_weights,
    resume_point,
    run_steps,
    sampling_params,
    save_checkpoint,
)
from miles.tracking.timeline import span
from miles.types import SamplingParams

log = logging.getLogger(__name__)


def train(ctx: LoopContext) -> dict[str, float]:
    """Run ``trainer.num_steps`` RL steps on the run's schedule; returns the last step's metrics (including
    final eval). ``schedule=sync`` runs the steps below; the async schedules are :mod:`miles.core.schedules`."""
    return SCHEDULES[ctx.run.schedule.name](ctx)


def train_sync(ctx: LoopContext) -> dict[str, float]:
    """``schedule=sync``: rollout, train and weight sync in turn, one step after the other."""
    run = ctx.run
    rng = random.Random(run.seed)
    eval_set = ctx.task.eval_problems(run.task.num_eval_prompts)
    sampling = sampling_params(run)
    log_batch_sizes(run)
    hooks = ctx.hooks

    first, next_group_id = resume_point(ctx, lambda state: rng.setstate(state.rng_state))
    hooks.on_run_start(first - 1)
    metrics: dict[str, float] = {}
    if run.trainer.resume_from is None:
        metrics = evaluate(ctx, eval_set)
        hooks.after_eval(0, metrics)
        ctx.log_metrics(metrics | hooks.pop_metrics(), 0)
        log.info("step 0: eval/accuracy %.3f (greedy %.3f)", metrics["eval/accuracy"], metrics["eval/greedy_accuracy"])
    return run_steps(ctx, first, next_group_id,
                     lambda step, next_group_id: _step(ctx, step, rng, next_group_id, eval_set, sampling),
                     lambda state: rng.setstate(state.rng_state), metrics)


def _step(ctx: LoopContext, step: int, rng: random.Random, next_group_id: int, eval_set: list,
          sampling: SamplingParams) -> tuple[dict[str, float], int]:
    """One synchronous step (1-6 of the module docstring, and the run checkpoint); returns its metrics and
    the next group id."""
    run, algo, hooks = ctx.run, ctx.run.algo, ctx.hooks
    begin_profile(ctx, step)
    if ctx.timeline is not None:  # tracking.timeline_steps: every actor's busy spans in this step
        ctx.timeline.begin(step)
    t0 = time.perf_counter()  # the engines' first reading: the last step's last one, when it ran no eval
    busy0 = ctx.engine_readings if ctx.engine_readings is not None else engine_busy(ctx.rollout.live_engines)
    ctx.engine_readings = None  # a step that fails (and is retried) reads anew

    # 1-2. rollout and reward: n responses per prompt from the current weights, scored by the task;
    # groups the sample filters drop (e.g. all rewards equal) are replaced by fresh prompts
    def collect(first: int = next_group_id):
        return ctx.rollout.collect(
            lambda k: ctx.task.sample(k, rng), algo.num_prompts_per_step, algo.num_samples_per_prompt, sampling,
            seed=run.seed * 1_000_003 + first, first_group_id=first)

    with span("rollout"):  # every engine dead in it: with recovery, new ones and the rollout again
        groups, metrics = collect_through_outage(ctx, step, collect)
    ctx.ledger.draw(range(next_group_id, next_group_id + int(metrics["rollout/groups"])))
    for group_id, outcome in ctx.rollout.left_out.items():
        ctx.ledger.settle(group_id, outcome)
    next_group_id += int(metrics["rollout/groups"])
    hooks.after_rollout(step, groups)
    t1 = time.perf_counter()

    # 3-4. advantages and the train step
    with span("learn"):
        metrics, samples = learn(ctx, step, groups, metrics)
    ctx.ledger.settle_batch(groups)
    t2 = time.perf_counter()

    # 5. sync: the engines still in rotation sample from the new weights from now on
    with span("sync"):
        metrics |= push_weights(ctx, step)
    hooks.after_weight_sync(step, step)
    t3 = time.perf_counter()  # the push's health check (with recovery) was the step's last engine reading
    busy3 = ctx.engine_readings if ctx.engine_readings is not None else engine_busy(ctx.rollout.live_engines)
    end_profile(ctx, step)

    # 6. evaluate and log; the last step is the last of num_steps or the one a hook asked to stop at
    last = step == run.trainer.num_steps or hooks.stop_reason is not None
    evaluated = None
    if last or (run.trainer.eval_every and step % run.trainer.eval_every == 0):
        with span("eval"):
            evaluated = evaluate(ctx, eval_set)
        hooks.after_eval(step, evaluated)
        metrics |= evaluated
    ctx.engine_readings = None if evaluated is not None else busy3  # the eval generated: the next step reads anew
    metrics |= {
        "perf/step_time_s": t3 - t0, "perf/rollout_s": t1 - t0,
        "perf/train_s": t2 - t1, "perf/sync_s": t3 - t2,
    } | engine_busy_metrics(busy0, busy3) | hooks.pop_metrics()
    if ctx.trainer_recovery is not None:
        metrics |= ctx.trainer_recovery.metrics()
    with span("log"):
        ctx.log_metrics(metrics, step)
        if ctx.log_distributions is not None:
            ctx.log_distributions({"train/reward": [s.reward for s in samples],
                                   "rollout/response_len": [float(len(s.response_ids)) for s in samples]}, step)
    every = run.trainer.save_every
    if every and (step % every == 0 or step == run.trainer.num_steps or hooks.stop_reason is not None):
        with span("checkpoint"):
            save_checkpoint(ctx, step, rng.getstate(), next_group_id, ctx.ledger.state())
    if ctx.timeline is not None:
        ctx.timeline.end(step)
    return metrics, next_group_id


SCHEDULES: dict[str, Callable[[LoopContext], dict[str, float]]] = {
    "sync": train_sync, "one_step_off": train_async, "fully_async": train_async}
"""``schedule.name`` -> its loop: :func:`train_sync` above, or :func:`miles.core.schedules.train_async`."""
