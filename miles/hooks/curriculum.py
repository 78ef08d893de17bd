"""A curriculum: make the task harder each time the training reward stays above a threshold.

    python -m miles 'hooks=[{_target_: miles.hooks.Curriculum, levels: [{list_len: 6}, {list_len: 8}]}]'
    python -m miles 'hooks=[{_target_: miles.hooks.Curriculum, threshold: 0.6, levels: [{max_value: 999}]}]'

Level 0 is the task as configured; ``levels[i]`` is a set of difficulty knobs
(:class:`miles.tasks.procedural.Difficulty`: ``largest``'s ``list_len`` / ``max_value``,
``arithmetic``'s ``max_operand``, ``count``'s ``max_start`` / ``max_span``) applied on top of
the level before it. After ``patience`` consecutive steps with ``metric`` (default
``train/reward_mean``) at or above ``threshold``, the next level is applied; the step after
draws its prompts from it. Every step logs ``hooks/<name>/level`` and the knobs' values. The
levels are checked against the task before Ray starts (a copy of the task takes every level).

The held-out evaluation set is drawn once at the start of the run, at level 0: ``eval/accuracy``
stays comparable across levels. A resumed run starts again at level 0.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from miles.hooks.chain import finite
from miles.hooks.protocols import HookContext

log = logging.getLogger(__name__)


class Curriculum:
    """Step through ``levels`` of task difficulty as ``metric`` stays at or above ``threshold``."""

    def __init__(self, *, levels: Sequence[Mapping[str, int]], threshold: float = 0.8,
                 metric: str = "train/reward_mean", patience: int = 3, name: str = "curriculum") -> None:
        if not levels or not all(isinstance(lv, Mapping) and lv for lv in levels):
            raise ValueError(f"levels: expected a non-empty list of knob mappings such as [{{list_len: 6}}], "
                             f"found {levels!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience: must be an integer of at least 1, found {patience!r}")
        self.levels = [dict(lv) for lv in levels]
        self.threshold, self.metric, self.patience, self.name = float(threshold), metric, patience, name
        self.level = 0
        self._streak = 0

    def check_config(self, config: Any, task: Any) -> None:
        """The task has difficulty knobs and accepts every level, in order (tried on a copy of it)."""
        knobs = task.difficulty() if callable(getattr(task, "difficulty", None)) else {}
        if not knobs or not callable(getattr(task, "set_difficulty", None)):
            raise ValueError(f"the task {type(task).__name__} has no difficulty knobs to raise; the curriculum "
                             "needs a task implementing miles.tasks.procedural.Difficulty (largest, arithmetic, count)")
        trial = copy.deepcopy(task)
        for i, level in enumerate(self.levels):
            try:
                trial.set_difficulty(**level)
            except ValueError as e:
                raise ValueError(f"levels[{i}].{e}") from None

    def on_run_start(self, ctx: HookContext) -> None:
        self.level, self._streak = 0, 0
        ctx.add_metrics(self._state(ctx))

    def after_train(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        value = finite(metrics, self.metric)
        self._streak = self._streak + 1 if value is not None and value >= self.threshold else 0
        if self._streak >= self.patience and self.level < len(self.levels):
            ctx.task.set_difficulty(**self.levels[self.level])
            self.level += 1
            self._streak = 0
            log.info("step %d: %s %.3f >= %g for %d step(s): curriculum level %d of %d, %s", ctx.step, self.metric,
                     value, self.threshold, self.patience, self.level, len(self.levels), ctx.task.difficulty())
        ctx.add_metrics(self._state(ctx))

    def _state(self, ctx: HookContext) -> dict[str, float]:
        return {"level": float(self.level), **{k: float(v) for k, v in ctx.task.difficulty().items()}}
