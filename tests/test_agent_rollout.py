"""The tool_loop generate function over a real in-process TorchEngine and a warm-started tiny model
that calls the calculator: the trained ids are, byte for byte, the engine's ids plus the observation
ids, across 3 turns; every turn's engine prompt is the session so far (nothing re-tokenized)."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from miles.agent.calculator import Calculator
from miles.agent.rewards import tool_answer_reward
from miles.agent.rollout import tool_loop
from miles.agent.tools import parse_tool_calls
from miles.config import TargetConfig, validate
from miles.rollout.generate import GenerateContext
from miles.rollout.manager import sample_counts
from miles.rollout.protocols import check_group
from miles.tasks.procedural import exact_answer_reward
from miles.types import SamplingParams, Status

TASK = TargetConfig(target="miles.agent.tasks.CalculatorArithmeticTask")
WARM_START = {"steps": 100, "batch_size": 32}  # enough for the tiny model to write the tool call


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The tool task's checkpoint: its tokenizer and a tiny Qwen3 warm-started on first turns only (the
    tool call), so after a tool response it calls again: sessions reach 3 turns."""
    from transformers import AutoTokenizer

    from miles.config.schema import PrecisionConfig
    from miles.core.run import build_components
    from miles.models.checkpoint import ensure_checkpoint
    from miles.rollout.torch_engine import TorchEngine

    run = validate({"task": {"name": "arithmetic_tools",
                             "source": {"_target_": TASK.target, "second_turn_fraction": 0.0}},
                    "warm_start": WARM_START | {"cache_dir": str(tmp_path_factory.getbasetemp() / "agent_ckpt")}})
    parts = build_components(run)
    path = ensure_checkpoint(run, parts["spec"], parts["task"])
    return SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(path), task=parts["task"],
                           engine=TorchEngine(str(path), PrecisionConfig(), seed=0, num_threads=1))


