"""Precision recipes: the weight formats each side computes with, and when the two sides differ.

A recipe (``conf/precision/*.yaml``, :class:`miles.config.schema.PrecisionConfig`) names

* ``rollout_quant``: the format the engine's weights are fake-quantized to each time weights reach
  it (at start and after every weight sync): :func:`apply_rollout_quant`;
* ``train_quant``: the format the trainer's forward computes with (fake quantization with a
  straight-through estimator, so the fp32 master weights learn through it: quantization-aware
  training): :func:`quantize_train_forward`. It is ``none`` or the rollout's format.

Formats (all weight-only; activations, gradients and optimizer state stay in the recipe's dtypes):

=========== ============================================ =========================================
format      quantizer                                    block
=========== ============================================ =========================================
fp8_block   :mod:`miles.precision.fp8` (e4m3, fp32 scale) ``quant_block_size`` x ``quant_block_size``
mxfp8       :mod:`miles.precision.mx` (e4m3, e8m0 scale)  1 x 32 (fixed by the format)
nvfp4       :mod:`miles.precision.nvfp4` (e2m1, e4m3 +    1 x 16 (fixed by the format)
            fp32 per-tensor scale)
int4        :mod:`miles.precision.int4` (int4, fp32)      1 x ``quant_block_size`` (group size)
=========== ============================================ =========================================

1-D blocks run along the last dimension, the input (reduction) dimension of ``nn.Linear`` weights
``[out, in]`` and of fused MoE expert tensors ``[E, out, in]``; expert tensors are quantized one
expert at a time (NVFP4's per-tensor scale is per expert).

Mismatch correction. Rollout and training numerics *differ* when their dtypes or weight formats
differ (:func:`numerics_differ`). :func:`effective_tis_clip` turns that and
``precision.mismatch_correction`` into the threshold the trainer's objective uses.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from miles.config.schema import PrecisionConfig
from miles.config.validate import FIXED_QUANT_BLOCK
from miles.precision.fp8 import fake_quantize_fp8_blockwise
from miles.precision.int4 import fake_quantize_int4
from miles.precision.mx import MX_BLOCK, fake_quantize_mxfp8
from miles.precision.nvfp4 import NVFP4_BLOCK, fake_quantize_nvfp4

log = logging.getLogger(__name__)

FORMATS = ("none", "fp8_block", "mxfp8", "nvfp4", "int4")
assert FIXED_QUANT_BLOCK == {"mxfp8": MX_BLOCK, "nvfp4": NVFP4_BLOCK}  # what validation enforces
DEFAULT_TIS_CLIP = 2.0
"""TIS threshold when mismatch correction is on and ``precision.tis_clip`` is null."""

_QUANTIZERS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "fp8_block": lambda w, b: fake_quantize_fp8_blockwise(w, b),
    "mxfp8": lambda w, b: fake_quantize_mxfp8(w, b),
    "nvfp4": lambda w, b: fake_quantize_nvfp4(w, b),
    "int4": lambda w, b: fake_quantize_int4(w, b),
}


def fake_quantizer(fmt: str, block: int) -> Callable[[Tensor], Tensor]:
    """Quantize-then-dequantize of ``fmt`` in the weight's own dtype: w [..., out, in] -> same shape.

    3-D tensors ``[E, out, in]`` are quantized expert by expert.
    """
    if fmt not in _QUANTIZERS:
        raise ValueError(f"weight format {fmt!r} is not supported; valid: {', '.join(FORMATS)}")
    q = _QUANTIZERS[fmt]

    def apply(w: Tensor) -> Tensor:
        if w.ndim == 3:
            return torch.stack([q(w[e], block) for e in range(w.shape[0])])
        return q(w, block)

    return apply


# Which weights are quantized. Following DeepSeek-V3 (section 3.3.1: embedding, output head, MoE
# gating, normalization and attention operators stay in higher precision), only the GEMM weights of
# linear layers are:
#   * 2-D ``*.weight`` of linear layers (attention q/k/v/o, dense MLP projections);
#   * fused MoE expert tensors of transformers 5 (``*.experts.gate_up_proj`` /
#     ``*.experts.down_proj``, 3-D [E, out, in]), quantized per expert;
# and never the token embedding, the LM head, norms (1-D anyway), or the MoE router
# ``*.mlp.gate.weight`` (tiny, and its top-k decision is brittle to noise).
_EXCLUDED = re.compile(r"(embed_tokens|lm_head|norm|\.mlp\.gate\.weight$|\.router\.)")
_FUSED_EXPERTS = re.compile(r"\.experts\.[^.]+$")


def is_quantized_weight(name: str, tensor: Tensor) -> bool:
    """Whether a recipe quantizes the parameter ``name`` (an HF state-dict key)."""
    if _EXCLUDED.search(name) or not tensor.is_floating_point():
        return False
    if name.endswith(".weight") and tensor.ndim == 2:
        return True
    return bool(_FUSED_EXPERTS.search(name)) and tensor.ndim == 3


_Target = TypeVar("_Target", dict[str, Tensor], nn.Module)


@torch.no_grad()
def apply_rollout_quant(target: _Target, precision: PrecisionConfig) -> _Target:
    """Fake-quantize the weights to ``precision.rollout_quant`` (what the engine serves).

    ``"none"``: returns ``target`` unchanged. Otherwise every weight for which
    :func:`is_quantized_weight` holds is replaced by :func:`fake_quantizer` of it (its own dtype).
    A state dict is not modified: a new dict is returned (untouched tensors are shared). A module is
    updated in place and returned.
    """
    if precision.rollout_quant == "none":
        return target
    fq = fake_quantizer(precision.rollout_quant, precision.quant_block_size)
    if isinstance(target, nn.Module):
        for name, p in target.named_parameters():
            if is_quantized_weight(name, p):
                p.copy_(fq(p))
        return target
    return {k: fq(v) if is_quantized_weight(k, v) else v for k, v in target.items()}


def _ste(fq: Callable[[Tensor], Tensor], w: Tensor) -> Tensor:
    """Forward ``fq(w)``, backward identity (straight-through estimator)."""
    return w + (fq(w.detach()) - w).detach()


def quantize_train_forward(model: nn.Module, precision: PrecisionConfig, *,
                           select: Callable[[str, Tensor], bool] = is_quantized_weight,
                           dtype: torch.dtype | None = None) -> list[str]:
    """Make ``model``'s forward compute with ``precision.train_quant`` weights, gradients straight through.

    Each module owning a weight that ``select(name, tensor)`` picks (default :func:`is_quantized_weight`
    on HF names) gets its ``forward`` wrapped (on the instance, like activation checkpointing): for the
    duration of the call the parameter is swapped for ``w + (fake_quant(w) - w).detach()``, then
    restored. The parameter is read at call time, so the wrap composes with FSDP2 (which installs the
    unsharded parameter before the layer's forward) and with activation checkpointing (the recompute
    quantizes again). ``dtype``: quantize ``w`` rounded to it (the dtype autocast computes in), the result
    back in ``w``'s dtype. Returns the wrapped parameter names (empty for ``"none"``). Parameter names
    and state dicts are unchanged.
    """
    if precision.train_quant == "none":
        return []
    fq = fake_quantizer(precision.train_quant, precision.quant_block_size)
    if dtype is not None:
        fq_in_own_dtype = fq

        def fq(w: Tensor) -> Tensor:
            return fq_in_own_dtype(w.to(dtype)).to(w.dtype)
    wrapped: list[str] = []
    for mod_name, module in model.named_modules():
        names = [n for n, p in module.named_parameters(recurse=False)
                 if select(f"{mod_name}.{n}" if mod_name else n, p)]
        if names:
            module.forward = _swapping_forward(module, names, fq)
            wrapped += [f"{mod_name}.{n}" if mod_name else n for n in names]
    return wrapped


def _swapping_forward(module: nn.Module, names: list[str], fq: Callable[[Tensor], Tensor]) -> Callable[..., Any]:
    forward = module.forward

    @functools.wraps(forward)
    def quantized(*args: Any, **kwargs: Any) -> Any:
        params = module._parameters
        saved = {n: params[n] for n in names}
        try:
            for n, w in saved.items():
                params[n] = _ste(fq, w)  # a plain tensor for this call; `module.<n>` reads it
            return forward(*args, **kwargs)
        finally:
            params.update(saved)

    return quantized


def numerics_differ(precision: PrecisionConfig, *, same_forward: bool = True) -> bool:
    """Whether rollout and training compute with different dtypes or weight formats, or, for a trainer whose
    model is another implementation than the engine's (``same_forward=False``: the megatron trainer against
    transformers' forward), in bf16 on either side: there the two implementations' kernels round apart
    (megatron vs the torch engine in bf16: 4e-3 to 6e-3 nats per token on the warm-started tiny MoE, against
    1e-7 to 3e-7 in fp32; docs/benchmarks.md)."""
    if precision.rollout_dtype != precision.train_dtype or precision.rollout_quant != precision.train_quant:
        return True
    return not same_forward and "bfloat16" in (precision.rollout_dtype, precision.train_dtype)


def effective_tis_clip(precision: PrecisionConfig, *, same_forward: bool = True) -> float | None:
    """The TIS / MIS threshold the trainer applies (None: no mismatch correction).

    ``mismatch_correction``: ``off`` -> None; ``on`` -> ``tis_clip`` (or :data:`DEFAULT_TIS_CLIP`
    when null); ``auto`` -> like ``on`` when :func:`numerics_differ` (``same_forward`` as there), else
    ``tis_clip`` as set (null by default: no correction where both sides compute alike).
    """
    mode = precision.mismatch_correction
    if mode == "off":
        return None
    if mode == "on" or numerics_differ(precision, same_forward=same_forward):
        return precision.tis_clip if precision.tis_clip is not None else DEFAULT_TIS_CLIP
    return precision.tis_clip


def mismatch_note(precision: PrecisionConfig, *, same_forward: bool = True) -> str | None:
    """The line a run logs at start when mismatch correction is on only because the trainer's model is another
    implementation than the engine's (``same_forward=False``, bf16), else None."""
    if (precision.mismatch_correction != "auto" or numerics_differ(precision)
            or not numerics_differ(precision, same_forward=same_forward)):
        return None
    return (f"precision {precision.name}: mismatch correction on ({precision.mismatch_mode} at "
            f"{effective_tis_clip(precision, same_forward=same_forward)}, precision.mismatch_correction=auto): the "
            "engine and the trainer compute with other implementations of the model, whose bf16 kernels round apart")


def mismatch_warning(precision: PrecisionConfig, *, same_forward: bool = True) -> str | None:
    """The warning a run gets when its numerics differ and mismatch correction is off, else None."""
    if precision.mismatch_correction == "off" and numerics_differ(precision, same_forward=same_forward):
        return (f"precision {precision.name}: rollout ({precision.rollout_dtype}, weights "
                f"{precision.rollout_quant}) and training ({precision.train_dtype}, weights "
                f"{precision.train_quant}{'' if same_forward else ', another implementation of the model'}) "
                "compute differently, and precision.mismatch_correction=off: the policy gradient uses off-policy "
                "samples uncorrected. Set it to auto to truncate the importance ratios (TIS).")
    return None
