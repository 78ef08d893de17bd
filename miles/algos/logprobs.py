"""Per-token log-probabilities, shared by the rollout engine and the trainer.

Both sides must compute the same numbers for the same weights and tokens, so
both call these functions. Log-probs are of the *temperature-scaled* full
distribution, ``log_softmax(logits / T)``, taken before any top-p/top-k
truncation: that is the policy the trainer optimises.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each target token.

    logits: [..., V] (any float dtype; computed in fp32), targets: [...] int64 -> [...] fp32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution. logits: [..., V] -> [...] fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
