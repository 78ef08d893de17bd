"""Gradient-norm clipping across TP, PP, EP and DP ranks (megatron's own clipping asserts CUDA tensors).

After megatron's DDP reduced the gradients, every data-parallel replica holds the same ones, TP ranks
hold disjoint shards of the split parameters and copies of the replicated ones (norms, router),
pipeline stages hold disjoint layers and expert-parallel ranks disjoint experts. The global norm
counts each gradient once::

    ||g||^2 = sum over ranks r of  sum_{i counted on r} ||g_i||^2        (one all-reduce)

where a rank counts a parameter when it is in data-parallel replica 0 (expert-data-parallel replica 0
for experts), on TP rank 0 unless the parameter is TP-split, and is not the last stage's copy of
tied embeddings. Clipping is torch's ``clip_grad_norm_``: ``g *= min(1, max_norm / (||g|| + 1e-6))``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def global_grad_norm(counted: Sequence[torch.Tensor], all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
    """The L2 norm of the gradients of every rank; ``counted``: this rank's gradients to count (any shapes)."""
    local = torch.zeros((), dtype=torch.float32)
    for g in counted:
        local = local + torch.linalg.vector_norm(g.float()).square().cpu()
    return all_reduce_sum(local.reshape(1)).reshape(()).sqrt()


def clip_(grads: Sequence[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))`` (as ``clip_grad_norm_``)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
