"""Side-by-side benchmarks: ``python -m miles.bench NAME [flags]``.

Each benchmark is a module ``miles.bench.NAME`` with ``main(argv: list[str] | None) -> int``; it
measures miles against a reference in the same process run (alternating, median of repeats) and
prints a JSON line last. The dispatcher imports the module only when it is asked for.
"""

BENCHMARKS = ("rollout", "train", "sync", "e2e", "rewards", "gpu", "precision", "async", "lora", "agent")
"""Names ``python -m miles.bench`` accepts."""
