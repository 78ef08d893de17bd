"""Ray: start or join the cluster, size the placement's pools, reserve placement groups, count threads.

Every long-lived process is a Ray actor, placed on a bundle of a placement group
(:mod:`miles.core.actors` creates them there).

``placement=colocate``: one placement group of ``max(num_engines, trainer_world_size)`` shared
bundles of ``cpus_per_bundle`` CPUs; engine ``i`` and trainer rank ``i`` sit on bundle ``i``, each
holding half of it. They take turns (rollout, then train), so each actor may use the CPUs of all
the actors that are idle meanwhile for torch threads, and the engines can release their memory
while the trainer trains (:meth:`miles.core.actors.Actors.offload_engines`).

``placement=disaggregated``: two pools, one placement group each: ``num_engines`` bundles of
``cpus_per_engine`` and ``trainer_world_size`` bundles of ``cpus_per_trainer_rank``. Engines and
trainer ranks run at the same time, so each actor's threads come from its own bundle. One group per
pool rather than one group with typed bundles: each pool is placed (and, when it cannot be, reported)
on its own, and a pool can later be resized or replaced (engine restarts) without releasing the
other. The cost is that the two reservations are not atomic; a timeout releases both.

Custom Ray resources (``engine_resources``, ``trainer_resources``, e.g. ``{node2: 1}``) pin a pool
to the nodes that offer them.

``placement.device=cuda`` (or ``auto`` on a cluster with GPUs) adds one GPU to every bundle: a
colocated engine and trainer rank share their bundle's GPU, a disaggregated engine or trainer rank
has its bundle's GPU to itself (the PPO critic shares its trainer rank's). The GPU path has not run
on a GPU yet (see the README).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.config import ConfigError, MilesConfig
from miles.config.schema import PlacementConfig

log = logging.getLogger(__name__)

_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# placement keys that only one mode reads: setting them in the other mode is a mistake
_ONLY_FOR = {"cpus_per_bundle": "colocate", "cpus_per_engine": "disaggregated", "cpus_per_trainer_rank": "disaggregated"}
_HINT = {
    "colocate": "placement.cpus_per_bundle, placement.num_engines or placement.trainer_world_size",
    "disaggregated": "placement.cpus_per_engine, placement.cpus_per_trainer_rank, placement.num_engines "
                     "or placement.trainer_world_size",
}


_KEPT: tuple[str | None, int | None] | None = None
"""(address, num_cpus) of the Ray cluster miles started and keeps for later jobs (``keep``), else None."""


def start_ray(run: MilesConfig, *, keep: bool = False) -> bool:
    """Start a local Ray cluster (dashboard off) or join ``cluster.address``. Returns True if we started it.

    A cluster that is already up is used as it is, except one that miles itself kept from an earlier
    job (``keep``) with other ``cluster.*`` settings: that one is stopped and this job's started.
    ``keep``: the caller leaves the cluster up after the job; :func:`stop_ray` stops it, as does Ray's
    own exit handler when the process ends.
    """
    global _KEPT
    want = (run.cluster.address, run.cluster.num_cpus)
    if ray.is_initialized() and _KEPT is not None and _KEPT != want:
        log.info("stopping the Ray cluster kept from the last job: this job sets other cluster.* values")
        stop_ray()
    if ray.is_initialized():
        return False
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if run.cluster.address:
        ray.init(address=run.cluster.address, runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        ray.init(
            num_cpus=run.cluster.num_cpus or os.cpu_count(),
            include_dashboard=False,
            runtime_env={"env_vars": env},
            logging_level=logging.WARNING,
        )
    if keep:
        _KEPT = want
    return True


def stop_ray() -> None:
    """Shut down the actors kept for the next job, and the Ray cluster miles kept (if it did)."""
    from miles.core.actors import release_parked  # actors builds on this module

    global _KEPT
    release_parked()
    if _KEPT is not None and ray.is_initialized():
        ray.shutdown()
    _KEPT = None


def actor_env(p: PlacementConfig, threads: int) -> dict[str, str]:
    """Environment of an engine or trainer actor: its thread count, and torch's huge-page switch.

    ``THP_MEM_ALLOC_ENABLE`` is read once per process, at torch's first allocation, so it can only
    be set at process start. With it, torch page-aligns CPU tensors of 2 MiB or more and advises them
    onto transparent huge pages (the kernel decides: ``/sys/kernel/mm/transparent_hugepage``).
    On the 19M Qwen3 on CPU, re-allocating an engine's 800 MB KV cache after a release took 0.11-0.16 s
    against 0.35 s, and a 128-row rollout about 5% less time.
    """
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if p.huge_pages:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return env


RENDEZVOUS_PORTS = (30000, 32768)
"""Where :func:`free_port` looks first: below the kernel's ephemeral range (32768+ by default), so that
no outgoing connection (Ray opens many) or ``bind(0)`` takes the port between picking it and the
process group's store binding it; above Ray's worker ports (10002-19999) and the ports SGLang picks
(below 30000)."""


def free_port(host: str = "127.0.0.1", attempts: int = 64, ports: tuple[int, int] | None = None) -> int:
    """A port ``host`` can bind now: one of ``attempts`` random ports in ``ports`` (default
    :data:`RENDEZVOUS_PORTS`), else (all tried ones taken) any free port the kernel gives."""
    lo, hi = ports or RENDEZVOUS_PORTS
    for port in random.sample(range(lo, hi), min(attempts, hi - lo)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_rendezvous() -> tuple[str, int]:
    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)


def rendezvous(run: MilesConfig, pg: PlacementGroup) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT of the trainer group: the node that holds trainer rank 0's bundle.

    A local cluster is this machine (loopback). On a joined cluster a zero-CPU task on bundle 0 reads
    that node's address and a free port there, so the ranks can meet across nodes.
    """
    if not run.cluster.address:
        return "127.0.0.1", free_port()
    probe = ray.remote(num_cpus=0)(_node_rendezvous).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    )
    return ray.get(probe.remote(), timeout=run.placement.ready_timeout_s)


