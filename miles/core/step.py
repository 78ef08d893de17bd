"""The parts of a training step that the synchronous loop and the async schedules share.

:class:`LoopContext` (what a loop runs on), :func:`learn` (advantages and the train step on a batch of
scored groups), run checkpoints (:func:`save_checkpoint`, :func:`resume_checkpoint`), the engines'
busy time, the sampling of training rollouts and the batch sizes logged at start. The synchronous loop
is :mod:`miles.core.loop`, the asynchronous schedules :mod:`miles.core.schedules`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray
import torch

from miles.algos.distill import opd_token_advantages
from miles.algos.gae import gae_from_lists
from miles.config import checkpoints
from miles.config.schema import MilesConfig
from miles.core import resume
from miles.core.actors import probe
from miles.core.groups import assign_advantages, shape_overlong, why_untrainable
from miles.core.ledger import Ledger
from miles.core.profiling import StepProfiler, step_actors
from miles.core.progress import Progress
from miles.core.recovery import (
    EngineRecovery,
    TrainerRankDiedError,
    TrainerRankHungError,
    TrainerRecovery,
    get_ranks,
)
from miles.core.timeline import StepTimeline
from miles.hooks.chain import HookChain
from miles.rollout.dispatch import AllEnginesDeadError
from miles.rollout.manager import RolloutManager
from miles.rollout.teacher import TeacherPool
from miles.tracking.memory import actor_metrics, process_memory, rank_memory
from miles.tracking.timeline import span
from miles.train.draft import draft_sequences
from miles.types import SamplingParams, Status, TrainBatch
from miles.weights.sync import Transport, sync_weights

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
    critics: Sequence[Any] = ()
    """Critic ranks (:class:`miles.train.critic.FSDPCritic`) when ``algo.estimator`` is ``gae``."""
    transport: Transport | None = None
    """Weight-sync transport (``weight_sync.transport``); None: the Ray object store."""
    start_offload: Callable[[Sequence[Any]], list[Any]] = lambda engines: []
    """colocate: engines start releasing memory for the train step (:meth:`miles.core.actors.Actors.start_offload`);
    the weight sync after it brings them back."""
    log_distributions: Callable[[dict[str, list[float]], int], None] | None = None
    """Per-sample values of a step (rewards, response lengths): the tracker logs their quantiles."""
    save_dir: str | None = None
    """Where run checkpoints go when ``trainer.save_every`` is set (:mod:`miles.core.resume`)."""
    hooks: HookChain = field(default_factory=HookChain)
    """The ``hooks:`` chain (:mod:`miles.hooks`), called at the points of the loop; empty: none."""
    ledger: Ledger = field(default_factory=Ledger)
    """Outcome of every prompt drawn for training (:mod:`miles.core.ledger`)."""
    recovery: EngineRecovery | None = None
    """Replaces engines that died or hung at each weight push (:mod:`miles.core.recovery`); None: a dead
    engine leaves the rotation for good."""
    fingerprint: dict[str, Any] | None = None
    """The model's shape and tokenizer, recorded in run checkpoints (:func:`miles.core.resume.fingerprint`)."""
    nonfinite_steps: list[int] = field(default_factory=list)
    """The steps, in a row up to the last one, whose train step skipped an update as not finite (:func:`count_nonfinite`)."""
    trainer_recovery: TrainerRecovery | None = None
    """Restarts the trainer (and critic) ranks when one dies and restores them from :attr:`last_checkpoint`
    (:func:`recover_trainers`); None: a dead rank ends the run."""
    last_checkpoint: str | None = None
    """The run checkpoint written last in this run, or the one it resumed from; None: none yet."""
    profiler: StepProfiler | None = None
    """``profile.steps``: records torch profiler traces of chosen steps (:mod:`miles.core.profiling`)."""
    timeline: StepTimeline | None = None
    """Records the steps of ``tracking.timeline_steps`` (:mod:`miles.core.timeline`); None: none."""
    teacher: TeacherPool | None = None
    """On-policy distillation's teacher engines (``teacher.model``): they score every step's samples
    before its train step (:func:`learn`); None: no teacher."""
    draft: Any | None = None
    """``draft.online``: the draft's trainer (:class:`miles.train.draft.DraftTrainer`); it trains on every
    step's samples during the train step (:func:`learn`; with ``draft.wait`` false, on those of the steps it is
    free at) and its weights go to the engines after the policy's (:func:`push_weights`); None: the draft stays
    as loaded."""
    draft_training: Any | None = None
    """The object ref of the draft's training call on the last batch it took, until :func:`push_draft` takes it
    (with ``draft.wait`` false it can stay in flight over several steps)."""
    draft_batch_step: int = 0
    """The step whose samples the draft's training in flight (:attr:`draft_training`) learns."""
    draft_trained_step: int = 0
    """The step whose samples the engines' draft learnt last (0: none, the draft as loaded or resumed)."""
    draft_state: Any | None = None
    """The object ref of the draft weights the engines were given last (:func:`push_draft`): what a new draft
    trainer starts from when the last one died."""
    restart_draft: Callable[[], Any] | None = None
    """Kills the draft trainer and starts a new one on its slot, from the draft's checkpoint
    (:func:`miles.core.actors.replace_draft_trainer`); returns it once it answers. None: a draft trainer that
    dies or hangs is not replaced (the draft stays as the engines have it)."""
    draft_restarts: int = 0
    """Draft trainers replaced so far in this run (``draft/restarts``)."""
    engine_readings: dict[int, EngineReading] | None = None
    """The engines' health read last in a step (:func:`push_weights`' check with ``ctx.recovery``,
    else :func:`engine_busy` at the step's end), kept as the next step's first reading when nothing ran
    on the engines in between (no eval); None: the next step reads anew."""
    offload_answers: dict[int, Any] | None = None
    """What each engine answered to this step's memory offload (engine index -> answer), until
    :func:`push_weights` takes it: an engine that answered with its ``health()`` right after releasing is
    not asked again before the push."""


