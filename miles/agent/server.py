"""``miles rollout CHECKPOINT [--host H] [--port P] ...``: a rollout engine over HTTP (FastAPI + uvicorn).

(``python -m miles.agent.server`` is the same command.)

Endpoints:

- ``GET /health``: ``{"status": "ok", "weight_version": N}``;
- ``POST /generate`` (SGLang-style, token ids in and out): ``{"input_ids": [...], "sampling_params":
  {"max_new_tokens", "temperature", "top_p", "top_k", "seed"}}`` returns ``{"output_ids": [...],
  "text": ..., "meta_info": {"output_token_logprobs": [...], "finish_reason", "weight_version",
  "prompt_tokens", "completion_tokens"}}``;
- ``POST /v1/chat/completions`` (OpenAI-compatible, ``n`` = 1): the messages (and ``tools``) are
  rendered with the checkpoint's chat template, the reply's ``<tool_call>`` blocks come back as
  OpenAI ``tool_calls`` (``finish_reason`` ``"tool_calls"``), and the choice also carries the token
  ids it was sampled from and as (``prompt_token_ids``, ``output_token_ids``, ``output_logprobs``).
  With a ``session_id`` in the body (the ``openai`` client: ``extra_body={"session_id": ...}``) or
  the header ``X-Miles-Session`` (``default_headers`` of the client), the
  conversation is a :class:`miles.agent.session.Session`: each request repeats the conversation, the
  server appends only the messages after its last turn (``tool`` messages as one ``<tool_response>``
  user turn), generates from the session's exact ids and appends the reply's ids and log-probs;
  the assistant turns it holds are the sampled ids. A request that does not continue those ids
  (the client sent back an assistant turn other than the reply it got, changed or dropped an earlier
  message, or the chat template rewrites an earlier turn once the new messages are added, as Qwen3's
  does with ``<think>`` parts) is still answered, from a fresh rendering of its messages; that turn
  is off the record: not appended to the ids, never trained on, and every later turn of the session
  is too. The choice's ``off_record`` says why (null for a recorded turn).
  Each turn generates with that ``session_id`` (:attr:`miles.types.GenerateRequest.session_id`): an
  engine pool sends it to the engine of the turn before, whose prefix cache may hold the context;
- ``POST /v1/completions`` (OpenAI-compatible, ``n`` = 1): ``prompt`` is a string (encoded as it is,
  no chat template) or a list of token ids (used as they are: token in, token out); the choice carries
  ``text``, ``logprobs`` (``tokens``, ``token_logprobs``) and the ids (``prompt_token_ids``,
  ``output_token_ids``, ``output_logprobs``);
- control, for a trainer driving the server (served when :func:`create_app` gets a ``control``, the
  engine): ``POST /pause`` (no further decode steps; requests in flight keep their place),
  ``POST /resume``, ``POST /update_weights`` with ``{"path": DIR, "version": N}`` (the ``*.safetensors``
  of ``DIR``, read without unpickling, applied between two decode steps; ``"adapter": NAME`` for a
  PEFT adapter directory on an engine serving adapters), ``GET /weight_version``;
- ``GET /sessions/{id}``: the session's ``prompt_ids``, ``response_ids``, ``logprobs``, ``loss_mask``
  (1 on sampled tokens), ``turns`` (recorded), ``masked_turns`` (off the record) and why
  (``off_record``), status and template drift; ``DELETE /sessions/{id}`` forgets it.

Requests that arrive together are sent to the engine as one ``generate`` call (continuous
batching inside the engine); each response is matched to its request by id.

Binding: 127.0.0.1 by default. Any address that is not loopback needs a token (environment
variable ``MILES_ROLLOUT_TOKEN``), checked on every endpoint as ``Authorization: Bearer <token>``;
without one the server refuses to start. With a token on loopback, it is checked too. The control
endpoints always need the admin token (``MILES_ROLLOUT_ADMIN_TOKEN``), and ``/update_weights`` reads
only directories under a ``--weights-dir``. The Host header, the body size (``--max-body-mb``, 8) and
the session table (``--max-sessions`` 4096, ``--session-ttl-s`` 3600) are checked as
:mod:`miles.agent.http_guard` describes.

Each request is checked on its own: a malformed one (a field of the wrong type or value, messages
that are not a list of ``{"role", "content"}`` objects, a session turn with nothing to answer) answers
400/409/410/422/429 with a ``detail`` naming the field, leaves its session as it was, and fails no
other request; if the engine refuses a batch, each of its requests is retried alone.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from miles.agent.http_guard import Guard, SessionTable
from miles.agent.server_requests import (
    assistant_message,
    chat_messages,
    check_messages,
    check_n,
    extend_session,
    off_record,
    sampling_params,
    to_request,
)
from miles.agent.session import Session, TemplateDriftError
from miles.agent.tools import special_token_strings
from miles.config.validate import ConfigError
from miles.rollout.requests import EngineLimits
from miles.types import GenerateRequest, GenerateResult, Status

TOKEN_ENV = "MILES_ROLLOUT_TOKEN"
ADMIN_TOKEN_ENV = "MILES_ROLLOUT_ADMIN_TOKEN"
SESSION_HEADER = "x-miles-session"
Generate = Callable[[GenerateRequest, "str | None"], Awaitable[list[GenerateResult]]]
_FINISH = {
    Status.COMPLETED: "stop",
    Status.TRUNCATED: "length",
    Status.ABORTED: "abort",
    Status.FAILED: "error",
}


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback ``host`` without a token (ConfigError says how to set one)."""
    if token:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"rollout server: binding to {host!r} (not loopback) needs a token; set the environment "
            f"variable {TOKEN_ENV} (clients send 'Authorization: Bearer <token>') or bind 127.0.0.1"
        )


