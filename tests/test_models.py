"""Model specs, the task tokenizer, and built checkpoints (real HF save/load, no mocks)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from miles.config.validate import validate
from miles.models.checkpoint import ensure_checkpoint
from miles.models.qwen3 import qwen3_moe_spec, qwen3_spec
from miles.models.tokenizer import encode_prompt, train_tokenizer
from miles.tasks.arithmetic import ArithmeticTask


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(ArithmeticTask().corpus(), 320)


# --- tokenizer ---------------------------------------------------------------------------------

def test_tokenizer_special_tokens(tokenizer) -> None:
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert len(tokenizer) <= 320


def test_digits_are_split_one_per_token(tokenizer) -> None:
    ids = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == list("12345")
    # words still merge: the BPE learned the task's vocabulary
    assert len(tokenizer.encode("What is", add_special_tokens=False)) <= 2


def test_chat_template_and_save_round_trip(tokenizer, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 1 and ids.count(2) == 1
    assert encode_prompt(tokenizer, "What is 3 + 4?") == list(ids)

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    assert loaded.encode("What is 37 - 19? 18", add_special_tokens=False) == tokenizer.encode(
        "What is 37 - 19? 18", add_special_tokens=False)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (2, 0)
    assert loaded.decode(ids, skip_special_tokens=True) == "user\nWhat is 3 + 4?\nassistant\n"


def test_tokenizer_rejects_a_vocab_smaller_than_bytes() -> None:
    with pytest.raises(ValueError, match="at least 259"):
        train_tokenizer(["1 + 1"], 100)


# --- specs -------------------------------------------------------------------------------------

def test_flavors() -> None:
    tiny = qwen3_spec("tiny")
    assert (tiny.name, tiny.flavor, tiny.is_moe, tiny.router_modules) == ("qwen3", "tiny", False, None)
    assert tiny.hf_config.model_type == "qwen3" and tiny.hf_config.num_hidden_layers <= 4
    real = qwen3_spec("0.6b").hf_config  # a config only: never built on CPU
    assert (real.hidden_size, real.num_hidden_layers, real.vocab_size) == (1024, 28, 151_936)
    big = qwen3_moe_spec("30b_a3b").hf_config
    assert (big.num_experts, big.num_experts_per_tok, big.num_hidden_layers) == (128, 8, 48)


def test_moe_tiny_is_4_experts_top2_every_layer_sparse() -> None:
    spec = qwen3_moe_spec("tiny")
    cfg = spec.hf_config
    assert spec.is_moe and spec.name == "qwen3_moe"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.decoder_sparse_step, list(cfg.mlp_only_layers)) == (
        4, 2, 1, [])
    assert spec.router_modules == "model.layers.{layer}.mlp.gate"
    model = AutoModelForCausalLM.from_config(cfg)
    for layer in range(cfg.num_hidden_layers):
        assert type(model.get_submodule(spec.router_modules.format(layer=layer))).__name__.endswith("Router")


def test_unknown_flavor_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'tiny'.*Valid flavors: tiny, 20m, 0\.6b"):
        qwen3_spec("tinny")
    with pytest.raises(ValueError, match="30b_a3b"):
        qwen3_moe_spec("30b")


def test_path_config_wins_over_flavor(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path) -> None:
    spec = qwen3_spec("tiny", path=str(tiny_qwen3_dir))
    assert spec.hf_config.hidden_size == 64 and spec.hf_config.vocab_size == 96  # the checkpoint's, not tiny's
    assert qwen3_spec("tiny").hf_config.hidden_size != 64
    assert spec.source_path == str(tiny_qwen3_dir)
    assert qwen3_moe_spec("tiny", path=str(tiny_qwen3_moe_dir)).hf_config.vocab_size == 96


def test_path_of_the_wrong_family_is_rejected(tiny_qwen3_moe_dir: Path) -> None:
    with pytest.raises(ValueError, match="'qwen3_moe' checkpoint.*model=qwen3_moe"):
        qwen3_spec("tiny", path=str(tiny_qwen3_moe_dir))


# --- built checkpoints ---------------------------------------------------------------------------

def _run(cache_dir: Path, seed: int = 0, steps: int = 5):
    return validate({"seed": seed, "warm_start": {"steps": steps, "batch_size": 8, "cache_dir": str(cache_dir)}})


def test_ensure_checkpoint_builds_caches_and_loads(tmp_path: Path) -> None:
    task = ArithmeticTask()
    run = _run(tmp_path)
    path = ensure_checkpoint(run, qwen3_spec("tiny"), task)
    assert path.parent == tmp_path and (path / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert json.loads((path / "miles_build.json").read_text())["sft/steps"] == 5
    out = model.generate(torch.tensor([encode_prompt(tok, "What is 3 + 4?")]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= len(encode_prompt(tok, "What is 3 + 4?")) + 3

    t0 = time.perf_counter()
    again = ensure_checkpoint(run, qwen3_spec("tiny"), task)
    assert again == path and time.perf_counter() - t0 < 1.0

    other = ensure_checkpoint(dataclasses.replace(run, seed=1), qwen3_spec("tiny"), task)
    assert other != path  # the seed is part of the cache key


def test_ensure_checkpoint_is_deterministic(tmp_path: Path) -> None:
    task = ArithmeticTask()
    a = ensure_checkpoint(_run(tmp_path / "a"), qwen3_moe_spec("tiny"), task)
    b = ensure_checkpoint(_run(tmp_path / "b"), qwen3_moe_spec("tiny"), task)
    assert a.name == b.name
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    init = load_file(ensure_checkpoint(_run(tmp_path / "c", steps=0), qwen3_moe_spec("tiny"), task)
                     / "model.safetensors")
    assert any(not torch.equal(wa[k], init[k]) for k in wa)  # the warm start moved the weights


def test_model_path_is_returned_unchanged(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    run = validate({"model": {"path": str(tiny_qwen3_dir)}, "warm_start": {"cache_dir": str(tmp_path)}})
    assert ensure_checkpoint(run, qwen3_spec("tiny", path=str(tiny_qwen3_dir)), ArithmeticTask()) == tiny_qwen3_dir
    assert not any(tmp_path.iterdir())  # nothing built


def test_warm_start_micro_batches_give_the_gradient_of_one_pass(tiny_qwen3_dir: Path) -> None:
    """A warm-start batch over the token budget is split by length; the accumulated gradient is the one pass's."""
    import random

    from miles.models.warm_start import _accumulate, collate_sft
    from miles.tasks.count import CountTask

    task = CountTask(max_span=24)
    tok = train_tokenizer(task.corpus(), 320)
    examples = task.sft_examples(12, random.Random(0))
    ids, _, _ = collate_sft(tok, examples)
    assert len({len(r) for _, r in examples}) > 4  # varied lengths: the split changes the padding
    grads, losses = [], []
    for budget in (0, ids.shape[1] * 3):  # one pass; then passes of at most 3 rows of the longest
        config = AutoConfig.from_pretrained(tiny_qwen3_dir)
        config.vocab_size = len(tok)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        losses.append(_accumulate(model, tok, examples, True, budget))
        grads.append({k: v.grad.clone() for k, v in model.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert max(g.abs().max().item() for g in grads[0].values()) > 1e-3
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-4, msg=k)


@pytest.mark.parametrize("over", [{"model": {"flavor": "0.6b"}},
                                  {"model": {"_target_": "miles.models.qwen3.qwen3_moe_spec", "flavor": "30b_a3b"}}])
def test_a_published_size_is_not_built_from_scratch(over: dict) -> None:
    from miles.config import ConfigError
    from miles.config.validate import validate
    from miles.core.run import build_components

    with pytest.raises(ConfigError, match=r"model.flavor=.*: qwen3.* at this size is a published model.*Set "
                                          r"model.path to a local HF checkpoint"):
        build_components(validate(over))
