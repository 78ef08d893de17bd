"""Rewards: a runner that scores with a deadline in worker processes, and reward functions.

- :mod:`miles.rewards.runner`: :class:`RewardRunner`, :class:`RewardItem`, :class:`RewardOutcome`.
- :mod:`miles.rewards.math`: ``math_verify_reward`` (``math-verify`` parse + verify).
- :mod:`miles.rewards.gym`: ``gym_reward`` (reasoning-gym's own scorer for :mod:`miles.tasks.gym` labels).

Nothing heavy is imported here: reward workers import this package before they cap their threads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RewardItem", "RewardOutcome", "RewardRunner"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from miles.rewards import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'miles.rewards' has no attribute '{name}'")
