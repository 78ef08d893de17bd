"""Engine and trainer actors of a job, on the placement groups' bundles; kept between jobs.

:func:`create_actors` places engine ``i`` and trainer rank ``i`` as :mod:`miles.core.cluster`
describes, and returns :class:`Actors`, the handles the loop talks to.

Most of an actor's start-up is its process importing torch and transformers' modeling code
(about 10 s of CPU per actor on 2 cores). So while Ray outlives a job (a sweep's jobs on the basic
launcher, jobs run from Python), :func:`park_actors` keeps a finished job's actors, and the next
job whose :func:`actor_shape` matches takes them: each is constructed anew in its process
(:mod:`miles.backends.reuse`). One set is kept at a time, because parked actors hold their bundles'
CPUs; a job of another shape shuts it down before it reserves its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.config import MilesConfig, check_allowed, locate
from miles.core.cluster import (
    actor_env,
    bundle_nodes,
    device,
    placement_pools,
    rendezvous,
    reserve,
    threads_per_actor,
)

log = logging.getLogger(__name__)

ENGINE_MAX_CONCURRENCY = 32  # engines are threaded actors: several generate calls share one batch


@dataclass
class Actors:
    """Handles to everything the loop talks to."""

    engines: list[Any]
    trainers: list[Any]
    placement_groups: list[PlacementGroup]
    engine_threads: int
    trainer_threads: int
    offload: bool = False
    """Whether :meth:`offload_engines` / :meth:`restore_engines` do anything (colocate + offload_engines)."""
    nodes: Mapping[str, list[str]] | None = None
    """Node id of each engine and trainer rank: ``{"engine": [...], "trainer": [...]}``."""
    critics: list[Any] = field(default_factory=list)
    """Critic ranks (``algo.estimator: gae``), their own torch.distributed group."""
    reused: bool = False
    """Whether these are the last job's actors, constructed anew (``cluster.reuse_actors``)."""

    @property
    def num_threads(self) -> int:
        """torch threads per actor (the larger of the engine and trainer counts)."""
        return max(self.engine_threads, self.trainer_threads)

    def start_offload(self, engines: Sequence[Any] | None = None) -> list[Any]:
        """colocate: every engine starts releasing its memory (KV cache, weights) so the trainer has it.

        Returns the calls' refs, to ``ray.get`` once the train step is under way (the release
        overlaps it). Call after the rollout (and any evaluation); generating while released is an
        error, and the next weight sync brings the engines back. Nothing for disaggregated or
        ``offload_engines=false``.
        """
        if not self.offload:
            return []
        return [e.release_memory.remote() for e in (self.engines if engines is None else engines)]

    def offload_engines(self) -> dict[str, float]:
        """:meth:`start_offload` and wait for it; ``perf/engine_offload_s`` (empty metrics when off)."""
        if not self.offload:
            return {}
        t0 = time.perf_counter()
        ray.get(self.start_offload())
        return {"perf/engine_offload_s": time.perf_counter() - t0}

    def restore_engines(self) -> dict[str, float]:
        """colocate: undo :meth:`offload_engines`, bit-exactly. No-op when not offloading.

        Not needed before a weight sync: a full weight update brings a released engine back by
        itself, with the new weights (without reading the offloaded copy).
        """
        if not self.offload:
            return {}
        t0 = time.perf_counter()
        ray.get([e.resume_memory.remote() for e in self.engines])
        return {"perf/engine_restore_s": time.perf_counter() - t0}

    def shutdown(self) -> None:
        try:
            ray.get([t.shutdown.remote() for t in self.trainers + self.critics], timeout=60)
        except Exception as e:  # a dead rank must not keep the driver from exiting
            log.warning("trainer shutdown failed: %s", e)
        for a in self.engines + self.trainers + self.critics:
            ray.kill(a)
        for pg in self.placement_groups:
            remove_placement_group(pg)


@dataclass(frozen=True)
class Backends:
    """The classes a run's actors are made of, and the engine's constructor arguments from config."""

    engine: type
    engine_kwargs: Mapping[str, Any]
    trainer: type
    critic: type | None
    offload: bool = False
    """colocate: whether the engines release their memory while the trainer trains."""


