"""Per-session prefix reuse in the torch engine: later turns prefill only their new tokens, and their
log-probs still equal an unpadded forward over the whole sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.algos.logprobs import token_logprobs
from miles.config.schema import PrecisionConfig
from miles.rollout.prefix_cache import PrefixEntry, PrefixStore
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, GenerateResult, SamplingParams, session_key

FP32 = PrecisionConfig()
GREEDY = SamplingParams(greedy=True, max_new_tokens=6)


def _entry(ids: tuple[int, ...], version: int = 0, adapter: str | None = None) -> PrefixEntry:
    kv = (torch.zeros(1, len(ids), 2),)
    return PrefixEntry(ids=ids, k=kv, v=kv, version=version, adapter=adapter)


def test_store_reuses_only_a_strict_prefix_of_the_same_version_and_adapter() -> None:
    store = PrefixStore(100)
    store.put("s", _entry((1, 2, 3), version=4, adapter="a"))
    assert store.lookup("s", (1, 2, 3, 9), 4, "a") is not None
    assert store.lookup("s", (1, 2, 3), 4, "a") is None  # nothing left to prefill: not a continuation
    assert store.lookup("s", (1, 2, 4, 9), 4, "a") is None
    assert store.lookup("s", (1, 2, 3, 9), 5, "a") is None  # other weights
    assert store.lookup("s", (1, 2, 3, 9), 4, None) is None  # other adapter
    assert store.lookup("t", (1, 2, 3, 9), 4, "a") is None
    assert store.lookup(None, (1, 2, 3, 9), 4, "a") is None  # no session: not counted
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["hit_tokens"]) == (1, 5, 3)


def test_store_evicts_least_recently_used_within_its_token_budget() -> None:
    store = PrefixStore(10)
    store.put("a", _entry(tuple(range(4))))
    store.put("b", _entry(tuple(range(4))))
    assert store.lookup("a", tuple(range(5)), 0, None) is not None  # a is now the most recent
    store.put("c", _entry(tuple(range(4))))  # 12 > 10: b goes
    assert store.lookup("b", tuple(range(5)), 0, None) is None
    assert store.lookup("a", tuple(range(5)), 0, None) is not None
    assert store.stats()["tokens"] == 8 and store.stats()["evictions"] == 1
    store.put("big", _entry(tuple(range(11))))  # longer than the whole budget: not stored, nothing evicted
    assert store.stats()["entries"] == 2
    store.put("a", _entry(tuple(range(2))))  # replacing a key frees its old tokens
    assert store.stats()["tokens"] == 6
    store.clear()
    assert store.stats()["entries"] == 0 and store.stats()["tokens"] == 0
    assert not PrefixStore(0).enabled
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        PrefixStore(-1)


def _hf_model(path: Path, sd: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if sd is not None:
        model.load_state_dict(sd)
    return model


def _assert_teacher_forced(model, prompt: tuple[int, ...], result: GenerateResult) -> None:
    ids = torch.tensor([list(prompt) + list(result.response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    ref = token_logprobs(logits, torch.tensor(result.response_ids))
    torch.testing.assert_close(torch.tensor(result.logprobs), ref, atol=1e-5, rtol=0)
    assert logits.argmax(-1).tolist() == list(result.response_ids)  # greedy


def _obs(i: int, turn: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (11 * i + 13 * turn + 7 * t) % 80 for t in range(n))


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_later_turns_reuse_the_session_prefix_and_match_teacher_forcing(
        fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    cached = TorchEngine(str(path), FP32, seed=0, prefix_cache_tokens=4096)
    plain = TorchEngine(str(path), FP32, seed=0)
    model = _hf_model(path)
    try:
        prompts = {f"s{i}": tuple(3 + (5 * i + 3 * t) % 85 for t in range(length))
                   for i, length in enumerate([4, 9, 17])}
        reused = 0
        for turn in range(3):
            reqs = [GenerateRequest(request_id=f"{s}-t{turn}", prompt_ids=p, session_id=s)
                    for s, p in prompts.items()]
            # a request without a session, and one whose prompt does not continue its session, in the same call
            reqs.append(GenerateRequest(request_id=f"x-t{turn}", prompt_ids=_obs(9, turn, 6)))
            reqs.append(GenerateRequest(request_id=f"y-t{turn}", prompt_ids=_obs(8, turn, 5 + turn), session_id="y"))
            got, ref = cached.generate(reqs, GREEDY), plain.generate(reqs, GREEDY)
            for q, g, r in zip(reqs, got, ref, strict=True):
                _assert_teacher_forced(model, q.prompt_ids, g)
                assert g.response_ids == r.response_ids
            stats = cached.health()["prefix_cache"]
            assert stats["hits"] == 3 * turn and stats["hit_tokens"] == reused
            for i, (q, g) in enumerate(zip(reqs[:3], got, strict=False)):  # the next turn: + response + observation
                reused += len(q.prompt_ids) + len(g.response_ids) - 1
                prompts[q.session_id] = q.prompt_ids + g.response_ids + _obs(i, turn, [1, 5, 20][i])
        assert plain.health()["prefix_cache"]["hits"] == 0
        assert cached.health()["prefix_cache"]["hit_share"] > 0.5
    finally:
        cached.close()
        plain.close()


def test_each_completion_of_a_group_continues_under_its_own_key(tiny_qwen3_dir: Path) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, prefix_cache_tokens=4096)
    model = _hf_model(tiny_qwen3_dir)
    try:
        prompt = tuple(range(3, 15))
        first = eng.generate([GenerateRequest(request_id="g", prompt_ids=prompt, n=3, seed=1, session_id="g")],
                             SamplingParams(temperature=1.0, max_new_tokens=5))
        nexts = [GenerateRequest(request_id=f"g{i}", prompt_ids=prompt + r.response_ids + (7, 8),
                                 session_id=session_key("g", 3, i)) for i, r in enumerate(first)]
        assert [q.session_id for q in nexts] == ["g#0", "g#1", "g#2"]
        for q, g in zip(nexts, eng.generate(nexts, GREEDY), strict=True):
            _assert_teacher_forced(model, q.prompt_ids, g)
        stats = eng.health()["prefix_cache"]
        assert stats["hits"] == 3
        assert stats["hit_tokens"] == sum(len(prompt) + len(r.response_ids) - 1 for r in first)
    finally:
        eng.close()


def test_a_weight_update_empties_the_cache(tiny_qwen3_dir: Path) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, prefix_cache_tokens=4096)
    try:
        prompt = tuple(range(3, 11))
        (r,) = eng.generate([GenerateRequest(request_id="a", prompt_ids=prompt, session_id="s")], GREEDY)
        assert eng.health()["prefix_cache"]["entries"] == 1
        g = torch.Generator().manual_seed(3)
        sd = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in _hf_model(tiny_qwen3_dir).state_dict().items()}
        eng.update_weights(sd, version=1)
        assert eng.health()["prefix_cache"]["entries"] == 0
        nxt = GenerateRequest(request_id="b", prompt_ids=prompt + r.response_ids + (5,), session_id="s")
        (got,) = eng.generate([nxt], GREEDY)
        assert eng.health()["prefix_cache"]["hits"] == 0  # the old weights' K/V is never reused
        _assert_teacher_forced(_hf_model(tiny_qwen3_dir, sd), nxt.prompt_ids, got)
    finally:
        eng.close()


def test_prefix_cache_refuses_routing_capture(tiny_qwen3_moe_dir: Path) -> None:
    with pytest.raises(ValueError, match="capture_routing"):
        TorchEngine(str(tiny_qwen3_moe_dir), FP32, capture_routing=True, prefix_cache_tokens=1024)
