"""FP8 block-wise quantization: error bounds, shapes, edge tiles, zeros, exactness, dtypes, selection."""

from __future__ import annotations

import pytest
import torch

from miles.config.schema import PrecisionConfig
from miles.precision.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_blockwise,
    fake_quantize_fp8_blockwise,
    quantize_fp8_blockwise,
)
from miles.precision.recipe import apply_rollout_quant, is_quantized_weight

FP32_SLACK = 1e-6  # fp32 rounding of w / s and q * s, relative


def _block_view(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element tile scale broadcast back to [M, N] (test helper)."""
    return x.repeat_interleave(block, 0).repeat_interleave(block, 1)


def _all_finite_e4m3() -> torch.Tensor:
    """Every finite float8_e4m3fn value, as fp32."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    return v[torch.isfinite(v)].unique()


@pytest.mark.parametrize("shape,block", [((130, 200), 128), ((64, 65), 32), ((7, 3), 4), ((1, 1), 128)])
def test_scale_shapes_and_edge_tiles(shape: tuple[int, int], block: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape)
    q, s = quantize_fp8_blockwise(w, block)
    mb, nb = -(-shape[0] // block), -(-shape[1] // block)
    assert q.shape == w.shape and q.dtype == FP8_DTYPE
    assert s.shape == (mb, nb) and s.dtype == torch.float32
    # Each scale is amax of the tile's *real* elements / 448 (edge tiles included).
    for i in range(mb):
        for j in range(nb):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            assert s[i, j].item() == pytest.approx(tile.abs().max().item() / FP8_MAX, rel=1e-6)
    # The largest element of every tile lands on +-448.
    assert q.float().abs().max().item() == FP8_MAX


def test_round_trip_error_bounds() -> None:
    """|w - w_hat| <= 2^-4 |w| + 2^-10 s per element, and <= 16 s = amax/28 per tile."""
    torch.manual_seed(0)
    block = 16
    w = torch.randn(70, 45) * torch.logspace(-3, 3, 45)  # columns span 6 decades: tiles differ
    w[3, 4] = 1e4  # an outlier only degrades its own tile
    q, s = quantize_fp8_blockwise(w, block)
    w_hat = dequantize_fp8_blockwise(q, s, block)
    s_full = _block_view(s, block)[: w.shape[0], : w.shape[1]]
    err = (w - w_hat).abs()
    assert bool((err <= (2**-4 * w.abs() + 2**-10 * s_full) * (1 + FP32_SLACK)).all())
    assert bool((err <= 16 * s_full * (1 + FP32_SLACK)).all())
    # The bound is not vacuous: e4m3 rounding does move values by a visible fraction.
    assert (err / w.abs()).max().item() > 2**-6
    # Tiles away from the outlier keep their own resolution.
    far = err[block:, block:] / w[block:, block:].abs().clamp_min(1e-30)
    normal = w[block:, block:].abs() > 2**-6 * s_full[block:, block:]
    assert far[normal].max().item() <= 2**-4 * (1 + FP32_SLACK)


def test_zero_tile_is_exact_and_finite() -> None:
    w = torch.randn(8, 8)
    w[:4, 4:] = 0.0
    q, s = quantize_fp8_blockwise(w, 4)
    assert s[0, 1].item() == 1.0  # guarded scale for an all-zero tile
    assert bool(torch.isfinite(s).all()) and bool(torch.isfinite(q.float()).all())
    w_hat = dequantize_fp8_blockwise(q, s, 4)
    assert bool((w_hat[:4, 4:] == 0).all())
    assert bool((fake_quantize_fp8_blockwise(torch.zeros(3, 5), 2) == 0).all())


def test_exactly_representable_values_survive() -> None:
    """Values on the e4m3 grid times a power-of-two scale, with 448 in every tile, round-trip exactly."""
    grid = _all_finite_e4m3()
    block = 16
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(len(grid), (32, 48), generator=g)
    w = grid[idx]
    w[::block, ::block] = FP8_MAX  # every tile's amax is 448 -> scale exactly 2^k below
    for k in (-20, 0, 7):
        wk = w * 2.0**k
        q, s = quantize_fp8_blockwise(wk, block)
        assert bool((s == 2.0**k).all())
        assert torch.equal(dequantize_fp8_blockwise(q, s, block), wk)
        assert torch.equal(fake_quantize_fp8_blockwise(wk, block), wk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_handling(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 24).to(dtype)
    q, s = quantize_fp8_blockwise(w, 16)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    out = fake_quantize_fp8_blockwise(w, 16)
    assert out.dtype == dtype and out.shape == w.shape
    assert dequantize_fp8_blockwise(q, s, 16, torch.float32).dtype == torch.float32
    # fake quant in a narrow dtype = fp32 dequant rounded once to that dtype
    assert torch.equal(out, dequantize_fp8_blockwise(q, s, 16, torch.float32).to(dtype))


def test_leading_dims_are_quantized_independently() -> None:
    """Fused MoE experts [E, out, in]: each expert gets its own tiles and scales."""
    torch.manual_seed(0)
    w = torch.randn(3, 20, 12) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]
    q, s = quantize_fp8_blockwise(w, 8)
    assert s.shape == (3, 3, 2)
    for e in range(3):
        qe, se = quantize_fp8_blockwise(w[e], 8)
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="block size"):
        quantize_fp8_blockwise(torch.randn(4, 4), 0)
    with pytest.raises(ValueError, match=r"\[..., M, N\]"):
        quantize_fp8_blockwise(torch.randn(4), 2)
    q, s = quantize_fp8_blockwise(torch.randn(8, 8), 4)
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp8_blockwise(q, s[:1], 4)


def _moe_state_dict(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


def test_apply_rollout_quant_selects_linear_and_expert_weights(tiny_qwen3_moe_dir) -> None:
    sd = _moe_state_dict(tiny_qwen3_moe_dir)
    fp8 = PrecisionConfig(rollout_quant="fp8_block", quant_block_size=48)
    out = apply_rollout_quant(sd, fp8)
    changed = {k for k in sd if not torch.equal(sd[k], out[k])}
    patterns = ("_proj.weight", "experts.gate_up_proj", "experts.down_proj")
    expected = {k for k in sd if any(p in k for p in patterns)}
    assert changed == expected
    assert {k for k in sd if is_quantized_weight(k, sd[k])} == expected
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.norm.weight"):
        assert out[kept] is sd[kept]
    # 3-D expert tensors are tiled per expert: 48 does not divide out=128, so tiles of a
    # flattened [E * out, in] matrix would straddle experts and give other numbers.
    k = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(out[k], torch.stack([fake_quantize_fp8_blockwise(e, 48) for e in sd[k]]))
    flat = fake_quantize_fp8_blockwise(sd[k].reshape(-1, sd[k].shape[-1]), 48).reshape(sd[k].shape)
    assert not torch.equal(out[k], flat)


def test_apply_rollout_quant_module_matches_state_dict_and_none_is_noop(tiny_qwen3_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_rollout_quant(sd, PrecisionConfig()) is sd
    fp8 = PrecisionConfig(rollout_quant="fp8_block", quant_block_size=32)
    assert apply_rollout_quant(model, fp8) is model
    expected = apply_rollout_quant(sd, fp8)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    with pytest.raises(ValueError, match="weight format .fp4_bogus. is not supported"):
        apply_rollout_quant(sd, PrecisionConfig(rollout_quant="fp4_bogus"))  # type: ignore[arg-type]
