"""Group-wise symmetric INT4 weights, and fake quantization with a straight-through estimator for QAT.

Along the last (input) dimension of a weight every ``g`` values (``g = 128`` by default,
the common group size of int4 weight-only kernels) share one fp32 scale

    s   = amax(|w_group|) / 7
    q_i = clamp(round(w_i / s), -8, 7)          (round half to even)
    w_hat_i = q_i * s

so ``+-amax`` maps to ``+-7`` and no element is clipped (code -8 is never produced; a
symmetric grid keeps zero exact and needs no zero point). Every element moves by at most
``s / 2 = amax / 14``. An all-zero group gets ``s = 1``. int4 has no NaN or inf, so a
non-finite weight raises ``ValueError``.

QAT. :func:`fake_quantize_int4_ste` returns ``w_hat`` in the forward pass and passes the
gradient straight through (``d w_hat / d w := 1``; Bengio et al. 2013), so the trainer
optimizes fp32 master weights against the loss of the int4 weights the engine serves. No
element is ever clipped, so the clipped-STE variant (zero gradient outside the range) is
the same as the plain one here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.precision.blocks import merge_blocks, split_blocks

INT4_MIN, INT4_MAX = -8, 7


def quantize_int4(w: Tensor, group: int = 128) -> tuple[Tensor, Tensor]:
    """w: [..., N] float -> (q: [..., N] int8 holding int4 values in [-8, 7], scales: [..., ceil(N/group)] fp32)."""
    if not torch.isfinite(w).all():
        raise ValueError("int4 cannot encode NaN or inf; found non-finite weights")
    n = w.shape[-1]
    wb = split_blocks(w.float(), group)
    amax = wb.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    q = torch.round(wb / scales[..., None]).clamp(INT4_MIN, INT4_MAX).to(torch.int8)
    return merge_blocks(q, n).contiguous(), scales


def dequantize_int4(q: Tensor, scales: Tensor, group: int = 128, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`quantize_int4`: q: [..., N] int8, scales: [..., ceil(N/group)] -> [..., N] dtype."""
    n = q.shape[-1]
    qb = split_blocks(q.float(), group)
    if scales.shape != qb.shape[:-1]:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)} "
                         f"with group {group}; expected {tuple(qb.shape[:-1])}")
    return merge_blocks(qb * scales[..., None], n).to(dtype).contiguous()


def fake_quantize_int4(w: Tensor, group: int = 128, dtype: torch.dtype | None = None) -> Tensor:
    """Quantize then dequantize (no gradient): w: [..., N] -> [..., N]."""
    q, scales = quantize_int4(w.detach(), group)
    return dequantize_int4(q, scales, group, dtype or w.dtype)


def fake_quantize_int4_ste(w: Tensor, group: int = 128) -> Tensor:
    """Forward: :func:`fake_quantize_int4` of ``w``; backward: the gradient passes to ``w`` unchanged."""
    return w + (fake_quantize_int4(w, group) - w).detach()
