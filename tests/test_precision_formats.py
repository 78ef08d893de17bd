"""MXFP8, NVFP4 and INT4 quantizers: torchao references (bit for bit), hand-computed scales and
rounding, saturation, zeros, NaN / inf, padding, round-trip error bounds, and the STE gradient."""

from __future__ import annotations

import pytest
import torch

from miles.precision.int4 import dequantize_int4, fake_quantize_int4, fake_quantize_int4_ste, quantize_int4
from miles.precision.mx import E8M0_NAN, dequantize_mxfp8, e8m0_to_float, fake_quantize_mxfp8, quantize_mxfp8
from miles.precision.nvfp4 import (
    dequantize_nvfp4,
    e2m1_to_float,
    fake_quantize_nvfp4,
    quantize_nvfp4,
    round_to_e2m1,
)


def _wide_range(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Gaussian values whose columns span six decades (exercises many scale exponents)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])


# ---------------------------------------------------------------- MXFP8

@pytest.mark.parametrize("shape", [(64, 256), (2, 8, 64)])
def test_mxfp8_matches_torchao_bit_for_bit(shape: tuple[int, ...]) -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    x = _wide_range(shape)
    ref_scale, ref_q = mx.to_mx(x, torch.float8_e4m3fn, 32)
    q, bits = quantize_mxfp8(x)
    assert torch.equal(bits, ref_scale.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    ref_deq = mx.to_dtype(ref_q, ref_scale, torch.float8_e4m3fn, 32, torch.float32)
    assert torch.equal(dequantize_mxfp8(q, bits), ref_deq)


def test_mxfp8_hand_computed_block() -> None:
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 1.0, 0.3, -1.9, 2.0**-12
    q, bits = quantize_mxfp8(x)
    # amax = 1.9: floor(log2 1.9) = 0, k = 0 - 8 = -8, byte 119, X = 1/256
    assert bits.tolist() == [119]
    # 1.0 * 256 = 256 (exact); 0.3 * 256 = 76.8 -> 80 (spacing 8 in [64, 128));
    # -1.9 * 256 = -486.4 saturates to -448; 2^-12 * 256 = 2^-4 (exact e4m3 normal)
    assert q.float()[:4].tolist() == [256.0, 80.0, -448.0, 2.0**-4]
    assert dequantize_mxfp8(q, bits)[:4].tolist() == [1.0, 0.3125, -1.75, 2.0**-12]


def test_mxfp8_scale_range_zero_tiny_huge() -> None:
    x = torch.zeros(3, 32)
    x[1, 0] = 1e-40  # fp32 subnormal: k clamps to -127
    x[2, 5] = 2.0**120
    q, bits = quantize_mxfp8(x)
    assert bits[:, 0].tolist() == [0, 0, 127 + 120 - 8]
    assert e8m0_to_float(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0**-127, 1.0, 2.0**127]
    out = dequantize_mxfp8(q, bits)
    assert torch.equal(out[0], torch.zeros(32)) and out[2, 5].item() == 2.0**120


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_mxfp8_nonfinite_block_becomes_nan_scale(bad: float) -> None:
    x = torch.ones(2, 64)
    x[0, 40] = bad
    q, bits = quantize_mxfp8(x)
    assert bits[0].tolist() == [127 - 8, E8M0_NAN] and bits[1].tolist() == [119, 119]
    out = dequantize_mxfp8(q, bits)
    assert torch.isnan(out[0, 32:]).all() and torch.equal(out[0, :32], torch.ones(32))
    assert torch.equal(out[1], torch.ones(64))


def test_mxfp8_padding_and_error_bound() -> None:
    x = _wide_range((16, 40), seed=1)
    q, bits = quantize_mxfp8(x)
    assert q.shape == (16, 40) and bits.shape == (16, 2)
    padded = torch.nn.functional.pad(x, (0, 24))
    assert torch.equal(fake_quantize_mxfp8(x), fake_quantize_mxfp8(padded)[:, :40])
    xhat = dequantize_mxfp8(q, bits)
    scale = e8m0_to_float(bits).repeat_interleave(32, -1)[:, :40]
    scaled = (x / scale).abs()
    err = (xhat - x).abs()
    normal = (scaled >= 2.0**-6) & (scaled <= 448)
    assert (err[normal] <= 2.0**-4 * x.abs()[normal]).all()
    assert (err[scaled < 2.0**-6] <= 2.0**-10 * scale[scaled < 2.0**-6]).all()
    assert (err[scaled > 448] < (scaled[scaled > 448] - 448 + 1e-3) * scale[scaled > 448]).all()
    assert (err > 0).any()  # the test can see quantization at all


# ---------------------------------------------------------------- NVFP4

def test_e2m1_rounding_table_ties_to_even_and_saturation() -> None:
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.3, -6.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -6.0]
    assert e2m1_to_float(round_to_e2m1(x)).tolist() == expected
    assert round_to_e2m1(torch.tensor([-6.0, 6.0, -0.1])).tolist() == [15, 7, 8]  # sign bit 8; -0 keeps it


