"""EnginePool over fake engine actors (real Ray actors, no model): session affinity, the deadline
that grows with the prompt, and the watchdog that takes out a hung engine. Each fake engine answers with its own id as the response, so a result
says where it was generated."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from miles.config.schema import RolloutConfig
from miles.rollout.dispatch import EnginePool, EngineRequestError
from miles.types import GenerateRequest, GenerateResult, Status


def _fakes(ray, k: int, delay_s: float = 0.0) -> list:
    """``k`` fake engine actors (defined here so that Ray ships the class by value)."""

    class FakeEngine:
        """Answers every completion with ``(engine_id,)`` after ``delay_s``; records the session ids it saw."""

        def __init__(self, engine_id: int, delay_s: float = 0.0) -> None:
            self.engine_id, self.delay_s = engine_id, delay_s
            self.sessions: list[str | None] = []
            self.calls: list[int] = []
            self.health_delays: list[float] = []

        def generate(self, requests: list[GenerateRequest], sampling=None) -> list[GenerateResult]:
            time.sleep(self.delay_s)
            self.sessions += [r.session_id for r in requests]
            self.calls.append(len(requests))
            return [GenerateResult(request_id=r.request_id, index=i, response_ids=(self.engine_id,), logprobs=(-0.1,),
                                   status=Status.COMPLETED, weight_version=0)
                    for r in requests for i in range(r.n)]

        def abort(self, request_ids: list[str]) -> None:
            pass

        def set_delay(self, seconds: float) -> None:
            self.delay_s = seconds

        def seen(self) -> list[str | None]:
            return self.sessions

        def call_sizes(self) -> list[int]:
            return self.calls

        def health(self) -> dict:
            time.sleep(self.health_delays.pop() if self.health_delays else 0.0)
            return {"ok": True, "engine_id": self.engine_id}

        def slow_health_once(self, seconds: float) -> None:
            self.health_delays = [seconds]

        def pid(self) -> int:
            return os.getpid()

    actor = ray.remote(FakeEngine).options(num_cpus=0, max_concurrency=8)
    engines = [actor.remote(i, delay_s) for i in range(k)]
    ray.get([e.seen.remote() for e in engines])
    return engines


def _turns(pool: EnginePool, sessions: int, turns: int, between=None) -> dict[str, list[int]]:
    """``sessions`` conversations of ``turns`` turns, all at once: session ``g`` starts as one request
    with n=2 (keys ``g#0``, ``g#1``), each completion then continues as its own session. Returns the
    engine of every turn per key. ``between(turn)`` runs (in a thread) before each later turn."""

    async def main() -> dict[str, list[int]]:
        queue = pool.session()
        where: dict[str, list[int]] = {}

        async def one(g: int) -> None:
            first = await queue.generate(GenerateRequest(request_id=f"g{g}", prompt_ids=(1, 2), n=2,
                                                         session_id=f"g{g}"), None)
            for r in first:
                where[f"g{g}#{r.index}"] = [r.response_ids[0]]
            for turn in range(2, turns + 1):
                for i in range(2):
                    key = f"g{g}#{i}"
                    (r,) = await queue.generate(GenerateRequest(request_id=f"{key}-t{turn}", prompt_ids=(1, 2, turn),
                                                                session_id=key), None)
                    where[key].append(r.response_ids[0])

        tasks = [asyncio.create_task(one(g)) for g in range(sessions)]
        if between is not None:
            await asyncio.sleep(0.3)
            await asyncio.to_thread(between)
        await asyncio.gather(*tasks)
        return where

    return asyncio.run(main())


def test_later_turns_go_to_the_engine_of_the_first(ray_cluster) -> None:
    engines = _fakes(ray_cluster, 3, delay_s=0.01)
    pool = EnginePool(engines, RolloutConfig(max_inflight_samples_per_engine=4, max_requests_per_call=4))
    where = _turns(pool, sessions=12, turns=3)
    assert len(where) == 24 and all(len(w) == 3 for w in where.values())
    assert all(len(set(w)) == 1 for w in where.values()), where
    assert len({w[0] for w in where.values()}) == 3, "the first turns are balanced over every engine"
    assert pool.counts["affinity_hits"] == 24 * 2 and pool.counts["affinity_misses"] == 12
    seen = ray_cluster.get([e.seen.remote() for e in engines])
    assert sum(len(s) for s in seen) == 12 + 24 * 2, "no request was sent twice"
    for e in engines:
        ray_cluster.kill(e)


def test_turns_homed_on_one_engine_go_to_it_in_one_call(ray_cluster) -> None:
    """Eight later turns whose sessions all live on engine 0 (engine 1 idle): one call of eight, not a
    call per engine's fair share of the queue; free requests queued with them are still split."""
    engines = _fakes(ray_cluster, 2, delay_s=0.01)
    pool = EnginePool(engines, RolloutConfig(max_inflight_samples_per_engine=16, max_requests_per_call=16))
    for g in range(8):
        pool.remember(GenerateRequest(request_id=f"s{g}", prompt_ids=(1,), n=1, session_id=f"s{g}"), 0)

    async def main() -> list[list[GenerateResult]]:
        queue = pool.session()
        pinned = [GenerateRequest(request_id=f"s{g}-t2", prompt_ids=(1, 2), n=1, session_id=f"s{g}") for g in range(8)]
        free = [GenerateRequest(request_id=f"f{i}", prompt_ids=(3,), n=1) for i in range(4)]
        return await asyncio.gather(*(queue.generate(r, None) for r in pinned + free))

    results = asyncio.run(main())
    assert [r[0].response_ids for r in results[:8]] == [(0,)] * 8
    sizes = ray_cluster.get([e.call_sizes.remote() for e in engines])
    assert sizes[0][0] >= 8, sizes  # the pinned turns (and a share of the free ones) in the first call
    assert sum(sizes[1]) >= 2, sizes  # the idle engine still took its share of the free requests
    for e in engines:
        ray_cluster.kill(e)


def test_without_affinity_nothing_is_remembered(ray_cluster) -> None:
    engines = _fakes(ray_cluster, 2, delay_s=0.01)
    pool = EnginePool(engines, RolloutConfig(session_affinity=False, max_inflight_samples_per_engine=2))
    where = _turns(pool, sessions=6, turns=3)
    assert all(len(w) == 3 for w in where.values())
    assert not pool.homes and pool.counts["affinity_hits"] == pool.counts["affinity_misses"] == 0
    for e in engines:
        ray_cluster.kill(e)


def test_a_turn_waits_for_its_full_engine(ray_cluster) -> None:
    """Engine 0 is busy with a slow request; the session it served waits for it rather than going to the idle one."""
    slow, idle = _fakes(ray_cluster, 2)
    pool = EnginePool([slow, idle], RolloutConfig(max_inflight_samples_per_engine=1))

    async def main() -> tuple[int, int]:
        queue = pool.session()
        (first,) = await queue.generate(GenerateRequest(request_id="a", prompt_ids=(1,), session_id="s"), None)
        await asyncio.to_thread(ray_cluster.get, slow.set_delay.remote(0.5))
        busy = asyncio.create_task(queue.generate(GenerateRequest(request_id="busy", prompt_ids=(1,)), None))
        await asyncio.sleep(0.05)  # "busy" is on engine 0 (the least loaded, then the first)
        (second,) = await queue.generate(GenerateRequest(request_id="b", prompt_ids=(1, 2), session_id="s"), None)
        await busy
        return first.response_ids[0], second.response_ids[0]

    assert asyncio.run(main()) == (0, 0)
    assert pool.counts["affinity_hits"] == 1
    ray_cluster.kill(slow)
    ray_cluster.kill(idle)


def test_a_dead_engines_sessions_move(ray_cluster) -> None:
    engines = _fakes(ray_cluster, 2, delay_s=0.05)
    pool = EnginePool(engines, RolloutConfig(max_inflight_samples_per_engine=4, max_requests_per_call=2))
    where = _turns(pool, sessions=8, turns=4, between=lambda: ray_cluster.kill(engines[0]))
    assert pool.alive == [1] and pool.counts["engines_lost"] == 1
    moved = [w for w in where.values() if w[0] == 0]
    assert moved, "some sessions started on engine 0"
    assert all(w[-1] == 1 for w in where.values()), "every session ends on the live engine"
    assert all(w == [1] * 4 for w in where.values() if w[0] == 1), "engine 1's sessions never moved"
    ray_cluster.kill(engines[1])


def test_the_deadline_grows_with_the_prompt(ray_cluster) -> None:
    """A 0.5 s engine: a short prompt misses a 0.2 s deadline, a 2000-token one gets 0.2 + 0.5 * 2 s."""
    (engine,) = _fakes(ray_cluster, 1, delay_s=0.5)
    cfg = RolloutConfig(request_timeout_s=0.2, request_timeout_per_1k_tokens_s=0.5, max_retries=0)
    pool = EnginePool([engine], cfg)

    async def ask(length: int) -> list[GenerateResult]:
        return await pool.session().generate(GenerateRequest(request_id=f"p{length}", prompt_ids=(1,) * length), None)

    with pytest.raises(EngineRequestError, match="request_timeout_per_1k_tokens_s=0.5s per 1000 prompt tokens"):
        asyncio.run(ask(10))
    assert asyncio.run(ask(2000))[0].response_ids == (0,)
    assert pool.counts["timeouts"] == 1
    assert pool.deadline_s([GenerateRequest(request_id="x", prompt_ids=(1,) * 3000)]) == pytest.approx(1.7)
    ray_cluster.kill(engine)


def _rollout(pool: EnginePool, k: int) -> list[int]:
    """``k`` requests at once; the engine of each answer."""

    async def main() -> list[int]:
        queue = pool.session()
        answers = await asyncio.gather(*(queue.generate(GenerateRequest(request_id=f"r{i}", prompt_ids=(1, 2)), None)
                                         for i in range(k)))
        return [a[0].response_ids[0] for a in answers]

    return asyncio.run(main())


def test_a_hung_engine_is_taken_out_by_the_watchdog(ray_cluster) -> None:
    """Engine 0's process stopped (SIGSTOP) before a rollout: the calls sent to it never answer, and the
    request deadline is 600 s. The watchdog (every 0.5 s, 2 s to answer) takes it out and its requests
    are answered by engine 1 within seconds; with the watchdog off they would wait out the deadline."""
    engines = _fakes(ray_cluster, 2, delay_s=0.05)
    pool = EnginePool(engines, RolloutConfig(max_inflight_samples_per_engine=2, max_requests_per_call=1,
                                             health_interval_s=0.5, engine_timeout_s=2.0))
    assert sorted(_rollout(pool, 8)) == [0] * 4 + [1] * 4  # both engines answer while they are well
    os.kill(ray_cluster.get(engines[0].pid.remote()), signal.SIGSTOP)
    t0 = time.monotonic()
    assert _rollout(pool, 8) == [1] * 8
    assert time.monotonic() - t0 < 60  # interval + timeout, not the 600 s request deadline
    assert pool.alive == [1] and pool.counts["engines_lost"] == 1 and pool.counts["retried"] >= 1
    assert pool.deaths[0] == "EngineHungError: health check: no answer within rollout.engine_timeout_s=2 s (hung)"
    for engine in engines:
        ray_cluster.kill(engine)


def test_an_idle_engine_that_hangs_is_found_and_left_out(ray_cluster) -> None:
    """Between rollouts, engine 0's process stopped (SIGSTOP) and engine 1's next health check slow (6 s).
    The idle watch (every 0.2 s, 1 s to answer) finds both unanswered with no call to either; engine 1
    then answers, so only engine 0 is hung: the next rollout's dispatch takes it out before sending
    anything, and every request goes to engine 1 at the first try (none retried)."""
    engines = _fakes(ray_cluster, 2, delay_s=0.05)
    pool = EnginePool(engines, RolloutConfig(max_inflight_samples_per_engine=2, max_requests_per_call=1,
                                             health_interval_s=0.2, engine_timeout_s=1.0))
    assert sorted(_rollout(pool, 4)) == [0, 0, 1, 1]
    pool.watch_idle()
    try:
        ray_cluster.get(engines[1].slow_health_once.remote(6.0))
        time.sleep(0.5)  # the check pending before the slow one answers
        os.kill(ray_cluster.get(engines[0].pid.remote()), signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while not all(c.hung for c in pool.idle_checks.values()) or len(pool.idle_checks) < 2:
            assert time.monotonic() < deadline, f"not both found unanswered: {pool.idle_checks}"
            time.sleep(0.1)
        assert pool.alive == [0, 1]  # found, not yet taken out: the driver's next call does that
        ray_cluster.wait([pool.idle_checks[1].ref], timeout=30)  # engine 1 answers: slow, not hung
        assert _rollout(pool, 8) == [1] * 8
        assert pool.alive == [1] and pool.counts["retried"] == 0 and pool.dispatched[0] == 2
        assert pool.deaths == {0: "EngineHungError: idle health check: no answer within rollout.engine_timeout_s=1 s (hung)"}
    finally:
        pool.stop_watching()
        for engine in engines:
            ray_cluster.kill(engine)


def test_affinity_counts_reach_the_rollout_metrics() -> None:
    """As ``retried`` / ``timeouts``: in a rollout's metrics, not in those of groups generated elsewhere."""
    from collections import Counter
    from types import SimpleNamespace

    from miles.rollout.manager import RolloutManager

    manager = RolloutManager([object()], tokenizer=None, reward=SimpleNamespace(kind="sample"))
    metrics = manager._metrics([], 1.0, Counter(affinity_hits=3, affinity_misses=1, retried=2))
    assert metrics["rollout/affinity_hits"] == 3 and metrics["rollout/affinity_misses"] == 1
    assert "rollout/affinity_hits" not in manager.metrics([]) and "rollout/retried" not in manager.metrics([])
    manager.close()


def test_a_negative_per_token_deadline_is_refused() -> None:
    from miles.config import ConfigError
    from miles.rollout.manager import check_config

    with pytest.raises(ConfigError, match="rollout.request_timeout_per_1k_tokens_s"):
        check_config(RolloutConfig(request_timeout_per_1k_tokens_s=-1.0))
    check_config(RolloutConfig(request_timeout_per_1k_tokens_s=2.0))
