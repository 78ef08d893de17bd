"""Ray: start or join the cluster, reserve a :class:`~miles.core.plan.Plan`'s pools, find the rendezvous.

What is placed where is the plan's (:mod:`miles.core.plan`, pure); this module does what needs Ray:
one placement group per pool (:func:`reserve`, failing within ``placement.ready_timeout_s`` with the
numbers), the address and store where the trainer ranks meet (:func:`rendezvous`), and the cluster itself
(:func:`start_ray`, :func:`stop_ray`). :mod:`miles.core.actors` creates the actors on the bundles.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from miles.config import ConfigError
from miles.config.schema import ClusterConfig
from miles.config.validate import ray_dashboard_installed
from miles.core.plan import HINT, Plan, describe_request

log = logging.getLogger(__name__)

_KEPT: tuple[str | None, int | None, int | None] | None = None
"""(address, num_cpus, dashboard_port) of the Ray cluster miles started and keeps for later jobs (``keep``), else None."""


def start_ray(cluster: ClusterConfig, *, keep: bool = False) -> bool:
    """Start a local Ray cluster (its dashboard on 127.0.0.1 with ``cluster.dashboard_port``, else off) or join ``cluster.address``. Returns True if we started it.

    A cluster that is already up is used as it is, except one that miles itself kept from an earlier
    job (``keep``) with other ``cluster.*`` settings: that one is stopped and this job's started.
    ``keep``: the caller leaves the cluster up after the job; :func:`stop_ray` stops it, as does Ray's
    own exit handler when the process ends.
    """
    global _KEPT
    want = (cluster.address, cluster.num_cpus, cluster.dashboard_port)
    if ray.is_initialized() and _KEPT is not None and _KEPT != want:
        log.info("stopping the Ray cluster kept from the last job: this job sets other cluster.* values")
        stop_ray()
    if ray.is_initialized():
        return False
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if cluster.address:
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        dashboard = {} if cluster.dashboard_port is None else {"dashboard_host": "127.0.0.1",
                                                                "dashboard_port": cluster.dashboard_port}
        if dashboard and not ray_dashboard_installed():
            raise ConfigError(f"cluster.dashboard_port={cluster.dashboard_port}: Ray's dashboard is not installed "
                              "here; pip install 'miles[dashboard]' (ray[default]), or leave the key null")
        ray.init(num_cpus=cluster.num_cpus or os.cpu_count(), include_dashboard=bool(dashboard),
                 runtime_env={"env_vars": env}, logging_level=logging.WARNING, **dashboard)
        if dashboard:
            log.info("Ray dashboard at http://127.0.0.1:%d", cluster.dashboard_port)
    if keep:
        _KEPT = want
    return True


def stop_ray() -> None:
    """Shut down the Ray cluster miles kept (if it did), and with it every actor on it (parked ones too)."""
    global _KEPT
    if _KEPT is not None and ray.is_initialized():
        ray.shutdown()
    _KEPT = None


def rendezvous(plan: Plan) -> tuple[str, Any]:
    """Where a trainer (or critic) group meets: ``(master_addr, store)``, a store this driver hosts
    (:func:`miles.train.rank.open_group_store`) whose ``port`` is the group's MASTER_PORT.

    A local cluster meets on loopback; a joined one at this driver's node address, which every node of
    a Ray cluster reaches. The port is bound when it is picked, so runs that share a machine never
    race for it. Keep the store while the group lives.
    """
    from miles.train.rank import open_group_store

    addr = "127.0.0.1" if not plan.joined else ray.util.get_node_ip_address()
    return addr, open_group_store(addr)


def reserve(plan: Plan, first: int = 0) -> list[PlacementGroup]:
    """One placement group per pool of ``plan`` from pool ``first`` on, in order; fail within the plan's
    ``ready_timeout_s``.

    If any pool is not placed after ``placement.ready_timeout_s``, every group is released and a
    :class:`ConfigError` says what each pool asked for, which were not placed, and what the cluster has.
    """
    pools = plan.pools[first:]
    groups = [placement_group([pool.bundle() for _ in range(pool.num_bundles)], strategy="PACK") for pool in pools]
    ready = [g.ready() for g in groups]
    done, _ = ray.wait(ready, num_returns=len(ready), timeout=plan.ready_timeout_s)
    if len(done) == len(ready):
        return groups
    for g in groups:
        remove_placement_group(g)
    time.sleep(0.2)  # let the released bundles show up as available again
    avail, total = ray.available_resources(), ray.cluster_resources()
    have = f"{avail.get('CPU', 0.0):g} of {total.get('CPU', 0.0):g} CPU"
    for k in sorted({k for pool in pools for k in pool.resources}):
        have += f", {avail.get(k, 0.0):g} of {total.get(k, 0.0):g} {k}"
    missing = "" if len(pools) == 1 else "; not placed: " + ", ".join(
        f"{pool.name} pool" for pool, r in zip(pools, ready, strict=True) if r not in done)
    raise ConfigError(f"{describe_request(plan.placement, pools)}, but the cluster has {have} available "
                      f"(waited {plan.ready_timeout_s:g} s{missing}). Lower {HINT[plan.placement]}, or add nodes"
                      + (" that offer the custom resources." if any(pool.resources for pool in pools) else "."))


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """Node id of each bundle of a ready placement group, in bundle order."""
    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in sorted(table)]
