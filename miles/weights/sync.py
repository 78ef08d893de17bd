"""Weight sync: one call per step moves trainer rank 0's weights to every engine as one version.

A *transport* (``weight_sync.transport``) is set up once per run by :func:`make_transport` and
hands out two small picklable objects per sync:

- a **sender**, given to every trainer rank through ``trainer.send_weights(sender, version)``;
  the ranks gather the full state dict collectively and rank 0 calls
  ``sender.send(state_dict, version) -> Sent`` in its own process;
- a **receiver** per engine, given through ``engine.update_weights_from(receiver, version)``; the
  engine calls ``receiver.receive(engine) -> state dict`` in its process and then applies it with
  ``update_weights`` (all checks before any copy), so an engine either holds the whole new version
  or stays at its old one.

Transports where the bytes are stored before they are read (object store, disk, shm) run the two
halves one after the other, the receiver carrying the sender's ``Sent.handle``; a collective
transport (broadcast) runs them at the same time. A receiver that also offers ``receive_shared``
(shm) lets an engine that can compute from the shared pages take the version without copying it
(``weight_sync/in_place``: the share of engines that did).

| transport      | path of the bytes                              | where it works                        |
|----------------|------------------------------------------------|---------------------------------------|
| ``object_store``| ``ray.put`` on rank 0, ``ray.get`` per engine | anywhere (default)                    |
| ``broadcast``  | gloo/NCCL group {rank 0, engines}, in buckets  | anywhere the ranks can reach the driver |
| ``disk``       | safetensors in an atomically renamed directory | one node, or a shared filesystem      |
| ``shm``        | ``/dev/shm`` segment: computed from in place,  | engines on rank 0's node only        |
|                | or loaded as it is written                     |                                       |
| ``ipc``        | CUDA IPC handle to one flat GPU buffer         | colocated on one GPU (untested so far) |

``auto`` (the default, :mod:`miles.weights.auto`) sends the first version through the object store and
the rest through ``shm`` where that works (a CPU run of torch engines on one node, with room in
``/dev/shm``), else through the object store.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from miles.config.schema import WeightSyncConfig
from miles.weights.transport import PendingSent, Sent, Transport

TRANSPORTS: dict[str, str] = {
    "auto": "miles.weights.auto:AutoTransport",
    "object_store": "miles.weights.object_store:ObjectStoreTransport",
    "broadcast": "miles.weights.broadcast:BroadcastTransport",
    "disk": "miles.weights.disk:DiskTransport",
    "shm": "miles.weights.shm:ShmTransport",
    "ipc": "miles.weights.ipc:IpcTransport",
}
"""The entry table: transport name -> its class as ``module:Class``, imported when a run names it."""
CPU_TRANSPORTS = ("object_store", "broadcast", "disk", "shm")
"""The transports that work between CPU processes."""


def drop_process_state() -> None:
    """Forget this process's side of every transport: sync-group memberships, shared-memory mappings.

    For an actor parked between jobs (:mod:`miles.backends.reuse`): the next job's transport sets up its own.
    """
    for entry in TRANSPORTS.values():
        module = sys.modules.get(entry.partition(":")[0])  # a transport never imported here holds nothing here
        if hasattr(module, "drop_process_state"):
            module.drop_process_state()


def make_transport(cfg: WeightSyncConfig, trainers: Sequence[Any], engines: Sequence[Any], *,
                   placement: str = "colocate", device: str = "cpu", engine_class: str = "") -> Transport:
    """The transport ``cfg.transport`` for these actors (call ``.close()`` at the end of the run).

    ``placement`` and ``device`` (the run's, resolved) say whether engines share trainer rank 0's
    GPU, which ``ipc`` needs; ``engine_class`` (``rollout.engine._target_``) is for ``auto``.
    """
    if not engines:
        raise ValueError("make_transport: no engines to send weights to")
    if cfg.transport not in TRANSPORTS:
        raise ValueError(f"weight_sync.transport: {cfg.transport!r} is not a transport; valid: {', '.join(TRANSPORTS)}")
    module, _, cls = TRANSPORTS[cfg.transport].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg, num_engines=len(engines), placement=placement,
                                                         device=device, engine_class=engine_class)


def sync_weights(
    trainers: Sequence[Any], engines: Sequence[Any], version: int, transport: Transport | None = None,
    wait_trainers: Callable[[list[Any]], list[Any]] | None = None,
) -> dict[str, float]:
    """Send the trainers' current weights to every engine as ``version``; returns timing metrics.

    ``transport`` None uses the object store. ``wait_trainers``: how to wait for the trainer ranks' sends
    (default ``ray.get``; the loop passes :func:`miles.core.recovery.get_ranks`, which kills a rank that
    hangs instead of waiting on it for ever). On failure raises ``RuntimeError`` naming the transport and
    the version; engines that did not receive the whole version keep their old one.
    """
    import ray

    wait_trainers = wait_trainers or ray.get
    recv_refs: list[Any] = []

    if transport is None:
        transport = make_transport(WeightSyncConfig(transport="object_store"), trainers, engines)
    pipelined = getattr(transport, "pipelined", False)
    t0 = time.perf_counter()
    transport.begin(trainers, engines)
    sender = transport.sender(version)
    try:
        if transport.concurrent:
            send_refs = [t.send_weights.remote(sender, version) for t in trainers]
            recv_refs = [e.update_weights_from.remote(transport.receiver(i, version, None), version)
                         for i, e in enumerate(engines)]
            # let every side finish or fail (each waits at most weight_sync.timeout_s for the others), so
            # that no engine is still inside this sync when we return or raise (the except below)
            sent = _rank0(wait_trainers(send_refs))
            t_sent = time.perf_counter()
            applied = ray.get(recv_refs)
        elif pipelined:  # the engines take rank 0's answer from its call themselves
            send_refs = [t.send_weights.remote(sender, version) for t in trainers]
            pending = PendingSent(send_refs[0])
            recv_refs = [e.update_weights_from.remote(transport.receiver(i, version, pending), version)
                         for i, e in enumerate(engines)]
            sent = _rank0(wait_trainers(send_refs))
            applied = ray.get(recv_refs)
        else:
            sent = _rank0(wait_trainers([t.send_weights.remote(sender, version) for t in trainers]))
            t_sent = time.perf_counter()
            applied = ray.get([e.update_weights_from.remote(transport.receiver(i, version, sent), version)
                               for i, e in enumerate(engines)])
    except Exception as e:
        if recv_refs:  # no engine is still inside this sync (each waits at most weight_sync.timeout_s)
            ray.wait(recv_refs, num_returns=len(recv_refs))
        transport.failed()
        raise RuntimeError(f"weight sync of version {version} over '{transport.name}' failed; engines that did "
                           f"not apply it keep their previous version. Cause: {e}") from e
    seconds = time.perf_counter() - t0
    synced = transport.synced(sent) if hasattr(transport, "synced") else {}  # auto: what this one took
    # sequential transports: the trainer call is the gather plus the send; a collective or pipelined one
    # overlaps them with the engines' calls
    gather = {} if transport.concurrent or pipelined else {"weight_sync/gather_s": (t_sent - t0) - sent.send_s}
    return gather | synced | {
        "weight_sync/seconds": seconds,
        "weight_sync/send_s": sent.send_s,
        "weight_sync/receive_s": max(float(a.get("receive_s", 0.0)) for a in applied),
        "weight_sync/apply_s": max(float(a.get("update_s", 0.0)) for a in applied),
        "weight_sync/in_place": sum(float(a.get("in_place", 0.0)) for a in applied) / len(applied),
        "weight_sync/bytes": float(sent.bytes),
        "weight_sync/bytes_per_s": sent.bytes * len(engines) / max(seconds, 1e-9),
        "weight_sync/version": float(version),
    }


def _rank0(results: list[Any]) -> Sent:
    sent = [r for r in results if r is not None]
    if len(sent) != 1 or not isinstance(sent[0], Sent):
        raise RuntimeError(f"expected exactly one trainer rank (rank 0) to return a Sent from send_weights, "
                           f"got {[type(r).__name__ for r in results]}")
    return sent[0]
