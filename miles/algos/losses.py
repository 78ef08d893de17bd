"""Per-token policy losses, KL estimators, importance weights and loss aggregation.

Notation: ``B`` sequences, ``T`` response tokens (padded), ``logp = log pi_theta(y_t | ...)`` under
the weights being trained, ``old_logp`` under the weights at the start of the step (the proximal
policy), ``rollout_logp`` as reported by the rollout engine, ``ref_logp`` under a frozen reference.

PPO-clip (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7) with separate
lower and upper clip ranges ("clip-higher", Yu et al. 2025, DAPO)::

    r_t   = exp(logp_t - old_logp_t)
    L_t   = -min(r_t * A,  clip(r_t, 1 - eps_low, 1 + eps_high) * A)

Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
Learning", eq. 5) also bounds the loss of a negative-advantage token whose ratio has run far above 1
(PPO-clip leaves ``-r_t * A`` unbounded there)::

    A < 0:  L_t = min(-min(r_t A, clip(r_t) A),  -c * A)        c > 1 (default 3)

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7) clips one *sequence-level*
ratio, the geometric mean of the token ratios over the sequence's trained tokens ``m_it = 1``::

    s_i   = exp( sum_t m_it (logp_it - old_logp_it) / sum_t m_it )
    L_i   = -min(s_i * A_i,  clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

The paper's objective is the mean over sequences of ``L_i``; here ``L_i`` is broadcast to every token
of sequence ``i`` so the loss has the usual [B, T] shape: ``loss_agg: seq_mean_token_mean`` then gives
exactly the paper's objective (``token_mean`` weights each sequence by its token count). Its clip
ranges are ~1e3 times smaller than PPO's (paper: 3e-4 / 4e-4) because ``s_i`` is a mean of logs.

CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
eq. 4-5) clips the importance-sampling *weight* instead of the update, and never zeroes a token's
gradient (the clipped tokens, often rare "fork" tokens, keep contributing)::

    L_t   = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logp_t           sg = stop-gradient

Its gradient at ``r_t = 1`` equals PPO's; its *value* is not comparable with PPO's loss. The paper
sets no lower bound in practice (a large ``eps_low``).

Rejection-sampling fine-tuning (RFT; Yuan et al. 2023, "Scaling Relationship on Learning
Mathematical Reasoning with Large Language Models", sec. 3.3; the "filtered" SFT of ReST/RAFT)
trains with the supervised loss on the policy's own sampled responses whose reward passed a
threshold; :func:`sft_loss` is ``-w_i * logp_t`` with the sample weight ``w_i`` in place of the
advantage (no ratio, no clip)::

    L_t = -w_i * logp_t            w_i = 1[r_i > threshold]   (advantages.rejection_sampling)

KL estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html),
tokens sampled from pi_theta, ``d = ref_logp - logp = log(pi_ref / pi_theta)``::

    k1 = -d                 unbiased, high variance, can be negative
    k2 = d^2 / 2            biased, low variance, >= 0
    k3 = exp(d) - d - 1     unbiased, low variance, >= 0   (GRPO's choice)
    low_var_kl = clamp(exp(d') - d' - 1, -10, 10),  d' = clamp(d, -20, 20)

``low_var_kl`` is verl's name for k3 with its numerical guards (``verl/trainer/ppo/core_algos.py``,
``kl_penalty``): the log-ratio is clamped to [-20, 20] before ``exp`` and the estimate to [-10, 10]
(k3 >= 0, so only the upper bound bites). Where a clamp is active the gradient is zero, so a token
whose policy has drifted far from the reference contributes at most 10 and no gradient.

Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"): the engine samples from pi_rollout, not pi_old (different kernels,
precision, quantization), so the policy gradient is re-weighted per token by::

    w_t = min(exp(old_logp_t - rollout_logp_t), C)       (no gradient)

Masked importance sampling (MIS; Liu et al. 2025, "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch") drops a token whose ratio exceeds ``C`` instead of
truncating it, so an outlier contributes nothing rather than a capped amount::

    w_t = exp(old_logp_t - rollout_logp_t)  if that is <= C,  else 0

At sequence level both use one ratio per sequence, the product of the token ratios over its trained
tokens, ``rho_i = exp( sum_t m_it (old_logp_it - rollout_logp_it) )``, broadcast to every token:
TIS weights the sequence by ``min(rho_i, C)``; MIS by ``rho_i``, or drops the whole sequence when
``rho_i > C``. The bound is one-sided (ratios below 1 are kept as they are) in both modes.

Aggregation over tokens (``mask`` = 1 on trained tokens)::

    token_mean:           sum_{i,t} m_it L_it / N_tokens
    seq_mean_token_mean:  sum_i [ sum_t m_it L_it / sum_t m_it ] / N_seqs
    seq_mean_token_sum:   sum_i [ sum_t m_it L_it ] / N_seqs
    seq_mean_token_sum_norm:  sum_i [ sum_t m_it L_it / L_max ] / N_seqs

``seq_mean_token_sum_norm`` is Dr. GRPO's normaliser (Liu et al. 2025, "Understanding R1-Zero-Like
Training: A Critical Perspective", sec. 3.1): dividing by the sequence's own length biases towards
long wrong answers, so a *constant* ``L_max`` (the maximum response length, ``norm_len``) replaces
it. It is ``seq_mean_token_sum`` scaled by ``1 / L_max``, which keeps the loss on the scale of a mean.

``N_tokens`` / ``N_seqs`` default to this batch's counts; a data-parallel rank passes the *global*
counts so that the per-rank results add up to the single-rank value (sum over ranks, not mean).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
MismatchMode = Literal["tis", "mis"]
MismatchLevel = Literal["token", "sequence"]


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per-token loss with asymmetric clip range.

    logp, old_logp: [B, T]; advantages: [B] (one per sequence) or [B, T]; ``loss_mask`` is accepted
    for the loss protocol and ignored (a token-level loss needs no mask; aggregation applies it).
    Returns ``(loss [B, T], indicators)``: float 0/1 tensors [B, T] named after the metric their
    token mean becomes, ``clip_frac_low`` (ratio < 1 - clip_low and A < 0) and ``clip_frac_high``
    (ratio > 1 + clip_high and A > 0): the tokens where the clip is active and the gradient is zero.
    """
    advantages = _per_token_shape("ppo_clip_loss", advantages, logp)
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


