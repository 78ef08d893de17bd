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
2. advantages and one train step, as in the synchronous loop (:func:`miles.core.step.learn`), with
   the decoupled PPO correction (:func:`miles.train.objective.mismatch_settings`);
3. every ``schedule.update_interval`` steps, push the weights to the engines without waiting for the
   generations in flight: their remaining tokens come from the new weights (partial rollout; each
   token carries its version, :attr:`miles.types.Sample.token_versions`). The torch engine swaps
   the weights between two decode steps and its rows go on with their K/V cache
   (:mod:`miles.rollout.torch_engine`); the SGLang engine aborts the rows in flight on its server,
   loads the weights, and continues each row as a new request on the new weights (prompt + the
   tokens so far, the tokens left, the same sampling; its K/V recomputed), joining the pieces into
   one result (:mod:`miles.rollout.sglang_calls`). Either way each token keeps the log-prob it was
   sampled with, and an engine must report each token's version (``reports_token_versions``; an
   engine class without it is refused before Ray starts).

``one_step_off`` is this with ``capacity`` one batch and a push after every step: the rollout of
step k+1 starts from the weights of step k-1 while step k trains and finishes on those of step k.
``fully_async`` lets the engines run ``buffer_batches`` batches ahead.

Staleness of a sample trained at step ``s`` (weights of version ``s - 1``): ``s - 1 - v`` where ``v``
is the oldest version behind its tokens. At the end the stream stops drawing, the generations in
flight finish, and every group not trained is settled ``unused`` (:mod:`miles.core.ledger`).

Engine failures: the rollout manager retries the requests of an engine that died on the others and
takes it out of rotation; the next weight push replaces it (:mod:`miles.core.recovery`). When no engine
is left, the stream stops and keeps its groups: the step that finds it so (:class:`EngineOutage`)
replaces the engines at once (a weight push of the trainer's weights, waiting up to
``rollout.max_outage_s``) and runs again on a :meth:`GroupStream.successor`, which keeps the finished
groups and generates the ones the outage ended again, under their ids and seeds. When no engine comes
back (``rollout.max_engine_restarts`` spent, or none up in time), the groups the outage ended are
settled ``failed``, those waiting or taken for the failing step ``unused``, and the run raises with the
ledger's accounting in the error's notes.

Trainer failures: when a step fails because a trainer or critic rank died or hung
(:mod:`miles.core.recovery`), the stream stops drawing and its generations in flight finish; with
``trainer.max_failures`` left, the ranks are restarted and restored from the run's last checkpoint with
its ledger (:func:`miles.core.step.recover_trainers`), and a new stream starts from the checkpoint's
sampler state: the prompts open at the checkpoint are generated again under their ids, then new ones.
What the old stream generated after the checkpoint is discarded with its ledger, so no prompt is lost or
trained twice. Without a restart left, the run raises as for an engine failure.

