"""Quantization-aware training in the megatron trainer: the FSDP trainer's quantizers on megatron's linears.

``precision.train_quant`` wraps the forward of every layer that owns a linear weight the engine serves
quantized (:func:`miles.precision.recipe.quantize_train_forward`: fake quantization with a
straight-through estimator, read at call time). In megatron these are the weights of kind ``qkv``,
``glu`` and ``row`` (:mod:`.mapping`): ``linear_qkv``, ``linear_fc1`` (column-parallel) and
``linear_proj``, ``linear_fc2`` (row-parallel), experts' included; never the embeddings, the output
layer, norms or the router, as in :func:`miles.precision.recipe.is_quantized_weight`.

Same numbers as FSDP. The 1-D formats (``int4``: group ``precision.quant_block_size``, ``mxfp8``:
32) give each block along the input dimension its own scale from that block's values alone, so
quantizing a megatron tensor equals quantizing its HF pieces whenever every block lies whole on one
rank at the same columns:

* column-parallel layers hold whole rows (every input column). Megatron's fused layouts reorder and
  cut rows only (``linear_qkv``: per query group ``[q; k; v]`` rows; ``linear_fc1``: ``[gate; up]``
  rows of the rank), so any TP is exact;
* row-parallel layers cut the input dimension over TP: rank ``r`` holds columns ``[r X/T, (r+1) X/T)``.
  With ``X/T`` a multiple of the block every block lies whole on one rank (exact); otherwise a block
  straddles two ranks and each would compute its own scale, so :func:`check_train_quant` refuses it;
* experts are whole per rank under expert parallelism (quantized one expert at a time, as FSDP's
  fused ``[E, out, in]`` tensors are).

Refused formats: ``fp8_block`` (its 128 x 128 tiles span 128 rows, which in ``linear_qkv`` mix the
q, k and v rows of several query groups: other tiles than the HF tensors') and ``nvfp4`` (one
per-tensor scale per HF tensor: megatron fuses q, k, v and gate, up into one tensor and shards it over
TP, so the scale would span other values).

bf16 (``precision.train_dtype=bfloat16``, fp32 parameters under autocast): the weight is rounded to
bf16 first and quantized in bf16, exactly as the engine quantizes the bf16 weights it holds; the
quantized values are bf16 numbers, so autocast's cast for the matmul keeps them.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.config.schema import PrecisionConfig
from miles.config.validate import ConfigError
from miles.precision.recipe import quantize_train_forward
from miles.train.megatron.arch import Arch
from miles.train.megatron.dims import ParallelDims
from miles.train.megatron.mapping import Entry

QUANTIZED_KINDS = ("qkv", "glu", "row")
"""Mapping kinds of the linear weights a recipe quantizes."""

EXACT_FORMATS = ("int4", "mxfp8")
"""Formats whose blocks run along the input dimension with a scale per block only."""


def row_parallel_inputs(arch: Arch) -> dict[str, int]:
    """Input width of each row-parallel linear, by its HF name (``X`` in the module docstring)."""
    out = {"self_attn.o_proj": arch.num_heads * arch.head_dim}
    if not arch.is_moe or not all(arch.moe_layers):
        out["mlp.down_proj"] = arch.ffn_hidden_size
    if arch.is_moe:
        out["mlp.experts.down_proj"] = arch.moe_ffn_hidden_size
    return out


def check_train_quant(precision: PrecisionConfig, arch: Arch, dims: ParallelDims) -> None:
    """Raise :class:`ConfigError` unless the megatron forward quantizes exactly as FSDP / the engine."""
    fmt = precision.train_quant
    if fmt == "none":
        return
    if fmt not in EXACT_FORMATS:
        why = ("its 128 x 128 tiles would span the q, k and v rows of several query groups in megatron's "
               "fused linear_qkv" if fmt == "fp8_block" else
               "its per-tensor scale belongs to each HF tensor, which megatron fuses (q, k, v; gate, up) and "
               "shards over tensor-parallel ranks")
        raise ConfigError(f"precision.train_quant={fmt}: the megatron trainer quantizes its forward with the 1-D "
                          f"block formats ({', '.join(EXACT_FORMATS)}) only; {fmt}: {why}. Use trainer=fsdp, or "
                          "precision.train_quant=none (the engine still serves the format; mismatch correction "
                          "covers the difference)")
    block, tp = precision.quant_block_size, dims.tp
    if tp == 1:
        return
    for name, width in row_parallel_inputs(arch).items():
        if width % tp or (width // tp) % block:
            raise ConfigError(
                f"precision.train_quant={fmt} with trainer.tensor_parallel={tp}: the row-parallel {name} splits its "
                f"{width} input columns into {width / tp:g} per rank, not a multiple of the block "
                f"(precision.quant_block_size={block}), so a block would straddle two ranks and get two scales "
                f"instead of the engine's one. Use a tensor-parallel size that leaves whole blocks per rank "
                f"(1, or one where {width} / size is a multiple of {block}), or trainer=fsdp")


def quantize_megatron_forward(model: nn.Module, entries: list[Entry], precision: PrecisionConfig, *,
                              bf16: bool) -> list[str]:
    """Wrap ``model``'s linear layers (this stage's GPTModel, unwrapped) for ``precision.train_quant``.

    Returns the wrapped parameter names (local megatron names; empty for ``none``).
    """
    names = {e.local for e in entries if e.kind in QUANTIZED_KINDS}
    return quantize_train_forward(model, precision, select=lambda name, _t: name in names,
                                  dtype=torch.bfloat16 if bf16 else None)
