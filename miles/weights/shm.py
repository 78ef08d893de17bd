"""Weight sync through shared memory on trainer rank 0's node, with sending and loading overlapped.

Files in ``weight_sync.shm_dir`` (tmpfs, ``/dev/shm``) that trainer rank 0 and the engines keep
mapped for the whole run (mapped with ``MAP_POPULATE``, so no page is faulted during a sync):

- a **control page** ``<prefix>-ctl``: two slots, each ``[state, version, layout key, bytes written]``,
  the last version whose send raised, and the pins of the engine processes computing from a slot;
- a **segment** per layout ``<prefix>-<key>``: a header, the layout as JSON (names, shapes, dtypes,
  byte offsets, written once) and two data regions, one per slot (:class:`miles.weights.layout.FlatLayout`).

Beside them an empty ``<prefix>-held``, locked by each process that maps them, so that the next run removes
the files of a run that was killed before its driver could (:mod:`miles.weights.shm_files`).

Rank 0 writes version ``v`` into a slot that does not hold the newest version, chunk by chunk
(:data:`CHUNK_BYTES`), and advances the slot's ``bytes written`` after each chunk; ``state=READY``
when done. An engine that can compute from the slot's pages (:meth:`ShmReceiver.receive_shared`, a CPU
torch engine without adapters or rollout quantization) waits for the whole version and makes its
weights views of the slot: a version then costs one memory copy, rank 0's. It pins the slot (its pid
and the slot in the control page's pins, :mod:`miles.weights.shm_pins`): rank 0 never writes into a slot a live
process has pinned (:func:`_slot_to_write`), so the engine's weights never change under it, and fails
the send with the reason if both slots are pinned; a pin of a process that ended does not count.
Otherwise a version costs one copy on rank 0 (state dict -> segment) and one per engine (segment -> its
weights, inside ``update_weights``), and the two run at the same time:

- the first sync (and the first after a failure) runs sender and receivers one after the other,
  which tells the driver the control page's path and node;
- after that the driver starts them together: each engine waits for ``v`` to appear in a slot and
  gets tensors (:class:`_Arriving`) whose metadata is there at once and whose ``copy_`` into the
  engine's weights copies each chunk as soon as rank 0 has written it. Reading them any other way
  waits for the whole tensor.

The other slot still holds the previous version, so a sync whose sender dies part-way (the
engine waits ``weight_sync.timeout_s`` for the next chunk) puts back what the engine had already
overwritten from it, when that slot holds the version the engine had: the engine keeps its old
version. Engines on another node cannot see the files: they fail with a message that names both
nodes and the transports that work across nodes.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from miles.config.schema import WeightSyncConfig
from miles.weights.layout import FlatLayout
from miles.weights.shm_files import hold, remove_files, sweep_stale
from miles.weights.shm_pins import Pin, Shared, slots_pinned
from miles.weights.transport import Sent, Transport

log = logging.getLogger(__name__)

MAGIC = 0x4D494C4553574754  # "MILESWGT"
CTL_MAGIC = 0x4D494C4553435443  # "MILESCTC"
WRITING, READY = 1, 2
HEADER_BYTES = 4096
CHUNK_BYTES = 4 << 20
"""Rank 0 publishes progress, and engines copy, in chunks of this many bytes."""
_POLL_S = 20e-6
# segment header words
_H_MAGIC, _H_KEY, _H_LAYOUT_LEN, _H_DATA_OFF, _H_TOTAL, _H_STRIDE = range(6)
# control page words: magic, the last failed version, then slot s at 8 + 8 * s
_C_MAGIC, _C_FAILED = 0, 1
_S_STATE, _S_VERSION, _S_KEY, _S_WRITTEN = range(4)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def _map(path: str, size: int, create: bool) -> Tensor:
    """uint8 view of the file ``path`` mapped shared, every page faulted in now."""
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
                    "--shm-size), point weight_sync.shm_dir at a bigger tmpfs, or use another transport."
                ) from e
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


@dataclass
class _Segment:
    """A mapped segment in this process: its layout and a view of each slot's data."""

    path: str
    key: int
    layout: FlatLayout
    slots: tuple[dict[str, Tensor], dict[str, Tensor]]
    flat: tuple[Tensor, Tensor]

    @staticmethod
    def of(path: str, buf: Tensor) -> _Segment:
        hdr = buf[:HEADER_BYTES].view(torch.int64)
        if int(hdr[_H_MAGIC]) != MAGIC:
            raise ValueError(f"weight_sync shm: {path} is not a miles weight segment")
        n, off, stride = int(hdr[_H_LAYOUT_LEN]), int(hdr[_H_DATA_OFF]), int(hdr[_H_STRIDE])
        layout = FlatLayout.from_json(bytes(buf[HEADER_BYTES : HEADER_BYTES + n].numpy()).decode())
        flat = (buf[off : off + stride], buf[off + stride : off + 2 * stride])
        return _Segment(path, int(hdr[_H_KEY]), layout, (layout.views(flat[0]), layout.views(flat[1])), flat)


