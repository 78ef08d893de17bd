"""Math answers compared by value: ``math-verify`` parses both sides to sympy and checks equivalence.

``"\\frac{1}{2}"``, ``"0.5"``, ``"1/2"`` and ``"The answer is \\boxed{\\frac12}"`` all match a label of
``"0.5"``. Parsing and verifying can be slow on adversarial text (huge powers, deep nesting):
run it under :class:`miles.rewards.runner.RewardRunner`, whose deadline stops it for real.
``math-verify``'s own signal-based timeouts are kept as a first line where they work (the main
thread of a process: inside a reward worker, always).
"""

from __future__ import annotations

import threading
from typing import Any

from math_verify import parse, verify  # at import, not at the first call: a worker's start has no deadline

__all__ = ["math_verify_reward"]


def math_verify_reward(response_text: str, label: Any) -> float:
    """1.0 if the response's final answer equals ``label`` mathematically, else 0.0.

    ``label`` is the reference answer as text (LaTeX or a plain expression) or a number. A label that
    ``math-verify`` cannot parse raises ``ValueError``: that is a data bug, reported as a failure by
    the runner, not a zero reward.
    """
    timeout = 5 if threading.current_thread() is threading.main_thread() else None  # signals: main thread only
    gold = _parse(parse, str(label), timeout)
    if not gold:
        raise ValueError(f"math_verify_reward: cannot parse the label {str(label)[:200]!r} as a math answer")
    answer = _parse(parse, response_text, timeout)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


def _parse(parse: Any, text: str, timeout: int | None) -> list:
    """``math-verify``'s parse; bare LaTeX without delimiters (``x^2+2x+1``) is retried inside ``$...$``."""
    parsed = parse(text, parsing_timeout=timeout)
    if not parsed and text.strip() and "$" not in text:
        parsed = parse(f"${text.strip()}$", parsing_timeout=timeout)
    return parsed
