"""Weight sync by CUDA IPC handles between colocated processes on one GPU (``weight_sync=ipc``).

Trainer rank 0 packs the full state dict into one flat CUDA buffer (:class:`FlatLayout`) and sends
the engines a handle to it instead of the bytes: torch's own CUDA IPC reduction
(``torch.multiprocessing.reductions.reduce_tensor``), the mechanism ``torch.multiprocessing`` uses
to share CUDA tensors between processes. Each engine opens the handle, views the buffer with the
layout and copies it into its weights (``update_weights``): one device-to-device copy per engine,
nothing through host memory. Rank 0 keeps the buffer alive until the next version is packed, and
the driver runs the engines only after rank 0 returned, so a buffer is never read while written.

Needs ``placement=colocate`` with ``placement.device=cuda``: an engine and trainer rank 0 must see
the same physical GPU (they share a bundle's GPU). Refused otherwise, before anything starts
(:func:`check`). Not yet run on a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from miles.config.schema import WeightSyncConfig
from miles.config.validate import ConfigError
from miles.weights.layout import FlatLayout
from miles.weights.transport import Sent, Transport

_KEEP: dict[str, Any] = {}
"""This process's current buffer (rank 0): the engines' handles point into it."""


def check(placement_name: str, device: str) -> None:
    """Raise :class:`ConfigError` unless engines share trainer rank 0's GPU (colocate on CUDA)."""
    if placement_name != "colocate" or device != "cuda":
        raise ConfigError(
            f"weight_sync=ipc: CUDA IPC handles only work between processes on one GPU, i.e. placement=colocate "
            f"with placement.device=cuda; this run has placement={placement_name} on {device}. Use "
            "weight_sync=broadcast (NCCL on GPUs, gloo on CPUs) or object_store instead.")


class IpcSender:
    """Runs on trainer rank 0: the state dict into one CUDA buffer, a handle to it out."""

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> Sent:
        from torch.multiprocessing.reductions import reduce_tensor

        t0 = time.perf_counter()
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync=ipc: trainer rank 0 sees no CUDA device")
        layout = FlatLayout.of(state_dict)
        flat = _KEEP.get("flat")
        if flat is None or flat.numel() < layout.total_bytes:
            flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=torch.cuda.current_device())
        layout.pack(state_dict, flat)
        torch.cuda.synchronize()
        _KEEP["flat"] = flat  # the previous buffer, if replaced, is freed once no engine holds it
        handle = (layout.to_json(), reduce_tensor(flat))
        return Sent(handle=handle, bytes=layout.data_bytes, send_s=time.perf_counter() - t0)


class IpcReceiver:
    """Runs in an engine on the same GPU: views of rank 0's buffer (copied by ``update_weights``)."""

    def __init__(self, handle: tuple[str, Any]) -> None:
        self.handle = handle

    def receive(self, engine: Any) -> dict[str, torch.Tensor]:
        layout_json, (rebuild, args) = self.handle
        flat = rebuild(*args)
        return FlatLayout.from_json(layout_json).views(flat)


class IpcTransport(Transport):
    """``weight_sync.transport=ipc``: sequential, no state between syncs besides rank 0's buffer."""

    name = "ipc"
    concurrent = False

    def __init__(self, cfg: WeightSyncConfig, *, placement: str, device: str, **_: Any) -> None:
        check(placement, device)

    def sender(self, version: int) -> IpcSender:
        return IpcSender()

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> IpcReceiver:
        assert sent is not None
        return IpcReceiver(sent.handle)
