"""Built-in task: pick the largest number of a short list.

``"Which is largest: 37 82 15 4?"`` -> ``"82"``. The answer is always one of
the prompt's own numbers, so a warm-started model answers in the right format
from the start and the reward only judges the comparison. Comparing is one
skill shared by every problem: what RL teaches on training prompts carries
over to held-out ones (unlike memorised arithmetic facts), which makes this
the task on which a tiny model visibly improves by RL on two CPU cores.

Difficulty knobs (:class:`miles.tasks.procedural.Difficulty`): ``list_len`` (more numbers to
compare) and ``max_value`` (numbers of more digits).

Held-out evaluation: a hashed split of the lists (:mod:`miles.tasks.procedural`);
``sample`` never returns an evaluation problem.
"""

from __future__ import annotations

import random

from miles.tasks.procedural import Problem, ProceduralTask, exact_answer_reward

__all__ = ["LargestNumberTask", "exact_answer_reward"]


class LargestNumberTask(ProceduralTask):
    """Lists of ``list_len`` integers in ``[0, max_value]``; the answer is the largest."""

    difficulty_knobs = ("list_len", "max_value")

    def __init__(self, *, list_len: int = 5, max_value: int = 99, heldout_fraction: float = 0.1,
                 eval_seed: int = 12345) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        self._set_difficulty(list_len=list_len, max_value=max_value)

    def _set_difficulty(self, *, list_len: int, max_value: int) -> None:
        if list_len < 2:
            raise ValueError(f"list_len: must be at least 2, found {list_len}")
        if max_value < 1:
            raise ValueError(f"max_value: must be at least 1, found {max_value}")
        self.list_len, self.max_value = list_len, max_value

    def draw(self, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.randint(0, self.max_value) for _ in range(self.list_len))

    def key_text(self, key: tuple[int, ...]) -> str:
        return " ".join(map(str, key))

    def problem(self, key: tuple[int, ...]) -> Problem:
        return Problem(prompt=f"Which is largest: {' '.join(map(str, key))}?", label=str(max(key)))
