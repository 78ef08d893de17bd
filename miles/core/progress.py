"""Progress: a bar with ETA on a terminal, one plain log line per step otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping

log = logging.getLogger("miles.progress")

SHOWN = (("train/reward_mean", "reward"), ("eval/accuracy", "eval_acc"), ("perf/step_time_s", "step_s"))


class Progress:
    def __init__(self, total: int, *, first: int = 1, tty: bool | None = None):
        """``total`` steps, numbered from 1; this run does ``first`` to ``total`` (a resumed run: from ``k + 1``)."""
        self.total, self.first = total, first
        self.start = time.perf_counter()
        self.bar = None
        if tty if tty is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=first - 1, desc="miles", unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = {name: f"{metrics[k]:.3g}" for k, name in SHOWN if k in metrics}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / (step - self.first + 1) * (self.total - step)
        log.info(
            "step %d/%d | %s | rollout %.2fs train %.2fs sync %.2fs | elapsed %.0fs eta %.0fs",
            step, self.total, " ".join(f"{k} {v}" for k, v in shown.items()),
            metrics.get("perf/rollout_s", 0.0), metrics.get("perf/train_s", 0.0), metrics.get("perf/sync_s", 0.0),
            elapsed, eta,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
