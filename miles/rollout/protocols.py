"""The rollout edges a config may name, and their contract checks.

Three places take user code by ``_target_`` (with its module prefix in ``plugins.allow``):

- ``rollout.generate_fn``, a :class:`GenerateFn`: ``async (ctx, problem, sampling) -> list[Sample]``,
  the ``ctx.n`` responses of one prompt. The built-in
  :func:`miles.rollout.generate.single_turn` sends one request with ``n`` (one shared prefill).
  Multi-turn and tool use live here: call ``await ctx.engine_generate(request)`` as often as
  needed (every call is load-balanced, deadline-bounded and retried by the manager), append
  environment tokens with loss mask 0, never re-tokenize.
- ``task.reward``, a :class:`RewardFn` ``(response_text, label) -> float`` or, per group, a
  :class:`GroupRewardFn` ``(responses, label) -> list[float]``, run by the reward runner.
- ``rollout.filters``, each a :class:`SampleFilter` ``(group) -> (keep, reason)``, applied to
  scored groups; dropped groups are replaced by over-sampling (``rollout.max_oversample_rounds``).

Each ``check_*`` runs an implementation on small real inputs and raises :class:`ContractError`
naming the first broken promise, so a broken plugin fails at start-up or in a unit test, not as a
silent bias in training.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from miles.types import Problem, Sample, SamplingParams, Status

if TYPE_CHECKING:
    from miles.rollout.generate import GenerateContext


class ContractError(ValueError):
    """A user-supplied rollout function breaks its protocol; the message names the promise."""


class GenerateFn(Protocol):
    """``async (ctx, problem, sampling) -> list[Sample]``: the ``ctx.n`` responses to one prompt.

    Promises: a coroutine function; returns exactly ``ctx.n`` samples with ``group_id ==
    ctx.group_id`` and indices ``0 .. n-1`` once each; per sample ``response_ids``,
    ``rollout_logprobs`` and ``loss_mask`` have one entry per response token, the loss mask is 0/1
    (0 on environment tokens), log-probs are finite and <= 0; ``prompt_ids`` is not empty.
    Engine failures surface as :class:`miles.rollout.dispatch.EngineRequestError` from
    ``ctx.engine_generate``; let it propagate (the group is then counted as failed) or handle it.
    """

    async def __call__(self, ctx: GenerateContext, problem: Problem, sampling: SamplingParams) -> list[Sample]: ...


class RewardFn(Protocol):
    """``(response_text, label) -> float``: one response's reward (finite; deterministic)."""

    def __call__(self, response_text: str, label: Any) -> float: ...


class GroupRewardFn(Protocol):
    """``(responses, label) -> list[float]``: the rewards of one prompt's responses, in order."""

    def __call__(self, responses: list[str], label: Any) -> list[float]: ...


class SampleFilter(Protocol):
    """``(group) -> (keep, reason)`` on one scored group; must not modify the samples.

    ``reason`` says why a group is dropped (logged and stored in ``Sample.filtered``); it may be
    empty when ``keep`` is true. Groups are dropped whole (a group is one prompt's baseline).
    """

    def __call__(self, group: Sequence[Sample]) -> tuple[bool, str]: ...


# --- contract checks ----------------------------------------------------------------------------


def _name(fn: Any) -> str:
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(inner, "__qualname__", repr(inner))


class _GroupGenerator(Protocol):
    """What :func:`check_generate_fn` needs of a :class:`miles.rollout.manager.RolloutManager`."""

    async def generate_group(self, fn: Any, problem: Problem, n: int, sampling: SamplingParams, *, group_id: int,
                             seed: int) -> list[Sample]: ...