def begin_profile(ctx: LoopContext, step: int) -> None:
    """At the start of ``step``: start the profiles of the actors it runs on, if ``profile.steps`` has it."""
    if ctx.profiler is not None:
        pool = ctx.rollout.pool
        ctx.profiler.begin(step, step_actors(ctx.trainers, ctx.critics, {e: pool.engines[e] for e in pool.alive}))


def end_profile(ctx: LoopContext, step: int) -> None:
    """After ``step``'s weight sync: stop the profiles :func:`begin_profile` started and save them."""
    if ctx.profiler is not None:
        ctx.profiler.end(step)


def learn(ctx: LoopContext, step: int, groups: list[list[Any]], metrics: dict[str, float]
          ) -> tuple[dict[str, float], list[Any]]:
    """Steps 3-4 on a batch of scored groups: advantages, then one train step (and the critic's).

    Returns the metrics with the reward and train metrics added, and the batch's samples in order.
    """
    run, algo, hooks = ctx.run, ctx.run.algo, ctx.hooks
    hang_s = run.trainer.hang_timeout_s  # a rank that stops answering is killed (miles.core.recovery.get_ranks)
    # 3. advantages: how much better each response is than its siblings (failed ones sit out),
    # or, with a critic (PPO), than the critic expected at each token (GAE)
    if algo.overlong_buffer_len > 0 and algo.overlong_penalty_factor > 0:
        metrics |= shape_overlong(groups, run)
    hooks.after_reward(step, groups)  # the rewards are final: advantages come from them
    gae = algo.estimator == "gae"
    with span("advantages"):
        metrics |= assign_advantages(groups, torch.zeros_like if gae else ctx.advantage_fn)
    samples = [s for g in groups for s in g]
    if len(samples) % (algo.num_minibatches * run.placement.trainer_world_size):
        raise RuntimeError(
            f"step {step}: the rollout returned {len(samples)} samples, which do not split into "
            f"algo.num_minibatches ({algo.num_minibatches}) x placement.trainer_world_size "
            f"({run.placement.trainer_world_size}); a generate_fn must return ctx.n samples per prompt")
    with span("batch"):
        batch = TrainBatch.from_samples(samples)
    if ctx.teacher is not None:  # on-policy distillation: every token's advantage gets the teacher's signal
        with span("teacher"):
            metrics |= ctx.teacher.score(samples)
        batch.token_advantages, opd = opd_token_advantages(
            batch.advantages, batch.rollout_logprobs, [s.metadata.get("teacher_logprobs") for s in samples],
            batch.loss_mask, distill_coef=algo.distill_coef, task_reward_weight=algo.task_reward_weight)
        metrics |= opd
    if gae:
        values = get_ranks([c.compute_values.remote(batch) for c in ctx.critics], ctx.critics, "critic", hang_s)[0]
        batch.token_advantages, returns = gae_from_lists(
            [s.reward for s in samples], values, batch.loss_mask,
            gamma=algo.gamma, lam=algo.lam, whiten_advantages=algo.whiten_advantages,
        )
    hooks.before_train(step, batch)
    # the draft learns the policy's latest tokens while the policy trains; with draft.wait false a draft trainer
    # still busy skips this batch (with the wait, a batch without a push since the last, fully_async's
    # update_interval, queues behind it)
    if ctx.draft is not None and (ctx.run.draft.wait or ctx.draft_training is None):
        ctx.draft_training = ctx.draft.train.remote(draft_sequences(samples))
        ctx.draft_batch_step = step

    # 4. train: every rank gets the batch and takes its shard;
    # then the critic ranks regress their values on the GAE returns (they share the trainer ranks'
    # CPUs, so one after the other)
    live = list(ctx.rollout.pool.alive)
    ctx.offload_answers = None
    offloading = ctx.start_offload([ctx.rollout.pool.engines[e] for e in live])  # during the train step
    offloading = dict(zip(live, offloading, strict=True)) if offloading else {}
    try:
        if metrics["train/trainable_samples"] > 0:
            with span("train_step"):
                # one rank: the batch goes with its call (Ray stores a large one itself), saving a round
                # trip through the object store; several ranks (or critics): stored once, read by each
                if len(ctx.trainers) + len(ctx.critics) > 1:
                    batch = ray.put(batch)
                ranks = get_ranks([t.train_step.remote(batch) for t in ctx.trainers], ctx.trainers, "trainer", hang_s)
            metrics |= ranks[0] | rank_memory(ranks)  # the same metrics on every rank, but each rank's own memory
            if gae:
                metrics |= get_ranks([c.train_step.remote(batch, returns, values) for c in ctx.critics],
                                     ctx.critics, "critic", hang_s)[0]
        elif all(s.status is Status.FAILED for s in samples):
            raise RuntimeError(f"step {step}: every sample failed ({why_untrainable(samples)}); see the log above")
        else:  # nothing to learn from (e.g. every group filtered out): keep the weights
            log.warning("step %d: no trainable sample (%s); skipping the update", step, why_untrainable(samples))
    finally:  # also when a trainer rank died: its recovery pushes weights to engines done releasing memory
        with span("offload_wait"):  # a dead or hung engine leaves the rotation
            ctx.offload_answers = ctx.rollout.settle_calls(offloading, what="memory offload")
    count_nonfinite(ctx.nonfinite_steps, step, metrics, ctx.run.trainer.max_nonfinite_steps)
    hooks.after_train(step, metrics)
    return metrics, samples


