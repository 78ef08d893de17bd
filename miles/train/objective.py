"""The RL training objective of one mini-batch on one rank, and its metrics.

Per token (see :mod:`miles.algos.losses` for the formulas and citations)::

    pg_t   = w_t * L_policy(logp_t, old_logp_t, A)        w_t = TIS / MIS weight, or 1 when off
    loss   = agg(pg) + kl_coef * agg(kl(logp, ref_logp)) - entropy_coef * agg(entropy)

``w_t`` is :func:`miles.algos.losses.mismatch_weights` (token or sequence level, threshold
``tis_clip``). ``agg`` is :func:`miles.algos.losses.aggregate` with the *global* token / sequence
counts of the mini-batch (summed over data-parallel ranks), so the value here is this rank's share:
the sum over ranks equals the loss of one rank holding the whole mini-batch. Metrics follow the same
rule (each is a token mean over the global loss-mask tokens), so one all-reduce SUM makes them
global.

Under an async schedule (``schedule`` other than ``sync``) the samples may come from older weights and
mix versions; ``old_logp`` is then the proximal policy (recomputed at the start of the update) and the
truncated weight ``w_t`` against ``rollout_logp`` (the behaviour policy of each token) is always on:
decoupled PPO (:func:`miles.algos.losses.decoupled_ppo_loss`). :func:`mismatch_settings` picks it.

This module is pure tensor math: no process group, no model, testable on its own.
"""

from __future__ import annotations

import torch

from miles.algos.losses import (
    MismatchLevel,
    MismatchMode,
    aggregate,
    kl_penalty,
    mismatch_weights,
    vanishes_at_zero_advantage,
)
from miles.algos.protocols import PolicyLossFn
from miles.config.rank import RankConfig
from miles.config.schema import AlgoConfig


def mismatch_settings(config: RankConfig, *, same_forward: bool = True) -> dict[str, object]:
    """``tis_clip``, ``mismatch_mode``, ``mismatch_level`` for :func:`policy_objective`.

    ``precision.*`` when the precision recipe corrects a mismatch (:func:`~miles.precision.recipe.effective_tis_clip`
    is set; ``same_forward=False``: the trainer's model is another implementation than the engine's); otherwise,
    under an async schedule, token-level truncation at ``schedule.behaviour_is_clip`` (decoupled PPO's behaviour
    weight); otherwise off.
    """
    from miles.precision.recipe import effective_tis_clip

    p = config.precision
    clip = effective_tis_clip(p, same_forward=same_forward)
    if clip is None and config.behaviour_is_clip is not None:
        return {"tis_clip": config.behaviour_is_clip, "mismatch_mode": "tis", "mismatch_level": "token"}
    return {"tis_clip": clip, "mismatch_mode": p.mismatch_mode, "mismatch_level": p.mismatch_level}


def skips_zero_advantage(config: RankConfig, policy_loss_fn: PolicyLossFn) -> bool:
    """Whether the trainer leaves samples with no advantage out of its passes (``trainer.skip_zero_advantage``):
    only when they add nothing to the loss, i.e. a policy loss that vanishes at zero advantage, no KL
    term and no entropy term (the normalization still counts their tokens)."""
    a = config.algo
    return (config.trainer.skip_zero_advantage and a.kl_coef == 0 and a.entropy_coef == 0
            and vanishes_at_zero_advantage(policy_loss_fn))


def policy_objective(*, logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     advantages: torch.Tensor, loss_mask: torch.Tensor, entropy: torch.Tensor,
                     policy_loss_fn: PolicyLossFn, algo: AlgoConfig, tis_clip: float | None = None,
                     mismatch_mode: MismatchMode = "tis", mismatch_level: MismatchLevel = "token",
                     ref_logp: torch.Tensor | None = None, global_tokens: torch.Tensor | float | None = None,
                     global_seqs: torch.Tensor | float | None = None,
                     norm_len: int | None = None,
                     metric_tokens: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's share of the loss (scalar, differentiable) and of each metric (detached scalars).

    logp (with grad), old_logp, rollout_logp, loss_mask, entropy, ref_logp: [B, T]; advantages: [B] (one
    per sequence, broadcast over its tokens) or [B, T] (per-token advantages, e.g. PPO/GAE).
    Metrics: ``train/loss``, ``train/pg_loss``, one ``train/<name>`` per indicator of the policy loss
    (``clip_frac_low``, ``clip_frac_high``), ``train/entropy``, ``train/logp_mismatch_abs_mean``,
    ``train/kl`` when ``ref_logp`` is given, and when ``tis_clip`` is set ``train/tis_clip_frac``
    (``mismatch_mode="tis"``: truncated tokens) or ``train/mis_masked_frac`` ("mis": dropped tokens).
    ``norm_len`` is the constant of ``loss_agg: seq_mean_token_sum_norm`` (the maximum response length).
    ``metric_tokens``: the global token count the metrics' token means divide by, when the passes
    compute fewer tokens than the loss normalizes by (:func:`skips_zero_advantage`); default
    ``global_tokens``.
    """
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"policy_objective: advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, "
                         f"found {tuple(advantages.shape)}")
    if algo.kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_objective: algo.kl_coef > 0 needs ref_logp from the reference model")

    def agg(x: torch.Tensor) -> torch.Tensor:
        return aggregate(
            x, loss_mask, algo.loss_agg,
            global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len,
        )

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x.detach().float(), loss_mask, "token_mean",
                         global_tokens=global_tokens if metric_tokens is None else metric_tokens)

    pg_tok, indicators = policy_loss_fn(logp, old_logp, advantages, loss_mask=loss_mask)
    metrics: dict[str, torch.Tensor] = {}
    if tis_clip is not None:
        w, over = mismatch_weights(
            old_logp, rollout_logp, loss_mask, mode=mismatch_mode, level=mismatch_level, clip=tis_clip
        )
        pg_tok = pg_tok * w
        name = "train/tis_clip_frac" if mismatch_mode == "tis" else "train/mis_masked_frac"
        metrics[name] = token_mean(over)
    pg_loss = agg(pg_tok)
    loss = pg_loss
    if ref_logp is not None:
        kl_tok = kl_penalty(logp, ref_logp, algo.kl_estimator)
        metrics["train/kl"] = token_mean(kl_tok)
        if algo.kl_coef > 0:
            loss = loss + algo.kl_coef * agg(kl_tok)
    if algo.entropy_coef != 0:
        loss = loss - algo.entropy_coef * agg(entropy)

    metrics["train/loss"] = loss.detach()
    metrics["train/pg_loss"] = pg_loss.detach()
    for name, indicator in indicators.items():
        metrics[f"train/{name}"] = token_mean(indicator)
    metrics["train/entropy"] = token_mean(entropy)
    metrics["train/logp_mismatch_abs_mean"] = token_mean((rollout_logp - old_logp).abs())
    return loss, dict(sorted(metrics.items()))
