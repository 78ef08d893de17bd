"""The reward worker process: builds the reward function from its dotted path, then scores jobs.

Runs in a fresh interpreter started by :class:`miles.rewards.runner.RewardRunner` (multiprocessing
"spawn"). Protocol over one duplex pipe, parent <-> worker:

- worker -> parent, once: ``("ready", extras)`` where ``extras`` names the optional keyword
  arguments (``prompt``, ``metadata``) the function accepts, or ``("error", "ExcType: message")``
  when the function cannot be built (then the worker exits).
- parent -> worker: ``(job_id, units)``, a list of calls; ``None`` asks the worker to exit.
- worker -> parent: ``(job_id, first_position, [outcomes, ...])``, the outcomes of the calls since its
  last message, sent at the end of the chunk and whenever :data:`FLUSH_INTERVAL_S` has passed since
  the last message (checked after each call). ``outcomes`` is one ``(reward, failure)`` pair per
  scored response (one for ``kind="sample"``, the group's size for ``kind="group"``). So a call
  starts less than ``FLUSH_INTERVAL_S`` after the last message the parent received, which is what
  lets the parent hold a deadline per call while paying for one message per chunk.

This module imports only the standard library at top level: thread caps must be in the
environment before the reward function's imports (torch, numpy) read them.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                   "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")
EXTRA_ARGS = ("prompt", "metadata")
MAX_MESSAGE_CHARS = 500
FLUSH_INTERVAL_S = 0.05
"""A worker sends the outcomes it has after a call once this long has passed since its last message
(and at the end of a chunk): any call starts within this long of the last message the parent got."""

Outcome = tuple[float | None, str | None]


def main(conn: Any, target: str, partial: bool, kwargs: dict[str, Any], allow: tuple[str, ...], key: str,
         kind: str, num_threads: int) -> None:
    """Worker entry point (see the module docstring for the protocol)."""
    for var in THREAD_ENV_VARS:
        os.environ[var] = "false" if var == "TOKENIZERS_PARALLELISM" else str(num_threads)
    try:
        fn = build_fn(target, partial, kwargs, allow, key)
        extras = accepted_extras(fn)
    except Exception as e:  # a user mistake in the reward config or module: reported, not raised
        conn.send(("error", describe(e)))
        return
    if "torch" in sys.modules:  # imported by the reward module: cap its intra-op pool too
        sys.modules["torch"].set_num_threads(num_threads)
    conn.send(("ready", extras))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if job is None:
            return
        job_id, units = job
        done: list[list[Outcome]] = []
        first = 0
        last_flush = time.monotonic()
        for position, unit in enumerate(units):
            done.append(call(fn, kind, unit))
            now = time.monotonic()
            if now - last_flush >= FLUSH_INTERVAL_S or position == len(units) - 1:
                conn.send((job_id, first, done))
                done, first, last_flush = [], position + 1, now


def build_fn(target: str, partial: bool, kwargs: dict[str, Any], allow: Sequence[str], key: str) -> Callable:
    """The reward callable, built exactly as the driver would (allowlist and signature checks included)."""
    from miles.config.build import build
    from miles.config.schema import TargetConfig

    fn = build(TargetConfig(target=target, partial=partial, kwargs=kwargs), allow=tuple(allow), key=key)
    if not callable(fn):
        raise TypeError(f"'{target}' built a {type(fn).__name__}, not a callable; set _partial_: true "
                        "for a plain reward function")
    return fn


def accepted_extras(fn: Callable) -> tuple[str, ...]:
    """Which of ``prompt`` / ``metadata`` the function takes as keyword arguments."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return EXTRA_ARGS
    return tuple(a for a in EXTRA_ARGS if a in params and params[a].kind is not inspect.Parameter.POSITIONAL_ONLY)


def call(fn: Callable, kind: str, unit: tuple[Any, Any, dict[str, Any]]) -> list[Outcome]:
    """Score one unit: ``(response_text, label, extras)`` for ``kind="sample"``, ``(responses, label, extras)``
    for ``kind="group"``. Returns one ``(reward, failure)`` per response; never raises ``Exception``."""
    responses, label, extras = unit
    try:
        value = fn(responses, label, **extras)
    except Exception as e:
        failure = f"raised {describe(e)}"
        return [(None, failure)] * (1 if kind == "sample" else len(responses))
    if kind == "sample":
        return [as_reward(value)]
    if isinstance(value, str | bytes) or not isinstance(value, (Sequence, *_array_types())):
        failure = f"group reward returned {type(value).__name__}, expected a list of {len(responses)} numbers"
        return [(None, failure)] * len(responses)
    values = list(value)
    if len(values) != len(responses):
        failure = f"group reward returned {len(values)} rewards for a group of {len(responses)} responses"
        return [(None, failure)] * len(responses)
    return [as_reward(v) for v in values]


def as_reward(value: Any) -> Outcome:
    """``(float(value), None)`` for a finite real number, else ``(None, "non-finite reward: ...")``."""
    if isinstance(value, str | bytes) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return None, f"non-finite reward: {_short(repr(value))} is a {type(value).__name__}, not a number"
    try:
        reward = float(value)
    except (TypeError, ValueError) as e:
        return None, f"non-finite reward: {_short(repr(value))} is not a single number ({e})"
    if not math.isfinite(reward):
        return None, f"non-finite reward: {reward}"
    return reward, None


def describe(e: BaseException) -> str:
    """``"ExcType: message"``, the message cut to a readable length."""
    return f"{type(e).__name__}: {_short(str(e))}"


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def _array_types() -> tuple[type, ...]:
    """numpy arrays and torch tensors count as sequences of rewards, when those libraries are loaded."""
    types: list[type] = []
    if "numpy" in sys.modules:
        types.append(sys.modules["numpy"].ndarray)
    if "torch" in sys.modules:
        types.append(sys.modules["torch"].Tensor)
    return tuple(types)
