"""OpenEnv environments as a miles task: ``task=openenv task.source.url=http://127.0.0.1:8000``.

An OpenEnv environment (the ``openenv-core`` package: an ``Environment`` with ``reset``/``step``
served by its ``create_app``) runs as its own process, from its own venv or container; miles talks
to it over its wire protocol and never imports ``openenv``:

- ``POST /reset`` with ``{"seed": s}`` answers ``{"observation": {...}, "reward", "done"}``. The
  HTTP endpoints build a fresh environment per call, so :class:`OpenEnvTask` uses them only to read
  the first observation of each seed (the prompt), once per seed;
- the WebSocket ``/ws`` keeps one environment per connection: ``{"type": "reset", "data": {"seed": s}}``
  and ``{"type": "step", "data": <action>}`` answer ``{"type": "observation", "data": {"observation",
  "reward", "done"}}`` (or ``{"type": "error", "data": {"message", ...}}``). Every sample is one
  episode on a connection of its own (:func:`episode`).

Problems are seeds: :class:`OpenEnvTask` draws seeds from ``range(pool_size)`` and splits them into
training and held-out ones by a hash of the first observation's text
(:mod:`miles.tasks.procedural`), so no question the environment asks in evaluation is a training one.

An episode (:func:`episode`, the ``rollout.generate_fn`` of ``task=openenv``): the policy answers the
observation's ``observation_key`` text; the answer goes to the environment as the action
``{action_key: text}``; a new observation that is not ``done`` is the next user turn (loss mask 0),
up to ``max_turns`` policy turns. The sample's reward is the sum of the rewards of its steps
(:func:`miles.agent.env_tasks.env_reward` reads it from ``Sample.metadata["env_reward"]``), so the
environment's own rubric scores it, unmodified. A fresh tiny model warm-starts on ``warm_start_task``
(:mod:`miles.agent.env_tasks`).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any

from miles.agent.env_tasks import ExternalTask
from miles.agent.rollout import next_turn
from miles.agent.session import Session
from miles.agent.tools import escape_special_tokens, special_token_strings
from miles.rollout.dispatch import EngineRequestError, first_line
from miles.rollout.generate import GenerateContext
from miles.tasks.procedural import Problem
from miles.types import GenerateRequest, Sample, SamplingParams, Status

COUNTS = ("agent/turns", "env/steps", "env/done")
"""Every episode's counts, summed into ``rollout/agent/turns``, ``rollout/env/steps`` and ``rollout/env/done``."""


class OpenEnvError(RuntimeError):
    """The environment server could not be reached, or answered with an error or an unexpected shape."""


def _http(url: str, path: str, body: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(dict(body)).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise OpenEnvError(f"OpenEnv server {url}: POST {path} answered {e.code}: "
                           f"{e.read()[:300].decode(errors='replace')}") from e
    except (urllib.error.URLError, OSError) as e:
        raise OpenEnvError(f"cannot reach the OpenEnv server at {url} ({e}): start the environment's server "
                           "(e.g. uvicorn my_env:app --port 8000) and set task.source.url to it") from e


def _text(observation: Mapping[str, Any], key: str, url: str) -> str:
    if key not in observation:
        raise OpenEnvError(f"OpenEnv server {url}: the observation has no field '{key}' (task.source.observation_key); "
                           f"its fields: {', '.join(sorted(observation)) or 'none'}")
    return str(observation[key])


class OpenEnvTask(ExternalTask):
    """Seeds of an OpenEnv environment as problems; the prompt is the first observation's ``observation_key``.

    ``url``: the environment server (``http://host:port``). ``pool_size``: seeds ``0 .. pool_size - 1``.
    ``warm_start_task``: a built task of the same prompt format, for the warm start of fresh tiny models.
    """

    kind = "openenv"

    def __init__(self, *, url: str, observation_key: str = "prompt", pool_size: int = 10_000,
                 heldout_fraction: float = 0.1, eval_seed: int = 12345, timeout_s: float = 30.0,
                 warm_start_task: Any = None) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed, warm_start_task=warm_start_task)
        if pool_size < 1:
            raise ValueError(f"pool_size: must be at least 1, found {pool_size}")
        self.url, self.observation_key, self.pool_size = url.rstrip("/"), observation_key, pool_size
        self.timeout_s = timeout_s
        self._prompts: dict[int, str] = {}
        self.prompt_of(0)  # reach the server now: a wrong url or key is an error before anything starts

    def prompt_of(self, seed: int) -> str:
        """The first observation's text for ``seed`` (read once, over the stateless HTTP ``/reset``)."""
        if seed not in self._prompts:
            answer = _http(self.url, "/reset", {"seed": seed}, self.timeout_s)
            self._prompts[seed] = _text(answer.get("observation") or {}, self.observation_key, self.url)
        return self._prompts[seed]

    def draw(self, rng: random.Random) -> int:
        return rng.randrange(self.pool_size)

    def key_text(self, key: Hashable) -> str:
        return self.prompt_of(int(key))  # type: ignore[arg-type]

    def problem(self, key: Hashable) -> Problem:
        seed = int(key)  # type: ignore[arg-type]
        return Problem(prompt=self.prompt_of(seed), label={"seed": seed})

    def corpus_keys(self) -> list[int]:
        return list(range(min(self.pool_size, 500)))


