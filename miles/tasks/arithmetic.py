"""The built-in task: integer arithmetic with a short exact answer.

``"What is 37 + 45?"`` -> ``"82"``. It is small enough that a tiny model
learns it on two CPU cores, and graded enough that RL has something to do:
each operand first draws its number of digits uniformly (1 or 2 for the
default ``max_operand=30``), then its value, so a batch mixes easy problems
(``3 + 4``), medium ones (``27 + 4``) and harder ones with carries and
borrows (``28 + 19``, ``23 - 9``). The defaults are tuned so that the default
warm start leaves the tiny model about 20-30% right (greedy) on held-out
problems, and right at least once in 8 samples at temperature 1 on about
two thirds of them: partial skill, with signal and headroom for RL. Subtraction puts the larger operand first, so answers are
never negative.

Difficulty knob (:class:`miles.tasks.procedural.Difficulty`): ``max_operand`` (operands of more
digits: each operand's digit count is drawn first, so raising it from 30 to 300 adds 3-digit
problems without removing the easy ones).

Held-out evaluation: a hashed split of the problems (:mod:`miles.tasks.procedural`).
A tiny model mostly memorises arithmetic facts, which do not carry over to
held-out problems; the default task is :mod:`miles.tasks.largest`, whose one
skill does.
"""

from __future__ import annotations

import random

from miles.tasks.procedural import Problem, ProceduralTask, exact_answer_reward, in_heldout

__all__ = ["ArithmeticTask", "Problem", "exact_answer_reward", "in_heldout"]

VALID_OPS = ("+", "-", "*")


class ArithmeticTask(ProceduralTask):
    """Integer ``a op b`` problems with operands in ``[0, max_operand]``.

    ``heldout_fraction`` of all problems form the evaluation split, chosen by a hash seeded with ``eval_seed``.
    """

    difficulty_knobs = ("max_operand",)

    def __init__(
        self,
        *,
        max_operand: int = 30,
        ops: tuple[str, ...] = ("+", "-"),
        heldout_fraction: float = 0.2,
        eval_seed: int = 12345,
    ) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        ops = tuple(ops)
        bad = [op for op in ops if op not in VALID_OPS]
        if not ops or bad:
            raise ValueError(f"ops: expected a non-empty list of {list(VALID_OPS)}, found {list(ops)}")
        self.ops = ops
        self._set_difficulty(max_operand=max_operand)

    def _set_difficulty(self, *, max_operand: int) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand: must be at least 1, found {max_operand}")
        self.max_operand = max_operand
        self._max_digits = len(str(max_operand))

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self._max_digits)
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(lo, min(10**digits - 1, self.max_operand))

    def draw(self, rng: random.Random) -> tuple[int, str, int]:
        op = rng.choice(self.ops)
        a, b = self._operand(rng), self._operand(rng)
        if op == "-" and a < b:
            a, b = b, a
        return a, op, b

    def key_text(self, key: tuple[int, str, int]) -> str:
        a, op, b = key
        return f"{a}{op}{b}"

    def problem(self, key: tuple[int, str, int]) -> Problem:
        a, op, b = key
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"What is {a} {op} {b}?", label=str(value))
