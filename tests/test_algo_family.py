"""The algorithm family (RLOO, REINFORCE++, dual-clip PPO, GSPO, CISPO, DAPO shaping, RFT) against hand-computed numbers."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hydra import compose, initialize_config_module

from miles.algos.advantages import reinforce_pp, reinforce_pp_baseline, rejection_sampling, rloo
from miles.algos.losses import aggregate, cispo_loss, dual_clip_ppo_loss, gspo_loss, ppo_clip_loss, sft_loss
from miles.algos.shaping import overlong_penalty, shape_overlong_rewards
from miles.config import build, validate
from miles.config.validate import group_options
from miles.train.objective import policy_objective


def test_rloo_hand_computed():
    adv = rloo(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 2.0, 1.0]]))
    # group 0: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3
    # group 1: 0 - 4/3, 1 - 3/3, 2 - 2/3, 1 - 3/3
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-4 / 3, 0.0, 4 / 3, 0.0]])
    torch.testing.assert_close(adv, expected)
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        rloo(torch.tensor([[1.0], [0.0]]))


def test_reinforce_pp_normalises_over_the_batch_without_group_baseline():
    adv = reinforce_pp(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    # batch mean 0.75; population var (3 * 0.25^2 + 0.75^2) / 4 = 0.1875, std 0.4330127
    # -> [0.25, -0.75, 0.25, 0.25] / 0.4330127; the all-correct group still gets A > 0
    expected = torch.tensor([[0.57735, -1.73205], [0.57735, 0.57735]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    assert reinforce_pp(torch.ones(2, 3)).abs().max().item() == 0.0  # no spread: 0, not NaN


def test_reinforce_pp_baseline_group_mean_then_batch_std():
    adv = reinforce_pp_baseline(torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, 1.0]]))
    # centred: [0.5, -0.5], [0, 0], [1, -1]; batch population std sqrt(2.5 / 6) = 0.645497
    expected = torch.tensor([[0.774597, -0.774597], [0.0, 0.0], [1.549193, -1.549193]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="num_groups, samples_per_group"):
        reinforce_pp_baseline(torch.tensor([1.0, 2.0]))


def _logp_from_ratios(ratios: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full_like(ratios, -1.0)
    return (old + ratios.log()).requires_grad_(True), old


def test_dual_clip_ppo_loss_hand_computed():
    logp, old = _logp_from_ratios(torch.tensor([[0.5, 1.0, 2.0, 5.0], [0.5, 1.0, 2.0, 5.0]]))
    loss, ind = dual_clip_ppo_loss(logp, old, torch.tensor([1.0, -1.0]), clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    # A=+1: PPO-clip unchanged, -min(r, clip(r))       = [-0.5, -1.0, -1.2, -1.2]
    # A=-1: min(max(r, clip(r)), c) = min([0.8, 1, 2, 5], 3) = [0.8, 1.0, 2.0, 3.0]
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -1.2, -1.2], [0.8, 1.0, 2.0, 3.0]]))
    torch.testing.assert_close(ind["dual_clip_frac"], torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(ind["clip_frac_low"], torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ind["clip_frac_high"], torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    loss.sum().backward()
    # d(-r A)/dlogp = -r A where no clip is active; 0 under the PPO clips and under the dual bound
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.0, 0.0, 0.0], [0.0, 1.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        dual_clip_ppo_loss(logp, old, torch.tensor([1.0, -1.0]), clip_low=0.2, clip_high=0.2, dual_clip_c=0.5)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp, old = _logp_from_ratios(torch.tensor([[math.exp(10.0), math.exp(20.0), 1.0]]))
    adv = torch.tensor([-2.0])
    plain, _ = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    dual, _ = dual_clip_ppo_loss(logp, old, adv, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    assert plain.max().item() > 1e4  # PPO-clip: -r A grows without bound
    assert dual.max().item() == pytest.approx(6.0)  # at most c * |A|
    torch.testing.assert_close(dual[:, 2], plain[:, 2])  # ratio 1: untouched


def test_gspo_loss_hand_computed():
    # row 0: token ratios [2, 8, 100 (masked out)] -> s = sqrt(2 * 8) = 4 -> clipped to 1.2, A=+1
    # row 1: [0.9, 0.9, 0.9] -> s = 0.9 (inside [0.8, 1.2]), A=-1
    # row 2: [1.21, 1.0, 50 (masked out)] -> s = 1.1, A=+2
    logp, old = _logp_from_ratios(torch.tensor([[2.0, 8.0, 100.0], [0.9, 0.9, 0.9], [1.21, 1.0, 50.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, ind = gspo_loss(logp, old, torch.tensor([1.0, -1.0, 2.0]), clip_low=0.2, clip_high=0.2, loss_mask=mask)
    # L_i = -min(s A, clip(s) A) = [-1.2, 0.9, -2.2], the same on every token of the sequence
    torch.testing.assert_close(loss, torch.tensor([[-1.2] * 3, [0.9] * 3, [-2.2] * 3]))
    torch.testing.assert_close(ind["clip_frac_high"], torch.tensor([[1.0] * 3, [0.0] * 3, [0.0] * 3]))
    torch.testing.assert_close(ind["clip_frac_low"], torch.zeros(3, 3))
    loss[:, 0].sum().backward()
    # dL_i/dlogp_it = -A_i s_i m_it / n_i (0 when clipped): row 1: 0.9 / 3, row 2: -2 * 1.1 / 2
    expected_grad = torch.tensor([[0.0, 0.0, 0.0], [0.3, 0.3, 0.3], [-1.1, -1.1, 0.0]])
    torch.testing.assert_close(logp.grad, expected_grad)
    # seq_mean_token_mean of the broadcast loss is the paper's mean over sequences
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((-1.2 + 0.9 - 2.2) / 3)


def test_gspo_ratio_is_the_geometric_mean_over_masked_tokens_only():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 2
    logp = old + 0.3 * torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.4).float()
    mask[:, 0] = 1.0
    # A = 1 and a clip range too wide to bind: L_i = -s_i
    loss, _ = gspo_loss(logp, old, torch.ones(4), clip_low=1.0 - 1e-9, clip_high=1e9, loss_mask=mask)
    ratios = torch.exp(logp - old)
    geo = torch.stack([ratios[i][mask[i].bool()].prod() ** (1.0 / mask[i].sum()) for i in range(4)])
    torch.testing.assert_close(-loss[:, 0], geo)
    # changing a masked-out token changes nothing
    logp2 = torch.where(mask.bool(), logp, logp + 5.0)
    torch.testing.assert_close(gspo_loss(logp2, old, torch.ones(4), clip_low=1.0 - 1e-9, clip_high=1e9,
                                         loss_mask=mask)[0], loss)


def test_cispo_loss_hand_computed():
    logp, old = _logp_from_ratios(torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]))
    loss, ind = cispo_loss(logp, old, torch.tensor([2.0, -1.0]), clip_low=0.2, clip_high=0.3)
    # w = clip(r, 0.8, 1.3) = [0.8, 1.0, 1.3]; logp = -1 + log r = [-1.693147, -1.0, -0.594535]
    # loss = -w A logp: A=2 -> [2.709035, 2.0, 1.545791]; A=-1 -> [-1.354518, -1.0, -0.772896]
    expected = torch.tensor([[2.709035, 2.0, 1.545791], [-1.354518, -1.0, -0.772896]])
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    # the weight is clipped, never the gradient: d/dlogp = -w A, nonzero on every token
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.6, -2.0, -2.6], [0.8, 1.0, 1.3]]))
    torch.testing.assert_close(ind["clip_frac_low"], torch.tensor([[1.0, 0.0, 0.0]] * 2))
    torch.testing.assert_close(ind["clip_frac_high"], torch.tensor([[0.0, 0.0, 1.0]] * 2))


def test_cispo_gradient_equals_ppo_at_ratio_one():
    old = torch.tensor([[-0.3, -2.0, -1.1]])
    adv = torch.tensor([0.7])
    grads = []
    for fn in (cispo_loss, ppo_clip_loss):
        logp = old.clone().requires_grad_(True)
        fn(logp, old, adv, clip_low=0.2, clip_high=0.2)[0].sum().backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])


def _objective_inputs(seed: int, b: int = 6, t: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    old = -torch.rand(b, t, generator=g) * 2
    return dict(
        logp=(old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_(True),
        old_logp=old,
        rollout_logp=old + 0.1 * torch.randn(b, t, generator=g),
        advantages=torch.randn(b, generator=g),
        loss_mask=mask,
        entropy=torch.rand(b, t, generator=g),
    )


@pytest.mark.parametrize("loss_fn,extra", [(dual_clip_ppo_loss, {"dual_clip_frac"}), (gspo_loss, set()),
                                           (cispo_loss, set())])
def test_policy_objective_runs_each_loss_and_shards_sum_to_the_whole(loss_fn, extra):
    run = validate({"algo": {"loss_agg": "seq_mean_token_mean"}})
    fn = functools.partial(loss_fn, clip_low=0.1, clip_high=0.1)
    x = _objective_inputs(0)
    whole, metrics = policy_objective(**x, policy_loss_fn=fn, algo=run.algo)
    pg, _ = fn(x["logp"], x["old_logp"], x["advantages"], loss_mask=x["loss_mask"])
    torch.testing.assert_close(whole, aggregate(pg, x["loss_mask"], "seq_mean_token_mean"))
    assert {"train/clip_frac_low", "train/clip_frac_high"} | {f"train/{e}" for e in extra} <= metrics.keys()
    whole.backward()
    assert torch.isfinite(x["logp"].grad).all() and x["logp"].grad.abs().sum() > 0
    # rows split across two "ranks" with the global sequence count add up to the whole
    seqs = (x["loss_mask"].sum(-1) > 0).sum()
    parts = [policy_objective(**{k: v[sl] for k, v in x.items()}, policy_loss_fn=fn, algo=run.algo, global_seqs=seqs)[0]
             for sl in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(parts[0] + parts[1], whole)


@pytest.mark.parametrize("option", group_options("algo"))
def test_every_algo_option_builds_an_advantage_and_a_loss_that_run(option: str):
    teacher = ["teacher.model={_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: null}"]  # opd needs one
    with initialize_config_module("miles.conf", version_base="1.3"):
        run = validate(compose("config", overrides=[f"algo={option}", *(teacher if option == "opd" else [])]))
    advantage_fn = build(run.algo.advantage)
    loss_fn = build(run.algo.policy_loss, clip_low=run.algo.clip_low, clip_high=run.algo.clip_high)
    adv = advantage_fn(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])).flatten()
    assert adv.shape == (6,) and adv.abs().sum() > 0
    logp = torch.full((6, 4), -1.0)
    loss, _ = loss_fn(logp + 0.01, logp, adv, loss_mask=torch.ones(6, 4))
    assert loss.shape == (6, 4) and torch.isfinite(loss).all()


# --- DAPO overlong shaping, rejection-sampling SFT ------------------------------------------------

def test_overlong_penalty_hand_computed():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then (6 - L) / 4, -1 beyond the cap
    lengths = torch.tensor([0, 5, 6, 7, 8, 10, 11])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, penalty=0.5), 0.5 * expected)
    with pytest.raises(ValueError, match="0 < algo.overlong_buffer_len < rollout.max_new_tokens"):
        overlong_penalty(lengths, 4, 4)


def test_shape_overlong_rewards_adds_the_penalty_and_can_be_off():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lengths = torch.tensor([[3, 8], [7, 2]])
    shaped = shape_overlong_rewards(rewards, lengths, max_len=8, buffer_len=2, penalty_factor=1.0)
    torch.testing.assert_close(shaped, torch.tensor([[1.0, -1.0], [0.5, 1.0]]))
    assert torch.equal(rewards, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))  # input untouched
    for off in ({"buffer_len": 0, "penalty_factor": 1.0}, {"buffer_len": 2, "penalty_factor": 0.0}):
        torch.testing.assert_close(shape_overlong_rewards(rewards, lengths, max_len=8, **off), rewards)
    with pytest.raises(ValueError, match="same \\[G, n\\] shape"):
        shape_overlong_rewards(rewards, lengths.flatten(), max_len=8, buffer_len=2, penalty_factor=1.0)


def test_dapo_config_is_clip_higher_token_mean_no_kl_with_overlong_shaping():
    with initialize_config_module("miles.conf", version_base="1.3"):
        run = validate(compose("config", overrides=["algo=dapo"]))
    a = run.algo
    assert (a.clip_low, a.clip_high, a.loss_agg, a.kl_coef) == (0.2, 0.28, "token_mean", 0.0)
    assert 0 < a.overlong_buffer_len < run.rollout.max_new_tokens and a.overlong_penalty_factor == 1.0
    assert a.estimator == "group"
    # dynamic sampling is part of the algorithm: the filter is built ahead of rollout.filters, once
    assert a.dynamic_sampling and run.rollout.filters == ()
    from miles.core.run import build_components
    from miles.rollout.filters import nonzero_reward_std

    filters = build_components(run)["filters"]
    assert [f.func for f in filters] == [nonzero_reward_std]
    with initialize_config_module("miles.conf", version_base="1.3"):
        both = validate(compose("config", overrides=[
            "algo=dapo", "rollout.filters=[{_target_: miles.rollout.filters.nonzero_reward_std, _partial_: true, "
            "min_std: 0.1}]"]))
    filters = build_components(both)["filters"]
    assert len(filters) == 1 and filters[0].keywords == {"min_std": 0.1}  # the user's own, not a second copy
    with initialize_config_module("miles.conf", version_base="1.3"):
        grpo = validate(compose("config", overrides=["algo=grpo"]))
    assert not grpo.algo.dynamic_sampling and build_components(grpo)["filters"] == []


def test_rejection_sampling_weights_and_sft_loss():
    w = rejection_sampling(torch.tensor([[1.0, 0.0, 0.5], [0.7, 0.2, 1.0]]), threshold=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0]]))
    logp = torch.tensor([[-0.5, -2.0], [-1.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-5.0, 0.0], [-1.0, -1.0]])  # ratios far from 1: ignored, nothing is clipped
    loss, ind = sft_loss(logp, old, torch.tensor([1.0, 0.0]), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 2.0], [0.0, 0.0]]))  # NLL of the accepted sample only
    torch.testing.assert_close(ind["sft_weighted_frac"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    aggregate(loss, torch.ones(2, 2)).backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]))
    # through the objective: train/loss is the mean NLL over all trained tokens, the metric is reported
    run = validate({"algo": {"policy_loss": {"_target_": "miles.algos.losses.sft_loss", "_partial_": True}}})
    fn = build(run.algo.policy_loss, clip_low=0.2, clip_high=0.2)
    total, metrics = policy_objective(logp=logp.detach(), old_logp=old, rollout_logp=old, advantages=torch.tensor([1.0, 0.0]),
                                      loss_mask=torch.ones(2, 2), entropy=torch.zeros(2, 2), policy_loss_fn=fn,
                                      algo=run.algo)
    assert total.item() == pytest.approx(2.5 / 4) and metrics["train/sft_weighted_frac"].item() == 0.5


def test_sft_config_learns_only_from_rewarded_samples():
    with initialize_config_module("miles.conf", version_base="1.3"):
        run = validate(compose("config", overrides=["algo=sft", "algo.advantage.threshold=0.9"]))
    weights = build(run.algo.advantage)(torch.tensor([[1.0, 0.5, 0.95]]))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.0, 1.0]]))
