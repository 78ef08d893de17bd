"""Arithmetic that a tiny model answers with the calculator tool.

Products of numbers up to ``max_operand`` (default 999: ``What is 123 * 456?``). A tiny model
cannot multiply 3-digit numbers; with the calculator it needs two turns: a tool call, then the
answer copied from the tool response. The warm start's target (``reference_response``) is the
first of them, the call::

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

and half of the warm start's examples (``second_turn_fraction``) are the second turn: the answer
after the tool response. The warm start takes (prompt, response) pairs whose prompt is rendered
as one user turn, so those examples write the first turn and the tool response into the prompt
text with the chat template's special tokens; the tokenizer parses them as special tokens and the
rendered prompt is the same text a session holds at that point::

    <|im_start|>user\nWhat is 123 * 456?<|im_end|>\n<|im_start|>assistant\n<tool_call>...</tool_call><|im_end|>
    <|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n  -> 56088

The reward is the exact answer on the last turn; a warm-started tiny model often copies an operand
wrong, which is what RL has to fix. The tokenizer corpus also holds the tool responses.
"""

from __future__ import annotations

import json
import random

from miles.models.tokenizer import IM_END, IM_START
from miles.tasks.arithmetic import ArithmeticTask, Problem


class CalculatorArithmeticTask(ArithmeticTask):
    """:class:`ArithmeticTask` with products of up to 3-digit numbers and a tool-call warm start."""

    def __init__(self, *, max_operand: int = 999, ops: tuple[str, ...] = ("*",), heldout_fraction: float = 0.2,
                 eval_seed: int = 12345, second_turn_fraction: float = 0.5) -> None:
        super().__init__(max_operand=max_operand, ops=ops, heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        if not 0.0 <= second_turn_fraction <= 1.0:
            raise ValueError(f"second_turn_fraction: must be in [0, 1], found {second_turn_fraction}")
        self.second_turn_fraction = second_turn_fraction

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """``n`` (prompt, response) pairs: first turns (the call) and second turns (the answer)."""
        out = []
        for p in self.sample(n, rng):
            if rng.random() < self.second_turn_fraction:
                out.append((f"{p.prompt}{IM_END}\n{IM_START}assistant\n{self.reference_response(p)}{IM_END}\n"
                            f"{IM_START}user\n<tool_response>\n{p.label}\n</tool_response>", str(p.label)))
            else:
                out.append((p.prompt, self.reference_response(p)))
        return out

    def reference_response(self, problem: Problem) -> str:
        expression = problem.prompt.removeprefix("What is ").removesuffix("?")
        call = {"name": "calculator", "arguments": {"expression": expression}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    def corpus(self) -> list[str]:
        problems = self.sample(2000, random.Random(0))
        return super().corpus() + [f"<tool_response>\n{p.label}\n</tool_response>" for p in problems[:500]]
