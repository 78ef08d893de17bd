"""Reward shaping applied to the task reward before advantages are computed.

Soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", eq. 13): a response of ``L`` tokens, with the generation cap ``L_max`` and a buffer of
the last ``L_cache`` tokens before it, gets a length reward added to its task reward::

    R_length(L) =  0                                  L <= L_max - L_cache
                   ((L_max - L_cache) - L) / L_cache  L_max - L_cache < L <= L_max
                   -1                                 L > L_max

i.e. a linear ramp from 0 to -1 over the buffer, so a truncated answer is punished in proportion
to how far into the buffer it ran rather than by an all-or-nothing cliff. ``penalty`` scales it
(verl's ``overlong_penalty_factor``; the paper uses 1). Here ``L_max`` is
``rollout.max_new_tokens``, ``L_cache`` is ``algo.overlong_buffer_len`` (the paper: 4096 of 20480,
i.e. 20%), and the engine never emits more than ``L_max`` tokens, so the last branch is reached
only through a response reported longer than the cap (kept for the paper's definition).
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment ``penalty * R_length(L)`` (module docstring).

    lengths: [...] response lengths in tokens (any int or float dtype) -> [...] fp32 in
    ``[-penalty, 0]``. ``0 < cache_len < max_len``, ``penalty >= 0``.
    """
    if not 0 < cache_len < max_len:
        raise ValueError(
            f"overlong_penalty: the buffer must satisfy 0 < algo.overlong_buffer_len < rollout.max_new_tokens; "
            f"found {cache_len} and {max_len} (set algo.overlong_buffer_len=0 to disable the shaping)"
        )
    if penalty < 0:
        raise ValueError(f"overlong_penalty: penalty must be >= 0 (algo.overlong_penalty_factor), found {penalty}")
    lengths = lengths.float()
    start = float(max_len - cache_len)
    ramp = (start - lengths) / cache_len
    r = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    r = torch.where(lengths > max_len, torch.full_like(lengths, -1.0), r)
    return penalty * r


def shape_overlong_rewards(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_len: int,
    buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """Task rewards plus the soft overlong punishment; unchanged when ``buffer_len`` or ``penalty_factor`` is 0.

    rewards: [G, n] fp32, lengths: [G, n] response token counts -> shaped rewards [G, n] fp32
    (a new tensor; the input is not modified). ``max_len`` is ``rollout.max_new_tokens``,
    ``buffer_len`` ``algo.overlong_buffer_len``, ``penalty_factor`` ``algo.overlong_penalty_factor``.
    """
    if rewards.shape != lengths.shape:
        raise ValueError(f"shape_overlong_rewards: rewards {tuple(rewards.shape)} and lengths "
                         f"{tuple(lengths.shape)} must have the same [G, n] shape")
    if buffer_len == 0 or penalty_factor == 0:
        return rewards.float().clone()
    return rewards.float() + overlong_penalty(lengths, max_len, buffer_len, penalty_factor)
