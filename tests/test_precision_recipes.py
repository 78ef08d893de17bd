"""Precision recipes: composition, bad combinations refused before Ray, mismatch-correction
resolution, and the trainer's quantization-aware forward (same numbers as the engine's weights,
gradients straight through)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from miles.config import ConfigError, validate
from miles.config.schema import PrecisionConfig
from miles.precision.recipe import (
    DEFAULT_TIS_CLIP,
    apply_rollout_quant,
    effective_tis_clip,
    mismatch_warning,
    numerics_differ,
    quantize_train_forward,
)


def _run(overrides: list[str]):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=overrides))


@pytest.mark.parametrize("recipe,rollout,train,block,clip", [
    ("fp32", "none", "none", 128, None),
    ("bf16", "none", "none", 128, None),
    ("fp8", "fp8_block", "none", 128, 2.0),
    ("mxfp8", "mxfp8", "mxfp8", 32, None),
    ("nvfp4", "nvfp4", "none", 16, 2.0),
    ("int4", "int4", "none", 128, 2.0),
    ("int4_qat", "int4", "int4", 128, None),
])
def test_shipped_recipes_and_their_mismatch_correction(recipe, rollout, train, block, clip) -> None:
    p = _run(["model=qwen3_moe", f"precision={recipe}"]).precision
    assert (p.rollout_quant, p.train_quant, p.quant_block_size) == (rollout, train, block)
    assert effective_tis_clip(p) == clip
    assert numerics_differ(p) == (clip is not None)


@pytest.mark.parametrize("recipe,clip", [("fp32", None), ("bf16", 2.0), ("fp8", 2.0), ("mxfp8", 2.0),
                                         ("int4_qat", 2.0)])
def test_another_implementation_of_the_model_in_bf16_counts_as_other_numerics(recipe: str, clip: float | None) -> None:
    """A trainer whose model is not the engine's (``same_forward=False``: megatron) corrects bf16 recipes too."""
    p = _run([f"precision={recipe}"]).precision
    assert effective_tis_clip(p, same_forward=False) == clip
    assert numerics_differ(p, same_forward=False) == (clip is not None)
    off = dataclasses.replace(p, mismatch_correction="off")
    assert (mismatch_warning(off, same_forward=False) is not None) == (clip is not None)
    if recipe in ("bf16", "mxfp8", "int4_qat"):  # the same recipes with the engine's own model: nothing to correct
        assert effective_tis_clip(p) is None and mismatch_warning(off) is None


