"""Per-token policy losses, KL estimators, importance weights and loss aggregation.

Notation: ``B`` sequences, ``T`` response tokens (padded), ``logp = log pi_theta(y_t | ...)`` under
the weights being trained, ``old_logp`` under the weights at the start of the step (the proximal
policy), ``rollout_logp`` as reported by the rollout engine, ``ref_logp`` under a frozen reference.

PPO-clip (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7) with separate
lower and upper clip ranges ("clip-higher", Yu et al. 2025, DAPO)::

    r_t   = exp(logp_t - old_logp_t)
    L_t   = -min(r_t * A,  clip(r_t, 1 - eps_low, 1 + eps_high) * A)

KL estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html),
tokens sampled from pi_theta, ``d = ref_logp - logp = log(pi_ref / pi_theta)``::

    k1 = -d                 unbiased, high variance, can be negative
    k2 = d^2 / 2            biased, low variance, >= 0
    k3 = exp(d) - d - 1     unbiased, low variance, >= 0   (GRPO's choice)

Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"): the engine samples from pi_rollout, not pi_old (different kernels,
precision, quantization), so the policy gradient is re-weighted per token by::

    w_t = min(exp(old_logp_t - rollout_logp_t), C)       (no gradient)

Aggregation over tokens (``mask`` = 1 on trained tokens)::

    token_mean:           sum_{i,t} m_it L_it / N_tokens
    seq_mean_token_mean:  sum_i [ sum_t m_it L_it / sum_t m_it ] / N_seqs

``N_tokens`` / ``N_seqs`` default to this batch's counts; a data-parallel rank passes the *global*
counts so that the per-rank results add up to the single-rank value (sum over ranks, not mean).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
AggMode = Literal["token_mean", "seq_mean_token_mean"]


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per-token loss with asymmetric clip range.

    logp, old_logp: [B, T]; advantages: [B] (one per sequence) or [B, T].
    Returns ``(loss [B, T], indicators)``: float 0/1 tensors [B, T] named after the metric their
    token mean becomes, ``clip_frac_low`` (ratio < 1 - clip_low and A < 0) and ``clip_frac_high``
    (ratio > 1 + clip_high and A > 0): the tokens where the clip is active and the gradient is zero.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.shape[0] != logp.shape[0]:
        raise ValueError(f"ppo_clip_loss: advantages {tuple(advantages.shape)} do not match logp {tuple(logp.shape)}")
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        indicators = {
            "clip_frac_low": ((ratio < 1.0 - clip_low) & (advantages < 0)).float(),
            "clip_frac_high": ((ratio > 1.0 + clip_high) & (advantages > 0)).float(),
        }
    return loss, indicators


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

    logp, ref_logp: [B, T] -> [B, T]. ``estimator`` is ``k1``, ``k2`` or ``k3`` (module docstring).
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; valid options: k1, k2, k3")


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, clip: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old_logp - rollout_logp), clip)``, detached.

    old_logp, rollout_logp: [B, T] -> [B, T].
    """
    if clip < 1.0:
        raise ValueError(f"tis_weights: clip must be >= 1, found {clip}")
    with torch.no_grad():
        return torch.exp(old_logp.float() - rollout_logp.float()).clamp(max=clip)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token_mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token quantity to a scalar.

    loss, mask: [B, T] (mask 1 on tokens that count) -> scalar. ``global_tokens`` (token_mean) and
    ``global_seqs`` (seq_mean_token_mean: sequences with at least one masked-in token) override the
    local counts; with the global counts, summing the per-rank results gives the global value.
    Counts are clamped to at least 1, so an all-masked batch gives 0, not NaN.
    """
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        denom = mask.sum() if global_tokens is None else global_tokens
        return (loss * mask).sum() / torch.clamp(torch.as_tensor(denom, dtype=loss.dtype), min=1.0)
    if mode == "seq_mean_token_mean":
        tokens_per_seq = mask.sum(-1)
        per_seq = (loss * mask).sum(-1) / tokens_per_seq.clamp(min=1.0)
        denom = (tokens_per_seq > 0).sum() if global_seqs is None else global_seqs
        return per_seq.sum() / torch.clamp(torch.as_tensor(denom, dtype=loss.dtype), min=1.0)
    raise ValueError(f"aggregate: unknown mode {mode!r}; valid options: seq_mean_token_mean, token_mean")