def collect_through_outage(ctx: LoopContext, step: int, collect: Callable[[], tuple[list[list[Any]], dict[str, float]]],
                           where: str = "") -> tuple[list[list[Any]], dict[str, float]]:
    """``collect()``, a synchronous rollout of ``step``; when every engine died in it and ``ctx.recovery``
    is on, the engines are replaced with the weights the rollout was on (version ``step - 1``, waiting up
    to ``rollout.max_outage_s``) and ``collect()`` runs once more. ``where``: for the log (e.g. a tenant)."""
    try:
        return collect()
    except AllEnginesDeadError:
        if ctx.recovery is None:
            raise
        log.warning("step %d: every rollout engine died%s; replacing them and rolling out again", step, where)
        ctx.recovery.restore(ctx.trainers, step - 1, ctx.transport)
        return collect()


def push_weights(ctx: LoopContext, version: int) -> dict[str, float]:
    """The trainers' weights to the engines in rotation as ``version``; then, with ``ctx.recovery``, the
    engines out of rotation are replaced and the new ones get ``version`` before they join it.

    When the push fails and an engine it went to has died meanwhile
    (:meth:`miles.rollout.manager.RolloutManager.drop_dead_engines`), it is retried once on the engines left.
    """
    ctx.engine_readings = None
    answers, ctx.offload_answers = ctx.offload_answers, None  # health given with the offload just now
    if ctx.recovery is not None:  # an engine that hangs must not hold up the push; its answers: the step's
        ctx.engine_readings = engine_readings(ctx.rollout.drop_dead_engines(answers=answers))  # last reading
    engines = ctx.rollout.live_engines
    if not engines and ctx.recovery is None:
        raise ctx.rollout.pool.all_dead_error()
    metrics = {}
    try:
        metrics = sync_weights(ctx.trainers, engines, version=version, transport=ctx.transport,
                               wait_trainers=_probed(ctx)) if engines else {}
    except RuntimeError:
        ctx.rollout.drop_dead_engines()
        left = ctx.rollout.live_engines
        if len(left) == len(engines):
            raise  # every engine lives: the push itself failed
        if not left and ctx.recovery is None:
            raise ctx.rollout.pool.all_dead_error() from None
        log.warning("weight push of version %d: %d engine(s) died; retried on the %d left", version,
                    len(engines) - len(left), len(left))
        metrics = sync_weights(ctx.trainers, left, version=version, transport=ctx.transport,
                               wait_trainers=_probed(ctx)) if left else {}
    if ctx.recovery is not None:
        metrics |= ctx.recovery.restore(ctx.trainers, version, ctx.transport)
    if ctx.draft is not None:  # after the recovery: a replacement engine gets the trained draft too
        metrics |= push_draft(ctx, version)
    return metrics


