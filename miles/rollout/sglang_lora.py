"""LoRA adapters on an SGLang server: SGLang's own LoRA serving, fed with miles' adapter-only updates.

An SGLang engine built with ``adapter`` (``kind: lora``) starts its server with ``--enable-lora``,
``--max-lora-rank``, ``--lora-target-modules`` and ``--lora-backend`` (``torch_native`` on CPU: SGLang's
PyTorch LoRA kernels; the others are Triton / CUDA), and loads one adapter per name of
``adapter_names`` with ``POST /load_lora_adapter_from_tensors`` (PEFT names, the
``adapter_config.json`` that :func:`miles.adapters.lora.export_adapter` writes, the tensors through
shared memory: :func:`miles.rollout.sglang_weights.shared_pickle`). At start every adapter is zero,
so it serves the base model, as a freshly initialized PEFT adapter (``lora_B = 0``) does.

An adapter-only update (:func:`miles.adapters.lora.sync_state` names) is checked against the PEFT
keys and shapes the adapters must have, then, once the engine has interrupted the rows in flight
(:mod:`miles.rollout.sglang_calls`: an adapter update changes the outputs as a full one does), each
adapter is loaded under a new SGLang name ``<name>@<version>``, the server's weight version is set
(``/update_weight_version``), and the previous name is unloaded (no request uses it any more).
Every post after the update, the interrupted rows' continuations included, names the new adapter
(``lora_path`` per row). A parked engine unloads its adapters before the next job takes its server
(:meth:`SGLangAdapters.unload_all`).

On CPU SGLang's LoRA code runs with miles' compatibility layer (``pin_memory`` a no-op:
:mod:`miles.rollout.sglang_cpu.sitecustomize`); without it the server dies at start with
``RuntimeError: Found no NVIDIA driver on your system``. In fp32 SGLang's greedy log-probs with an
adapter equal the torch engine's with the same adapter (``tests/test_sglang_lora_moe.py``).

One limit of SGLang 0.5.23's ``torch_native`` backend: it applies an ``lm_head`` adapter with the
segments of the prompt tokens, not of the positions whose logits are computed, so a prefill batch
that mixes rows of different adapters (or of an adapter and the base model) gives some rows another
row's ``lm_head`` update (wrong greedy tokens: ``tests/test_sglang_lora_moe.py``; decoding steps, one
position per row, are right, and so are mixed rows of adapters without ``lm_head``). With
``lm_head`` among ``adapter.target_modules`` and that backend the engine therefore serves one
adapter and refuses requests for the base model; old and new names of an adapter never prefill
together, as every update drains the server first. SGLang's other backends (Triton / CUDA) build ``lm_head``
segments of their own; the GPU path is untested.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import torch
from torch import Tensor

from miles.adapters import lora
from miles.config.schema import AdapterConfig
from miles.rollout.engine_rows import _listing
from miles.rollout.sglang_weights import Post, shared_pickle

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
"""The HF linear layers the SGLang engine puts adapters on (SGLang's ``SUPPORTED_LORA_TARGET_MODULES``
that Qwen-style checkpoints name)."""
LM_HEAD_MIXING = ("SGLang 0.5.23's torch_native LoRA backend applies an lm_head adapter with the prompt-token "
                  "segments, so a prefill batch that mixes adapters (or an adapter and the base model) computes "
                  "wrong logits for some rows")


def resolve_backend(backend: str | None, device: str) -> str | None:
    """SGLang's ``--lora-backend``: ``backend``, else ``torch_native`` on CPU (the only one without
    Triton / CUDA), else None (SGLang's default)."""
    return backend or ("torch_native" if device == "cpu" else None)


def check_adapter(cfg: AdapterConfig, names: tuple[str, ...], backend: str | None) -> None:
    """``ValueError`` for what the SGLang engine cannot serve with these adapters on LoRA ``backend``."""
    other = [m for m in cfg.target_modules if m not in LINEAR_TARGETS]
    if other:
        raise ValueError(f"adapter.target_modules: the SGLang engine serves LoRA on {list(LINEAR_TARGETS)}; found "
                         f"{other}. Remove them, or use rollout=torch")
    if backend == "torch_native" and "lm_head" in cfg.target_modules and len(names) > 1:
        raise ValueError(f"adapter.target_modules has lm_head with {len(names)} adapters ({list(names)}): "
                         f"{LM_HEAD_MIXING}. Leave lm_head out of adapter.target_modules, or use rollout=torch")


def server_args(cfg: AdapterConfig, names: tuple[str, ...], backend: str | None) -> list[str]:
    """Launch flags: LoRA on, the rank and modules, and batch slots for each adapter's old and new
    version plus the base model."""
    args = ["--enable-lora", "--max-lora-rank", str(cfg.rank), "--max-loras-per-batch", str(2 * len(names) + 1),
            "--lora-target-modules", *cfg.target_modules]
    return args + (["--lora-backend", backend] if backend else [])


def adapter_shapes(cfg: AdapterConfig, weight_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``{PEFT key: shape}`` of one adapter on a checkpoint with these weight shapes (HF names)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in sorted(weight_shapes.items()):
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or module.rsplit(".", 1)[-1] not in cfg.target_modules:
            continue
        if ".experts." in module:  # transformers 5 fuses MoE experts into 3-D tensors: peft adapts no expert
            continue
        out[f"base_model.model.{module}.lora_A.weight"] = (cfg.rank, shape[1])
        out[f"base_model.model.{module}.lora_B.weight"] = (shape[0], cfg.rank)
    return out


class SGLangAdapters:
    """The adapters one SGLang server holds, by miles name: their current SGLang names, checks, loads."""

    def __init__(self, cfg: AdapterConfig, names: tuple[str, ...], weight_shapes: Mapping[str, tuple[int, ...]],
                 post: Post, timeout_s: float, dtype: torch.dtype, backend: str | None) -> None:
        if not names or len(set(names)) != len(names) or lora.BASE in names:
            raise ValueError(f"adapter names must be distinct and not {lora.BASE!r}; got {list(names)}")
        self.cfg, self.names, self.post, self.timeout_s, self.dtype = cfg, tuple(names), post, timeout_s, dtype
        self.shapes = adapter_shapes(cfg, weight_shapes)
        if not self.shapes:
            raise ValueError(f"adapter.target_modules={list(cfg.target_modules)} name no 2-D weight of the checkpoint")
        self.no_base_model = (f"the engine holds an lm_head adapter: {LM_HEAD_MIXING}"
                              if "lm_head" in cfg.target_modules and backend == "torch_native" else None)
        config = lora.lora_config(cfg, inference=True).to_dict()
        self.config = json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()},
                                            default=str))
        self.current: dict[str, str] = {}

    def default(self) -> str:
        return self.names[0]

    def lora_path(self, adapter: str | None) -> str | None:
        """SGLang's ``lora_path`` of a request for ``adapter`` (None: the default one; ``lora.BASE``: none)."""
        return None if adapter == lora.BASE else self.current[adapter or self.default()]

    def check(self, state_dict: Mapping[str, Tensor], version: int) -> dict[str, dict[str, Tensor]]:
        """``{adapter: {PEFT key: tensor}}`` of an adapter-only update; ``ValueError`` before anything is sent."""
        if not lora.is_adapter_state(dict(state_dict)):
            raise ValueError(f"update_weights(version={version}): this engine serves LoRA adapters on frozen base "
                             f"weights and takes adapter tensors only (names '{lora.SYNC_PREFIX}<adapter>:<PEFT key>'); "
                             f"got {_listing(sorted(state_dict))}")
        sent = lora.split_sync_state(dict(state_dict))
        errors = [f"unknown adapter {n!r} (held: {list(self.names)})" for n in sent if n not in self.names]
        for n, sd in sent.items():
            if n not in self.names:
                continue
            missing, unexpected = sorted(set(self.shapes) - set(sd)), sorted(set(sd) - set(self.shapes))
            if missing or unexpected:
                errors.append(f"adapter {n!r}: missing {_listing(missing)}, unexpected {_listing(unexpected)}")
            errors += [f"{n}:{k}: sent {tuple(v.shape)}, expected {self.shapes[k]}"
                       for k, v in sd.items() if k in self.shapes and tuple(v.shape) != self.shapes[k]]
            errors += [f"{n}:{k}: sent {v.dtype}, expected a floating dtype" for k, v in sd.items()
                       if not v.is_floating_point()]
        if errors:
            raise ValueError(f"update_weights(version={version}): {'; '.join(errors)}")
        return sent

    def zeros(self) -> dict[str, dict[str, Tensor]]:
        """Every adapter with zero tensors: the base model's outputs."""
        return {n: {k: torch.zeros(s, dtype=self.dtype) for k, s in self.shapes.items()} for n in self.names}

    def load(self, sent: Mapping[str, Mapping[str, Tensor]], version: int) -> dict[str, float]:
        """Load each sent adapter under ``<name>@<version>``, switch requests to it and unload the name it
        replaces; the caller makes sure no request is on the server."""
        t0 = time.perf_counter()
        stale = []
        for n, sd in sent.items():
            tag = f"{n}@{int(version)}"
            if self.current.get(n) == tag:
                raise ValueError(f"adapter {n!r} already holds version {version}")
            tensors = {k: v.detach().to("cpu", self.dtype, copy=True).contiguous() for k, v in sd.items()}
            out = self.post("/load_lora_adapter_from_tensors", {
                "lora_name": tag, "config_dict": self.config, "serialized_named_tensors": [shared_pickle(tensors)],
            }, timeout_s=self.timeout_s)
            if not (isinstance(out, dict) and out.get("success")):
                raise RuntimeError(f"SGLang refused adapter {n!r} of version {version}: {out}")
            if n in self.current:
                stale.append(self.current[n])
            self.current[n] = tag
        out = self.post("/update_weight_version", {"new_version": str(int(version)), "abort_all_requests": False},
                        timeout_s=self.timeout_s)
        if not (isinstance(out, dict) and out.get("success")):
            raise RuntimeError(f"SGLang did not take weight version {version}: {out}")
        self._unload(stale)
        nbytes = float(sum(v.numel() * v.element_size() for sd in sent.values() for v in sd.values()))
        return {"load_s": time.perf_counter() - t0, "bytes": nbytes}

    def unload_all(self) -> None:
        """Unload every adapter this engine loaded (the server keeps running without them)."""
        tags, self.current = list(self.current.values()), {}
        self._unload(tags)

    def _unload(self, tags: list[str]) -> None:
        for tag in tags:
            out = self.post("/unload_lora_adapter", {"lora_name": tag}, timeout_s=self.timeout_s)
            if not (isinstance(out, dict) and out.get("success")):
                raise RuntimeError(f"SGLang did not unload adapter {tag!r}: {out}")
