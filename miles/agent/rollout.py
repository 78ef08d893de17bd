"""A multi-turn, tool-using generate function for ``rollout.generate_fn``.

::

    rollout:
      generate_fn:
        _target_: miles.agent.rollout.tool_loop
        _partial_: true
        max_turns: 4
        tools:
          - {_target_: miles.agent.calculator.Calculator}

Per prompt, each of the ``ctx.n`` samples is one :class:`miles.agent.session.Session`. Turn 1 is
one engine request with ``n`` (the samples share its prefill) and a fresh ``session_id``; later
turns are one request per sample whose prompt is exactly the session's ids so far and whose
``session_id`` is the sample's :func:`miles.types.session_key`, the same for all its turns: the
engine pool sends them to the engine of the turn before (``rollout.session_affinity``), whose
prefix cache may hold the context's KV. After each policy turn:

- a turn that did not complete (truncated or aborted) ends the session with that status;
- a turn without ``<tool_call>`` blocks is the final answer: the session ends (COMPLETED);
- otherwise the calls run (at most ``max_calls_per_turn``; further ones and malformed ones get an
  error observation), concurrently, each under its tool's deadline, and their results are appended
  as one ``<tool_response>`` user turn (loss mask 0; special tokens' strings in a tool's text are
  escaped, :func:`miles.agent.tools.escape_special_tokens`), unless ``max_turns`` policy turns were taken;
  the session then ends TRUNCATED, as it does when the tool-response turn plus ``max_new_tokens``
  would not fit in ``max_context_tokens`` (that turn is then taken back).

A later turn whose engine request fails on every attempt (the pool retried it
``rollout.max_retries`` times; :class:`~miles.rollout.dispatch.EngineRequestError`) ends that
sample alone as FAILED, with the reason in ``Sample.failure`` (out of the loss and the group's
reward statistics, counted in ``rollout/failed_generation``) and ``agent/turn_failures``; the
group's other samples go on. A failed first turn fails the whole group (no sample exists yet).

The sample's response is everything after the prompt (policy turns with their log-probs and loss
mask 1, observations with loss mask 0); its ``response_text``, which the reward sees, is the last
policy turn's text. Per-sample counts go to ``Sample.metadata["counts"]`` and the rollout manager
sums them into ``rollout/agent/*`` metrics (:func:`miles.rollout.manager.sample_counts`): ``turns``
(policy turns), ``tool_malformed`` (malformed ``<tool_call>`` blocks the policy wrote, in any turn it finished; a turn cut off at
``max_new_tokens`` is not parsed),
``tool_calls`` (calls whose response the policy got, malformed ones included), ``tool_calls_ok``
(those that returned without error), ``tool_unknown_tool`` / ``tool_timeout`` / ``tool_raised`` /
``tool_too_many``, ``template_drift``, ``template_rewrites`` and ``tool_success_rate``
(``tool_calls_ok / tool_calls``), ``turn_failures``; every count but ``tool_success_rate`` is there every step, 0
included (:data:`COUNTS`). The calls of a turn at ``max_turns`` are not run; those of a
turn whose response is taken back (no room) ran but are not counted in ``tool_calls``.

Template drift (see :mod:`miles.agent.session`) is counted per sample; with ``strict_template``
a drift or a template that rewrites a past turn raises, and the manager records the group as
FAILED with that reason (out of the loss). Without it, a rewrite ends the session where it
happened (the sample keeps the turns it has) and is counted.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from miles.agent.session import Session, TemplateDriftError
from miles.agent.tools import (
    Tool,
    ToolOutcome,
    escape_special_tokens,
    parse_tool_calls,
    run_call,
    schema,
    special_token_strings,
    tool_response_message,
)
from miles.models.vision import PLACEHOLDER
from miles.rollout.dispatch import EngineRequestError, first_line
from miles.rollout.generate import GenerateContext
from miles.types import GenerateRequest, GenerateResult, Problem, Sample, SamplingParams, Status, session_key

COUNTS = ("agent/turns", "agent/tool_calls", "agent/tool_calls_ok", "agent/tool_malformed", "agent/tool_unknown_tool",
          "agent/tool_timeout", "agent/tool_raised", "agent/tool_too_many", "agent/template_drift",
          "agent/template_rewrites", "agent/turn_failures")
"""Every sample's counts, 0 included: each is a ``rollout/agent/*`` metric (and a Prometheus series) every step."""


