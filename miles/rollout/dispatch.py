"""Engine pool: requests from many coroutines onto N engine actors, none lost, none duplicated.

- **Load balancing.** A request goes to the live engine with the fewest samples in flight, and
  an engine holds at most ``rollout.max_inflight_samples_per_engine`` of them; the rest wait and
  are sent as calls finish (completion-driven, so a slow engine gets less work, never a fixed
  share). Queued requests with the same sampling parameters share one call, up to
  ``rollout.max_requests_per_call`` and an even split of the queue over the engines with room
  (requests homed on the call's engine, below, count whole: no other engine may take them).
  A request with ``n`` samples always goes whole to one engine (one prefill for the group).
- **Session affinity** (``rollout.session_affinity``). The pool remembers, for the last 65536
  session keys (:func:`miles.types.session_key` of each completion of a request with a
  ``session_id``), the engine that produced them. A request whose ``session_id`` is such a key goes
  to that engine (which may hold its prefix's KV) even when another has fewer samples in flight; if
  that engine is full the request waits for it, and only if the engine died or already failed the
  request does it go to any engine. ``counts["affinity_hits"]`` are requests with a ``session_id``
  sent to the engine of their key, ``counts["affinity_misses"]`` the others (a new session, an
  evicted key, or its engine dead or failed). Requests without a ``session_id`` are balanced as above.
- **Deadlines and retries.** A call that does not answer within its deadline,
  ``rollout.request_timeout_s`` plus ``rollout.request_timeout_per_1k_tokens_s`` per 1000 tokens of
  the longest prompt in the call (a long multi-turn context takes longer to prefill), is aborted
  on its engine (if it can abort) and its requests are retried on another engine, as are requests
  of a call that raised; after ``rollout.max_retries`` retries a request fails with
  :class:`EngineRequestError`, whose message lists every attempt.
- **Dead engines.** An engine whose actor died, or whose call raised :class:`EngineDeadError` (an
  actor alive around a backend that is gone, e.g. an SGLang server process that exited or hung),
  leaves the rotation (logged) and its requests are retried on the others; with no engine left
  every waiting request raises :class:`AllEnginesDeadError`.
- **Hung engines.** While a session has calls in flight on an engine, a watchdog asks the engine for
  its ``health()`` every ``rollout.health_interval_s`` (engines answer it while they generate). An
  engine that does not answer within ``rollout.engine_timeout_s`` (its process stopped, or stuck
  holding the interpreter) leaves the rotation as a dead one, and its calls in flight are aborted and
  retried on the others at once: a hung engine costs interval + timeout, not a request deadline. (An
  SGLang engine's server that hangs is found by the engine's own watchdog, which fails its calls.)
- **Idle engines.** Between rollouts (during a train step, or an engine the rollout leaves without calls)
  the idle watch (:meth:`EnginePool.watch_idle`, a thread of the driver's, started by the run) asks every
  engine in rotation without calls in flight for its ``health()`` at the same interval. One whose actor
  died, whose backend is gone (``ok`` false), or that has not answered within ``rollout.engine_timeout_s``
  is found then (logged), and taken out of rotation at the next call the driver makes to the engines (a
  rollout's dispatch, the health check of the weight push): unless it answered meanwhile, a hung engine
  found idle costs interval + timeout too, and no call waits on it.

Every answered request's latency (from its arrival in the queue to its answer, retries included) is kept
in ``EnginePool.latencies``, and its time to first token in ``EnginePool.first_token_s``, until the rollout
manager reads them. The time to first token is the request's wait before the call that answered it was sent
(retries included) plus the engine's own measure, from receiving that call to the request's first token
(:attr:`miles.types.GenerateResult.ttft_s`; the earliest of its ``n`` completions); the call's passage
through Ray is not in it. With a Prometheus exporter running (:mod:`miles.tracking.prometheus`) queue
depth, requests in flight, latencies, times to first token and tokens are reported to it as they happen,
the latencies labelled by the request's adapter (a multi-LoRA tenant).

Each call carries fresh request ids (``<id>@<n>``), so a late answer to an abandoned call can
never be mistaken for its retry; results come back under the caller's ids, ordered by index.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from miles.config.schema import RolloutConfig
from miles.tracking import prometheus
from miles.types import GenerateRequest, GenerateResult, SamplingParams, session_key

log = logging.getLogger(__name__)


MAX_SESSION_KEYS = 65536  # session keys whose engine the pool remembers (least recently used go first)


class AllEnginesDeadError(RuntimeError):
    """Every rollout engine actor died: nothing is left to generate on."""


class EngineDeadError(RuntimeError):
    """Raised by an engine whose backend is gone for good while its actor lives on (a server process
    that exited or stopped answering); the pool takes the engine out of rotation as if its actor died."""


class EngineHungError(RuntimeError):
    """The watchdog took an engine out of rotation: its health check went unanswered."""


@dataclass
class IdleCheck:
    """An idle engine's health check in flight: the engine handle it went to (a replacement gets its own),
    its object ref, when it was sent, and ``why`` the engine is unwell once found so (else None)."""

    engine: Any
    ref: Any
    sent: float
    why: str | None = None
    hung: bool = False  # why: no answer yet (an answer that comes before the take-out clears it)


class EngineRequestError(RuntimeError):
    """A request failed on every attempt (timeouts, engine errors, dead engines); the message lists them."""


class EnginePool:
    """N engine actors behind load balancing, deadlines, retries and dead-engine removal.

    Lives on the driver for the whole run (which engines are alive, what was sent where);
    :meth:`session` gives the queue of one rollout, bound to its event loop.
    """

    def __init__(self, engines: Sequence[Any], cfg: RolloutConfig) -> None:
        if not engines:
            raise ValueError("EnginePool: needs at least one engine (placement.num_engines >= 1)")
        self.engines, self.cfg = list(engines), cfg
        self.alive = list(range(len(self.engines)))
        self.deaths: dict[int, str] = {}
        self.died_at: dict[int, float] = {}  # engine -> time.monotonic() when it was taken out
        self.dispatched = [0] * len(self.engines)  # requests sent to each engine, all time
        self.counts: Counter[str] = Counter()  # retried, timeouts, engines_lost, request_failures, affinity_*
        self.homes: OrderedDict[str, int] = OrderedDict()  # session key -> engine that produced it (LRU)
        self.latencies: list[float] = []  # seconds from arrival to answer of each answered request, until read
        self.first_token_s: list[float] = []  # seconds from arrival to first token of each answered request
        self._wire_id = 0
        self.busy = [0] * len(self.engines)  # calls in flight per engine, over every session
        self.idle_checks: dict[int, IdleCheck] = {}  # the idle watch's checks in flight, by engine
        self._idle_lock = threading.Lock()
        self._idle_stop = threading.Event()
        self._idle_thread: threading.Thread | None = None

    def session(self) -> Session:
        """A request queue for the running event loop: ``await session.generate(request, sampling)``."""
        return Session(self)

    def next_wire_id(self) -> int:
        self._wire_id += 1
        return self._wire_id

    def home(self, request: GenerateRequest) -> int | None:
        """The engine that produced ``request.session_id``'s key, if affinity is on and it is known."""
        if not self.cfg.session_affinity or request.session_id is None:
            return None
        return self.homes.get(request.session_id)

    def remember(self, request: GenerateRequest, e: int) -> None:
        """Engine ``e`` produced ``request``'s completions: their session keys now live there."""
        if not self.cfg.session_affinity or request.session_id is None:
            return
        for i in range(request.n):
            key = session_key(request.session_id, request.n, i)
            self.homes[key] = e
            self.homes.move_to_end(key)
        while len(self.homes) > MAX_SESSION_KEYS:
            self.homes.popitem(last=False)

    def deadline_s(self, call: Sequence[GenerateRequest]) -> float:
        """A call's deadline: the fixed part plus the per-1000-prompt-token part for its longest prompt."""
        longest = max((len(r.prompt_ids) for r in call), default=0)
        return self.cfg.request_timeout_s + self.cfg.request_timeout_per_1k_tokens_s * longest / 1000

    def mark_dead(self, e: int, err: BaseException) -> None:
        """Take engine ``e`` out of rotation (once), saying why."""
        if e in self.alive:
            self.alive.remove(e)
            self.deaths[e] = first_line(err)
            self.died_at[e] = time.monotonic()
            self.counts["engines_lost"] += 1
            if (live := prometheus.active()) is not None:
                live.lost.inc()
                live.alive.set(len(self.alive))
            log.warning("rollout engine %d died (%s); taken out of rotation, %d of %d engine(s) left",
                        e, self.deaths[e], len(self.alive), len(self.engines))

    def revive(self, e: int, engine: Any) -> float:
        """Put ``engine`` (a replacement that holds the current weights) in rotation as engine ``e``;
        returns the seconds engine ``e`` was out."""
        self.engines[e] = engine
        self.deaths.pop(e, None)
        self.alive = sorted([*self.alive, e])
        if (live := prometheus.active()) is not None:
            live.alive.set(len(self.alive))
        return time.monotonic() - self.died_at.pop(e, time.monotonic())

    def watch_idle(self) -> None:
        """Start the idle watch (see the module docstring) unless it runs or ``health_interval_s`` is 0;
        :meth:`stop_watching` ends it."""
        if self.cfg.health_interval_s <= 0 or self._idle_thread is not None:
            return
        self._idle_stop.clear()
        self._idle_thread = threading.Thread(target=self._watch_idle, name="miles-idle-health", daemon=True)
        self._idle_thread.start()

    def stop_watching(self) -> None:
        if self._idle_thread is not None:
            self._idle_stop.set()
            self._idle_thread.join(timeout=10.0)
            self._idle_thread = None

    def _watch_idle(self) -> None:
        while not self._idle_stop.wait(self.cfg.health_interval_s):
            try:
                self.check_idle()
            except Exception:  # noqa: BLE001 - the watch goes on; the next push checks every engine anyway
                log.exception("rollout engines: the idle health check failed")

    def check_idle(self) -> None:
        """One round of the idle watch: send a health check to each engine in rotation with no call in
        flight and none pending; read those answered; find those unanswered past ``engine_timeout_s``."""
        now, timeout = time.monotonic(), self.cfg.engine_timeout_s
        alive = list(self.alive)
        with self._idle_lock:
            for e in [e for e in self.idle_checks if e not in alive]:  # taken out meanwhile
                del self.idle_checks[e]
        for e in alive:
            engine = self.engines[e]
            with self._idle_lock:
                check = self.idle_checks.get(e)
                if check is None or check.engine is not engine:  # none pending, or the engine was replaced
                    if self.busy[e] == 0:
                        self.idle_checks[e] = IdleCheck(engine, engine.health.remote(), now)
                    else:
                        self.idle_checks.pop(e, None)  # a rollout's watchdog checks it
                    continue
            if ray.wait([check.ref], timeout=0)[0]:
                why = _unwell(check.ref)
                with self._idle_lock:
                    if why is None:
                        self.idle_checks.pop(e, None)
                    elif check.why is None or check.hung:
                        check.why, check.hung = why, False
                        log.warning("rollout engine %d (idle): %s; taken out at the next call to the engines", e, why)
            elif now - check.sent > timeout and check.why is None:
                check.why, check.hung = f"idle health check: no answer within rollout.engine_timeout_s={timeout:g} s (hung)", True
                log.warning("rollout engine %d: %s; taken out at the next call to the engines", e, check.why)

    def take_out_unwell(self) -> None:
        """Take out of rotation the engines the idle watch found dead, gone or hung; a hung one that has
        answered since stays (the watch reads its answer)."""
        if not self.idle_checks:
            return
        with self._idle_lock:
            found = [(e, c) for e, c in self.idle_checks.items() if c.why is not None and c.engine is self.engines[e]]
        for e, check in found:
            if check.hung and ray.wait([check.ref], timeout=0)[0]:
                continue
            with self._idle_lock:
                self.idle_checks.pop(e, None)
            self.mark_dead(e, EngineHungError(check.why) if check.hung else RuntimeError(check.why))

    def all_dead_error(self) -> AllEnginesDeadError:
        why = "; ".join(f"engine {e}: {r}" for e, r in sorted(self.deaths.items()))
        return AllEnginesDeadError(
            f"all {len(self.engines)} rollout engine(s) died ({why}); nothing left to generate on. "
            "Check the engine actors' logs (`ray logs`), e.g. for out-of-memory kills.")

    def abort(self, e: int, request_ids: list[str]) -> None:
        """Ask engine ``e`` to stop generating ``request_ids`` (fire and forget; older engines cannot)."""
        handle = self.engines[e]
        if hasattr(handle, "abort"):
            handle.abort.remote(request_ids)


