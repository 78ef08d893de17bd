"""low_var_kl, TIS / MIS mismatch weights (token and sequence level) and the token-sum aggregations."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from objective_inputs import objective_inputs

from miles.algos.losses import aggregate, kl_penalty, mismatch_weights, ppo_clip_loss
from miles.config.validate import ConfigError, validate
from miles.train.objective import policy_objective


def test_low_var_kl_is_k3_clamped_hand_computed():
    logp = torch.zeros(1, 6, requires_grad=True)
    ref = torch.tensor([[0.0, math.log(2.0), -1.0, 5.0, 1000.0, -1000.0]])
    kl = kl_penalty(logp, ref, "low_var_kl")
    # d = ref - logp; k3 = e^d - d - 1:
    #   d = 0 -> 0;  d = ln 2 -> 2 - ln 2 - 1;  d = -1 -> e^-1;  d = 5 -> e^5 - 6 = 142.4 -> 10
    #   d = 1000 -> clamp to 20 first (no inf) -> e^20 - 21 -> 10;  d = -1000 -> -20 -> e^-20 + 19 -> 10
    expected = torch.tensor([[0.0, 1.0 - math.log(2.0), math.exp(-1.0), 10.0, 10.0, 10.0]])
    torch.testing.assert_close(kl, expected)
    # unclamped k3 differs exactly where a clamp is active
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0, 3].item() == pytest.approx(math.exp(5.0) - 6.0, rel=1e-5)
    assert math.isinf(k3[0, 4].item())
    # a clamped token contributes no gradient: d/dlogp k3 = 1 - e^d
    kl.sum().backward()
    grad = logp.grad[0]
    torch.testing.assert_close(grad[1:3], torch.tensor([1.0 - 2.0, 1.0 - math.exp(-1.0)]))
    assert grad[3:].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def _mismatch_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # token ratios exp(old - rollout): row 0 [0.5, 1, 3]; row 1 [1.5, 1.5, 3] with its last token untrained
    ratios = torch.tensor([[0.5, 1.0, 3.0], [1.5, 1.5, 3.0]])
    old = torch.zeros(2, 3, requires_grad=True)
    rollout = -ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, rollout, mask


@pytest.mark.parametrize(
    ("mode", "level", "weights", "indicator"),
    [
        # token TIS: min(r, 2); untrained positions get 1
        ("tis", "token", [[0.5, 1.0, 2.0], [1.5, 1.5, 1.0]], [[0, 0, 1], [0, 0, 0]]),
        # token MIS: r > 2 -> 0
        ("mis", "token", [[0.5, 1.0, 0.0], [1.5, 1.5, 1.0]], [[0, 0, 1], [0, 0, 0]]),
        # sequence: rho_0 = 0.5 * 1 * 3 = 1.5; rho_1 = 1.5 * 1.5 = 2.25 (untrained 3 excluded) > 2
        ("tis", "sequence", [[1.5] * 3, [2.0] * 3], [[0, 0, 0], [1, 1, 0]]),
        ("mis", "sequence", [[1.5] * 3, [0.0] * 3], [[0, 0, 0], [1, 1, 0]]),
    ],
)
def test_mismatch_weights_hand_computed(mode, level, weights, indicator):
    old, rollout, mask = _mismatch_example()
    w, over = mismatch_weights(old, rollout, mask, mode=mode, level=level, clip=2.0)
    torch.testing.assert_close(w, torch.tensor(weights))
    torch.testing.assert_close(over, torch.tensor(indicator, dtype=torch.float32))
    assert not w.requires_grad and not over.requires_grad


def test_mismatch_weights_sequence_product_does_not_overflow_and_errors_name_the_problem():
    old = torch.full((1, 10), 100.0)
    rollout = torch.zeros(1, 10)
    mask = torch.ones(1, 10)
    # rho = exp(1000): inf in float32, compared in log space
    w_tis, _ = mismatch_weights(old, rollout, mask, mode="tis", level="sequence", clip=2.0)
    w_mis, over = mismatch_weights(old, rollout, mask, mode="mis", level="sequence", clip=2.0)
    torch.testing.assert_close(w_tis, torch.full((1, 10), 2.0))
    torch.testing.assert_close(w_mis, torch.zeros(1, 10))
    assert over.sum().item() == 10
    with pytest.raises(ValueError, match=">= 1"):
        mismatch_weights(old, rollout, mask, mode="tis", level="token", clip=0.5)
    with pytest.raises(ValueError, match="valid options: mis, tis"):
        mismatch_weights(old, rollout, mask, mode="is", level="token", clip=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid options: sequence, token"):
        mismatch_weights(old, rollout, mask, mode="tis", level="seq", clip=2.0)  # type: ignore[arg-type]


def test_token_sum_aggregations_hand_computed_and_shares_add_up():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # seq_mean_token_sum: (6 + 4) / 2 = 5 (row 3 empty); *_norm with L_max = 4: (6/4 + 4/4) / 2 = 1.25
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx(5.0)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(1.25)
    parts = [(loss[:1], mask[:1]), (loss[1:], mask[1:])]
    shares = [aggregate(lo, m, "seq_mean_token_sum", global_seqs=2).item() for lo, m in parts]
    assert sum(shares) == pytest.approx(5.0)
    shares = [aggregate(lo, m, "seq_mean_token_sum_norm", global_seqs=2, norm_len=4).item() for lo, m in parts]
    assert sum(shares) == pytest.approx(1.25)
    assert aggregate(loss, torch.zeros_like(mask), "seq_mean_token_sum_norm", norm_len=4).item() == 0.0
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="seq_mean_token_sum_norm"):
        aggregate(loss, mask, "seq_sum")  # type: ignore[arg-type]


def test_config_accepts_the_new_options_and_names_bad_ones():
    run = validate({"algo": {"kl_estimator": "low_var_kl", "loss_agg": "seq_mean_token_sum_norm"},
                    "precision": {"tis_clip": 2.0, "mismatch_mode": "mis", "mismatch_level": "sequence"}})
    assert (run.precision.mismatch_mode, run.precision.mismatch_level) == ("mis", "sequence")
    assert run.algo.kl_estimator == "low_var_kl"
    with pytest.raises(ConfigError, match="precision.mismatch_mode"):
        validate({"precision": {"mismatch_mode": "truncate"}})
    with pytest.raises(ConfigError, match="precision.mismatch_level"):
        validate({"precision": {"mismatch_level": "batch"}})


@pytest.mark.parametrize(
    ("mode", "level", "loss_agg"),
    [("mis", "token", "seq_mean_token_sum"), ("mis", "sequence", "seq_mean_token_sum_norm"),
     ("tis", "sequence", "token_mean"), ("tis", "token", "seq_mean_token_sum_norm")],
)
def test_objective_with_mismatch_and_token_sums_shares_sum_to_the_whole(mode, level, loss_agg):
    run = validate({"algo": {"kl_coef": 0.1, "kl_estimator": "low_var_kl", "loss_agg": loss_agg},
                    "precision": {"tis_clip": 1.3, "mismatch_mode": mode, "mismatch_level": level}})
    fn = functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.2)
    common = dict(policy_loss_fn=fn, algo=run.algo, tis_clip=1.3, mismatch_mode=mode, mismatch_level=level,
                  norm_len=7)
    x = objective_inputs(3, rollout_noise=0.3)
    whole, whole_m = policy_objective(**x, **common)
    whole.backward()
    grad_whole = x["logp"].grad.clone()
    x["logp"].grad = None

    tokens, seqs = x["loss_mask"].sum(), (x["loss_mask"].sum(-1) > 0).sum()
    shares, metric_sums = [], {}
    for sl in (slice(0, 2), slice(2, 6)):
        loss, m = policy_objective(**{k: v[sl] for k, v in x.items()}, **common, global_tokens=tokens,
                                   global_seqs=seqs)
        shares.append(loss)
        for k, v in m.items():
            metric_sums[k] = metric_sums.get(k, 0.0) + v
    (shares[0] + shares[1]).backward()
    torch.testing.assert_close(shares[0] + shares[1], whole)
    torch.testing.assert_close(x["logp"].grad, grad_whole)
    for k in whole_m:
        torch.testing.assert_close(metric_sums[k], whole_m[k], msg=k)

    # the documented formula, and the metric named after the mode
    pg, _ = ppo_clip_loss(x["logp"], x["old_logp"], x["advantages"], clip_low=0.2, clip_high=0.2)
    w, over = mismatch_weights(x["old_logp"], x["rollout_logp"], x["loss_mask"],
                               mode=mode, level=level, clip=1.3)
    def agg(v: torch.Tensor) -> torch.Tensor:
        return aggregate(v, x["loss_mask"], loss_agg, norm_len=7)
    kl = kl_penalty(x["logp"], x["ref_logp"], "low_var_kl")
    torch.testing.assert_close(whole, agg(pg * w) + 0.1 * agg(kl))
    metric = "train/tis_clip_frac" if mode == "tis" else "train/mis_masked_frac"
    other = "train/mis_masked_frac" if mode == "tis" else "train/tis_clip_frac"
    assert metric in whole_m and other not in whole_m
    torch.testing.assert_close(whole_m[metric], (over * x["loss_mask"]).sum() / tokens)
    assert 0.0 < whole_m[metric].item() < 1.0  # the example exercises the threshold