@dataclass
class _Process:
    """This process's side of one transport: the control page and the current segment."""

    ctl: Tensor  # int64 [512]
    held: int = -1  # a descriptor of the run's -held file with a shared lock on it (shm_files.hold)
    seg: _Segment | None = None
    segs_by_key: dict[int, _Segment] = field(default_factory=dict)
    pin_entry: int | None = None  # this process's entry in the page's pins (shm_pins), once it computes in place

    def slot(self, s: int) -> Tensor:
        return self.ctl[8 + 8 * s : 16 + 8 * s]


# this process's mappings, kept for the whole run: prefix -> its side
_WRITERS: dict[str, _Process] = {}
_READERS: dict[str, _Process] = {}


def drop_process_state() -> None:
    """Unmap every segment this process wrote or read (a finished run's transport removed the files)."""
    for p in (*_WRITERS.values(), *_READERS.values()):
        if p.held >= 0:
            os.close(p.held)  # its lock goes with it
    _WRITERS.clear()
    _READERS.clear()


def _ctl_path(prefix: str) -> str:
    return f"{prefix}-ctl"


def _seg_path(prefix: str, key: int) -> str:
    return f"{prefix}-{key:016x}"


class ShmSender:
    """Runs on trainer rank 0: write the flat weights into a slot of the (pre-allocated) segment."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def send(self, state_dict: dict[str, Tensor], version: int) -> Sent:
        t0 = time.perf_counter()
        w = _WRITERS.get(self.prefix) or self._open()
        try:
            w.ctl[_C_FAILED] = -1  # a version sent again after a failure
            layout = FlatLayout.of(state_dict)
            seg = w.seg if w.seg is not None and w.seg.layout == layout else self._adopt(w, layout)
            s = _slot_to_write(w)
            c = w.slot(s)
            c[_S_STATE] = WRITING
            c[_S_KEY], c[_S_WRITTEN] = seg.key, 0
            c[_S_VERSION] = version  # last: a reader that finds the version finds the rest set
            views = seg.slots[s]
            for name, off in zip(layout.names, layout.offsets, strict=True):
                _write(views[name], state_dict[name].detach(), off, c)
            c[_S_WRITTEN] = layout.total_bytes
            c[_S_STATE] = READY
        except BaseException:
            w.ctl[_C_FAILED] = version  # engines waiting for this version fail now, not after the timeout
            raise
        handle = {"ctl": _ctl_path(self.prefix), "node_id": _node_id(), "host": os.uname().nodename}
        return Sent(handle=handle, bytes=layout.data_bytes, send_s=time.perf_counter() - t0)

    def _open(self) -> _Process:
        path = _ctl_path(self.prefix)
        stale = sweep_stale(os.path.dirname(path), self.prefix)
        if stale:
            log.info("weight_sync shm: removed the files of %d earlier run(s) that ended without closing their "
                     "transport: %s", len(stale), ", ".join(os.path.basename(p) for p in stale))
        held = hold(self.prefix, create=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # a restarted rank 0 reopens the run's page
        try:
            if os.fstat(fd).st_size < HEADER_BYTES:
                os.ftruncate(fd, HEADER_BYTES)
        finally:
            os.close(fd)
        ctl = _map(path, HEADER_BYTES, create=False).view(torch.int64)
        if int(ctl[_C_MAGIC]) != CTL_MAGIC:
            ctl.zero_()
            ctl[_C_FAILED] = -1
            for s in (0, 1):
                ctl[8 + 8 * s + _S_VERSION] = -1
            ctl[_C_MAGIC] = CTL_MAGIC
        w = _WRITERS[self.prefix] = _Process(ctl, held)
        return w

    def _adopt(self, w: _Process, layout: FlatLayout) -> _Segment:
        """The run's segment for ``layout`` if one exists (another process was rank 0 before), else a new one."""
        path = _seg_path(self.prefix, layout.key)
        if w.seg is None and Path(path).exists():
            try:
                seg = _Segment.of(path, _map(path, 0, create=False))
            except (OSError, ValueError):
                seg = None
            if seg is not None and seg.layout == layout:
                w.seg = seg  # its slots, and the versions they hold, stay valid
                return seg
        return self._create(w, layout)

    def _create(self, w: _Process, layout: FlatLayout) -> _Segment:
        text = layout.to_json().encode()
        data_off = -(-(HEADER_BYTES + len(text)) // 4096) * 4096
        stride = -(-layout.total_bytes // 4096) * 4096
        key = layout.key
        path = _seg_path(self.prefix, key)
        for s in (0, 1):  # the slots of the old layout are gone with its segment
            w.slot(s)[_S_STATE] = 0
        if w.seg is not None:
            Path(w.seg.path).unlink(
                missing_ok=True
            )  # engines still mapping it keep their pages until they drop it
        Path(path).unlink(missing_ok=True)
        buf = _map(path, data_off + 2 * stride, create=True)
        buf[HEADER_BYTES : HEADER_BYTES + len(text)].copy_(
            torch.frombuffer(bytearray(text), dtype=torch.uint8)
        )
        buf[:HEADER_BYTES].view(torch.int64)[:6] = torch.tensor(
            [MAGIC, key, len(text), data_off, layout.total_bytes, stride]
        )
        w.seg = _Segment.of(path, buf)
        return w.seg


def _slot_to_write(w: _Process) -> int:
    """The slot for the next version: never one an engine computes from in place; of the others, one that
    holds no whole version, else the older one (so the newest whole version stays whole meanwhile)."""
    pinned = slots_pinned(w.ctl)
    free = [s for s in (0, 1) if s not in pinned]
    if not free:
        raise RuntimeError(
            "weight_sync shm: both slots are in use by engines computing in place from them (processes "
            f"{pinned}); an engine left on an older version must be synced or stopped first")
    ready = {s: int(w.slot(s)[_S_VERSION]) for s in (0, 1) if int(w.slot(s)[_S_STATE]) == READY}
    return min(free, key=lambda s: (s in ready, ready.get(s, 0)))


def _write(dst: Tensor, src: Tensor, offset: int, c: Tensor) -> None:
    """Copy ``src`` into its place ``dst`` (at byte ``offset`` of the slot), advancing bytes-written per chunk."""
    n = dst.numel() * dst.element_size()
    if not src.is_contiguous() or src.dtype != dst.dtype or n <= CHUNK_BYTES:
        dst.copy_(src)
        c[_S_WRITTEN] = offset + n
        return
    d, s, size = dst.view(-1), src.view(-1), dst.element_size()
    step = CHUNK_BYTES // size
    for a in range(0, d.numel(), step):
        b = min(a + step, d.numel())
        d[a:b].copy_(s[a:b])
        c[_S_WRITTEN] = offset + b * size


_METADATA = frozenset(
    {
        "size",
        "dim",
        "numel",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "stride",
        "storage_offset",
        "__len__",
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "layout",
        "requires_grad",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "itemsize",
        "nbytes",
        "is_cpu",
    }
)
"""What an arriving tensor answers without waiting for its bytes (every other use waits)."""


@dataclass
class _Stream:
    """One engine's receipt of one version while rank 0 is still writing it."""

    prefix: str
    reader: _Process
    seg: _Segment
    slot: int
    version: int
    timeout_s: float
    engine_version: int | None
    """The version the engine held when the sync began (None: unknown), for putting it back on failure."""
    touched: list[tuple[Tensor, str]] = field(default_factory=list)

    def wait(self, end: int) -> None:
        """Return once rank 0 has written the slot's bytes [0, end); raise if it cannot."""
        c = self.reader.slot(self.slot)
        written = int(c[_S_WRITTEN])
        if written >= end:
            return
        deadline, last = time.monotonic() + self.timeout_s, written
        while True:
            if int(c[_S_VERSION]) != self.version or int(self.reader.ctl[_C_FAILED]) == self.version:
                self.fail("rank 0's send failed or was replaced part-way")
            written = int(c[_S_WRITTEN])
            if written >= end:
                return
            if written != last:
                deadline, last = time.monotonic() + self.timeout_s, written
            elif time.monotonic() > deadline:
                self.fail(
                    f"rank 0 wrote nothing for weight_sync.timeout_s={self.timeout_s:g} s "
                    f"({written} of {self.seg.layout.total_bytes} bytes written)"
                )
            time.sleep(_POLL_S)

    def fail(self, reason: str) -> None:
        """Put back what this sync overwrote (from the other slot, when it holds the engine's version), then raise."""
        other = self.reader.slot(1 - self.slot)
        restored = (
            self.engine_version is not None
            and int(other[_S_STATE]) == READY
            and int(other[_S_VERSION]) == self.engine_version
            and int(other[_S_KEY]) == self.seg.key
        )
        kept = (
            f"its weights were put back to version {self.engine_version}"
            if restored or not self.touched
            else "its weights are partly overwritten: sync it again before generating"
        )
        if restored:
            views = self.seg.slots[1 - self.slot]
            with torch._C.DisableTorchFunctionSubclass():
                for dst, name in self.touched:
                    dst.copy_(views[name])
        self.touched.clear()
        raise RuntimeError(f"weight_sync shm: version {self.version} did not arrive: {reason}; {kept}")


class _Arriving(Tensor):
    """A view of a tensor in a slot that rank 0 is still writing (see the module docstring)."""

    _stream: _Stream
    _name: str
    _start: int  # byte offset in the slot
    _plain: Tensor

    @staticmethod
    def of(plain: Tensor, stream: _Stream, name: str, start: int) -> _Arriving:
        t = plain.as_subclass(_Arriving)
        t._stream, t._name, t._start, t._plain = stream, name, start, plain
        return t

    @property
    def _end(self) -> int:
        return self._start + self._plain.numel() * self._plain.element_size()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if (
            func is Tensor.copy_
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], _Arriving)
            and not isinstance(args[0], _Arriving)
        ):
            return args[1]._copy_into(args[0])
        if name not in _METADATA:
            for a in (*args, *kwargs.values()):
                if isinstance(a, _Arriving):
                    a._stream.wait(a._end)
        unwrap = lambda a: a._plain if isinstance(a, _Arriving) else a  # noqa: E731
        with torch._C.DisableTorchFunctionSubclass():
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def _copy_into(self, dst: Tensor) -> Tensor:
        """``dst.copy_(self)`` chunk by chunk as the chunks arrive (whole, when the shapes differ)."""
        stream, src = self._stream, self._plain
        stream.touched.append((dst, self._name))
        with torch._C.DisableTorchFunctionSubclass():
            if dst.shape != src.shape or not dst.is_contiguous() or src.numel() == 0:
                stream.wait(self._end)
                return dst.copy_(src)
            d, s, size = dst.view(-1), src.view(-1), src.element_size()
            step = CHUNK_BYTES // size
            for a in range(0, s.numel(), step):
                b = min(a + step, s.numel())
                stream.wait(self._start + b * size)
                d[a:b].copy_(s[a:b])
        return dst