@dataclass
class _Pending:
    request: GenerateRequest
    sampling: SamplingParams | None
    future: asyncio.Future
    attempts: int = 0
    avoid: set[int] = field(default_factory=set)  # engines this request already failed on
    errors: list[str] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)


class Session:
    """The request queue of one rollout (one event loop) over the pool's live engines."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.queue: deque[_Pending] = deque()
        self.inflight = [0] * len(pool.engines)  # samples in flight per engine
        self.scheduled = False
        self.tasks: set[asyncio.Task] = set()
        self.live = prometheus.active()  # None: no exporter runs
        if self.live is not None:
            self.live.watch(self)
            self.live.alive.set(len(pool.alive))
        self.lost: dict[int, asyncio.Future] = {}  # engine -> set (to its error) when the watchdog takes it out
        self.watchdog: asyncio.Task | None = None

    async def generate(self, request: GenerateRequest, sampling: SamplingParams | None) -> list[GenerateResult]:
        if request.n < 1:
            raise ValueError(f"GenerateRequest {request.request_id!r}: n must be >= 1, found {request.n}")
        future = self.loop.create_future()
        self.queue.append(_Pending(request, sampling, future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if not self.scheduled:  # requests queued in the same loop iteration can share a call
            self.scheduled = True
            self.loop.call_soon(self._dispatch)

    def _spare(self, e: int) -> int:
        return self.pool.cfg.max_inflight_samples_per_engine - self.inflight[e]

    def _home(self, p: _Pending) -> int | None:
        """The engine ``p``'s session key lives on, while it is alive and ``p`` has not failed there."""
        e = self.pool.home(p.request)
        return e if e is not None and e in self.pool.alive and e not in p.avoid else None

    def _has_room(self, e: int) -> bool:
        return self._spare(e) > 0 or self.inflight[e] == 0

    def _pick(self, p: _Pending) -> int | None:
        """``p``'s home engine (see :meth:`_home`) when it has room, None while it is full; without a
        home, the live engine with room and the fewest samples in flight, avoiding ones ``p`` failed on."""
        home = self._home(p)
        if home is not None:
            return home if self._has_room(home) else None
        alive = self.pool.alive
        fresh = [e for e in alive if e not in p.avoid] or alive
        room = [e for e in fresh if self._has_room(e)]
        return min(room, key=lambda e: self.inflight[e]) if room else None

    def _next(self) -> tuple[_Pending | None, int | None]:
        """The first queued request that can go now, and where: requests waiting for their full home
        engine let the ones behind them by; any other request that cannot go holds the queue."""
        if not any(self._has_room(x) for x in self.pool.alive):
            return None, None
        for p in self.queue:
            e = self._pick(p)
            if e is not None:
                return p, e
            if self._home(p) is None:
                break
        return None, None

    def _share(self, e: int) -> int:
        """Rows of the queue a call on engine ``e`` may take: every row only ``e`` can serve (requests
        whose home it is), plus an even split, over the engines with room, of the rows any engine may
        take. Requests homed on other engines are theirs."""
        pinned = free = 0
        for p in self.queue:
            home = self._home(p)
            if home is None:
                free += p.request.n
            elif home == e:
                pinned += p.request.n
        with_room = sum(1 for x in self.pool.alive if self._spare(x) > 0) or 1
        return pinned + math.ceil(free / with_room)

    def _dispatch(self) -> None:
        self.scheduled = False
        cfg = self.pool.cfg
        self.pool.take_out_unwell()
        while self.queue:
            if not self.pool.alive:
                error = self.pool.all_dead_error()
                for p in self.queue:
                    if not p.future.done():
                        p.future.set_exception(error)
                self.queue.clear()
                return
            head, e = self._next()
            if head is None or e is None:
                return  # every engine is full: a finishing call dispatches again
            budget = max(head.request.n, min(self._spare(e), self._share(e)))
            self.queue.remove(head)
            call, rows = [head], head.request.n
            for p in list(self.queue):
                if len(call) >= cfg.max_requests_per_call or rows + p.request.n > budget:
                    break
                home = self._home(p)
                joins = home == e if home is not None else e not in p.avoid or self._pick(p) == e
                if p.sampling == head.sampling and joins:
                    self.queue.remove(p)
                    call.append(p)
                    rows += p.request.n
            self.inflight[e] += rows
            if self.live is not None:
                self.live.inflight(e).inc(len(call))
            for p in call:
                if p.request.session_id is not None and self.pool.cfg.session_affinity:
                    self.pool.counts["affinity_hits" if self.pool.home(p.request) == e else "affinity_misses"] += 1
            task = self.loop.create_task(self._run(e, call, rows))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, e: int, call: list[_Pending], rows: int) -> None:
        pool = self.pool
        wire = [replace(p.request, request_id=f"{p.request.request_id}@{pool.next_wire_id()}") for p in call]
        pool.dispatched[e] += len(call)
        pool.busy[e] += 1
        timeout = pool.deadline_s(wire)
        sent = time.perf_counter()
        self._watch()
        try:
            ref = pool.engines[e].generate.remote(wire, call[0].sampling or SamplingParams())
            results = await self._answer(e, ref, timeout)
        except EngineHungError as err:  # the watchdog took the engine out: its calls go elsewhere now
            pool.abort(e, [w.request_id for w in wire])
            self._retry_all(call, e, f"engine {e} taken out ({err})")
        except TimeoutError:
            pool.counts["timeouts"] += len(call)
            pool.abort(e, [w.request_id for w in wire])
            per_1k = pool.cfg.request_timeout_per_1k_tokens_s
            grown = f" + rollout.request_timeout_per_1k_tokens_s={per_1k:g}s per 1000 prompt tokens = {timeout:g}s"
            self._retry_all(call, e, f"engine {e}: no answer within rollout.request_timeout_s="
                                     f"{pool.cfg.request_timeout_s:g}s{grown if per_1k else ''}")
        except ray.exceptions.ActorUnavailableError as err:
            self._retry_all(call, e, f"engine {e} unavailable ({first_line(err)})")
        except ray.exceptions.RayActorError as err:
            pool.mark_dead(e, err)
            self._retry_all(call, e, f"engine {e} died")
        except Exception as err:  # the engine raised (a RayTaskError wrapping its exception)
            if isinstance(err, EngineDeadError) or isinstance(getattr(err, "cause", None), EngineDeadError):
                pool.mark_dead(e, err)
            self._retry_all(call, e, f"engine {e} raised {first_line(err)}")
        else:
            self._deliver(e, call, wire, results, sent)
        finally:
            pool.busy[e] -= 1
            self.inflight[e] -= rows
            if self.live is not None:
                self.live.inflight(e).dec(len(call))
            self._schedule()

    async def _answer(self, e: int, ref: Any, timeout: float) -> list[GenerateResult]:
        """The results of the call ``ref`` on engine ``e``; raises its error, :class:`TimeoutError` past
        ``timeout``, or :class:`EngineHungError` when the watchdog takes the engine out first."""
        answer = asyncio.wrap_future(ref.future())
        lost = self._lost(e)
        done, _ = await asyncio.wait({answer, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            return answer.result()
        answer.add_done_callback(_retrieve)  # a late answer or error of an abandoned call is dropped
        if lost in done:
            raise lost.result()
        raise TimeoutError

    def _lost(self, e: int) -> asyncio.Future:
        """The future the watchdog sets when it takes engine ``e`` out (made on first use)."""
        if e not in self.lost:
            self.lost[e] = self.loop.create_future()
        return self.lost[e]

    def _watch(self) -> None:
        """Start the watchdog (see the module docstring) unless it runs or ``health_interval_s`` is 0."""
        if self.pool.cfg.health_interval_s > 0 and (self.watchdog is None or self.watchdog.done()):
            self.watchdog = self.loop.create_task(self._watchdog())
            self.tasks.add(self.watchdog)
            self.watchdog.add_done_callback(self.tasks.discard)

    async def _watchdog(self) -> None:
        pool, cfg = self.pool, self.pool.cfg
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            busy = [e for e in pool.alive if self.inflight[e] > 0]
            if not busy:
                return  # started again with the next call
            checks = {e: asyncio.wrap_future(pool.engines[e].health.remote().future()) for e in busy}
            done, _ = await asyncio.wait(checks.values(), timeout=cfg.engine_timeout_s)
            for e, check in checks.items():
                if check in done:
                    continue  # answered (a backend that is gone fails its calls itself), or its actor died
                check.add_done_callback(_retrieve)
                why = f"health check: no answer within rollout.engine_timeout_s={cfg.engine_timeout_s:g} s (hung)"
                pool.mark_dead(e, EngineHungError(why))
                lost = self._lost(e)
                if not lost.done():
                    lost.set_result(EngineHungError(why))
                del self.lost[e]  # a replacement of engine e (a later rollout) starts with a fresh one

    def _deliver(self, e: int, call: list[_Pending], wire: list[GenerateRequest], results: list, sent: float) -> None:
        by_id: dict[str, list[GenerateResult]] = {}
        for r in results:
            by_id.setdefault(r.request_id, []).append(r)
        for p, w in zip(call, wire, strict=True):
            got = sorted(by_id.pop(w.request_id, []), key=lambda r: r.index)
            if [r.index for r in got] != list(range(p.request.n)):
                p.future.set_exception(RuntimeError(
                    f"engine {e} returned completions {[r.index for r in got]} for request {p.request.request_id!r} "
                    f"(n={p.request.n}): a lost or duplicated completion is an engine bug"))
            elif not p.future.done():
                self.pool.remember(p.request, e)
                latency = time.perf_counter() - p.arrived
                self.pool.latencies.append(latency)
                firsts = [r.ttft_s for r in got if r.ttft_s is not None]
                ttft = sent - p.arrived + min(firsts) if firsts else None
                if ttft is not None:
                    self.pool.first_token_s.append(ttft)
                if self.live is not None:
                    self.live.answered(e, latency, sum(len(r.response_ids) for r in got), ttft,
                                       p.request.adapter or "", max(r.weight_version for r in got))
                p.future.set_result([replace(r, request_id=p.request.request_id) for r in got])
        if by_id:
            log.error("engine %d returned results for requests it was not sent: %s", e, sorted(by_id))

    def _retry_all(self, call: list[_Pending], e: int, reason: str) -> None:
        for p in reversed(call):  # appendleft: keep their order at the head of the queue
            p.attempts += 1
            p.errors.append(reason)
            p.avoid.add(e)
            if p.future.done():
                continue
            if p.attempts > self.pool.cfg.max_retries:
                self.pool.counts["request_failures"] += 1
                p.future.set_exception(EngineRequestError(
                    f"request {p.request.request_id!r} failed {p.attempts} time(s): {'; '.join(p.errors)}"))
            else:
                self.pool.counts["retried"] += 1
                self.queue.appendleft(p)
                if self.live is not None:
                    self.live.retried.inc()


def _retrieve(future: asyncio.Future) -> None:
    """Done callback of a future nobody awaits any more: reads its error, so asyncio does not log it."""
    if not future.cancelled():
        future.exception()


def _unwell(ref: Any) -> str | None:
    """None when the answered health check ``ref`` says the engine is well; else why not (its actor died, or
    its backend is gone: ``ok`` false)."""
    try:
        health = ray.get(ref, timeout=0)
    except Exception as err:  # noqa: BLE001 - its actor died (RayActorError), or its health() raised
        return f"idle health check: {first_line(err)}"
    return None if health.get("ok", True) else f"idle health check: {health}"


def first_line(err: BaseException) -> str:
    """``ExcType: last line of the message`` (a Ray error's last line is the cause)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"