# ---- what the placement asks for ----------------------------------------------------------------

@dataclass(frozen=True)
class Pool:
    """``num_bundles`` identical bundles of one placement group."""

    name: str
    """``shared`` (colocate), ``engine`` or ``trainer`` (disaggregated)."""
    num_bundles: int
    cpus_per_bundle: float
    resources: Mapping[str, float]
    """Custom Ray resources per bundle."""
    gpus_per_bundle: int = 0
    """1 with ``placement.device=cuda``, else 0."""

    def bundle(self) -> dict[str, float]:
        gpus = {"GPU": float(self.gpus_per_bundle)} if self.gpus_per_bundle else {}
        return {"CPU": self.cpus_per_bundle, **gpus, **self.resources}

    @property
    def cpus(self) -> float:
        return self.num_bundles * self.cpus_per_bundle

    def describe(self) -> str:
        """E.g. ``2 bundle(s) x 1 CPU (+ node2: 1 per bundle) = 2 CPU``."""
        extra = ", ".join(f"{k}: {v:g}" for k, v in ({"GPU": self.gpus_per_bundle} if self.gpus_per_bundle else {}
                                                      | dict(self.resources)).items())
        extra = f" (+ {extra} per bundle)" if extra else ""
        return f"{self.num_bundles} bundle(s) x {self.cpus_per_bundle:g} CPU{extra} = {self.cpus:g} CPU"


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
                              f"'{p.name}'. Size its bundles with {_HINT[p.name]}.")
    for key in (k for k, mode in _ONLY_FOR.items() if mode == p.name):
        if not getattr(p, key) > 0:
            raise ConfigError(f"placement.{key}: must be > 0 CPUs, found {getattr(p, key)}")
    if p.torch_threads_per_actor < 0:
        raise ConfigError(f"placement.torch_threads_per_actor: must be >= 0 (0: automatic), found {p.torch_threads_per_actor}")
    if not p.ready_timeout_s > 0:
        raise ConfigError(f"placement.ready_timeout_s: must be > 0 seconds, found {p.ready_timeout_s}")
    _check_resources("placement.engine_resources", p.engine_resources)
    _check_resources("placement.trainer_resources", p.trainer_resources)


def device(run: MilesConfig) -> str:
    """``cpu`` or ``cuda``: ``placement.device``, with ``auto`` resolved.

    ``auto`` is ``cuda`` when the Ray cluster offers GPUs (before Ray starts: when this machine has a
    CUDA device and no cluster is joined), else ``cpu``.
    """
    d = run.placement.device
    if d != "auto":
        return d
    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if not run.cluster.address and torch.cuda.is_available() else "cpu"


def placement_pools(run: MilesConfig) -> list[Pool]:
    """The pools ``run``'s placement asks for: one shared pool (colocate) or engine + trainer pools."""
    p = run.placement
    check_placement(p)
    gpus = 1 if device(run) == "cuda" else 0
    engine_res = {k: float(v) for k, v in (p.engine_resources or {}).items()}
    trainer_res = {k: float(v) for k, v in (p.trainer_resources or {}).items()}
    if p.name == "colocate":  # a shared bundle hosts an engine and a trainer rank: it needs both
        both = {k: engine_res.get(k, 0.0) + trainer_res.get(k, 0.0) for k in engine_res | trainer_res}
        return [Pool("shared", max(p.num_engines, p.trainer_world_size), p.cpus_per_bundle, both, gpus)]
    return [Pool("engine", p.num_engines, p.cpus_per_engine, engine_res, gpus),
            Pool("trainer", p.trainer_world_size, p.cpus_per_trainer_rank, trainer_res, gpus)]


def describe_request(name: str, pools: list[Pool]) -> str:
    if len(pools) == 1:
        return f"placement '{name}' asks for {pools[0].describe()}"
    total = sum(pool.cpus for pool in pools)
    parts = " + ".join(f"{pool.name} pool {pool.describe()}" for pool in pools)
    return f"placement '{name}' asks for {parts} = {total:g} CPU in all"


