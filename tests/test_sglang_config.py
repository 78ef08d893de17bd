"""``rollout=sglang`` before any server starts: config, class checks, refusals, the interpreter lookup.

No SGLang needed (these run in the main suite); tests/test_sglang.py drives real servers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from miles.backends.contract import check_engine_class
from miles.config import ConfigError, validate
from miles.config.schema import AdapterConfig, PrecisionConfig
from miles.core.plan import backends
from miles.rollout.sglang_engine import SGLangEngine, SGLangOffloadingEngine
from miles.rollout.sglang_lora import adapter_shapes
from miles.rollout.sglang_server import PYTHON_ENV, find_python
from miles.rollout.sglang_weights import _layout, served_weights, split_buckets
from miles.rollout.sglang_weights import weights_dir as _weights_dir


def _run(*overrides: str):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=["rollout=sglang", *overrides]))


def test_rollout_sglang_resolves_to_the_engine_with_every_shipped_knob() -> None:
    b = backends(_run())  # placement.offload_engines=null: the CPU engine cannot release memory, so it keeps it
    assert b.engine is SGLangEngine and not b.offload
    assert {"python", "max_total_tokens", "radix_cache", "health_timeout_s"} <= set(b.engine_kwargs)


def test_offloading_engines_on_sglang_fail_before_ray_with_what_to_set() -> None:
    with pytest.raises(ConfigError, match=r"placement.offload_engines=true, but rollout.engine .*SGLangEngine has no "
                                          r"release_memory\(\) / resume_memory\(\). Set placement.offload_engines="
                                          r"false .*on a GPU, .*SGLangOffloadingEngine"):
        backends(_run("placement.offload_engines=true"))
    check_engine_class(SGLangOffloadingEngine, offload=True)  # the GPU class has them


@pytest.mark.parametrize("kwargs,message", [
    (dict(deterministic=True), "deterministic=true needs a GPU attention backend"),
    (dict(weight_load="nfs"), r"weight_load='nfs'; valid: tensor, distributed, disk"),
    (dict(weight_bucket_mb=0), "weight_bucket_mb must be > 0"),
    (dict(adapter=AdapterConfig(kind="lora"), adapter_names=("a", "b")), "lm_head with 2 adapters"),
    (dict(adapter=AdapterConfig(kind="lora", target_modules=("q_proj", "embed_tokens"))),
     r"serves LoRA on .*found \['embed_tokens'\]"),
    (dict(health_timeout_s=0), "health_timeout_s must be > 0"),
])
def test_what_sglang_cannot_do_on_cpu_is_refused_before_a_server_starts(tiny_qwen3_dir: Path, kwargs, message) -> None:
    precision = kwargs.pop("precision", PrecisionConfig())
    with pytest.raises(ValueError, match=message):
        SGLangEngine(str(tiny_qwen3_dir), precision, **kwargs)
    with pytest.raises(ValueError, match="SGLangOffloadingEngine needs a GPU"):
        SGLangOffloadingEngine(str(tiny_qwen3_dir), PrecisionConfig(), device="cpu")


def test_a_missing_sglang_venv_says_how_to_make_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"no SGLang interpreter at .*nope \(rollout.engine.python\). Run "
                                                r"scripts/setup_sglang.sh"):
        find_python(str(tmp_path / "nope"))
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "env-python"))
    with pytest.raises(FileNotFoundError, match=rf"env-python \(\${PYTHON_ENV}\)"):
        find_python()
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_python(str(exe)) == exe


def test_weight_directories_of_dead_processes_are_removed() -> None:
    mine = _weights_dir(0)
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    stale = mine.parent / f"{dead_pid}-engine0-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x")
    fresh = _weights_dir(1)
    try:
        assert not stale.exists() and mine.exists() and fresh.name.startswith(f"{os.getpid()}-engine1-")
    finally:
        for d in (mine, fresh):
            d.rmdir()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_the_weights_sent_to_sglang_are_the_torch_engines_under_every_recipe(tiny_qwen3_dir: Path, recipe: str,
                                                                              dtype: str) -> None:
    """What a full update (or the start-up push) sends the server equals the weights the torch engine
    computes with under the same recipe, bit for bit."""
    from safetensors.torch import load_file

    from miles.rollout.torch_engine import TorchEngine

    run = _run(f"precision={recipe}", f"precision.rollout_dtype={dtype}")
    state = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    sent = served_weights(state, run.precision, getattr(torch, dtype))
    engine = TorchEngine(str(tiny_qwen3_dir), run.precision, num_threads=1, max_batch_size=2)
    try:
        held = engine.model.state_dict()
        assert set(sent) == set(held)
        for k, v in sent.items():
            assert v.dtype == held[k].dtype and torch.equal(v, held[k]), k
        assert not torch.equal(sent["model.layers.0.mlp.up_proj.weight"],
                               state["model.layers.0.mlp.up_proj.weight"].to(getattr(torch, dtype)))
    finally:
        engine.close()


def test_adapter_names_and_shapes_are_peft_s(tiny_qwen3_dir: Path) -> None:
    """The PEFT keys and shapes the SGLang engine checks adapter updates against are those the trainer
    sends (:func:`miles.adapters.lora.sync_state` of a peft-wrapped model)."""
    from transformers import AutoModelForCausalLM

    from miles.adapters import lora
    from miles.rollout.sglang_wire import Checkpoint

    cfg = AdapterConfig(kind="lora", rank=3)
    model = lora.add_adapters(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), cfg, ("default",), trainable=True)
    expected = {k: tuple(v.shape) for k, v in lora.adapter_state(model, "default").items()}
    assert adapter_shapes(cfg, Checkpoint.read(tiny_qwen3_dir).shapes) == expected


def test_buckets_keep_order_and_alignment() -> None:
    named = [("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(5)), ("c", torch.zeros(40)),
             ("d", torch.zeros(2))]
    buckets = split_buckets(named, bucket_bytes=64)
    assert [[k for k, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]  # c is larger than a bucket: alone
    meta, size = _layout(buckets[0])
    assert [(m.start_idx, m.end_idx) for m in meta] == [(0, 6), (8, 28)] and size == 28  # b starts on 4 bytes


def test_lora_with_sglang_is_accepted_and_what_it_cannot_serve_is_refused() -> None:
    b = backends(_run("adapter=lora"))
    assert b.engine is SGLangEngine and b.engine_kwargs["adapter"].kind == "lora"
    tenants = {"rollout": {"engine": {"_target_": "miles.rollout.sglang_engine.SGLangEngine"}},
               "adapter": {"kind": "lora"}, "tenants": [{"name": "a", "task": "largest"}, {"name": "b", "task": "arithmetic"}]}
    with pytest.raises(ConfigError, match="lm_head with 2 adapters"):
        backends(validate(tenants))
    tenants["adapter"]["target_modules"] = ["q_proj", "v_proj"]  # without lm_head: several adapters are served
    assert backends(validate(tenants)).engine_kwargs["adapter_names"] == ("a", "b")


def test_fused_moe_experts_are_sent_under_the_checkpoints_names_quantized_as_the_torch_engine(
        tiny_qwen3_moe_dir: Path) -> None:
    """A transformers 5 MoE state dict fuses each layer's experts; the checkpoint (and SGLang's loader)
    names them one by one. Split and fused forms map onto each other exactly, and the recipe quantizes
    the fused tensors (fp8 tiles of 128 x 128 spanning an expert's gate and up rows), as the torch
    engine does, before the split."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.rollout.sglang_wire import fuse_experts, split_experts
    from miles.rollout.torch_engine import TorchEngine

    on_disk = load_file(str(tiny_qwen3_moe_dir / "model.safetensors"))
    fused = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.experts.0.up_proj.weight" in on_disk
    for a, b in ((split_experts(fused), on_disk), (fuse_experts(on_disk), fused)):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    precision = _run("precision=fp8", "precision.rollout_dtype=float32").precision
    sent = split_experts(served_weights(fuse_experts(on_disk), precision, torch.float32))
    engine = TorchEngine(str(tiny_qwen3_moe_dir), precision, num_threads=1, max_batch_size=2)
    try:
        held = split_experts(engine.model.state_dict())
    finally:
        engine.close()
    assert set(sent) == set(on_disk) and all(torch.equal(sent[k], held[k]) for k in sent)
    one_by_one = served_weights(on_disk, precision, torch.float32)  # gate and up with scales of their own
    assert any(not torch.equal(one_by_one[k], sent[k]) for k in sent if k.endswith(("gate_proj.weight", "up_proj.weight"))
               and ".experts." in k)
