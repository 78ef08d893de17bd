"""Loading weights into the SGLang engine's server: checks, the load itself, the initial push.

A base of :class:`miles.rollout.sglang_engine.SGLangEngine` (it holds the server, the checkpoint facts,
the adapters and the request bookkeeping these methods use). ``update_weights`` itself stays in the
engine: checks, then :meth:`SGLangEngineWeights._load_weights`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    """Checks of a full update, the load through ``weight_load`` or the adapters, holding calls around it."""

    checkpoint_dir: str
    precision: PrecisionConfig
    engine_id: int
    dtype: torch.dtype
    ckpt: Checkpoint
    adapters: SGLangAdapters | None
    weight_load: str
    bucket_bytes: int
    request_timeout_s: float
    _cv: threading.Condition
    _update_lock: threading.Lock
    _inflight: dict[str, set[str]]
    _loaders: dict[str, Any]
    _weights_dir: Path
    _paused: bool
    _holding: bool
    _version: int
    _control: Callable[..., Any]
    _stopped: Callable[[], bool]

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
        "load_s", "quant_s", "bytes"}``.

        Adapter tensors go to :class:`~miles.rollout.sglang_lora.SGLangAdapters`; full weights are cast
        to the engine's dtype, fake-quantized by the recipe, and loaded through ``weight_load``. A load
        of more than one call (several buckets or adapters, or an ``lm_head`` adapter) first holds new
        calls and waits for the calls in flight (not while paused: paused rows finish after
        ``resume``). On an error from SGLang the version stays, and the weights may be partly new:
        send a full update again.
        """
        with self._update_lock:
            if self.adapters is not None and lora.is_adapter_state(state_dict):
                sent = lora.split_sync_state(state_dict)
                with self._quiesced(len(sent) > 1 or self.adapters.lm_head) as drained:
                    metrics = self.adapters.load(sent, version, drained)
                self._version = int(version)
                return {"copy_s": 0.0, "quant_s": 0.0, **metrics}
            return self._load_full(state_dict, version)

    def _load_full(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        served = split_experts(served_weights(state_dict, self.precision, self.dtype))
        quant_s = time.perf_counter() - t0
        named = list(served.items())
        buckets = split_buckets(named, self.bucket_bytes)
        loader = self._loaders.get(self.weight_load)
        if loader is None:
            loader = self._loaders[self.weight_load] = make_loader(self.weight_load, self._control,
                                                                   self.request_timeout_s, self._weights_dir)
        with self._quiesced(len(buckets) > 1):
            metrics = loader.load(buckets, version)
        self._version = int(version)
        return {**metrics, "quant_s": quant_s, "bytes": float(nbytes(named))}

    @contextmanager
    def _quiesced(self, hold: bool) -> Iterator[bool]:
        """Within it (when ``hold``), new ``generate`` calls wait; on entry the calls in flight have
        returned, unless the engine is paused. Yields whether they have (nothing runs on the server)."""
        if not hold:
            yield False
            return
        deadline = time.monotonic() + self.request_timeout_s
        with self._cv:
            self._holding = True
            while self._inflight and not self._paused and not self._stopped() and time.monotonic() < deadline:
                self._cv.wait(0.05)
            drained = not self._inflight
        try:
            yield drained
        finally:
            with self._cv:
                self._holding = False
                self._cv.notify_all()

    def _push_initial(self) -> None:
        """What the server must hold before the first request, beyond the checkpoint's weights: the
        recipe's quantized weights (version 0), and each adapter (zero: the base model's outputs)."""
        if self.precision.rollout_quant != "none":
            from safetensors.torch import load_file

            state: dict[str, torch.Tensor] = {}
            for f in sorted(Path(self.checkpoint_dir).glob("*.safetensors")):
                state.update(load_file(str(f)))
            state = fuse_experts(state)  # quantized as the torch engine's transformers model holds them
            with self._update_lock:
                metrics = self._load_full(state, self._version)
            log.info("engine %d: %s-quantized weights loaded in %.2f s", self.engine_id,
                     self.precision.rollout_quant, metrics["load_s"] + metrics["copy_s"] + metrics["quant_s"])
        if self.adapters is not None:
            self._load_weights({f"{lora.SYNC_PREFIX}{n}:{k}": v for n, sd in self.adapters.zeros().items()
                                for k, v in sd.items()}, self._version)
