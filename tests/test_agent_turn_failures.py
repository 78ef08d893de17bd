"""tool_loop over a real EnginePool of fake engine actors (no model): later turns continue the
sample's session key, a turn the pool retries keeps the session's ids exactly once, and a turn that
fails every attempt ends only its own sample as FAILED."""

from __future__ import annotations

import asyncio
import functools

import pytest

from miles.agent.calculator import Calculator
from miles.agent.rollout import tool_loop
from miles.config.schema import RolloutConfig
from miles.models.tokenizer import train_tokenizer
from miles.rollout.dispatch import EnginePool
from miles.rollout.generate import GenerateContext
from miles.rollout.protocols import check_group
from miles.types import SamplingParams, Status, session_key

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
CORPUS = [f"What is 123 * 456? {CALL}", "<tool_response>\n56088\n</tool_response> the answer is 56088"] * 4


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, 320)


def _engines(ray, tok, k: int, fail: str | None) -> list:
    """``k`` fake engines: turn 1 answers with a calculator call, later turns with the answer; engine 0
    raises on every call with a request whose id contains ``fail``."""
    call = tuple(tok.encode(CALL, add_special_tokens=False)) + (tok.eos_token_id,)
    answer = tuple(tok.encode("the answer is 56088", add_special_tokens=False)) + (tok.eos_token_id,)

    class FakeEngine:
        def __init__(self, fails: bool) -> None:
            self.fails, self.requests = fails, []

        def generate(self, requests, sampling=None):
            from miles.types import GenerateResult, Status

            self.requests += requests
            if self.fails and fail is not None and any(fail in r.request_id for r in requests):
                raise RuntimeError("injected engine failure")
            out = []
            for r in requests:
                ids = call if r.request_id.split("@")[0].endswith("-t1") else answer
                out += [GenerateResult(request_id=r.request_id, index=i, response_ids=ids, logprobs=(-0.5,) * len(ids),
                                       status=Status.COMPLETED, weight_version=0) for i in range(r.n)]
            return out

        def seen(self):
            return self.requests

    actor = ray.remote(FakeEngine).options(num_cpus=0, max_concurrency=4)
    return [actor.remote(e == 0) for e in range(k)]


def _rollout(tok, engines: list, cfg: RolloutConfig, n: int = 3) -> tuple[list, EnginePool]:
    pool = EnginePool(engines, cfg)
    fn = functools.partial(tool_loop, tools=[Calculator()], max_turns=3)

    async def main():
        queue = pool.session()
        ctx = GenerateContext(group_id=7, n=n, seed=1, tokenizer=tok, _generate=queue.generate,
                              _encode=lambda p: ())
        problem = type("P", (), {"prompt": "What is 123 * 456?", "label": "56088"})()
        return await fn(ctx, problem, SamplingParams(max_new_tokens=64))

    samples = asyncio.run(main())
    check_group(samples, n=n, group_id=7, who="tool_loop")
    return samples, pool


def test_a_retried_turn_keeps_the_session_ids_once(ray_cluster, tok) -> None:
    """Sample 1's second turn fails on engine 0 (where its first turn ran) and is retried on engine 1."""
    engines = _engines(ray_cluster, tok, 2, fail="-1-t2")
    samples, pool = _rollout(tok, engines, RolloutConfig(max_requests_per_call=1, max_retries=2))
    assert [s.status for s in samples] == [Status.COMPLETED] * 3 and all(s.trainable for s in samples)
    assert pool.counts["retried"] == 1
    assert samples[1].response_ids == samples[0].response_ids, "the retried turn's ids are in the session once"
    assert samples[1].loss_mask == samples[0].loss_mask
    requests = [r for e in engines for r in ray_cluster.get(e.seen.remote())]
    (first,) = [r for r in requests if r.request_id.startswith("7-t1")]
    assert first.n == 3 and first.session_id.startswith("agent-7-")
    later = {r.request_id.split("@")[0]: r.session_id for r in requests if "-t2" in r.request_id}
    assert later == {f"7-{i}-t2": session_key(first.session_id, 3, i) for i in range(3)}
    for e in engines:
        ray_cluster.kill(e)


def test_a_turn_failing_every_attempt_fails_only_its_sample(ray_cluster, tok) -> None:
    engines = _engines(ray_cluster, tok, 1, fail="-1-t2")
    samples, pool = _rollout(tok, engines, RolloutConfig(max_requests_per_call=1, max_retries=1))
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED, Status.COMPLETED]
    failed = samples[1]
    assert not failed.trainable and failed.failure.startswith("generation: turn 2: EngineRequestError")
    assert "failed 2 time(s)" in failed.failure and "injected engine failure" in failed.failure
    assert failed.metadata["counts"]["agent/turn_failures"] == 1
    assert all(s.metadata["counts"]["agent/turn_failures"] == 0 for s in (samples[0], samples[2]))
    assert pool.counts["request_failures"] == 1
    for e in engines:
        ray_cluster.kill(e)