class ShmReceiver:
    """Runs in an engine on rank 0's node: views of the slot holding ``version`` (the engine copies them in).

    ``wait_s`` 0: the version must be there already (rank 0 has returned); > 0: rank 0 is writing it now,
    wait at most that long for it to start and for each next chunk.
    """

    def __init__(self, prefix: str, handle: dict[str, str], version: int, wait_s: float = 0.0) -> None:
        self.prefix, self.handle, self.version, self.wait_s = prefix, handle, version, wait_s

    def receive(self, engine: Any) -> dict[str, Tensor]:
        r, s, seg = self._locate()
        c = r.slot(s)
        if int(c[_S_STATE]) == READY and int(c[_S_VERSION]) == self.version:
            return seg.slots[s]
        version = getattr(engine, "weight_version", None)
        stream = _Stream(
            self.prefix, r, seg, s, self.version, self.wait_s, int(version()) if callable(version) else None
        )
        views, layout = seg.slots[s], seg.layout
        return {
            n: _Arriving.of(views[n], stream, n, off)
            for n, off in zip(layout.names, layout.offsets, strict=True)
        }

    def receive_shared(self, engine: Any) -> Shared:
        """The whole version as plain views of its slot, for an engine that computes from them in place
        (:class:`Shared`): waits until rank 0 has written all of it (``wait_s``); nothing is copied."""
        r, s, seg = self._locate()
        c = r.slot(s)
        if not (int(c[_S_STATE]) == READY and int(c[_S_VERSION]) == self.version):
            held = getattr(engine, "weight_version", None)
            stream = _Stream(self.prefix, r, seg, s, self.version, self.wait_s, int(held()) if callable(held) else None)
            stream.wait(seg.layout.total_bytes)  # on failure nothing was touched: the engine keeps its version
        return Shared(dict(seg.slots[s]), Pin(r, self.handle["ctl"], s))

    def _locate(self) -> tuple[_Process, int, _Segment]:
        """This process's reader, the slot holding the version (see :meth:`_find_slot`) and its segment."""
        here = _node_id()
        if here != self.handle["node_id"]:
            raise RuntimeError(
                f"weight_sync shm: this engine runs on node {here} ({os.uname().nodename}) but trainer rank 0 "
                f"wrote the weights to shared memory on node {self.handle['node_id']} ({self.handle['host']}). "
                "Shared memory works only when every engine is on rank 0's node; use weight_sync=broadcast "
                "(or object_store) for engines on other nodes."
            )
        r = self._reader()
        s = self._find_slot(r)
        key = int(r.slot(s)[_S_KEY])
        seg = r.segs_by_key.get(key)
        if seg is None:
            path = _seg_path(self.prefix, key)
            try:
                buf = _map(path, 0, create=False)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"weight_sync shm: segment {path} is gone (removed, or the run closed its transport)"
                ) from None
            r.segs_by_key = {key: _Segment.of(path, buf)}  # an older layout's segment is unmapped
            seg = r.segs_by_key[key]
        return r, s, seg

    def _reader(self) -> _Process:
        r = _READERS.get(self.prefix)
        if r is None:
            path = self.handle["ctl"]
            try:
                held = hold(path[: -len("-ctl")])  # before the page: a sweep removes nothing held
                try:
                    ctl = _map(path, 0, create=False).view(torch.int64)
                except BaseException:
                    os.close(held)
                    raise
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"weight_sync shm: control page {path} is gone (removed, or the run closed its transport)"
                ) from None
            if int(ctl[_C_MAGIC]) != CTL_MAGIC:
                os.close(held)
                raise ValueError(f"weight_sync shm: {path} is not a miles weight-sync control page")
            r = _READERS[self.prefix] = _Process(ctl, held)
        return r

    def _find_slot(self, r: _Process) -> int:
        """The slot holding ``self.version`` (waiting up to ``wait_s`` for rank 0 to start writing it)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            for s in (0, 1):
                c = r.slot(s)
                if int(c[_S_VERSION]) == self.version and int(c[_S_STATE]) in (WRITING, READY):
                    if self.wait_s > 0 or int(c[_S_STATE]) == READY:
                        return s
            if int(r.ctl[_C_FAILED]) == self.version:
                raise RuntimeError(f"weight_sync shm: trainer rank 0 failed to send version {self.version}")
            if time.monotonic() >= deadline:
                newest = max((0, 1), key=lambda s: int(r.slot(s)[_S_VERSION]))
                c = r.slot(newest)
                found, state = int(c[_S_VERSION]), int(c[_S_STATE])
                waited = f" after waiting {self.wait_s:g} s" if self.wait_s > 0 else ""
                raise RuntimeError(
                    f"weight_sync shm: segment {self.prefix} holds version {found} "
                    f"({'ready' if state == READY else 'being written'}), expected "
                    f"{self.version}{waited}"
                )
            time.sleep(_POLL_S)


class ShmTransport(Transport):
    """``weight_sync.transport=shm``: sequential for the first sync (and after a failure), then overlapped."""

    name = "shm"

    def __init__(self, cfg: WeightSyncConfig, **_: Any) -> None:
        if not Path(cfg.shm_dir).is_dir():
            raise ValueError(
                f"weight_sync.shm_dir: {cfg.shm_dir!r} is not a directory (on Linux use /dev/shm)"
            )
        if cfg.timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s: must be > 0, found {cfg.timeout_s}")
        self.prefix = str(Path(cfg.shm_dir) / f"miles-weights-{uuid.uuid4().hex[:12]}")
        self.timeout_s = cfg.timeout_s
        self.handle: dict[str, str] | None = None
        """Where rank 0's control page is, once a sync through it succeeded: from then on syncs overlap."""

    @property
    def concurrent(self) -> bool:  # type: ignore[override]
        return self.handle is not None

    def begin(self, trainers: Any, engines: Any) -> None:
        pass

    def sender(self, version: int) -> ShmSender:
        return ShmSender(self.prefix)

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> ShmReceiver:
        if sent is not None:
            self.handle = sent.handle
            return ShmReceiver(self.prefix, sent.handle, version)
        assert self.handle is not None
        return ShmReceiver(self.prefix, self.handle, version, wait_s=self.timeout_s)

    def failed(self) -> None:
        self.handle = None  # the next sync starts over one after the other

    def close(self) -> None:
        """Unlink the files (on this node: with rank 0 on another node they go with that node's tmpfs)."""
        remove_files(self.prefix)