class _Batcher:
    """Sends the requests queued while the engine was busy as one ``engine.generate`` call."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.queue: list[tuple[GenerateRequest, asyncio.Future]] = []
        self.running = False

    async def generate(self, request: GenerateRequest) -> list[GenerateResult]:
        future = asyncio.get_running_loop().create_future()
        self.queue.append((request, future))
        if not self.running:
            self.running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self.queue:
                batch, self.queue = self.queue, []
                try:
                    results = await asyncio.to_thread(self.engine.generate, [r for r, _ in batch])
                except Exception as e:
                    if len(batch) == 1:
                        batch[0][1].set_exception(e)
                        continue
                    for (
                        item
                    ) in batch:  # one request may be what the engine refused: each alone, failing only itself
                        await self._one(*item)
                    continue
                for request, future in batch:
                    future.set_result([r for r in results if r.request_id == request.request_id])
        finally:
            self.running = False

    async def _one(self, request: GenerateRequest, future: asyncio.Future) -> None:
        try:
            future.set_result(await asyncio.to_thread(self.engine.generate, [request]))
        except Exception as e:
            future.set_exception(e)


async def _generate_one(
    generate: Generate, request: GenerateRequest, session_id: str | None
) -> GenerateResult:
    """One result of ``generate``; an engine's ValueError (a request it refuses) answers 422."""
    try:
        (r,) = await generate(request, session_id)
    except ValueError as e:
        raise HTTPException(422, f"request {request.request_id!r}: {e}") from None
    return r


