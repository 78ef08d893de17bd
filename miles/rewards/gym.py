"""reasoning-gym's own scorer as a miles reward: ``gym_reward(response_text, label) -> float``.

The label is what :class:`miles.tasks.gym.ReasoningGymTask` puts in each problem:
``{"dataset": name, "config": {...}, "entry": {"question", "answer", "metadata"}}``. The dataset
object is rebuilt from name and config (once per process, cached) because ``score_answer`` is a
method of it; e.g. countdown evaluates the response as an expression with sympy and checks it uses
exactly the given numbers and hits the target. That evaluation can take unbounded time on a response
like ``9**9**9**9``: run it under :class:`miles.rewards.runner.RewardRunner`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import reasoning_gym  # at import, not at the first call: a reward worker's start has no deadline

__all__ = ["gym_math_verify_reward", "gym_reward"]


def gym_reward(response_text: str, label: Mapping[str, Any]) -> float:
    """reasoning-gym's ``score_answer`` of the stripped response for the entry in ``label`` (0.0 to 1.0)."""
    try:
        name, config, entry = label["dataset"], label["config"], label["entry"]
    except (TypeError, KeyError) as e:
        raise ValueError("gym_reward: expected a label {'dataset', 'config', 'entry'} from "
                         f"miles.tasks.gym.ReasoningGymTask, found {str(label)[:200]!r}") from e
    dataset = _dataset(name, json.dumps(dict(config), sort_keys=True))
    return float(dataset.score_answer(response_text.strip(), entry))


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str) -> Any:
    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(config_json))


def gym_math_verify_reward(response_text: str, label: Mapping[str, Any]) -> float:
    """math-verify's comparison of the response's final answer with the entry's answer (0.0 or 1.0).

    For tasks whose answer is a number or an expression: ``12 + 7 = 19`` and ``\\boxed{19}`` both
    match ``"19"`` (:func:`miles.rewards.math.math_verify_reward`).
    """
    from miles.rewards.math import math_verify_reward

    try:
        answer = label["entry"]["answer"]
    except (TypeError, KeyError) as e:
        raise ValueError("gym_math_verify_reward: expected a label {'dataset', 'config', 'entry'} from "
                         f"miles.tasks.gym.ReasoningGymTask, found {str(label)[:200]!r}") from e
    return math_verify_reward(response_text, answer)
