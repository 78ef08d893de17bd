"""Weight sync through one shared-memory segment on trainer rank 0's node.

The segment is a file in ``weight_sync.shm_dir`` (tmpfs, ``/dev/shm``) that trainer rank 0 and the
engines keep mapped for the whole run, so after the first version no page is allocated or faulted
again: a version costs one memory copy on rank 0 (state dict -> segment) and one per engine
(segment -> its weights, inside ``update_weights``).

Segment format (one file per layout; a new layout gets a new file and the old one is unlinked)::

    [0, 4096)              header, int64: magic, state, version, layout key, layout length, data offset, total
    [4096, ...)            the layout as JSON (names, shapes, dtypes, byte offsets), written once
    [data offset, +total)  the flat weights (see :class:`miles.weights.layout.FlatLayout`)

Rank 0 sets ``state=WRITING`` before it writes and ``state=READY, version=v`` after; an engine
applies the segment only if it reads ``READY`` and the version it was asked for, so a half-written
segment is never applied. The driver runs writer and readers one after the other (the next write
starts after every engine returned). Engines on another node cannot see the segment: they fail
with a message that names both nodes and the transports that work across nodes.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles.config.schema import WeightSyncConfig
from miles.weights.layout import FlatLayout
from miles.weights.transport import Sent, Transport

MAGIC = 0x4D494C4553574754  # "MILESWGT"
WRITING, READY = 1, 2
HEADER_BYTES = 4096
_H_MAGIC, _H_STATE, _H_VERSION, _H_KEY, _H_LAYOUT_LEN, _H_DATA_OFF, _H_TOTAL = range(7)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


@dataclass
class _Mapped:
    """A mapped segment file in this process, with its views."""

    path: str
    buf: Tensor  # uint8 [file size], backed by the mapping
    layout: FlatLayout
    views: dict[str, Tensor]

    @property
    def header(self) -> Tensor:
        return self.buf[:HEADER_BYTES].view(torch.int64)

    @staticmethod
    def open(path: str, size: int, create: bool) -> Tensor:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on a later write
                except OSError as e:
                    os.unlink(path)
                    free = os.statvfs(os.path.dirname(path))
                    raise OSError(
                        f"weight_sync shm: cannot allocate {size / 2**20:.0f} MiB in {os.path.dirname(path)} "
                        f"({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): {e}. Enlarge it (docker "
                        "--shm-size), point weight_sync.shm_dir at a bigger tmpfs, or use another transport.") from e
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8)


# this process's mappings, kept for the whole run: prefix -> segment
_WRITERS: dict[str, _Mapped] = {}
_READERS: dict[str, _Mapped] = {}


def drop_process_state() -> None:
    """Unmap every segment this process wrote or read (a finished run's transport removed the files)."""
    _WRITERS.clear()
    _READERS.clear()


class ShmSender:
    """Runs on trainer rank 0: write the flat weights into the (pre-allocated) segment."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def send(self, state_dict: dict[str, Tensor], version: int) -> Sent:
        t0 = time.perf_counter()
        layout = FlatLayout.of(state_dict)
        seg = _WRITERS.get(self.prefix)
        if seg is None or seg.layout != layout:
            seg = self._create(layout)
        hdr = seg.header
        hdr[_H_STATE], hdr[_H_VERSION] = WRITING, -1
        for name, t in state_dict.items():
            seg.views[name].copy_(t)
        hdr[_H_VERSION], hdr[_H_STATE] = version, READY
        handle = {"path": seg.path, "node_id": _node_id(), "host": os.uname().nodename}
        return Sent(handle=handle, bytes=layout.data_bytes, send_s=time.perf_counter() - t0)

    def _create(self, layout: FlatLayout) -> _Mapped:
        text = layout.to_json().encode()
        data_off = -(-(HEADER_BYTES + len(text)) // 4096) * 4096
        path = f"{self.prefix}-{layout.key:016x}"
        old = _WRITERS.pop(self.prefix, None)
        if old is not None:
            Path(old.path).unlink(missing_ok=True)  # engines still mapping it keep their pages until they drop it
        Path(path).unlink(missing_ok=True)
        buf = _Mapped.open(path, data_off + layout.total_bytes, create=True)
        buf[HEADER_BYTES:HEADER_BYTES + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
        seg = _Mapped(path, buf, layout, layout.views(buf[data_off:]))
        seg.header[:7] = torch.tensor([MAGIC, WRITING, -1, layout.key, len(text), data_off, layout.total_bytes])
        _WRITERS[self.prefix] = seg
        return seg


class ShmReceiver:
    """Runs in an engine on rank 0's node: views of the segment's weights (the engine copies them in)."""

    def __init__(self, prefix: str, handle: dict[str, str], version: int) -> None:
        self.prefix, self.handle, self.version = prefix, handle, version

    def receive(self, engine: Any) -> dict[str, Tensor]:
        here = _node_id()
        if here != self.handle["node_id"]:
            raise RuntimeError(
                f"weight_sync shm: this engine runs on node {here} ({os.uname().nodename}) but trainer rank 0 "
                f"wrote the weights to shared memory on node {self.handle['node_id']} ({self.handle['host']}). "
                "Shared memory works only when every engine is on rank 0's node; use weight_sync=broadcast "
                "(or object_store) for engines on other nodes.")
        path = self.handle["path"]
        seg = _READERS.get(self.prefix)
        if seg is None or seg.path != path:
            _READERS.pop(self.prefix, None)
            try:
                buf = _Mapped.open(path, 0, create=False)
            except FileNotFoundError:
                raise FileNotFoundError(f"weight_sync shm: segment {path} is gone (removed, or the run closed its "
                                        "transport)") from None
            hdr = buf[:HEADER_BYTES].view(torch.int64)
            if int(hdr[_H_MAGIC]) != MAGIC:
                raise ValueError(f"weight_sync shm: {path} is not a miles weight segment")
            n, off = int(hdr[_H_LAYOUT_LEN]), int(hdr[_H_DATA_OFF])
            layout = FlatLayout.from_json(bytes(buf[HEADER_BYTES:HEADER_BYTES + n].numpy()).decode())
            seg = _READERS[self.prefix] = _Mapped(path, buf, layout, layout.views(buf[off:]))
        hdr = seg.header
        state, found = int(hdr[_H_STATE]), int(hdr[_H_VERSION])
        if state != READY or found != self.version:
            raise RuntimeError(f"weight_sync shm: segment {path} holds version {found} "
                               f"({'ready' if state == READY else 'being written'}), expected {self.version}")
        return seg.views


class ShmTransport(Transport):
    """``weight_sync.transport=shm``."""

    name = "shm"
    concurrent = False

    def __init__(self, cfg: WeightSyncConfig, **_: Any) -> None:
        if not Path(cfg.shm_dir).is_dir():
            raise ValueError(f"weight_sync.shm_dir: {cfg.shm_dir!r} is not a directory (on Linux use /dev/shm)")
        self.prefix = str(Path(cfg.shm_dir) / f"miles-weights-{uuid.uuid4().hex[:12]}")

    def sender(self, version: int) -> ShmSender:
        return ShmSender(self.prefix)

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> ShmReceiver:
        assert sent is not None
        return ShmReceiver(self.prefix, sent.handle, version)

    def close(self) -> None:
        """Unlink the segment files (on this node: with rank 0 on another node they go with that node's tmpfs)."""
        parent, stem = os.path.split(self.prefix)
        for p in Path(parent).glob(f"{stem}-*"):
            p.unlink(missing_ok=True)
