"""Weight sync by broadcast over a dedicated process group {trainer rank 0, engine 0, engine 1, ...}.

The group is separate from the trainers' FSDP group and is built without ``init_process_group``:
the driver hosts a ``TCPStore`` for the run, and each participant connects to it and constructs
the backend directly (``ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)``, or
``ProcessGroupNCCL`` when the processes see CUDA). On torch 2.13 this is the public way to make a
second, independent group in a process that may already hold a default group (``new_group`` can
only split the default group's ranks; sglang/OpenRLHF use the private ``_new_process_group_helper``
for the same job). Ranks join lazily on their first sync and keep the group for the run.

Per sync: rank 0 broadcasts a header ``[magic, version, layout key, total bytes]``; the layout
itself (names, shapes, dtypes, offsets) goes through the store once per layout. Then the flat
image of the state dict is broadcast in ``weight_sync.bucket_mb`` buckets: rank 0 packs bucket
k+1 while bucket k is on the wire (two staging buffers); each engine receives straight into one
pre-allocated flat buffer, and applies all of it at once afterwards (atomic per engine).

A rank that does not show up, or stalls, makes the others fail after ``weight_sync.timeout_s``;
the driver then moves the next sync to a fresh group (a new store prefix), so no half-finished
collective is ever matched with a new one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.config.schema import WeightSyncConfig
from miles.weights.layout import FlatLayout
from miles.weights.transport import Sent, Transport

MAGIC = 0x4D494C4553425354  # "MILESBST"


@dataclass(frozen=True)
class GroupSpec:
    """Everything a participant needs to join the run's sync group (picklable)."""

    host: str
    port: int
    world_size: int
    generation: int
    members: str
    """A digest of the participating actors: other actors (a restarted trainer) never reuse a group."""
    backend: str
    timeout_s: float
    bucket_bytes: int

    @property
    def prefix(self) -> str:
        return f"miles-weight-sync/{self.generation}/{self.members}"


@dataclass
class _Member:
    store: Any
    pg: Any
    device: torch.device
    prefix: str
    layouts: dict[int, FlatLayout]
    buffers: dict[Any, Tensor]


_MEMBERS: dict[tuple[str, int, int], _Member] = {}  # (host, port, rank) -> this process's membership


def drop_process_state() -> None:
    """Leave every group this process joined (their stores and peers belong to finished runs)."""
    _MEMBERS.clear()


def _resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("weight_sync.broadcast_backend=nccl, but this process sees no CUDA device; use gloo")
    return name


def join(spec: GroupSpec, rank: int, device: torch.device | None = None) -> _Member:
    """This process's member of the group ``spec`` as ``rank`` (created on first use, then cached)."""
    key = (spec.host, spec.port, rank)
    member = _MEMBERS.get(key)
    if member is not None and member.prefix == spec.prefix:
        return member
    _MEMBERS.pop(key, None)  # an older group: dropped, never matched again
    timeout = timedelta(seconds=spec.timeout_s)
    backend = _resolve_backend(spec.backend)
    base = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore(spec.prefix, base)
    dev = torch.device("cpu")
    gpu = ""
    if backend == "nccl":
        dev = device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        gpu = str(torch.cuda.get_device_properties(dev).uuid)
    store.set(f"backend/{rank}", f"{backend} {gpu}")
    if rank != 0:  # fail in seconds with a reason, not after the timeout with none
        root_backend, _, root_gpu = store.get("backend/0").decode().partition(" ")
        if root_backend != backend:
            raise RuntimeError(f"weight_sync broadcast: trainer rank 0 uses {root_backend} but engine rank {rank} "
                               f"resolved {backend}; set weight_sync.broadcast_backend explicitly")
        if gpu and root_gpu == gpu:
            raise RuntimeError(f"weight_sync broadcast: engine rank {rank} is on the same GPU as trainer rank 0 "
                               f"({gpu}) and NCCL needs one GPU per rank; use weight_sync.broadcast_backend=gloo "
                               "or weight_sync=shm for colocated actors")
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(store, rank, spec.world_size, opts)
    member = _MEMBERS[key] = _Member(store, pg, dev, spec.prefix, {}, {})
    return member


def _buffer(member: _Member, key: Any, nbytes: int) -> Tensor:
    buf = member.buffers.get(key)
    if buf is None or buf.numel() != nbytes:
        member.buffers.pop(key, None)
        buf = member.buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=member.device)
    return buf


