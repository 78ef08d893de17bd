"""verifiers environments as a miles task: ``task=verifiers task.source.env=<taskset id>``.

A verifiers environment (the ``verifiers`` package, ``verifiers.v1``: a ``Taskset`` of tasks with their
rewards, played by a harness) runs unmodified in verifiers' own venv (scripts/setup_verifiers.sh): miles
starts :mod:`miles.agent.verifiers_side.runner` there, one process per environment, and talks to it in
JSON lines over its stdin and stdout; miles itself never imports verifiers.

- **Problems are the taskset's tasks** (:class:`VerifiersTask`): the runner lists their prompts once, and
  they are split into training and held-out ones by a hash of the prompt text.
- **Each sample is one episode** (:func:`episode`, the ``rollout.generate_fn`` of ``task=verifiers``): the
  runner plays the task with miles' harness (``miles_chat``: one chat-completions call, made in process),
  and every model call of the episode goes, through verifiers' interception server, to the
  run's rollout server (:mod:`miles.agent.openai_rollout`) with the sample's session header. The server
  records the tokens the engines sampled, so the sample is exactly what was generated; the reward is the
  trace's (the sum of the taskset's rewards), read by :func:`miles.agent.env_tasks.env_reward`.
- An episode the runner reports as failed (the harness or a reward raised) fails its group, with the
  runner's reason. A runner that does not start, or dies, is an error naming its venv and its stderr;
  the episodes it was playing fail their groups with that error, and the next episode starts a new
  runner.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.agent.env_tasks import ExternalTask
from miles.agent.openai_rollout import SessionEndpoint, session_samples
from miles.rollout.generate import GenerateContext
from miles.tasks.procedural import Problem
from miles.types import Sample, SamplingParams

RUNNER = Path(__file__).resolve().parent / "verifiers_side" / "runner.py"
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-verifiers"


class VerifiersError(RuntimeError):
    """The verifiers runner could not start, died, or answered with something else than the protocol."""


def find_python(python: str | None = None) -> Path:
    """verifiers' venv: ``python``, else ``$MILES_VERIFIERS_PYTHON``, else ``<repo>/.venv-verifiers``."""
    path = Path(python or os.environ.get("MILES_VERIFIERS_PYTHON") or DEFAULT_VENV / "bin" / "python")
    if not path.exists():
        raise FileNotFoundError(f"verifiers' python {path} is missing: run scripts/setup_verifiers.sh, or set "
                                "task.source.python (or MILES_VERIFIERS_PYTHON) to a python with verifiers installed")
    return path


