"""precision.true_on_policy: the engine's rollout log-probs and the trainer's recomputed ones are
bitwise equal (torch.equal), and the reason the ordinary paths are not (shape-dependent reductions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_ranks import hf_model_from, local_trainer

from miles.config import validate
from miles.config.schema import PrecisionConfig
from miles.precision.on_policy import fixed_length_logits
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams, Status, TrainBatch

MAX_NEW = 8


def _requests() -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"r{i}", prompt_ids=tuple(3 + (13 * i + 7 * t) % 90 for t in range(n)), n=2,
                            seed=10 + i) for i, n in enumerate([3, 9, 5, 6])]


def _rollout(ckpt: Path, precision: PrecisionConfig, temperature: float = 1.0) -> tuple[TrainBatch, list]:
    eng = TorchEngine(str(ckpt), precision, max_batch_size=8)
    try:
        reqs = _requests()
        results = eng.generate(reqs, SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW))
    finally:
        eng.close()
    prompts = {q.request_id: list(q.prompt_ids) for q in reqs}
    batch = TrainBatch(prompt_ids=[prompts[r.request_id] for r in results],
                       response_ids=[list(r.response_ids) for r in results],
                       rollout_logprobs=[list(r.logprobs) for r in results],
                       loss_mask=[[1] * len(r.response_ids) for r in results],
                       advantages=[1.0 if i % 2 else -1.0 for i in range(len(results))])
    return batch, results


def _run(true_on_policy: bool, temperature: float = 1.0, dtype: str = "float32"):
    return validate({"precision": {"true_on_policy": true_on_policy, "train_dtype": dtype, "rollout_dtype": dtype},
                     "algo": {"num_prompts_per_step": 4, "num_samples_per_prompt": 2},
                     "rollout": {"max_new_tokens": MAX_NEW, "temperature": temperature},
                     "trainer": {"lr": 1e-3, "lr_warmup_steps": 0}})


@pytest.mark.parametrize("model,dtype,temperature", [("dense", "float32", 1.0), ("dense", "float32", 0.7),
                                                     ("dense", "bfloat16", 1.0)])
def test_engine_and_trainer_logprobs_are_bitwise_equal(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, model: str,
                                                       dtype: str, temperature: float) -> None:
    ckpt = tiny_qwen3_moe_dir if model == "moe" else tiny_qwen3_dir
    run = _run(True, temperature, dtype)
    batch, results = _rollout(ckpt, run.precision, temperature)
    assert {r.status for r in results} <= {Status.COMPLETED, Status.TRUNCATED}
    assert sum(len(r) for r in batch.response_ids) > 20
    with local_trainer(ckpt, run) as trainer:
        recomputed = trainer.compute_logprobs(batch)
        for got, want in zip(recomputed, batch.rollout_logprobs, strict=True):
            assert torch.equal(torch.tensor(got), torch.tensor(want))
        metrics = trainer.train_step(batch)  # the training pass's log-probs too
    assert metrics["train/logp_mismatch_abs_mean"] == 0.0


def test_without_it_the_same_weights_disagree_in_the_last_bits(tiny_qwen3_dir: Path) -> None:
    """The ordinary engine and trainer paths: equal to ~1e-6, not bitwise (what true_on_policy fixes)."""
    run = _run(False)
    batch, _ = _rollout(tiny_qwen3_dir, run.precision)
    with local_trainer(tiny_qwen3_dir, run) as trainer:
        recomputed = trainer.compute_logprobs(batch)
    got, want = torch.tensor(sum(recomputed, [])), torch.tensor(sum(batch.rollout_logprobs, []))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert not torch.equal(got, want)


def test_where_the_difference_comes_from(tiny_qwen3_dir: Path) -> None:
    """A forward over a prefix and over the whole sequence differ at shared positions; at one fixed
    padded length they do not."""
    model = hf_model_from(tiny_qwen3_dir)
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(input_ids=ids[None]).logits[0]
        prefix_equal = [torch.equal(model(input_ids=ids[None, :t]).logits[0, t - 1], whole[t - 1]) for t in range(1, 25)]
        fixed = fixed_length_logits(model, ids, 24, pad_id=0)
        fixed_equal = [torch.equal(fixed_length_logits(model, ids[:t], 24, pad_id=0)[t - 1], fixed[t - 1])
                       for t in range(1, 25)]
    assert not all(prefix_equal)
    assert all(fixed_equal)


def test_moe_experts_are_not_length_invariant(tiny_qwen3_moe_dir: Path) -> None:
    """Why true_on_policy is refused for MoE models: transformers' experts run one GEMM per expert over the
    tokens routed to it, and the padding tokens of a fixed-length forward route too, so an expert's GEMM
    has another row count in the engine's forward (padding after t tokens) than in the trainer's (the
    finished sequence): close, not bitwise."""
    run = _run(True)
    batch, _ = _rollout(tiny_qwen3_moe_dir, run.precision)
    with local_trainer(tiny_qwen3_moe_dir, run) as trainer:
        recomputed = trainer.compute_logprobs(batch)
    got, want = torch.tensor(sum(recomputed, [])), torch.tensor(sum(batch.rollout_logprobs, []))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.equal(got, want)


def test_true_on_policy_refuses_what_it_cannot_match() -> None:
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match="true_on_policy"):
        validate({"precision": {"true_on_policy": True, "rollout_dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match="true_on_policy"):
        validate({"precision": {"true_on_policy": True}, "rollout": {"top_p": 0.9}})
    from miles.core.run import build_components

    with pytest.raises(ConfigError, match="true_on_policy=true: qwen3_moe is an MoE model"):
        build_components(validate({"precision": {"true_on_policy": True},
                                   "model": {"_target_": "miles.models.qwen3.qwen3_moe_spec"}}))
