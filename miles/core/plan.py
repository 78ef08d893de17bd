"""The placement plan of a job: every actor, where it runs and what its process gets, from the config alone.

:func:`make_plan` is pure: the validated config and the :class:`Machine` give a :class:`Plan`; no Ray starts.
``python -m miles --plan [overrides]`` prints it; :mod:`miles.core.cluster` reserves its pools and
:mod:`miles.core.actors` creates every actor from its entry.

**Pools.** colocate: one pool of ``max(num_engines, trainer_world_size)`` bundles of ``cpus_per_bundle``;
engine ``i`` and trainer rank ``i`` share bundle ``i``, half of its CPUs each, and take turns (the engines can
release their memory while the ranks train: ``placement.offload_engines``). disaggregated: an engine pool and a
trainer pool (``cpus_per_engine``, ``cpus_per_trainer_rank`` per bundle), one placement group each. A PPO critic
rank sits on its trainer rank's bundle with no CPUs. ``engine_resources`` / ``trainer_resources`` pin a pool to
the nodes that offer them. ``device=cuda`` adds a GPU per bundle (engine / rank hold 0.4 / 0.3 of it colocated,
1 / 0.5 disaggregated); untested on a GPU.

**Threads** (``OMP_NUM_THREADS``, ``torch.set_num_threads``): the actors that can compute at once never ask for
more threads than there are cores: ``max(1, (cores - 1 - reward workers) // (num_engines + trainer_world_size))``
(``cores``: ``os.sched_getaffinity``, or ``cluster.num_cpus`` when lower; ``1``: the driver). Engines and ranks
count together under colocate too (the async schedules and a releasing engine compute while ranks train);
critics take turns with their ranks. A disaggregated actor gets at most its bundle's CPUs; on a joined cluster
(``cluster.address``) each actor gets its share of its bundle. ``placement.torch_threads_per_actor`` > 0 wins.

**Rendezvous.** The trainer ranks (and, apart, the critic ranks) meet at a store the driver opens when it
creates them, on 127.0.0.1, or on a joined cluster at the driver's node (:func:`miles.core.cluster.rendezvous`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.config import ConfigError, MilesConfig, check_allowed, locate
from miles.config.draft import speculation_on
from miles.config.schema import PlacementConfig
from miles.config.teacher import teacher_models
from miles.machine import Machine, resolve_device
from miles.train.megatron.dims import ParallelDims

_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
# placement keys only one mode reads: setting them in the other mode is a mistake
_ONLY_FOR = {"cpus_per_bundle": "colocate", "cpus_per_engine": "disaggregated", "cpus_per_trainer_rank": "disaggregated"}
HINT = {"colocate": "placement.cpus_per_bundle, placement.num_engines or placement.trainer_world_size",
        "disaggregated": "placement.cpus_per_engine, placement.cpus_per_trainer_rank, placement.num_engines "
                         "or placement.trainer_world_size"}  # the keys that size a placement's request


@dataclass(frozen=True)
class Pool:
    """``num_bundles`` identical bundles of one placement group."""

    name: str  # shared (colocate), engine or trainer (disaggregated)
    num_bundles: int
    cpus_per_bundle: float
    resources: Mapping[str, float]  # custom Ray resources per bundle
    gpus_per_bundle: int = 0

    def bundle(self) -> dict[str, float]:
        gpus = {"GPU": float(self.gpus_per_bundle)} if self.gpus_per_bundle else {}
        return {"CPU": self.cpus_per_bundle, **gpus, **self.resources}

    @property
    def cpus(self) -> float:
        return self.num_bundles * self.cpus_per_bundle

    def describe(self) -> str:
        """E.g. ``2 bundle(s) x 1 CPU (+ node2: 1 per bundle) = 2 CPU``."""
        extra = ", ".join(f"{k}: {v:g}" for k, v in self.bundle().items() if k != "CPU")
        extra = f" (+ {extra} per bundle)" if extra else ""
        return f"{self.num_bundles} bundle(s) x {self.cpus_per_bundle:g} CPU{extra} = {self.cpus:g} CPU"


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One actor: its bundle, what it holds of it, and its process's threads and environment."""

    role: str  # engine, trainer or critic
    index: int  # engine id, or rank in its group
    pool: int  # index of its pool in Plan.pools (and of its placement group)
    bundle: int
    cpus: float  # Ray CPUs it holds on its bundle
    gpus: float
    threads: int
    env: Mapping[str, str]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every actor of a job and how it is placed (see the module docstring for the rules)."""

    placement: str  # colocate or disaggregated
    device: str  # cpu or cuda (placement.device=auto resolved)
    joined: bool  # on a joined cluster (cluster.address)
    pools: tuple[Pool, ...]
    engines: tuple[Slot, ...]
    trainers: tuple[Slot, ...]
    critics: tuple[Slot, ...]
    """Critic ranks (``algo.estimator: gae``), a group of their own; empty otherwise."""
    layout: ParallelDims
    """The trainer ranks' parallel sizes (``trainer.*`` over ``trainer_world_size``)."""
    engine_class: str
    trainer_class: str
    critic_class: str | None
    offload: bool
    """colocate: the engines release their memory while the trainer trains."""
    engine_kwargs: Mapping[str, Any]
    """What every engine is constructed with besides the driver's arguments (:func:`engine_kwargs`)."""
    rank_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """What every trainer rank is constructed with besides the driver's arguments (tenants' adapter names)."""
    teachers: tuple[Slot, ...] = ()
    """On-policy distillation's teacher engines, of :attr:`engine_class`: ``teacher.num_engines`` for each of
    :attr:`teacher_names`, in that order; empty: none."""
    teacher_names: tuple[str, ...] = ()
    """The teachers (:func:`miles.config.teacher.teacher_models`): ``teacher``, or one per tenant, named after it."""
    teacher_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """What every teacher engine is constructed with besides the driver's arguments: ``rollout.engine``'s
    keys, without the policy's own (prefix cache, routing capture, adapters, draft)."""
    teacher_checkpoints: Mapping[str, str] = field(default_factory=dict)
    """Each teacher's checkpoint directory by name, set once they are built (:func:`miles.core.run.run_job`)."""
    draft_trainer: tuple[Slot, ...] = ()
    """``draft.online``: the actor that trains the draft (:class:`miles.train.draft.DraftTrainer`), on trainer
    rank 0's bundle with no CPUs of its own (it trains while the ranks do); empty: none."""
    cores: int = 1
    """The cores the threads are shared out of (local cluster), or the bundles' CPUs (joined)."""
    reserved: int = 0
    """Threads of the driver and its reward workers, counted against :attr:`cores` (local cluster)."""
    ready_timeout_s: float = 60.0  # how long the placement groups may take to be placed

    @property
    def engine_memory(self) -> str:
        """What the engines do with their memory while the trainer trains, in words."""
        kept = "release" if self.offload else "keep"
        return f"{kept} their memory while the trainer trains" if self.placement == "colocate" else "have bundles of their own"

    def teacher_name(self, index: int) -> str:
        """The teacher (of :attr:`teacher_names`) that teacher engine ``index`` serves."""
        return self.teacher_names[index // (len(self.teachers) // len(self.teacher_names))]

    def key(self) -> str:
        """What fixes the actors' processes: classes, bundles, resources, threads and environment. Jobs
        with the same key can run on the same actors (:mod:`miles.core.actors` reuses them)."""
        fields = ("placement", "device", "joined", "pools", "engines", "trainers", "critics", "teachers",
                  "draft_trainer", "engine_class", "trainer_class", "critic_class", "offload")
        return json.dumps({k: v for k, v in asdict(self).items() if k in fields}, sort_keys=True, default=str)

    def engine_key(self) -> str | None:
        """Disaggregated only: what fixes the engines and their pool of their own. A job whose :meth:`key`
        differs only in its trainer side (another trainer class, world size, critics) can keep the
        engines, and an SGLang engine its server (:mod:`miles.core.actors`)."""
        if self.placement != "disaggregated":
            return None
        pool = self.pools[self.engines[0].pool]
        return json.dumps({"device": self.device, "joined": self.joined, "pool": asdict(pool),
                           "engines": [asdict(s) for s in self.engines], "engine_class": self.engine_class},
                          sort_keys=True, default=str)

    def describe(self) -> str:
        """The plan as text (``python -m miles --plan``)."""
        cluster = "a joined Ray cluster" if self.joined else f"a local Ray cluster ({self.cores} core(s) for threads)"
        lines = [f"placement {self.placement} on {self.device}, {cluster}", "pools:"]
        lines += [f"  {i}: {p.name} pool, {p.describe()}" for i, p in enumerate(self.pools)]
        lines.append(f"engines: {len(self.engines)} x {self.engine_class}, which {self.engine_memory}")
        lines += self._slots(self.engines)
        meet = "the driver's node" if self.joined else "127.0.0.1"
        lines.append(f"trainer: {len(self.trainers)} rank(s) x {self.trainer_class}, {self.layout.describe()}; "
                     f"the group meets at a store the driver opens on {meet}")
        lines += self._slots(self.trainers)
        if self.critics:
            lines.append(f"critic: {len(self.critics)} rank(s) x {self.critic_class}, a group of its own")
            lines += self._slots(self.critics)
        if self.teachers:
            where = ("on the engines' bundles, no CPUs of their own" if self.teachers[0].pool == self.engines[0].pool
                     else "a pool of their own")
            lines.append(f"teacher: {len(self.teachers)} engine(s) x {self.engine_class}, {where}"
                         + (f"; {len(self.teachers) // len(self.teacher_names)} for each of the tenants' teachers "
                            f"({', '.join(self.teacher_names)})" if self.teacher_names != ("teacher",) else ""))
            lines += self._slots(self.teachers)
        if self.draft_trainer:
            lines.append("draft trainer (draft.online): miles.train.draft.DraftTrainer, on trainer rank 0's bundle, "
                         "no CPUs of its own")
            lines += self._slots(self.draft_trainer)
        if not self.joined:
            busy = sum(s.threads for s in self.engines + self.trainers)
            lines.append(f"threads: {busy} for the engines and trainer ranks + {self.reserved} for the driver and its "
                         f"reward workers, on {self.cores} core(s) (at least 1 per actor)")
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.engine_kwargs.items()))
        lines.append(f"engine arguments: {args or '(none)'}")
        if self.rank_kwargs:
            lines.append("trainer arguments: " + ", ".join(f"{k}={v!r}" for k, v in sorted(self.rank_kwargs.items())))
        return "\n".join(lines)

    def _slots(self, slots: tuple[Slot, ...]) -> list[str]:
        who = {"engine": "engine", "trainer": "rank", "critic": "critic rank", "teacher": "teacher engine",
               "draft_trainer": "draft trainer"}
        return [f"  {who[s.role]} {s.index}: {self.pools[s.pool].name} bundle {s.bundle}, {s.cpus:g} CPU"
                + (f", {s.gpus:g} GPU" if s.gpus else "") + f", {s.threads} thread(s); "
                + " ".join(f"{k}={v}" for k, v in s.env.items()) for s in slots]


