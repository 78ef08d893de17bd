"""FP8 (e4m3) block-wise weight quantization, DeepSeek-V3 style.

A weight matrix ``W [M, N]`` is cut into ``b x b`` tiles (``b = 128`` by
default, as in DeepSeek-V3 and SGLang's ``fp8`` block-quantized checkpoints).
Each tile gets one fp32 scale

    s = amax(|W_tile|) / 448            (448 = largest finite float8_e4m3fn)

and its elements are stored as ``q = round_e4m3(W / s)``, so the largest
element of every tile lands exactly on +-448 and the rest use the full e4m3
range. Dequantization is ``W_hat = q * s``. A per-tile scale (instead of one
per tensor or per row) keeps one outlier from crushing the resolution of the
whole matrix, while a 128 x 128 tile still maps onto one GEMM tile so the
scale can be applied in the matmul epilogue.

Error bound. e4m3 has 3 mantissa bits: within the binade ``[2^e, 2^(e+1))``
the spacing is ``2^(e-3)``, so round-to-nearest has relative error at most
``2^-4`` for normal values (``|W / s| >= 2^-6``) and absolute error at most
``2^-10`` (half the subnormal spacing ``2^-9``) below that. The coarsest
spacing of the scaled range ``[256, 448]`` is 32, so no element of a tile moves
by more than ``16 * s = amax / 28``. These are the bounds the tests check.

Edge tiles of a matrix whose sides are not multiples of ``b`` are padded
logically with zeros: zeros never change a tile's ``amax``, so the edge tile's
scale is the scale of its real elements. An all-zero tile gets ``s = 1`` (any
scale reproduces zeros; 1 avoids dividing by zero).

The rollout engine computes with :func:`fake_quantize_fp8_blockwise` weights
(quantize then dequantize into the engine dtype): the numbers an FP8 GEMM
would see, without needing FP8 kernels on CPU. Which weights are quantized is
decided in :mod:`miles.precision.recipe` (``is_quantized_weight``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _check_block(w: Tensor, block: int) -> None:
    if block < 1:
        raise ValueError(f"block size must be a positive integer, got {block}")
    if w.ndim < 2:
        raise ValueError(f"block-wise quantization needs a tensor [..., M, N]; got shape {tuple(w.shape)}")


def _tiles(x: Tensor, block: int) -> tuple[Tensor, int, int]:
    """Zero-pad [..., M, N] to multiples of ``block`` and view as [..., Mb, b, Nb, b]."""
    m, n = x.shape[-2:]
    mb, nb = -(-m // block), -(-n // block)
    x = nn.functional.pad(x, (0, nb * block - n, 0, mb * block - m))
    return x.reshape(*x.shape[:-2], mb, block, nb, block), m, n


def _untile(x: Tensor, m: int, n: int) -> Tensor:
    """Inverse of :func:`_tiles`: [..., Mb, b, Nb, b] -> [..., M, N] (crops the padding)."""
    *lead, mb, b, nb, _ = x.shape
    return x.reshape(*lead, mb * b, nb * b)[..., :m, :n]


def quantize_fp8_blockwise(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """Quantize to float8_e4m3fn with one fp32 scale per ``block x block`` tile.

    w: [..., M, N] any float dtype (leading dims, e.g. experts [E, out, in], are
    quantized independently) -> (q: [..., M, N] float8_e4m3fn,
    scales: [..., ceil(M/block), ceil(N/block)] fp32), with ``w ~= q * scale``.
    """
    _check_block(w, block)
    t, m, n = _tiles(w.float(), block)
    amax = t.abs().amax(dim=(-3, -1))  # [..., Mb, Nb]
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = t / scales[..., :, None, :, None]
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return _untile(q, m, n).contiguous(), scales


def dequantize_fp8_blockwise(
    q: Tensor, scales: Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`quantize_fp8_blockwise`.

    q: [..., M, N] float8_e4m3fn, scales: [..., ceil(M/block), ceil(N/block)] fp32
    -> [..., M, N] in ``dtype`` (the product ``q * scale`` is formed in fp32).
    """
    _check_block(q, block)
    t, m, n = _tiles(q.float(), block)
    if scales.shape != t.shape[:-4] + t.shape[-4::2]:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)} with block {block}; "
            f"expected {tuple(t.shape[:-4] + t.shape[-4::2])}"
        )
    return _untile(t * scales.float()[..., :, None, :, None], m, n).to(dtype).contiguous()


def fake_quantize_fp8_blockwise(w: Tensor, block: int = 128, dtype: torch.dtype | None = None) -> Tensor:
    """Quantize then dequantize: the values an FP8 block-scaled GEMM computes with.

    w: [..., M, N] -> [..., M, N] in ``dtype`` (default: ``w.dtype``).
    """
    q, scales = quantize_fp8_blockwise(w, block)
    return dequantize_fp8_blockwise(q, scales, block, dtype or w.dtype)
