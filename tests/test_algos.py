"""Advantages, PPO-clip, KL estimators, TIS weights and aggregation against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algos.advantages import group_normalized
from miles.algos.losses import aggregate, kl_penalty, mismatch_weights, ppo_clip_loss


def test_group_normalized_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 1.0]])
    adv = group_normalized(rewards)
    # group 0: mean 0.5, population std 0.5 -> +-1
    # group 1: all equal -> 0 (not NaN)
    # group 2: mean 1, population std sqrt(0.5) = 0.70711 -> [-1.41421, 0, 1.41421, 0]
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [-1.41421, 0.0, 1.41421, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    # every group with spread has zero mean and unit mean square (population std)
    assert adv[0].square().mean().item() == pytest.approx(1.0, abs=1e-5)
    # Bessel's std (TRL / verl): group 0 has sample std sqrt(1/3) = 0.57735 -> +-0.86603
    unbiased = group_normalized(rewards, unbiased_std=True)
    torch.testing.assert_close(unbiased[0], torch.tensor([0.86603, -0.86603, -0.86603, 0.86603]), atol=1e-4, rtol=0)
    torch.testing.assert_close(unbiased[1], torch.zeros(4))


def test_group_normalized_mean_only_and_shape_error():
    adv = group_normalized(torch.tensor([[0.0, 1.0, 2.0]]), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match="num_groups, samples_per_group"):
        group_normalized(torch.tensor([1.0, 2.0]))


def test_ppo_clip_loss_hand_computed():
    # ratios r = [0.5, 1.0, 1.5] for both rows; A = +1 (row 0) and -1 (row 1); clip range [0.8, 1.3]
    ratios = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    old_logp = torch.full((2, 3), -1.0)
    logp = (old_logp + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, ind = ppo_clip_loss(logp, old_logp, adv, clip_low=0.2, clip_high=0.3)
    # A=+1: -min(r, clip(r)) = -[min(.5,.8), min(1,1), min(1.5,1.3)] = [-0.5, -1.0, -1.3]
    # A=-1: -min(-r, -clip(r)) = [max(.5,.8), 1, max(1.5,1.3)]     = [ 0.8,  1.0,  1.5]
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -1.3], [0.8, 1.0, 1.5]]))
    torch.testing.assert_close(ind["clip_frac_high"], torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ind["clip_frac_low"], torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    # d/dlogp of -r*A is -r*A where unclipped, 0 where the clip is active
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]]))


def test_ppo_clip_loss_per_token_advantages_match_per_sequence():
    logp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.1, -1.9]])
    a, _ = ppo_clip_loss(logp, old, torch.tensor([0.7]), clip_low=0.2, clip_high=0.2)
    b, _ = ppo_clip_loss(logp, old, torch.tensor([[0.7, 0.7]]), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(a, b)


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # d = ref - logp = log(0.5) = -0.693147
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * 0.693147**2, abs=1e-6)  # 0.240227
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + 0.693147 - 1.0, abs=1e-6)  # 0.193147
    for est in ("k1", "k2", "k3"):
        assert kl_penalty(ref, ref, est).item() == 0.0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_k1_and_k3_are_unbiased_estimators_of_kl():
    # exact expectation over a categorical: E_{x~p}[k(x)] vs KL(p || q)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    kl = (p * (p.log() - q.log())).sum()
    for est in ("k1", "k3"):
        expectation = (p * kl_penalty(p.log(), q.log(), est)).sum()
        assert expectation.item() == pytest.approx(kl.item(), abs=1e-6), est
    assert (p * kl_penalty(p.log(), q.log(), "k2")).sum().item() != pytest.approx(kl.item(), abs=1e-3)


def test_tis_weights_truncate_and_are_detached():
    old = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[math.log(2.0), 0.0, -math.log(4.0)]])
    ones = torch.ones(1, 3)
    w, _ = mismatch_weights(old, rollout, ones, mode="tis", level="token", clip=2.0)
    # exp(old - rollout) = [0.5, 1, 4] -> min(., 2) = [0.5, 1, 2]
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match=">= 1"):
        mismatch_weights(old, rollout, ones, mode="tis", level="token", clip=0.5)


def test_aggregate_modes_and_global_normalisers():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # token_mean: (1 + 2 + 3 + 4) / 4 = 2.5; seq_mean_token_mean: (mean(1,2,3) + 4) / 2 = 3 (row 3 empty)
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(2.5)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
    # two "ranks" with the global counts add up to the single-rank value
    parts = [(loss[:1], mask[:1]), (loss[1:], mask[1:])]
    assert sum(aggregate(lo, m, "token_mean", global_tokens=4).item() for lo, m in parts) == pytest.approx(2.5)
    assert sum(aggregate(lo, m, "seq_mean_token_mean", global_seqs=2).item() for lo, m in parts) == pytest.approx(3.0)
    # all masked: 0, not NaN
    assert aggregate(loss, torch.zeros_like(mask), "token_mean").item() == 0.0
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(loss, mask, "sum")  # type: ignore[arg-type]
