"""What every procedurally generated task shares: a hashed held-out split and the exact-answer reward.

A task draws problem *keys* (``(37, "+", 45)``, a tuple of numbers, ...) from a
seeded ``random.Random`` and turns a key into a :class:`Problem`. Each key
belongs to the evaluation split or to the training split by a sha256 of
``(eval_seed, key_text(key))``: stable across processes and runs, and the same
mix of easy and hard problems on both sides. ``sample`` only returns training
keys; ``eval_problems`` is the first ``n`` distinct evaluation keys of a fixed
stream, so no training prompt is ever an evaluation problem (keys with the
same ``key_text`` are one problem).

Difficulty: a task with integer knobs (list length, operand range, ...) names them in
``difficulty_knobs`` and implements :class:`Difficulty`; ``set_difficulty`` changes some of them
while the run goes on (:class:`miles.hooks.Curriculum` raises them as the reward rises). Later
``sample`` calls draw from the new range; the held-out split stays a hash of the key, so no
training prompt is an evaluation problem at any difficulty. ``eval_problems`` draws at the current
difficulty: the loop takes its evaluation set once, at the start of the run.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from miles.config.validate import suggest


@dataclass(frozen=True)
class Problem:
    """One prompt and the reference its reward compares against.

    The built-in tasks' label is the exact text of a correct response; other tasks carry what their
    reward needs (a reasoning-gym entry, a dataset row's label column).
    """

    prompt: str
    label: Any


def in_heldout(key: str, eval_seed: int, fraction: float) -> bool:
    """Whether the problem named ``key`` is in the evaluation split: a stable hash, the same in every process."""
    digest = hashlib.sha256(f"{eval_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def exact_answer_reward(response_text: str, label: str) -> float:
    """1.0 if the response is exactly the answer (surrounding whitespace ignored), else 0.0.

    ``response_text`` is decoded without special tokens, so a response ``82<|im_end|>`` reads ``"82"``.
    Anything else (``"82 82"``, ``"The answer is 82"``, ``"082"``) scores 0: the task teaches the format.
    """
    return 1.0 if response_text.strip() == str(label).strip() else 0.0


class Difficulty(Protocol):
    """A task whose difficulty can change during a run, through named integer knobs."""

    def difficulty(self) -> dict[str, int]:
        """The knobs and their current values, e.g. ``{"list_len": 5, "max_value": 99}``."""
        ...

    def set_difficulty(self, **knobs: int) -> None:
        """Set some knobs (the others keep their values); later ``sample`` calls draw from the new range.

        Raises ``ValueError`` naming the knob for an unknown knob or a value the task's constructor
        would refuse, and then changes nothing.
        """
        ...


class ProceduralTask:
    """Base of the built-in tasks: subclasses define :meth:`draw`, :meth:`key_text` and :meth:`problem`.

    A subclass with a difficulty lists its knobs (constructor arguments) in ``difficulty_knobs`` and
    checks and applies a full set of their values in :meth:`_set_difficulty`.
    """

    heldout_fraction: float
    eval_seed: int
    difficulty_knobs: tuple[str, ...] = ()
    """Integer constructor arguments :meth:`set_difficulty` may change (empty: a fixed difficulty)."""

    def __init__(self, *, heldout_fraction: float, eval_seed: int) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: must be in (0, 1), found {heldout_fraction}")
        self.heldout_fraction, self.eval_seed = heldout_fraction, eval_seed

    def draw(self, rng: random.Random) -> Hashable:
        """One random problem key."""
        raise NotImplementedError

    def key_text(self, key: Hashable) -> str:
        """The text the split hash is taken of (stable: no reprs of floats or sets)."""
        raise NotImplementedError

    def problem(self, key: Hashable) -> Problem:
        raise NotImplementedError

    def difficulty(self) -> dict[str, int]:
        """The current value of every knob in ``difficulty_knobs`` (:class:`Difficulty`)."""
        return {k: getattr(self, k) for k in self.difficulty_knobs}

    def set_difficulty(self, **knobs: int) -> None:
        """Change some knobs of ``difficulty_knobs``, checked as the constructor checks them (:class:`Difficulty`)."""
        name = type(self).__name__
        if not self.difficulty_knobs:
            raise ValueError(f"{name} has a fixed difficulty: it has no difficulty knobs to set")
        for k, v in knobs.items():
            if k not in self.difficulty_knobs:
                raise ValueError(f"{k}: not a difficulty knob of {name}{suggest(k, self.difficulty_knobs)}; "
                                 f"its knobs: {', '.join(self.difficulty_knobs)}")
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{k}: expected an integer, found {v!r}")
        self._set_difficulty(**(self.difficulty() | knobs))

    def _set_difficulty(self, **knobs: int) -> None:
        """Check a full set of knob values (``ValueError`` naming the knob) and apply them all, or none."""
        raise NotImplementedError

    def is_heldout_key(self, key: Hashable) -> bool:
        return in_heldout(self.key_text(key), self.eval_seed, self.heldout_fraction)

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` training problems (with repeats), never from the evaluation split."""
        out: list[Problem] = []
        while len(out) < n:
            key = self.draw(rng)
            if not self.is_heldout_key(key):
                out.append(self.problem(key))
        return out

    def eval_problems(self, n: int) -> list[Problem]:
        """The first ``n`` distinct problems of the evaluation split: the same list on every call."""
        rng = random.Random(self.eval_seed)
        seen: set[str] = set()
        out: list[Problem] = []
        for _ in range(1000 * n + 10_000):
            if len(out) == n:
                return out
            key = self.draw(rng)
            text = self.key_text(key)
            if text not in seen and self.is_heldout_key(key):
                seen.add(text)
                out.append(self.problem(key))
        raise ValueError(
            f"eval_problems: found only {len(out)} distinct held-out problems, asked for {n}; lower "
            "task.num_eval_prompts or make the task's problem space larger (or heldout_fraction higher)"
        )

    def reference_response(self, problem: Problem) -> str:
        """The text of a correct response (the warm start's target): the label itself by default."""
        return str(problem.label)

    def corpus(self) -> list[str]:
        """Text to train the tokenizer on: prompts and answers of a fixed sample of problems."""
        problems = self.sample(2000, random.Random(0))
        return [p.prompt for p in problems] + [self.reference_response(p) for p in problems] + ["0123456789"]

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """``n`` (prompt, target response) pairs from the training split."""
        return [(p.prompt, self.reference_response(p)) for p in self.sample(n, rng)]
