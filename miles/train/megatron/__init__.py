"""Megatron-core trainer backend: ``trainer=megatron`` (``miles.train.megatron.MegatronTrainer``).

TP, PP (1F1B), DP and MoE EP with megatron-core's own model, schedules and DDP; on CPU over gloo
with a small compatibility layer (:mod:`.compat`). Importing this package imports nothing from
megatron: :class:`MegatronTrainer` is loaded on first access, and megatron with its first instance.

Modules: :mod:`.arch` (what is read from the HF config), :mod:`.dims` (parallel sizes, validated
together), :mod:`.compat` (CPU redirects), :mod:`.model` (the ``GPTModel``), :mod:`.mapping` and
:mod:`.collect` (HF <-> megatron shards), :mod:`.load` (each rank's slices read from the checkpoint's
safetensors files), :mod:`.logits` (vocab-parallel log-probs), :mod:`.grads` (global grad-norm
clipping), :mod:`.quant` (quantization-aware forward), :mod:`.replay` (MoE routing replay),
:mod:`.engine` (groups, passes, reductions), :mod:`.policy` (a rank's model, optimizer and train passes),
:mod:`.state` and :mod:`.sharded_state` (checkpoints; each rank writes its own shard), :mod:`.trainer` (the
actor's API); LoRA (``adapter=lora``, tenants): :mod:`.lora_layout` (where each adapter tensor sits), :mod:`.lora`
(adapters on the parallel linears), :mod:`.tenants` (train step per adapter), :mod:`.lora_state`
(sync, export, checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.train.megatron.trainer import MegatronTrainer

__all__ = ["MegatronTrainer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTrainer":
        from miles.train.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
