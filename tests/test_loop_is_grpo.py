"""The RL loop computes GRPO exactly: every batch it trains on, replayed through a plain reference
update (an HF model, the GRPO objective written out as TRL writes it, torch AdamW), lands on the
weights that sampled the next batch.

This is the property ``python -m miles.bench e2e`` rests on when it compares miles with TRL's
``GRPOTrainer``: the same prompts, a batch sampled from the current weights, the same update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_ranks import hf_logprobs, hf_model_from

pytestmark = pytest.mark.slow


def test_each_step_is_the_reference_grpo_update(ray_cluster, tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.bench.e2e import compose
    from miles.core.run import build_components, run_job
    from miles.models.checkpoint import ensure_checkpoint
    from miles.train.optim import lr_multiplier
    from miles.types import TrainBatch

    steps, prompts, n = 3, 4, 4
    # the count task's partial credit gives groups unequal rewards from the first step
    run, _ = compose(["seed=3", "tracking=none", "task=count", "task.source.max_span=4", "task.num_eval_prompts=4",
                      "rollout.max_new_tokens=16", f"algo.num_prompts_per_step={prompts}",
                      f"algo.num_samples_per_prompt={n}", "+algo.advantage.unbiased_std=true",
                      # a large constant lr: each update moves the log-probs well past the tolerance below
                      f"trainer.num_steps={steps}", "trainer.eval_every=0", "trainer.lr=5e-4",
                      "trainer.lr_warmup_steps=0", "trainer.max_tokens_per_microbatch=64",  # several micro-batches
                      "warm_start.steps=80", f"warm_start.cache_dir={tmp_path / 'cache'}"])
    parts = build_components(run)
    checkpoint = ensure_checkpoint(run, parts["spec"], parts["task"])

    batches: list[list] = []  # what the loop hands the trainer, step by step
    record = TrainBatch.from_samples

    def recording(samples):
        batches.append([(s.prompt_ids, s.response_ids, s.rollout_logprobs, s.loss_mask, s.reward, s.advantage,
                         s.response_text, s.label) for s in samples])
        return record(samples)

    monkeypatch.setattr(TrainBatch, "from_samples", staticmethod(recording))
    run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: None)
    assert len(batches) == steps and all(len(b) == prompts * n for b in batches)

    t = run.trainer
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    opt = torch.optim.AdamW(ref.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(
        s, warmup_steps=t.lr_warmup_steps, total_steps=t.num_steps, schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio))
    start = hf_model_from(checkpoint)

    def logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        return logits.float().log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)

    for step, batch in enumerate(batches, start=1):
        rewards = torch.tensor([b[4] for b in batch]).view(prompts, n)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        tokens = sum(sum(b[3]) for b in batch)
        opt.zero_grad(set_to_none=True)
        gap = moved = 0.0
        for (p, r, rollout_lp, mask, reward, adv, text, label), a in zip(batch, advantages.tolist(), strict=True):
            # the reward of the text the engine's tokens decode to, and the group-normalised advantage
            assert text == tokenizer.decode(r, skip_special_tokens=True)
            assert reward == pytest.approx(parts["reward_fn"](text, label), abs=1e-9)
            assert adv == pytest.approx(a, abs=1e-4)
            # the engine sampled with the weights the reference reached after step - 1 updates
            lp = logprobs(ref, p, r)
            gap = max(gap, (lp.detach() - torch.tensor(rollout_lp)).abs().max().item())
            if step > 1:
                (at_start,) = hf_logprobs(start, [p], [r])
                moved = max(moved, (torch.tensor(at_start) - torch.tensor(rollout_lp)).abs().max().item())
            # TRL's GRPO loss with loss_type="dapo": PPO-clip per token, summed, over the batch's tokens
            ratio = torch.exp(lp - lp.detach())
            per_token = -torch.minimum(ratio * a, ratio.clamp(1 - run.algo.clip_low, 1 + run.algo.clip_high) * a)
            ((per_token * torch.tensor(mask, dtype=torch.float32)).sum() / tokens).backward()
        assert gap < 2e-4, f"step {step}: engine log-probs are {gap:.2e} from the reference weights"
        if step > 1:
            assert moved > 50 * 2e-4, f"step {step}: the weights barely moved ({moved:.2e}); the check has no teeth"
        torch.nn.utils.clip_grad_norm_(ref.parameters(), t.max_grad_norm)
        opt.step()
        sched.step()
