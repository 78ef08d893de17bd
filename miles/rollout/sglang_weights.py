"""How weights reach an SGLang server that runs on the engine actor's node: three load paths.

``rollout.engine.weight_load`` picks one; each takes the named tensors, already in the engine's dtype
(and fake-quantized where the recipe says so), and makes them the server's weights of ``version``:

- ``tensor`` (default): ``POST /update_weights_from_tensor`` with ``load_format=flattened_bucket``,
  between ``/begin_weight_update`` and ``/end_weight_update`` (SGLang refuses it outside). Each bucket
  of tensors is copied into one flat staging buffer in shared memory that the engine keeps for its
  life, and what crosses HTTP is a pickle of a few hundred bytes that names the buffer: SGLang's
  scheduler maps the same pages and copies from them into its parameters. The pickle uses torch's
  ``file_system`` sharing (a named ``/dev/shm`` segment, ``rebuild_storage_filename``), which SGLang's
  ``SafeUnpickler`` allows and which works between miles' torch 2.13 and SGLang's 2.14.1 (their
  ``torch.multiprocessing.reductions`` are the same). torch's default ``file_descriptor`` sharing
  does not work here: the fd is handed over by ``multiprocessing.resource_sharer``, whose
  connection is authenticated with the sending process's ``authkey``, and SGLang's processes are
  not its children (``AuthenticationError: digest sent was rejected``).
- ``distributed``: ``POST /init_weights_update_group`` once (``backend=gloo``, world size 2: the
  engine actor is rank 0, the server's scheduler rank 1), then per bucket ``POST
  /update_weights_from_distributed`` (``flattened_bucket``: one flat tensor) while the engine actor
  broadcasts the bucket over the group, between the same begin / end calls. The engine's side of the
  group is a ``ProcessGroupGloo`` on a ``TCPStore`` with the key prefixes SGLang's
  ``init_custom_process_group`` puts on its side (``<group>``, ``<group>/``, ``cpu/``).
- ``disk``: the whole state dict as safetensors in a fresh version directory, then ``POST
  /update_weights_from_disk`` (one call; SGLang rolls back on a failed load).

A model larger than ``bucket_bytes`` goes as several calls. Between two calls a request would run on
half-new weights; none does, because the engine loads only on an idle server with new calls held
(the rows in flight interrupted first, then continued: :mod:`miles.rollout.sglang_calls`).
A loader lives as long as its engine; :meth:`DistributedLoader.release` destroys the server's side
of the group when a parked engine hands its server to the next job (whose engine makes a new group).
The ``tensor`` and ``distributed`` paths have run on CPU only; on a GPU SGLang's tensor path takes
CUDA IPC handles instead (not wired here).
"""

from __future__ import annotations

import base64
import datetime
import io
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from miles.machine import pid_alive

WEIGHT_LOADS = ("tensor", "distributed", "disk")
"""Values of ``rollout.engine.weight_load``."""
GROUP_NAME = "miles_weights"
"""Name of the weight-update group between an engine actor and its server (``distributed``)."""

Post = Callable[..., Any]
"""``post(path, body, timeout_s=...)`` -> the decoded JSON answer (the engine's ``_control``)."""
Named = list[tuple[str, Tensor]]


def shared_pickle(obj: Any) -> str:
    """``obj`` pickled as SGLang's ``MultiprocessingSerializer`` reads it, base64: CPU tensors travel as
    the names of shared-memory segments (torch's ``file_system`` sharing), not as bytes.

    A tensor whose storage is not shared yet is moved into a new segment (one copy); a storage
    already shared is only named again. Each pickle holds one reference on the segment until the
    reader has mapped it, as ``torch.multiprocessing`` does.
    """
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import rebuild_storage_empty, rebuild_storage_filename

    def reduce_storage(storage: torch.UntypedStorage) -> tuple:
        if storage.size() == 0:
            return (rebuild_storage_empty, (type(storage),))
        metadata = storage._share_filename_cpu_()
        storage._shared_incref()
        return (rebuild_storage_filename, (type(storage), *metadata))

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**ForkingPickler._extra_reducers, torch.UntypedStorage: reduce_storage}
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def served_weights(state_dict: dict[str, Tensor], precision: Any, dtype: torch.dtype) -> dict[str, Tensor]:
    """What the server is sent for a full update: each tensor on CPU in the engine's ``dtype``, then
    fake-quantized by the recipe (:func:`miles.precision.recipe.apply_rollout_quant`), in that order,
    as the torch engine quantizes its weights after copying them in."""
    from miles.precision.recipe import apply_rollout_quant

    return apply_rollout_quant({k: v.detach().to("cpu", dtype) for k, v in state_dict.items()}, precision)


