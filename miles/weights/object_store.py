"""Weight sync through the Ray object store (``weight_sync.transport=object_store``; ``auto`` starts with it).

Trainer rank 0 puts the full state dict in the object store once per version (each tensor as its
raw bytes); every engine gets the same object as zero-copy views and applies it as one version.
Works wherever Ray does. The engines' calls start with the trainers' (``pipelined``): each engine
waits for rank 0's answer itself, so the driver waits once per sync, not twice.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import ray
import torch

from miles.config.schema import WeightSyncConfig
from miles.weights.transport import PendingSent, Sent, Transport


class ObjectStoreSender:
    """Runs on trainer rank 0: one ``ray.put`` per version.

    Each tensor goes in as its raw bytes (a uint8 numpy view, no copy), which Ray stores out of
    band and hands back as zero-copy read-only views; pickled torch tensors are copied on both
    ends instead (measured 3.3 s vs 0.08 s for 380 MiB).
    """

    def send(self, state_dict: dict[str, Any], version: int) -> Any:
        t0 = time.perf_counter()
        raw = {k: (tuple(t.shape), str(t.dtype).removeprefix("torch."),
                   t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
               for k, t in state_dict.items()}
        ref = ray.put(raw)
        nbytes = sum(a.nbytes for _, _, a in raw.values())
        # in a list, so that Ray passes the ref on instead of resolving it
        return Sent(handle=[ref], bytes=nbytes, send_s=time.perf_counter() - t0)


class ObjectStoreReceiver:
    """Runs in an engine: the version's tensors as read-only views of the object store (no copy).
    Started with the sender (``handle`` a :class:`PendingSent`), it first waits for rank 0's answer."""

    def __init__(self, handle: list | PendingSent) -> None:
        self.handle = handle

    def receive(self, engine: Any) -> dict[str, torch.Tensor]:
        refs = self.handle
        if isinstance(refs, PendingSent):
            sent = ray.get(refs.ref)  # rank 0's Sent, or its error (the sync fails on this engine too)
            if not isinstance(sent, Sent):
                raise RuntimeError(f"trainer rank 0's send_weights returned {type(sent).__name__}, not what it sent")
            refs = sent.handle
        raw = ray.get(refs[0])
        with warnings.catch_warnings():  # read-only views: update_weights only reads them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {k: torch.from_numpy(a).view(getattr(torch, dtype)).view(shape)
                    for k, (shape, dtype, a) in raw.items()}


class ObjectStoreTransport(Transport):
    """``weight_sync.transport=object_store``: no state between syncs."""

    name = "object_store"
    concurrent = False
    pipelined = True

    def __init__(self, cfg: WeightSyncConfig, **_: Any) -> None:
        pass

    def sender(self, version: int) -> ObjectStoreSender:
        return ObjectStoreSender()

    def receiver(self, engine_index: int, version: int, sent: Sent | PendingSent) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(sent if isinstance(sent, PendingSent) else sent.handle)
