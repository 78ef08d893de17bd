"""Tool calls in Qwen3's format: parsing, running with a deadline, and the tool-response turn.

The model writes each call as a JSON object between tags, as Qwen3's chat template teaches it::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

:func:`parse_tool_calls` returns the well-formed calls and one :class:`ToolOutcome` error per
malformed block (unclosed tag, invalid JSON, no ``name``, ``arguments`` not an object), so a broken
call becomes an error observation the model sees, and a counted metric, never an exception.
``arguments`` given as a JSON-encoded string are decoded.

A tool (:class:`Tool`) is a ``_target_`` entry (its module must be allowlisted, see
``plugins.allow``) with a ``name``, a ``description``, a JSON-schema ``parameters`` and a
``timeout_s``; calling it with the arguments returns the observation text. :func:`run_call` runs
one call in a new daemon thread and stops waiting at ``timeout_s``: the observation is then a
timeout error. A Python thread cannot be killed: a call past its deadline keeps running in its
thread (nothing waits for it, not even the interpreter's exit), so a tool whose work can be
unbounded bounds itself (the calculator refuses huge powers; the sandbox kills its subprocess at
its wall limit).

The results go back as one user turn of ``<tool_response>`` blocks (:func:`tool_response_message`),
which is exactly how Qwen3's template renders consecutive ``tool`` messages. A tool's text is text:
:func:`escape_special_tokens` breaks every special token's string in it (``<|im_end|>``,
``<|im_start|>``, ``<|image_pad|>``, ...) with a zero-width space, so output the model wrote through a
tool (the sandbox prints what its code prints) can neither forge a turn nor claim a picture.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class Tool(Protocol):
    """A callable tool: ``tool(arguments) -> observation text`` (or an :class:`Observation` with pictures);
    raise to report an error.

    A tool may also define ``for_problem(problem) -> Tool``: the tool loop then calls that once per prompt
    and uses what it returns for that prompt's samples (a tool that works on the problem's own state, such as
    its picture)."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object (what the chat template shows the model)."""
    timeout_s: float
    """Per-call deadline in seconds."""

    def __call__(self, arguments: dict[str, Any]) -> str: ...


@dataclass(frozen=True)
class Observation:
    """What a tool returns when its answer holds pictures: ``text`` and ``images`` (PNG bytes, paths or PIL
    images). Each picture is shown to a vision-language model before the text, in the tool's response
    block; a text-only model refuses such a tool (see :mod:`miles.agent.rollout`)."""

    text: str = ""
    images: tuple[Any, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One well-formed call parsed from the model's text."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ToolOutcome:
    """What one call (or one malformed block) gave back to the model."""

    name: str
    """The tool's name ("" for a block that had none)."""
    text: str
    """The observation shown to the model."""
    error: str | None = None
    """None on success, else one of "malformed", "unknown_tool", "timeout", "raised"."""
    images: tuple[Any, ...] = ()
    """The pictures of an :class:`Observation` (none for text or an error)."""


def schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function schema that chat templates (Qwen3's ``tools=``) render."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[ToolOutcome]]:
    """The calls in ``text``, in order, and an error outcome for each malformed ``<tool_call>`` block."""
    calls, errors = [], []
    for match in _BLOCK.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            errors.append(_malformed(f"{OPEN} without {CLOSE}"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(_malformed(f"the call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            errors.append(_malformed('the call must be a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(_malformed(f'"arguments" of {obj["name"]} must be a JSON object', obj["name"]))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls, errors


def _malformed(why: str, name: str = "") -> ToolOutcome:
    return ToolOutcome(name=name, text=f"error: malformed tool call: {why}", error="malformed")


async def run_call(tools: Mapping[str, Tool], call: ToolCall) -> ToolOutcome:
    """Run one call in a thread, bounded by the tool's ``timeout_s``; every failure is an outcome."""
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolOutcome(name=call.name, text=f"error: unknown tool {call.name!r} (tools: {known})",
                           error="unknown_tool")
    try:
        text = await asyncio.wait_for(run_in_daemon_thread(tool, dict(call.arguments)), timeout=tool.timeout_s)
    except TimeoutError:
        return ToolOutcome(name=call.name, text=f"error: {call.name} did not answer within {tool.timeout_s:g} s",
                           error="timeout")
    except Exception as e:  # the tool's own failure is the model's observation
        return ToolOutcome(name=call.name, text=f"error: {type(e).__name__}: {e}", error="raised")
    if isinstance(text, Observation):
        return ToolOutcome(name=call.name, text=text.text, images=tuple(text.images))
    return ToolOutcome(name=call.name, text=str(text))


def run_in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a new daemon thread: a call that never returns keeps only its thread, and
    neither the event loop's shutdown nor the interpreter's exit waits for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:  # handed to the awaiting coroutine
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while the call ran (its deadline had passed)
            pass

    threading.Thread(target=work, name="miles-tool", daemon=True).start()
    return future


ZERO_WIDTH_SPACE = "\u200b"


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings ``tokenizer`` reads as special tokens: its special tokens and its added special tokens."""
    added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)]
    return tuple(sorted({*getattr(tokenizer, "all_special_tokens", ()), *added} - {""}, key=len, reverse=True))


def escape_special_tokens(text: str, specials: Sequence[str]) -> str:
    """``text`` with each occurrence of a special token's string broken after its first character by a
    zero-width space (the tokenizer then reads it as plain text)."""
    for token in specials:
        text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
    return text


def tool_response_message(outcomes: Sequence[ToolOutcome]) -> dict[str, str]:
    """One user message with a ``<tool_response>`` block per outcome (Qwen3's rendering of tool turns); an
    outcome's pictures are image placeholders (:data:`miles.models.vision.PLACEHOLDER`) before its text."""
    from miles.models.vision import PLACEHOLDER

    body = "\n".join(f"<tool_response>\n{PLACEHOLDER * len(o.images)}{o.text}\n</tool_response>" for o in outcomes)
    return {"role": "user", "content": body}
