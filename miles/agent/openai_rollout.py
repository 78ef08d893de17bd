"""Agent code written against the official ``openai`` client as ``rollout.generate_fn``.

::

    rollout:
      generate_fn:
        _target_: miles.agent.openai_rollout.openai_agent
        _partial_: true
        agent: {_target_: my_agents.solve, _partial_: true}   # solve(client, prompt) -> None

The first call starts one rollout server (:mod:`miles.agent.server`) for the process, on
127.0.0.1 and an ephemeral port, in a daemon thread, with a random bearer token. For each of the
``ctx.n`` samples the agent runs in a worker thread with an ``openai.OpenAI`` client whose
``base_url`` is that server and whose every request carries the sample's session id (header
``X-Miles-Session``): a ``with_options`` copy of one client the server builds once, so every
sample shares its HTTP connection pool. The agent just calls
``client.chat.completions.create(messages=...)`` as often as it likes. The server keeps each
conversation as a :class:`miles.agent.session.Session` and sends each turn to this rollout's engines through ``ctx.engine_generate`` (load-balanced,
deadline-bounded and retried by the manager), with the run's sampling parameters (the request's
``temperature`` and ``max_tokens`` are ignored: the log-probs must be the policy's). When the agent
returns, the session becomes the sample: the sampled ids with loss mask 1 and log-probs, the
messages the agent added between turns with loss mask 0, ``response_text`` the last reply.

The sample's ``metadata["counts"]`` (summed into ``rollout/agent/*``, and read by
:func:`miles.agent.rewards.tool_answer_reward`) are :func:`tool_counts` of the session: ``agent/turns``,
``agent/turns_masked`` (turns off the record, see :mod:`miles.agent.server`: their tokens are not in the
sample), ``agent/template_drift`` (1 when the sample's ids differ from a re-rendering of its messages, or a
turn was off the record), ``agent/tool_malformed`` (malformed ``<tool_call>`` blocks in the policy's
finished turns), ``agent/tool_calls`` (well-formed calls the agent answered with a ``tool`` message) and
``agent/tool_calls_ok``, the same calls: the agent runs its tools itself, and an OpenAI ``tool`` message
carries no error flag, so the server cannot tell a tool that failed from one that worked.

The HTTP client's own per-request INFO lines are silenced (:data:`HTTP_CLIENT_LOGGERS`).

An agent that raises, or returns without a single call, fails the group (the manager records it as
FAILED with the reason). The agent's own deadline is ``timeout_s`` (default 600 s); past it the
group fails too (its thread cannot be stopped; it is left to finish on its own).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from miles.agent.server import SESSION_HEADER, create_app
from miles.agent.session import Session
from miles.agent.tools import parse_tool_calls, run_in_daemon_thread
from miles.rollout.generate import GenerateContext
from miles.types import GenerateRequest, GenerateResult, Problem, Sample, SamplingParams, Status

HTTP_CLIENT_LOGGERS = ("httpx", "httpx2")
"""Loggers of the HTTP libraries under the ``openai`` client, which log every request at INFO (hundreds
of lines a step): set to WARNING when the server starts, unless a level was already set for them."""


@dataclass
class _Route:
    ctx: GenerateContext
    index: int
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop


class _Server:
    """The process's rollout server and the routes from session ids to the rollouts that own them."""

    def __init__(self, tokenizer: Any) -> None:
        import openai
        import uvicorn

        self.routes: dict[str, _Route] = {}
        self.token = secrets.token_urlsafe(16)
        self.app = create_app(self._generate, tokenizer, token=self.token)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        threading.Thread(target=self.server.run, name="miles-agent-server", daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("openai_agent: the rollout server did not start within 30 s")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self._client = openai.OpenAI(base_url=self.base_url, api_key=self.token, max_retries=0)
        for name in HTTP_CLIENT_LOGGERS:
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)

    def client(self, session_id: str) -> Any:
        """An ``openai.OpenAI`` client for one session: a copy of the server's client (the same HTTP
        connection pool) whose requests carry ``session_id``."""
        return self._client.with_options(default_headers={SESSION_HEADER: session_id})

    async def _generate(self, request: GenerateRequest, session_id: str | None) -> list[GenerateResult]:
        route = self.routes.get(session_id or "")
        if route is None:
            raise RuntimeError(f"no rollout owns session {session_id!r} (send the {SESSION_HEADER} header)")
        # a seed per sample and turn: the group's seed, the sample's index, the context length
        seed = route.ctx.seed + 1_000_003 * route.index + len(request.prompt_ids)
        request = replace(request, sampling=None, seed=seed)
        future = asyncio.run_coroutine_threadsafe(route.ctx.engine_generate(request, route.sampling), route.loop)
        return await asyncio.wrap_future(future)


