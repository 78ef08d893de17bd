"""NVFP4: e2m1 elements in 16-element blocks, e4m3 block scales, one fp32 per-tensor scale.

The e2m1 grid is ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with a sign bit; the 4-bit code of a
value is ``sign << 3 | i`` where ``i`` indexes that grid (which is also e2m1's bit
pattern). Two-level scaling, as NVIDIA's NVFP4 recipe describes it:

    s_t = amax(|x|) / (448 * 6)                          per tensor, fp32
    s_b = e4m3(amax(|x_block|) / 6 / s_t)                per 16 values, stored in e4m3
    q_i = round_e2m1(x_i * ((1 / s_t) / s_b)), saturated to +-6
    x_hat_i = e2m1(q_i) * s_b * s_t

``s_t`` lets the block scales use all of e4m3 up to 448; the block scale maps the
block's amax close to 6, the top of the grid. ``round_e2m1`` is round-to-nearest with
ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
5 -> 4). Because ``s_b`` is itself rounded to e4m3 (relative error <= 2^-4), a block's
amax can scale to slightly above 6 and saturate.

Edge cases. Block scales are clamped to ``[2^-6, 448]`` (2^-6 is e4m3's smallest
normal, the floor torchao's reference uses too): a block whose amax is below
``2^-6 * 6 * s_t = amax_t / 7168`` keeps the floor scale, so its small elements round
towards 0, and an all-zero block gets scale 2^-6 and codes 0. An all-zero tensor gets
``s_t = 1``. e2m1 has no NaN or inf, so a non-finite input raises ``ValueError``. The last
dimension is zero-padded to a multiple of 16 (:mod:`miles.precision.blocks`).

Error bound (what the tests check). For an element of a block with scale ``s = s_b * s_t``
the absolute error is at most half the grid spacing at its magnitude times ``s``:
``0.25 s`` below 2, ``0.5 s`` in [2, 4), ``1 s`` in [4, 6], plus the saturation loss above 6 s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.precision.blocks import merge_blocks, split_blocks

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_to_e2m1(x: Tensor) -> Tensor:
    """Round fp32 values (already scaled, |x| <= 6 expected) to 4-bit e2m1 codes: [...] -> [...] uint8.

    Round-to-nearest, ties to the even code; values beyond 6 saturate to code 7 (6.0).
    """
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=x.device)
    a = x.abs().clamp(max=E2M1_MAX)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)  # grid[lo] <= a < grid[lo + 1]
    d_lo, d_hi = a - grid[lo], grid[lo + 1] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    i = torch.where(up, lo + 1, lo)
    sign = torch.signbit(x)  # values that round to 0 keep their sign: code 8 is -0
    return (i | (sign.to(i.dtype) << 3)).to(torch.uint8)


def e2m1_to_float(codes: Tensor) -> Tensor:
    """4-bit e2m1 codes (uint8, one per value) -> fp32 values."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def quantize_nvfp4(x: Tensor, block: int = NVFP4_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize along the last dimension.

    x: [..., N] float -> (codes: [..., N] uint8 e2m1 codes (unpacked, one per byte),
    block_scales: [..., ceil(N/block)] float8_e4m3fn, tensor_scale: [] fp32).
    """
    if not torch.isfinite(x).all():
        raise ValueError("nvfp4 cannot encode NaN or inf (e2m1 has neither); found non-finite values")
    n = x.shape[-1]
    xb = split_blocks(x.float(), block)
    amax_t = xb.abs().amax() if xb.numel() else torch.zeros((), device=x.device)
    tensor_scale = torch.where(amax_t > 0, amax_t / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax_t))
    block_amax = xb.abs().amax(dim=-1)
    bs = (block_amax / E2M1_MAX / tensor_scale).clamp(E4M3_MIN_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    recip = (1.0 / tensor_scale) / bs.float()
    codes = round_to_e2m1(xb * recip[..., None])
    return merge_blocks(codes, n).contiguous(), bs, tensor_scale


def dequantize_nvfp4(
    codes: Tensor, block_scales: Tensor, tensor_scale: Tensor, block: int = NVFP4_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_nvfp4`: -> [..., N] in ``dtype`` (products formed in fp32)."""
    n = codes.shape[-1]
    vb = split_blocks(e2m1_to_float(codes), block)
    if block_scales.shape != vb.shape[:-1]:
        raise ValueError(f"block_scales shape {tuple(block_scales.shape)} does not match codes "
                         f"{tuple(codes.shape)} with block {block}; expected {tuple(vb.shape[:-1])}")
    s = block_scales.float() * tensor_scale.float()
    return merge_blocks(vb * s[..., None], n).to(dtype).contiguous()


def fake_quantize_nvfp4(x: Tensor, block: int = NVFP4_BLOCK, dtype: torch.dtype | None = None) -> Tensor:
    """Quantize then dequantize: the values an NVFP4 GEMM computes with. x: [..., N] -> [..., N]."""
    codes, bs, ts = quantize_nvfp4(x, block)
    return dequantize_nvfp4(codes, bs, ts, block, dtype or x.dtype)
