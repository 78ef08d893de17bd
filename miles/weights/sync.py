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
transport (broadcast) runs them at the same time.

| transport      | path of the bytes                              | where it works                        |
|----------------|------------------------------------------------|---------------------------------------|
| ``object_store``| ``ray.put`` on rank 0, ``ray.get`` per engine | anywhere (default)                    |
| ``broadcast``  | gloo/NCCL group {rank 0, engines}, in buckets  | anywhere the ranks can reach the driver |
| ``disk``       | safetensors in an atomically renamed directory | one node, or a shared filesystem      |
| ``shm``        | one ``/dev/shm`` segment, written once per step | engines on rank 0's node only        |
| ``ipc``        | CUDA IPC handle to one flat GPU buffer         | colocated on one GPU (untested so far) |
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from miles.config.schema import WeightSyncConfig

CPU_TRANSPORTS = ("object_store", "broadcast", "disk", "shm")
"""The transports that work between CPU processes."""
TRANSPORTS = (*CPU_TRANSPORTS, "ipc")


@dataclass(frozen=True)
class Sent:
    """What trainer rank 0's ``sender.send`` returns to the driver."""

    handle: Any
    """What the receivers need to find this version (an object ref, a path, ...; None for broadcast)."""
    bytes: int
    """Bytes of weights sent (one copy)."""
    send_s: float
    """Seconds ``send`` took on rank 0 (the gather before it is not included)."""


class Transport(Protocol):
    """Set up once per run; ``sender()`` / ``receiver()`` are called once per sync."""

    name: str
    concurrent: bool
    """True: sender and receivers must run at the same time (a collective)."""

    def begin(self, trainers: Sequence[Any], engines: Sequence[Any]) -> None:
        """Called at the start of every sync with the actors taking part."""

    def sender(self, version: int) -> Any: ...

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> Any: ...

    def failed(self) -> None:
        """A sync failed part-way; the next one must not depend on state it left behind."""

    def close(self) -> None:
        """The run is over: release what the transport holds (nothing, unless a transport says so)."""


def drop_process_state() -> None:
    """Forget this process's side of every transport: sync-group memberships, shared-memory mappings.

    For an actor parked between jobs (:mod:`miles.backends.reuse`): the next job's transport sets up its own.
    """
    from miles.weights import broadcast, shm

    broadcast.drop_process_state()
    shm.drop_process_state()


def make_transport(cfg: WeightSyncConfig, trainers: Sequence[Any], engines: Sequence[Any], *,
                   placement: str = "colocate", device: str = "cpu") -> Transport:
    """The transport ``cfg.transport`` for these actors (call ``.close()`` at the end of the run).

    ``placement`` and ``device`` (the run's, resolved) say whether engines share trainer rank 0's
    GPU, which ``ipc`` needs.
    """
    if not engines:
        raise ValueError("make_transport: no engines to send weights to")
    if cfg.transport == "object_store":
        from miles.weights.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if cfg.transport == "broadcast":
        from miles.weights.broadcast import BroadcastTransport

        return BroadcastTransport(cfg, num_engines=len(engines))
    if cfg.transport == "disk":
        from miles.weights.disk import DiskTransport

        return DiskTransport(cfg)
    if cfg.transport == "shm":
        from miles.weights.shm import ShmTransport

        return ShmTransport(cfg)
    if cfg.transport == "ipc":
        from miles.weights import ipc

        ipc.check(placement, device)
        return ipc.IpcTransport()
    raise ValueError(f"weight_sync.transport: {cfg.transport!r} is not a transport; valid: {', '.join(TRANSPORTS)}")


def sync_weights(
    trainers: Sequence[Any], engines: Sequence[Any], version: int, transport: Transport | None = None,
) -> dict[str, float]:
    """Send the trainers' current weights to every engine as ``version``; returns timing metrics.

    ``transport`` None uses the object store. On failure raises ``RuntimeError`` naming the
    transport and the version; engines that did not receive the whole version keep their old one.
    """
    import ray

    if transport is None:
        from miles.weights.object_store import ObjectStoreTransport

        transport = ObjectStoreTransport()
    t0 = time.perf_counter()
    transport.begin(trainers, engines)
    sender = transport.sender(version)
    try:
        if transport.concurrent:
            send_refs = [t.send_weights.remote(sender, version) for t in trainers]
            recv_refs = [e.update_weights_from.remote(transport.receiver(i, version, None), version)
                         for i, e in enumerate(engines)]
            # let every side finish or fail (each waits at most weight_sync.timeout_s for the others), so
            # that no engine is still inside this sync when we return or raise
            ray.wait(send_refs + recv_refs, num_returns=len(send_refs) + len(recv_refs))
            sent = _rank0(ray.get(send_refs))
            t_sent = time.perf_counter()
            applied = ray.get(recv_refs)
        else:
            sent = _rank0(ray.get([t.send_weights.remote(sender, version) for t in trainers]))
            t_sent = time.perf_counter()
            applied = ray.get([e.update_weights_from.remote(transport.receiver(i, version, sent), version)
                               for i, e in enumerate(engines)])
    except Exception as e:
        transport.failed()
        raise RuntimeError(f"weight sync of version {version} over '{transport.name}' failed; engines that did "
                           f"not apply it keep their previous version. Cause: {e}") from e
    seconds = time.perf_counter() - t0
    # sequential transports: the trainer call is the gather plus the send; a collective one overlaps them
    gather = {} if transport.concurrent else {"weight_sync/gather_s": (t_sent - t0) - sent.send_s}
    return gather | {
        "weight_sync/seconds": seconds,
        "weight_sync/send_s": sent.send_s,
        "weight_sync/receive_s": max(float(a.get("receive_s", 0.0)) for a in applied),
        "weight_sync/apply_s": max(float(a.get("update_s", 0.0)) for a in applied),
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
