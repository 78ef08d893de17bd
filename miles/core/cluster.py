"""Ray: start or join the cluster, reserve a placement group, create engine and trainer actors.

Every long-lived process is a Ray actor. ``placement=colocate`` puts one
engine and one trainer rank on each bundle; they take turns (rollout, then
train), so each actor may use all of its bundle's CPUs for torch threads.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.config import ConfigError, MilesConfig, check_allowed, locate

log = logging.getLogger(__name__)

TRAINER_BACKENDS = {"fsdp": "miles.train.fsdp.FSDPTrainer"}


def start_ray(run: MilesConfig) -> bool:
    """Start a local Ray cluster (dashboard off) or join ``cluster.address``. Returns True if we started it."""
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
    return True


def free_port(host: str = "127.0.0.1") -> int:
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


@dataclass
class Actors:
    """Handles to everything the loop talks to."""

    engines: list[Any]
    trainers: list[Any]
    placement: PlacementGroup
    num_threads: int

    def shutdown(self) -> None:
        try:
            ray.get([t.shutdown.remote() for t in self.trainers], timeout=60)
        except Exception as e:  # a dead rank must not keep the driver from exiting
            log.warning("trainer shutdown failed: %s", e)
        for a in self.engines + self.trainers:
            ray.kill(a)
        remove_placement_group(self.placement)


def placement_request(run: MilesConfig) -> tuple[int, float]:
    """(bundles, CPUs per bundle) that ``run``'s placement asks for."""
    p = run.placement
    return max(p.num_engines, p.trainer_world_size), p.cpus_per_bundle


def check_fits_locally(run: MilesConfig) -> None:
    """For a cluster we start ourselves, fail before any work if the placement cannot fit in it."""
    if run.cluster.address:
        return  # a joined cluster may grow; reserve() waits ready_timeout_s for it
    n, cpus = placement_request(run)
    have = run.cluster.num_cpus or os.cpu_count() or 1
    if n * cpus > have:
        raise ConfigError(
            f"placement '{run.placement.name}' asks for {n} bundle(s) x {cpus:g} CPU = {n * cpus:g} CPU, but the "
            f"local Ray cluster has {have} CPU (cluster.num_cpus). Lower placement.cpus_per_bundle, "
            "placement.num_engines or placement.trainer_world_size, or join a bigger cluster (cluster.address)."
        )


def reserve(run: MilesConfig) -> PlacementGroup:
    """A placement group with one bundle per engine/trainer slot; fail within the timeout if it cannot fit."""
    p = run.placement
    num_bundles, cpus = placement_request(run)
    bundles = [{"CPU": cpus} for _ in range(num_bundles)]
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=p.ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        avail = ray.available_resources().get("CPU", 0.0)
        total = ray.cluster_resources().get("CPU", 0.0)
        raise ConfigError(
            f"placement '{p.name}' asked for {num_bundles} bundle(s) x {p.cpus_per_bundle:g} CPU "
            f"= {num_bundles * p.cpus_per_bundle:g} CPU, but the cluster has {avail:g} of {total:g} CPU "
            f"available (waited {p.ready_timeout_s:g} s). Lower placement.cpus_per_bundle, "
            "placement.num_engines or placement.trainer_world_size, or add nodes."
        ) from None
    return pg


def auto_threads(run: MilesConfig, num_bundles: int) -> int:
    """torch threads per actor: the CPUs available / the actors busy at once.

    Colocated engines and trainer ranks take turns, so at most max(engines, ranks) actors compute at
    once. On a local cluster they may use the whole machine; on a joined cluster, their bundles.
    """
    p = run.placement
    busy = max(p.num_engines, p.trainer_world_size)
    cpus = (run.cluster.num_cpus or os.cpu_count() or 1) if not run.cluster.address else p.cpus_per_bundle * num_bundles
    return max(1, math.floor(cpus / busy))


def create_actors(run: MilesConfig, checkpoint_dir: str) -> Actors:
    """Engines and trainer ranks on the placement group's bundles."""
    p = run.placement
    pg = reserve(run)
    num_bundles = len(pg.bundle_specs)
    threads = p.torch_threads_per_actor or auto_threads(run, num_bundles)
    # colocated: an engine and a trainer share a bundle, each holding half of it
    cpus_per_actor = p.cpus_per_bundle / 2

    def on_bundle(i: int) -> dict[str, Any]:
        return dict(
            num_cpus=cpus_per_actor,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i % num_bundles),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}},
        )

    allow = run.plugins.allow
    check_allowed(run.rollout.engine, allow, key="rollout.engine")
    engine_cls = ray.remote(locate(run.rollout.engine))
    engines = [
        engine_cls.options(**on_bundle(i)).remote(
            checkpoint_dir, run.precision, seed=run.seed + 1000 * i, num_threads=threads, engine_id=i
        )
        for i in range(p.num_engines)
    ]
    trainer_cls = ray.remote(locate(TRAINER_BACKENDS[run.trainer.backend]))
    addr, port = rendezvous(run, pg)
    trainers = [
        trainer_cls.options(**on_bundle(r)).remote(
            rank=r, world_size=p.trainer_world_size, master_addr=addr, master_port=port,
            checkpoint_dir=checkpoint_dir, run=run, num_threads=threads,
        )
        for r in range(p.trainer_world_size)
    ]
    # surface construction errors now, with the actor's traceback
    ray.get([e.health.remote() for e in engines] + [t.__ray_ready__.remote() for t in trainers])
    return Actors(engines=engines, trainers=trainers, placement=pg, num_threads=threads)
