"""TorchEngine: log-probs vs teacher forcing, left padding, stops, seeding, weight sync, fp8, Ray actor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from miles.algos.logprobs import token_logprobs
from miles.config.schema import PrecisionConfig
from miles.core.types import GenerateRequest, GenerateResult, SamplingParams, Status
from miles.precision.fp8 import apply_rollout_quant, is_quantized_weight
from miles.rollout.torch_engine import TorchEngine

FP32 = PrecisionConfig()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=10)


def _requests(lengths: list[int], n: int = 2, seed0: int | None = 0) -> list[GenerateRequest]:
    """Prompts of the given lengths, token ids in [3, 90)."""
    return [
        GenerateRequest(request_id=f"r{i}", prompt_ids=tuple(3 + (7 * i + 5 * t) % 87 for t in range(length)),
                        n=n, seed=None if seed0 is None else seed0 + i)
        for i, length in enumerate(lengths)
    ]


def _teacher_forced(model, prompt: tuple[int, ...], response: tuple[int, ...], temperature: float
                    ) -> torch.Tensor:
    """Log-probs of ``response`` from one unpadded forward over prompt + response: [R]."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, ids[0, len(prompt) :], temperature)


def _hf_model(path: Path, sd: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if sd is not None:
        model.load_state_dict(sd)
    return model


def _random_state_dict(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Fresh fp32 weights with the checkpoint's names and shapes (what a trainer would send)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in _hf_model(path).state_dict().items()}


def _assert_results_shape(results: list[GenerateResult], reqs: list[GenerateRequest], max_new: int) -> None:
    assert [(r.request_id, r.index) for r in results] == [(q.request_id, j) for q in reqs for j in range(q.n)]
    for r in results:
        assert len(r.response_ids) == len(r.logprobs) >= 1
        if r.status == Status.TRUNCATED:
            assert len(r.response_ids) == max_new and 2 not in r.response_ids
        else:
            assert r.status == Status.COMPLETED and r.response_ids[-1] == 2 and 2 not in r.response_ids[:-1]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path) -> TorchEngine:
    return TorchEngine(str(tiny_qwen3_dir), FP32, seed=0)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_logprobs_match_teacher_forcing_with_left_padding(fixture: str, request: pytest.FixtureRequest
                                                          ) -> None:
    path = request.getfixturevalue(fixture)
    eng = TorchEngine(str(path), FP32, max_batch_size=5)  # 3 chunks: chunking must not matter either
    reqs = _requests([1, 9, 4, 17, 2, 6], n=2)
    calls: list[dict] = []
    eng.model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw), with_kwargs=True)
    results = eng.generate(reqs, SAMPLED)
    # RoPE is shift-invariant, so log-probs cannot see position ids: check them directly.
    # Prefill of chunk 1 (rows r0,r0,r1,r1,r2): real tokens count from 0, decode continues.
    mask, pos = calls[0]["attention_mask"], calls[0]["position_ids"]
    for b, length in enumerate([1, 1, 9, 9, 4]):
        assert mask[b].tolist() == [0] * (9 - length) + [1] * length
        assert pos[b, 9 - length :].tolist() == list(range(length))
    assert calls[1]["position_ids"][:, 0].tolist() == [1, 1, 9, 9, 4]
    _assert_results_shape(results, reqs, SAMPLED.max_new_tokens)
    model = _hf_model(path)
    prompts = {q.request_id: q.prompt_ids for q in reqs}
    for r in results:
        ref = _teacher_forced(model, prompts[r.request_id], r.response_ids, SAMPLED.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)
    # A request alone (no padding, no neighbours) samples the same tokens with the same numbers.
    alone = eng.generate([reqs[0]], SAMPLED)
    for a, b in zip(alone, results[:2], strict=True):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_greedy_logprobs_are_temperature_one_and_top_k_1_is_greedy(engine: TorchEngine, tiny_qwen3_dir
                                                                   ) -> None:
    reqs = _requests([3, 8], n=1)
    greedy = engine.generate(reqs, SamplingParams(greedy=True, temperature=0.5, max_new_tokens=6))
    topk1 = engine.generate(reqs, SamplingParams(top_k=1, temperature=1.0, max_new_tokens=6))
    zero_t = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6))
    model = _hf_model(tiny_qwen3_dir)
    for g, k, z, q in zip(greedy, topk1, zero_t, reqs, strict=True):
        assert g.response_ids == k.response_ids == z.response_ids
        assert g.logprobs == k.logprobs == z.logprobs
        ids = torch.tensor([list(q.prompt_ids) + list(g.response_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(q.prompt_ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == list(g.response_ids)
        ref = token_logprobs(logits, ids[0, len(q.prompt_ids) :])  # temperature 1
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-5, rtol=0)


def _with_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_stops_on_eos_and_ends_loop_early(engine: TorchEngine, tiny_qwen3_dir, tmp_path: Path) -> None:
    req = [GenerateRequest(request_id="a", prompt_ids=(5, 9, 11), n=3)]
    long = engine.generate(req, SamplingParams(greedy=True, max_new_tokens=10))[0]
    assert long.status == Status.TRUNCATED and len(long.response_ids) == 10
    stop_at = next(i for i in range(2, 10) if long.response_ids[i] not in long.response_ids[:i])
    eos = long.response_ids[stop_at]
    eng = TorchEngine(str(_with_eos(tiny_qwen3_dir, tmp_path / "ckpt", [2, eos])), FP32)
    assert eng.eos_ids == sorted({2, eos})  # generation_config list + config int
    calls = []
    eng.model.register_forward_hook(lambda *_: calls.append(1))
    results = eng.generate(req, SamplingParams(greedy=True, max_new_tokens=10))
    for r in results:
        assert r.status == Status.COMPLETED
        assert r.response_ids == long.response_ids[: stop_at + 1]  # EOS included ...
        assert r.logprobs == long.logprobs[: stop_at + 1]  # ... with its log-prob
    assert len(calls) == stop_at + 1  # every row stopped: no further decode steps


def test_sampled_rows_stop_independently(engine: TorchEngine) -> None:
    reqs = _requests([4] * 8, n=4)
    sp = SamplingParams(temperature=1.5, max_new_tokens=48)
    results = engine.generate(reqs, sp)
    _assert_results_shape(results, reqs, sp.max_new_tokens)
    statuses = {r.status for r in results}
    assert statuses == {Status.COMPLETED, Status.TRUNCATED}, statuses


def test_seeded_reproducibility(tiny_qwen3_dir) -> None:
    a, b = TorchEngine(str(tiny_qwen3_dir), FP32, seed=3), TorchEngine(str(tiny_qwen3_dir), FP32, seed=3)
    seeded, unseeded = _requests([5, 7], n=3), _requests([5, 7], n=3, seed0=None)
    assert a.generate(seeded, SAMPLED) == b.generate(seeded, SAMPLED)
    assert a.generate(seeded, SAMPLED) == b.generate(seeded, SAMPLED)  # request seeds do not drift
    assert a.generate(unseeded, SAMPLED) == b.generate(unseeded, SAMPLED)  # engine seed sequence
    ids = lambda rs: [r.response_ids for r in rs]  # noqa: E731
    assert ids(a.generate(_requests([5, 7], n=3, seed0=100), SAMPLED)) != ids(a.generate(seeded, SAMPLED))
    other = TorchEngine(str(tiny_qwen3_dir), FP32, seed=3, engine_id=1)
    c = TorchEngine(str(tiny_qwen3_dir), FP32, seed=3)
    assert ids(other.generate(unseeded, SAMPLED)) != ids(c.generate(unseeded, SAMPLED))
    # The n completions of one request are different samples.
    res = a.generate(seeded, SAMPLED)
    assert len({r.response_ids for r in res[:3]}) > 1


def test_update_weights_bit_identical_and_atomic(tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32)
    before = eng.state_dict()
    sent = _random_state_dict(tiny_qwen3_dir, seed=1)
    bad = dict(sent)
    bad["model.layers.0.self_attn.q_proj.wieght"] = bad.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"q_proj\.wieght") as info:
        eng.update_weights(bad, version=1)
    assert "q_proj.weight" in str(info.value)  # the missing name is listed too
    wrong_shape = dict(sent, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        eng.update_weights(wrong_shape, version=1)
    assert eng.weight_version() == 0
    for k, v in eng.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a rejected update"

    metrics = eng.update_weights(sent, version=7)
    assert metrics["bytes"] == sum(v.numel() * 4 for v in sent.values()) and metrics["update_s"] >= 0
    got = eng.state_dict()
    assert got.keys() == sent.keys()
    for k, v in sent.items():
        assert torch.equal(got[k], v), k
    assert eng.weight_version() == 7 and eng.health() == {"ok": True, "version": 7, "engine_id": 0}
    res = eng.generate(_requests([3], n=1), SAMPLED)
    assert res[0].weight_version == 7
    ref = _teacher_forced(_hf_model(tiny_qwen3_dir, sent), _requests([3])[0].prompt_ids,
                          res[0].response_ids, SAMPLED.temperature)
    torch.testing.assert_close(torch.tensor(res[0].logprobs), ref, atol=1e-5, rtol=0)


def test_fp8_engine_weights_are_block_quantized(tiny_qwen3_moe_dir) -> None:
    fp8 = PrecisionConfig(rollout_quant="fp8_block", quant_block_size=32)
    eng = TorchEngine(str(tiny_qwen3_moe_dir), fp8)
    sent = _random_state_dict(tiny_qwen3_moe_dir, seed=2)
    eng.update_weights(sent, version=1)
    got = eng.state_dict()
    n_quantized = 0
    for k, v in sent.items():
        if not is_quantized_weight(k, v):
            assert torch.equal(got[k], v), f"{k} is not a quantized weight but changed"
            continue
        n_quantized += 1
        assert not torch.equal(got[k], v), f"{k} should be fp8-quantized"
        # per 32 x 32 tile (per expert for 3-D): |w - w_hat| <= amax(tile) / 28
        tiles = v.unfold(-2, 32, 32).unfold(-2, 32, 32)  # [..., Mb, Nb, 32, 32]
        diff = (got[k] - v).unfold(-2, 32, 32).unfold(-2, 32, 32)
        bound = tiles.abs().amax(dim=(-2, -1), keepdim=True) * 16 / 448
        assert bool((diff.abs() <= bound * (1 + 1e-6)).all()), k
    assert n_quantized == 2 * 6  # q, k, v, o, experts.gate_up_proj, experts.down_proj per layer
    # The engine's log-probs are those of the fake-quantized model.
    reqs = _requests([2, 6], n=1)
    res = eng.generate(reqs, SAMPLED)
    model = _hf_model(tiny_qwen3_moe_dir, apply_rollout_quant(sent, fp8))
    for r, q in zip(res, reqs, strict=True):
        ref = _teacher_forced(model, q.prompt_ids, r.response_ids, SAMPLED.temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)


def test_bf16_engine_and_bad_requests(tiny_qwen3_dir) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig(rollout_dtype="bfloat16"))
    assert all(v.dtype == torch.bfloat16 for v in eng.state_dict().values())
    res = eng.generate(_requests([3, 5], n=2), SAMPLED)
    assert all(all(lp <= 0 for lp in r.logprobs) for r in res)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.generate([GenerateRequest(request_id="x", prompt_ids=())], SAMPLED)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
        eng.generate([GenerateRequest(request_id="x", prompt_ids=(1, 96))], SAMPLED)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(_requests([2]), SamplingParams(top_p=0.0))


def test_engine_as_ray_actor(ray_cluster, tiny_qwen3_dir, engine: TorchEngine) -> None:
    ray = ray_cluster
    actor = ray.remote(TorchEngine).options(num_cpus=0.5).remote(str(tiny_qwen3_dir), FP32, num_threads=1,
                                                                  engine_id=3)
    assert ray.get(actor.health.remote(), timeout=60) == {"ok": True, "version": 0, "engine_id": 3}
    reqs = _requests([2, 5], n=2)
    remote, local = ray.get(actor.generate.remote(reqs, SAMPLED), timeout=60), engine.generate(reqs, SAMPLED)
    # Same seeds -> same tokens; log-probs only to 1e-5 (1 vs 2 threads reduce in another order).
    assert [r.response_ids for r in remote] == [r.response_ids for r in local]
    torch.testing.assert_close(torch.tensor([x for r in remote for x in r.logprobs]),
                               torch.tensor([x for r in local for x in r.logprobs]), atol=1e-5, rtol=0)
    sent = _random_state_dict(tiny_qwen3_dir, seed=4)
    ray.get(actor.update_weights.remote(sent, 2), timeout=60)
    got = ray.get(actor.state_dict.remote(), timeout=60)
    assert all(torch.equal(got[k], v) for k, v in sent.items())
    assert ray.get(actor.weight_version.remote(), timeout=60) == 2
    ray.kill(actor)