Run checkpoints (``trainer.save_every``) hold the ledger and the prompts still open (in flight or
waiting for the trainer) as their group ids plus the sampler's RNG state when the oldest of them was
drawn: every group draws one prompt with ``task.sample(1, rng)`` in id order, so replaying the draws
from that state gives the open prompts back (and must end at the checkpoint's sampler state). A
resumed run generates them again, under their ids and seeds, before drawing new ones.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from miles.config.checkpoints import LoopState
from miles.core.evaluate import evaluate
from miles.core.ledger import OUTCOMES, Ledger
from miles.core.progress import Progress
from miles.core.step import (
    LoopContext,
    begin_profile,
    end_profile,
    engine_busy,
    engine_busy_metrics,
    learn,
    log_batch_sizes,
    push_weights,
    recover_trainers,
    resume_checkpoint,
    sampling_params,
    save_checkpoint,
)
from miles.rollout.dispatch import AllEnginesDeadError
from miles.types import Sample, SamplingParams

log = logging.getLogger(__name__)


def staleness(group: list[Sample], version: int) -> int:
    """How many versions the oldest token of ``group`` is behind ``version`` (0 with no tokens)."""
    return max((version - s.oldest_version for s in group if s.response_ids), default=0)


class GroupStream:
    """Groups generated continuously into a buffer on a thread of its own (module docstring).

    ``reopened``: ``(group_id, problem, rng_state)`` of groups drawn before a resume and still open
    there; they are generated first, without being drawn again.
    """

    def __init__(self, ctx: LoopContext, *, rng: random.Random, sampling: SamplingParams, capacity: int,
                 ledger: Ledger, next_group_id: int = 0, reopened: Sequence[tuple[int, Any, tuple]] = ()) -> None:
        self.ctx, self.rng, self.sampling, self.capacity, self.ledger = ctx, rng, sampling, capacity, ledger
        self.n = ctx.run.algo.num_samples_per_prompt
        self.seed0 = ctx.run.seed * 1_000_003
        self.next_group_id = next_group_id
        self.reopened = deque(reopened)
        self.drawn_at: dict[int, tuple] = {g: st for g, _, st in reopened}  # open group -> sampler state before it
        self.buffer: deque[list[Sample]] = deque()
        self.inflight = 0
        self.filtered_in_a_row = 0
        self.max_filtered_in_a_row = (ctx.run.rollout.max_oversample_rounds + 1) * ctx.run.algo.num_prompts_per_step
        self.error: BaseException | None = None
        self.lost: list[tuple[int, Any]] = []  # (group id, problem) whose generation every engine's death ended
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

    def _draw(self) -> tuple[int, Any]:
        """The next group to generate (under ``cv``): a reopened one, else a new prompt."""
        if self.reopened:
            group_id, problem, _ = self.reopened.popleft()
            return group_id, problem
        state = self.rng.getstate()
        problem = self.ctx.task.sample(1, self.rng)[0]
        group_id, self.next_group_id = self.next_group_id, self.next_group_id + 1
        self.ledger.draw([group_id])
        self.drawn_at[group_id] = state
        return group_id, problem

    def _settle(self, group_id: int, outcome: str) -> None:
        """Settle a group (under ``cv``)."""
        self.drawn_at.pop(group_id, None)
        self.ledger.settle(group_id, outcome)

    async def _produce(self) -> None:
        self.loop, self.wake = asyncio.get_running_loop(), asyncio.Event()
        run_group = self.ctx.rollout.group_runner()
        tasks: set[asyncio.Task] = set()
        self.started.set()
        while True:
            with self.cv:
                if self.stopping or self.error is not None:
                    break
                room = max(self.capacity - len(self.buffer) - self.inflight, 0)
                self.inflight += room
                todo = [self._draw() for _ in range(room)]
            for group_id, problem in todo:
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
                if isinstance(e, AllEnginesDeadError):  # open until the engines are back (successor) or failed
                    self.lost.append((group_id, problem))
                else:
                    self._settle(group_id, "failed")
                self.cv.notify_all()
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
                self._settle(group_id, "filtered")
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
        The caller settles the groups returned; on an error the ones already picked go back to the buffer.
        """
        t0, groups, stale = time.perf_counter(), [], 0
        with self.cv:
            while len(groups) < k:
                while not self.buffer and self.error is None:
                    self.cv.wait()
                if self.error is not None:
                    self.buffer.extendleft(reversed(groups))
                    kind = EngineOutage if isinstance(self.error, AllEnginesDeadError) else RuntimeError
                    raise kind(f"async rollout failed: {self.error}") from self.error
                group = self.buffer.popleft()
                if staleness(group, version) > max_staleness:
                    self._settle(group[0].group_id, "stale")
                    stale += 1
                else:
                    groups.append(group)
                self._poke()
            for group in groups:
                self.drawn_at.pop(group[0].group_id)
        return groups, stale, time.perf_counter() - t0

    def checkpoint(self) -> tuple[tuple, int, dict[str, list[int]], dict[str, Any] | None]:
        """``(sampler state, next group id, ledger state, open prompts)`` at one instant, for a run
        checkpoint (module docstring); open prompts None when there are none."""
        with self.cv:
            open_ids = sorted(self.drawn_at)
            ledger = self.ledger.state()
            assert open_ids == ledger["open"], (open_ids, ledger["open"])  # every open group is in the stream
            stream = ({"open": open_ids, "first_open": open_ids[0], "rng_state": self.drawn_at[open_ids[0]]}
                      if open_ids else None)
            return self.rng.getstate(), self.next_group_id, ledger, stream

    def close(self, settle: bool = True) -> int:
        """Stop drawing, let the generations in flight finish, settle what was never taken ``unused`` (and
        the groups an engine outage ended ``failed``). ``settle`` False: leave them open for
        :meth:`successor`."""
        with self.cv:
            self.stopping = True
        self._poke()
        self.thread.join()
        if not settle:
            return 0
        with self.cv:
            unused = [group[0].group_id for group in self.buffer] + [g for g, _, _ in self.reopened]
            self.buffer.clear()
            self.reopened.clear()
            for group_id in unused:
                self._settle(group_id, "unused")
            for group_id, _ in self.lost:
                self._settle(group_id, "failed")
            self.lost.clear()
        return len(unused)

    def successor(self) -> GroupStream:
        """After an engine outage (:class:`EngineOutage`) and :meth:`close` without settling: a stream (not
        started) that goes on where this one stopped, with its finished groups, the groups the outage
        ended generated again first (under their ids and seeds), and the same sampler and ledger."""
        new = GroupStream(self.ctx, rng=self.rng, sampling=self.sampling, capacity=self.capacity, ledger=self.ledger,
                          next_group_id=self.next_group_id)
        with self.cv:
            again = sorted([(g, p, self.drawn_at[g]) for g, p in self.lost] + list(self.reopened), key=lambda t: t[0])
            new.reopened, new.drawn_at, new.buffer = deque(again), dict(self.drawn_at), deque(self.buffer)
            new.filtered_in_a_row = self.filtered_in_a_row
            self.lost, self.buffer, self.reopened = [], deque(), deque()
        return new


class EngineOutage(RuntimeError):
    """:meth:`GroupStream.take` found that every rollout engine died (:class:`AllEnginesDeadError`)."""


def reopen(task: Any, state: LoopState) -> list[tuple[int, Any, tuple]]:
    """The prompts open at the checkpoint ``state`` as ``(group_id, problem, sampler state before it)``,
    by replaying the sampler's draws from the oldest (module docstring)."""
    if state.stream is None:
        return []
    open_ids, rng = set(state.stream["open"]), random.Random()
    rng.setstate(state.stream["rng_state"])
    out = []
    for group_id in range(state.stream["first_open"], state.next_group_id):
        before = rng.getstate()
        problem = task.sample(1, rng)[0]
        if group_id in open_ids:
            out.append((group_id, problem, before))
    if rng.getstate() != state.rng_state or len(out) != len(open_ids):
        raise RuntimeError(f"{state.path}: replaying the prompt draws of groups {state.stream['first_open']}.."
                           f"{state.next_group_id - 1} did not end at the checkpoint's sampler state; the task's "
                           "sample() must depend on the RNG alone (and the task config must be the one that wrote "
                           "the checkpoint)")
    return out


def train_async(ctx: LoopContext) -> dict[str, float]:
    """Run ``trainer.num_steps`` steps under ``schedule.name`` (one_step_off / fully_async)."""
    run, algo, sched, hooks = ctx.run, ctx.run.algo, ctx.run.schedule, ctx.hooks
    eval_set = ctx.task.eval_problems(run.task.num_eval_prompts)
    log_batch_sizes(run)
    log.info("schedule %s: up to %d group(s) ahead of the trainer, weights every %d step(s), groups more than %d "
             "version(s) old dropped", sched.name, sched.buffer_batches * algo.num_prompts_per_step,
             sched.update_interval, sched.max_staleness)
    rng, first, next_group_id, reopened = random.Random(run.seed), 1, 0, []
    if run.trainer.resume_from is not None:
        state = resume_checkpoint(ctx)
        first, next_group_id = state.step + 1, state.next_group_id
        rng.setstate(state.rng_state)
        reopened = reopen(ctx.task, state)
        log.info("%d prompt(s) open at the checkpoint are generated again", len(reopened))
    hooks.on_run_start(first - 1)
    if run.trainer.resume_from is None:
        metrics = evaluate(ctx, eval_set)
        hooks.after_eval(0, metrics)
        ctx.log_metrics(metrics | hooks.pop_metrics(), 0)
    progress = Progress(run.trainer.num_steps, first=first)
    pushed, dropped_total, taken_total, metrics = first - 1, 0, 0, {}
    step, carry = first, None
    try:
        # once; again from the last checkpoint after a dead trainer rank (recover_trainers); again from the
        # failed step, with the stream's groups, after the engines died and were replaced (_restore_engines)
        while True:
            stream = carry.successor() if carry is not None else GroupStream(
                ctx, rng=rng, sampling=sampling_params(run), capacity=sched.buffer_batches * algo.num_prompts_per_step,
                ledger=ctx.ledger, next_group_id=next_group_id, reopened=reopened)
            carry = None
            stream.start()
            taken: list[list[Sample]] = []  # the step's groups until the ledger has them
            try:
                for step in range(first, run.trainer.num_steps + 1):
                    if hooks.stop_reason is not None:
                        break
                    begin_profile(ctx, step)
                    t0, busy0 = time.perf_counter(), engine_busy(ctx.rollout.live_engines)
                    version = step - 1  # the trainer's weights: the proximal policy of this update
                    taken, stale, wait_s = stream.take(algo.num_prompts_per_step, version, sched.max_staleness)
                    groups = taken
                    dropped_total, taken_total = dropped_total + stale, taken_total + stale + len(groups)
                    metrics = ctx.rollout.metrics(groups) | _staleness_metrics(groups, version, stale)
                    hooks.after_rollout(step, groups)
                    t1 = time.perf_counter()
                    metrics, samples = learn(ctx, step, groups, metrics)
                    ctx.ledger.settle_batch(groups)
                    taken = []
                    t2 = time.perf_counter()
                    last = step == run.trainer.num_steps or hooks.stop_reason is not None
                    evaluating = last or (run.trainer.eval_every and step % run.trainer.eval_every == 0)
                    if last:
                        metrics["ledger/unused_at_end"] = float(stream.close())
                    if step % sched.update_interval == 0 or evaluating:  # in-flight generations go on with them
                        metrics |= push_weights(ctx, step)
                        hooks.after_weight_sync(step, step)
                        pushed = step
                    t3, busy3 = time.perf_counter(), engine_busy(ctx.rollout.live_engines)
                    end_profile(ctx, step)
                    if evaluating:
                        evaluated = evaluate(ctx, eval_set)
                        hooks.after_eval(step, evaluated)
                        metrics |= evaluated
                    metrics |= {
                        "perf/step_time_s": t3 - t0, "perf/rollout_s": t1 - t0, "perf/train_s": t2 - t1,
                        "perf/sync_s": t3 - t2, "perf/rollout_wait_s": wait_s,
                        "train/stale_dropped_frac": dropped_total / max(taken_total, 1),
                        "async/engine_version_lag": float(step - pushed),
                    } | engine_busy_metrics(busy0, busy3)
                    metrics |= ctx.ledger.metrics() | hooks.pop_metrics()
                    if ctx.trainer_recovery is not None:
                        metrics |= ctx.trainer_recovery.metrics()
                    ctx.log_metrics(metrics, step)
                    if ctx.log_distributions is not None:
                        ctx.log_distributions({"train/reward": [s.reward for s in samples],
                                               "rollout/response_len": [float(len(s.response_ids)) for s in samples]},
                                              step)
                    progress.update(step, metrics)
                    if run.trainer.save_every and (step % run.trainer.save_every == 0 or last):
                        save_checkpoint(ctx, step, *stream.checkpoint())
                break
            except Exception as e:
                if isinstance(e, EngineOutage) and ctx.recovery is not None:
                    _restore_engines(ctx, stream, step)  # raises (accounted for) when none comes back
                    carry, first, pushed = stream, step, step - 1
                    continue
                state = _recover(ctx, stream, taken, step, e)  # raises e (accounted for) unless a rank died
                first, next_group_id, pushed = state.step + 1, state.next_group_id, state.step
                rng.setstate(state.rng_state)
                reopened = reopen(ctx.task, state)
                log.warning("%d prompt(s) open at the checkpoint are generated again", len(reopened))
            finally:
                if stream.thread.is_alive():
                    stream.close()
    finally:
        progress.close()
    ctx.ledger.check_closed()
    return metrics | ctx.ledger.metrics()


def _recover(ctx: LoopContext, stream: GroupStream, taken: list[list[Sample]], step: int,
             error: Exception) -> LoopState:
    """After ``step`` failed with ``error``: stop the stream (the generations in flight finish) and, when a
    trainer rank died and can be recovered, restore the run's last checkpoint
    (:func:`~miles.core.step.recover_trainers`, which starts a fresh ledger from it: what the stream held
    since is drawn again, under the same ids) and return its loop state. Otherwise settle what the run
    holds and raise, with the ledger's accounting in the error's notes."""
    stream.close()
    try:
        return recover_trainers(ctx, step, error)
    except Exception as final:
        _account_for_failure(ctx, stream, taken, step, final)
        raise


def _restore_engines(ctx: LoopContext, stream: GroupStream, step: int) -> None:
    """Every engine died before ``step`` could take its batch: stop ``stream`` without settling its groups,
    replace the engines (:func:`~miles.core.step.push_weights`, which waits up to ``rollout.max_outage_s``)
    and give them the trainers' weights (version ``step - 1``); the caller goes on with
    :meth:`GroupStream.successor`. When none comes back, settle what the run holds and raise."""
    stream.close(settle=False)
    log.warning("step %d: every rollout engine died while generating; the rollout goes on once they are replaced "
                "(%d group(s) they were generating are generated again, %d finished ones kept)", step,
                len(stream.lost), len(stream.buffer))
    try:
        push_weights(ctx, step - 1)
    except Exception as final:
        stream.close()  # the groups it holds: unused, and those the outage ended failed
        _account_for_failure(ctx, stream, [], step, final)
        raise


def _account_for_failure(ctx: LoopContext, stream: GroupStream, taken: list[list[Sample]], step: int,
                         error: Exception) -> None:
    """Settle what the failing run holds (the stream's groups, the step's ``taken`` ones ``unused``) and
    add the ledger's accounting to ``error``'s notes."""
    try:
        if stream.thread.is_alive():
            stream.close()
        for group in taken:
            ctx.ledger.settle(group[0].group_id, "unused")
        c = ctx.ledger.counts()
        note = (f"sample ledger at the failure (step {step}): {c['drawn']} prompt(s) drawn = "
                + " + ".join(f"{c[o]} {o}" for o in OUTCOMES) + f", {c['open']} not accounted for")
    except Exception as inner:  # noqa: BLE001 - the run's own error is the one to raise
        note = f"sample ledger: could not account for the prompts at the failure ({inner!r})"
    log.error("%s", note)
    error.add_note(note)


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
