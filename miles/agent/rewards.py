"""Rewards for tool-using sessions: the answer's score plus a bonus for working tool calls.

An answer-only reward does not pay for tool use: from a weak warm start a policy that guesses can
learn faster than one that calls, and its calls then decay into malformed text. ``tool_answer_reward``
adds ``call_bonus`` to the answer's score when the session made at least ``min_calls`` tool calls
that returned without error and wrote no malformed ``<tool_call>`` block, so a well-formed call is
worth more than a guess within a group and the tool-call success rate is trained as well::

    task:
      reward:
        _target_: miles.agent.rewards.tool_answer_reward
        _partial_: true
        call_bonus: 0.2

It reads the per-sample counts that :func:`miles.agent.rollout.tool_loop` and
:func:`miles.agent.openai_rollout.openai_agent` record in ``Sample.metadata["counts"]``; the reward runner
passes them as ``metadata``. For an ``openai``-client agent, which runs its tools itself, a working call is
one the agent answered with a ``tool`` message (the server cannot see whether the tool failed). A sample
without tool counts (another generate function) gets the answer's score alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from miles.tasks.procedural import exact_answer_reward


def tool_answer_reward(response_text: str, label: Any, *, metadata: Mapping[str, Any] | None = None,
                       call_bonus: float = 0.2, min_calls: int = 1,
                       answer: Callable[[str, Any], float] = exact_answer_reward) -> float:
    """``answer(response_text, label)`` plus ``call_bonus`` for a session whose tool use worked.

    The bonus is paid when ``metadata["counts"]`` has ``agent/tool_calls_ok >= min_calls`` and
    ``agent/tool_malformed == 0``. ``answer``: the answer's score (default
    :func:`~miles.tasks.procedural.exact_answer_reward`; any ``fn(response_text, label) -> float``).
    """
    if not math.isfinite(call_bonus) or call_bonus < 0:
        raise ValueError(f"tool_answer_reward: call_bonus must be a finite number >= 0, found {call_bonus}")
    if min_calls < 1:
        raise ValueError(f"tool_answer_reward: min_calls must be >= 1, found {min_calls}")
    score = float(answer(response_text, label))
    counts = (metadata or {}).get("counts", {})
    if counts.get("agent/tool_calls_ok", 0) >= min_calls and counts.get("agent/tool_malformed", 0) == 0:
        score += call_bonus
    return score