def load_weights_dir(path: str, adapter: str | None = None) -> dict[str, Any]:
    """The tensors of every ``*.safetensors`` file in ``path`` (safetensors only: nothing is unpickled);
    with ``adapter``, named as an adapter-only update of that adapter (:mod:`miles.adapters.lora`)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"path: no *.safetensors file in {path!r}")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    if adapter is not None:
        from miles.adapters.lora import SYNC_PREFIX

        state = {f"{SYNC_PREFIX}{adapter}:{k}": v for k, v in state.items()}
    return state


def engine_backend(engine: Any) -> tuple[Generate, Callable[[], int]]:
    """``(generate, weight_version)`` of :func:`create_app` for an in-process engine (batched calls)."""
    batcher = _Batcher(engine)

    async def generate(request: GenerateRequest, session_id: str | None) -> list[GenerateResult]:
        return await batcher.generate(request)

    return generate, engine.weight_version


def create_app(
    generate: Generate,
    tokenizer: Any,
    *,
    weight_version: Callable[[], int] = lambda: -1,
    token: str | None = None,
    admin_token: str | None = None,
    control: Any = None,
    limits: EngineLimits | None = None,
    weights_dirs: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
    max_body_bytes: int = 8 << 20,
    max_sessions: int = 4096,
    session_ttl_s: float = 3600.0,
) -> Any:
    """The FastAPI app. ``generate(request, session_id)`` completes one request (``session_id`` is the
    chat session's or None); the sessions are ``app.state.sessions`` (a :class:`SessionTable`).
    ``control``: an engine with ``pause``, ``resume`` and ``update_weights`` for the control endpoints
    (None: they answer 501); they need ``admin_token``, and ``/update_weights`` reads only directories
    under ``weights_dirs``. ``limits``: the engine's, to check each request against before it is queued
    (422 when it is wrong, failing no other request of its batch); None: the engine checks. The rest:
    :mod:`miles.agent.http_guard`."""
    app = FastAPI(title="miles rollout")
    ids = itertools.count()
    sessions = SessionTable(max_sessions=max_sessions, ttl_s=session_ttl_s)
    app.state.sessions = sessions
    busy: set[str | None] = set()
    specials = special_token_strings(tokenizer)  # broken in the text of every message but the assistant's
    roots = [os.path.realpath(d) for d in weights_dirs]
    app.add_middleware(
        Guard,
        token=token,
        admin_token=admin_token,
        max_body_bytes=max_body_bytes,
        allowed_hosts=tuple(allowed_hosts),
    )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": weight_version()}

    @app.post("/generate")
    async def generate_ids(body: dict[str, Any]) -> dict[str, Any]:
        input_ids = body.get("input_ids")
        if (
            not isinstance(input_ids, list)
            or not input_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids)
        ):
            raise HTTPException(422, "input_ids: a non-empty list of token ids is required")
        sampling = sampling_params(body.get("sampling_params", {}), max_key="max_new_tokens")
        request = to_request(f"gen-{next(ids)}", input_ids, sampling, limits=limits)
        r = await _generate_one(generate, request, None)
        return {
            "output_ids": list(r.response_ids),
            "text": tokenizer.decode(list(r.response_ids), skip_special_tokens=True),
            "meta_info": {
                "output_token_logprobs": list(r.logprobs),
                "finish_reason": r.finish_reason or _FINISH[r.status],
                "weight_version": r.weight_version,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(r.response_ids),
            },
        }

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any], request: Request) -> dict[str, Any]:
        check_n(body)
        messages = check_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise HTTPException(422, "tools: expected a list of tool objects")
        extra = {"tools": tools} if tools else {}
        session_id = body.get("session_id") or request.headers.get(SESSION_HEADER)
        if session_id is not None and (not isinstance(session_id, str) or len(session_id) > 256):
            raise HTTPException(422, "session_id: expected a string of at most 256 characters")
        sampling = sampling_params(body, max_key="max_tokens")
        if session_id is not None:
            if session_id in busy:
                raise HTTPException(
                    409, f"session {session_id!r} has a request in progress; send its turns one by one"
                )
            sessions.expire(busy)
            sessions.check(session_id)
        held = sessions.get(session_id) if session_id is not None else None
        added, unrecorded, why = False, None, None
        try:
            rendered = chat_messages(messages, specials)
            session = held or Session(tokenizer, rendered, render_kwargs=extra)
            if held is not None:
                why = off_record(held, messages, rendered)
                if why is None:
                    try:
                        added = extend_session(held, rendered)
                    except TemplateDriftError as e:
                        why = str(e)
                if why is not None:  # answered from a fresh rendering, never trained on
                    unrecorded = rendered
                    prompt = held.render_ids(unrecorded)
        except ValueError as e:
            raise HTTPException(409 if held is not None else 422, f"messages: {e}") from None
        except (KeyError, TypeError) as e:  # the chat template refused the messages
            raise HTTPException(
                422, f"messages: the chat template cannot render them ({type(e).__name__}: {e})"
            ) from None
        if unrecorded is None:
            prompt = list(session.ids)
        rid = f"chatcmpl-{next(ids)}"
        busy.add(session_id)
        try:
            request_ = to_request(rid, prompt, sampling, limits=limits, session_id=session_id)
            r = await _generate_one(generate, request_, session_id)
        except BaseException:
            if added:  # the session is left as it was before this request
                session.drop_last_turn()
            raise
        finally:
            busy.discard(session_id)
        text = session.add_policy(r) if unrecorded is None else session.add_unrecorded(unrecorded, r, why)
        message = assistant_message(text, rid)
        if session_id is not None and (held is None or session_id in sessions):  # not if ended meanwhile
            sessions.put(session_id, session)
        finish = "tool_calls" if "tool_calls" in message else _FINISH[r.status]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "session_id": session_id,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "prompt_token_ids": list(prompt),
                    "output_token_ids": list(r.response_ids),
                    "output_logprobs": list(r.logprobs),
                    "off_record": why,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(r.response_ids),
                "total_tokens": len(prompt) + len(r.response_ids),
            },
        }

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        check_n(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # the openai client sends one prompt of ids as [[...]]
        if isinstance(prompt, str) and prompt:
            prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            prompt_ids = prompt
        else:
            raise HTTPException(
                422, "prompt: a non-empty string or list of token ids is required (one prompt)"
            )
        rid = f"cmpl-{next(ids)}"
        sampling = sampling_params(body, max_key="max_tokens")
        r = await _generate_one(generate, to_request(rid, prompt_ids, sampling, limits=limits), None)
        tokens = [tokenizer.decode([t]) for t in r.response_ids]
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "text": tokenizer.decode(list(r.response_ids), skip_special_tokens=True),
                    "finish_reason": _FINISH[r.status],
                    "logprobs": {"tokens": tokens, "token_logprobs": list(r.logprobs)},
                    "prompt_token_ids": list(prompt_ids),
                    "output_token_ids": list(r.response_ids),
                    "output_logprobs": list(r.logprobs),
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(r.response_ids),
                "total_tokens": len(prompt_ids) + len(r.response_ids),
            },
        }

    def _control() -> Any:
        if control is None:
            raise HTTPException(501, "this server has no engine control (started without one)")
        return control

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        await asyncio.to_thread(_control().pause)
        return {"paused": True}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        await asyncio.to_thread(_control().resume)
        return {"paused": False}

    @app.get("/weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": weight_version()}

    @app.post("/update_weights")
    async def update_weights(body: dict[str, Any]) -> dict[str, Any]:
        engine = _control()
        path, version, adapter = body.get("path"), body.get("version"), body.get("adapter")
        if not isinstance(path, str) or isinstance(version, bool) or not isinstance(version, int):
            raise HTTPException(
                422, "update_weights: {'path': a directory of safetensors, 'version': int} required"
            )
        if adapter is not None and not isinstance(adapter, str):
            raise HTTPException(422, f"adapter: expected a string, got {adapter!r}")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in roots):
            raise HTTPException(
                403,
                f"update_weights: {path!r} is not under a directory this server loads weights "
                f"from ({', '.join(roots) or 'none configured'}; --weights-dir)",
            )
        try:
            state = await asyncio.to_thread(load_weights_dir, real, adapter)
            metrics = await asyncio.to_thread(engine.update_weights, state, version)
        except (ValueError, OSError) as e:
            raise HTTPException(422, f"update_weights: {e}") from None
        return {"weight_version": weight_version(), **metrics}

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        session = sessions.get(session_id)
        if session is None:
            sessions.check(session_id)  # 410 when it expired
            raise HTTPException(404, f"no session {session_id!r}")
        drift = session.drift()
        return {
            "prompt_ids": session.prompt_ids,
            "response_ids": session.response_ids,
            "logprobs": session.logprobs,
            "loss_mask": session.loss_mask,
            "turns": session.policy_turns,
            "masked_turns": session.masked_turns,
            "off_record": session.off_record,
            "status": session.status.value,
            "weight_version": session.weight_version,
            "drift": None if drift is None else drift.describe(tokenizer),
        }

    @app.delete("/sessions/{session_id}")
    async def end_session(session_id: str) -> dict[str, Any]:
        return {"ended": sessions.pop(session_id, None) is not None}

    return app


def main(argv: list[str] | None = None) -> None:
    """Load a checkpoint into an in-process TorchEngine and serve it (see the module docstring)."""
    import uvicorn
    from transformers import AutoTokenizer

    from miles.config.schema import PrecisionConfig
    from miles.rollout.torch_engine import TorchEngine

    parser = argparse.ArgumentParser(
        prog="miles rollout", description="Serve a checkpoint's engine over HTTP."
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-body-mb", type=float, default=8.0, help="request body limit (413 past it)")
    parser.add_argument(
        "--max-sessions", type=int, default=4096, help="chat sessions held at once (429 past it)"
    )
    parser.add_argument(
        "--session-ttl-s", type=float, default=3600.0, help="idle seconds before a session is dropped"
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="another Host header name to answer to (loopback names and --host always are)",
    )
    parser.add_argument(
        "--weights-dir",
        action="append",
        default=[],
        help="a directory /update_weights may load from (repeatable; none: it loads nothing)",
    )
    args = parser.parse_args(argv)
    if args.max_body_mb <= 0 or args.max_sessions <= 0 or args.session_ttl_s <= 0:
        parser.error("--max-body-mb, --max-sessions and --session-ttl-s must be > 0")
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token)
    engine = TorchEngine(args.checkpoint, PrecisionConfig())
    generate, version = engine_backend(engine)
    app = create_app(
        generate,
        AutoTokenizer.from_pretrained(args.checkpoint),
        weight_version=version,
        token=token,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
        control=engine,
        limits=engine.limits,
        weights_dirs=args.weights_dir,
        allowed_hosts=[args.host, *args.allowed_host],
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl_s,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
