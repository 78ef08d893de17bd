"""Procedural tasks from reasoning-gym: ``basic_arithmetic``, ``countdown`` and the other ~100 generators.

``reasoning_gym.create_dataset(name, seed=s, **config)[i]`` is a deterministic entry
``{"question", "answer", "metadata"}`` for every index ``i``, and the dataset scores a response
with ``score_answer(answer, entry)``. :class:`ReasoningGymTask` draws indices from a fixed pool
(``pool_size``; each entry is generated once, then cached) and splits them by a hash of the prompt
text (:mod:`miles.tasks.procedural`), so a training prompt is never an evaluation prompt.

Prompts: a reasoning-gym question carries format instructions meant for large models (a countdown
question is ~400 characters), too long for the tiny model's 256 positions. ``prompt_template``
rewrites it from the entry's metadata, e.g. ``"Make {target} from {numbers}"`` ->
``"Make 21 from 8 18 11"`` (list fields are joined with spaces; ``{question}`` is the original
text). The label is the whole entry plus the dataset name and config, so the reward
(:func:`miles.rewards.gym.gym_reward`) can rebuild the scorer in any process.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from miles.config.validate import suggest
from miles.tasks.procedural import Problem, ProceduralTask

__all__ = ["ReasoningGymTask"]

_RESERVED = ("seed", "size")


class ReasoningGymTask(ProceduralTask):
    """Problems of the reasoning-gym dataset ``dataset`` built with ``config``, indices ``[0, pool_size)``."""

    def __init__(
        self,
        *,
        dataset: str,
        config: Mapping[str, Any] | None = None,
        prompt_template: str | None = None,
        seed: int = 0,
        pool_size: int = 20_000,
        heldout_fraction: float = 0.1,
        eval_seed: int = 12345,
    ) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ValueError(f"dataset: reasoning-gym has no dataset '{dataset}'{suggest(dataset, list(DATASETS))}; "
                             f"valid names include {', '.join(sorted(DATASETS)[:12])}, ...")
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config or {}).items()}
        reserved = [k for k in _RESERVED if k in config]
        if reserved:
            raise ValueError(f"config.{reserved[0]}: set by the task (seed: task seed, size: pool_size); "
                             "remove it from config")
        if pool_size < 1:
            raise ValueError(f"pool_size: must be at least 1, found {pool_size}")
        try:
            self._dataset = reasoning_gym.create_dataset(dataset, seed=seed, size=pool_size, **config)
        except (TypeError, AssertionError, ValueError) as e:
            raise ValueError(f"config: reasoning-gym '{dataset}' rejected {config}: {e}") from e
        self.dataset, self.config, self.prompt_template = dataset, config, prompt_template
        self.pool_size = pool_size
        self._entries: dict[int, dict[str, Any]] = {}
        self._prompts: dict[int, str] = {}
        self.key_text(0)  # a template naming a missing field fails here, not mid-run

    def entry(self, index: int) -> dict[str, Any]:
        """The reasoning-gym entry at ``index`` (generated once, then cached)."""
        e = self._entries.get(index)
        if e is None:
            e = self._entries[index] = self._dataset[index]
        return e

    def draw(self, rng: random.Random) -> int:
        return rng.randrange(self.pool_size)

    def key_text(self, key: int) -> str:
        """The prompt itself: the split is by what the model sees."""
        text = self._prompts.get(key)
        if text is None:
            text = self._prompts[key] = self._render(self.entry(key))
        return text

    def problem(self, key: int) -> Problem:
        label = {"dataset": self.dataset, "config": self.config, "entry": self.entry(key)}
        return Problem(prompt=self.key_text(key), label=label)

    def reference_response(self, problem: Problem) -> str:
        return str(problem.label["entry"]["answer"])

    def _render(self, entry: Mapping[str, Any]) -> str:
        if self.prompt_template is None:
            return str(entry["question"])
        fields = {k: " ".join(map(str, v)) if isinstance(v, list | tuple) else v
                  for k, v in entry.get("metadata", {}).items()}
        fields["question"] = entry["question"]
        try:
            return self.prompt_template.format(**fields)
        except (KeyError, IndexError) as e:
            raise ValueError(f"prompt_template: {self.prompt_template!r} names {e}, which '{self.dataset}' "
                             f"entries lack; available fields: {', '.join(sorted(fields))}") from None
