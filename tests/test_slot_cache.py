"""The fast forward's decode steps (miles.rollout.slot_cache): concatenated per-layer weights, RoPE's rotate-half
as a matmul, the additive attention bias."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.schema import PrecisionConfig
from miles.rollout.slot_cache import FastQwen3, _DecodeWeights
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, GenerateResult, SamplingParams

FP32 = PrecisionConfig()
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=12)


def _requests(lengths: list[int]) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"r{i}", prompt_ids=tuple(3 + (7 * i + 5 * t) % 87 for t in range(length)),
                            n=2, seed=i) for i, length in enumerate(lengths)]


def _unfused(eng: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of ``eng`` run one projection and norm at a time (no concatenated weights)."""
    monkeypatch.setattr(eng._fast, "_fused", lambda i, layer: None)


def _assert_same_to_rounding(a: list[GenerateResult], b: list[GenerateResult]) -> None:
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    torch.testing.assert_close(torch.tensor([x for r in a for x in r.logprobs]),
                               torch.tensor([x for r in b for x in r.logprobs]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_fused_decode_layers_match_the_per_projection_decode(fixture: str, request: pytest.FixtureRequest,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    eng = TorchEngine(str(request.getfixturevalue(fixture)), FP32, seed=0, max_batch_size=4)
    try:
        assert eng.fast_forward and eng._fast.matmul_decode
        reqs = _requests([3, 8, 5])
        fused = eng.generate(reqs, SAMPLED)
        held = [eng._fast._decode_weights[i] for i in range(len(eng._fast.layers))]
        assert all(w is not None for w in held)
        dense = fixture == "tiny_qwen3_dir"  # the MoE layers keep their MLP module (router hooks)
        assert all((w.gate_up is not None) == dense for w in held)
        _unfused(eng, monkeypatch)
        _assert_same_to_rounding(fused, eng.generate(reqs, SAMPLED))
    finally:
        eng.close()


def test_fused_decode_weights_follow_weight_updates(tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=4)
    ref = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=4)
    try:
        reqs = _requests([4, 6])
        eng.generate(reqs, SAMPLED)  # builds the concatenated weights from the loaded ones
        before = eng._fast._decode_weights[0].qkv.clone()
        g = torch.Generator().manual_seed(3)
        sent = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in eng.state_dict().items()}
        for e in (eng, ref):
            e.update_weights(sent, 1)
        _unfused(ref, monkeypatch)
        _assert_same_to_rounding(eng.generate(reqs, SAMPLED), ref.generate(reqs, SAMPLED))
        attn = eng.model.model.layers[0].self_attn
        now = eng._fast._decode_weights[0].qkv
        assert not torch.equal(now, before)
        assert torch.equal(now, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        eng.release_memory()
        eng.resume_memory()  # the weights come back in new storage: rebuilt at the next decode step
        _assert_same_to_rounding(eng.generate(reqs, SAMPLED), ref.generate(reqs, SAMPLED))
    finally:
        eng.close()
        ref.close()


def test_layers_with_wrapped_projections_are_not_fused(tiny_qwen3_dir: Path) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=2)
    eng.close()
    layer = eng.model.model.layers[0]
    fast = eng._fast
    assert _DecodeWeights.build(layer, fast.heads, fast.kv_heads, fast.head_dim) is not None

    class Wrapped(torch.nn.Module):  # as a LoRA layer: not a plain nn.Linear
        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.base, self.weight, self.bias = base, base.weight, None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x)

    layer.self_attn.k_proj = Wrapped(layer.self_attn.k_proj)
    assert _DecodeWeights.build(layer, fast.heads, fast.kv_heads, fast.head_dim) is None
    assert FastQwen3(eng.model)._fused(0, layer) is None


def test_rotation_matrix_is_rotate_half_exactly(tiny_qwen3_dir: Path) -> None:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=2)
    eng.close()
    x = torch.randn(3, 5, 1, eng._fast.head_dim, generator=torch.Generator().manual_seed(0))
    half = x.shape[-1] // 2
    assert torch.equal(x @ eng._fast._rotation(x), torch.cat((-x[..., half:], x[..., :half]), dim=-1))


def test_decode_bias_is_zero_where_attended_and_minus_infinity_elsewhere() -> None:
    from miles.rollout.slot_cache import decode_bias

    mask = torch.tensor([[True, False, True]])
    bias = decode_bias(mask, torch.float32)
    assert bias.dtype == torch.float32 and bias.tolist() == [[0.0, float("-inf"), 0.0]]
    assert decode_bias(mask, torch.bfloat16).dtype == torch.bfloat16
