"""The hook points of the loop (one Protocol each), the context a hook gets, and the start-up contract check.

A hook is an object; for every point it implements it has a method of the point's name, called
with a :class:`HookContext` and the point's arguments, positionally:

=====================  ====================================================================  ===================
point                  when                                                                  arguments after ctx
=====================  ====================================================================  ===================
``on_run_start``       once, before the step-0 evaluation (a resumed run: before its first    -
                       step, ``ctx.step`` is the checkpoint's step)
``after_rollout``      every step, once the batch's groups are generated and scored          ``groups``
``after_reward``       every step, once the rewards are final, before the advantages         ``groups``
``before_train``       every step, before the trainer ranks get the batch                    ``batch``
``after_train``        every step, after the train phase (also when it skipped the update)   ``metrics``
``after_weight_sync``  every step, once the engines have the new weights                     ``version``
``after_eval``         after every evaluation: step 0, every ``trainer.eval_every``, the     ``metrics``
                       last step
``on_checkpoint``      after a run checkpoint is written (``trainer.save_every``)            ``path``
``on_run_end``         once, when the run ends, finished or not                              ``metrics, status``
=====================  ====================================================================  ===================

Rollout and reward: the rollout manager scores each group as soon as it is generated, inside
:meth:`miles.rollout.manager.RolloutManager.collect`, and applies the sample filters there. So at
``after_rollout`` the samples already carry the task's reward; ``after_reward`` follows in the same
step once the loop's own reward shaping (DAPO's overlong penalty) is applied, right before the
advantages are computed from the rewards.

What a hook may change: the task's difficulty (``ctx.task.set_difficulty``, tasks implementing
:class:`miles.tasks.procedural.Difficulty`); ``Sample.reward`` at ``after_reward`` (advantages and
the ``train/reward_*`` metrics are computed from the rewards after it); values of the batch at
``before_train`` (e.g. its advantages; not its length or the length of any row). Everything else
it is given is read-only. Through ``ctx`` it may add metrics and ask the run to stop.

:func:`check_hook` runs before Ray starts and raises :class:`~miles.config.ConfigError` naming the
config key: at least one point implemented, no method that looks like a misspelled point,
signatures that take the documented arguments, plain (not ``async``) methods, and the hook's own
``check_config(config, task)`` when it has one.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from miles.config.schema import MilesConfig
from miles.config.validate import ConfigError, suggest
from miles.types import Sample, TrainBatch


@dataclass(frozen=True)
class HookSpec:
    """One checked entry of ``hooks``."""

    key: str
    """Its config key, ``hooks[i]``."""
    target: str
    """Its ``_target_``."""
    hook: Any
    """The object built from it."""
    points: tuple[str, ...]
    """The points it implements."""
    optional: bool = False
    """``_optional_: true``: its errors are counted, not fatal."""
    name: str = ""
    """Its metric namespace (``hooks/<name>/...``)."""


class _Chain(Protocol):
    """What a :class:`HookContext` reads of its chain (:class:`miles.hooks.chain.HookChain`)."""

    step: int
    config: Any
    task: Any
    stop_reason: str | None
    _metrics: dict[str, float]

    def _request_stop(self, spec: HookSpec, reason: str) -> None: ...


class HookContext:
    """What a hook gets at every point: where the run is, the task, and what it may do to the run."""

    def __init__(self, chain: _Chain, spec: HookSpec) -> None:
        self._chain, self._spec = chain, spec

    @property
    def step(self) -> int:
        """The current step (0: before the first step and in the step-0 evaluation)."""
        return self._chain.step

    @property
    def config(self) -> MilesConfig:
        """The run's validated config (frozen)."""
        return self._chain.config

    @property
    def task(self) -> Any:
        """The task the loop draws prompts from; a hook may change its difficulty
        (:class:`miles.tasks.procedural.Difficulty`) and nothing else."""
        return self._chain.task

    @property
    def name(self) -> str:
        """This hook's metric namespace: its metrics are logged as ``hooks/<name>/<key>``."""
        return self._spec.name

    @property
    def stop_reason(self) -> str | None:
        """Why the run is stopping early (whichever hook asked first), or None."""
        return self._chain.stop_reason

    def add_metrics(self, metrics: Mapping[str, float]) -> None:
        """Log ``metrics`` with the current step's as ``hooks/<name>/<key>``; values must be numbers."""
        for k, v in metrics.items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"add_metrics: '{k}' must be a number, found {v!r}")
            self._chain._metrics[f"hooks/{self.name}/{k}"] = float(v)

    def request_stop(self, reason: str) -> None:
        """End the run cleanly after the current step (see :mod:`miles.hooks.chain`); ``reason`` is
        logged and recorded in MLflow. Not available at ``on_checkpoint`` and ``on_run_end``."""
        self._chain._request_stop(self._spec, reason)


class OnRunStart(Protocol):
    def on_run_start(self, ctx: HookContext) -> None:
        """Once, before the step-0 evaluation; ``ctx.step`` is 0 (a resumed run: the checkpoint's step,
        before the first step it runs). A stop asked for here ends the run before its first step."""
        ...


class AfterRollout(Protocol):
    def after_rollout(self, ctx: HookContext, groups: Sequence[Sequence[Sample]]) -> None:
        """Every step: the batch's groups (one per prompt, ``algo.num_samples_per_prompt`` samples each),
        generated and scored by the task's reward, filters applied (``Sample.filtered``). Read-only."""
        ...