async def tool_loop(
    ctx: GenerateContext, problem: Problem, sampling: SamplingParams, *, tools: Sequence[Tool] = (),
    max_turns: int = 4, max_calls_per_turn: int = 4, max_context_tokens: int | None = None,
    system_prompt: str | None = None, tools_in_template: bool = True, strict_template: bool = False,
) -> list[Sample]:
    """The ``ctx.n`` multi-turn samples of one prompt (see the module docstring).

    ``tools``: the built tool objects; ``system_prompt``: an optional first system message;
    ``tools_in_template``: pass the tools' schemas to the chat template as ``tools=`` (Qwen3's
    template lists them in the system turn; a template without tool support ignores them).
    """
    if max_turns < 1 or max_calls_per_turn < 1:
        raise ValueError(f"tool_loop: max_turns and max_calls_per_turn must be >= 1, found {max_turns}, "
                         f"{max_calls_per_turn}")
    tools = [t.for_problem(problem) if hasattr(t, "for_problem") else t for t in tools]
    by_name = {t.name: t for t in tools}
    pictures = tuple(getattr(problem, "images", None) or ())
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": PLACEHOLDER * len(pictures) + problem.prompt}]
    render = {"tools": [schema(t) for t in tools]} if tools and tools_in_template else {}
    sessions = [Session(ctx.tokenizer, messages, strict=strict_template, render_kwargs=render, pictures=pictures,
                        encoder=ctx.image_encoder) for _ in range(ctx.n)]
    session_id = f"agent-{ctx.group_id}-{secrets.token_hex(4)}"  # unique even when group ids repeat
    first = await ctx.engine_generate(GenerateRequest(
        request_id=f"{ctx.group_id}-t1", prompt_ids=tuple(sessions[0].ids), n=ctx.n, seed=ctx.seed,
        session_id=session_id, images=sessions[0].images), sampling)
    loop = _Loop(ctx, sampling, by_name, max_turns, max_calls_per_turn, max_context_tokens, session_id)
    return list(await asyncio.gather(*(loop.run(s, r, problem) for s, r in zip(sessions, first, strict=True))))


class _Loop:
    """The turns of one sample after the shared first request."""

    def __init__(self, ctx: GenerateContext, sampling: SamplingParams, tools: dict[str, Tool], max_turns: int,
                 max_calls: int, max_context: int | None, session_id: str) -> None:
        self.ctx, self.sampling, self.tools, self.session_id = ctx, sampling, tools, session_id
        self.max_turns, self.max_calls, self.max_context = max_turns, max_calls, max_context
        self.specials = special_token_strings(ctx.tokenizer)  # a tool's text never speaks in special tokens

    async def run(self, session: Session, result: GenerateResult, problem: Problem) -> Sample:
        counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        text, failure = "", None
        while True:
            text = session.add_policy(result)
            counts["agent/turns"] += 1
            if result.status is not Status.COMPLETED:
                break
            calls, outcomes = parse_tool_calls(text)
            counts["agent/tool_malformed"] += len(outcomes)
            if not calls and not outcomes:
                break  # the final answer
            if session.policy_turns >= self.max_turns:
                session.status = Status.TRUNCATED
                break
            outcomes += await self._call(calls)
            try:
                session.add_messages([tool_response_message(outcomes)], [p for o in outcomes for p in o.images])
            except TemplateDriftError:
                if session.strict:
                    raise
                counts["agent/template_rewrites"] += 1
                break
            if self.max_context is not None and len(session.ids) + self.sampling.max_new_tokens > self.max_context:
                session.drop_last_turn()  # no room for the answer to it: the session ends on the policy's turn
                session.status = Status.TRUNCATED
                break
            _count(counts, outcomes)
            try:
                result = await next_turn(self.ctx, session, self.sampling, self.session_id, result.index)
            except EngineRequestError as e:  # retried by the pool already: this sample ends, the group goes on
                counts["agent/turn_failures"] += 1
                failure = f"generation: turn {session.policy_turns + 1}: {first_line(e)}"
                break
        counts["agent/template_drift"] += session.finish() is not None
        return Sample(
            group_id=self.ctx.group_id, index=result.index, prompt_ids=list(session.prompt_ids),
            response_ids=list(session.response_ids), rollout_logprobs=list(session.logprobs),
            loss_mask=list(session.loss_mask), status=Status.FAILED if failure else session.status,
            weight_version=session.weight_version, label=problem.label, response_text=text, failure=failure,
            images=session.images, metadata={"counts": dict(counts)})

    async def _call(self, calls: list) -> list[ToolOutcome]:
        extra = [ToolOutcome(name=c.name, text=f"error: more than {self.max_calls} tool calls in one turn; not run",
                             error="too_many") for c in calls[self.max_calls:]]
        done = await asyncio.gather(*(run_call(self.tools, c) for c in calls[:self.max_calls]))
        return [replace(o, text=escape_special_tokens(o.text, self.specials)) for o in done] + extra


def _count(counts: Counter[str], outcomes: list[ToolOutcome]) -> None:
    """Calls whose responses the policy got (malformed ones are counted when parsed)."""
    for o in outcomes:
        counts["agent/tool_calls"] += 1
        counts["agent/tool_calls_ok"] += o.error is None
        if o.error not in (None, "malformed"):
            counts[f"agent/tool_{o.error}"] += 1


async def next_turn(ctx: GenerateContext, session: Session, sampling: SamplingParams, session_id: str,
                    index: int) -> GenerateResult:
    """Sample ``index``'s next policy turn: one request (n=1) whose prompt is exactly the session's ids so far,
    with a seed of its own per turn and the sample's :func:`~miles.types.session_key` (so it goes to the
    engine of the sample's earlier turns); the result carries the sample's index. Raises
    :class:`~miles.rollout.dispatch.EngineRequestError` when every attempt failed."""
    turn = session.policy_turns + 1
    (result,) = await ctx.engine_generate(GenerateRequest(
        request_id=f"{ctx.group_id}-{index}-t{turn}", prompt_ids=tuple(session.ids), n=1,
        seed=ctx.seed + 7919 * turn + index, session_id=session_key(session_id, ctx.n, index),
        images=session.images), sampling)
    return replace(result, index=index)
