"""Per-step cost of scoring rewards in worker processes, against calling the function in-process.

    python -m miles.bench rewards [--items 256] [--repeats 30]

Scores one step's worth of exact-answer items (the built-in reward) four ways, alternating, and
prints the median time per step of each: a plain loop over the function (the reference), the
runner inline (``timeout_s=0``), and the runner with one and with two worker processes. Also
prints how long the runner takes to build and to have its workers ready.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from miles.config import TargetConfig
from miles.rewards.runner import RewardItem, RewardRunner
from miles.tasks.procedural import exact_answer_reward

REWARD = TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles.bench rewards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=256, help="responses scored per step")
    parser.add_argument("--repeats", type=int, default=30, help="steps timed per variant")
    args = parser.parse_args(argv)
    items = [RewardItem(str(i % 100), str((i * 7) % 100)) for i in range(args.items)]

    t0 = time.perf_counter()
    runners = {"inline": RewardRunner(REWARD, timeout_s=0),
               "1 worker": RewardRunner(REWARD, timeout_s=10.0, num_workers=1),
               "2 workers": RewardRunner(REWARD, timeout_s=10.0, num_workers=2)}
    built = time.perf_counter() - t0
    for r in runners.values():
        r.wait_ready()
    ready = time.perf_counter() - t0
    print(f"build 3 runners: {built * 1e3:.1f} ms; workers ready after {ready:.2f} s")

    variants: dict[str, Callable[[], object]] = {
        "in-process loop": lambda: [exact_answer_reward(it.response_text, it.label) for it in items],
        **{f"runner {name}": (lambda r=r: r.score(items)) for name, r in runners.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    ref = statistics.median(times["in-process loop"])
    print(f"{args.items} items per step, median of {args.repeats} (alternating):")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:18s} {med * 1e3:8.3f} ms/step   overhead {1e3 * (med - ref):7.3f} ms   x{med / ref:7.1f}")
    for r in runners.values():
        r.close()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(json.dumps({"items": args.items, "ms_per_step": {k: v * 1e3 for k, v in medians.items()},
                      "ratio_vs_in_process": {k: v / ref for k, v in medians.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