def backends(run: MilesConfig) -> Backends:
    """Resolve ``rollout.engine``, ``trainer._target_`` and (PPO) ``algo.critic._target_`` to classes.

    Each dotted path is checked against the allowlist before it is imported, then the class against
    its Protocol (:mod:`miles.backends.contract`): a class that cannot serve raises :class:`ConfigError`
    before any actor starts.
    """
    from miles.backends.contract import (
        can_offload,
        check_critic_class,
        check_engine_class,
        check_trainer_class,
    )

    node, allow = run.rollout.engine, run.plugins.allow
    for key, target in (("rollout.engine._target_", node.target), ("trainer._target_", run.trainer.target),
                        ("algo.critic._target_", run.algo.critic.target)):
        check_allowed(target, allow, key=key)
    engine = locate(node.target)
    p = run.placement
    offload = p.name == "colocate" and (can_offload(engine) if p.offload_engines is None else p.offload_engines)
    if p.name == "colocate" and p.offload_engines is None and not offload:
        log.info("placement.offload_engines=null: %s cannot release memory, so engines keep it while the "
                 "trainer trains", node.target)
    check_engine_class(engine, kwargs=engine_kwargs(run), offload=offload, run=run)
    trainer = locate(run.trainer.target)
    check_trainer_class(trainer, run)
    critic = None
    if run.algo.estimator == "gae":
        critic = locate(run.algo.critic.target)
        check_critic_class(critic)
    return Backends(engine=engine, engine_kwargs=engine_kwargs(run), trainer=trainer, critic=critic, offload=offload)


def engine_kwargs(run: MilesConfig) -> dict[str, Any]:
    """The ``rollout.engine`` node's keyword arguments, with ``capture_routing=True`` when
    ``algo.routing_replay=rollout`` (the trainer replays what the engines record; this wins over the node),
    and the torch engine's session prefix cache off under routing replay or ``precision.true_on_policy``
    (a reused prefix has no recorded routes; true on-policy prefills every prompt whole)."""
    kwargs = dict(run.rollout.engine.kwargs)
    if run.algo.routing_replay == "rollout":
        kwargs["capture_routing"] = True
    if "prefix_cache_tokens" in kwargs and (run.algo.routing_replay == "rollout" or run.precision.true_on_policy):
        kwargs["prefix_cache_tokens"] = 0
    if run.adapter.kind != "none":  # the engines hold the trainer's adapters on the frozen base
        kwargs["adapter"] = run.adapter
        if run.tenants:  # one adapter per tenant, named after it
            kwargs["adapter_names"] = tuple(t.name for t in run.tenants)
    return kwargs


