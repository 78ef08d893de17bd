"""``python -m miles.bench NAME [flags]``: run ``miles.bench.NAME:main(flags)``."""

from __future__ import annotations

import importlib
import sys

from miles.bench import BENCHMARKS


def _usage() -> str:
    return ("usage: python -m miles.bench NAME [flags]   (NAME --help for a benchmark's flags)\n"
            f"benchmarks: {', '.join(BENCHMARKS)}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    if name == "rollout" and "--speculative" in rest:  # its own workload and flags: miles.bench.speculative
        name, rest = "speculative", [a for a in rest if a != "--speculative"]
    module = importlib.import_module(f"miles.bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
