"""From scored groups to trainable samples: reward shaping, advantages, and the reward metrics of a step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from miles.algos.shaping import shape_overlong_rewards
from miles.config.schema import MilesConfig
from miles.types import Sample


def assign_advantages(groups: Sequence[Sequence[Sample]], advantage_fn: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, float]:
    """Set every sample's advantage from its group's *trainable* samples; returns reward metrics.

    Samples that are not trainable (failed, aborted, in a filtered group) stay in their group with
    advantage 0 and an all-zero loss mask: out of the loss and out of their group's statistics.
    Groups are stacked by their number ``k`` of trainable samples into ``[G_k, k]`` rewards, one
    ``advantage_fn`` call per ``k`` (usually a single ``[G, n]`` call). A group with fewer trainable
    samples than the estimator accepts (a group baseline needs 2) has no baseline: advantage 0 and
    masked out too. Batch-normalised estimators (REINFORCE++) see per-``k`` statistics.
    """
    n = max(len(g) for g in groups)
    by_size: dict[int, list[list[Sample]]] = {}
    for group in groups:
        valid = [s for s in group if s.trainable]
        for s in group:
            if not s.trainable:
                s.advantage, s.loss_mask = 0.0, [0] * len(s.response_ids)
        if valid:
            by_size.setdefault(len(valid), []).append(valid)
    for k, valid_groups in by_size.items():
        rewards = torch.tensor([[s.reward for s in g] for g in valid_groups], dtype=torch.float32)
        try:
            advantages = advantage_fn(rewards).tolist()
        except ValueError:
            if k == n:
                raise
            advantages = [[0.0] * k for _ in valid_groups]
            for s in (s for g in valid_groups for s in g):
                s.loss_mask = [0] * len(s.response_ids)
        for group, advs in zip(valid_groups, advantages, strict=True):
            for sample, adv in zip(group, advs, strict=True):
                sample.advantage = adv
    return reward_metrics(groups)


def shape_overlong(groups: Sequence[Sequence[Sample]], run: MilesConfig) -> dict[str, float]:
    """DAPO soft overlong punishment added to every sample's reward; the penalty's mean as a metric."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
    lengths = torch.tensor([[len(s.response_ids) for s in g] for g in groups])
    shaped = shape_overlong_rewards(rewards, lengths, max_len=run.rollout.max_new_tokens,
                                    buffer_len=run.algo.overlong_buffer_len,
                                    penalty_factor=run.algo.overlong_penalty_factor)
    for group, row in zip(groups, shaped.tolist(), strict=True):
        for s, r in zip(group, row, strict=True):
            s.reward = r
    return {"train/overlong_penalty_mean": (shaped - rewards).mean().item()}


def reward_metrics(groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """Mean and std of the trainable samples' rewards, the share of groups whose trainable rewards are
    all equal (no signal), and how many samples are trainable / left out of the loss."""
    rewards = [[s.reward for s in g if s.trainable] for g in groups]
    flat = torch.tensor([r for g in rewards for r in g], dtype=torch.float32)
    stds = [torch.tensor(g).std(unbiased=False).item() for g in rewards if g]
    return {
        "train/reward_mean": flat.mean().item() if len(flat) else float("nan"),
        "train/reward_std": flat.std(unbiased=False).item() if len(flat) else float("nan"),
        "train/zero_std_group_frac": sum(s == 0 for s in stds) / max(len(stds), 1),
        "train/trainable_samples": float(len(flat)),
        "train/excluded_samples": float(sum(len(g) for g in groups) - len(flat)),
    }


def why_untrainable(samples: Sequence[Sample]) -> str:
    """The most common reasons samples are out of the loss, for a log line."""
    reasons = Counter(s.failure or s.filtered or s.status.value for s in samples if not s.trainable)
    return "; ".join(f"{c} x {r}" for r, c in reasons.most_common(3))
