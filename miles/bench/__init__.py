"""Side-by-side benchmarks: ``python -m miles.bench NAME [flags]``.

Each benchmark is a module ``miles.bench.NAME`` with ``main(argv: list[str] | None) -> int``; it
measures miles against a reference in the same process run (alternating, median of repeats) and
prints a JSON line last. The dispatcher imports the module only when it is asked for.
"""

import argparse
from collections.abc import Callable, Collection

BENCHMARKS = ("rollout", "train", "sync", "e2e", "rewards", "gpu", "precision", "async", "lora", "agent",
              "faults", "agent_server", "observe", "distill")
"""Names ``python -m miles.bench`` accepts."""


def names_from(valid: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated list of names, each one of ``valid``."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; valid: {', '.join(valid)}")
        return names
    return parse
