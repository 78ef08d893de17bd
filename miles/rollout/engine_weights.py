"""Weight updates and memory release of :class:`miles.rollout.torch_engine.TorchEngine`.

:class:`EngineWeights` checks and applies a full weight update (or, for an engine holding LoRA adapters,
an update of the adapter tensors only) between two scheduler steps, reports the engine's weights and
adapters, and drops / restores the KV cache and the weights for colocation
(``release_memory`` / ``resume_memory``; see :mod:`miles.rollout.torch_engine`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import deque
from typing import Any

import torch
from torch import Tensor

from miles.adapters import lora
from miles.config.schema import PrecisionConfig
from miles.precision.recipe import apply_rollout_quant
from miles.rollout.engine_rows import _listing, _Row
from miles.rollout.prefix_cache import PrefixStore
from miles.rollout.slot_cache import SlotCache

log = logging.getLogger("miles.rollout.torch_engine")


class EngineWeights:
    """Weight and adapter updates, state dicts, memory release and restore; a base of
    :class:`~miles.rollout.torch_engine.TorchEngine`, whose constructor sets the attributes below."""

    engine_id: int
    model: Any
    precision: PrecisionConfig
    max_batch_size: int
    noise_chunk: int
    vocab_size: int
    device: torch.device
    _version: int
    _weights: dict[str, Tensor]
    _required: list[str]
    _shapes: dict[str, tuple[int, ...]]
    _peft: Any
    _adapters: dict[str, dict[str, Tensor]]
    _offload: int | dict[str, Tensor] | None  # int: the descriptor of a nameless file (offload_to_file)
    _pin: Any  # miles.weights.shm_pins.Pin while the weights are a shared slot's views, else None
    _fast: Any
    _released: bool
    _st: dict[str, Tensor]
    _rows: list[_Row | None]
    _n: int
    _waiting: deque[_Row]
    _cache: SlotCache
    _prefix: PrefixStore

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, Tensor], version: int) -> dict[str, float]:
        """Replace every weight (HF names), re-apply rollout quantization, set ``version``.

        All checks happen before any copy: on a ``ValueError`` the engine is unchanged. The copy
        runs between two scheduler steps (see :mod:`miles.rollout.torch_engine` for in-flight rows).
        Returns ``{"update_s", "quant_s", "bytes", "bytes_per_s"}`` (bytes as received).
        """
        t0 = time.perf_counter()
        self._check_open("update_weights")
        if self._peft is not None:
            return self._update_adapters(state_dict, version, t0)
        self._check_full(state_dict, version)

        def apply() -> tuple[float, float]:
            self._check_open("update_weights")
            if self._released or self._pin is not None:  # every weight is about to be overwritten: allocate
                self._reacquire()  # (skipping the offloaded copy, and never writing into a shared slot)
            t_copy = time.perf_counter()
            for k, v in state_dict.items():
                # casts to the engine dtype and device; detached, so that a transport's tensor type (shm's
                # arriving chunks) handles the copy rather than Parameter's
                self._weights[k].detach().copy_(v)
            t1 = time.perf_counter()
            apply_rollout_quant(self.model, self.precision)
            self._new_version(version)
            return t1 - t_copy, time.perf_counter() - t1

        copy_s, quant_s = self._run_op(apply)
        nbytes = float(sum(v.numel() * v.element_size() for v in state_dict.values()))
        return {"update_s": time.perf_counter() - t0, "quant_s": quant_s, "bytes": nbytes,
                "bytes_per_s": nbytes / max(copy_s, 1e-9), "in_place": 0.0}

    def _new_version(self, version: int) -> None:
        """After the weights changed (scheduler thread): the version, and nothing computed from the old ones."""
        self._version = int(version)
        self._prefix.clear()
        if self._fast is not None:
            self._fast.forget()

    def _adopt(self, shared: Any, version: int, t0: float) -> dict[str, float]:
        """:meth:`update_weights` from a shared-memory slot without copying: the weights become the slot's
        views (``shared``: :class:`miles.weights.shm.Shared`), pinned so that rank 0 does not write there
        while the engine computes from them. An engine whose dtypes differ from the slot's copies instead."""
        views = shared.views
        self._check_full(views, version)
        if any(v.dtype != self._weights[k].dtype for k, v in views.items()):
            return self.update_weights(views, version)

        def apply() -> None:
            self._check_open("update_weights")
            if self._released:
                self._drop_offload()
            self._pin = shared.pin.take_over(self._pin)  # before the first use: the slot keeps this version
            for k, v in views.items():
                self._weights[k].data = v
            self._new_version(version)

        self._run_op(apply)
        nbytes = float(sum(v.numel() * v.element_size() for v in views.values()))
        seconds = time.perf_counter() - t0
        return {"update_s": seconds, "quant_s": 0.0, "bytes": nbytes, "bytes_per_s": nbytes / max(seconds, 1e-9),
                "in_place": 1.0}

    def _in_place(self) -> bool:
        """Whether this engine can compute from a shared slot's views: no adapters (their layers wrap the base
        weights), no rollout quantization (it rewrites the weights), on the CPU (the slot is host memory)."""
        return self._peft is None and self.precision.rollout_quant == "none" and self.device.type == "cpu"

    def _check_full(self, state_dict: dict[str, Tensor], version: int) -> None:
        """The checks of a full update (names, shapes, dtypes): a ``ValueError`` before anything changes."""
        missing = [k for k in self._required if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._weights]
        if missing or unexpected:
            raise ValueError(f"update_weights(version={version}): names must match the engine's model "
                             f"exactly; missing {_listing(missing)}, unexpected {_listing(unexpected)}. "
                             "Send the full HF state dict of the same architecture.")
        bad = [f"{k}: sent {tuple(v.shape)}, expected {self._shapes[k]}"
               for k, v in state_dict.items() if tuple(v.shape) != self._shapes[k]]
        bad += [f"{k}: sent {v.dtype}, expected a floating dtype" for k, v in state_dict.items()
                if self._weights[k].is_floating_point() and not v.is_floating_point()]
        if bad:
            raise ValueError(f"update_weights(version={version}): wrong shapes or dtypes: {bad}")

    def _update_adapters(self, state_dict: dict[str, Tensor], version: int, t0: float) -> dict[str, float]:
        """:meth:`update_weights` of an engine with adapters: the state dict holds adapter tensors only
        (:func:`miles.adapters.lora.sync_state`); the base weights are frozen and stay as loaded."""
        if not lora.is_adapter_state(state_dict):
            raise ValueError(f"update_weights(version={version}): this engine serves LoRA adapters on frozen base "
                             f"weights and takes adapter tensors only (names '{lora.SYNC_PREFIX}<adapter>:<PEFT key>'); "
                             f"got {_listing(sorted(state_dict))}")
        sent = lora.split_sync_state(state_dict)
        errors = [f"unknown adapter {n!r} (held: {sorted(self._adapters)})" for n in sent if n not in self._adapters]
        for n, sd in sent.items():
            if n not in self._adapters:
                continue
            held = self._adapters[n]
            missing, unexpected = sorted(set(held) - set(sd)), sorted(set(sd) - set(held))
            if missing or unexpected:
                errors.append(f"adapter {n!r}: missing {_listing(missing)}, unexpected {_listing(unexpected)}")
            errors += [f"{n}:{k}: sent {tuple(v.shape)}, expected {tuple(held[k].shape)}"
                       for k, v in sd.items() if k in held and tuple(v.shape) != tuple(held[k].shape)]
        if errors:
            raise ValueError(f"update_weights(version={version}): {'; '.join(errors)}")

        def apply() -> float:
            self._check_open("update_weights")
            self._restore()  # a released engine gets its base weights back (adapters are never offloaded)
            t_copy = time.perf_counter()
            for n, sd in sent.items():
                for k, v in sd.items():
                    self._adapters[n][k].detach().copy_(v)
            self._version = int(version)
            self._prefix.clear()
            return time.perf_counter() - t_copy

        copy_s = self._run_op(apply)
        nbytes = float(sum(v.numel() * v.element_size() for v in state_dict.values()))
        return {"update_s": time.perf_counter() - t0, "quant_s": 0.0, "bytes": nbytes,
                "bytes_per_s": nbytes / max(copy_s, 1e-9)}

    def adapter_state(self, name: str) -> dict[str, Tensor]:
        """CPU copies of adapter ``name``'s tensors as the engine holds them: ``{PEFT key: tensor}``."""
        if name not in self._adapters:
            raise ValueError(f"engine {self.engine_id}: no adapter {name!r} (held: {sorted(self._adapters)})")
        return self._run_op(lambda: {k: v.detach().to("cpu", copy=True) for k, v in self._adapters[name].items()})

    def update_weights_from(self, receiver: Any, version: int) -> dict[str, float]:
        """``sd = receiver.receive(self)`` (a transport's receiving end), then :meth:`update_weights`; from a
        receiver that offers the version's shared memory (``receive_shared``, :mod:`miles.weights.shm`), an
        engine that can (:meth:`_in_place`) computes from it in place instead: no copy (``in_place`` 1)."""
        t0 = time.perf_counter()
        if hasattr(receiver, "receive_shared") and self._in_place():
            shared = receiver.receive_shared(self)
            return {**self._adopt(shared, version, time.perf_counter()), "receive_s": time.perf_counter() - t0}
        state_dict = receiver.receive(self)
        receive_s = time.perf_counter() - t0
        return {**self.update_weights(state_dict, version), "receive_s": receive_s}

    def state_dict(self) -> dict[str, Tensor]:
        """CPU copies of the engine's weights as it computes with them (after quantization)."""
        self._check_usable("state_dict")
        return self._run_op(lambda: {k: v.detach().to("cpu", copy=True) for k, v in self._weights.items()})

    def release_memory(self) -> dict[str, Any]:
        """Drop the KV cache and offload the weights (colocation); rows still in flight are aborted.
        Returns :meth:`health` as it is right after: the loop's check before the next weight push."""
        self._run_op(self._release)
        return self.health()

    def resume_memory(self) -> None:
        """Restore what :meth:`release_memory` offloaded, bit-exactly."""
        self._run_op(self._restore)

    def _release(self) -> None:
        if self._released:
            return
        if self._n or self._waiting:  # never left hanging: they come back ABORTED
            log.warning("engine %d: release_memory aborts %d running and %d queued rows", self.engine_id,
                        self._n, len(self._waiting))
            self._abort({r.request.request_id for r in [*self._rows[: self._n], *self._waiting] if r is not None})
        self._cache = SlotCache(self.max_batch_size)  # the old buffers are freed
        self._prefix.clear()
        for k in ("out_tok", "out_lp", "out_ver", "top_v", "top_i", "route", "noise", "snoise"):  # regrown / redrawn
            self._st[k] = self._st[k].new_zeros((self.max_batch_size, 0, *self._st[k].shape[2:]))
        unique = {k: self._weights[k] for k in self._required}
        if self._pin is not None:  # computing from a pinned shared slot: its pages stay, nothing to save
            self._offload = {k: v.data for k, v in unique.items()}
        elif self.device.type == "cpu":
            self._offload = offload_to_file({k: v.detach().contiguous() for k, v in unique.items()},
                                            f"miles-engine{self.engine_id}-")
        else:
            self._offload = {k: v.detach().to("cpu", copy=True) for k, v in unique.items()}
        for v in unique.values():
            v.data = torch.empty(0, dtype=v.dtype, device=v.device)
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore(self) -> None:
        if not self._released:
            return
        if isinstance(self._offload, int):
            saved = load_offload(self._offload)
        else:
            saved = self._offload or {}
        for k, v in saved.items():
            self._weights[k].data = v.to(self.device)
        self._regrow_noise()
        self._offload, self._released = None, False

    def _reacquire(self) -> None:
        """Released or computing from a shared slot -> usable with uninitialised weights of its own (a full
        update fills them); drops the offloaded copy and the pin."""
        if self._released:
            self._drop_offload()
        for k in self._required:
            w = self._weights[k]
            w.data = torch.empty(self._shapes[k], dtype=w.dtype, device=self.device)
        if self._pin is not None:
            self._pin.unpin()
            self._pin = None

    def _drop_offload(self) -> None:
        """Released -> not released, the weights left as they are (about to be replaced whole)."""
        if isinstance(self._offload, int):
            os.close(self._offload)
        self._regrow_noise()
        self._offload, self._released = None, False

    def _regrow_noise(self) -> None:
        """The noise buffer the release dropped, uninitialised: every row draws its noise before it reads it,
        so zeroing its ``max_batch_size x noise_chunk x V`` floats (4.7 MB for the tiny model) is not needed."""
        self._st["noise"] = torch.empty(self.max_batch_size, self.noise_chunk, self.vocab_size, device=self.device)
        self._st["snoise"] = self._spec_noise_buffer()  # type: ignore[attr-defined]


def offload_to_file(tensors: dict[str, Tensor], prefix: str) -> int:
    """Write ``tensors`` (safetensors) to a file in the temporary directory and return a descriptor of it, open
    for reading, after its name is gone: the file exists only while the descriptor does, so the kernel frees it
    when the engine closes it or its process dies (a named file would stay behind an engine killed while
    released). Only a death inside this call can leave a name behind."""
    from safetensors.torch import save_file

    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, path)
        return os.open(path, os.O_RDONLY)
    finally:
        os.unlink(path)


def load_offload(fd: int) -> dict[str, Tensor]:
    """The tensors of :func:`offload_to_file`'s file ``fd`` (read through ``/proc/self/fd``); closes ``fd``."""
    from safetensors.torch import load_file

    try:
        return load_file(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