class _Runner:
    """One runner process: a thread reads its answer lines; ``run`` answers come back to the asyncio loop
    that asked, in any order, by their ids."""

    def __init__(self, python: Path, config: Mapping[str, Any], start_timeout_s: float) -> None:
        self.config = dict(config)
        self.proc = subprocess.Popen([str(python), str(RUNNER), json.dumps(self.config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self._stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True, name="miles-verifiers-stderr").start()
        self._write_lock = threading.Lock()
        self._lines: list[dict] = []
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count()
        self._dead: str | None = None
        threading.Thread(target=self._read, daemon=True, name="miles-verifiers-stdout").start()
        ready = self._next_line(start_timeout_s, "start")
        if not ready.get("ready"):
            raise VerifiersError(f"verifiers runner: expected its ready line, got {str(ready)[:300]}")
        self.num_tasks = int(ready["tasks"])

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr = (self._stderr + [line])[-40:]

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if "id" in answer and answer["id"] in self._pending:
                loop, future = self._pending.pop(answer["id"])
                loop.call_soon_threadsafe(lambda f=future, a=answer: f.done() or f.set_result(a))
                continue
            with self._cond:
                self._lines.append(answer)
                self._cond.notify_all()
        lines = [line.strip() for line in self._stderr if line.strip()]
        self._dead = (f"the verifiers runner exited ({self.proc.wait()}): {lines[-1] if lines else 'no output'}"
                      f"{' (its stderr ends: ' + ' | '.join(lines[-6:-1]) + ')' if len(lines) > 1 else ''}")
        for loop, future in list(self._pending.values()):
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(VerifiersError(self._dead)))
        with self._cond:
            self._cond.notify_all()

    def _next_line(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._lines:
                if self._dead:
                    raise VerifiersError(f"{what}: {self._dead}")
                if not self._cond.wait(timeout=max(deadline - time.monotonic(), 0)) and time.monotonic() >= deadline:
                    raise VerifiersError(f"{what}: the verifiers runner did not answer within {timeout_s:.0f} s; its "
                                         f"stderr: {''.join(self._stderr)[-1500:]}")
            return self._lines.pop(0)

    def _send(self, request: Mapping[str, Any]) -> None:
        if self._dead:
            raise VerifiersError(self._dead)
        try:
            with self._write_lock:
                self.proc.stdin.write(json.dumps(dict(request)) + "\n")
                self.proc.stdin.flush()
        except OSError as e:  # it died since: its reader thread is about to say how
            raise VerifiersError(self._dead or f"the verifiers runner's input is closed ({e})") from None

    def prompts(self, timeout_s: float) -> list[str]:
        self._send({"op": "tasks"})
        return list(self._next_line(timeout_s, "listing the tasks")["tasks"])

    async def run(self, task: int, endpoint: SessionEndpoint, timeout_s: float) -> dict[str, Any]:
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (asyncio.get_running_loop(), future)
        try:
            self._send({"op": "run", "id": request_id, "task": task, "base_url": endpoint.base_url,
                        "api_key": endpoint.token, "headers": endpoint.headers, "timeout_s": timeout_s})
        except VerifiersError:
            self._pending.pop(request_id, None)
            raise
        return await future

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_runners: dict[str, _Runner] = {}
_runners_lock = threading.Lock()


def runner_for(env: str, args: Mapping[str, Any] | None = None, paths: Sequence[str] = (),
               python: str | None = None, start_timeout_s: float = 300.0) -> _Runner:
    """The process's runner for this environment (one per distinct configuration, started on first use)."""
    config = {"taskset": {"id": env, **dict(args or {})}, "paths": [str(Path(p).resolve()) for p in paths]}
    key = json.dumps(config, sort_keys=True) + str(python)
    with _runners_lock:
        runner = _runners.get(key)
        if runner is None or runner._dead:
            runner = _runners[key] = _Runner(find_python(python), config, start_timeout_s)
        return runner


def close_runners() -> None:
    with _runners_lock:
        for runner in _runners.values():
            runner.close()
        _runners.clear()


class VerifiersTask(ExternalTask):
    """The tasks of a verifiers taskset as problems (module docstring).

    ``env``: the taskset's id; ``args``: its config's fields; ``paths``: directories its module is found in;
    ``python``: verifiers' venv (:func:`find_python`).
    """

    kind = "verifiers"

    def __init__(self, *, env: str, args: Mapping[str, Any] | None = None, paths: Sequence[str] = (),
                 python: str | None = None, heldout_fraction: float = 0.1,
                 eval_seed: int = 12345, timeout_s: float = 300.0, warm_start_task: Any = None) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed, warm_start_task=warm_start_task)
        runner = runner_for(env, args, paths, python, timeout_s)
        self.prompts = runner.prompts(timeout_s)
        if not self.prompts:
            raise ValueError(f"task.source.env={env}: the taskset has no tasks")

    def draw(self, rng: random.Random) -> int:
        return rng.randrange(len(self.prompts))

    def key_text(self, key: Hashable) -> str:
        return self.prompts[int(key)]  # type: ignore[arg-type]

    def problem(self, key: Hashable) -> Problem:
        return Problem(prompt=self.prompts[int(key)], label={"task": int(key)})  # type: ignore[arg-type]

    def corpus_keys(self) -> list[int]:
        return list(range(min(len(self.prompts), 500)))


async def episode(ctx: GenerateContext, problem: Problem, sampling: SamplingParams, *, env: str,
                  args: Mapping[str, Any] | None = None, paths: Sequence[str] = (), python: str | None = None,
                  timeout_s: float = 300.0) -> list[Sample]:
    """The ``ctx.n`` episodes of one task, played by the runner against the rollout server (module docstring)."""
    runner = await asyncio.to_thread(runner_for, env, args, paths, python, timeout_s)
    task = int(problem.label["task"])

    async def play(index: int, endpoint: SessionEndpoint) -> dict[str, Any]:
        answer = await runner.run(task, endpoint, timeout_s)
        if not answer.get("ok"):
            raise VerifiersError(f"verifiers episode of task {task}: {answer.get('error')}")
        return {"env_reward": float(answer["reward"])}

    return await session_samples(ctx, problem, sampling, play, timeout_s=timeout_s + 30,
                                 who=f"the verifiers episode of task {task}")


__all__ = ["VerifiersError", "VerifiersTask", "close_runners", "episode", "find_python", "runner_for"]

