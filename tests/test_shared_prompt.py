"""Shared-prompt forward: each distinct prompt computed once gives the plain forward's log-probs,
gradients and updates (dense and MoE, in the trainer, and over two FSDP ranks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from fsdp_ranks import Group, hf_logprobs, hf_model_from, local_trainer

from miles.algos.advantages import group_normalized
from miles.config.schema import MilesConfig
from miles.config.validate import validate
from miles.train.batching import pad_batch, response_logits
from miles.train.shared_prompt import cache_keyword, shared_prompt_logits, shared_tokens, worth_sharing
from miles.types import TrainBatch


def grouped_batch(model: torch.nn.Module, *, prompt_lens=(9, 14, 11), n: int = 4, vocab: int = 96) -> TrainBatch:
    """``len(prompt_lens)`` prompts of different lengths, ``n`` responses each (1 to 5 tokens), GRPO order."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in prompt_lens]
    prompt_ids = [prompts[i // n] for i in range(len(prompts) * n)]
    responses = [torch.randint(3, vocab, (1 + (2 * i) % 5,), generator=g).tolist() for i in range(len(prompt_ids))]
    loss_mask = [[0 if (i % 3 == 0 and j == 1) else 1 for j in range(len(r))] for i, r in enumerate(responses)]
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(prompt_ids))]).view(len(prompts), n)
    return TrainBatch(prompt_ids=prompt_ids, response_ids=responses,
                      rollout_logprobs=hf_logprobs(model, prompt_ids, responses), loss_mask=loss_mask,
                      advantages=group_normalized(rewards).flatten().tolist())


def _plain_logits(model: torch.nn.Module, p) -> torch.Tensor:
    out = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids, use_cache=False)
    return response_logits(out.logits, p.logit_index)


def _logp_sum(logits: torch.Tensor, p) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1).gather(-1, p.targets.unsqueeze(-1)).squeeze(-1)
    return (logp * p.loss_mask * torch.linspace(0.5, 1.5, logp.shape[0]).unsqueeze(-1)).sum()


def _with_trainer(run: MilesConfig, **trainer: object) -> MilesConfig:
    return dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, **trainer))


# --- the forward itself -----------------------------------------------------------------------------------

def test_distinct_prompts_and_first_rows_are_found():
    batch = TrainBatch(prompt_ids=[[5, 6], [7], [5, 6], [7], [5, 6, 8]], response_ids=[[1]] * 5,
                       rollout_logprobs=[[0.0]] * 5, loss_mask=[[1]] * 5, advantages=[0.0] * 5)
    p = pad_batch(batch)
    assert p.num_prompts == 3
    assert p.prompt_index.tolist() == [0, 1, 0, 1, 2]
    assert p.prompt_rows.tolist() == [0, 1, 4]
    assert p.prompt_lengths.tolist() == [2, 1, 2, 1, 3]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_same_logits_and_gradients_as_the_plain_forward(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, moe: bool):
    model = hf_model_from(tiny_qwen3_moe_dir if moe else tiny_qwen3_dir)
    batch = grouped_batch(model)
    p = pad_batch(batch)
    assert p.num_prompts == 3 and worth_sharing(batch.prompt_ids, [len(r) for r in batch.response_ids])
    kw = cache_keyword(model)
    assert kw is not None

    plain = _plain_logits(model, p)
    shared = shared_prompt_logits(model, p, pad_id=0, cache_kw=kw)
    assert shared.shape == plain.shape
    real = p.response_mask.bool()
    torch.testing.assert_close(shared[real], plain[real], atol=1e-5, rtol=1e-5)

    grads = []
    for logits_fn in (_plain_logits, lambda m, b: shared_prompt_logits(m, b, pad_id=0, cache_kw=kw)):
        model.zero_grad(set_to_none=True)
        _logp_sum(logits_fn(model, p), p).backward()
        grads.append({k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None})
    assert list(grads[0]) == list(grads[1])
    # the prompt positions get their gradient through the repeated cache: embeddings of prompt-only ids move
    prompt_only = sorted(set(p.input_ids[p.prompt_rows].flatten().tolist()) - set(p.targets.flatten().tolist()))
    embed = next(k for k in grads[1] if "embed_tokens" in k)
    assert grads[1][embed][prompt_only].abs().max() > 1e-4
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-4, msg=k)


def test_sharing_only_where_it_saves_five_percent():
    def rows(prompts: list[list[int]], response_len: int) -> tuple[list[list[int]], list[int]]:
        return prompts, [response_len] * len(prompts)

    assert not worth_sharing(*rows([[i, 5, 6, 7] for i in range(8)], 2))  # nothing repeats
    grpo = rows([[9] * 20] * 8, 4)
    assert shared_tokens(*grpo) == (8 * 24, 20 + 8 * 3) and worth_sharing(*grpo)
    assert worth_sharing(*rows([[9] * 4] * 8, 60))  # 8 x 64 plain vs 4 + 8 x 59 shared: 7% saved
    assert not worth_sharing(*rows([[9] * 2] * 8, 60))  # 8 x 62 plain vs 2 + 8 x 59 shared: 4.4% saved


