"""Engine and trainer actors of a job, created from its :class:`~miles.core.plan.Plan`; kept between jobs.

:func:`create_actors` reserves the plan's pools (:func:`miles.core.cluster.reserve`) and places every engine,
trainer rank and critic rank on the bundle, CPUs, GPUs, threads and environment of its plan entry; it
returns :class:`Actors`, the handles the loop talks to.

Most of an actor's start-up is its process importing torch and transformers' modeling code
(about 10 s of CPU per actor on 2 cores). So while Ray outlives a job (a sweep's jobs on the basic
launcher, jobs run from Python), :func:`park_actors` keeps a finished job's actors, and the next
job whose plan has the same :meth:`~miles.core.plan.Plan.key` takes them: each is constructed anew in its
process (:mod:`miles.backends.reuse`). With ``placement=disaggregated``, a job whose plan differs only on
the trainer side (the same :meth:`~miles.core.plan.Plan.engine_key`) takes the engines and their pool
alone, so an SGLang engine keeps its server. One set is kept at a time, because parked actors hold their
bundles' CPUs; a job of another key shuts down what it does not take before it reserves its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.config import MilesConfig, RankConfig, locate
from miles.config.draft import draft_lr
from miles.core.cluster import bundle_nodes, rendezvous, reserve
from miles.core.plan import Plan, Slot
from miles.tracking.timeline import timed_class

log = logging.getLogger(__name__)

ENGINE_MAX_CONCURRENCY = 32  # engines are threaded actors: several generate calls share one batch

PROBE_GROUP = "probe"
"""The concurrency group of every trainer and critic rank that its liveness probe (:func:`probe`) runs in:
a thread of its own, so a rank busy in a train step, or waiting in a collective on a peer, answers at
once, while a rank that is stopped, or hung holding the interpreter, does not."""


def probe(rank: Any) -> Any:
    """A liveness probe of a trainer or critic rank (an ``ObjectRef`` of ``True``), answered in
    :data:`PROBE_GROUP`; its error is the rank's death."""
    return rank.__ray_ready__.options(concurrency_group=PROBE_GROUP).remote()


@dataclass
class Actors:
    """Handles to everything the loop talks to."""

    engines: list[Any]
    trainers: list[Any]
    placement_groups: list[PlacementGroup]
    plan: Plan
    """Where each of them runs."""
    nodes: Mapping[str, list[str]] | None = None
    """Node id of each engine and trainer rank: ``{"engine": [...], "trainer": [...]}``."""
    critics: list[Any] = field(default_factory=list)
    """Critic ranks (``algo.estimator: gae``), their own torch.distributed group."""
    reused: bool = False
    """Whether these are the last job's actors, constructed anew (``cluster.reuse_actors``)."""
    stores: list[Any] = field(default_factory=list)
    """The stores the trainer and critic groups meet at, hosted in this driver while the groups live."""
    teachers: list[Any] = field(default_factory=list)
    """On-policy distillation's teacher engines (``teacher.model``); started for each job, never parked."""
    draft_trainer: Any | None = None
    """``draft.online``: the draft's trainer (:class:`miles.train.draft.DraftTrainer`); started for each job,
    never parked; None: none."""

    def start_offload(self, engines: Sequence[Any] | None = None) -> list[Any]:
        """colocate: every engine starts releasing its memory (KV cache, weights) so the trainer has it.

        Returns the calls' refs, to ``ray.get`` once the train step is under way (the release
        overlaps it). Call after the rollout (and any evaluation); generating while released is an
        error, and the next weight sync brings the engines back. Nothing for disaggregated or
        ``offload_engines=false``.
        """
        if not self.plan.offload:
            return []
        return [e.release_memory.remote() for e in (self.engines if engines is None else engines)]

    def _draft(self) -> list[Any]:
        return [self.draft_trainer] if self.draft_trainer is not None else []

    def shutdown(self) -> None:
        try:
            ray.get([t.shutdown.remote() for t in self.trainers + self.critics], timeout=60)
        except Exception as e:  # a dead rank must not keep the driver from exiting
            log.warning("trainer shutdown failed: %s", e)
        for a in self.engines + self.trainers + self.critics + self.teachers + self._draft():
            ray.kill(a)
        self.teachers, self.draft_trainer = [], None
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.stores.clear()


