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

Held-out evaluation: every problem is assigned to the evaluation split or the
training split by a hash of ``(eval_seed, problem)``. ``eval_problems`` draws
only from the evaluation split (deterministically) and ``sample`` only from
the training split, so no training prompt is ever an evaluation problem, and
both splits follow the same easy/hard mix.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

VALID_OPS = ("+", "-", "*")


def in_heldout(key: str, eval_seed: int, fraction: float) -> bool:
    """Whether the problem named ``key`` is in the evaluation split: a stable hash, the same in every process."""
    digest = hashlib.sha256(f"{eval_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer (the exact text of a correct response)."""

    prompt: str
    label: str


class ArithmeticTask:
    """Integer ``a op b`` problems with operands in ``[0, max_operand]``.

    ``heldout_fraction`` of all problems form the evaluation split, chosen by a hash seeded with ``eval_seed``.
    """

    def __init__(
        self,
        *,
        max_operand: int = 30,
        ops: tuple[str, ...] = ("+", "-"),
        heldout_fraction: float = 0.2,
        eval_seed: int = 12345,
    ) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand: must be at least 1, found {max_operand}")
        ops = tuple(ops)
        bad = [op for op in ops if op not in VALID_OPS]
        if not ops or bad:
            raise ValueError(f"ops: expected a non-empty list of {list(VALID_OPS)}, found {list(ops)}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: must be in (0, 1), found {heldout_fraction}")
        self.max_operand = max_operand
        self.ops = ops
        self.heldout_fraction = heldout_fraction
        self.eval_seed = eval_seed
        self._max_digits = len(str(max_operand))

    # --- problems -------------------------------------------------------------------------------

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self._max_digits)
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(lo, min(10**digits - 1, self.max_operand))

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        op = rng.choice(self.ops)
        a, b = self._operand(rng), self._operand(rng)
        if op == "-" and a < b:
            a, b = b, a
        return a, op, b

    def is_heldout(self, a: int, op: str, b: int) -> bool:
        """Whether ``a op b`` belongs to the evaluation split (stable across processes and runs)."""
        return in_heldout(f"{a}{op}{b}", self.eval_seed, self.heldout_fraction)

    @staticmethod
    def _problem(a: int, op: str, b: int) -> Problem:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"What is {a} {op} {b}?", label=str(value))

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` training problems (with repeats), never from the evaluation split."""
        out: list[Problem] = []
        while len(out) < n:
            a, op, b = self._draw(rng)
            if not self.is_heldout(a, op, b):
                out.append(self._problem(a, op, b))
        return out

    def eval_problems(self, n: int) -> list[Problem]:
        """The first ``n`` distinct problems of the evaluation split: the same list on every call."""
        rng = random.Random(self.eval_seed)
        seen: set[tuple[int, str, int]] = set()
        out: list[Problem] = []
        for _ in range(1000 * n + 10_000):
            if len(out) == n:
                return out
            key = self._draw(rng)
            if key not in seen and self.is_heldout(*key):
                seen.add(key)
                out.append(self._problem(*key))
        raise ValueError(
            f"eval_problems: found only {len(out)} distinct held-out problems, asked for {n}; "
            "lower task.num_eval_prompts or raise heldout_fraction / max_operand"
        )

    # --- text for the tokenizer and the warm start ------------------------------------------------

    def corpus(self) -> list[str]:
        """Text to train the tokenizer on: prompts and answers of a fixed sample of problems."""
        problems = self.sample(2000, random.Random(0))
        return [p.prompt for p in problems] + [p.label for p in problems] + ["0123456789"]

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """``n`` (prompt, target response) pairs from the training split."""
        return [(p.prompt, p.label) for p in self.sample(n, rng)]


def exact_answer_reward(response_text: str, label: str) -> float:
    """1.0 if the response is exactly the answer (surrounding whitespace ignored), else 0.0.

    ``response_text`` is decoded without special tokens, so a response ``82<|im_end|>`` reads ``"82"``.
    Anything else (``"82 82"``, ``"The answer is 82"``, ``"082"``) scores 0: the task teaches the format.
    """
    return 1.0 if response_text.strip() == str(label).strip() else 0.0
