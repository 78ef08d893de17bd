"""The rollout server's request bodies: each field checked on its own (an HTTPException naming it),
and how a chat request's messages continue a :class:`~miles.agent.session.Session`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException

from miles.agent.session import Session
from miles.agent.tools import CLOSE, OPEN, escape_special_tokens, parse_tool_calls
from miles.rollout.requests import EngineLimits, check_request
from miles.types import GenerateRequest, SamplingParams

ROLES = ("system", "user", "assistant", "tool")


def sampling_params(body: Any, *, max_key: str) -> SamplingParams:
    """The sampling fields of a request body (``max_key``: its ``max_new_tokens``); 422 naming a wrong field."""
    if not isinstance(body, dict):
        raise HTTPException(422, f"sampling fields: expected a JSON object, got {type(body).__name__}")

    def number(key: str, value: Any, kind: type) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise HTTPException(422, f"{key}: expected a number, got {value!r}")
        try:
            out = kind(float(value)) if kind is int and isinstance(value, float) else kind(value)
        except (TypeError, ValueError, OverflowError):
            raise HTTPException(422, f"{key}: expected a number, got {value!r}") from None
        if kind is int and isinstance(value, float) and out != value:
            raise HTTPException(422, f"{key}: expected an integer, got {value!r}")
        if kind is float and out != out:
            raise HTTPException(422, f"{key}: expected a number, got NaN")
        return out

    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise HTTPException(422, f"seed: expected an integer or null, got {seed!r}")
    temperature = number("temperature", body.get("temperature", 1.0), float)
    max_new = body.get(max_key) or body.get("max_completion_tokens") or 256
    return SamplingParams(
        temperature=temperature,
        greedy=temperature == 0.0,
        seed=seed,
        top_p=number("top_p", body.get("top_p", 1.0), float),
        top_k=number("top_k", body.get("top_k", 0), int),
        max_new_tokens=number(max_key, max_new, int),
    )


def to_request(
    rid: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    limits: EngineLimits | None,
    session_id: str | None = None,
) -> GenerateRequest:
    """A request of ``prompt_ids``, checked against the engine's ``limits`` when known (422 naming the field)."""
    request = GenerateRequest(
        request_id=rid, prompt_ids=tuple(prompt_ids), sampling=sampling, session_id=session_id
    )
    if limits is not None:
        try:
            check_request(request, None, limits)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
    return request


def check_n(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise HTTPException(422, f"n: only 1 is supported, got {n!r}")
    if body.get("stream"):
        raise HTTPException(422, "stream: streaming responses are not supported; send stream=false")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The OpenAI ``messages`` of a chat request, checked (422 naming the message and field)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPException(422, "messages: a non-empty list of {'role', 'content'} objects is required")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPException(422, f"messages[{k}]: expected an object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise HTTPException(
                422, f"messages[{k}].role: expected one of {', '.join(ROLES)}, got {m.get('role')!r}"
            )
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text parts, joined
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise HTTPException(422, f"messages[{k}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise HTTPException(
                422, f"messages[{k}].content: expected a string, got {type(content).__name__}"
            )
        out.append({**m, "content": content})
    return out


def assistant_message(text: str, call_id_prefix: str) -> dict[str, Any]:
    """An OpenAI assistant message: ``content`` is the text before the first ``<tool_call>`` when the
    text has well-formed calls (then listed in ``tool_calls``, arguments JSON-encoded), else the text."""
    calls, _ = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": text.split(OPEN)[0].strip() or None,
        "tool_calls": [
            {
                "id": f"call_{call_id_prefix}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ],
    }


def _reply(message: dict[str, Any]) -> tuple[str, list[tuple[Any, Any]]]:
    """What an assistant message says: its text and its calls as ``(name, arguments)``, the arguments
    decoded when they are JSON (a client may re-encode them), ``None`` content read as empty."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            calls.append((None, call))
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append((function.get("name"), arguments))
    return message.get("content") or "", calls


def _assistant_text(message: dict[str, Any]) -> str:
    """An assistant message as the policy would have written it: the content, then each of its
    ``tool_calls`` as a ``<tool_call>`` block (what :func:`assistant_message` parsed them from)."""
    text, calls = _reply(message)
    blocks = [
        f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}" for name, arguments in calls
    ]
    return "\n".join([text, *blocks] if text else blocks)


def chat_messages(messages: list[dict[str, Any]], specials: Sequence[str] = ()) -> list[dict[str, str]]:
    """OpenAI messages as the session renders them: consecutive ``tool`` messages become one user turn
    of ``<tool_response>`` blocks (Qwen3's rendering), an assistant message's ``tool_calls`` become
    ``<tool_call>`` blocks after its content; other roles keep their text content.

    Every special token's string in a system, user or tool message's text (``specials``, the tokenizer's:
    :func:`~miles.agent.tools.special_token_strings`) is broken as in a tool's output
    (:func:`~miles.agent.tools.escape_special_tokens`): text an agent passes on from an environment cannot
    close its turn and forge an assistant turn. Assistant messages are the policy's replies, kept as sent."""
    out: list[dict[str, str]] = []
    for m in messages:
        text = m.get("content") or ""
        if m["role"] != "assistant":
            text = escape_special_tokens(text, specials)
        if m["role"] == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tools"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tools": "1"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _assistant_text(m)})
        else:
            out.append({"role": m["role"], "content": text})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def off_record(session: Session, messages: list[dict[str, Any]], request: list[dict[str, str]]) -> str | None:
    """Why the request's ``messages`` (``request``: their :func:`chat_messages`) cannot continue the
    session's record, or None when they can.

    They continue it when they start with the session's messages: the same roles, the same text for
    every other role, and for each assistant turn the reply the server gave (content and calls, see
    :func:`assistant_message`; re-encoded arguments are the same calls). An agent that edits its
    earlier replies (strips a ``<think>`` part, trims them), rewrites or drops earlier messages, or
    follows a turn already off the record, does not: the server then answers from a fresh rendering
    (:meth:`Session.add_unrecorded`). A request with nothing after the session's last assistant turn
    is refused (ValueError): there is nothing to answer.
    """
    held = session.messages
    if request[-1]["role"] == "assistant":
        raise ValueError("nothing new after the conversation's last assistant turn")
    if session.off_record is not None:
        return "an earlier turn of the session was already off the record"
    if len(request) < len(held):
        return f"the session holds {len(held)} messages, the request only {len(request)}"
    sent = iter([m for m in messages if m["role"] == "assistant"])
    for k, (ours, theirs) in enumerate(zip(held, request, strict=False)):
        if ours["role"] != theirs["role"]:
            return f"message {k} is a {theirs['role']} message where the session holds a {ours['role']} one"
        if ours["role"] == "assistant":
            if _reply(next(sent)) != _reply(assistant_message(ours["content"], "")):
                return f"message {k} (assistant) is not the reply the server gave"
        elif ours["content"] != theirs["content"]:
            return f"message {k} ({theirs['role']}) differs from the session's"
    return None


def extend_session(session: Session, request: list[dict[str, str]]) -> bool:
    """Append the messages after the session's turns (``request``: the request's :func:`chat_messages`),
    for a request :func:`off_record` found continuing the record. Returns whether messages were appended (one environment turn, which
    :meth:`Session.drop_last_turn` removes). Raises :class:`~miles.agent.session.TemplateDriftError` when
    the chat template rewrites an earlier turn once they are added (nothing is appended then)."""
    new = request[len(session.messages) :]
    if new:
        session.add_messages(new)
    return bool(new)
