"""Cut the last dimension of a tensor into fixed-size blocks (shared by the MX, NVFP4 and INT4 quantizers).

``x [..., N]`` is zero-padded on the right to a multiple of ``block`` and viewed as
``[..., ceil(N / block), block]``. Padding zeros never raise a block's ``amax``, so the
last (partial) block gets the scale of its real elements; :func:`merge_blocks` crops them.
"""

from __future__ import annotations

from torch import Tensor, nn


def split_blocks(x: Tensor, block: int) -> Tensor:
    """x: [..., N] -> [..., ceil(N/block), block] (zero-padded)."""
    if block < 1:
        raise ValueError(f"block size must be a positive integer, got {block}")
    if x.ndim < 1:
        raise ValueError("block-wise quantization needs a tensor with at least one dimension")
    n = x.shape[-1]
    nb = -(-n // block)
    x = nn.functional.pad(x, (0, nb * block - n))
    return x.reshape(*x.shape[:-1], nb, block)


def merge_blocks(xb: Tensor, n: int) -> Tensor:
    """Inverse of :func:`split_blocks`: [..., Nb, block] -> [..., n] (crops the padding)."""
    return xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])[..., :n]