def tool_counts(session: Session) -> dict[str, int]:
    """The session's counts (module docstring). A policy turn's well-formed calls count as answered as far as
    the turn after it holds ``<tool_response>`` blocks (the agent's ``tool`` messages, in order); the last
    turn is parsed for malformed blocks only when it finished (a turn cut off at ``max_tokens`` is not)."""
    counts = {"agent/turns": session.policy_turns + session.masked_turns, "agent/turns_masked": session.masked_turns,
              "agent/template_drift": int(session.masked_turns > 0 or session.drift() is not None),
              "agent/tool_calls": 0, "agent/tool_calls_ok": 0, "agent/tool_malformed": 0}
    messages = session.messages
    for k in session.policy_messages:
        last = k == len(messages) - 1
        calls, errors = parse_tool_calls(messages[k]["content"])
        if not last or session.status is Status.COMPLETED:
            counts["agent/tool_malformed"] += len(errors)
        if not last and messages[k + 1]["role"] == "user":
            answered = min(len(calls), messages[k + 1]["content"].count("<tool_response>"))
            counts["agent/tool_calls"] += answered
            counts["agent/tool_calls_ok"] += answered
    return counts


_servers: dict[int, _Server] = {}
_lock = threading.Lock()


def _server_for(tokenizer: Any) -> _Server:
    with _lock:
        if id(tokenizer) not in _servers:
            _servers[id(tokenizer)] = _Server(tokenizer)
        return _servers[id(tokenizer)]


@dataclass(frozen=True)
class SessionEndpoint:
    """Where one sample's agent sends its turns: the rollout server's ``base_url``, its bearer ``token``, and
    the ``headers`` that name the sample's session (:data:`SESSION_HEADER`)."""

    base_url: str
    token: str
    session_id: str
    _server: _Server

    @property
    def headers(self) -> dict[str, str]:
        return {SESSION_HEADER: self.session_id}

    def client(self) -> Any:
        """An ``openai.OpenAI`` client for this session (:meth:`_Server.client`)."""
        return self._server.client(self.session_id)


async def session_samples(
    ctx: GenerateContext, problem: Problem, sampling: SamplingParams,
    play: Callable[[int, SessionEndpoint], Awaitable[dict[str, Any] | None]], *, timeout_s: float, who: str,
) -> list[Sample]:
    """The ``ctx.n`` samples of one prompt, each the session of one ``play(index, endpoint)``: whatever sends
    that session's turns to the rollout server (an agent in a thread, an environment's runner). What ``play``
    returns is added to the sample's metadata (an environment's reward: ``env_reward``)."""
    server = _server_for(ctx.tokenizer)
    loop = asyncio.get_running_loop()

    async def one(index: int) -> Sample:
        session_id = f"{ctx.group_id}-{index}-{secrets.token_hex(4)}"
        server.routes[session_id] = _Route(ctx, index, sampling, loop)
        try:
            extra = await asyncio.wait_for(play(index, SessionEndpoint(server.base_url, server.token, session_id,
                                                                       server)), timeout=timeout_s)
        finally:
            server.routes.pop(session_id, None)
            session = server.app.state.sessions.pop(session_id, None)
        if session is None or session.policy_turns == 0:
            raise RuntimeError(f"{who} returned without calling client.chat.completions.create")
        last = session.messages[-1]["content"] if session.messages[-1]["role"] == "assistant" else ""
        return Sample(group_id=ctx.group_id, index=index, prompt_ids=list(session.prompt_ids),
                      response_ids=list(session.response_ids), rollout_logprobs=list(session.logprobs),
                      loss_mask=list(session.loss_mask), status=session.status,
                      weight_version=session.weight_version, label=problem.label, response_text=last,
                      metadata={"counts": tool_counts(session)} | dict(extra or {}))

    return list(await asyncio.gather(*(one(i) for i in range(ctx.n))))


async def openai_agent(
    ctx: GenerateContext, problem: Problem, sampling: SamplingParams, *, agent: Callable[[Any, str], Any],
    timeout_s: float = 600.0,
) -> list[Sample]:
    """The ``ctx.n`` samples of one prompt, each one run of ``agent(client, prompt)`` (see the module docstring)."""

    async def play(index: int, endpoint: SessionEndpoint) -> None:
        await run_in_daemon_thread(agent, endpoint.client(), problem.prompt)

    return await session_samples(ctx, problem, sampling, play, timeout_s=timeout_s,
                                 who=f"agent {getattr(agent, '__name__', agent)!r}")
