"""The count task: a hashed split, answers of widely varying length, and its partial-credit reward."""

from __future__ import annotations

import random

import pytest

from miles.tasks.count import CountTask, count_reward


def test_problems_count_and_splits_never_overlap() -> None:
    task = CountTask(max_start=20, max_span=30)
    train = task.sample(500, random.Random(0))
    held = task.eval_problems(40)
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    for p in train[:50] + held:
        nums = [int(x) for x in p.label.split()]
        assert nums == list(range(nums[0], nums[0] + len(nums)))
        assert p.prompt == f"Count from {nums[0]} to {nums[-1]}."
    spans = [len(p.label.split()) for p in train]
    assert min(spans) <= 3 and max(spans) >= 27  # lengths vary widely in one batch


@pytest.mark.parametrize(("response", "label", "want"), [
    ("37 38 39 40", "37 38 39 40", 1.0),
    ("37 38 39", "37 38 39 40", 0.75),        # stopped early
    ("37 38 40 41", "37 38 39 40", 0.5),      # the count broke at the third number
    ("1 2 3", "1 2", 2 / 3),                  # ran past the end
    ("one two", "1 2", 0.0),
    ("", "5", 0.0),
])
def test_count_reward_is_the_share_counted_right(response: str, label: str, want: float) -> None:
    assert count_reward(response, label) == pytest.approx(want)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_span"):
        CountTask(max_span=0)
    with pytest.raises(ValueError, match="max_start"):
        CountTask(max_start=-1)