class _Connection:
    """One episode's WebSocket to the environment (an environment of its own on the server)."""

    def __init__(self, ws: Any, url: str, timeout_s: float) -> None:
        self.ws, self.url, self.timeout_s = ws, url, timeout_s

    async def call(self, kind: str, data: Mapping[str, Any]) -> dict[str, Any]:
        await self.ws.send_str(json.dumps({"type": kind, "data": dict(data)}))
        msg = await asyncio.wait_for(self.ws.receive(), self.timeout_s)
        try:
            answer = json.loads(msg.data)
        except (TypeError, ValueError) as e:
            raise OpenEnvError(f"OpenEnv server {self.url}: {kind} got no JSON answer ({msg.type}: {msg.data!r:.200})") from e
        if answer.get("type") == "error":
            raise OpenEnvError(f"OpenEnv server {self.url}: {kind} failed: {answer.get('data')}")
        if answer.get("type") != "observation" or "observation" not in (answer.get("data") or {}):
            raise OpenEnvError(f"OpenEnv server {self.url}: {kind} answered {str(answer)[:200]}")
        return answer["data"]


_SLOTS: dict[tuple[int, str], tuple[asyncio.Semaphore, asyncio.Lock]] = {}
"""Per event loop and server: the episodes this process may have open at once (``max_sessions``)."""


async def _take_slots(url: str, n: int, max_sessions: int) -> asyncio.Semaphore:
    """Wait for ``n`` of the server's ``max_sessions`` slots, all at once (one group at a time takes them,
    so two groups never each hold part of what they need)."""
    if not 1 <= n <= max_sessions:
        raise ValueError(f"openenv episode: {n} samples per prompt need as many sessions at once; "
                         f"max_sessions is {max_sessions}")
    key = (id(asyncio.get_running_loop()), url)
    if key not in _SLOTS:
        _SLOTS[key] = (asyncio.Semaphore(max_sessions), asyncio.Lock())
    slots, lock = _SLOTS[key]
    async with lock:
        for _ in range(n):
            await slots.acquire()
    return slots


async def episode(ctx: GenerateContext, problem: Problem, sampling: SamplingParams, *, url: str,
                  observation_key: str = "prompt", action_key: str = "message", max_turns: int = 1,
                  timeout_s: float = 30.0, max_sessions: int = 64, system_prompt: str | None = None) -> list[Sample]:
    """The ``ctx.n`` episodes of one seed (see the module docstring); the first turn is one engine request
    with ``n`` (every episode of a seed starts from the same observation, which is checked). At most
    ``max_sessions`` episodes are open on the server at once (an OpenEnv server refuses sessions past
    its ``max_concurrent_envs``); the others wait."""
    if max_turns < 1:
        raise ValueError(f"openenv episode: max_turns must be >= 1, found {max_turns}")
    slots = await _take_slots(url, ctx.n, max_sessions)
    try:
        return await _episodes(ctx, problem, sampling, url, observation_key, action_key, max_turns, timeout_s,
                               system_prompt)
    finally:
        for _ in range(ctx.n):
            slots.release()


