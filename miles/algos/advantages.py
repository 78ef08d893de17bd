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
hard prompts).
"""

from __future__ import annotations

import torch


def group_normalized(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages. rewards: [G, n] (G prompts, n samples each) -> advantages [G, n] fp32.

    ``(r - mean_group) / (std_group + eps)`` with the population std (see the module docstring);
    with ``normalize_std=False`` just ``r - mean_group``.
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"group_normalized: rewards must be [num_groups, samples_per_group], found shape {tuple(rewards.shape)}"
        )
    r = rewards.float()
    centered = r - r.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