class Recorder:
    """Calls the real engine and keeps every request and its results."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    async def __call__(self, request, sampling):
        results = await asyncio.to_thread(self.engine.generate, [request], sampling)
        self.calls.append((request, results))
        return results


def _ctx(built, recorder: Recorder, n: int, group_id: int = 5) -> GenerateContext:
    from miles.models.tokenizer import encode_prompt

    return GenerateContext(group_id=group_id, n=n, seed=11, tokenizer=built.tokenizer, _generate=recorder,
                           _encode=lambda p: tuple(encode_prompt(built.tokenizer, p)))


def test_three_turn_sessions_train_on_exactly_what_the_engine_sampled(built) -> None:
    problem = built.task.sample(1, random.Random(3))[0]
    recorder = Recorder(built.engine)
    fn = functools.partial(tool_loop, tools=[Calculator()], max_turns=3, max_context_tokens=256)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48)
    samples = asyncio.run(fn(_ctx(built, recorder, n=4), problem, sampling))
    check_group(samples, n=4, group_id=5, who="tool_loop")

    first_request, first_results = recorder.calls[0]
    assert first_request.n == 4 and len(first_results) == 4  # turn 1: one request, one shared prefill
    turns = {i: [first_results[i]] for i in range(4)}
    for request, (result,) in recorder.calls[1:]:
        turns[int(request.request_id.split("-")[1])].append((request, result))
    multi = 0
    for s in samples:
        policy = [turns[s.index][0]] + [r for _, r in turns[s.index][1:]]
        prompts = [first_request.prompt_ids] + [q.prompt_ids for q, _ in turns[s.index][1:]]
        full = s.prompt_ids + s.response_ids
        assert list(first_request.prompt_ids) == s.prompt_ids
        pos, expected_ids, expected_mask, expected_lp = len(s.prompt_ids), [], [], []
        for k, result in enumerate(policy):
            assert list(prompts[k]) == full[:pos]  # the engine saw the session so far, unchanged
            expected_ids += result.response_ids
            expected_mask += [1] * len(result.response_ids)
            expected_lp += result.logprobs
            pos += len(result.response_ids)
            if k + 1 < len(policy):  # the observation between two policy turns
                obs = list(prompts[k + 1][pos:])
                text = built.tokenizer.decode(obs)
                assert text.startswith("\n<|im_start|>user\n<tool_response>\n")
                assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
                expected_ids += obs
                expected_mask += [0] * len(obs)
                expected_lp += [0.0] * len(obs)
                pos += len(obs)
        assert s.response_ids == expected_ids and s.loss_mask == expected_mask  # byte for byte
        assert s.rollout_logprobs == expected_lp
        assert s.response_text == built.tokenizer.decode(list(policy[-1].response_ids), skip_special_tokens=True)
        assert s.metadata["counts"]["agent/turns"] == len(policy)
        multi += len(policy) >= 3
    assert multi >= 1, [s.metadata for s in samples]  # the warm-started model called the tool twice
    counts = sample_counts(samples)
    assert counts["rollout/agent/turns"] == len(recorder.calls) - 1 + 4
    assert counts["rollout/agent/tool_calls"] >= 4


def test_each_call_gets_its_tool_response_and_malformed_calls_are_counted(built) -> None:
    recorder = Recorder(built.engine)
    fn = functools.partial(tool_loop, tools=[Calculator()], max_turns=3, max_context_tokens=256)
    samples = []
    for seed in range(3):
        problem = built.task.sample(1, random.Random(seed))[0]
        samples += asyncio.run(fn(_ctx(built, recorder, n=4, group_id=seed), problem,
                                  SamplingParams(temperature=1.0, max_new_tokens=48)))
    seen, with_ok = Counter(), 0
    for s in samples:
        before = Counter(seen)
        text = built.tokenizer.decode(s.response_ids)
        turns = text.split("<|im_start|>assistant\n")  # policy turn k, then its tool responses
        for k, turn in enumerate(turns):
            calls, errors = parse_tool_calls(turn.split("<|im_end|>")[0])
            if k == len(turns) - 1 and s.status is Status.COMPLETED:
                assert not calls and not errors  # a session completes on a turn without calls
            if "<|im_end|>" in turn:  # counted in every turn the policy finished (a cut-off one is not parsed)
                seen["malformed"] += len(errors)
            if k == len(turns) - 1:
                continue  # no room or no turns left: no response, not counted as calls
            seen["calls"] += len(calls) + len(errors)
            seen["ok"] += sum(not _calculator_text(c.arguments).startswith("error") for c in calls)
            response = turn.split("<|im_start|>user\n", 1)[1]
            for c in calls:  # each well-formed call's result, in order
                want = _calculator_text(c.arguments)
                assert f"<tool_response>\n{want}\n</tool_response>" in response, (turn, response)
            assert response.count("error: malformed tool call") == len(errors)
        # the shaped reward pays its bonus exactly for the sessions whose calls all worked
        works = seen["ok"] - before["ok"] >= 1 and seen["malformed"] == before["malformed"]
        reward = tool_answer_reward(s.response_text, s.label, metadata=s.metadata, call_bonus=0.25)
        assert reward == exact_answer_reward(s.response_text, s.label) + 0.25 * works
        with_ok += seen["ok"] > before["ok"]
    assert with_ok > 0  # the bonus was decided on sessions with working calls (paid or not, by malformed ones)
    counts = sample_counts(samples)
    assert counts["rollout/agent/tool_calls_ok"] == seen["ok"] > 0
    assert counts["rollout/agent/tool_calls"] == seen["calls"]
    assert counts.get("rollout/agent/tool_malformed", 0) == seen["malformed"]
    assert 0 < counts["rollout/agent/tool_success_rate"] <= 1


def _calculator_text(arguments: dict) -> str:
    try:
        return Calculator()(arguments)
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def test_an_openai_client_agent_is_the_rollout_and_its_samples_are_what_was_sampled(built, caplog) -> None:
    """examples/openai_agent.py through the rollout server: every span the loss trains on is one
    engine result, sampled from exactly the ids before it; the agent's tool results have mask 0.
    The HTTP client under the openai client does not log each request."""
    pytest.importorskip("openai")
    from examples.openai_agent import solve
    from miles.agent.openai_rollout import HTTP_CLIENT_LOGGERS, openai_agent

    caplog.set_level(logging.INFO)

    recorder = Recorder(built.engine)
    problem = built.task.sample(1, random.Random(5))[0]
    fn = functools.partial(openai_agent, agent=functools.partial(solve, max_turns=2))
    samples = asyncio.run(fn(_ctx(built, recorder, n=3), problem, SamplingParams(temperature=1.0, max_new_tokens=48)))
    check_group(samples, n=3, group_id=5, who="openai_agent")
    calls = {(tuple(q.prompt_ids), tuple(r.response_ids)): r for q, (r,) in recorder.calls}
    assert len({q.seed for q, _ in recorder.calls}) == len(recorder.calls)  # samples do not share seeds
    spans, answered_calls = 0, 0
    for s in samples:
        full, start = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        i = 0
        while i < len(s.loss_mask):
            j = i
            while j < len(s.loss_mask) and s.loss_mask[j] == s.loss_mask[i]:
                j += 1
            if s.loss_mask[i] == 1:
                # an engine call sampled these ids from exactly the session before them
                result = calls[(tuple(full[:start + i]), tuple(s.response_ids[i:j]))]
                assert s.rollout_logprobs[i:j] == list(result.logprobs)
                spans += 1
            else:
                assert "<tool_response>" in built.tokenizer.decode(s.response_ids[i:j])
            i = j
        assert s.metadata["counts"]["agent/turns"] == sum(
            1 for k in range(len(s.loss_mask)) if s.loss_mask[k] == 1 and (k == 0 or s.loss_mask[k - 1] == 0))
        # tool counts from the sampled text: each policy turn's well-formed calls that the agent answered
        want = Counter()
        turns = built.tokenizer.decode(s.response_ids).split("<|im_start|>assistant\n")
        for turn in turns:
            made, malformed = parse_tool_calls(turn.split("<|im_end|>")[0])
            if "<|im_end|>" in turn:
                want["agent/tool_malformed"] += len(malformed)
            if "<|im_start|>user\n" in turn:
                answered = min(len(made), turn.split("<|im_start|>user\n", 1)[1].count("<tool_response>"))
                want["agent/tool_calls"] += answered
                want["agent/tool_calls_ok"] += answered
        got = {k: v for k, v in s.metadata["counts"].items() if k.startswith("agent/tool_")}
        assert got == {k: want[k] for k in ("agent/tool_calls", "agent/tool_calls_ok", "agent/tool_malformed")}
        works = got["agent/tool_calls_ok"] >= 1 and got["agent/tool_malformed"] == 0
        assert tool_answer_reward(s.response_text, s.label, metadata=s.metadata) == (
            exact_answer_reward(s.response_text, s.label) + 0.2 * works)
        answered_calls += got["agent/tool_calls"]
    assert spans == len(recorder.calls) and spans > 3  # the warm-started model called the tool: 2 replies each
    assert answered_calls > 0  # the tool-use bonus is decided on calls the agent answered
    assert not [r for r in caplog.records if r.name in HTTP_CLIENT_LOGGERS], "per-request lines were logged"


def test_openai_agent_clients_share_one_connection_pool_and_carry_their_session(built, monkeypatch) -> None:
    """The agents' clients are copies of one ``openai.OpenAI`` (built with the server, not per sample):
    one HTTP connection pool, and each client's requests carry its own session header."""
    openai = pytest.importorskip("openai")
    from miles.agent.openai_rollout import openai_agent
    from miles.agent.server import SESSION_HEADER

    built_clients = []

    class Counting(openai.OpenAI):
        def __init__(self, *args, **kwargs) -> None:
            built_clients.append(kwargs.get("default_headers"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(openai, "OpenAI", Counting)
    seen = []

    def agent(client, prompt: str) -> None:
        seen.append(client)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])

    problem = built.task.sample(1, random.Random(7))[0]
    fn = functools.partial(openai_agent, agent=agent)
    for group_id in (21, 22):
        samples = asyncio.run(fn(_ctx(built, Recorder(built.engine), n=3, group_id=group_id), problem,
                                 SamplingParams(temperature=1.0, max_new_tokens=8)))
        check_group(samples, n=3, group_id=group_id, who="openai_agent")
    assert len(built_clients) <= 1  # at most the server's own (none if a server already ran in this process)
    assert len({id(c._client) for c in seen}) == 1
    assert len({c.default_headers[SESSION_HEADER] for c in seen}) == len(seen) == 6


