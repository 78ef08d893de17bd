"""What the SGLang engine's server holds: the checks of an update, the load itself, the initial push,
and what a parked engine undoes on a server it hands to the next job.

A base of :class:`miles.rollout.sglang_engine.SGLangEngine` (it holds the server, the checkpoint facts,
the adapters and the loaders these methods use). ``update_weights`` is in
:mod:`miles.rollout.sglang_calls`: :meth:`SGLangEngineWeights._check_update`, then the rows in flight
interrupted, then :meth:`SGLangEngineWeights._load_weights` on the idle server with new calls held,
then the rows continued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles.adapters import lora
from miles.config.schema import PrecisionConfig
from miles.rollout.engine_rows import _listing
from miles.rollout.sglang_lora import SGLangAdapters
from miles.rollout.sglang_weights import make_loader, nbytes, served_weights, split_buckets
from miles.rollout.sglang_wire import Checkpoint, fuse_experts, split_experts

log = logging.getLogger(__name__)


class SGLangEngineWeights:
    """Checks of an update, the load through ``weight_load`` or the adapters, the initial push, the reset."""

    checkpoint_dir: str
    precision: PrecisionConfig
    engine_id: int
    dtype: torch.dtype
    ckpt: Checkpoint
    adapters: SGLangAdapters | None
    weight_load: str
    bucket_bytes: int
    request_timeout_s: float
    _loaders: dict[str, Any]
    _weights_dir: Path
    _version: int
    _control: Callable[..., Any]

    def _check_update(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """``ValueError`` before anything is interrupted or sent: adapter tensors only for an engine with
        adapters (:meth:`SGLangAdapters.check`), else every checkpoint weight with its shape."""
        if self.adapters is not None:
            self.adapters.check(state_dict, version)
        else:
            self._check_full(state_dict, version)

    def _check_full(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        state_dict = split_experts(state_dict)  # fused MoE experts (transformers 5) -> the checkpoint's names
        shapes = self.ckpt.shapes
        missing = [k for k in shapes if k not in state_dict and k not in self.ckpt.optional]
        unexpected = [k for k in state_dict if k not in shapes]
        if missing or unexpected:
            raise ValueError(f"update_weights(version={version}): names must match the checkpoint's exactly; "
                             f"missing {_listing(missing)}, unexpected {_listing(unexpected)}. Send the full HF "
                             "state dict of the same architecture.")
        bad = [f"{k}: sent {tuple(v.shape)}, expected {shapes[k]}" for k, v in state_dict.items()
               if tuple(v.shape) != shapes[k]]
        bad += [f"{k}: sent {v.dtype}, expected a floating dtype" for k, v in state_dict.items()
                if not v.is_floating_point()]
        if bad:
            raise ValueError(f"update_weights(version={version}): wrong shapes or dtypes: {bad}")

    def _load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Make the checked ``state_dict`` the server's weights of ``version``; returns ``{"copy_s",
        "load_s", "quant_s", "bytes"}``. The caller makes sure no request runs on the server meanwhile
        (:meth:`~miles.rollout.sglang_calls.SGLangCalls.update_weights`, or the constructor).

        Adapter tensors go to :class:`~miles.rollout.sglang_lora.SGLangAdapters`; full weights are cast
        to the engine's dtype, fake-quantized by the recipe, and loaded through ``weight_load``. On an
        error from SGLang the version stays, and the weights may be partly new: send a full update again.
        """
        if self.adapters is not None and lora.is_adapter_state(state_dict):
            metrics = self.adapters.load(lora.split_sync_state(state_dict), version)
            self._version = int(version)
            return {"copy_s": 0.0, "quant_s": 0.0, **metrics}
        t0 = time.perf_counter()
        served = split_experts(served_weights(state_dict, self.precision, self.dtype))
        quant_s = time.perf_counter() - t0
        named = list(served.items())
        loader = self._loaders.get(self.weight_load)
        if loader is None:
            loader = self._loaders[self.weight_load] = make_loader(self.weight_load, self._control,
                                                                   self.request_timeout_s, self._weights_dir)
        metrics = loader.load(split_buckets(named, self.bucket_bytes), version)
        self._version = int(version)
        return {**metrics, "quant_s": quant_s, "bytes": float(nbytes(named))}

    def _push_initial(self) -> None:
        """What the server must hold before the first request, beyond the checkpoint's weights: the
        recipe's quantized weights (version 0), and each adapter (zero: the base model's outputs)."""
        if self.precision.rollout_quant != "none":
            from safetensors.torch import load_file

            state: dict[str, torch.Tensor] = {}
            for f in sorted(Path(self.checkpoint_dir).glob("*.safetensors")):
                state.update(load_file(str(f)))
            state = fuse_experts(state)  # quantized as the torch engine's transformers model holds them
            metrics = self._load_weights(state, self._version)
            log.info("engine %d: %s-quantized weights loaded in %.2f s", self.engine_id,
                     self.precision.rollout_quant, metrics["load_s"] + metrics["copy_s"] + metrics["quant_s"])
        if self.adapters is not None:
            self._load_weights({f"{lora.SYNC_PREFIX}{n}:{k}": v for n, sd in self.adapters.zeros().items()
                                for k, v in sd.items()}, self._version)

    def _release_server(self) -> None:
        """Undo on the server what this engine added to it, so that the next job's engine can take it
        (:meth:`~miles.rollout.sglang_engine.SGLangEngine._end_job`): its adapters unloaded and the
        ``distributed`` path's group destroyed. The weights themselves are the next engine's to reload.
        Raises when SGLang refuses (the server is then not kept)."""
        if self.adapters is not None:
            self.adapters.unload_all()
        for loader in self._loaders.values():
            loader.release()

    def _close_loaders(self) -> None:
        """Drop the loaders' memory (shared-memory staging buffer, the engine's end of a group)."""
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()