@pytest.mark.parametrize("shape", [(64, 256), (4, 48)])
def test_nvfp4_matches_torchao_bit_for_bit(shape: tuple[int, int]) -> None:
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    x = _wide_range(shape, seed=2)
    ts_ref = nv.per_tensor_amax_to_scale(x.abs().amax())
    ref_bs, ref_packed = nv.nvfp4_quantize(x, 16, ts_ref)
    codes, bs, ts = quantize_nvfp4(x)
    assert torch.equal(ts, ts_ref)
    assert torch.equal(bs.view(torch.uint8), ref_bs.view(torch.uint8))
    assert torch.equal(codes, kernels.unpack_uint4(ref_packed))
    ref = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=ts_ref).dequantize(torch.float32)
    torch.testing.assert_close(dequantize_nvfp4(codes, bs, ts), ref, rtol=1e-6, atol=0)


def test_nvfp4_hand_computed_tensor() -> None:
    x = torch.zeros(2, 16)
    x[0, :3] = torch.tensor([2688.0, 1000.0, -10.0])  # tensor amax 2688 = 448 * 6: s_t = 1
    x[1, :2] = torch.tensor([6.0, 2.9])  # block amax 6: s_b = 1
    codes, bs, ts = quantize_nvfp4(x)
    assert ts.item() == 1.0 and bs.float().tolist() == [[448.0], [1.0]]
    # row 0: 1000 / 448 = 2.23 -> 2; -10 / 448 = -0.022 -> -0; row 1: 2.9 -> 3
    out = dequantize_nvfp4(codes, bs, ts)
    assert out[0, :3].tolist() == [2688.0, 896.0, 0.0] and out[1, :2].tolist() == [6.0, 3.0]


def test_nvfp4_zeros_nonfinite_and_error_bound() -> None:
    assert torch.equal(fake_quantize_nvfp4(torch.zeros(3, 16)), torch.zeros(3, 16))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            quantize_nvfp4(torch.tensor([[1.0, bad]]))
    x = torch.randn(32, 80, generator=torch.Generator().manual_seed(3))
    codes, bs, ts = quantize_nvfp4(x)
    s = (bs.float() * ts).repeat_interleave(16, -1)
    scaled = (x / s).abs()
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    bound = (half_step + (scaled - 6).clamp(min=0)) * s * (1 + 1e-6)
    err = (dequantize_nvfp4(codes, bs, ts) - x).abs()
    assert (err <= bound).all() and (err > 0).any()


# ---------------------------------------------------------------- INT4

def test_int4_hand_computed_group() -> None:
    w = torch.tensor([[7.0, -3.5, 1.5, 0.49, 2.5, -7.0, 0.0, 0.51]])
    q, s = quantize_int4(w, group=8)
    assert s.tolist() == [[1.0]]  # amax 7 / 7
    assert q.tolist() == [[7, -4, 2, 0, 2, -7, 0, 1]]  # round half to even: -3.5 -> -4, 2.5 -> 2
    w2 = torch.tensor([[0.7, 0.1, 0.0, 0.0]])
    q2, s2 = quantize_int4(w2, group=2)
    assert q2.tolist() == [[7, 1, 0, 0]] and s2[0, 1].item() == 1.0  # all-zero group: scale 1
    assert torch.allclose(dequantize_int4(q2, s2, group=2), torch.tensor([[0.7, 0.1, 0.0, 0.0]]))


def test_int4_error_bound_padding_and_nonfinite() -> None:
    w = torch.randn(3, 16, 200, generator=torch.Generator().manual_seed(4))
    q, s = quantize_int4(w, group=64)
    assert q.dtype == torch.int8 and s.shape == (3, 16, 4)
    assert q.min() >= -7 and q.max() <= 7
    err = (dequantize_int4(q, s, group=64) - w).abs()
    assert (err <= s.repeat_interleave(64, -1)[..., :200] / 2 * (1 + 1e-6)).all() and (err > 0).any()
    with pytest.raises(ValueError, match="non-finite"):
        quantize_int4(torch.tensor([1.0, float("nan")]))


def test_int4_ste_forward_is_fake_quant_and_gradient_passes_straight() -> None:
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    upstream = torch.randn(8, 32, generator=torch.Generator().manual_seed(6))
    out = fake_quantize_int4_ste(w, group=16)
    assert torch.equal(out.detach(), fake_quantize_int4(w.detach(), group=16))
    assert not torch.equal(out.detach(), w.detach())
    (out * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)


def test_int4_qat_learns_weights_whose_quantized_values_fit() -> None:
    """Gradient descent through the STE lowers the loss of the *quantized* model on a regression."""
    g = torch.Generator().manual_seed(7)
    x, w_true = torch.randn(256, 32, generator=g), torch.randn(4, 32, generator=g)
    y = x @ fake_quantize_int4(w_true, group=32).T
    w = torch.nn.Parameter(torch.randn(4, 32, generator=g))
    opt = torch.optim.SGD([w], lr=0.05)

    def loss() -> torch.Tensor:
        return ((x @ fake_quantize_int4_ste(w, group=32).T - y) ** 2).mean()

    start = loss().item()
    for _ in range(200):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.05 * start