def _probed(ctx: LoopContext) -> Callable[[list[Any]], list[Any]]:
    """Wait for one call on each trainer rank while probing them (:func:`miles.core.recovery.get_ranks`): a
    rank that hangs (``trainer.hang_timeout_s``) is killed instead of waited on for ever."""
    return functools.partial(get_ranks, ranks=ctx.trainers, kind="trainer", timeout_s=ctx.run.trainer.hang_timeout_s)


def push_draft(ctx: LoopContext, version: int) -> dict[str, float]:
    """``draft.online``: wait for the draft's training on the last batch (its ``draft/*`` metrics), then load
    its weights into every engine in rotation; an engine that died or hangs meanwhile leaves the rotation,
    as in generation. The state goes through the object store once, whatever the number of engines. Then the
    draft trainer gets one engine's weights (``state_dict``, as served) to distil the next samples from.

    With ``draft.wait`` false, a training still running is not waited for: the engines keep their draft, the
    draft trainer is probed for liveness, and it gets the engines' new weights after that training (the policy
    its next batch comes from); ``draft/lag_steps``: how many steps before ``version`` the samples the engines'
    draft learnt last came from.

    A draft trainer that died, or does not answer a liveness probe within ``trainer.hang_timeout_s`` (probed
    as the trainer ranks are, :func:`miles.core.recovery.get_ranks`: a slow step is not a hang), is replaced
    (:func:`recover_draft`) and the engines keep the draft they have."""
    assert ctx.draft is not None
    out: dict[str, float] = {}
    hang_s = ctx.run.trainer.hang_timeout_s  # probed as the trainer ranks are: slow is not hung
    ref = ctx.draft_training
    if not ctx.run.draft.wait and ref is not None and not ray.wait([ref], timeout=0)[0]:  # still training
        if hang_s > 0:
            with span("draft_probe"):
                try:
                    get_ranks([probe(ctx.draft)], [ctx.draft], "draft trainer", hang_s)
                except (ray.exceptions.RayActorError, TrainerRankHungError) as err:
                    ctx.draft_training = None
                    return recover_draft(ctx, err)
        if ctx.rollout.pool.alive:  # queued after the training in flight: its next batch comes from these weights
            _give_policy(ctx, next(iter(ctx.rollout.pool.alive)))
        return _draft_counts(ctx, version)
    ctx.draft_training = None
    with span("draft_push"):
        try:
            if ref is not None:
                out |= get_ranks([ref], [ctx.draft], "draft trainer", hang_s)[0]
                ctx.draft_trained_step = ctx.draft_batch_step
            state = ctx.draft.state.remote()
            # the actor answers in call order: health answers once state is in the object store, so an
            # engine never loads from a trainer that died under it (that would take the engine out of rotation)
            get_ranks([ctx.draft.health.remote()], [ctx.draft], "draft trainer", hang_s)
        except (ray.exceptions.RayActorError, TrainerRankHungError) as err:
            return out | recover_draft(ctx, err)
        pool = ctx.rollout.pool
        done = ctx.rollout.settle_calls({e: pool.engines[e].update_draft.remote(state, version)
                                         for e in list(pool.alive)}, what="draft push")
    ctx.draft_state = state
    if done:
        out["draft/update_s"] = max(r["draft_update_s"] for r in done.values())
        # the next samples come from the engines' weights as of now: the draft learns those (queued before
        # the next train call; an actor runs a caller's calls in order)
        _give_policy(ctx, next(iter(done)))
    return out | _draft_counts(ctx, version)


