"""What the external environments' tasks share (:mod:`miles.agent.env_tasks`): the environment's reward
read from the sample, and no warm start without a task that has reference responses."""

from __future__ import annotations

import random

import pytest

from miles.agent.env_tasks import ExternalTask, env_reward
from miles.tasks.largest import LargestNumberTask


class Numbers(ExternalTask):
    """An external task over a fixed list of prompts (as a taskset's or an environment's seeds give them)."""

    kind = "numbers"

    def __init__(self, warm_start_task=None) -> None:
        super().__init__(heldout_fraction=0.5, eval_seed=1, warm_start_task=warm_start_task)
        self.prompts = [f"Which is largest: {i} {i + 1}?" for i in range(20)]

    def draw(self, rng):
        return rng.randrange(len(self.prompts))

    def key_text(self, key):
        return self.prompts[key]

    def problem(self, key):
        from miles.tasks.procedural import Problem

        return Problem(prompt=self.prompts[key], label={"task": key})

    def corpus_keys(self):
        return list(range(len(self.prompts)))


def test_env_reward_is_the_episodes_and_needs_one() -> None:
    assert env_reward("7", {"seed": 1}, metadata={"env_reward": 0.5}) == 0.5
    with pytest.raises(ValueError, match=r"no environment reward: use the rollout.generate_fn of task=openenv"):
        env_reward("7", {"seed": 1}, metadata={"counts": {}})


def test_a_warm_start_needs_a_task_of_the_same_format() -> None:
    task = Numbers()
    with pytest.raises(ValueError, match=r"task=numbers: .*task.source.warm_start_task .*warm_start.steps=0, .*\(model.path\)"):
        task.sft_examples(2, random.Random(0))
    with pytest.raises(ValueError, match="no reference responses"):
        task.reference_response(task.problem(0))
    assert task.corpus()[:20] == task.prompts and task.corpus()[-1] == "0123456789"
    warm = Numbers(LargestNumberTask())
    (prompt, answer), = warm.sft_examples(1, random.Random(0))
    assert prompt.startswith("Which is largest: ") and answer == str(max(map(int, prompt[18:-1].split())))
    assert len(warm.corpus()) > len(task.corpus())  # the warm-start task's text joins the tokenizer's


def test_held_out_problems_are_never_training_ones() -> None:
    task = Numbers()
    held = {p.prompt for p in task.eval_problems(3)}
    assert len(held) == 3 and not held & {p.prompt for p in task.sample(200, random.Random(0))}