def create_actors(plan: Plan, run: MilesConfig, checkpoint_dir: str) -> Actors:
    """Every engine, trainer rank and critic rank of ``plan``, each on its plan entry's bundle.

    ``run`` is what the actors are constructed with: engines take ``run.precision`` and their seed
    (``run.seed + 1000 * engine id``) besides the plan's engine arguments; trainer and critic ranks take
    their part of it, ``RankConfig.of(run)`` (:class:`miles.config.rank.RankConfig`). With
    ``cluster.reuse_actors``, the actors the last job in this driver parked
    (:func:`park_actors`) are taken instead when their plan has the same key: each is constructed anew
    in its process (:mod:`miles.backends.reuse`), which skips the process start and its imports.
    """
    warm = _take_parked(plan, run.cluster.reuse_actors)
    if warm is not None and warm.trainers:
        try:
            return _ready(_start_job_actors(_reinit(warm, plan, run, checkpoint_dir), run, checkpoint_dir),
                          reused=True)
        except Exception as e:  # e.g. an actor that died while parked: start new ones, as without reuse
            log.warning("the last job's actors could not be reused (%s); starting new ones", _first_line(e))
            warm.shutdown()
            warm = None
    kept = warm  # None, or the last job's engines alone (disaggregated, the same engine side)
    groups = reserve(plan) if kept is None else [*kept.placement_groups, *reserve(plan, first=1)]

    engine_args, trainer_args, critic_args, stores = _constructor_args(plan, run, checkpoint_dir)
    trainer_cls = locate(plan.trainer_class)
    if kept is not None:
        engines = kept.engines
        pending = [e.reinit.remote(*a, **kw) for e, (a, kw) in zip(engines, engine_args, strict=True)]
    else:
        engines = [_new_engine(plan, groups, i, args, timed=_timed(run)) for i, args in enumerate(engine_args)]
        pending = []
    trainers = [_place(trainer_cls, slot, groups, track=_track("trainer rank", slot, run), probed=True).remote(**kw)
                for slot, kw in zip(plan.trainers, trainer_args, strict=True)]
    critics = [_place(locate(plan.critic_class), slot, groups, track=_track("critic rank", slot, run),
                      probed=True).remote(**kw)
               for slot, kw in zip(plan.critics, critic_args, strict=True)]
    actors = Actors(engines=engines, trainers=trainers, placement_groups=groups, plan=plan, critics=critics,
                    stores=stores)
    try:
        ray.get(pending)
    except Exception as e:  # a kept engine that died while parked: new engines, as with nothing kept
        actors.shutdown()
        log.warning("the last job's engines could not be kept (%s); starting new ones", _first_line(e))
        return create_actors(plan, run, checkpoint_dir)
    try:  # surface construction errors now, with the actor's traceback
        ray.get([e.health.remote() for e in engines] + [t.__ray_ready__.remote() for t in trainers + critics])
    except BaseException:
        actors.shutdown()
        raise
    if kept is not None:
        log.info("kept the last job's %d engine(s) and their pool; new trainer ranks", len(engines))
    try:
        _start_job_actors(actors, run, checkpoint_dir)
    except BaseException:
        actors.shutdown()
        raise
    return _ready(actors, reused=False)


def replace_teacher(actors: Actors, index: int, run: MilesConfig) -> Any:
    """Kill teacher engine ``index`` and start a new one in its placement bundle, constructed as at the start of
    the run. Returns the new handle at once (it is up when its ``health`` answers); ``actors.teachers`` holds it."""
    ray.kill(actors.teachers[index], no_restart=True)
    actors.teachers[index] = _new_teacher(actors, index, run)
    return actors.teachers[index]


def _new_teacher(actors: Actors, index: int, run: MilesConfig) -> Any:
    plan = actors.plan
    s = plan.teachers[index]
    return _place(locate(plan.engine_class), s, actors.placement_groups,
                  track=f"teacher {s.index}" if _timed(run) else None, max_concurrency=ENGINE_MAX_CONCURRENCY).remote(
        plan.teacher_checkpoints[plan.teacher_name(index)], run.precision, **dict(plan.teacher_kwargs, seed=run.seed + 1000 * s.index + 7,
                                                       num_threads=s.threads, engine_id=s.index, device=plan.device))