def test_one_token_responses_still_run_the_response_pass(tiny_qwen3_dir: Path):
    """Ranks must run the same passes: a micro-batch of one-token responses runs a (dropped) response
    pass like any other, and its logits are still the prompt pass's."""
    model = hf_model_from(tiny_qwen3_dir)
    batch = grouped_batch(model)
    batch = dataclasses.replace(batch, response_ids=[r[:1] for r in batch.response_ids],
                                rollout_logprobs=[x[:1] for x in batch.rollout_logprobs],
                                loss_mask=[[1] for _ in batch.loss_mask])
    p = pad_batch(batch)
    calls = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                       with_kwargs=True)
    try:
        with torch.no_grad():
            logits = shared_prompt_logits(model, p, 0, cache_keyword(model))
    finally:
        hook.remove()
    assert calls == [(3, 14), (len(batch), 1)]  # the prompt pass, then the response pass
    with torch.no_grad():
        torch.testing.assert_close(logits, _plain_logits(model, p), atol=1e-5, rtol=1e-5)


# --- in the trainer ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [8192, 6], ids=["one-pass", "micro-batched"])
def test_trainer_update_is_the_same_with_and_without_sharing(tiny_qwen3_dir: Path, budget: int):
    """Old log-probs, reference log-probs, gradients and the update; at budget 6 the responses of a prompt
    spread over several micro-batches that read one prompt pass (several passes with and without)."""
    run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "max_tokens_per_microbatch": budget},
                    "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "num_minibatches": 2},
                    "precision": {"tis_clip": 2.0}})
    batch = grouped_batch(hf_model_from(tiny_qwen3_dir), n=4, prompt_lens=(9, 14, 11, 12))
    out = {}
    for share in (False, True):
        with local_trainer(tiny_qwen3_dir, _with_trainer(run, shared_prompt_forward=share)) as t:
            grads = t.compute_gradients(batch)
            metrics = t.train_step(batch)
            out[share] = grads, metrics, t.full_state_dict()
    (g0, m0, sd0), (g1, m1, sd1) = out[False], out[True]
    if budget == 6:
        assert m1["train/num_microbatches"] >= 6 and m0["train/num_microbatches"] == len(batch)
    # each prompt once: 2 mini-batches x 2 prompts x 14 padded positions, then the response tails
    assert m1["perf/train_forward_tokens"] < 0.6 * m0["perf/train_forward_tokens"]
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-6, rtol=1e-4, msg=k)
    for k in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/num_tokens"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k
    for k in sd0:
        torch.testing.assert_close(sd1[k], sd0[k], atol=1e-5, rtol=0, msg=k)  # Adam on a ~0 gradient: see test_fsdp


def test_activation_checkpointing_turns_sharing_off(tiny_qwen3_dir: Path):
    run = _with_trainer(validate({}), activation_checkpointing=True)
    with local_trainer(tiny_qwen3_dir, run) as t:
        assert t.cache_kw is None
    with local_trainer(tiny_qwen3_dir, validate({})) as t:
        assert t.cache_kw is not None


@pytest.mark.slow
def test_two_fsdp_ranks_with_sharing_match_one_without(ray_cluster, tiny_qwen3_dir: Path):
    """FSDP2 with the prompt pass read by several micro-batches and back-propagated in the last one's
    backward: the same gradients as one unsharded rank's plain forward."""
    run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0}, "algo": {"entropy_coef": 0.01}})
    batch = grouped_batch(hf_model_from(tiny_qwen3_dir), n=4, prompt_lens=(9, 14, 11, 12))
    with local_trainer(tiny_qwen3_dir, _with_trainer(run, shared_prompt_forward=False)) as t:
        want = t.compute_gradients(batch)
        m1 = t.train_step(batch)
        sd1 = t.full_state_dict()
    two = Group(ray_cluster, 2, tiny_qwen3_dir, _with_trainer(run, max_tokens_per_microbatch=6))
    try:
        got = two.call("compute_gradients", batch)[0]
        m2 = two.call("train_step", batch)[0]
        sd2 = two.call("full_state_dict")[0]
    finally:
        two.close()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-4, msg=k)
    assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-5, abs=1e-6)
    for k in sd1:
        torch.testing.assert_close(sd2[k], sd1[k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.slow
def test_ranks_agree_on_sharing_when_only_one_could(ray_cluster, tiny_qwen3_dir: Path):
    """Rank 0's half repeats its prompts, rank 1's does not: both must run the same passes (FSDP's
    all-gathers are collective), so neither shares, and the result is one rank's."""
    model = hf_model_from(tiny_qwen3_dir)
    grouped = grouped_batch(model, n=4, prompt_lens=(9, 14))  # 8 samples, 2 prompts
    pairs = grouped_batch(model, n=2, prompt_lens=(11, 12, 10, 13))
    prompts = [p + [3 + i] for i, p in enumerate(pairs.prompt_ids)]  # 8 samples, 8 prompts
    distinct = dataclasses.replace(pairs, prompt_ids=prompts,
                                   rollout_logprobs=hf_logprobs(model, prompts, pairs.response_ids))
    batch = TrainBatch(**{f.name: getattr(grouped, f.name) + getattr(distinct, f.name)
                          for f in dataclasses.fields(TrainBatch)
                          if f.name not in ("token_advantages", "routing", "adapters", "images")})
    # every sample in the passes (some have advantage 0), so that the token count below is the plain one
    run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "skip_zero_advantage": False}})
    with local_trainer(tiny_qwen3_dir, _with_trainer(run, shared_prompt_forward=False)) as t:
        want = t.compute_gradients(batch)
    two = Group(ray_cluster, 2, tiny_qwen3_dir, run)
    try:
        got = two.call("compute_gradients", batch)[0]
        m = two.call("train_step", batch)[0]
    finally:
        two.close()
    plain_tokens = sum(len(g) * max(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in g)
                       for g in (range(8), range(8, 16)))
    assert m["perf/train_forward_tokens"] == plain_tokens
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-4, msg=k)
