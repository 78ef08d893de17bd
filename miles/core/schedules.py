"""Asynchronous schedules (``schedule=one_step_off`` / ``fully_async``): rollout overlaps training.

A :class:`GroupStream` keeps the engines busy on a thread of its own: its event loop keeps up to
``capacity = schedule.buffer_batches x algo.num_prompts_per_step`` groups in flight or finished and
waiting, drawing a new prompt as soon as the trainer takes a group. Each group is generated and
scored as in the synchronous rollout (same group ids and sampling seeds), and the sample filters
(DAPO) drop groups as they finish: a new prompt takes the place of a dropped one (after
``(rollout.max_oversample_rounds + 1) x algo.num_prompts_per_step`` drops in a row the run stops
with an error naming the last filter).

The trainer, on the driver's main thread, repeats:

1. take the next ``algo.num_prompts_per_step`` finished groups, in the order they finished; a group
   whose oldest token is more than ``schedule.max_staleness`` versions behind the trainer's weights
   is dropped (``stale`` in the ledger) and the next one taken;
2. advantages and one train step, as in the synchronous loop (:func:`miles.core.loop.learn`), with
   the decoupled PPO correction (:func:`miles.train.objective.mismatch_settings`);
3. every ``schedule.update_interval`` steps, push the weights to the engines without waiting for the
   generations in flight: their remaining tokens come from the new weights (partial rollout; each
   token carries its version, :attr:`miles.types.Sample.token_versions`).

``one_step_off`` is this with ``capacity`` one batch and a push after every step: the rollout of
step k+1 starts from the weights of step k-1 while step k trains and finishes on those of step k.
``fully_async`` lets the engines run ``buffer_batches`` batches ahead.

Staleness of a sample trained at step ``s`` (weights of version ``s - 1``): ``s - 1 - v`` where ``v``
is the oldest version behind its tokens. At the end the stream stops drawing, the generations in
flight finish, and every group not trained is settled ``unused`` (:mod:`miles.core.ledger`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from typing import Any

from miles.core.evaluate import evaluate
from miles.core.ledger import Ledger
from miles.core.loop import (
    LoopContext,
    engine_busy,
    engine_busy_metrics,
    learn,
    log_batch_sizes,
    sampling_params,
)
from miles.core.progress import Progress
from miles.types import Sample, SamplingParams
from miles.weights.sync import sync_weights

log = logging.getLogger(__name__)


def staleness(group: list[Sample], version: int) -> int:
    """How many versions the oldest token of ``group`` is behind ``version`` (0 with no tokens)."""
    return max((version - s.oldest_version for s in group if s.response_ids), default=0)


class GroupStream:
    """Groups generated continuously into a buffer on a thread of its own (module docstring)."""

    def __init__(self, ctx: LoopContext, *, rng: random.Random, sampling: SamplingParams, capacity: int,
                 ledger: Ledger) -> None:
        self.ctx, self.rng, self.sampling, self.capacity, self.ledger = ctx, rng, sampling, capacity, ledger
        self.n = ctx.run.algo.num_samples_per_prompt
        self.seed0 = ctx.run.seed * 1_000_003
        self.next_group_id = 0
        self.buffer: deque[list[Sample]] = deque()
        self.inflight = 0
        self.filtered_in_a_row = 0
        self.max_filtered_in_a_row = (ctx.run.rollout.max_oversample_rounds + 1) * ctx.run.algo.num_prompts_per_step
        self.error: BaseException | None = None
        self.cv = threading.Condition()
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._produce()), name="miles-group-stream",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.started.wait()

    def _poke(self) -> None:
        """Wake the producer loop (from any thread)."""
        if self.loop is not None and self.wake is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.wake.set)

    async def _produce(self) -> None:
        self.loop, self.wake = asyncio.get_running_loop(), asyncio.Event()
        run_group = self.ctx.rollout.group_runner()
        tasks: set[asyncio.Task] = set()
        self.started.set()
        while True:
            with self.cv:
                if self.stopping or self.error is not None:
                    break
                room = self.capacity - len(self.buffer) - self.inflight
                self.inflight += max(room, 0)
            for _ in range(room):
                problem = self.ctx.task.sample(1, self.rng)[0]
                group_id, self.next_group_id = self.next_group_id, self.next_group_id + 1
                self.ledger.draw([group_id])
                task = asyncio.ensure_future(self._one(run_group, problem, group_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await self.wake.wait()
            self.wake.clear()
        if tasks:  # the generations in flight finish (they are accounted for by close())
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, run_group: Any, problem: Any, group_id: int) -> None:
        try:
            group = await run_group(problem, self.n, self.sampling, group_id, self.seed0 + group_id)
            why = self.ctx.rollout.rejection(group)
        except BaseException as e:  # noqa: BLE001 - e.g. every engine died: the trainer raises it
            with self.cv:
                self.inflight -= 1
                self.error = self.error or e
                self.cv.notify_all()
            self.ledger.settle(group_id, "failed")
            self._poke()
            return
        with self.cv:
            self.inflight -= 1
            if why is None:
                self.filtered_in_a_row = 0
                self.buffer.append(group)
            else:
                for s in group:
                    s.filtered = f"{why[0]}: {why[1]}"
                self.ledger.settle(group_id, "filtered")
                self.filtered_in_a_row += 1
                if self.filtered_in_a_row > self.max_filtered_in_a_row:
                    self.error = RuntimeError(
                        f"the sample filters dropped the last {self.filtered_in_a_row} groups in a row (last: "
                        f"{why[0]}: {why[1]}); raise rollout.max_oversample_rounds or check the filters and task")
            self.cv.notify_all()
        self._poke()

    def take(self, k: int, version: int, max_staleness: int) -> tuple[list[list[Sample]], int, float]:
        """The next ``k`` groups at most ``max_staleness`` versions behind ``version`` (blocks until there).

        Returns ``(groups, number dropped as stale, seconds waited)``; older groups are settled ``stale``.
        """
        t0, groups, stale = time.perf_counter(), [], 0
        with self.cv:
            while len(groups) < k:
                while not self.buffer and self.error is None:
                    self.cv.wait()
                if self.error is not None:
                    raise RuntimeError(f"async rollout failed: {self.error}") from self.error
                group = self.buffer.popleft()
                if staleness(group, version) > max_staleness:
                    self.ledger.settle(group[0].group_id, "stale")
                    stale += 1
                else:
                    groups.append(group)
                self._poke()
        return groups, stale, time.perf_counter() - t0

    def close(self) -> int:
        """Stop drawing, let the generations in flight finish, settle what was never taken ``unused``."""
        with self.cv:
            self.stopping = True
        self._poke()
        self.thread.join()
        unused = list(self.buffer)
        self.buffer.clear()
        for group in unused:
            self.ledger.settle(group[0].group_id, "unused")
        return len(unused)


def train_async(ctx: LoopContext) -> dict[str, float]:
    """Run ``trainer.num_steps`` steps under ``schedule.name`` (one_step_off / fully_async)."""
    run, algo, sched, hooks = ctx.run, ctx.run.algo, ctx.run.schedule, ctx.hooks
    eval_set = ctx.task.eval_problems(run.task.num_eval_prompts)
    log_batch_sizes(run)
    log.info("schedule %s: up to %d group(s) ahead of the trainer, weights every %d step(s), groups more than %d "
             "version(s) old dropped", sched.name, sched.buffer_batches * algo.num_prompts_per_step,
             sched.update_interval, sched.max_staleness)
    hooks.on_run_start(0)
    metrics = evaluate(ctx, eval_set)
    hooks.after_eval(0, metrics)
    ctx.log_metrics(metrics | hooks.pop_metrics(), 0)
    stream = GroupStream(ctx, rng=random.Random(run.seed), sampling=sampling_params(run),
                         capacity=sched.buffer_batches * algo.num_prompts_per_step, ledger=ctx.ledger)
    stream.start()
    progress = Progress(run.trainer.num_steps)
    pushed, dropped_total, taken_total = 0, 0, 0
    try:
        for step in range(1, run.trainer.num_steps + 1):
            if hooks.stop_reason is not None:
                break
            t0, busy0 = time.perf_counter(), engine_busy(ctx.rollout.live_engines)
            version = step - 1  # the trainer's weights: the proximal policy of this update
            groups, stale, wait_s = stream.take(algo.num_prompts_per_step, version, sched.max_staleness)
            dropped_total, taken_total = dropped_total + stale, taken_total + stale + len(groups)
            metrics = ctx.rollout.metrics(groups) | _staleness_metrics(groups, version, stale)
            hooks.after_rollout(step, groups)
            t1 = time.perf_counter()
            metrics, samples = learn(ctx, step, groups, metrics)
            ctx.ledger.settle_batch(groups)
            t2 = time.perf_counter()
            last = step == run.trainer.num_steps or hooks.stop_reason is not None
            evaluating = last or (run.trainer.eval_every and step % run.trainer.eval_every == 0)
            if last:
                metrics["ledger/unused_at_end"] = float(stream.close())
            if step % sched.update_interval == 0 or evaluating:  # in-flight generations go on with them
                metrics |= sync_weights(ctx.trainers, ctx.rollout.live_engines, version=step, transport=ctx.transport)
                hooks.after_weight_sync(step, step)
                pushed = step
            t3 = time.perf_counter()
            if evaluating:
                evaluated = evaluate(ctx, eval_set)
                hooks.after_eval(step, evaluated)
                metrics |= evaluated
            metrics |= {
                "perf/step_time_s": t3 - t0, "perf/rollout_s": t1 - t0, "perf/train_s": t2 - t1,
                "perf/sync_s": t3 - t2, "perf/rollout_wait_s": wait_s,
                "train/stale_dropped_frac": dropped_total / max(taken_total, 1),
                "async/engine_version_lag": float(step - pushed),
            } | engine_busy_metrics(busy0, engine_busy(ctx.rollout.live_engines))
            metrics |= ctx.ledger.metrics() | hooks.pop_metrics()
            ctx.log_metrics(metrics, step)
            if ctx.log_distributions is not None:
                ctx.log_distributions({"train/reward": [s.reward for s in samples],
                                       "rollout/response_len": [float(len(s.response_ids)) for s in samples]}, step)
            progress.update(step, metrics)
    finally:
        if stream.thread.is_alive():
            stream.close()
        progress.close()
    ctx.ledger.check_closed()
    return metrics | ctx.ledger.metrics()


def _staleness_metrics(groups: list[list[Sample]], version: int, stale: int) -> dict[str, float]:
    """``train/staleness_mean|max`` over the samples with tokens (versions behind ``version``), the
    share of samples with tokens of more than one version (partial rollouts), and the stale drops."""
    ages = [version - s.oldest_version for g in groups for s in g if s.response_ids]
    mixed = [len(set(s.token_versions)) > 1 for g in groups for s in g if s.response_ids]
    return {
        "train/staleness_mean": sum(ages) / max(len(ages), 1),
        "train/staleness_max": float(max(ages, default=0)),
        "train/partial_rollout_frac": sum(mixed) / max(len(mixed), 1),
        "train/stale_dropped_groups": float(stale),
    }