def _give_policy(ctx: LoopContext, engine: int) -> Any:
    """The draft trainer's policy copy from engine ``engine``'s weights as served (queued behind its calls)."""
    assert ctx.draft is not None
    return ctx.draft.set_policy.remote(ctx.rollout.pool.engines[engine].state_dict.remote())


def _draft_counts(ctx: LoopContext, version: int) -> dict[str, float]:
    """``draft/lag_steps`` (steps from the samples the engines' draft learnt last to ``version``), ``draft/restarts``."""
    return {"draft/lag_steps": float(version - ctx.draft_trained_step), "draft/restarts": float(ctx.draft_restarts)}


def recover_draft(ctx: LoopContext, err: BaseException) -> dict[str, float]:
    """The draft trainer died or hangs (``err``): a new one (``ctx.restart_draft``) gets the draft the engines
    were given last (:attr:`LoopContext.draft_state`; its optimizer state starts anew) and the policy one
    engine serves, and trains from the next step on. The last step's draft update is lost; the engines keep
    the draft they have. After ``trainer.max_failures`` replacements, or when the new one does not start, the
    draft stops training (``ctx.draft`` None) and the run goes on with the draft the engines have: speculative
    sampling stays exact whatever the draft, only its acceptance rate may fall."""
    limit = ctx.run.trainer.max_failures
    why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if ctx.restart_draft is None or ctx.draft_restarts >= limit:
        return _stop_draft(ctx, f"{why}, and {ctx.draft_restarts} of trainer.max_failures={limit} replacements done")
    log.warning("the draft trainer died or hangs (%s): replacing it (%d of trainer.max_failures=%d)", why,
                ctx.draft_restarts + 1, limit)
    ctx.draft_restarts += 1
    try:
        ctx.draft = ctx.restart_draft()
        if ctx.draft_state is not None:
            ray.get(ctx.draft.load_weights.remote(ctx.draft_state))
        if ctx.rollout.pool.alive:
            ray.get(_give_policy(ctx, next(iter(ctx.rollout.pool.alive))))
    except Exception as again:  # noqa: BLE001 - whatever stops the new trainer ends online training, not the run
        return _stop_draft(ctx, f"its replacement failed: {type(again).__name__}: {again}")
    return {"draft/restarts": float(ctx.draft_restarts)}


