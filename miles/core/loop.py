"""The RL post-training loop: rollout -> reward -> advantages -> train -> sync -> log.

One step, synchronously:

1. **Rollout.** Draw prompts from the task; every engine samples
   ``num_samples_per_prompt`` responses per prompt with the current weights and
   returns token ids plus the log-prob of each sampled token.
2. **Reward.** The task's rule scores each decoded response.
3. **Advantages.** Each response is compared with the others for the same
   prompt (GRPO: reward minus group mean, over group std).
4. **Train.** Trainer ranks recompute log-probs on the same tokens and take a
   policy-gradient step (PPO-clip; optional KL, entropy, TIS).
5. **Sync.** The new weights reach every engine as version ``step``; the next
   rollout samples from them.
6. **Log.** Reward, losses, mismatch, timings and weight-sync cost go to the
   tracker; evaluation on held-out prompts runs at step 0, every
   ``trainer.eval_every`` steps, and at the end.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from miles.config.schema import MilesConfig
from miles.core.progress import Progress
from miles.core.types import Problem, SamplingParams, TrainBatch
from miles.rollout.manager import RolloutManager
from miles.weights.object_store import sync_weights

log = logging.getLogger(__name__)


@dataclass
class LoopContext:
    """What the loop needs, built once by :func:`miles.core.run.run_job`."""

    run: MilesConfig
    task: Any
    rollout: RolloutManager
    trainers: Sequence[Any]
    engines: Sequence[Any]
    advantage_fn: Callable[[torch.Tensor], torch.Tensor]
    log_metrics: Callable[[dict[str, float], int], None]


def train(ctx: LoopContext) -> dict[str, float]:
    """Run ``trainer.num_steps`` RL steps; returns the last step's metrics (including final eval)."""
    run, algo = ctx.run, ctx.run.algo
    rng = random.Random(run.seed)
    eval_set = ctx.task.eval_problems(run.task.num_eval_prompts)
    sampling = SamplingParams(
        temperature=run.rollout.temperature, top_p=run.rollout.top_p, top_k=run.rollout.top_k,
        max_new_tokens=run.rollout.max_new_tokens,
    )
    log_batch_sizes(run)

    metrics = evaluate(ctx, eval_set)
    ctx.log_metrics(metrics, 0)
    log.info("step 0: eval/accuracy %.3f (greedy %.3f)", metrics["eval/accuracy"], metrics["eval/greedy_accuracy"])
    progress = Progress(run.trainer.num_steps)
    for step in range(1, run.trainer.num_steps + 1):
        t0 = time.perf_counter()

        # 1-2. rollout and reward: n responses per prompt from the current weights, scored by the task
        problems = ctx.task.sample(algo.num_prompts_per_step, rng)
        groups, metrics = ctx.rollout.rollout(
            problems, algo.num_samples_per_prompt, sampling,
            seed=run.seed * 1_000_003 + step * algo.num_prompts_per_step,
            first_group_id=(step - 1) * algo.num_prompts_per_step,
        )
        t1 = time.perf_counter()

        # 3. advantages: how much better each response is than its siblings
        rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
        for group, advs in zip(groups, ctx.advantage_fn(rewards).tolist(), strict=True):
            for sample, adv in zip(group, advs, strict=True):
                sample.advantage = adv
        metrics |= reward_metrics(rewards)

        # 4. train: every rank gets the batch (once, through the object store) and takes its shard
        batch = ray.put(TrainBatch.from_samples([s for g in groups for s in g]))
        metrics |= ray.get([t.train_step.remote(batch) for t in ctx.trainers])[0]
        t2 = time.perf_counter()

        # 5. sync: the engines sample from the new weights from now on
        metrics |= sync_weights(ctx.trainers, ctx.engines, version=step)
        t3 = time.perf_counter()

        # 6. evaluate and log
        if step == run.trainer.num_steps or (run.trainer.eval_every and step % run.trainer.eval_every == 0):
            metrics |= evaluate(ctx, eval_set)
        metrics |= {
            "perf/step_time_s": t3 - t0, "perf/rollout_s": t1 - t0,
            "perf/train_s": t2 - t1, "perf/sync_s": t3 - t2,
        }
        ctx.log_metrics(metrics, step)
        progress.update(step, metrics)
    progress.close()
    return metrics


def evaluate(ctx: LoopContext, problems: Sequence[Problem]) -> dict[str, float]:
    """Held-out prompts, scored by the task reward.

    ``eval/accuracy`` is pass@1 estimated from ``rollout.eval_samples_per_prompt`` samples per prompt at
    ``rollout.eval_temperature`` (the mean reward; greedy with one sample when the temperature is 0);
    ``eval/greedy_accuracy`` is greedy decoding, logged alongside.
    """
    r = ctx.run.rollout
    greedy = SamplingParams(greedy=True, max_new_tokens=r.max_new_tokens)
    out = {}
    if r.eval_temperature > 0:
        sampling = SamplingParams(temperature=r.eval_temperature, max_new_tokens=r.max_new_tokens)
        groups, m = ctx.rollout.rollout(problems, r.eval_samples_per_prompt, sampling, seed=ctx.run.seed)
        out["eval/accuracy"] = sum(s.reward for g in groups for s in g) / sum(len(g) for g in groups)
        out[f"eval/pass_at_{r.eval_samples_per_prompt}"] = sum(max(s.reward for s in g) > 0 for g in groups) / len(groups)
        out["eval/response_len_mean"] = m["rollout/response_len_mean"]
    groups, m = ctx.rollout.rollout(problems, 1, greedy, seed=ctx.run.seed)
    out["eval/greedy_accuracy"] = sum(g[0].reward for g in groups) / len(groups)
    out.setdefault("eval/accuracy", out["eval/greedy_accuracy"])
    out.setdefault("eval/response_len_mean", m["rollout/response_len_mean"])
    return out


def reward_metrics(rewards: torch.Tensor) -> dict[str, float]:
    """rewards: [G, n] -> mean, std, and the share of groups whose rewards are all equal (no signal)."""
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std": rewards.std(unbiased=False).item(),
        "train/zero_std_group_frac": (rewards.std(dim=1, unbiased=False) == 0).float().mean().item(),
    }


def log_batch_sizes(run: MilesConfig) -> None:
    """Print the derived batch sizes once, in the units they are configured in."""
    a, ws = run.algo, run.placement.trainer_world_size
    samples = a.num_prompts_per_step * a.num_samples_per_prompt
    log.info(
        "batch: %d prompts x %d samples = %d samples per step = %d optimizer step(s) x %d samples "
        "(%d per rank at world size %d)",
        a.num_prompts_per_step, a.num_samples_per_prompt, samples, a.num_minibatches,
        samples // a.num_minibatches, samples // a.num_minibatches // ws, ws,
    )