def _start_job_actors(actors: Actors, run: MilesConfig, checkpoint_dir: str) -> Actors:
    """The actors started for each job, never parked: the plan's teacher engines (:attr:`~miles.core.plan.Plan.teachers`,
    actors of the engine class on their bundles, built from their teacher's checkpoint) and the draft trainer
    (:attr:`~miles.core.plan.Plan.draft_trainer`); returns once each answers ``health``."""
    plan = actors.plan
    if not plan.teachers and not plan.draft_trainer:
        return actors
    if set(plan.teacher_names) - set(plan.teacher_checkpoints):
        raise ValueError(f"the plan has teacher engines for {plan.teacher_names} but checkpoints for "
                         f"{sorted(plan.teacher_checkpoints)} only")
    actors.teachers = [_new_teacher(actors, s.index, run) for s in plan.teachers]
    if plan.draft_trainer:
        actors.draft_trainer = _new_draft_trainer(actors, run, checkpoint_dir)
    try:
        ray.get([t.health.remote() for t in actors.teachers + actors._draft()])
    except BaseException:  # the caller decides about the rest
        for t in actors.teachers + actors._draft():
            ray.kill(t)
        actors.teachers, actors.draft_trainer = [], None
        raise
    return actors


def _new_draft_trainer(actors: Actors, run: MilesConfig, checkpoint_dir: str) -> Any:
    """``draft.online``'s :class:`~miles.train.draft.DraftTrainer` on its plan slot, from the draft's checkpoint
    (the one every engine loads) and the policy's (``checkpoint_dir``)."""
    from miles.train.draft import DraftTrainer

    plan = actors.plan
    checkpoint = plan.engine_kwargs.get("draft_checkpoint_dir")
    if checkpoint is None:
        raise ValueError("the plan has a draft trainer but its engines load no draft (draft_checkpoint_dir)")
    s = plan.draft_trainer[0]
    return _place(DraftTrainer, s, actors.placement_groups, track="draft trainer" if _timed(run) else None,
                  probed=True).remote(
        str(checkpoint), checkpoint_dir, lr=draft_lr(run), temperature=run.rollout.temperature, num_threads=s.threads,
        seed=run.seed + 11, lr_warmup_steps=run.draft.lr_warmup_steps)


def replace_draft_trainer(actors: Actors, run: MilesConfig, checkpoint_dir: str) -> Any:
    """Kill the draft trainer (``draft.online``) and start a new one on its slot, as at the start of the run
    (the draft's checkpoint); returns it once its ``health`` answers. ``actors.draft_trainer`` holds it."""
    if actors.draft_trainer is not None:
        ray.kill(actors.draft_trainer, no_restart=True)
        actors.draft_trainer = None
    actors.draft_trainer = _new_draft_trainer(actors, run, checkpoint_dir)
    ray.get(actors.draft_trainer.health.remote())
    return actors.draft_trainer


def replace_engine(actors: Actors, index: int, run: MilesConfig, checkpoint_dir: str) -> Any:
    """Kill engine ``index`` (its backend goes with it) and start a new actor in its placement bundle,
    constructed as at the start of the run (the checkpoint's weights, version 0). Returns the new handle
    at once; it is up when its ``health`` answers. ``actors.engines`` holds it from now on."""
    ray.kill(actors.engines[index], no_restart=True)
    actors.engines[index] = _new_engine(actors.plan, actors.placement_groups, index,
                                        _engine_args(actors.plan, run, checkpoint_dir)[index], timed=_timed(run))
    return actors.engines[index]


def restart_trainers(actors: Actors, run: MilesConfig, checkpoint_dir: str) -> None:
    """Kill every trainer and critic rank and start new ones in the same placement bundles, constructed
    as at the start of the run (the model of ``checkpoint_dir``), each group meeting at a new store on a
    fresh port: a torch.distributed group cannot take a new member in place of a dead one, so the whole
    group restarts. ``actors.trainers`` and ``actors.critics`` hold the new handles (the same lists);
    returns once every new rank is constructed."""
    for a in actors.trainers + actors.critics:
        ray.kill(a, no_restart=True)
    plan = actors.plan
    _, trainer_args, critic_args, stores = _constructor_args(plan, run, checkpoint_dir)
    trainer_cls = locate(plan.trainer_class)
    actors.trainers[:] = [_place(trainer_cls, slot, actors.placement_groups,
                                 track=_track("trainer rank", slot, run), probed=True).remote(**kw)
                          for slot, kw in zip(plan.trainers, trainer_args, strict=True)]
    actors.critics[:] = [_place(locate(plan.critic_class), slot, actors.placement_groups,
                                track=_track("critic rank", slot, run), probed=True).remote(**kw)
                         for slot, kw in zip(plan.critics, critic_args, strict=True)]
    actors.stores[:] = stores  # the old stores close with their last reference
    ray.get([t.__ray_ready__.remote() for t in actors.trainers + actors.critics])


