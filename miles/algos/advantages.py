"""Advantage estimators: turn per-sample rewards into per-sample advantages.

GRPO (Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
Language Models", eq. 4 / section 4.1.2, outcome supervision) replaces PPO's learned value
baseline by the statistics of a *group* of ``n`` responses sampled for the same prompt::

    A_{g,i} = (r_{g,i} - mean_j r_{g,j}) / (std_j r_{g,j} + eps)

and gives every token of response ``i`` the same advantage ``A_{g,i}``.

Which std: the *population* standard deviation (divide by ``n``, ``unbiased=False``). With it the
advantages of a group with any spread have exactly zero mean and unit mean square, for every group
size, so the scale of the policy gradient does not depend on ``n``. Bessel's correction (TRL and
verl use ``torch.std``'s default) shrinks every advantage by ``sqrt((n - 1) / n)`` (0.71 at n=2,
0.94 at n=8): a group-size-dependent rescaling of the learning rate, not an estimator of anything
we need unbiased. A group whose rewards are all equal gets advantages 0 (no signal), never NaN.

``normalize_std=False`` keeps only the mean baseline (Dr. GRPO, Liu et al. 2025, "Understanding
R1-Zero-Like Training: A Critical Perspective", argues the std division biases towards easy and
hard prompts). Shipped as ``conf/algo/dr_grpo.yaml``.

RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs", eq. 5, after Kool et al. 2019) uses the *leave-one-out* mean of the
other ``n - 1`` samples of the group as the baseline, so the baseline does not depend on the sample
it is subtracted from and the estimator stays unbiased::

    A_{g,i} = r_{g,i} - 1/(n-1) sum_{j != i} r_{g,j}  =  n/(n-1) * (r_{g,i} - mean_j r_{g,j})

REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
Models", section 3) drops the per-prompt baseline and normalises with the statistics of the whole
*batch* (all ``G * n`` responses of the step)::

    reinforce_pp:            A = (r - mean_batch r) / (std_batch r + eps)
    reinforce_pp_baseline:   c = r - mean_group r;  A = (c - mean_batch c) / (std_batch c + eps)

``reinforce_pp_baseline`` is the paper's "REINFORCE++-baseline" for reasoning tasks (group-mean
baseline, then batch std); ``mean_batch c`` is 0 because every group is centred, so in effect
``A = c / (std_batch c + eps)``. Deviations from the paper, both on purpose: (1) the paper folds a
per-token KL penalty into the return before normalising; here KL is a loss term (``algo.kl_coef``),
so the normalised quantity is the sequence reward; (2) OpenRLHF whitens over *tokens* (a long
response counts once per token); here each response counts once. Stds are population stds, as above.

Rejection sampling (for ``algo=sft``, rejection-sampling fine-tuning) is not an advantage estimator
in the policy-gradient sense: it turns each reward into a 0/1 *weight* for the supervised loss
:func:`miles.algos.losses.sft_loss`, ``w = 1[r > threshold]``, so only accepted (correct) responses
are learned from and the rest contribute nothing. With ``loss_agg: token_mean`` the denominator
still counts the rejected responses' tokens: the step size scales with the accepted share of
tokens, which shrinks updates when few responses pass (RAFT/ReST instead drop the rejected samples
from the batch; here the batch keeps its shape so it still splits evenly over ranks).
"""

from __future__ import annotations

import torch


def group_normalized(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6,
                     unbiased_std: bool = False) -> torch.Tensor:
    """GRPO advantages. rewards: [G, n] (G prompts, n samples each) -> advantages [G, n] fp32.

    ``(r - mean_group) / (std_group + eps)`` with the population std (see the module docstring),
    or Bessel's std with ``unbiased_std=True`` (TRL's and verl's convention, for like-for-like
    comparisons); with ``normalize_std=False`` just ``r - mean_group``.
    """
    r = _check_groups("group_normalized", rewards, min_samples=2)
    centered = r - r.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (r.std(dim=1, unbiased=unbiased_std, keepdim=True) + eps)


def _check_groups(name: str, rewards: torch.Tensor, min_samples: int = 1) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"{name}: rewards must be [num_groups, samples_per_group], found shape {tuple(rewards.shape)}")
    if rewards.shape[1] < min_samples:
        raise ValueError(
            f"{name}: needs at least {min_samples} samples per group, found {rewards.shape[1]} "
            "(raise algo.num_samples_per_prompt)"
        )
    return rewards.float()


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO advantages. rewards: [G, n], n >= 2 -> advantages [G, n] fp32.

    ``r_i - mean_{j != i} r_j`` (leave-one-out baseline, see the module docstring).
    """
    r = _check_groups("rloo", rewards, min_samples=2)
    n = r.shape[1]
    return r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)


def reinforce_pp(rewards: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantages. rewards: [G, n] -> advantages [G, n] fp32.

    ``(r - mean_batch) / (std_batch + eps)`` over all ``G * n`` rewards: no per-prompt baseline.
    A batch whose rewards are all equal gets 0.
    """
    r = _check_groups("reinforce_pp", rewards)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def reinforce_pp_baseline(rewards: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline advantages. rewards: [G, n] -> advantages [G, n] fp32.

    Subtract the group mean, then whiten with the *batch* mean (0) and std of the centred rewards.
    """
    r = _check_groups("reinforce_pp_baseline", rewards, min_samples=2)
    centered = r - r.mean(dim=1, keepdim=True)
    return (centered - centered.mean()) / (centered.std(unbiased=False) + eps)


def rejection_sampling(rewards: torch.Tensor, *, threshold: float = 0.5) -> torch.Tensor:
    """Rejection-sampling weights. rewards: [G, n] -> [G, n] fp32, 1 where ``r > threshold`` else 0.

    Used with :func:`miles.algos.losses.sft_loss` (module docstring); groups may have any size.
    """
    r = _check_groups("rejection_sampling", rewards)
    return (r > threshold).float()
