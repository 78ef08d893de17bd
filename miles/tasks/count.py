"""Built-in task: count from one number to another.

``"Count from 37 to 45."`` -> ``"37 38 39 40 41 42 43 44 45"``. The answer's
length is the span of the count, drawn uniformly from ``[1, max_span]``, so
response lengths vary widely within one batch: the workload on which padded
static batching wastes most of its work and continuous batching pays off
(``python -m miles.bench e2e`` uses it as its ``long`` workload). Counting is one
skill shared by every problem, so RL gains carry to held-out problems; a long
count must be right in every number to score 1.

Difficulty knobs (:class:`miles.tasks.procedural.Difficulty`): ``max_span`` (longer counts; keep
``rollout.max_new_tokens`` above it, each number is one or two tokens) and ``max_start``
(counts among larger numbers).

Held-out evaluation: a hashed split of ``(start, span)`` (:mod:`miles.tasks.procedural`).
"""

from __future__ import annotations

import random

from miles.tasks.procedural import Problem, ProceduralTask

__all__ = ["CountTask", "count_reward"]


class CountTask(ProceduralTask):
    """Counts of ``span`` in ``[1, max_span]`` consecutive integers starting in ``[0, max_start]``."""

    difficulty_knobs = ("max_start", "max_span")

    def __init__(self, *, max_start: int = 99, max_span: int = 64, heldout_fraction: float = 0.1,
                 eval_seed: int = 12345) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        self._set_difficulty(max_start=max_start, max_span=max_span)

    def _set_difficulty(self, *, max_start: int, max_span: int) -> None:
        if max_start < 0:
            raise ValueError(f"max_start: must be >= 0, found {max_start}")
        if max_span < 1:
            raise ValueError(f"max_span: must be >= 1, found {max_span}")
        self.max_start, self.max_span = max_start, max_span

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(0, self.max_start), rng.randint(1, self.max_span)

    def key_text(self, key: tuple[int, int]) -> str:
        return f"{key[0]} {key[1]}"

    def problem(self, key: tuple[int, int]) -> Problem:
        start, span = key
        end = start + span - 1
        return Problem(prompt=f"Count from {start} to {end}.", label=" ".join(map(str, range(start, end + 1))))


def count_reward(response_text: str, label: str) -> float:
    """Partial credit: the numbers right, in order from the first, over the longer of answer and response.

    ``"37 38 39"`` for ``"37 38 39 40"`` scores 0.75; ``"37 38 40 41"`` scores 0.5 (the count broke
    at the third number); an exact answer scores 1.0 and a response that runs past the end is
    charged for the extra numbers (``"1 2 3"`` for ``"1 2"`` scores 2/3). Non-numbers end the count.
    A long count is then a graded signal instead of almost always 0.
    """
    want, got = str(label).split(), response_text.split()
    right = 0
    for w, g in zip(want, got, strict=False):
        if w != g:
            break
        right += 1
    return right / max(len(want), len(got), 1)