def _stop_draft(ctx: LoopContext, why: str) -> dict[str, float]:
    """End the draft's online training (``ctx.draft`` None): the engines keep the draft they have."""
    log.error("the draft trainer is lost (%s): the draft is no longer trained; the engines keep the draft they "
              "have", why)
    if ctx.draft is not None:
        ray.kill(ctx.draft)
    ctx.draft = None
    return {"draft/restarts": float(ctx.draft_restarts), "draft/stopped": 1.0}


_SKIPPED = ("train/nonfinite_skipped", "critic/nonfinite_skipped")


def count_nonfinite(steps: list[int], step: int, metrics: dict[str, float], limit: int) -> None:
    """Count ``step`` in ``steps`` (the non-finite steps in a row) when its train step skipped an update
    because the loss or gradient norm was not finite (``train/`` or ``critic/nonfinite_skipped`` > 0),
    clear ``steps`` when it skipped none; RuntimeError when ``limit`` (> 0) steps in a row were so."""
    if not any(k in metrics for k in _SKIPPED):  # no update was tried (nothing to learn from)
        return
    skipped = sum(metrics.get(k, 0.0) for k in _SKIPPED)
    if skipped == 0:
        steps.clear()
        return
    steps.append(step)
    log.warning("step %d: %d update(s) skipped, the loss or gradient norm was not finite (%d step(s) in a row; "
                "trainer.max_nonfinite_steps=%d)", step, int(skipped), len(steps), limit)
    if limit and len(steps) >= limit:
        raise RuntimeError(
            f"steps {', '.join(map(str, steps))}: {len(steps)} steps in a row with a loss or gradient norm that is "
            f"not finite (trainer.max_nonfinite_steps={limit}); the run stops. Resume from the last checkpoint "
            "with a lower trainer.lr or trainer.max_grad_norm, check the rewards and advantages for extreme "
            "values, or raise trainer.max_nonfinite_steps (0: never stop)")


def _config_dict(run: MilesConfig) -> dict[str, Any]:
    from miles.config.schema import to_yaml_dict

    return to_yaml_dict(dataclasses.asdict(run))


def save_checkpoint(ctx: LoopContext, step: int, rng_state: tuple, next_group_id: int,
                    ledger: dict[str, list[int]], stream: dict[str, Any] | None = None,
                    tenants: dict[str, tuple] | None = None) -> None:
    """The run checkpoint of ``step`` (:func:`miles.core.resume.save`), then the ``on_checkpoint`` hooks."""
    t0 = time.perf_counter()
    if ctx.save_dir is None:
        raise RuntimeError("trainer.save_every is set but the loop got no save directory")
    path = resume.save(ctx.trainers, ctx.save_dir, step, rng_state, next_group_id, _config_dict(ctx.run),
                       keep=ctx.run.trainer.keep_checkpoints, critics=ctx.critics, ledger=ledger, stream=stream,
                       fingerprint=ctx.fingerprint, draft=ctx.draft, hang_timeout_s=ctx.run.trainer.hang_timeout_s,
                       tenants=tenants)
    ctx.last_checkpoint = str(path)
    log.info("step %d: run checkpoint %s (%.1fs)", step, path, time.perf_counter() - t0)
    ctx.hooks.on_checkpoint(step, str(path))