def actor_env(threads: int, huge_pages: bool) -> dict[str, str]:
    """Environment of an engine or trainer process: its thread count, and torch's huge-page switch
    (``placement.huge_pages``; torch reads ``THP_MEM_ALLOC_ENABLE`` once, at the process's first allocation).
    On the 19M Qwen3 on CPU it re-allocated an engine's 800 MB KV cache after a release in 0.11-0.16 s, not 0.35 s."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if huge_pages:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return env


def make_plan(run: MilesConfig, machine: Machine) -> Plan:
    """The plan of ``run`` on ``machine``; :class:`ConfigError` for a placement that cannot be.

    Checks, before anything starts: the placement keys, that the pools fit a cluster miles starts here
    (CPUs, CUDA devices, no custom resources), and the engine / trainer / critic classes
    (:func:`backends`: the allowlist, their Protocols, and each class's own ``check_config``, e.g. the
    Megatron trainer's parallel layout against the model).
    """
    p, joined = run.placement, bool(run.cluster.address)
    check_placement(p)
    device = resolve_device(p.device, joined, machine)
    gpu = 1 if device == "cuda" else 0
    engine_res = {k: float(v) for k, v in (p.engine_resources or {}).items()}
    trainer_res = {k: float(v) for k, v in (p.trainer_resources or {}).items()}
    if p.name == "colocate":  # a shared bundle hosts an engine and a trainer rank: it needs both
        both = {k: engine_res.get(k, 0.0) + trainer_res.get(k, 0.0) for k in engine_res | trainer_res}
        pools = (Pool("shared", max(p.num_engines, p.trainer_world_size), p.cpus_per_bundle, both, gpu),)
        engine_cpus = trainer_cpus = p.cpus_per_bundle / 2
        engine_gpus, trainer_gpus = (0.4, 0.3) if gpu else (0, 0)
    else:
        pools = (Pool("engine", p.num_engines, p.cpus_per_engine, engine_res, gpu),
                 Pool("trainer", p.trainer_world_size, p.cpus_per_trainer_rank, trainer_res, gpu))
        engine_cpus, trainer_cpus = p.cpus_per_engine, p.cpus_per_trainer_rank
        engine_gpus, trainer_gpus = (1.0, 0.5) if gpu else (0, 0)
    engine_pool, trainer_pool = 0, len(pools) - 1
    tc, teacher_names = run.teacher, tuple(n for n, _ in teacher_models(run))
    n_teachers = tc.num_engines * len(teacher_names)
    if teacher_names and tc.placement == "own":
        pools = (*pools, Pool("teacher", n_teachers, tc.cpus_per_engine, engine_res, gpu))
    if not joined:
        _check_fits(run, pools, machine)
    classes = backends(run)
    tasks = [t.task for t in run.tenants] or [run.task]  # each reward runner's workers score at once
    reserved = 1 + sum(t.reward_num_workers for t in tasks if t.reward_timeout_s > 0)
    cores = min(run.cluster.num_cpus or machine.cpus, machine.cpus)
    engine_threads = _threads(p, joined, engine_cpus, cores, reserved)
    trainer_threads = _threads(p, joined, trainer_cpus, cores, reserved)

    def slots(role: str, n: int, pool: int, cpus: float, gpus: float, threads: int) -> tuple[Slot, ...]:
        env = actor_env(threads, p.huge_pages)
        return tuple(Slot(role=role, index=i, pool=pool, bundle=i % pools[pool].num_bundles, cpus=cpus, gpus=gpus,
                          threads=threads, env=env) for i in range(n))

    w, t = p.trainer_world_size, run.trainer
    return Plan(
        placement=p.name, device=device, joined=joined, pools=pools,
        engines=slots("engine", p.num_engines, engine_pool, engine_cpus, engine_gpus, engine_threads),
        trainers=slots("trainer", w, trainer_pool, trainer_cpus, trainer_gpus, trainer_threads),
        # the bundle's CPUs are held by its engine and rank already: the critic takes turns with them
        critics=slots("critic", w, trainer_pool, 0, trainer_gpus, trainer_threads) if classes.critic else (),
        layout=ParallelDims(world_size=w, tp=t.tensor_parallel, pp=t.pipeline_parallel, ep=t.expert_parallel),
        engine_class=run.rollout.engine.target, trainer_class=run.trainer.target,
        critic_class=run.algo.critic.target if classes.critic else None, offload=classes.offload,
        engine_kwargs=classes.engine_kwargs,
        rank_kwargs={"adapter_names": tuple(t.name for t in run.tenants)} if run.tenants else {},
        # colocated: on the engines' bundles with no CPUs of their own; they score between rollouts
        teachers=(() if not teacher_names else
                  slots("teacher", n_teachers, engine_pool, 0, 0, engine_threads) if tc.placement == "colocate"
                  else slots("teacher", n_teachers, len(pools) - 1, tc.cpus_per_engine, engine_gpus, engine_threads)),
        teacher_names=teacher_names,
        teacher_kwargs=teacher_kwargs(run) if teacher_names else {},
        draft_trainer=slots("draft_trainer", 1, trainer_pool, 0, 0, trainer_threads)
        if speculation_on(run) and run.draft.online else (),
        cores=cores if not joined else int(sum(pool.cpus for pool in pools)),
        reserved=reserved if not joined else 0, ready_timeout_s=p.ready_timeout_s,
    )


def _threads(p: PlacementConfig, joined: bool, cpus_held: float, cores: int, reserved: int) -> int:
    """torch threads of one engine or trainer rank (the rule is in the module docstring)."""
    if p.torch_threads_per_actor:
        return p.torch_threads_per_actor
    if joined:
        return max(1, math.floor(cpus_held))
    share = (cores - reserved) // (p.num_engines + p.trainer_world_size)
    if p.name == "disaggregated":
        share = min(share, math.floor(cpus_held))
    return max(1, share)


def describe_request(name: str, pools: tuple[Pool, ...]) -> str:
    if len(pools) == 1:
        return f"placement '{name}' asks for {pools[0].describe()}"
    total = sum(pool.cpus for pool in pools)
    parts = " + ".join(f"{pool.name} pool {pool.describe()}" for pool in pools)
    return f"placement '{name}' asks for {parts} = {total:g} CPU in all"


def _check_fits(run: MilesConfig, pools: tuple[Pool, ...], machine: Machine) -> None:
    """A cluster miles starts here holds the pools: CPUs only, as many CPUs and CUDA devices as it has."""
    name = run.placement.name
    custom = sorted({k for pool in pools for k in pool.resources})
    if custom:
        raise ConfigError(
            f"{describe_request(name, pools)}, which needs custom Ray resource(s) {', '.join(custom)}, but a local "
            "Ray cluster started by miles has CPUs only. Join a cluster whose nodes offer them "
            "(cluster.address=HOST:PORT), or clear placement.engine_resources / trainer_resources.")
    need_gpus = sum(pool.num_bundles * pool.gpus_per_bundle for pool in pools)
    if need_gpus > machine.cuda_devices:
        raise ConfigError(
            f"{describe_request(name, pools)}, but this machine has {machine.cuda_devices} CUDA device(s). "
            f"Set placement.device=cpu, lower {HINT[name]}, or join a cluster with GPUs.")
    have = run.cluster.num_cpus or machine.cpus
    if sum(pool.cpus for pool in pools) > have:
        raise ConfigError(
            f"{describe_request(name, pools)}, but the local Ray cluster has {have} CPU (cluster.num_cpus). "
            f"Lower {HINT[name]}, or join a bigger cluster (cluster.address).")


def _check_resources(key: str, resources: Mapping[str, float] | None) -> None:
    for name, amount in (resources or {}).items():
        if name in _BUILTIN_RESOURCES:
            raise ConfigError(f"{key}.{name}: CPUs and memory are sized by the cpus_* keys; list only custom "
                              f"Ray resources here (those a node was started with, e.g. --resources='{{\"node2\": 1}}')")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
            raise ConfigError(f"{key}.{name}: expected a positive number, found {amount!r}")


def check_placement(p: PlacementConfig) -> None:
    """Values the schema cannot rule out: non-positive CPUs, keys of the other mode, bad resources."""
    defaults = PlacementConfig()
    for key, mode in _ONLY_FOR.items():
        if mode != p.name and getattr(p, key) != getattr(defaults, key):
            raise ConfigError(f"placement.{key} applies to placement={mode} only, but placement.name is "
                              f"'{p.name}'. Size its bundles with {HINT[p.name]}.")
    for key in (k for k, mode in _ONLY_FOR.items() if mode == p.name):
        if not getattr(p, key) > 0:
            raise ConfigError(f"placement.{key}: must be > 0 CPUs, found {getattr(p, key)}")
    if p.torch_threads_per_actor < 0:
        raise ConfigError(f"placement.torch_threads_per_actor: must be >= 0 (0: automatic), found {p.torch_threads_per_actor}")
    if not p.ready_timeout_s > 0:
        raise ConfigError(f"placement.ready_timeout_s: must be > 0 seconds, found {p.ready_timeout_s}")
    _check_resources("placement.engine_resources", p.engine_resources)
    _check_resources("placement.trainer_resources", p.trainer_resources)


# ---- the classes ----------------------------------------------------------------------------------

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
    from miles.backends import contract

    node, allow = run.rollout.engine, run.plugins.allow
    for key, target in (("rollout.engine._target_", node.target), ("trainer._target_", run.trainer.target),
                        ("algo.critic._target_", run.algo.critic.target)):
        check_allowed(target, allow, key=key)
    engine = locate(node.target)
    p = run.placement
    offload = p.name == "colocate" and (contract.can_offload(engine) if p.offload_engines is None else p.offload_engines)
    kwargs = engine_kwargs(run)
    contract.check_engine_class(engine, kwargs=kwargs, offload=offload, run=run)
    trainer = locate(run.trainer.target)
    contract.check_trainer_class(trainer, run)
    if teacher_models(run) and not callable(getattr(engine, "score", None)):
        raise ConfigError(f"teacher.model: the teacher is served by rollout.engine's class {node.target}, which has "
                          "no score() (per-token log-probs of given sequences); use rollout=torch or rollout=sglang")
    critic = None
    if run.algo.estimator == "gae":
        critic = locate(run.algo.critic.target)
        contract.check_critic_class(critic)
    return Backends(engine=engine, engine_kwargs=kwargs, trainer=trainer, critic=critic, offload=offload)


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


def teacher_kwargs(run: MilesConfig) -> dict[str, Any]:
    """The teacher engines' keyword arguments: ``rollout.engine``'s node without the keys that serve the
    policy's own rollouts (a session prefix cache, MoE routing capture); no adapters and no draft."""
    return {k: v for k, v in run.rollout.engine.kwargs.items() if k not in ("prefix_cache_tokens", "capture_routing")}
