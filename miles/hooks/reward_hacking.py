"""A reward-hacking monitor: the training reward rises while a sign of real progress falls.

    python -m miles 'hooks=[{_target_: miles.hooks.RewardHackingMonitor, window: 10, stop: true}]'

Two alarms, each a warning in the log and ``hooks/<name>/alarm`` = 1 at the step it fires:

- **length collapse** (``after_train``): over the last ``window`` steps, the mean of
  ``reward_metric`` over the newer half is at least ``min_reward_rise`` above the older half's,
  while the mean of ``length_metric`` over the newer half is at most ``1 - min_length_drop`` times
  the older half's (a policy that found it is paid for answering short, or for nothing);
- **reference drop** (``after_eval``): ``reference_metric`` (default ``eval/accuracy``) fell by at
  least ``min_reference_drop`` since the previous evaluation, while the mean training reward over
  the ``window`` steps before this evaluation rose by at least ``min_reward_rise`` over the mean
  over the ``window`` steps before the previous one (the reward is earned without the skill).

Each step once the window is full it logs ``hooks/<name>/reward_rise`` (newer minus older half) and
``hooks/<name>/length_ratio`` (newer over older half), ``hooks/<name>/alarm`` and
``hooks/<name>/alarms`` (alarms so far).
With ``stop: true`` the first alarm also stops the run (:meth:`HookContext.request_stop`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from statistics import fmean

from miles.hooks.chain import finite
from miles.hooks.protocols import HookContext

log = logging.getLogger(__name__)


class RewardHackingMonitor:
    """Warn, count and optionally stop when reward rises while response length collapses or a reference falls."""

    def __init__(self, *, window: int = 10, min_reward_rise: float = 0.1, min_length_drop: float = 0.3,
                 min_reference_drop: float = 0.05, reward_metric: str = "train/reward_mean",
                 length_metric: str = "rollout/response_len_mean", reference_metric: str = "eval/accuracy",
                 stop: bool = False, name: str = "reward_hacking") -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window: must be an integer of at least 2 (two halves to compare), found {window!r}")
        if not 0.0 < min_length_drop < 1.0:
            raise ValueError(f"min_length_drop: must be in (0, 1) (a fraction of the length), found {min_length_drop}")
        if min_reward_rise < 0 or min_reference_drop < 0:
            raise ValueError("min_reward_rise and min_reference_drop: must be 0 or more, found "
                             f"{min_reward_rise} and {min_reference_drop}")
        self.window, self.min_reward_rise, self.min_length_drop = window, float(min_reward_rise), float(min_length_drop)
        self.min_reference_drop = float(min_reference_drop)
        self.reward_metric, self.length_metric, self.reference_metric = reward_metric, length_metric, reference_metric
        self.stop, self.name = stop, name
        self.alarms = 0
        self._fired = False
        self._steps: deque[tuple[float, float | None]] = deque(maxlen=window)  # (reward, length) per step
        self._last_eval: tuple[float, float] | None = None  # (reference, recent reward) at the previous evaluation

    def after_train(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        reward = finite(metrics, self.reward_metric)
        if reward is None:
            return  # no trainable sample this step: nothing to compare
        self._steps.append((reward, finite(metrics, self.length_metric)))
        if len(self._steps) < self.window:
            return
        half = self.window // 2
        old, new = list(self._steps)[:half], list(self._steps)[-half:]
        rise = fmean(r for r, _ in new) - fmean(r for r, _ in old)
        out = {"reward_rise": rise}
        if all(length is not None for _, length in self._steps):
            old_len, new_len = fmean(n for _, n in old), fmean(n for _, n in new)
            ratio = new_len / old_len if old_len > 0 else 1.0
            out["length_ratio"] = ratio
            if rise >= self.min_reward_rise and ratio <= 1.0 - self.min_length_drop:
                self._alarm(ctx, f"{self.reward_metric} rose by {rise:.3f} over the last {self.window} steps while "
                                 f"{self.length_metric} fell to {ratio:.0%} ({old_len:.1f} -> {new_len:.1f})")
        ctx.add_metrics(out | {"alarm": float(self._fired), "alarms": float(self.alarms)})
        self._fired = False

    def after_eval(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        reference = finite(metrics, self.reference_metric)
        if reference is None or not self._steps:
            return  # the step-0 evaluation: no training reward yet
        reward = fmean(r for r, _ in self._steps)
        if self._last_eval is not None:
            last_reference, last_reward = self._last_eval
            rise, drop = reward - last_reward, last_reference - reference
            if rise >= self.min_reward_rise and drop >= self.min_reference_drop:
                self._alarm(ctx, f"{self.reward_metric} rose by {rise:.3f} since the last evaluation while "
                                 f"{self.reference_metric} fell by {drop:.3f} ({last_reference:.3f} -> {reference:.3f})")
                ctx.add_metrics({"alarm": 1.0, "alarms": float(self.alarms)})
                self._fired = False
        self._last_eval = (reference, reward)

    def _alarm(self, ctx: HookContext, what: str) -> None:
        self.alarms += 1
        self._fired = True
        log.warning("step %d: possible reward hacking: %s", ctx.step, what)
        if self.stop:
            ctx.request_stop(f"possible reward hacking: {what}")