class BroadcastSender:
    """Runs on trainer rank 0 (group rank 0)."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec

    def send(self, state_dict: dict[str, Tensor], version: int) -> Sent:
        t0 = time.perf_counter()
        m = join(self.spec, 0)
        layout = FlatLayout.of(state_dict)
        if layout.key not in m.layouts:
            m.store.set(f"layout/{layout.key}", layout.to_json())
            m.layouts[layout.key] = layout
        header = torch.tensor([MAGIC, version, layout.key, layout.total_bytes], dtype=torch.int64, device=m.device)
        m.pg.broadcast(header, 0).wait()
        size = min(self.spec.bucket_bytes, layout.total_bytes)
        staging = [_buffer(m, ("stage", i), size) for i in range(2)]
        pending: list[Any] = [None, None]
        for i, start in enumerate(range(0, layout.total_bytes, size)):
            end = min(start + size, layout.total_bytes)
            slot = i % 2
            if pending[slot] is not None:
                pending[slot].wait()  # this staging buffer's previous bucket has left
            layout.pack(state_dict, staging[slot], start, end)
            pending[slot] = m.pg.broadcast(staging[slot][: end - start], 0)
        for w in pending:
            if w is not None:
                w.wait()
        return Sent(handle=None, bytes=layout.data_bytes, send_s=time.perf_counter() - t0)


class BroadcastReceiver:
    """Runs in engine ``rank - 1`` (group rank ``rank``)."""

    def __init__(self, spec: GroupSpec, rank: int, version: int) -> None:
        self.spec, self.rank, self.version = spec, rank, version

    def receive(self, engine: Any) -> dict[str, Tensor]:
        m = join(self.spec, self.rank, getattr(engine, "device", None))
        header = torch.zeros(4, dtype=torch.int64, device=m.device)
        m.pg.broadcast(header, 0).wait()
        magic, version, key, total = header.tolist()
        if magic != MAGIC or version != self.version:
            raise RuntimeError(f"weight_sync broadcast: engine rank {self.rank} expected version {self.version}, "
                               f"got header magic={magic:#x} version={version} (the group is out of step)")
        layout = m.layouts.get(key)
        if layout is None:
            layout = m.layouts[key] = FlatLayout.from_json(m.store.get(f"layout/{key}").decode())
        flat = _buffer(m, "recv", total)
        size = min(self.spec.bucket_bytes, total)
        works = [m.pg.broadcast(flat[s:min(s + size, total)], 0) for s in range(0, total, size)]
        for w in works:
            w.wait()
        return layout.views(flat)


class BroadcastTransport(Transport):
    """``weight_sync.transport=broadcast``: the driver hosts the group's store for the run."""

    name = "broadcast"
    concurrent = True

    def __init__(self, cfg: WeightSyncConfig, *, num_engines: int, **_: Any) -> None:
        if cfg.bucket_mb * 2**20 < 1:
            raise ValueError(f"weight_sync.bucket_mb: must be > 0 (MiB per bucket), found {cfg.bucket_mb}")
        if cfg.timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s: must be > 0, found {cfg.timeout_s}")
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.timeout_s))
        self.cfg, self.num_engines, self.generation, self.members = cfg, num_engines, 0, ""
        self.host, self.port = host, self.store.port

    def begin(self, trainers: Sequence[Any], engines: Sequence[Any]) -> None:
        """Key the group by the actors taking part, so new actors (a restart) get a fresh group."""
        ids = [getattr(a, "_actor_id", None) for a in [*trainers, *engines]]
        text = ",".join(i.hex() if i is not None else repr(a) for i, a in zip(ids, [*trainers, *engines], strict=True))
        self.members = hashlib.sha256(text.encode()).hexdigest()[:12]
        self.num_engines = len(engines)

    def spec(self) -> GroupSpec:
        return GroupSpec(host=self.host, port=self.port, world_size=1 + self.num_engines, generation=self.generation,
                         members=self.members,
                         backend=self.cfg.broadcast_backend, timeout_s=self.cfg.timeout_s,
                         bucket_bytes=int(self.cfg.bucket_mb * 2**20))

    def sender(self, version: int) -> BroadcastSender:
        return BroadcastSender(self.spec())

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> BroadcastReceiver:
        return BroadcastReceiver(self.spec(), engine_index + 1, version)

    def failed(self) -> None:
        self.generation += 1

    def close(self) -> None:
        self.store = None