def _timed(run: MilesConfig) -> bool:
    """Whether the actors record their calls for per-step timelines (``tracking.timeline_steps``)."""
    return bool(run.tracking.timeline_steps)


def _track(kind: str, slot: Slot, run: MilesConfig) -> str | None:
    """The timeline track of the actor of ``slot`` (e.g. ``"trainer rank 0"``), or None: not timed."""
    return f"{kind} {slot.index}" if _timed(run) else None


def _place(cls: Any, slot: Slot, groups: Sequence[Any], track: str | None = None, probed: bool = False,
           **options: Any) -> Any:
    """``cls`` as a Ray actor class bound to ``slot``'s bundle, CPUs, GPUs and environment; with ``track``,
    its calls are recorded for per-step timelines (:func:`miles.tracking.timeline.timed_class`); ``probed``:
    it answers :func:`probe` in a thread of its own (trainer and critic ranks)."""
    if track is not None:
        cls = timed_class(cls, track)
    remote = ray.remote(concurrency_groups={PROBE_GROUP: 1}) if probed else ray.remote
    return remote(cls).options(
        num_cpus=slot.cpus, num_gpus=slot.gpus, runtime_env={"env_vars": dict(slot.env)},
        scheduling_strategy=PlacementGroupSchedulingStrategy(groups[slot.pool], placement_group_bundle_index=slot.bundle),
        **options)


def _new_engine(plan: Plan, groups: Sequence[Any], index: int, args: tuple[tuple[Any, ...], dict[str, Any]],
                timed: bool = False) -> Any:
    """Engine ``index`` of ``plan`` on its bundle, constructed with ``args`` (one of :func:`_engine_args`);
    ``timed``: its calls are recorded for per-step timelines."""
    args, kwargs = args
    return _place(locate(plan.engine_class), plan.engines[index], groups, track=f"engine {index}" if timed else None,
                  max_concurrency=ENGINE_MAX_CONCURRENCY).remote(*args, **kwargs)


