"""``python -m miles.agent.server CHECKPOINT``: a rollout engine over HTTP (FastAPI + uvicorn).

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

Requests that arrive together are sent to the engine as one ``generate`` call (continuous
batching inside the engine); each response is matched to its request by id.

Binding: 127.0.0.1 by default. Any address that is not loopback needs a token (environment
variable ``MILES_ROLLOUT_TOKEN``), checked on every endpoint as ``Authorization: Bearer <token>``;
without one the server refuses to start. With a token on loopback, it is checked too.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import itertools
import json
import os
import time
from typing import Any

from miles.agent.tools import parse_tool_calls
from miles.config.validate import ConfigError
from miles.types import GenerateRequest, GenerateResult, SamplingParams, Status

TOKEN_ENV = "MILES_ROLLOUT_TOKEN"
_FINISH = {Status.COMPLETED: "stop", Status.TRUNCATED: "length", Status.ABORTED: "abort", Status.FAILED: "error"}


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback ``host`` without a token (ConfigError says how to set one)."""
    if token:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(f"rollout server: binding to {host!r} (not loopback) needs a token; set the environment "
                          f"variable {TOKEN_ENV} (clients send 'Authorization: Bearer <token>') or bind 127.0.0.1")


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
                    for _, f in batch:
                        f.set_exception(e)
                    continue
                for request, future in batch:
                    future.set_result([r for r in results if r.request_id == request.request_id])
        finally:
            self.running = False


def _sampling(body: dict[str, Any], *, max_key: str) -> SamplingParams:
    max_new = body.get(max_key) or body.get("max_completion_tokens") or 256
    return SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                          top_k=int(body.get("top_k", 0)), max_new_tokens=int(max_new),
                          greedy=float(body.get("temperature", 1.0)) == 0.0, seed=body.get("seed"))


def assistant_message(text: str, call_id_prefix: str) -> dict[str, Any]:
    """An OpenAI assistant message: ``content`` is the text before the first ``<tool_call>`` when the
    text has well-formed calls (then listed in ``tool_calls``, arguments JSON-encoded), else the text."""
    calls, _ = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text.split("<tool_call>")[0].strip() or None,
            "tool_calls": [{"id": f"call_{call_id_prefix}_{i}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for i, c in enumerate(calls)]}


def create_app(engine: Any, tokenizer: Any, *, token: str | None = None) -> Any:
    """The FastAPI app over ``engine`` (a :class:`miles.backends.RolloutEngine`, called in-process)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="miles rollout")
    batcher, ids = _Batcher(engine), itertools.count()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if token and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.weight_version()}

    @app.post("/generate")
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        input_ids = body.get("input_ids")
        if not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise HTTPException(422, "input_ids: a non-empty list of token ids is required")
        sampling = _sampling(body.get("sampling_params", {}), max_key="max_new_tokens")
        (r,) = await batcher.generate(GenerateRequest(request_id=f"gen-{next(ids)}", prompt_ids=tuple(input_ids),
                                                      sampling=sampling))
        return {"output_ids": list(r.response_ids),
                "text": tokenizer.decode(list(r.response_ids), skip_special_tokens=True),
                "meta_info": {"output_token_logprobs": list(r.logprobs), "finish_reason": r.finish_reason or
                              _FINISH[r.status], "weight_version": r.weight_version,
                              "prompt_tokens": len(input_ids), "completion_tokens": len(r.response_ids)}}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        if int(body.get("n", 1)) != 1:
            raise HTTPException(422, "n: only 1 is supported")
        extra = {"tools": body["tools"]} if body.get("tools") else {}
        try:
            prompt = tokenizer.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True,
                                                   return_dict=False, **extra)
        except Exception as e:
            raise HTTPException(422, f"messages: the chat template could not render them ({e})") from None
        rid = f"chatcmpl-{next(ids)}"
        (r,) = await batcher.generate(GenerateRequest(request_id=rid, prompt_ids=tuple(prompt),
                                                      sampling=_sampling(body, max_key="max_tokens")))
        message = assistant_message(tokenizer.decode(list(r.response_ids), skip_special_tokens=True), rid)
        finish = "tool_calls" if "tool_calls" in message else _FINISH[r.status]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": body.get("model", ""),
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "prompt_token_ids": list(prompt), "output_token_ids": list(r.response_ids),
                             "output_logprobs": list(r.logprobs)}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(r.response_ids),
                          "total_tokens": len(prompt) + len(r.response_ids)}}

    return app


def main(argv: list[str] | None = None) -> None:
    """Load a checkpoint into an in-process TorchEngine and serve it (see the module docstring)."""
    import uvicorn
    from transformers import AutoTokenizer

    from miles.config.schema import PrecisionConfig
    from miles.rollout.torch_engine import TorchEngine

    parser = argparse.ArgumentParser(prog="python -m miles.agent.server", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    args = parser.parse_args(argv)
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token)
    engine = TorchEngine(args.checkpoint, PrecisionConfig())
    app = create_app(engine, AutoTokenizer.from_pretrained(args.checkpoint), token=token)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