def resume_checkpoint(ctx: LoopContext, path: str | None = None) -> checkpoints.LoopState:
    """Trainer (and critic) state, ledger and loop state of ``path`` (default ``trainer.resume_from``); the
    engines get its weights. ``ctx.ledger`` must have drawn nothing yet."""
    state = checkpoints.load(path or ctx.run.trainer.resume_from)
    critic = checkpoints.critic_state(state) if ctx.critics else None
    checkpoints.verify(state)  # every file against the manifest, before a trainer reads one
    changed = resume.config_differences(state.config, _config_dict(ctx.run))
    if changed:
        log.warning("resuming %s with a config that differs from the one that wrote it in %s: the run will "
                    "not follow the uninterrupted one", state.path, ", ".join(changed[:10])
                    + (f" and {len(changed) - 10} more" if len(changed) > 10 else ""))
    if state.ledger is not None:
        ctx.ledger.restore(state.ledger)
    hang_s = ctx.run.trainer.hang_timeout_s  # a rank that hangs while it loads is killed, not waited on
    get_ranks([t.load_state.remote(str(state.path / "trainer")) for t in ctx.trainers], ctx.trainers, "trainer", hang_s)
    if critic is not None:
        get_ranks([c.load_state.remote(str(critic)) for c in ctx.critics], ctx.critics, "critic", hang_s)
    sync_weights(ctx.trainers, ctx.rollout.live_engines, version=state.step, transport=ctx.transport,
                 wait_trainers=_probed(ctx))
    if ctx.draft is not None:  # draft.online: the draft it had, or (a checkpoint without one) the draft as loaded
        ctx.draft_training = None  # a batch after the checkpoint: not trained on
        if (state.path / "draft").is_dir():
            ray.get(ctx.draft.load_state.remote(str(state.path / "draft")))
            ctx.draft_trained_step = state.step
        else:
            log.warning("%s holds no draft state (written without draft.online): the draft continues as loaded",
                        state.path)
        push_draft(ctx, state.step)
    ctx.last_checkpoint = str(state.path)
    log.info("resumed from %s: step %d done, continuing at step %d", state.path, state.step, state.step + 1)
    return state


def recover_trainers(ctx: LoopContext, step: int, err: Exception) -> checkpoints.LoopState:
    """After ``step`` failed with ``err``: when a trainer or critic rank died and ``ctx.trainer_recovery``
    has restarts left, restart the rank groups, restore them, the ledger and the loop state from the run's
    last checkpoint and give the engines its weights; the caller runs again from the step after it.

    Raises ``err`` when no rank died (or recovery is off), and a :class:`~miles.core.recovery.TrainerRankDiedError`
    when no restart is left or there is no checkpoint to restore (:func:`restore_point`).
    """
    rec = ctx.trainer_recovery
    if rec is None:
        raise err
    died = rec.find_dead(step, err)
    if died is None:
        raise err
    if rec.restarts >= rec.max_failures:
        raise died.stop(f"No restart left (trainer.max_failures={rec.max_failures}); the run stops. Resume it "
                        "from its last checkpoint with trainer.resume_from=auto") from err
    path = restore_point(ctx, died)
    log.warning("%s; restarting the trainer ranks from %s (%d of trainer.max_failures=%d)", died, path,
                rec.restarts + 1, rec.max_failures)
    t0 = time.perf_counter()
    rec.restart()
    ctx.ledger = Ledger()  # the prompts drawn since the checkpoint are drawn again, with the same ids
    ctx.nonfinite_steps.clear()
    state = resume_checkpoint(ctx, path)
    rec.restore_s = time.perf_counter() - t0
    log.warning("trainer ranks restored from step %d in %.1f s; continuing at step %d", state.step, rec.restore_s,
                state.step + 1)
    return state


def resume_point(ctx: LoopContext, restore: Callable[[checkpoints.LoopState], None]) -> tuple[int, int]:
    """The first step to run and the next group id: 1 and 0, or those after ``trainer.resume_from``'s
    checkpoint, loaded by :func:`resume_checkpoint` (``restore(state)`` then sets the loop's own state from it,
    e.g. its prompt sampler)."""
    if ctx.run.trainer.resume_from is None:
        return 1, 0
    state = resume_checkpoint(ctx)
    restore(state)
    return state.step + 1, state.next_group_id


