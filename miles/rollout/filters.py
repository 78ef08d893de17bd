"""Sample filters: which scored groups enter the batch (protocol :class:`~miles.rollout.protocols.SampleFilter`).

Dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", section 3.2): a group whose rewards are all equal (every response right, or every one
wrong) has zero advantage under a group baseline and contributes no gradient, only noise in the
token count. DAPO drops such groups and keeps sampling until the batch is full; here the manager
draws more prompts for at most ``rollout.max_oversample_rounds`` extra rounds (see
:meth:`miles.rollout.manager.RolloutManager.collect`).

Only trainable samples count: failed or aborted responses have no reward to compare.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from miles.types import Sample


def nonzero_reward_std(group: Sequence[Sample], *, min_std: float = 0.0) -> tuple[bool, str]:
    """Keep a group whose trainable samples' rewards have population std > ``min_std`` (DAPO)."""
    rewards = [s.reward for s in group if s.trainable]
    if len(rewards) < 2:
        return False, f"{len(rewards)} trainable sample(s): no reward spread to learn from"
    std = statistics.pstdev(rewards)
    if std <= min_std:
        return False, f"reward std {std:.3g} <= {min_std:g}"
    return True, ""


def first_rejection(
    filters: Sequence[tuple[str, Callable[[Sequence[Sample]], tuple[bool, str]]]], group: Sequence[Sample]
) -> tuple[str, str] | None:
    """``(filter name, reason)`` of the first filter that drops ``group``, or None when all keep it."""
    for name, fn in filters:
        keep, reason = fn(group)
        if not keep:
            return name, reason
    return None