def split_buckets(named: Named, bucket_bytes: int) -> list[Named]:
    """``named`` in order, cut into runs of at most ``bucket_bytes`` (a larger tensor is a bucket alone)."""
    out: list[Named] = [[]]
    size = 0
    for k, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((k, t))
        size += n
    return [b for b in out if b]


def nbytes(named: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _layout(named: Named) -> tuple[list[SimpleNamespace], int]:
    """SGLang's ``FlattenedTensorMetadata`` fields per tensor (byte offsets in one uint8 buffer; each
    tensor starts at a multiple of its element size) and the buffer's length."""
    meta, off = [], 0
    for k, t in named:
        off = -(-off // t.element_size()) * t.element_size()
        n = t.numel() * t.element_size()
        meta.append(SimpleNamespace(name=k, shape=t.shape, dtype=t.dtype, start_idx=off, end_idx=off + n, numel=n))
        off += n
    return meta, off


def _fill(buf: Tensor, named: Named, meta: list[SimpleNamespace]) -> None:
    for (_, t), m in zip(named, meta, strict=True):
        buf[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t)


def _ok(out: Any, what: str) -> None:
    if not (isinstance(out, dict) and out.get("success")):
        raise RuntimeError(f"SGLang refused {what}: {out}")


class _BucketLoader:
    """Buckets packed into one flat byte buffer each (:func:`_layout`), between ``/begin_weight_update``
    and ``/end_weight_update``; a subclass has the buffer (:meth:`_buffer`) and sends it (:meth:`_send`)."""

    endpoint = ""

    def __init__(self, post: Post, timeout_s: float) -> None:
        self.post, self.timeout_s = post, timeout_s
        self._flat: Tensor | None = None

    def _buffer(self, size: int) -> Tensor:
        if self._flat is None or self._flat.numel() < size:
            self._flat = None  # free the old one first
            self._flat = torch.empty(max(size, 1), dtype=torch.uint8)
        return self._flat

    def _send(self, flat: Tensor, meta: list[SimpleNamespace], bucket: Named, body: dict[str, Any]) -> Any:
        raise NotImplementedError

    def load(self, buckets: list[Named], version: int) -> dict[str, float]:
        copy_s = 0.0
        t0 = time.perf_counter()
        _ok(self.post("/begin_weight_update", {}, timeout_s=self.timeout_s), "/begin_weight_update")
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            meta, size = _layout(bucket)
            t_copy = time.perf_counter()
            flat = self._buffer(size)[:size]
            _fill(flat, bucket, meta)
            copy_s += time.perf_counter() - t_copy
            body: dict[str, Any] = {"load_format": "flattened_bucket", "flush_cache": last}
            if last:
                body["weight_version"] = str(int(version))
            _ok(self._send(flat, meta, bucket, body), f"bucket {i + 1}/{len(buckets)} of version {version} "
                                                      f"({self.endpoint})")
        _ok(self.post("/end_weight_update", {}, timeout_s=self.timeout_s), "/end_weight_update")
        return {"copy_s": copy_s, "load_s": time.perf_counter() - t0 - copy_s}

    def release(self) -> None:
        """Nothing of this path stays on the server (each load's mapping of the buffer ends with it)."""

    def close(self) -> None:
        self._flat = None


class TensorLoader(_BucketLoader):
    """``weight_load=tensor``: buckets through a shared-memory staging buffer (see the module docstring)."""

    endpoint = "/update_weights_from_tensor"

    def _buffer(self, size: int) -> Tensor:
        if self._flat is None or self._flat.numel() < size:
            super()._buffer(size).untyped_storage()._share_filename_cpu_()  # a named segment, kept for the engine's life
        return self._flat

    def _send(self, flat: Tensor, meta: list[SimpleNamespace], bucket: Named, body: dict[str, Any]) -> Any:
        body["serialized_named_tensors"] = [shared_pickle({"flattened_tensor": flat, "metadata": meta})]
        return self.post(self.endpoint, body, timeout_s=self.timeout_s)


class DistributedLoader(_BucketLoader):
    """``weight_load=distributed``: each bucket broadcast over a gloo group {engine actor, server}."""

    endpoint = "/update_weights_from_distributed"

    def __init__(self, post: Post, timeout_s: float, host: str = "127.0.0.1") -> None:
        super().__init__(post, timeout_s)
        self.host = host
        self._group: Any = None
        self._store: Any = None

    def _connect(self) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)  # the store's port is bound as the kernel picks it
        self._store = dist.TCPStore(self.host, 0, 2, True, timeout=timeout, wait_for_workers=False)
        answer: dict[str, Any] = {}
        body = {"master_address": self.host, "master_port": self._store.port, "rank_offset": 1, "world_size": 2,
                "group_name": GROUP_NAME, "backend": "gloo"}
        joiner = threading.Thread(target=self._call, args=("/init_weights_update_group", body, answer), daemon=True)
        joiner.start()
        store = dist.PrefixStore("cpu/", dist.PrefixStore(f"{GROUP_NAME}/", dist.PrefixStore(GROUP_NAME, self._store)))
        try:
            self._group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        finally:
            joiner.join(self.timeout_s)
        if "error" in answer:
            raise answer["error"]
        _ok(answer.get("value"), "/init_weights_update_group (backend gloo)")

    def _call(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        try:
            answer["value"] = self.post(path, body, timeout_s=self.timeout_s)
        except BaseException as e:  # reported by the caller
            answer["error"] = e

    def load(self, buckets: list[Named], version: int) -> dict[str, float]:
        if self._group is None:
            self._connect()
        return super().load(buckets, version)

    def _send(self, flat: Tensor, meta: list[SimpleNamespace], bucket: Named, body: dict[str, Any]) -> Any:
        body |= {"names": [k for k, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                 "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP_NAME}
        answer: dict[str, Any] = {}
        call = threading.Thread(target=self._call, args=(self.endpoint, body, answer), daemon=True)
        call.start()
        self._group.broadcast(flat, 0).wait()
        call.join(self.timeout_s)
        if "error" in answer:
            raise answer["error"]
        return answer.get("value")

    def release(self) -> None:
        """``POST /destroy_weights_update_group``: the server's side of the group goes (another engine's
        ``/init_weights_update_group`` under the same name is then accepted)."""
        if self._group is not None:
            _ok(self.post("/destroy_weights_update_group", {"group_name": GROUP_NAME}, timeout_s=self.timeout_s),
                "/destroy_weights_update_group")
            self.close()

    def close(self) -> None:
        self._group = self._store = self._flat = None


class DiskLoader:
    """``weight_load=disk``: a safetensors version directory, then ``/update_weights_from_disk``."""

    def __init__(self, post: Post, timeout_s: float, directory: Path) -> None:
        self.post, self.timeout_s, self.directory = post, timeout_s, directory

    def load(self, buckets: list[Named], version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        final = self.directory / f"v{int(version):08d}"
        tmp = self.directory / f".v{int(version):08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors, seen = {}, set()
        for k, t in (kv for b in buckets for kv in b):  # safetensors refuses tensors that share memory (tied weights)
            t = t.contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[k] = t.clone() if t.numel() and ptr in seen else t
            seen.add(ptr)
        save_file(tensors, str(tmp / "model.safetensors"))
        del tensors
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        t_written = time.perf_counter()
        loaded = False
        try:
            _ok(self.post("/update_weights_from_disk", {
                "model_path": str(final), "weight_version": str(int(version)), "flush_cache": True,
            }, timeout_s=self.timeout_s), f"the weights of version {version} (/update_weights_from_disk)")
            loaded = True
        finally:
            for old in self.directory.iterdir():
                if old != final or not loaded:
                    shutil.rmtree(old, ignore_errors=True)
        return {"copy_s": t_written - t0, "load_s": time.perf_counter() - t_written}

    def release(self) -> None:
        """Nothing of this path stays on the server (the engine's directory goes with the engine)."""

    def close(self) -> None:
        pass


def make_loader(kind: str, post: Post, timeout_s: float, directory: Path) -> TensorLoader | DistributedLoader | DiskLoader:
    if kind == "tensor":
        return TensorLoader(post, timeout_s)
    if kind == "distributed":
        return DistributedLoader(post, timeout_s)
    if kind == "disk":
        return DiskLoader(post, timeout_s, directory)
    raise ValueError(f"rollout.engine.weight_load={kind!r}; valid: {', '.join(WEIGHT_LOADS)}")


def weights_dir(engine_id: int) -> Path:
    """A fresh directory for this engine's weight versions, under ``<tmp>/miles-sglang-weights``.

    Its name starts with this process's pid. An actor killed by Ray never runs
    :meth:`~miles.rollout.sglang_engine.SGLangEngine.close`, so every new engine first removes the
    directories of processes that no longer run.
    """
    root = Path(tempfile.gettempdir()) / "miles-sglang-weights"
    root.mkdir(exist_ok=True)
    for old in root.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-engine{engine_id}-", dir=root))
