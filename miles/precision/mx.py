"""MXFP8 (OCP Microscaling v1.0): 1 x 32 blocks, e8m0 shared scales, e4m3 elements.

Along the last dimension every run of 32 values ``v_1..v_32`` shares one scale
``X = 2^k`` stored as an e8m0 byte (``k + 127``: exponent only, no sign, no mantissa;
byte 255 means NaN). Following the spec's conversion (section 6.3),

    k   = floor(log2(amax)) - 8          (8 = exponent of 448, the largest e4m3)
    P_i = round_e4m3(v_i / X), saturated to +-448

so the largest element of a block lands in e4m3's top binade ``[256, 512)``;
values in ``(448, 512)`` saturate to 448. Dequantization is ``P_i * X``.

Error bound. With ``X`` a power of two the scaling is exact; e4m3's 3 mantissa bits
give a relative error of at most ``2^-4`` for every element whose scaled value is
normal (``|v / X| >= 2^-6``), absolute error at most ``2^-10 * X`` below that, and the
saturated top of the range loses at most ``amax - 448 X < amax / 8``
(``amax < 512 X``). Compared with a per-tile fp32 scale (:mod:`miles.precision.fp8`)
the power-of-two scale wastes up to one bit of range, in exchange for a one-byte scale
and 32-element blocks that follow outliers closely.

Special values. ``k`` is clamped to e8m0's range ``[-127, 127]``; an all-zero block
gets ``k = -127``. A block holding NaN or +-inf gets the NaN scale byte 255 and
dequantizes to NaN as a whole (the spec's NaN scale), so a broken weight stays visible
instead of saturating silently. (torchao's FLOOR mode agrees on NaN; for +-inf it
saturates instead.) A last dimension that is not a multiple of 32 is zero-padded
(see :mod:`miles.precision.blocks`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.precision.blocks import merge_blocks, split_blocks

MX_BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2^8
E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_to_float(scale_bits: Tensor) -> Tensor:
    """uint8 e8m0 bytes -> fp32 ``2^(byte - 127)`` (byte 255 -> NaN)."""
    k = scale_bits.to(torch.int32) - E8M0_BIAS
    s = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
    return torch.where(scale_bits == E8M0_NAN, torch.full_like(s, float("nan")), s)


def quantize_mxfp8(x: Tensor, block: int = MX_BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize along the last dimension.

    x: [..., N] float -> (q: [..., N] float8_e4m3fn, scale_bits: [..., ceil(N/block)] uint8
    e8m0 bytes), with ``x ~= q * 2^(scale_bits - 127)`` block by block.
    """
    n = x.shape[-1]
    xb = split_blocks(x.float(), block)
    finite = torch.isfinite(xb).all(dim=-1)
    amax = torch.where(finite, xb.abs().amax(dim=-1), torch.zeros_like(xb[..., 0]))
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    k = torch.where(amax > 0, e - 1 - E4M3_EMAX, torch.full_like(e, -E8M0_BIAS))
    k = k.clamp(-E8M0_BIAS, E8M0_BIAS)
    bits = torch.where(finite, k + E8M0_BIAS, torch.full_like(k, E8M0_NAN)).to(torch.uint8)
    scale = torch.ldexp(torch.ones_like(amax), k)  # finite also for NaN blocks; bits carry the NaN
    q = (xb / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return merge_blocks(q, n).contiguous(), bits


def dequantize_mxfp8(
    q: Tensor, scale_bits: Tensor, block: int = MX_BLOCK, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_mxfp8`: q: [..., N] e4m3, scale_bits: [..., ceil(N/block)] -> [..., N] dtype."""
    n = q.shape[-1]
    qb = split_blocks(q.float(), block)
    if scale_bits.shape != qb.shape[:-1]:
        raise ValueError(f"scale_bits shape {tuple(scale_bits.shape)} does not match q {tuple(q.shape)} "
                         f"with block {block}; expected {tuple(qb.shape[:-1])}")
    return merge_blocks(qb * e8m0_to_float(scale_bits)[..., None], n).to(dtype).contiguous()


def fake_quantize_mxfp8(x: Tensor, block: int = MX_BLOCK, dtype: torch.dtype | None = None) -> Tensor:
    """Quantize then dequantize: the values an MXFP8 GEMM computes with. x: [..., N] -> [..., N]."""
    q, bits = quantize_mxfp8(x, block)
    return dequantize_mxfp8(q, bits, block, dtype or x.dtype)