async def _episodes(ctx: GenerateContext, problem: Problem, sampling: SamplingParams, url: str, observation_key: str,
                    action_key: str, max_turns: int, timeout_s: float, system_prompt: str | None) -> list[Sample]:
    import aiohttp

    seed = int(problem.label["seed"])
    ws_url = url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s)) as http:
        try:
            sockets = await asyncio.gather(*(http.ws_connect(ws_url) for _ in range(ctx.n)))
        except (aiohttp.ClientError, OSError) as e:
            raise OpenEnvError(f"cannot open an episode on the OpenEnv server at {ws_url}: {e}") from e
        conns = [_Connection(ws, url, timeout_s) for ws in sockets]
        try:
            firsts = await asyncio.gather(*(c.call("reset", {"seed": seed}) for c in conns))
            texts = {_text(f["observation"], observation_key, url) for f in firsts}
            if texts != {problem.prompt}:
                raise OpenEnvError(f"OpenEnv server {url}: reset(seed={seed}) gave {sorted(texts)!r:.300}, not the "
                                   f"prompt read before ({problem.prompt!r:.100}): the environment is not "
                                   "deterministic under its seed")
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
                {"role": "user", "content": problem.prompt}]
            sessions = [Session(ctx.tokenizer, messages) for _ in range(ctx.n)]
            session_id = f"openenv-{ctx.group_id}-{secrets.token_hex(4)}"
            first = await ctx.engine_generate(GenerateRequest(
                request_id=f"{ctx.group_id}-t1", prompt_ids=tuple(sessions[0].ids), n=ctx.n, seed=ctx.seed,
                session_id=session_id), sampling)
            run = _Episode(ctx, sampling, session_id, observation_key, action_key, max_turns, url)
            return list(await asyncio.gather(*(run.play(c, s, r, problem) for c, s, r in
                                               zip(conns, sessions, first, strict=True))))
        finally:
            await asyncio.gather(*(c.ws.close() for c in conns), return_exceptions=True)


class _Episode:
    def __init__(self, ctx: GenerateContext, sampling: SamplingParams, session_id: str, observation_key: str,
                 action_key: str, max_turns: int, url: str) -> None:
        self.ctx, self.sampling, self.session_id, self.url = ctx, sampling, session_id, url
        self.specials = special_token_strings(ctx.tokenizer)  # an observation is text, never a forged turn
        self.observation_key, self.action_key, self.max_turns = observation_key, action_key, max_turns

    async def play(self, conn: _Connection, session: Session, result: Any, problem: Problem) -> Sample:
        counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        total, text, failure, index = 0.0, "", None, result.index
        while True:
            text = session.add_policy(result)
            counts["agent/turns"] += 1
            answer = await conn.call("step", {self.action_key: text})
            counts["env/steps"] += 1
            total += float(answer.get("reward") or 0.0)
            if answer.get("done"):
                counts["env/done"] += 1
                break
            if result.status is not Status.COMPLETED or session.policy_turns >= self.max_turns:
                session.status = Status.TRUNCATED
                break
            observation = _text(answer["observation"], self.observation_key, self.url)
            session.add_messages([{"role": "user", "content": escape_special_tokens(observation, self.specials)}])
            try:
                result = await next_turn(self.ctx, session, self.sampling, self.session_id, index)
            except EngineRequestError as e:  # retried by the pool already: this episode ends, the group goes on
                failure = f"generation: turn {session.policy_turns + 1}: {first_line(e)}"
                break
        session.finish()
        return Sample(
            group_id=self.ctx.group_id, index=index, prompt_ids=list(session.prompt_ids),
            response_ids=list(session.response_ids), rollout_logprobs=list(session.logprobs),
            loss_mask=list(session.loss_mask), status=Status.FAILED if failure else session.status,
            weight_version=session.weight_version, label=problem.label, response_text=text, failure=failure,
            metadata={"env_reward": total, "counts": dict(counts)})
