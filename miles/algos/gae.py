"""PPO with a learned critic: generalized advantage estimation and the clipped value loss.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16 and its recursive form) over the response tokens of each sequence, with the
task reward placed on the last response token and no reward elsewhere::

    delta_t = r_t + gamma * V_{t+1} - V_t              V_{T} = 0 after the last token
    A_t     = delta_t + gamma * lam * A_{t+1}          (= sum_l (gamma lam)^l delta_{t+l})
    R_t     = A_t + V_t                                the critic's regression target

``V_t`` is the critic's value of the state *before* response token ``t`` (prompt plus the first
``t`` response tokens), the same position whose logits predict token ``t``. Tokens with
``mask == 0`` are not steps: the recursion passes over them, carrying ``V_{t+1}`` and ``A_{t+1}``
unchanged, and they get whatever those carried values are (their advantage is never trained on).
This handles right padding (nothing after the end: ``A = 0``) and environment tokens inside a
multi-turn response alike, as in verl (``verl/trainer/ppo/core_algos.py``,
``compute_gae_advantage_return``). With ``gamma = 1, lam = 1`` GAE is the Monte-Carlo advantage
``r - V_t``; with ``lam = 0`` it is the one-step TD error.

Whitening (optional, verl's ``masked_whiten``, and PPO2's advantage normalisation):
``A <- (A - mean(A)) / sqrt(var(A) + 1e-8)`` over the valid tokens of the whole batch. The
returns are computed *before* whitening (they are value targets, in reward units).

Clipped value loss (PPO2 / OpenAI baselines ``ppo2/model.py``; verl ``compute_value_loss``):
the new prediction may not move the loss below what it would be if it had stayed within ``clip``
of the value it predicted at rollout time::

    V_clip = old_V + clamp(V - old_V, -clip, clip)
    L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

``vf_clip_frac`` is the share of valid tokens where ``|V - old_V| > clip`` and the clipped term is the
larger one: the tokens that get no gradient.
"""

from __future__ import annotations

import torch


def gae(
    rewards_tok: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and returns (module docstring), no gradient.

    rewards_tok, values, mask: [B, T] (right-padded; ``mask`` 1 on the tokens that are steps).
    ``gamma, lam`` in [0, 1]. Returns ``(advantages [B, T], returns [B, T])`` fp32, with
    ``returns = advantages + values``; positions after a sequence's last valid token get
    advantage 0.
    """
    if rewards_tok.shape != values.shape or mask.shape != values.shape or values.dim() != 2:
        raise ValueError(
            "gae: rewards_tok, values and mask must all be [B, T]; found "
            f"{tuple(rewards_tok.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"gae: {name} must be in [0, 1] (algo.{name}), found {v}")
    with torch.no_grad():
        r, v, m = rewards_tok.float(), values.float(), mask.float()
        next_value = torch.zeros_like(v[:, 0])
        next_adv = torch.zeros_like(v[:, 0])
        advantages = torch.zeros_like(v)
        for t in reversed(range(v.shape[1])):
            delta = r[:, t] + gamma * next_value - v[:, t]
            adv_t = delta + gamma * lam * next_adv
            # a masked position is not a step: carry the later value and advantage through it
            next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
            next_adv = torch.where(m[:, t] > 0, adv_t, next_adv)
            advantages[:, t] = next_adv
        return advantages, advantages + v


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and population variance over ``mask == 1``.

    x, mask: [B, T] -> [B, T] fp32. Masked-out positions are set to 0. Fewer than two valid
    tokens: returned centred, unscaled (no spread to normalise).
    """
    m = mask.float()
    n = m.sum()
    if n < 2:
        return (x.float() - (x.float() * m).sum() / n.clamp(min=1.0)) * m
    mean = (x.float() * m).sum() / n
    var = (((x.float() - mean) * m) ** 2).sum() / n
    return (x.float() - mean) * torch.rsqrt(var + eps) * m


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None,
    global_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (module docstring), token mean over ``mask == 1``.

    values (with grad), old_values, returns, mask: [B, T]. ``clip``: the value clip range
    (``algo.critic.value_clip``; None disables clipping). ``global_tokens`` overrides the local
    mask count, so per-rank results sum to the global value. Returns ``(loss scalar, clip_frac
    scalar)``; ``clip_frac`` is detached and counts over the same denominator.
    """
    if not values.shape == old_values.shape == returns.shape == mask.shape:
        raise ValueError(
            "value_loss: values, old_values, returns and mask must have the same [B, T] shape; found "
            f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    if clip is not None and clip <= 0:
        raise ValueError(f"value_loss: clip must be > 0 or None (algo.critic.value_clip), found {clip}")
    m = mask.to(values.dtype)
    denom = m.sum() if global_tokens is None else torch.as_tensor(global_tokens, dtype=values.dtype)
    denom = torch.clamp(denom, min=1.0)
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * (unclipped * m).sum() / denom, torch.zeros((), dtype=values.dtype)
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(unclipped, clipped) * m).sum() / denom
    with torch.no_grad():
        # the clip is active (not rounding noise of old + (V - old) == V) and its term is the larger
        active = ((values - old_values).abs() > clip) & (clipped > unclipped)
        clip_frac = (active.to(values.dtype) * m).sum() / denom
    return loss, clip_frac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over ``mask == 1`` (1: perfect critic, 0: as good as a constant).

    values, returns, mask: [B, T]. NaN when the returns have no variance.
    """
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var_r = r.var(unbiased=False)
    if r.numel() == 0 or var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


def gae_from_lists(
    rewards: list[float],
    values: list[list[float]],
    loss_mask: list[list[int]],
    *,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
) -> tuple[list[list[float]], list[list[float]]]:
    """GAE for a batch in list form (what the loop holds): one reward per sample, values per token.

    rewards: B floats; values, loss_mask: B lists of per-response-token floats / 0-1 ints of the
    same lengths. The reward sits on the sample's last token with ``loss_mask == 1`` (a sample
    with none gets advantage 0 everywhere). Returns ``(token_advantages, returns)``, B lists of
    the response lengths, advantages whitened over all valid tokens when ``whiten_advantages``.
    """
    b = len(rewards)
    if len(values) != b or len(loss_mask) != b:
        raise ValueError(f"gae_from_lists: {b} rewards but {len(values)} value lists and {len(loss_mask)} masks")
    lengths = [len(v) for v in values]
    if [len(m) for m in loss_mask] != lengths:
        raise ValueError("gae_from_lists: each sample's values and loss_mask must have the same length "
                         f"(its response length); found {lengths} and {[len(m) for m in loss_mask]}")
    t = max(1, max(lengths, default=1))
    v = torch.zeros(b, t)
    m = torch.zeros(b, t)
    r = torch.zeros(b, t)
    for i, (vals, mask_i) in enumerate(zip(values, loss_mask, strict=True)):
        v[i, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
        m[i, : len(vals)] = torch.tensor(mask_i, dtype=torch.float32)
        valid = [j for j, x in enumerate(mask_i) if x]
        if valid:
            r[i, valid[-1]] = rewards[i]
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    if whiten_advantages:
        adv = whiten(adv, m)
    adv = adv * m
    return ([row[:n] for row, n in zip(adv.tolist(), lengths, strict=True)],
            [row[:n] for row, n in zip(ret.tolist(), lengths, strict=True)])
