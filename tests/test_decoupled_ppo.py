"""Decoupled PPO (async schedules): the loss against hand-computed values, and the trainer's objective
applying it under an async schedule on either rollout engine. The metrics of real async runs
(staleness, partial rollouts, behaviour IS clip, mismatch) are checked per engine in
tests/test_schedules.py."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from miles.algos.losses import aggregate, decoupled_ppo_loss, ppo_clip_loss
from miles.config import RankConfig, validate
from miles.train.objective import mismatch_settings, policy_objective

# three tokens per row: pi_theta, pi_prox (the update's start), pi_behav (the weights that sampled it)
THETA, PROX, BEHAV = [0.6, 0.3, 0.9], [0.5, 0.4, 0.6], [0.5, 0.1, 0.8]


def _inputs() -> tuple[torch.Tensor, ...]:
    logp = torch.log(torch.tensor([THETA, THETA], dtype=torch.float64)).requires_grad_(True)
    prox = torch.log(torch.tensor([PROX, PROX], dtype=torch.float64))
    behav = torch.log(torch.tensor([BEHAV, BEHAV], dtype=torch.float64))
    return logp, prox, behav, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)


def test_decoupled_ppo_matches_hand_computed_values() -> None:
    logp, prox, behav, adv, mask = _inputs()
    loss, ind = decoupled_ppo_loss(logp, prox, behav, adv, clip_low=0.2, clip_high=0.2, behaviour_clip=2.0,
                                   loss_mask=mask)
    # ratios against the proximal policy: 1.2, 0.75, 1.5; behaviour weights: 1, min(4, 2) = 2, 0.75
    # A = +1: -w * min(r, clip(r, 0.8, 1.2))      A = -1: w * max(r, clip(r, 0.8, 1.2))
    expected = [[-1.2, -2 * 0.75, -0.75 * 1.2], [1.2, 2 * 0.8, 0.75 * 1.5]]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert ind["behaviour_is_clip_frac"].tolist() == [[0, 1, 0], [0, 1, 0]]  # exp(prox - behav) = 4 > 2
    assert ind["clip_frac_high"].tolist() == [[0, 0, 1], [0, 0, 0]]
    assert ind["clip_frac_low"].tolist() == [[0, 0, 0], [0, 1, 0]]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # d/dlogp of -w r A is -w r A where the clip is inactive, 0 where it is active
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -1.5, 0.0], [1.2, 0.0, 0.75 * 1.5]], dtype=torch.float64))


def test_the_ratio_is_taken_against_the_proximal_policy_not_the_behaviour_one() -> None:
    logp, prox, behav, adv, mask = _inputs()
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, clip_low=0.2, clip_high=0.2, behaviour_clip=1e9,
                                 loss_mask=mask)
    plain, _ = ppo_clip_loss(logp, prox, adv, clip_low=0.2, clip_high=0.2)
    weights = torch.exp(prox - behav)
    torch.testing.assert_close(loss, plain * weights)
    # with a fresh sample (behaviour = proximal) it is PPO-clip exactly
    fresh, _ = decoupled_ppo_loss(logp, prox, prox, adv, clip_low=0.2, clip_high=0.2, behaviour_clip=2.0,
                                  loss_mask=mask)
    torch.testing.assert_close(fresh, plain)


ENGINES = {"torch": {}, "sglang": {"rollout": {"engine": {"_target_": "miles.rollout.sglang_engine.SGLangEngine"}}}}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_async_schedules_train_with_the_decoupled_objective(engine: str) -> None:
    """On either engine (the runs themselves: tests/test_schedules.py, per engine)."""
    sync = validate({})
    one_off = validate({"schedule": {"name": "one_step_off", "max_staleness": 1},
                        "placement": {"name": "disaggregated"}, **ENGINES[engine]})
    assert one_off.rollout.engine.target.split(".")[2] == f"{engine}_engine"
    assert mismatch_settings(RankConfig.of(sync))["tis_clip"] is None
    assert mismatch_settings(RankConfig.of(one_off)) == {"tis_clip": 2.0, "mismatch_mode": "tis", "mismatch_level": "token"}
    logp, prox, behav, adv, mask = _inputs()
    loss, metrics = policy_objective(
        logp=logp, old_logp=prox, rollout_logp=behav, advantages=adv, loss_mask=mask, entropy=torch.zeros(2, 3),
        policy_loss_fn=functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.2), algo=one_off.algo,
        **mismatch_settings(RankConfig.of(one_off)))
    ref, _ = decoupled_ppo_loss(logp, prox, behav, adv, clip_low=0.2, clip_high=0.2, behaviour_clip=2.0,
                                loss_mask=mask)
    torch.testing.assert_close(loss, aggregate(ref, mask, "token_mean"))
    assert metrics["train/tis_clip_frac"].item() == pytest.approx(2 / 6)  # the IS clip fraction
    mismatch = sum(abs(math.log(p) - math.log(b)) for p, b in zip(PROX, BEHAV, strict=True)) / 3
    assert metrics["train/logp_mismatch_abs_mean"].item() == pytest.approx(mismatch)  # behaviour vs proximal
