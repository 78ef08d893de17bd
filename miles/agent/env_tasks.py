"""What the tasks of external environments share (``task=openenv``, ``task=verifiers``): problems are the
environment's own (seeds, or tasks of a taskset), held out by a hash of their prompt text
(:mod:`miles.tasks.procedural`), and scored by the environment, so they have no reference responses.

Fresh tiny models (no ``model.path``) build a tokenizer from the task's text and are warm-started on
reference responses: ``warm_start_task`` names a built task of the same prompt format that has them
(e.g. the built-in ``largest`` for an environment that asks for the largest of a list); without one the
warm start is refused, naming the other ways.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from miles.tasks.procedural import Problem, ProceduralTask


class ExternalTask(ProceduralTask):
    """Base of the external environments' tasks: subclasses define :meth:`draw`, :meth:`key_text` (the
    prompt text) and :meth:`problem`, and name themselves in ``kind`` (``openenv``, ``verifiers``)."""

    kind = "external"

    def __init__(self, *, heldout_fraction: float, eval_seed: int, warm_start_task: Any = None) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        self.warm_start_task = warm_start_task

    def reference_response(self, problem: Problem) -> str:
        raise ValueError(f"task={self.kind}: an environment gives no reference responses (the warm start draws its "
                         "examples from task.source.warm_start_task)")

    def corpus(self) -> list[str]:
        """The prompts of up to 500 problems, plus the warm-start task's text when there is one."""
        prompts = [self.key_text(k) for k in self.corpus_keys()]
        extra = self.warm_start_task.corpus() if self.warm_start_task is not None else []
        return prompts + extra + ["0123456789"]

    def corpus_keys(self) -> list[Any]:
        """The problems whose prompts go into :meth:`corpus`."""
        raise NotImplementedError

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        if self.warm_start_task is None:
            raise ValueError(f"task={self.kind}: an environment gives no reference responses to warm-start a fresh "
                             "model on: set task.source.warm_start_task to a task of the same prompt format (e.g. "
                             "{_target_: miles.tasks.largest.LargestNumberTask}), or warm_start.steps=0, or train a "
                             "pretrained model (model.path)")
        return self.warm_start_task.sft_examples(n, rng)


def env_reward(response_text: str, label: Any, *, metadata: Mapping[str, Any] | None = None) -> float:
    """The environment's reward for the sample's episode (``metadata["env_reward"]``, set by the generate
    function of ``task=openenv`` or ``task=verifiers``)."""
    if not metadata or "env_reward" not in metadata:
        raise ValueError("env_reward: the sample has no environment reward: use the rollout.generate_fn of "
                         "task=openenv (miles.agent.openenv.episode) or task=verifiers (miles.agent.verifiers.episode)")
    return float(metadata["env_reward"])
