"""The one request check both engines and the rollout server use: every field, and engine capabilities."""

from __future__ import annotations

import pytest

from miles.rollout.requests import EngineLimits, check_request, eos_ids
from miles.types import GenerateRequest, SamplingParams

LIMITS = EngineLimits(vocab_size=10, context_length=16, adapters=("a", "b"))
DEFAULT = SamplingParams()


def _check(limits: EngineLimits = LIMITS, sampling: SamplingParams | None = DEFAULT, **request) -> None:
    check_request(GenerateRequest(**{"request_id": "r1", "prompt_ids": (1, 2)} | request), sampling, limits)


@pytest.mark.parametrize(("request_fields", "sampling", "message"), [
    ({}, None, r"request 'r1' has no sampling params: pass generate\(..., sampling\) or set GenerateRequest.sampling"),
    ({}, SamplingParams(temperature=-1.0), r"request 'r1': temperature must be >= 0 \(0 means greedy\), got -1.0"),
    ({}, SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\] \(1 disables nucleus sampling\), got 1.5"),
    ({}, SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ({}, SamplingParams(top_k=-2), r"top_k must be >= 0 \(0 disables top-k\), got -2"),
    ({}, SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    ({}, SamplingParams(logprobs_top_k=11), r"logprobs_top_k must be in \[0, 10\] \(0: off\), got 11"),
    ({}, SamplingParams(stop_token_ids=(3, 10)), r"stop_token_ids must be in \[0, 10\), got \[3, 10\]"),
    ({}, SamplingParams(stop="ab"), "stop must be a tuple of non-empty strings, got 'ab'"),
    ({}, SamplingParams(stop=("",)), r"stop must be a tuple of non-empty strings, got \(''"),
    ({"n": 0}, SamplingParams(), "n must be >= 1, got 0"),
    ({"adapter": "c"}, SamplingParams(), r"adapter 'c' is not one this engine holds \(\['a', 'b'\]\); send one of "
                                         r"those, None \(the default\) or '__base__' \(the base model\)"),
    ({"prompt_ids": ()}, SamplingParams(), "prompt_ids is empty; send at least one token"),
    ({"prompt_ids": (3, 10)}, SamplingParams(), r"prompt_ids: token ids must be in \[0, 10\), got min 3, max 10"),
    ({"prompt_ids": (-1, 3)}, SamplingParams(), "got min -1, max 3"),
    ({"prompt_ids": (1, 2, 3)}, SamplingParams(max_new_tokens=14),
     r"prompt \(3 tokens\) \+ max_new_tokens \(14\) exceeds the context length 16; lower max_new_tokens"),
])
def test_each_wrong_field_is_named_with_its_range(request_fields: dict, sampling: SamplingParams | None,
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _check(sampling=sampling, **request_fields)


def test_valid_requests_and_the_sampling_they_use() -> None:
    own = SamplingParams(max_new_tokens=6)
    request = GenerateRequest(request_id="r", prompt_ids=(0, 9), sampling=own)
    assert check_request(request, SamplingParams(), LIMITS) is own  # the request's own params win
    assert check_request(GenerateRequest(request_id="r", prompt_ids=(1,)), own, LIMITS) is own
    for adapter in (None, "a", "b", "__base__"):
        _check(adapter=adapter)
    _check(EngineLimits(vocab_size=10), sampling=SamplingParams(max_new_tokens=10_000))  # no context bound
    _check(sampling=SamplingParams(temperature=0.0, top_p=1.0, logprobs_top_k=10, stop=("x",)))


def test_engine_capabilities_refuse_with_their_reason() -> None:
    no_adapters = EngineLimits(vocab_size=10)
    with pytest.raises(ValueError, match=r"adapter 'a' is not one this engine holds \(it holds none\)"):
        _check(no_adapters, adapter="a")
    _check(no_adapters, adapter="__base__")  # the base model is what an engine without adapters serves
    refusing = EngineLimits(vocab_size=10, adapters=("a",), no_stop_strings="no tokenizer; use stop_token_ids",
                            no_base_model="lm_head adapters mix")
    with pytest.raises(ValueError, match=r"request 'r1': stop=\['x'\]: no tokenizer; use stop_token_ids"):
        _check(refusing, sampling=SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match=r"adapter='__base__' \(the base model\) is refused: lm_head adapters mix"):
        _check(refusing, adapter="__base__")
    _check(refusing, adapter="a", sampling=SamplingParams(stop_token_ids=(4,)))


def test_eos_ids_from_either_config() -> None:
    assert eos_ids("ckpt", 5, [7, 5]) == [5, 7]
    assert eos_ids("ckpt", None, (2,)) == [2]
    with pytest.raises(ValueError, match="ckpt: neither config.json nor generation_config.json sets eos_token_id"):
        eos_ids("ckpt", None, [])