def run_steps(ctx: LoopContext, first: int, next_group_id: int,
              one_step: Callable[[int, int], tuple[dict[str, float], int]],
              restore: Callable[[checkpoints.LoopState], None], metrics: dict[str, float]) -> dict[str, float]:
    """Steps ``first`` to ``trainer.num_steps`` of a synchronous loop: ``one_step(step, next_group_id)`` returns
    the step's metrics and the next group id. A step that fails on a dead trainer rank is recovered
    (:func:`recover_trainers`, then ``restore(state)``) and the loop goes on from the checkpoint's next step;
    a hook's stop ends it. Returns the last step's metrics (``metrics`` when no step ran) with the ledger's
    (checked closed)."""
    progress = Progress(ctx.run.trainer.num_steps, first=first)
    step = first
    while step <= ctx.run.trainer.num_steps:
        if ctx.hooks.stop_reason is not None:  # a hook asked to stop: the step before was the last
            break
        try:
            metrics, next_group_id = one_step(step, next_group_id)
        except Exception as err:  # a dead trainer rank: restart and restore
            state = recover_trainers(ctx, step, err)  # raises err unless a rank died and can be recovered
            step, next_group_id = state.step + 1, state.next_group_id
            restore(state)
            continue
        progress.update(step, metrics)
        step += 1
    progress.close()
    ctx.ledger.check_closed()
    return metrics | ctx.ledger.metrics()


def restore_point(ctx: LoopContext, died: TrainerRankDiedError) -> str:
    """The checkpoint a recovery restores (:attr:`LoopContext.last_checkpoint`); raises ``died``, saying
    how to have one, when the run has none."""
    if ctx.last_checkpoint is None:
        raise died.stop("There is no run checkpoint to restore the trainer ranks from yet: set trainer.save_every "
                        "(e.g. 1) for a dead rank to be recovered") from died.cause
    return ctx.last_checkpoint


class EngineReading(NamedTuple):
    """One engine's ``health()`` at a moment: seconds spent generating so far, its clock, its memory."""

    busy_s: float
    clock_s: float
    memory: dict[str, float]
    """:func:`miles.tracking.memory.process_memory` of the engine's process (and its server's)."""


def engine_busy(engines: Sequence[Any]) -> dict[int, EngineReading]:
    """The :class:`EngineReading` of each engine by engine id (``health()``); engines that do not report
    their busy time (or do not answer in 10 s) are left out."""
    healths = []
    with span("engine_busy"):
        refs = [e.health.remote() for e in engines]
    for ref in refs:
        try:
            healths.append(ray.get(ref, timeout=10))
        except Exception:  # noqa: BLE001 - a dead engine: the dispatcher takes it out of rotation
            continue
    return engine_readings(healths)


def engine_readings(healths: Iterable[dict[str, Any]]) -> dict[int, EngineReading]:
    """The :class:`EngineReading` of each engine ``health()`` answer by engine id; answers without the
    engine's busy time are left out."""
    return {int(h["engine_id"]): EngineReading(float(h["busy_s"]), float(h["clock_s"]), h.get("memory", {}))
            for h in healths if "busy_s" in h}


def engine_busy_metrics(before: dict[int, EngineReading], after: dict[int, EngineReading]) -> dict[str, float]:
    """Between two :func:`engine_busy` readings, averaged over the engines in both:
    ``perf/engine_busy_s`` (seconds spent generating) and ``perf/engine_busy_frac`` (that over the
    seconds between the readings, on the engine's clock). With them, the memory of every engine at the
    second reading and of the driver now: ``mem/engine<id>/*``, ``mem/driver/*`` (:mod:`miles.tracking.memory`)."""
    out = actor_metrics("driver", process_memory())
    for e, reading in after.items():
        out |= actor_metrics(f"engine{e}", reading.memory)
    both = [(after[e].busy_s - before[e].busy_s, after[e].clock_s - before[e].clock_s)
            for e in before.keys() & after.keys()]
    if not both or min(dt for _, dt in both) <= 0:
        return out
    return out | {"perf/engine_busy_s": sum(b for b, _ in both) / len(both),
                  "perf/engine_busy_frac": sum(b / dt for b, dt in both) / len(both)}


def sampling_params(run: MilesConfig) -> SamplingParams:
    """The sampling of training rollouts (``rollout.*``)."""
    r = run.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)


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