def test_an_agent_that_edits_its_reply_trains_only_on_the_turns_before(built) -> None:
    """An agent that sends back an edited reply: the turn after it is answered off the record, so the sample
    holds (and trains on) the first turn only, and says so in its counts; the last reply is still its text."""
    pytest.importorskip("openai")
    from miles.agent.openai_rollout import openai_agent

    runs = []

    def agent(client, prompt: str) -> None:
        messages, seen = [{"role": "user", "content": prompt}], []
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages)
            seen.append((reply.choices[0].message.content or "", reply.choices[0].model_extra["off_record"]))
            messages += [{"role": "assistant", "content": seen[-1][0] + " (edited)"},
                         {"role": "user", "content": "Check it."}]
        runs.append(seen)

    recorder = Recorder(built.engine)
    problem = built.task.sample(1, random.Random(3))[0]
    samples = asyncio.run(functools.partial(openai_agent, agent=agent)(
        _ctx(built, recorder, n=2), problem, SamplingParams(temperature=1.0, max_new_tokens=12)))
    check_group(samples, n=2, group_id=5, who="openai_agent")
    assert len(recorder.calls) == 4
    firsts = [list(r.response_ids) for q, (r,) in recorder.calls if len(q.prompt_ids) == len(samples[0].prompt_ids)]
    for s in samples:
        assert s.response_ids in firsts and s.loss_mask == [1] * len(s.response_ids)
        counts = s.metadata["counts"]
        assert (counts["agent/turns"], counts["agent/turns_masked"], counts["agent/template_drift"]) == (2, 1, 1)
    assert [[why for _, why in seen] for seen in runs] == [
        [None, "message 1 (assistant) is not the reply the server gave"]] * 2
    assert sorted(s.response_text for s in samples) == sorted(seen[1][0] for seen in runs)
