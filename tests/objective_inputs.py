"""Inputs shared by the objective tests."""

from __future__ import annotations

import torch


def objective_inputs(seed: int, b: int = 6, t: int = 5, rollout_noise: float = 0.2) -> dict[str, torch.Tensor]:
    """Random [b, t] inputs of ``policy_objective``: one sequence has no trained tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[-1] = 0.0  # one sequence with no trained tokens
    old = -torch.rand(b, t, generator=g) * 2
    return dict(
        logp=(old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_(True),
        old_logp=old,
        rollout_logp=old + rollout_noise * torch.randn(b, t, generator=g),
        ref_logp=old + 0.1 * torch.randn(b, t, generator=g),
        advantages=torch.randn(b, generator=g),
        loss_mask=mask,
        entropy=torch.rand(b, t, generator=g).requires_grad_(True),
    )