def check_fits_locally(run: MilesConfig) -> None:
    """For a cluster we start ourselves, fail before any work if the placement cannot fit in it."""
    pools = placement_pools(run)  # also checks the placement keys, for joined clusters too
    if run.cluster.address:
        return  # a joined cluster may grow; reserve() waits ready_timeout_s for it
    custom = sorted({k for pool in pools for k in pool.resources})
    if custom:
        raise ConfigError(
            f"{describe_request(run.placement.name, pools)}, which needs custom Ray resource(s) "
            f"{', '.join(custom)}, but a local Ray cluster started by miles has CPUs only. Join a cluster whose "
            "nodes offer them (cluster.address=HOST:PORT), or clear placement.engine_resources / trainer_resources."
        )
    need_gpus = sum(pool.num_bundles * pool.gpus_per_bundle for pool in pools)
    if need_gpus:
        import torch

        have_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if need_gpus > have_gpus:
            raise ConfigError(
                f"{describe_request(run.placement.name, pools)}, but this machine has {have_gpus} CUDA device(s). "
                f"Set placement.device=cpu, lower {_HINT[run.placement.name]}, or join a cluster with GPUs.")
    have = run.cluster.num_cpus or os.cpu_count() or 1
    need = sum(pool.cpus for pool in pools)
    if need > have:
        raise ConfigError(
            f"{describe_request(run.placement.name, pools)}, but the local Ray cluster has {have} CPU "
            f"(cluster.num_cpus). Lower {_HINT[run.placement.name]}, or join a bigger cluster (cluster.address)."
        )


# ---- reserving ------------------------------------------------------------------------------------

def reserve(run: MilesConfig) -> list[PlacementGroup]:
    """One placement group per pool (see :func:`placement_pools`), in order; fail within the timeout.

    If any pool is not placed after ``placement.ready_timeout_s``, every group is released and a
    :class:`ConfigError` says what each pool asked for, which were not placed, and what the cluster has.
    """
    p = run.placement
    pools = placement_pools(run)
    groups = [placement_group([pool.bundle() for _ in range(pool.num_bundles)], strategy="PACK") for pool in pools]
    ready = [g.ready() for g in groups]
    done, _ = ray.wait(ready, num_returns=len(ready), timeout=p.ready_timeout_s)
    if len(done) == len(ready):
        return groups
    placed = {i for i, r in enumerate(ready) if r in done}
    for g in groups:
        remove_placement_group(g)
    time.sleep(0.2)  # let the released bundles show up as available again
    avail, total = ray.available_resources(), ray.cluster_resources()
    have = f"{avail.get('CPU', 0.0):g} of {total.get('CPU', 0.0):g} CPU"
    for k in sorted({k for pool in pools for k in pool.resources}):
        have += f", {avail.get(k, 0.0):g} of {total.get(k, 0.0):g} {k}"
    if len(pools) == 1:
        asked = f"{pools[0].describe()}"
        missing = ""
    else:
        asked = " + ".join(f"{pool.name} pool {pool.describe()}" for pool in pools)
        missing = "; not placed: " + ", ".join(f"{pool.name} pool" for i, pool in enumerate(pools) if i not in placed)
    raise ConfigError(
        f"placement '{p.name}' asked for {asked}, but the cluster has {have} available "
        f"(waited {p.ready_timeout_s:g} s{missing}). Lower {_HINT[p.name]}, or add nodes"
        + (" that offer the custom resources." if any(pool.resources for pool in pools) else ".")
    )


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """Node id of each bundle of a ready placement group, in bundle order."""
    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in sorted(table)]


# ---- threads ------------------------------------------------------------------------------------

def auto_threads(run: MilesConfig, num_bundles: int) -> int:
    """colocate: torch threads per actor = the CPUs available / the actors busy at once.

    Colocated engines and trainer ranks take turns, so at most max(engines, ranks) actors compute at
    once. On a local cluster they may use the whole machine; on a joined cluster, their bundles.
    """
    p = run.placement
    busy = max(p.num_engines, p.trainer_world_size)
    cpus = (run.cluster.num_cpus or os.cpu_count() or 1) if not run.cluster.address else p.cpus_per_bundle * num_bundles
    return max(1, math.floor(cpus / busy))


def threads_per_actor(run: MilesConfig) -> tuple[int, int]:
    """(engine, trainer rank) torch threads.

    ``placement.torch_threads_per_actor`` wins when set. Otherwise colocate shares the CPUs among the
    actors busy at once (:func:`auto_threads`); disaggregated engines and ranks compute at the same
    time, so each gets the whole CPUs of its own bundle (at least 1).
    """
    p = run.placement
    if p.torch_threads_per_actor:
        return p.torch_threads_per_actor, p.torch_threads_per_actor
    if p.name == "colocate":
        n = auto_threads(run, max(p.num_engines, p.trainer_world_size))
        return n, n
    return max(1, math.floor(p.cpus_per_engine)), max(1, math.floor(p.cpus_per_trainer_rank))
