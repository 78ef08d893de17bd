"""Score responses with a user reward function that cannot hang, crash or poison the run.

A reward function is user code named by a dotted path (``task.reward._target_``). It may loop
forever on a pathological response (``sympy`` on ``9**9**9**9``), raise, return NaN, or kill its
process. :class:`RewardRunner` runs it in worker subprocesses and turns each of those into a
:class:`RewardOutcome` with ``reward=None`` and a ``failure`` string; the caller keeps the sample and
masks it out of the loss, so a failure is never silently a training signal.

How it works
------------
- The dotted path is checked against the allowlist in the calling process (nothing imported);
  each worker, a fresh interpreter ("spawn"), imports and builds the function itself, with torch /
  OpenMP / BLAS capped to ``num_threads_per_worker`` threads. Workers start in the constructor and
  are waited for at the first :meth:`RewardRunner.score`, so building the runner is cheap.
- Batching: the items of one ``score`` call are split into ``num_workers`` chunks and each chunk is
  one message to a worker, which answers at the end of the chunk and whenever 50 ms
  (``FLUSH_INTERVAL_S``) have passed since its last answer. A call therefore starts less than 50 ms
  after the last answer the parent got, and the parent's deadline, ``timeout_s`` + 50 ms after that
  answer, leaves every call at least ``timeout_s`` of its own.
- A call past its deadline: the worker is killed (SIGKILL, then reaped) and a fresh one starts.
  When only one call of the chunk was unanswered it fails with ``"timeout after Xs"``; otherwise
  the unanswered calls are re-queued one per chunk, so the culprit times out again, alone, and is
  blamed, while the others are scored (a hang costs up to two deadlines, a fast call nothing).
  A worker that dies (``os._exit``, a segfault, ``sys.exit``) is handled the same way and its call
  fails with ``"reward worker died (exit code N)"``. Re-queued calls go to any ready worker; a
  worker's start never counts against a deadline.
- ``timeout_s=0`` (or ``isolation="inline"``) calls the function in this process: no deadline and no
  crash protection, only exceptions and non-finite values are caught. It saves the per-step IPC
  (about 1-3 ms for 256 short items) and the workers' start (about a second), nothing else.
- Imports made by the reward module when it is imported happen during the worker's start; imports
  made inside the function on its first call count against that call's deadline. Reward modules
  import their dependencies at module level.
- Spawned workers re-import the main script: a script (not ``python -m miles``) that creates a
  runner needs the usual ``if __name__ == "__main__":`` guard.

The default is isolation with a 10 s deadline: one hung call would otherwise stall every engine
and trainer of the run, and its cost on 256 exact-answer items a step is a few milliseconds
(``python -m miles.bench rewards``).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Literal

from miles.config.build import check_allowed
from miles.config.schema import TargetConfig
from miles.config.validate import ConfigError
from miles.rewards import _worker

log = logging.getLogger(__name__)

__all__ = ["RewardItem", "RewardOutcome", "RewardRunner"]


@dataclass(frozen=True)
class RewardItem:
    """One response to score: its text, the task's reference label, and optional context.

    ``prompt`` and ``metadata`` are passed to reward functions that take keyword arguments of those names.
    """

    response_text: str
    label: Any
    prompt: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardOutcome:
    """A finite ``reward``, or ``reward=None`` and why (``failure``: timeout, exception, non-finite, crash)."""

    reward: float | None
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


class RewardRunner:
    """Scores :class:`RewardItem` lists with the reward function named by ``fn``, under a deadline per call.

    ``kind="sample"``: ``fn(response_text, label) -> float``, use :meth:`score`.
    ``kind="group"``: ``fn(responses: list[str], label) -> list[float]``, one call per group of
    responses to the same prompt, use :meth:`score_groups`. Either may also take ``prompt=`` /
    ``metadata=`` keyword arguments. Create once per run, :meth:`close` at the end (or use ``with``).
    """

    def __init__(self, fn: TargetConfig, *, allow: Sequence[str] = (), timeout_s: float = 10.0,
                 num_workers: int = 1, kind: Literal["sample", "group"] = "sample",
                 isolation: Literal["process", "inline"] | None = None, num_threads_per_worker: int = 1,
                 startup_timeout_s: float = 120.0, key: str = "task.reward") -> None:
        if kind not in ("sample", "group"):
            raise ConfigError(f"{key}: reward kind must be 'sample' or 'group', found {kind!r}")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ConfigError(f"{key}: timeout_s must be a finite number >= 0 (0: inline, no deadline), "
                              f"found {timeout_s!r}")
        if isolation is None:
            isolation = "inline" if timeout_s == 0 else "process"
        if isolation not in ("process", "inline"):
            raise ConfigError(f"{key}: isolation must be 'process' or 'inline', found {isolation!r}")
        if isolation == "process" and timeout_s == 0:
            raise ConfigError(f"{key}: isolation='process' needs a deadline: timeout_s > 0 (found 0)")
        if num_workers < 1:
            raise ConfigError(f"{key}: num_workers must be at least 1, found {num_workers}")
        check_allowed(fn.target, allow, f"{key}._target_")
        self.fn, self.kind, self.isolation = fn, kind, isolation
        self.timeout_s = float(timeout_s)
        # the parent's clock for a call starts at the worker's last message, up to FLUSH_INTERVAL_S
        # before the call itself: waiting that much longer keeps at least timeout_s for every call
        self.deadline_s = self.timeout_s + _worker.FLUSH_INTERVAL_S
        self.num_workers = num_workers if isolation == "process" else 0
        self.startup_timeout_s = startup_timeout_s
        self._spec = (fn.target, fn.partial, dict(fn.kwargs), tuple(allow), f"{key}._target_", kind,
                      num_threads_per_worker)
        self._lock = threading.Lock()
        self._closed = False
        self._inline_fn: Any = None
        self._inline_extras: tuple[str, ...] = ()
        if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
            # e.g. "loky" in a joblib launcher's job: a spawned worker restores its parent's start method
            # first, and "cannot find context for 'loky'" in a process that has not imported loky
            mp.set_start_method("spawn", force=True)
        self._ctx = mp.get_context("spawn")
        self.spans: deque[tuple[str, float, float, int]] = deque(maxlen=4096)
        """``(worker, start, end, calls)`` of the last chunks scored, on the wall clock (``time.time()``), for
        per-step timelines (:mod:`miles.tracking.timeline`); worker ``"inline"`` is this process."""
        self._workers: list[_Worker] = [_Worker(self._ctx, self._spec, startup_timeout_s, self.spans, i)
                                        for i in range(self.num_workers)]
        self.num_crashes = self.num_restarts = 0
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    # -- public API ------------------------------------------------------------------------------

    def score(self, items: Sequence[RewardItem]) -> list[RewardOutcome]:
        """One outcome per item, in order (``kind="sample"``)."""
        if self.kind != "sample":
            raise TypeError("score: this runner has kind='group'; call score_groups(groups)")
        units = [(it.response_text, it.label, it) for it in items]
        return [outs[0] for outs in self._run(units, [1] * len(units))]

    def score_groups(self, groups: Sequence[Sequence[RewardItem]]) -> list[list[RewardOutcome]]:
        """One outcome per item of each group (``kind="group"``: one call per group, the group's label
        and context taken from its first item)."""
        if self.kind != "group":
            raise TypeError("score_groups: this runner has kind='sample'; call score(items)")
        units = [([it.response_text for it in g], g[0].label, g[0]) for g in groups if g]
        outs = iter(self._run(units, [len(g) for g in groups if g]))
        return [next(outs) if g else [] for g in groups]

    def wait_ready(self) -> None:
        """Block until every worker has built the reward function; raises what a broken config raises."""
        with self._lock:
            self._check_open()
            if self.isolation == "inline":
                self._inline()
            for w in self._workers:
                self._await_start(w)

    def close(self) -> None:
        """Stop the workers (politely, then by force). The runner cannot score afterwards."""
        with self._lock:
            self._closed = True
            for w in self._workers:
                w.stop()
            self._finalizer.detach()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def worker_pids(self) -> list[int | None]:
        """Process ids of the current workers (for tests and diagnostics)."""
        return [w.proc.pid for w in self._workers]

    # -- scoring ---------------------------------------------------------------------------------

    def _run(self, units: list[tuple[Any, Any, RewardItem]], sizes: list[int]) -> list[list[RewardOutcome]]:
        with self._lock:
            self._check_open()
            if not units:
                return []
            if self.isolation == "inline":
                fn, extras = self._inline()
                t0 = time.time()
                results = [_worker.call(fn, self.kind, (r, label, _extras(it, extras))) for r, label, it in units]
                self.spans.append(("inline", t0, time.time(), len(units)))
            else:
                try:
                    results = self._run_isolated(units, sizes)
                except BaseException:  # e.g. Ctrl-C or a replacement that cannot start: drop in-flight work
                    for w in list(self._workers):
                        if w.job is not None:
                            self._replace(w)
                    raise
        return [[RewardOutcome(reward, failure) for reward, failure in outs] for outs in results]

    def _run_isolated(self, units: list[tuple[Any, Any, RewardItem]],
                      sizes: list[int]) -> list[list[_worker.Outcome]]:
        results: list[list[_worker.Outcome] | None] = [None] * len(units)
        extras: tuple[str, ...] = ()
        for w in self._workers:
            self._await_start(w)  # a worker start never counts against a call's deadline
            extras = w.extras
        payloads = [(r, label, _extras(it, extras)) for r, label, it in units]
        chunk = -(-len(units) // len(self._workers))
        queue: deque[list[int]] = deque(list(range(i, min(i + chunk, len(units))))
                                        for i in range(0, len(units), chunk))
        while queue or any(w.job for w in self._workers):
            for w in list(self._workers):  # hand out work
                if w.job is None and w.ready and queue:
                    self._dispatch(w, queue.popleft(), payloads, results, sizes, queue)
            busy = [w for w in self._workers if w.job or not w.ready]
            if not busy:
                continue
            next_deadline = min(w.deadline for w in busy)
            ready = wait([o for w in busy for o in (w.conn, w.proc.sentinel)],
                         max(0.0, next_deadline - time.monotonic()))
            for w in busy:
                if w.conn in ready or w.proc.sentinel in ready:
                    self._drain(w, results, sizes, queue)
            now = time.monotonic()
            for w in list(self._workers):
                if w.deadline <= now and (w.job or not w.ready):
                    self._on_deadline(w, results, sizes, queue)
        return results  # type: ignore[return-value]

    def _dispatch(self, w: _Worker, chunk: list[int], payloads: list, results: list, sizes: list[int],
                  queue: deque[list[int]]) -> None:
        try:
            w.dispatch(chunk, payloads, self.deadline_s)
        except OSError:  # the idle worker died since its last call: replace it, keep the chunk
            queue.appendleft(chunk)
            self._replace(w)
        except Exception as e:  # an item that does not pickle (nothing was written to the pipe)
            if len(chunk) > 1:
                queue.extendleft([[u] for u in reversed(chunk)])
            else:
                results[chunk[0]] = [(None, f"could not send to the reward worker: {_worker.describe(e)}")] * sizes[chunk[0]]

    def _drain(self, w: _Worker, results: list, sizes: list[int], queue: deque[list[int]]) -> None:
        """Read every message the worker has sent; handle its death after the last one."""
        dead = False
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if not w.ready:
                    status, info = msg
                    if status == "error":
                        w.stop()
                        raise ConfigError(f"{self._spec[4]}: could not build reward function "
                                          f"'{self.fn.target}' in the reward worker: {info}")
                    w.on_ready(info)
                    continue
                job_id, first, outs = msg
                assert w.job is not None and job_id == w.job_id and first == w.position, msg
                for k, unit_outs in enumerate(outs):
                    results[w.job[first + k]] = unit_outs
                w.advance(len(outs), self.deadline_s)
        except (EOFError, OSError):
            dead = True
        if dead or not w.proc.is_alive():
            w.proc.join(timeout=5.0)
            if w.proc.is_alive():  # closed its pipe but lingers: not a usable worker either
                w.kill()
            code = w.proc.exitcode
            if not w.ready:
                raise RuntimeError(f"reward worker for '{self.fn.target}' exited with code {code} while "
                                   "importing the reward function; import it once in a Python shell to see why"
                                   + _unguarded_main_hint())
            if w.job is not None and len(w.job) - w.position == 1:
                self.num_crashes += 1
            self._fail_current(w, results, sizes, queue, f"reward worker died (exit code {code})")

    def _on_deadline(self, w: _Worker, results: list, sizes: list[int], queue: deque[list[int]]) -> None:
        if not w.ready:
            w.stop()
            raise RuntimeError(f"reward worker for '{self.fn.target}' did not start within "
                               f"{self.startup_timeout_s:g}s (importing the reward function)")
        w.kill()
        self._fail_current(w, results, sizes, queue, f"timeout after {self.timeout_s:g}s")

    def _fail_current(self, w: _Worker, results: list, sizes: list[int], queue: deque[list[int]],
                      failure: str) -> None:
        """A call of the worker's chunk failed: blame it, re-queue the rest, start a fresh worker.

        The calls not yet reported are ``job[position:]``. When that is one call it is the culprit;
        otherwise any of them may be (the worker reports in batches), so each is re-queued as a chunk of
        its own: the culprit fails again, alone, and is blamed; the others are scored.
        """
        if w.job is not None:
            unreported = w.job[w.position:]
            if len(unreported) == 1:
                log.warning("reward %s: %s", self.fn.target, failure)
                results[unreported[0]] = [(None, failure)] * sizes[unreported[0]]
            else:
                queue.extendleft([[u] for u in reversed(unreported)])
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.num_restarts += 1
        i = self._workers.index(w)
        self._workers[i] = _Worker(self._ctx, self._spec, self.startup_timeout_s, self.spans, i)

    def _await_start(self, w: _Worker) -> None:
        while not w.ready:
            ready = wait([w.conn, w.proc.sentinel], max(0.0, w.deadline - time.monotonic()))
            if not ready:
                self._on_deadline(w, [], [], deque())
            self._drain(w, [], [], deque())

    def _inline(self) -> tuple[Any, tuple[str, ...]]:
        if self._inline_fn is None:
            target, partial, kwargs, allow, key, _, _ = self._spec
            try:
                self._inline_fn = _worker.build_fn(target, partial, kwargs, allow, key)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(f"{key}: could not build reward function '{target}': {_worker.describe(e)}") from e
            self._inline_extras = _worker.accepted_extras(self._inline_fn)
        return self._inline_fn, self._inline_extras

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RewardRunner is closed")


def _extras(item: RewardItem, wanted: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(item, name) for name in wanted}


class _Worker:
    """One worker process and the chunk it is working on (parent-side bookkeeping)."""

    def __init__(self, ctx: Any, spec: tuple, startup_timeout_s: float,
                 spans: deque[tuple[str, float, float, int]], index: int) -> None:
        self.spans, self.name, self.started = spans, str(index), 0.0
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker.main, args=(child, *spec), daemon=True, name="miles-reward")
        self.proc.start()
        child.close()  # the parent keeps only its end, so a dead worker reads as EOF
        self.ready = False
        self.extras: tuple[str, ...] = ()
        self.deadline = time.monotonic() + startup_timeout_s  # until ready: the start deadline
        self.job: list[int] | None = None
        self.job_id = 0
        self.position = 0

    def on_ready(self, extras: Sequence[str]) -> None:
        self.ready, self.extras, self.deadline = True, tuple(extras), math.inf

    def dispatch(self, units: list[int], payloads: list, timeout_s: float) -> None:
        self.conn.send((self.job_id + 1, [payloads[u] for u in units]))
        self.job_id += 1
        self.job, self.position = units, 0
        self.deadline = time.monotonic() + timeout_s
        self.started = time.time()

    def advance(self, n: int, deadline_s: float) -> None:
        assert self.job is not None
        self.position += n
        if self.position == len(self.job):
            self.spans.append((self.name, self.started, time.time(), len(self.job)))
            self.job, self.deadline = None, math.inf
        else:
            self.deadline = time.monotonic() + deadline_s

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
            self.proc.join(timeout=2.0)
        self.kill()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.is_alive():
            w.proc.kill()


def _unguarded_main_hint() -> str:
    """A spawned worker re-imports the main script: unguarded top-level code runs again there and fails."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None or not getattr(main, "__file__", None):
        return ""  # ``python -m ...`` or an interactive session: the script is not re-run
    return (f". Workers start as fresh interpreters that re-import the main script ({main.__file__}): if it "
            "starts miles at top level, put that code under `if __name__ == \"__main__\":`")
