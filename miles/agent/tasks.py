"""Arithmetic that a tiny model answers with the calculator tool.

Products of numbers up to ``max_operand`` (default 999: ``What is 123 * 456?``). A tiny model
cannot multiply 3-digit numbers; with the calculator it needs two turns: a tool call, then the
answer copied from the tool response. The warm start's target (``reference_response``) is the
first of them, the call::

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

so a warm-started tiny model calls the tool; the reward (exact answer on the last turn) is what
RL has to raise. The tokenizer corpus also holds the tool responses, so their text gets merges.
"""

from __future__ import annotations

import json
import random

from miles.tasks.arithmetic import ArithmeticTask, Problem


class CalculatorArithmeticTask(ArithmeticTask):
    """:class:`ArithmeticTask` with products of up to 3-digit numbers and a tool-call warm start."""

    def __init__(self, *, max_operand: int = 999, ops: tuple[str, ...] = ("*",), heldout_fraction: float = 0.2,
                 eval_seed: int = 12345) -> None:
        super().__init__(max_operand=max_operand, ops=ops, heldout_fraction=heldout_fraction, eval_seed=eval_seed)

    def reference_response(self, problem: Problem) -> str:
        expression = problem.prompt.removeprefix("What is ").removesuffix("?")
        call = {"name": "calculator", "arguments": {"expression": expression}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    def corpus(self) -> list[str]:
        problems = self.sample(2000, random.Random(0))
        return super().corpus() + [f"<tool_response>\n{p.label}\n</tool_response>" for p in problems[:500]]
