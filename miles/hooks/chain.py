"""The hook chain: the ``hooks:`` entries, built and checked before Ray starts, called by the loop.

:func:`build_hooks` turns ``run.hooks`` into checked :class:`HookSpec` entries (allowlisted
:func:`miles.config.build`, :func:`miles.hooks.protocols.check_hook`); :class:`HookChain` calls,
at each point, every hook implementing it in list order, each with its own :class:`HookContext`.

Metrics: a hook's ``ctx.add_metrics({"level": 2})`` is logged with the step's metrics as
``hooks/<name>/level`` (``<name>``: the hook's ``name`` attribute, else its class name in snake case;
two hooks with one name are refused). Added at ``on_checkpoint`` it goes out with the next step's
metrics, at ``on_run_end`` at the run's last step. The chain adds ``hooks/errors`` (exceptions of
optional hooks so far) and ``hooks/time_s`` (seconds spent in hooks since the last log).

Stopping: ``ctx.request_stop(reason)`` ends the run after the current step: that step is evaluated
(if it was not an evaluation step already), logged and checkpointed as the last one would be, the
run's status is FINISHED, and MLflow gets the tags ``miles.stopped_early`` (``true``),
``miles.stop_reason`` (the hook and its reason) and ``miles.stopped_at_step``. The first request
wins. Asked for at ``on_run_start`` or in the step-0 evaluation, the run ends before step 1.

Errors: an exception from a hook fails the run with :class:`HookError`, ``hooks[1]
my_mod.MyHook.after_train raised ValueError: ...``; from a hook whose entry has ``_optional_: true``
it is logged with its traceback, counted in ``hooks/errors``, and the run goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from miles.config import ConfigError, MilesConfig, build, check_allowed
from miles.config.schema import HOOK_OPTIONAL_KEY
from miles.hooks.protocols import HookContext, HookSpec, check_hook, hook_name
from miles.types import Sample, TrainBatch

log = logging.getLogger(__name__)


class HookError(RuntimeError):
    """A hook raised; the message names its config entry, target and point."""


def build_hooks(run: MilesConfig, task: Any) -> list[HookSpec]:
    """Build and check every entry of ``run.hooks`` (nothing runs yet); raises ConfigError naming ``hooks[i]``."""
    specs: list[HookSpec] = []
    names: dict[str, str] = {}
    for i, node in enumerate(run.hooks):
        key = f"hooks[{i}]"
        check_allowed(node.target, run.plugins.allow, f"{key}._target_")
        optional = bool(node.kwargs.get(HOOK_OPTIONAL_KEY, False))
        node = dataclasses.replace(node, kwargs={k: v for k, v in node.kwargs.items() if k != HOOK_OPTIONAL_KEY})
        try:
            hook = build(node, allow=run.plugins.allow, key=key)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}: {node.target} refused its arguments: {e}") from None
        points = check_hook(hook, key=key, target=node.target, config=run, task=task)
        name = hook_name(hook)
        if name in names:
            raise ConfigError(f"{key}: its metrics would go to hooks/{name}/, as those of {names[name]}; give one "
                              "of them another name (its `name` argument or attribute)")
        names[name] = key
        specs.append(HookSpec(key=key, target=node.target, hook=hook, points=points, optional=optional, name=name))
    return specs


class HookChain:
    """The hooks of a run, called by the loop at each point in list order.

    Each point method takes the step first, then the point's arguments. An empty chain (the default of
    :class:`miles.core.step.LoopContext`) calls nothing and logs no metric.
    """

    def __init__(self, specs: Sequence[HookSpec] = (), *, config: MilesConfig | None = None, task: Any = None,
                 set_tags: Callable[[dict[str, str]], None] | None = None) -> None:
        self.specs = list(specs)
        self.config, self.task = config, task
        self._set_tags = set_tags
        self._contexts = [HookContext(self, s) for s in self.specs]
        self.step = 0
        """The step of the last call (the run's last step once the loop is done)."""
        self.stop_reason: str | None = None
        """Why the run is stopping early (the hook and its reason), or None."""
        self.errors = 0
        """Exceptions of optional hooks so far."""
        self._metrics: dict[str, float] = {}
        self._seconds = 0.0
        self._point: str | None = None
        self._ended = False

    def __len__(self) -> int:
        return len(self.specs)

    # ---- the points, in the order the loop reaches them -------------------------------------------

    def on_run_start(self, step: int) -> None:
        self._call("on_run_start", step)

    def after_rollout(self, step: int, groups: Sequence[Sequence[Sample]]) -> None:
        self._call("after_rollout", step, groups)

    def after_reward(self, step: int, groups: Sequence[Sequence[Sample]]) -> None:
        self._call("after_reward", step, groups)

    def before_train(self, step: int, batch: TrainBatch) -> None:
        self._call("before_train", step, batch)

    def after_train(self, step: int, metrics: Mapping[str, float]) -> None:
        self._call("after_train", step, MappingProxyType(dict(metrics)))

    def after_weight_sync(self, step: int, version: int) -> None:
        self._call("after_weight_sync", step, version)

    def after_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._call("after_eval", step, MappingProxyType(dict(metrics)))

    def on_checkpoint(self, step: int, path: str) -> None:
        self._call("on_checkpoint", step, str(path))

    def on_run_end(self, metrics: Mapping[str, float], status: str) -> None:
        """Once per run (later calls do nothing), at the last step. With a status other than FINISHED
        (the run already failed) a hook's exception is logged, not raised."""
        if self._ended:
            return
        self._ended = True
        self._call("on_run_end", self.step, MappingProxyType(dict(metrics)), status, fatal=status == "FINISHED")

    # ---- what the loop reads back ------------------------------------------------------------------

    def pop_metrics(self) -> dict[str, float]:
        """The hooks' metrics since the last call, plus ``hooks/errors`` and ``hooks/time_s``; none without hooks."""
        if not self.specs:
            return {}
        out = self._metrics | {"hooks/errors": float(self.errors), "hooks/time_s": self._seconds}
        self._metrics, self._seconds = {}, 0.0
        return out

    # ---- internals ---------------------------------------------------------------------------------

    def _call(self, point: str, step: int, *args: Any, fatal: bool = True) -> None:
        self.step = step
        for spec, ctx in zip(self.specs, self._contexts, strict=True):
            if point not in spec.points:
                continue
            t0 = time.perf_counter()
            self._point = point
            try:
                getattr(spec.hook, point)(ctx, *args)
            except Exception as e:
                what = f"{spec.key} {spec.target}.{point} raised {type(e).__name__}: {e}"
                if not spec.optional and fatal:
                    raise HookError(what) from e
                self.errors += 1
                log.warning("step %d: %s (%s)", step, what, "optional hook: counted in hooks/errors, the run goes on"
                            if spec.optional else "the run had already failed", exc_info=True)
            finally:
                self._point = None
                self._seconds += time.perf_counter() - t0

    def _request_stop(self, spec: HookSpec, reason: str) -> None:
        if self._point in ("on_checkpoint", "on_run_end"):
            raise RuntimeError(f"request_stop: not available at {self._point} (the step's evaluation has run); "
                               "ask for the stop at after_train or after_eval")
        who = f"{spec.key} {spec.target}: {reason}"
        if self.stop_reason is not None:
            log.info("step %d: %s also asked to stop (the run already stops: %s)", self.step, who, self.stop_reason)
            return
        self.stop_reason = who
        log.warning("step %d: %s asked to stop: %s; the run ends after this step", self.step, spec.key, reason)
        if self._set_tags is not None:
            self._set_tags({"miles.stopped_early": "true", "miles.stop_reason": who,
                            "miles.stopped_at_step": str(self.step)})


def finite(metrics: Mapping[str, float], key: str) -> float | None:
    """``metrics[key]`` when present and finite, else None (a step without trainable samples has NaN rewards)."""
    v = metrics.get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else None