def test_the_driver_says_when_correction_is_on_for_the_megatron_trainers_bf16(caplog: pytest.LogCaptureFixture) -> None:
    from miles.core.run import build_components

    for trainer, said in (("megatron", True), ("fsdp", False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="miles"):
            build_components(_run([f"trainer={trainer}", "precision=int4_qat"]))
        assert ("precision int4_qat: mismatch correction on (tis at 2.0, precision.mismatch_correction=auto)"
                in caplog.text) == said, trainer
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles"):
        build_components(_run(["trainer=megatron", "precision=bf16", "precision.mismatch_correction=off"]))
    assert "another implementation of the model" in caplog.text


def test_mismatch_correction_modes() -> None:
    same, differ = PrecisionConfig(), PrecisionConfig(rollout_dtype="bfloat16")
    assert numerics_differ(differ) and not numerics_differ(same)
    assert effective_tis_clip(same) is None
    assert effective_tis_clip(differ) == DEFAULT_TIS_CLIP  # auto: on, default threshold
    assert effective_tis_clip(dataclasses.replace(differ, tis_clip=3.0)) == 3.0
    assert effective_tis_clip(dataclasses.replace(same, tis_clip=3.0)) == 3.0  # set explicitly: applied
    assert effective_tis_clip(dataclasses.replace(same, mismatch_correction="on")) == DEFAULT_TIS_CLIP
    off = dataclasses.replace(differ, tis_clip=3.0, mismatch_correction="off")
    assert effective_tis_clip(off) is None
    assert "mismatch_correction=off" in mismatch_warning(off)
    assert mismatch_warning(dataclasses.replace(same, mismatch_correction="off")) is None
    assert mismatch_warning(differ) is None


def test_off_with_differing_numerics_warns_when_the_run_is_built(caplog: pytest.LogCaptureFixture) -> None:
    from miles.core.run import build_components

    run = _run(["precision=fp8", "precision.mismatch_correction=off"])
    with caplog.at_level(logging.WARNING, logger="miles"):
        build_components(run)
    assert any("mismatch_correction=off" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("overrides,match", [
    (["precision=int4_qat", "precision.train_quant=mxfp8"], "trains through the format the engine serves"),
    (["precision=fp32", "precision.train_quant=int4"], "precision.train_quant=int4 with precision.rollout_quant=none"),
    (["precision=fp8", "precision.rollout_quant=mxfp8"], "set precision.quant_block_size=32"),
    (["precision=nvfp4", "precision.quant_block_size=32"], "nvfp4 blocks are 16 elements"),
])
def test_bad_combinations_are_refused_by_validation(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _run(overrides)


def test_backends_refuse_formats_they_cannot_run() -> None:
    from miles.core.plan import backends
    from miles.rollout.sglang_engine import SGLangEngine

    for recipe in ("fp8", "mxfp8", "nvfp4", "int4", "int4_qat"):  # served as the torch engine serves them
        assert backends(_run(["rollout=sglang", f"precision={recipe}"])).engine is SGLangEngine
    with pytest.raises(ConfigError, match="true_on_policy=true: the SGLang engine's kernels are not the trainer's"):
        backends(_run(["rollout=sglang", "precision=fp32", "precision.true_on_policy=true"]))
    # megatron: the 1-D block formats only (tests/test_megatron_replay_precision.py); its check imports no megatron
    backends(_run(["trainer=megatron", "precision=int4_qat"]))
    with pytest.raises(ConfigError, match="precision.train_quant=nvfp4: the megatron trainer quantizes its forward "
                                          "with the 1-D block formats"):
        backends(_run(["trainer=megatron", "precision=nvfp4", "precision.train_quant=nvfp4"]))


def _load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("fmt,block", [("int4", 32), ("mxfp8", 32), ("nvfp4", 16), ("fp8_block", 32)])
@pytest.mark.parametrize("moe", [False, True])
def test_train_forward_computes_with_the_engines_weights_and_gradients_pass_straight(
    fmt: str, block: int, moe: bool, tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path
) -> None:
    path = tiny_qwen3_moe_dir if moe else tiny_qwen3_dir
    precision = PrecisionConfig(rollout_quant=fmt, train_quant=fmt, quant_block_size=block)
    qat, served = _load(path), apply_rollout_quant(_load(path), precision)
    master = {k: v.clone() for k, v in qat.state_dict().items()}
    wrapped = quantize_train_forward(qat, precision)
    assert any(".experts." in n for n in wrapped) == moe and any("q_proj" in n for n in wrapped)
    assert not any("embed" in n or "lm_head" in n or "norm" in n or "mlp.gate." in n for n in wrapped)

    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    out_qat, out_served = qat(input_ids=ids).logits, served(input_ids=ids).logits
    assert torch.equal(out_qat, out_served)  # the trainer sees exactly what the engine serves
    assert not torch.equal(out_qat, _load(path)(input_ids=ids).logits)
    out_qat.square().mean().backward()
    out_served.square().mean().backward()
    grads_qat, grads_served = dict(qat.named_parameters()), dict(served.named_parameters())
    for name in wrapped:  # STE: d loss / d master weight = d loss / d quantized weight
        assert torch.equal(grads_qat[name].grad, grads_served[name].grad), name
    assert {k: v for k, v in qat.state_dict().items()}.keys() == master.keys()
    assert all(torch.equal(v, master[k]) for k, v in qat.state_dict().items())  # master weights untouched


def test_train_quant_none_wraps_nothing(tiny_qwen3_dir: Path) -> None:
    model = _load(tiny_qwen3_dir)
    forward = model.model.layers[0].self_attn.q_proj.forward
    assert quantize_train_forward(model, PrecisionConfig()) == []
    assert model.model.layers[0].self_attn.q_proj.forward == forward


def test_train_forward_quantizes_in_the_compute_dtype_as_the_engine_does() -> None:
    """``dtype=bfloat16`` (a forward under bf16 autocast over fp32 weights, the megatron trainer's): the weight the
    forward sees is the engine's quantization of its bf16 weights, exactly, and gradients pass straight through."""

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 96, generator=torch.Generator().manual_seed(0)))

        def forward(self) -> torch.Tensor:
            return self.weight

    precision = PrecisionConfig(rollout_quant="int4", train_quant="int4", quant_block_size=32)
    model = Probe()
    assert quantize_train_forward(model, precision, select=lambda name, _t: name == "weight",
                                  dtype=torch.bfloat16) == ["weight"]
    seen = model()
    served = apply_rollout_quant({"layer.weight": model.weight.detach().to(torch.bfloat16)}, precision)["layer.weight"]
    assert seen.dtype == torch.float32 and torch.equal(seen, served.float())
    assert not torch.equal(seen, apply_rollout_quant({"layer.weight": model.weight.detach()}, precision)["layer.weight"])
    seen.square().sum().backward()
    assert torch.equal(model.weight.grad, 2 * seen.detach())