def create_actors(run: MilesConfig, checkpoint_dir: str) -> Actors:
    """Engines and trainer ranks on the placement groups' bundles (see :mod:`miles.core.cluster`).

    With ``cluster.reuse_actors``, the actors the last job in this driver parked (:func:`park_actors`)
    are taken instead when the run's shape matches: each is constructed anew in its process
    (:mod:`miles.backends.reuse`), which skips the process start and its imports.
    """
    warm = _take_parked(run)
    if warm is not None:
        try:
            return _ready(run, _reinit(warm, run, checkpoint_dir), reused=True)
        except Exception as e:  # e.g. an actor that died while parked: start new ones, as without reuse
            log.warning("the last job's actors could not be reused (%s); starting new ones", _first_line(e))
            warm.shutdown()
    p = run.placement
    classes = backends(run)
    engine_cls, trainer_cls = ray.remote(classes.engine), ray.remote(classes.trainer)
    groups = reserve(run)
    engine_threads, trainer_threads = threads_per_actor(run)
    gpu = device(run) == "cuda"
    if p.name == "colocate":
        shared = groups[0]
        engine_pg = trainer_pg = shared
        # an engine and a trainer rank share a bundle, each holding half of its CPUs and part of its GPU
        engine_cpus = trainer_cpus = p.cpus_per_bundle / 2
        engine_gpus, trainer_gpus = (0.4, 0.3) if gpu else (0, 0)
    else:
        engine_pg, trainer_pg = groups
        engine_cpus, trainer_cpus = p.cpus_per_engine, p.cpus_per_trainer_rank
        engine_gpus, trainer_gpus = (1.0, 0.5) if gpu else (0, 0)
    critic_gpus = trainer_gpus  # a critic rank shares its trainer rank's bundle (and GPU)

    def on_bundle(pg: PlacementGroup, i: int, cpus: float, threads: int, gpus: float) -> dict[str, Any]:
        return dict(
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i % len(pg.bundle_specs)),
            runtime_env={"env_vars": actor_env(p, threads)},
        )

    args = _constructor_args(run, checkpoint_dir, trainer_pg, engine_threads, trainer_threads)
    engines = [
        engine_cls.options(max_concurrency=ENGINE_MAX_CONCURRENCY,
                           **on_bundle(engine_pg, i, engine_cpus, engine_threads, engine_gpus)).remote(*a, **kw)
        for i, (a, kw) in enumerate(args.engines)
    ]
    trainers = [trainer_cls.options(**on_bundle(trainer_pg, r, trainer_cpus, trainer_threads, trainer_gpus)).remote(**kw)
                for r, kw in enumerate(args.trainers)]
    critics = []
    if args.critics:
        assert classes.critic is not None
        critic_cls = ray.remote(classes.critic)
        # the bundle's CPUs are already split between engine and trainer: the critic takes turns with them
        critics = [critic_cls.options(**on_bundle(trainer_pg, r, 0, trainer_threads, critic_gpus)).remote(**kw)
                   for r, kw in enumerate(args.critics)]
    actors = Actors(engines=engines, trainers=trainers, placement_groups=groups, engine_threads=engine_threads,
                    trainer_threads=trainer_threads, offload=classes.offload,
                    critics=critics)
    try:
        # surface construction errors now, with the actor's traceback
        ray.get([e.health.remote() for e in engines] + [t.__ray_ready__.remote() for t in trainers + critics])
    except BaseException:
        actors.shutdown()
        raise
    return _ready(run, actors, reused=False)


@dataclass(frozen=True)
class _Args:
    """Constructor arguments of every actor of a job: engines ``(args, kwargs)``, ranks' kwargs."""

    engines: list[tuple[tuple[Any, ...], dict[str, Any]]]
    trainers: list[dict[str, Any]]
    critics: list[dict[str, Any]]


def _constructor_args(run: MilesConfig, checkpoint_dir: str, trainer_pg: PlacementGroup,
                      engine_threads: int, trainer_threads: int) -> _Args:
    """What each actor is constructed with, for new actors and reused ones alike."""
    p, dev = run.placement, device(run)
    engines = [((checkpoint_dir, run.precision),
                dict(engine_kwargs(run), seed=run.seed + 1000 * i, num_threads=engine_threads, engine_id=i,
                     device=dev))
               for i in range(p.num_engines)]

    def ranks() -> list[dict[str, Any]]:
        addr, port = rendezvous(run, trainer_pg)  # a group of its own: its own port
        return [dict(rank=r, world_size=p.trainer_world_size, master_addr=addr, master_port=port,
                     checkpoint_dir=checkpoint_dir, run=run, num_threads=trainer_threads, device=dev)
                for r in range(p.trainer_world_size)]

    trainers = ranks()
    if run.tenants:  # one adapter per tenant, named after it (as in the engines)
        trainers = [dict(r, adapter_names=tuple(t.name for t in run.tenants)) for r in trainers]
    return _Args(engines=engines, trainers=trainers, critics=ranks() if run.algo.estimator == "gae" else [])