def _per_token_shape(name: str, advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """advantages [B] or [B, T] -> broadcastable against logp [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.shape[0] != logp.shape[0]:
        raise ValueError(f"{name}: advantages {tuple(advantages.shape)} do not match logp {tuple(logp.shape)}")
    return advantages


def dual_clip_ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float = 3.0,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO per-token loss: PPO-clip, and for A < 0 the loss is at most ``-c * A``.

    logp, old_logp: [B, T]; advantages: [B] or [B, T]; ``loss_mask`` ignored (as in
    :func:`ppo_clip_loss`); ``dual_clip_c > 1`` (the paper uses 3). Returns ``(loss [B, T],
    indicators)``: ``clip_frac_low``, ``clip_frac_high`` as in :func:`ppo_clip_loss`, and
    ``dual_clip_frac`` (A < 0 and the PPO loss above ``-c * A``, i.e. ratio > c when
    c > 1 + clip_high: the bound is active and the gradient is zero).
    """
    if dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_ppo_loss: dual_clip_c must be > 1, found {dual_clip_c}")
    loss, indicators = ppo_clip_loss(logp, old_logp, advantages, clip_low=clip_low, clip_high=clip_high)
    advantages = _per_token_shape("dual_clip_ppo_loss", advantages, logp)
    bound = -dual_clip_c * advantages
    with torch.no_grad():
        active = (advantages < 0) & (loss > bound)
        indicators["dual_clip_frac"] = active.float()
    return torch.where(active, bound.expand_as(loss), loss), indicators


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss: PPO-clip on the sequence ratio, broadcast to every token.

    logp, old_logp, loss_mask: [B, T]; advantages: [B] (one per sequence). ``s_i`` is the geometric
    mean of the token ratios over tokens with ``loss_mask == 1`` (a sequence with none has ``s_i = 1``).
    Returns ``(loss [B, T], indicators)``: ``loss[i, t] = L_i`` for every t; ``clip_frac_low`` /
    ``clip_frac_high`` are 1 on every token of a sequence whose clip is active (as in PPO-clip).
    """
    if advantages.shape != logp.shape[:1] or loss_mask.shape != logp.shape:
        raise ValueError(
            f"gspo_loss: expected advantages [B] and loss_mask [B, T] for logp {tuple(logp.shape)}, "
            f"found {tuple(advantages.shape)} and {tuple(loss_mask.shape)}"
        )
    m = loss_mask.to(logp.dtype)
    log_ratio = ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    ratio = torch.exp(log_ratio)  # [B]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        low = ((ratio < 1.0 - clip_low) & (advantages < 0)).float()
        high = ((ratio > 1.0 + clip_high) & (advantages > 0)).float()
    shape = logp.shape
    return loss.unsqueeze(-1).expand(shape), {
        "clip_frac_low": low.unsqueeze(-1).expand(shape),
        "clip_frac_high": high.unsqueeze(-1).expand(shape),
    }


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO per-token loss ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``.

    logp, old_logp: [B, T]; advantages: [B] or [B, T]; ``loss_mask`` ignored. Returns
    ``(loss [B, T], indicators)``: ``clip_frac_low`` (ratio < 1 - clip_low) and ``clip_frac_high``
    (ratio > 1 + clip_high), whatever the sign of A: the tokens whose weight is clipped (their
    gradient is scaled, not zeroed).
    """
    advantages = _per_token_shape("cispo_loss", advantages, logp)
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        indicators = {
            "clip_frac_low": (ratio < 1.0 - clip_low).float(),
            "clip_frac_high": (ratio > 1.0 + clip_high).float(),
        }
    return -weight * advantages * logp, indicators


def sft_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised (weighted negative log-likelihood) per-token loss ``-A * logp``, no ratio.

    logp: [B, T]; advantages: [B] or [B, T], used as per-sample *weights* (with
    :func:`miles.algos.advantages.rejection_sampling`: 1 for accepted responses, 0 otherwise).
    ``old_logp``, ``clip_low``, ``clip_high`` and ``loss_mask`` are accepted for the loss protocol
    and ignored: the gradient is the plain NLL gradient ``-A`` per token, at any ratio. Returns
    ``(loss [B, T], indicators)`` with ``sft_weighted_frac`` (A != 0): the share of trained tokens
    that are learned from. Unlike :func:`miles.train.sft.sft_loss` (the warm start's cross-entropy
    over logits) this takes the trainer's log-probs, so the RL trainer calls it unchanged.
    """
    advantages = _per_token_shape("sft_loss", advantages, logp)
    with torch.no_grad():
        indicators = {"sft_weighted_frac": (advantages != 0).float().expand_as(logp).clone()}
    return -advantages * logp, indicators


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

    logp, ref_logp: [B, T] -> [B, T]. ``estimator`` is ``k1``, ``k2``, ``k3`` or ``low_var_kl``
    (k3 with verl's clamps; module docstring).
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    if estimator == "low_var_kl":
        d = d.clamp(min=-20.0, max=20.0)
        return (torch.exp(d) - d - 1.0).clamp(min=-10.0, max=10.0)
    raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; valid options: k1, k2, k3, low_var_kl")


def mismatch_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mode: MismatchMode,
    level: MismatchLevel,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout/train mismatch weights, TIS (truncate at ``clip``) or MIS (drop above ``clip``), detached.

    old_logp, rollout_logp, loss_mask: [B, T]. ``level="token"`` uses each token's ratio
    ``exp(old_logp - rollout_logp)``; ``level="sequence"`` one ratio per sequence, the product of its
    token ratios over ``loss_mask == 1`` (module docstring), broadcast to every token. ``clip >= 1``.
    Returns ``(weights [B, T], indicator [B, T])``: float32, no gradient; the indicator is 1 on the
    trained tokens whose (token or sequence) ratio exceeds ``clip``, i.e. truncated (TIS) or dropped
    (MIS). Positions with ``loss_mask == 0`` at token level get weight 1 (aggregation ignores them).
    The sequence ratio is compared in log space, so a huge product neither overflows nor gives NaN.
    """
    if clip < 1.0:
        raise ValueError(f"mismatch_weights: clip must be >= 1, found {clip}")
    if mode not in ("tis", "mis"):
        raise ValueError(f"mismatch_weights: unknown mode {mode!r}; valid options: mis, tis")
    if level not in ("token", "sequence"):
        raise ValueError(f"mismatch_weights: unknown level {level!r}; valid options: sequence, token")
    with torch.no_grad():
        m = loss_mask.bool()
        log_ratio = torch.where(m, old_logp.float() - rollout_logp.float(), 0.0)
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        log_clip = torch.tensor(clip, dtype=torch.float32).log()
        over = log_ratio > log_clip
        capped = torch.exp(log_ratio.clamp(max=log_clip))
        weights = capped if mode == "tis" else torch.where(over, 0.0, capped)
        return weights, (over & m).float()


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token_mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token quantity to a scalar.

    loss, mask: [B, T] (mask 1 on tokens that count) -> scalar. ``global_tokens`` (token_mean) and
    ``global_seqs`` (the ``seq_mean_*`` modes: sequences with at least one masked-in token) override
    the local counts; with the global counts, summing the per-rank results gives the global value.
    Counts are clamped to at least 1, so an all-masked batch gives 0, not NaN. ``norm_len`` is the
    constant ``L_max`` of ``seq_mean_token_sum_norm`` (required there, ignored elsewhere).
    """
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        denom = mask.sum() if global_tokens is None else global_tokens
        return (loss * mask).sum() / torch.clamp(torch.as_tensor(denom, dtype=loss.dtype), min=1.0)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        tokens_per_seq = mask.sum(-1)
        per_seq = (loss * mask).sum(-1)
        if mode == "seq_mean_token_mean":
            per_seq = per_seq / tokens_per_seq.clamp(min=1.0)
        elif mode == "seq_mean_token_sum_norm":
            if norm_len is None or norm_len < 1:
                raise ValueError(
                    f"aggregate: seq_mean_token_sum_norm needs norm_len >= 1 (the maximum response length), "
                    f"found {norm_len}"
                )
            per_seq = per_seq / norm_len
        denom = (tokens_per_seq > 0).sum() if global_seqs is None else global_seqs
        return per_seq.sum() / torch.clamp(torch.as_tensor(denom, dtype=loss.dtype), min=1.0)
    raise ValueError(
        f"aggregate: unknown mode {mode!r}; valid options: seq_mean_token_mean, seq_mean_token_sum, "
        "seq_mean_token_sum_norm, token_mean"
    )