class AfterReward(Protocol):
    def after_reward(self, ctx: HookContext, groups: Sequence[Sequence[Sample]]) -> None:
        """Every step, after ``after_rollout`` and the loop's reward shaping: the same groups with their
        final rewards. A hook may change ``Sample.reward``; the advantages are computed after it."""
        ...


class BeforeTrain(Protocol):
    def before_train(self, ctx: HookContext, batch: TrainBatch) -> None:
        """Every step: the batch the trainer ranks will get (advantages set). A hook may change its values
        in place, not its length or the length of any row."""
        ...


class AfterTrain(Protocol):
    def after_train(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        """Every step, after the train phase: the step's metrics so far (``rollout/*``, ``train/*`` and,
        with a critic, ``critic/*``; no ``train/loss`` when no sample was trainable). Read-only."""
        ...


class AfterWeightSync(Protocol):
    def after_weight_sync(self, ctx: HookContext, version: int) -> None:
        """Every step, once the engines in rotation have the new weights, whose version is ``version``
        (the step)."""
        ...


class AfterEval(Protocol):
    def after_eval(self, ctx: HookContext, metrics: Mapping[str, float]) -> None:
        """After every evaluation (step 0, every ``trainer.eval_every`` steps, the last step, and the step
        a stop was asked for): its ``eval/*`` metrics. Read-only."""
        ...


class OnCheckpoint(Protocol):
    def on_checkpoint(self, ctx: HookContext, path: str) -> None:
        """After a run checkpoint is written: its directory (:func:`miles.config.checkpoints.step_dir`). The
        step's evaluation has run, so a hook cannot ask to stop here."""
        ...


class OnRunEnd(Protocol):
    def on_run_end(self, ctx: HookContext, metrics: Mapping[str, float], status: str) -> None:
        """Once, when the run ends: ``status`` is ``FINISHED`` (``metrics``: the last step's, final
        evaluation and ``perf/wall_time_s`` included), ``FAILED`` or ``KILLED`` (``metrics`` empty).
        A hook that raises fails a finished run; after a failure its error is only logged."""
        ...


PROTOCOLS: tuple[type, ...] = (OnRunStart, AfterRollout, AfterReward, BeforeTrain, AfterTrain, AfterWeightSync,
                               AfterEval, OnCheckpoint, OnRunEnd)


def _point(protocol: type) -> tuple[str, tuple[str, ...]]:
    (name,) = [n for n in vars(protocol) if not n.startswith("_")]
    return name, tuple(inspect.signature(getattr(protocol, name)).parameters)[1:]  # after self


POINTS: dict[str, tuple[str, ...]] = dict(_point(p) for p in PROTOCOLS)
"""Point name -> its documented arguments, in call order (``ctx`` first), in the order the loop calls them."""

NOT_POINTS = ("check_config",)
"""Public methods a hook may have besides its points."""

_POINT_PREFIXES = ("on_", "after_", "before_")


def hook_name(hook: Any) -> str:
    """The hook's metric namespace: its ``name`` attribute, else its class name in snake case."""
    name = getattr(hook, "name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(hook).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(cls))


def check_hook(hook: Any, *, key: str, target: str, config: Any = None, task: Any = None) -> tuple[str, ...]:
    """Raise :class:`ConfigError` naming ``key`` unless ``hook`` meets the hook contract (module docstring).

    Returns the points it implements, in call order. ``check_config(config, task)``, when the hook has
    one, runs last; a ``ValueError`` from it becomes a ``ConfigError`` naming ``key``.
    """
    points = tuple(p for p in POINTS if callable(getattr(hook, p, None)))
    for attr in sorted(dir(hook)):
        if attr.startswith("_") or attr in POINTS or attr in NOT_POINTS or not callable(getattr(hook, attr, None)):
            continue
        if attr.startswith(_POINT_PREFIXES) or difflib.get_close_matches(attr, POINTS, n=1, cutoff=0.8):
            raise ConfigError(
                f"{key}._target_: {target}.{attr} is not a hook point{suggest(attr, list(POINTS))}. Hook points: "
                f"{', '.join(POINTS)}; a helper method must not look like one (prefix it with '_')")
    if not points:
        raise ConfigError(
            f"{key}._target_: {target} built a {type(hook).__name__} that implements none of the hook points; a "
            f"hook is an object with one or more of the methods {', '.join(POINTS)} (see miles.hooks.protocols)")
    for point in points:
        method = getattr(hook, point)
        shown = f"{point}({', '.join(POINTS[point])})"
        if inspect.iscoroutinefunction(method):
            raise ConfigError(f"{key}._target_: {target}.{point} is 'async def'; hooks are called synchronously "
                              f"in the loop: make it a plain method {shown}")
        try:
            sig = inspect.signature(method)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: trust it
        try:
            sig.bind(*POINTS[point])
        except TypeError as e:
            raise ConfigError(f"{key}._target_: {target}.{point}{sig} cannot be called as {shown}, the arguments "
                              f"the loop passes ({e}); see miles.hooks.protocols") from None
    check = getattr(hook, "check_config", None)
    if callable(check):
        try:
            check(config, task)
        except ValueError as e:
            raise ConfigError(f"{key}: {target}: {e}") from None
    return points