def check_generate_fn(
    fn: Any, manager: _GroupGenerator, problem: Problem, *, n: int = 2, sampling: SamplingParams | None = None
) -> list[Sample]:
    """Run ``fn`` once for ``problem`` through ``manager``'s engines and check every promise of
    :class:`GenerateFn`. Returns the samples it produced."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if not (inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(type(inner).__call__)):
        raise ContractError(f"generate_fn {_name(fn)}: must be an 'async def' function (a coroutine function)")
    sampling = sampling or SamplingParams(max_new_tokens=4)
    samples = asyncio.run(manager.generate_group(fn, problem, n, sampling, group_id=7, seed=0))
    check_group(samples, n=n, group_id=7, who=f"generate_fn {_name(fn)}")
    return samples


def check_group(samples: Any, *, n: int, group_id: int, who: str) -> None:
    """The structural promises of a generated group (see :class:`GenerateFn`)."""
    if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
        raise ContractError(f"{who}: must return a list of Sample, found {type(samples).__name__}")
    if len(samples) != n:
        raise ContractError(f"{who}: returned {len(samples)} samples, expected ctx.n = {n}")
    if sorted(s.index for s in samples) != list(range(n)):
        raise ContractError(f"{who}: sample indices {[s.index for s in samples]} must be 0..{n - 1}, each once")
    for s in samples:
        where = f"{who}: sample {s.index}"
        if s.group_id != group_id:
            raise ContractError(f"{where} has group_id {s.group_id}, expected ctx.group_id = {group_id}")
        if not isinstance(s.status, Status):
            raise ContractError(f"{where}: status must be a miles.types.Status, found {s.status!r}")
        if s.status is Status.FAILED:
            continue  # a failed sample carries no tokens to check
        if not s.prompt_ids:
            raise ContractError(f"{where}: prompt_ids is empty; the first response token needs context")
        r, lp, m = len(s.response_ids), len(s.rollout_logprobs), len(s.loss_mask)
        if not r == lp == m:
            raise ContractError(
                f"{where}: {r} response tokens, {lp} rollout log-probs and {m} loss-mask entries; all must match"
            )
        if s.token_versions and len(s.token_versions) != r:
            raise ContractError(f"{where}: {len(s.token_versions)} token versions for {r} response tokens; set one "
                                "per token (environment tokens: the version of the turn before) or none")
        if any(v not in (0, 1) for v in s.loss_mask):
            raise ContractError(f"{where}: loss_mask must hold only 0 and 1, found {sorted(set(s.loss_mask))}")
        if any(not math.isfinite(x) or x > 1e-6 for x in s.rollout_logprobs):
            raise ContractError(f"{where}: rollout log-probs must be finite and <= 0")


def check_reward_fn(fn: Any, examples: Sequence[tuple[Any, Any]], *, kind: str = "sample") -> list[Any]:
    """Call a reward function on ``examples`` twice and check its promises.

    ``kind="sample"``: examples are ``(response_text, label)``; each call returns a finite number.
    ``kind="group"``: examples are ``(responses, label)``; each call returns one finite number per
    response. Both: the same input gives the same reward (rewards must be reproducible).
    """
    if kind not in ("sample", "group"):
        raise ValueError(f"check_reward_fn: kind must be 'sample' or 'group', found {kind!r}")
    who = f"reward fn {_name(fn)}"
    if inspect.iscoroutinefunction(fn.func if isinstance(fn, functools.partial) else fn):
        raise ContractError(f"{who}: must be a plain function (it runs in a worker process), not 'async def'")
    out = []
    for x, label in examples:
        first, again = fn(copy.deepcopy(x), label), fn(copy.deepcopy(x), label)
        values = [first] if kind == "sample" else first
        if kind == "group" and (not isinstance(first, Sequence) or len(first) != len(x)):
            raise ContractError(f"{who}: must return one reward per response ({len(x)}), found {first!r}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ContractError(f"{who}: rewards must be finite numbers, found {v!r} for {x!r}")
        if first != again:
            raise ContractError(f"{who}: not deterministic: {first!r} then {again!r} for {x!r}")
        out.append(first)
    return out


def check_filter(fn: Any, groups: Sequence[Sequence[Sample]]) -> list[tuple[bool, str]]:
    """Apply a sample filter to each group twice and check its promises.

    Returns ``(keep, reason)`` as a bool and a str; a dropped group has a non-empty reason; the
    samples are not modified; the same group gives the same answer.
    """
    who = f"filter {_name(fn)}"
    out = []
    for group in groups:
        before = copy.deepcopy(list(group))
        result = fn(group)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool)
                and isinstance(result[1], str)):
            raise ContractError(f"{who}: must return (keep: bool, reason: str), found {result!r}")
        if not result[0] and not result[1]:
            raise ContractError(f"{who}: a dropped group needs a reason (found an empty string)")
        if list(group) != before:
            raise ContractError(f"{who}: modified the samples of the group it was given")
        if fn(group) != result:
            raise ContractError(f"{who}: not deterministic on the same group")
        out.append(result)
    return out
