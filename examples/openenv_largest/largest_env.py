"""An OpenEnv environment written with OpenEnv's own server classes (openenv-core), for ``task=openenv``.

Each episode asks for the largest of five numbers in [0, 99], drawn from ``random.Random(seed)``:
``"Which is largest: 37 82 15 4 60?"``, the prompt format of miles' built-in ``largest`` task (so a
fresh tiny model can warm-start on that task). The action's ``message`` is the answer; it is right when
it is exactly the largest number (surrounding whitespace ignored): reward 1.0, done. With
``LARGEST_ENV_ATTEMPTS=2`` (or more) a wrong answer is told so and asked again, not done, and a right
answer at attempt ``k`` earns ``1 / k``.

Run it from the OpenEnv venv (scripts/setup_openenv.sh); it needs nothing of miles::

    .venv-openenv/bin/python examples/openenv_largest/largest_env.py --port 8000

``--port 0`` binds a free port and prints ``port <n>`` on the first line of stdout. Then
``python -m miles task=openenv task.source.url=http://127.0.0.1:8000`` (see conf/task/openenv.yaml).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LIST_LEN, MAX_VALUE = 5, 99


class Answer(Action):
    message: str = Field(..., description="the answer: one number")


class Question(Observation):
    prompt: str = ""


class LargestState(State):
    numbers: list[int] = Field(default_factory=list)
    attempts: int = 0


class LargestEnvironment(Environment[Answer, Question, LargestState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # a WebSocket session gets an instance of its own

    def __init__(self) -> None:
        super().__init__()
        self.max_attempts = max(1, int(os.environ.get("LARGEST_ENV_ATTEMPTS", "1")))
        self._state = LargestState(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Question:
        rng = random.Random(seed)
        numbers = [rng.randint(0, MAX_VALUE) for _ in range(LIST_LEN)]
        self._state = LargestState(episode_id=episode_id or str(uuid4()), step_count=0, numbers=numbers)
        return Question(prompt=f"Which is largest: {' '.join(map(str, numbers))}?", done=False, reward=None)

    def step(self, action: Answer, timeout_s: float | None = None, **kwargs: Any) -> Question:
        state = self._state
        if not state.numbers:
            return Question(prompt="call reset first", done=True, reward=0.0)
        state.step_count += 1
        state.attempts += 1
        if action.message.strip() == str(max(state.numbers)):
            return Question(prompt="Right.", done=True, reward=1.0 / state.attempts)
        if state.attempts >= self.max_attempts:
            return Question(prompt="Wrong.", done=True, reward=0.0)
        return Question(prompt=f"No. Which is largest: {' '.join(map(str, state.numbers))}?", done=False, reward=0.0)

    @property
    def state(self) -> LargestState:
        return self._state


app = create_app(LargestEnvironment, Answer, Question, env_name="largest", max_concurrent_envs=256)


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args()
    sock = socket.socket()
    sock.bind((args.host, args.port))  # bound here, so --port 0 names the port before anything connects
    print(f"port {sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
    sys.exit(0)


if __name__ == "__main__":
    main()
