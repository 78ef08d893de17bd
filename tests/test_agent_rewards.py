"""tool_answer_reward: the answer's score plus a bonus for working tool calls, read from the counts a
tool-loop session records, also through the reward runner's worker process."""

from __future__ import annotations

import functools

import pytest

from miles.agent.rewards import tool_answer_reward
from miles.config import TargetConfig
from miles.rewards.runner import RewardItem, RewardRunner


def _meta(ok: int, malformed: int = 0) -> dict:
    return {"counts": {"agent/turns": 2, "agent/tool_calls": ok + malformed, "agent/tool_calls_ok": ok,
                       "agent/tool_malformed": malformed}}


@pytest.mark.parametrize(("text", "meta", "want"), [
    ("56088", _meta(ok=1), 1.2),                 # right answer after a working call
    ("56087", _meta(ok=1), 0.2),                 # a working call pays even when the copy is wrong
    ("56088", _meta(ok=1, malformed=1), 1.0),    # any malformed block: no bonus
    ("56088", _meta(ok=0), 1.0),                 # a guess: the answer's score alone
    ("56088", {}, 1.0),                          # no tool counts (another generate function)
    ("nope", None, 0.0),
])
def test_the_bonus_is_paid_for_working_calls_without_malformed_ones(text, meta, want) -> None:
    assert tool_answer_reward(text, "56088", metadata=meta) == pytest.approx(want)


def test_min_calls_and_a_custom_answer_score() -> None:
    assert tool_answer_reward("x", "56088", metadata=_meta(ok=1), min_calls=2) == 0.0
    assert tool_answer_reward("x", "56088", metadata=_meta(ok=2), min_calls=2, call_bonus=0.5) == 0.5
    half = functools.partial(lambda response, label: 0.5)
    assert tool_answer_reward("x", "y", metadata=_meta(ok=1), answer=half) == pytest.approx(0.7)


@pytest.mark.parametrize(("kwargs", "match"), [({"call_bonus": -0.1}, "call_bonus"),
                                               ({"call_bonus": float("nan")}, "call_bonus"),
                                               ({"min_calls": 0}, "min_calls")])
def test_bad_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        tool_answer_reward("1", "1", metadata=_meta(ok=1), **kwargs)


def test_the_runner_passes_sample_counts_to_a_worker_process() -> None:
    fn = TargetConfig(target="miles.agent.rewards.tool_answer_reward", partial=True,
                      kwargs={"call_bonus": 0.25, "answer": {"_target_": "miles.tasks.procedural.exact_answer_reward",
                                                             "_partial_": True}})
    items = [RewardItem("56088", "56088", metadata=_meta(ok=1)), RewardItem("1", "56088", metadata=_meta(ok=1)),
             RewardItem("56088", "56088", metadata=_meta(ok=1, malformed=2)), RewardItem("56088", "56088")]
    with RewardRunner(fn, timeout_s=30.0, isolation="process") as runner:
        outcomes = runner.score(items)
    assert [o.failure for o in outcomes] == [None] * 4
    assert [o.reward for o in outcomes] == pytest.approx([1.25, 0.25, 1.0, 1.0])
