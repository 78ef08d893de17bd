"""Reward functions for tests that need a reward with a known behaviour (allowed by ``plugins.allow``)."""

from __future__ import annotations


def length_parity(response_text: str, label: object) -> float:
    """1 for an odd-length response, else 0: rewards that differ within a group whatever the model."""
    return float(len(response_text) % 2)


def always_raises(response_text: str, label: object) -> float:
    """A grader that is broken: every call raises."""
    raise ValueError("this grader is broken")
