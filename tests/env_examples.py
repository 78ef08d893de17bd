"""What the tests of the example environments share (tests/test_openenv.py, tests/test_verifiers.py): a
hook that keeps a run's training samples, and the examples' answer for a seed."""

from __future__ import annotations

import random


class Capture:
    """Hook: keeps every training sample of the run (read by the test)."""

    samples: list = []

    def __init__(self) -> None:
        Capture.samples = []

    def after_rollout(self, ctx, groups) -> None:
        Capture.samples += [s for group in groups for s in group]


def largest_of(seed: int) -> str:
    """The answer of the example environments (examples/openenv_largest, examples/verifiers_largest) for
    ``seed``: their five numbers are ``random.Random(seed)``'s."""
    rng = random.Random(seed)
    return str(max(rng.randint(0, 99) for _ in range(5)))