def _ready(run: MilesConfig, actors: Actors, *, reused: bool) -> Actors:
    """Record where the actors are and log the placement."""
    p = run.placement
    engine_pg, trainer_pg = actors.placement_groups[0], actors.placement_groups[-1]
    engine_nodes, trainer_nodes = bundle_nodes(engine_pg), bundle_nodes(trainer_pg)
    actors.nodes = {"engine": [engine_nodes[i % len(engine_nodes)] for i in range(p.num_engines)],
                    "trainer": [trainer_nodes[r % len(trainer_nodes)] for r in range(p.trainer_world_size)]}
    pools = "; ".join(f"{pool.name} pool {pool.describe()}" for pool in placement_pools(run))
    log.info("placement '%s': %s; engines on node(s) %s with %d thread(s) each, trainer ranks on node(s) %s "
             "with %d thread(s) each", p.name, pools, _short(actors.nodes["engine"]), actors.engine_threads,
             _short(actors.nodes["trainer"]), actors.trainer_threads)
    actors.reused = reused
    return actors


# ---- actors kept between jobs ---------------------------------------------------------------------

@dataclass
class _Parked:
    shape: str
    cluster: tuple[str, str]
    actors: Actors


_PARKED: _Parked | None = None
"""The one set of actors kept for the next job in this driver (one set: parked actors hold CPUs)."""


def actor_shape(run: MilesConfig) -> str:
    """What fixes a job's actor processes: their classes, bundles, resources and environment.

    Two jobs of the same shape can run on the same actors; everything else (model, precision,
    algorithm, seed, ...) goes to the constructors.
    """
    engine_threads, trainer_threads = threads_per_actor(run)
    return json.dumps({
        "placement": dataclasses.asdict(run.placement), "engine": run.rollout.engine.target,
        "trainer": run.trainer.target, "critic": run.algo.critic.target if run.algo.estimator == "gae" else None,
        "threads": [engine_threads, trainer_threads], "address": run.cluster.address, "device": device(run),
    }, sort_keys=True, default=str)


def _cluster_id() -> tuple[str, str]:
    """This driver's connection to Ray: another cluster, or a new connection, never sees old actors."""
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id()


def _reusable(run: MilesConfig) -> bool:
    b = backends(run)
    classes = [b.engine, b.trainer] + ([b.critic] if b.critic is not None else [])
    return all(callable(getattr(c, m, None)) for c in classes for m in ("park", "reinit"))


def _take_parked(run: MilesConfig) -> Actors | None:
    """The parked actors if they fit ``run``; a parked set of another shape is shut down (it holds CPUs)."""
    global _PARKED
    kept = _PARKED
    if (kept is not None and run.cluster.reuse_actors and kept.shape == actor_shape(run) and _reusable(run)
            and ray.is_initialized() and kept.cluster == _cluster_id()):
        _PARKED = None
        return kept.actors
    release_parked()  # another shape, reuse off, or gone with its cluster
    return None


def _reinit(actors: Actors, run: MilesConfig, checkpoint_dir: str) -> Actors:
    args = _constructor_args(run, checkpoint_dir, actors.placement_groups[-1], actors.engine_threads,
                             actors.trainer_threads)
    ray.get([e.reinit.remote(*a, **kw) for e, (a, kw) in zip(actors.engines, args.engines, strict=True)]
            + [t.reinit.remote(**kw) for t, kw in zip(actors.trainers + actors.critics,
                                                     args.trainers + args.critics, strict=True)])
    return actors


def park_actors(run: MilesConfig, actors: Actors) -> bool:
    """After a job that finished: keep its actors for the next job in this driver, or shut them down.

    Kept when ``cluster.reuse_actors`` is on and every actor class can be reused; each actor then
    releases everything of the job (:meth:`miles.backends.reuse.Reusable.park`). Returns whether they
    were kept. A set parked before is shut down: only the latest is kept.
    """
    global _PARKED
    if not (run.cluster.reuse_actors and _reusable(run)):
        actors.shutdown()
        return False
    try:
        ray.get([a.park.remote() for a in actors.engines + actors.trainers + actors.critics], timeout=60)
    except Exception as e:
        log.warning("could not park the job's actors for the next job (%s); shutting them down", _first_line(e))
        actors.shutdown()
        return False
    release_parked()
    _PARKED = _Parked(actor_shape(run), _cluster_id(), actors)
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
