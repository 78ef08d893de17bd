"""Built-in task: pick the largest number of a short list.

``"Which is largest: 37 82 15 4?"`` -> ``"82"``. The answer is always one of
the prompt's own numbers, so a warm-started model answers in the right format
from the start and the reward only judges the comparison. Comparing is one
skill shared by every problem: what RL teaches on training prompts carries
over to held-out ones (unlike memorised arithmetic facts), which makes this
the task on which a tiny model visibly improves by RL on two CPU cores.

Held-out evaluation: every list belongs to the evaluation split or to the
training split by a hash of ``(eval_seed, list)``; ``sample`` never returns an
evaluation problem.
"""

from __future__ import annotations

import random

from miles.tasks.arithmetic import Problem, exact_answer_reward, in_heldout

__all__ = ["LargestNumberTask", "exact_answer_reward"]


class LargestNumberTask:
    """Lists of ``list_len`` integers in ``[0, max_value]``; the answer is the largest."""

    def __init__(self, *, list_len: int = 5, max_value: int = 99, heldout_fraction: float = 0.1,
                 eval_seed: int = 12345) -> None:
        if list_len < 2:
            raise ValueError(f"list_len: must be at least 2, found {list_len}")
        if max_value < 1:
            raise ValueError(f"max_value: must be at least 1, found {max_value}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: must be in (0, 1), found {heldout_fraction}")
        self.list_len, self.max_value = list_len, max_value
        self.heldout_fraction, self.eval_seed = heldout_fraction, eval_seed

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.randint(0, self.max_value) for _ in range(self.list_len))

    def is_heldout(self, numbers: tuple[int, ...]) -> bool:
        return in_heldout(" ".join(map(str, numbers)), self.eval_seed, self.heldout_fraction)

    @staticmethod
    def _problem(numbers: tuple[int, ...]) -> Problem:
        return Problem(prompt=f"Which is largest: {' '.join(map(str, numbers))}?", label=str(max(numbers)))

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` training problems, never from the evaluation split."""
        out: list[Problem] = []
        while len(out) < n:
            numbers = self._draw(rng)
            if not self.is_heldout(numbers):
                out.append(self._problem(numbers))
        return out

    def eval_problems(self, n: int) -> list[Problem]:
        """The first ``n`` distinct problems of the evaluation split: the same list on every call."""
        rng = random.Random(self.eval_seed)
        seen: set[tuple[int, ...]] = set()
        out: list[Problem] = []
        for _ in range(1000 * n + 10_000):
            if len(out) == n:
                return out
            numbers = self._draw(rng)
            if numbers not in seen and self.is_heldout(numbers):
                seen.add(numbers)
                out.append(self._problem(numbers))
        raise ValueError(f"eval_problems: found only {len(out)} distinct held-out problems, asked for {n}")

    def corpus(self) -> list[str]:
        """Tokenizer training text: prompts and answers of a fixed sample."""
        problems = self.sample(2000, random.Random(0))
        return [p.prompt for p in problems] + [p.label for p in problems] + ["0123456789"]

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        return [(p.prompt, p.label) for p in self.sample(n, rng)]
