"""Padding a TrainBatch, and the per-rank objective summing to the single-rank objective."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from objective_inputs import objective_inputs

from miles.algos.losses import aggregate, kl_penalty, ppo_clip_loss
from miles.config.validate import validate
from miles.train.batching import pad_batch, response_logits, unpad_response
from miles.train.objective import policy_objective
from miles.types import TrainBatch


def _batch() -> TrainBatch:
    return TrainBatch(
        prompt_ids=[[5, 6, 7], [8]],
        response_ids=[[9, 10], [11, 12, 13]],
        rollout_logprobs=[[-0.5, -0.6], [-1.0, -1.1, -1.2]],
        loss_mask=[[1, 1], [1, 0, 1]],
        advantages=[0.5, -1.5],
    )


def test_pad_batch_layout_hand_checked():
    p = pad_batch(_batch(), pad_id=0)
    assert p.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    # response token j of sample i is predicted at position P_i + j - 1
    assert p.logit_index.tolist() == [[2, 3, 0], [0, 1, 2]]
    assert p.targets.tolist() == [[9, 10, 0], [11, 12, 13]]
    assert p.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert p.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    torch.testing.assert_close(p.rollout_logp, torch.tensor([[-0.5, -0.6, 0.0], [-1.0, -1.1, -1.2]]))
    assert p.advantages.tolist() == [0.5, -1.5]
    rows = unpad_response(p.rollout_logp, p.response_lengths)
    assert [len(r) for r in rows] == [2, 3]
    assert rows[1] == pytest.approx([-1.0, -1.1, -1.2])


def test_response_logits_select_the_predicting_positions():
    p = pad_batch(_batch(), pad_id=0)
    # a perfect next-token predictor: logits at position t put all mass on input_ids[t + 1]
    vocab = 16
    nxt = torch.cat([p.input_ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)
    logits = torch.nn.functional.one_hot(nxt, vocab).float() * 50
    picked = response_logits(logits, p.logit_index).argmax(-1)
    assert (picked[p.response_mask.bool()] == p.targets[p.response_mask.bool()]).all()


def test_pad_batch_errors_name_the_problem():
    b = _batch()
    with pytest.raises(ValueError, match="sample 1 has 3 response tokens but 2 rollout log-probs"):
        pad_batch(dataclasses.replace(b, rollout_logprobs=[[-0.5, -0.6], [-1.0, -1.1]]))
    with pytest.raises(ValueError, match="empty prompt"):
        pad_batch(dataclasses.replace(b, prompt_ids=[[5], []]))


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_objective_shares_sum_to_the_whole(loss_agg: str):
    run = validate({"algo": {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_agg": loss_agg, "clip_high": 0.28},
                    "precision": {"tis_clip": 1.5}})
    loss_fn = functools.partial(ppo_clip_loss, clip_low=run.algo.clip_low, clip_high=run.algo.clip_high)
    x = objective_inputs(0)
    common = dict(policy_loss_fn=loss_fn, algo=run.algo, tis_clip=run.precision.tis_clip)
    whole, whole_m = policy_objective(**x, **common)
    whole.backward()
    grad_whole = x["logp"].grad.clone()
    x["logp"].grad = None

    tokens = x["loss_mask"].sum()
    seqs = (x["loss_mask"].sum(-1) > 0).sum()
    shares, metric_sums = [], {}
    for sl in (slice(0, 2), slice(2, 6)):
        part = {k: v[sl] for k, v in x.items()}
        loss, m = policy_objective(**part, **common, global_tokens=tokens, global_seqs=seqs)
        shares.append(loss)
        for k, v in m.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + v
    total = shares[0] + shares[1]
    total.backward()
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(x["logp"].grad, grad_whole)
    assert metric_sums.keys() == whole_m.keys()
    for k in whole_m:
        torch.testing.assert_close(metric_sums[k], whole_m[k], msg=k)

    # the whole loss is the documented formula
    pg, _ = ppo_clip_loss(x["logp"], x["old_logp"], x["advantages"], clip_low=0.2, clip_high=0.28)
    w = torch.exp(x["old_logp"] - x["rollout_logp"]).clamp(max=1.5)
    def agg(v: torch.Tensor) -> torch.Tensor:
        return aggregate(v, x["loss_mask"], loss_agg)
    expected = agg(pg * w) + 0.1 * agg(kl_penalty(x["logp"], x["ref_logp"], "k3")) - 0.01 * agg(x["entropy"])
    torch.testing.assert_close(whole, expected)
    mismatch = ((x["rollout_logp"] - x["old_logp"]).abs() * x["loss_mask"]).sum() / tokens
    torch.testing.assert_close(whole_m["train/logp_mismatch_abs_mean"], mismatch)
    assert set(whole_m) == {"train/loss", "train/pg_loss", "train/clip_frac_low", "train/clip_frac_high",
                            "train/entropy", "train/kl", "train/logp_mismatch_abs_mean", "train/tis_clip_frac"}


def test_objective_without_reference_refuses_kl():
    run = validate({"algo": {"kl_coef": 0.1}})
    x = objective_inputs(1)
    x.pop("ref_logp")
    loss_fn = functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_objective(**x, policy_loss_fn=loss_fn, algo=run.algo)


def test_pad_batch_token_advantages():
    b = dataclasses.replace(_batch(), token_advantages=[[0.1, 0.2], [1.0, 2.0, 3.0]])
    p = pad_batch(b, pad_id=0)
    torch.testing.assert_close(p.advantages, torch.tensor([[0.1, 0.2, 0.0], [1.0, 2.0, 3.0]]))
    assert pad_batch(_batch()).advantages.shape == (2,)
    with pytest.raises(ValueError, match="sample 1 has 3 response tokens but 2 token advantages"):
        pad_batch(dataclasses.replace(b, token_advantages=[[0.1, 0.2], [1.0, 2.0]]))
    with pytest.raises(ValueError, match="token_advantages has 1 entries, expected 2"):
        pad_batch(dataclasses.replace(b, token_advantages=[[0.1, 0.2]]))
    # sharding and selecting keep per-token advantages with their samples
    assert b.select([1]).token_advantages == [[1.0, 2.0, 3.0]] and b.shard(0, 2).token_advantages == [[0.1, 0.2]]


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_objective_token_advantages(loss_agg: str):
    run = validate({"algo": {"loss_agg": loss_agg}})
    loss_fn = functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.2)
    x = objective_inputs(2)
    x.pop("ref_logp")
    per_sample, _ = policy_objective(**x, policy_loss_fn=loss_fn, algo=run.algo)
    # the per-sample advantage broadcast over the tokens is the same objective
    broadcast = dict(x, advantages=x["advantages"].unsqueeze(-1).expand_as(x["logp"]))
    per_token, _ = policy_objective(**broadcast, policy_loss_fn=loss_fn, algo=run.algo)
    torch.testing.assert_close(per_token, per_sample)
    # varying advantages along the sequence: hand-computed at ratio 1 (logp == old_logp), L_t = -A_t
    adv = torch.randn(x["logp"].shape, generator=torch.Generator().manual_seed(3))
    at_old = dict(x, logp=x["old_logp"].clone().requires_grad_(True), advantages=adv)
    loss, _ = policy_objective(**at_old, policy_loss_fn=loss_fn, algo=run.algo)
    torch.testing.assert_close(loss, aggregate(-adv, x["loss_mask"], loss_agg))
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, T\]"):
        policy_objective(**dict(x, advantages=adv[:, :2]), policy_loss_fn=loss_fn, algo=run.algo)