def _engine_args(plan: Plan, run: MilesConfig, checkpoint_dir: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every engine's ``(args, kwargs)``: the checkpoint and precision, the plan's engine arguments, and
    a seed, thread count and id of its own."""
    return [((checkpoint_dir, run.precision),
             dict(plan.engine_kwargs, seed=run.seed + 1000 * s.index, num_threads=s.threads, engine_id=s.index,
                  device=plan.device))
            for s in plan.engines]


_Args = tuple[list[tuple[tuple[Any, ...], dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]], list[Any]]


def _constructor_args(plan: Plan, run: MilesConfig, checkpoint_dir: str) -> _Args:
    """What each actor is constructed with, for new actors and reused ones alike: every engine's
    ``(args, kwargs)``, every trainer rank's kwargs, every critic rank's kwargs; and the stores the rank
    groups meet at (:func:`~miles.core.cluster.rendezvous`), which live as long as the actors."""
    config = RankConfig.of(run)
    stores: list[Any] = []

    def ranks(slots: tuple[Slot, ...], extra: Mapping[str, Any]) -> list[dict[str, Any]]:
        if not slots:
            return []
        addr, store = rendezvous(plan)  # a group of its own: its own store
        stores.append(store)
        return [dict(extra, rank=s.index, world_size=len(slots), master_addr=addr, master_port=store.port,
                     checkpoint_dir=checkpoint_dir, config=config, num_threads=s.threads, device=plan.device)
                for s in slots]

    return (_engine_args(plan, run, checkpoint_dir), ranks(plan.trainers, plan.rank_kwargs), ranks(plan.critics, {}),
            stores)


def _ready(actors: Actors, *, reused: bool) -> Actors:
    """Record where the actors are and log the placement."""
    plan = actors.plan
    nodes = [bundle_nodes(pg) for pg in actors.placement_groups]
    actors.nodes = {"engine": [nodes[s.pool][s.bundle] for s in plan.engines],
                    "trainer": [nodes[s.pool][s.bundle] for s in plan.trainers]}
    pools = "; ".join(f"{pool.name} pool {pool.describe()}" for pool in plan.pools)
    log.info("placement '%s': %s; engines on node(s) %s with %d thread(s) each, trainer ranks on node(s) %s "
             "with %d thread(s) each", plan.placement, pools, _short(actors.nodes["engine"]),
             plan.engines[0].threads, _short(actors.nodes["trainer"]), plan.trainers[0].threads)
    actors.reused = reused
    return actors


# ---- actors kept between jobs ---------------------------------------------------------------------

@dataclass
class _Parked:
    key: str
    cluster: tuple[str, str]
    actors: Actors


_PARKED: _Parked | None = None
"""The one set of actors kept for the next job in this driver (one set: parked actors hold CPUs)."""


def _cluster_id() -> tuple[str, str]:
    """This driver's connection to Ray: another cluster, or a new connection, never sees old actors."""
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id()


def _reusable(plan: Plan) -> bool:
    classes = [plan.engine_class, plan.trainer_class] + ([plan.critic_class] if plan.critic_class else [])
    return all(callable(getattr(locate(c), m, None)) for c in classes for m in ("park", "reinit"))


def _take_parked(plan: Plan, reuse: bool) -> Actors | None:
    """The parked actors if they fit ``plan``; or, disaggregated, their engines alone if the engine side
    fits (:meth:`~miles.core.plan.Plan.engine_key`): the trainer side is shut down with its pool. Whatever
    is not taken is shut down (it holds CPUs)."""
    global _PARKED
    kept = _PARKED
    if kept is None or not (reuse and ray.is_initialized() and kept.cluster == _cluster_id()):
        release_parked()  # reuse off, or gone with its cluster
        return None
    if kept.key == plan.key() and _reusable(plan):
        _PARKED = None
        return kept.actors
    old = kept.actors
    if (plan.engine_key() is not None and old.plan.engine_key() == plan.engine_key()
            and callable(getattr(locate(plan.engine_class), "reinit", None))):
        _PARKED = None
        trainer_side = Actors(engines=[], trainers=old.trainers, critics=old.critics,
                              placement_groups=old.placement_groups[1:], plan=old.plan)
        trainer_side.shutdown()
        return Actors(engines=old.engines, trainers=[], placement_groups=old.placement_groups[:1], plan=old.plan)
    release_parked()  # another key
    return None


def _reinit(actors: Actors, plan: Plan, run: MilesConfig, checkpoint_dir: str) -> Actors:
    engine_args, trainer_args, critic_args, actors.stores = _constructor_args(plan, run, checkpoint_dir)
    ray.get([e.reinit.remote(*a, **kw) for e, (a, kw) in zip(actors.engines, engine_args, strict=True)]
            + [t.reinit.remote(**kw) for t, kw in zip(actors.trainers + actors.critics,
                                                     trainer_args + critic_args, strict=True)])
    actors.plan = plan
    return actors


def park_actors(actors: Actors, *, reuse: bool) -> bool:
    """After a job that finished: keep its actors for the next job in this driver, or shut them down.

    Kept when ``reuse`` (``cluster.reuse_actors``) is on and every actor class can be reused; each actor
    then releases everything of the job (:meth:`miles.backends.reuse.Reusable.park`). Returns whether they
    were kept. A set parked before is shut down: only the latest is kept.
    """
    global _PARKED
    if not (reuse and _reusable(actors.plan)):
        actors.shutdown()
        return False
    for t in actors.teachers + actors._draft():  # started for each job: they hold a checkpoint of their own
        ray.kill(t)
    actors.teachers, actors.draft_trainer = [], None
    try:
        ray.get([a.park.remote() for a in actors.engines + actors.trainers + actors.critics], timeout=60)
    except Exception as e:
        log.warning("could not park the job's actors for the next job (%s); shutting them down", _first_line(e))
        actors.shutdown()
        return False
    release_parked()
    _PARKED = _Parked(actors.plan.key(), _cluster_id(), actors)
    return True


def parked() -> Actors | None:
    """The actors kept for the next job in this driver, if any."""
    return _PARKED.actors if _PARKED is not None else None


def release_parked() -> None:
    """Shut down the actors kept for the next job, if any (their placement groups free their CPUs)."""
    global _PARKED
    parked, _PARKED = _PARKED, None
    if parked is not None and ray.is_initialized() and parked.cluster == _cluster_id():
        parked.actors.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _short(node_ids: list[str]) -> str:
    return ",".join(n[:8] for n in node_ids)
