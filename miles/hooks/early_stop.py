"""Stop the run once a metric reaches a target, e.g. held-out accuracy 0.7.

    python -m miles 'hooks=[{_target_: miles.hooks.EarlyStop, metric: eval/accuracy, target: 0.7}]'

The metric is looked up in every evaluation's metrics (``after_eval``) and in every step's
metrics after the train phase (``after_train``: ``train/*``, ``rollout/*``), so any of them can
be the criterion. The step it is reached on is the run's last: evaluated, logged and
checkpointed as the last step would be, status FINISHED, the reason in MLflow's
``miles.stop_reason`` tag. A metric that is reached at the step-0 evaluation ends the run before
any training. Evaluations are noisy (``eval/accuracy_se``): a target within two standard errors
of where the run starts can be reached by chance.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from miles.config.validate import suggest
from miles.hooks.chain import finite
from miles.hooks.protocols import HookContext

log = logging.getLogger(__name__)


class EarlyStop:
    """Ask the run to stop once ``metric`` is at or above ``target`` (``mode: max``) or at or below it (``min``)."""

    def __init__(self, *, target: float, metric: str = "eval/accuracy", mode: str = "max",
                 name: str = "early_stop") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode: expected 'max' (stop at or above target) or 'min' (at or below), found {mode!r}")
        if not isinstance(target, int | float) or isinstance(target, bool):
            raise ValueError(f"target: expected a number, found {target!r}")
        self.metric, self.target, self.mode, self.name = metric, float(target), mode, name
        self._seen: set[str] = set()
        self._warned = False

    def after_train(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        self._check(ctx, metrics)
        if not self._warned and self.metric not in self._seen:  # a typo shows after the first step, not at the end
            self._warned = True
            log.warning("%s: metric '%s' is not among the metrics logged up to step %d%s; the run may never stop "
                        "on it", self.name, self.metric, ctx.step, suggest(self.metric, sorted(self._seen)))

    def after_eval(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        self._check(ctx, metrics)

    def _check(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        self._seen.update(metrics)
        value = finite(metrics, self.metric)
        if value is None or ctx.stop_reason is not None:
            return
        reached = value >= self.target if self.mode == "max" else value <= self.target
        if reached:
            op = ">=" if self.mode == "max" else "<="
            ctx.request_stop(f"{self.metric} {value:.4g} {op} target {self.target:g} at step {ctx.step}")
