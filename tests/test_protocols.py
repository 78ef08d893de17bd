"""Contract checks for advantage functions and policy losses: every built-in passes, user code is checked."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import pytest
import torch

from miles.algos import advantages, losses
from miles.algos.protocols import ContractError, check_advantage_fn, check_policy_loss_fn
from miles.config import TargetConfig, build, validate

ADVANTAGE_FNS = [
    advantages.group_normalized,
    functools.partial(advantages.group_normalized, normalize_std=False),
    advantages.rloo,
    advantages.reinforce_pp,
    advantages.reinforce_pp_baseline,
    advantages.rejection_sampling,
]
TOKEN_LOSSES = [losses.ppo_clip_loss, losses.dual_clip_ppo_loss, losses.cispo_loss, losses.sft_loss]


@pytest.mark.parametrize("fn", ADVANTAGE_FNS, ids=lambda f: getattr(f, "__name__", None) or f.func.__name__)
def test_builtin_advantage_fns_pass(fn):
    check_advantage_fn(fn)
    check_advantage_fn(fn, num_samples=3)


def test_advantage_check_at_the_configured_group_size():
    def needs_four(rewards):
        if rewards.shape[1] < 4:
            raise ValueError("needs_four: at least 4 samples per group")
        return rewards - rewards.mean(1, keepdim=True)

    check_advantage_fn(needs_four, num_samples=4)
    with pytest.raises(ContractError, match="raised ValueError: needs_four: at least 4 samples per group on rewards "
                                            "of shape \\(1, 2\\)"):
        check_advantage_fn(needs_four)


@pytest.mark.parametrize("fn", TOKEN_LOSSES + [losses.gspo_loss], ids=lambda f: f.__name__)
def test_builtin_policy_losses_pass(fn):
    bound = functools.partial(fn, clip_low=0.2, clip_high=0.28)
    check_policy_loss_fn(bound, per_token=fn is not losses.gspo_loss)


def test_gspo_refuses_per_token_advantages_with_a_clear_message():
    with pytest.raises(ContractError, match=r"gspo_loss' breaks its contract: raised ValueError: gspo_loss: expected "
                                            r"advantages \[B\]"):
        check_policy_loss_fn(functools.partial(losses.gspo_loss, clip_low=0.2, clip_high=0.2))


def _bad_advantages():
    def nan_on_ties(rewards):
        return (rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)  # 0/0 on a no-spread group

    def flattens(rewards):
        return rewards.flatten()

    def in_place(rewards):
        return rewards.sub_(rewards.mean(1, keepdim=True))

    def integer(rewards):
        return (rewards > 0.5).long()

    return [(nan_on_ties, "non-finite advantages"), (flattens, r"shape \[G, n\] = \(3, 4\), returned \(12,\)"),
            (in_place, "modified its rewards input in place"), (integer, "must return a float tensor")]


@pytest.mark.parametrize("fn,message", _bad_advantages(), ids=lambda x: getattr(x, "__name__", "msg"))
def test_broken_advantage_fns_fail_with_the_rule(fn, message):
    with pytest.raises(ContractError, match=message):
        check_advantage_fn(fn)


def _tok(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _bad_losses():
    def wrong_sign(logp, old_logp, advantages, *, loss_mask):
        return torch.exp(logp - old_logp) * _tok(advantages), {}

    def detached(logp, old_logp, advantages, *, loss_mask):
        return (-torch.exp(logp - old_logp) * _tok(advantages)).detach(), {}

    def row_mean_ignores_mask(logp, old_logp, advantages, *, loss_mask):
        per_seq = (-torch.exp(logp - old_logp) * _tok(advantages)).mean(-1, keepdim=True)
        return per_seq.expand_as(logp), {}

    def inf_on_padding(logp, old_logp, advantages, *, loss_mask):
        return -_tok(advantages) * logp / (logp > -10).float(), {}

    def scalar(logp, old_logp, advantages, *, loss_mask):
        return (-torch.exp(logp - old_logp) * _tok(advantages)).mean(), {}

    def in_place(logp, old_logp, advantages, *, loss_mask):
        old_logp.clamp_(min=-1.0)
        return -torch.exp(logp - old_logp) * _tok(advantages), {}

    def soft_indicator(logp, old_logp, advantages, *, loss_mask):
        ratio = torch.exp(logp - old_logp)
        return -ratio * _tok(advantages), {"clip_frac_high": ratio.detach()}

    return [
        (wrong_sign, "gradient has the wrong sign"),
        (detached, "carries no gradient"),
        (row_mean_ignores_mask, "masked tokens .* received gradient"),
        (inf_on_padding, "non-finite per-token loss"),
        (scalar, r"shape \[B, T\] = \(4, 5\), found \(\)"),
        (in_place, "modified its input 'old_logp' in place"),
        (soft_indicator, "indicator 'clip_frac_high' must be a \\[B, T\\] tensor of 0/1 values"),
    ]


@pytest.mark.parametrize("fn,message", _bad_losses(), ids=lambda x: getattr(x, "__name__", "msg"))
def test_broken_policy_losses_fail_with_the_rule(fn, message):
    with pytest.raises(ContractError, match=message) as err:
        check_policy_loss_fn(fn)
    assert fn.__name__ in str(err.value)  # the message names the function


PLUGIN = textwrap.dedent('''
    import torch

    def my_advantage(rewards, *, scale=1.0):
        return scale * (rewards - rewards.mean(dim=1, keepdim=True))

    def my_loss(logp, old_logp, advantages, *, clip_low, clip_high, loss_mask):
        ratio = torch.exp(logp - old_logp)
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        return -torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach() * adv * logp, {}

    def broken_loss(logp, old_logp, advantages, *, clip_low, clip_high, loss_mask):
        return (logp - old_logp).sum(-1), {}
''')


def test_custom_functions_loaded_by_target_from_a_user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "my_rl_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = validate({
        "plugins": {"allow": ["my_rl_plugin."]},
        "algo": {"advantage": {"_target_": "my_rl_plugin.my_advantage", "_partial_": True, "scale": 2.0},
                 "policy_loss": {"_target_": "my_rl_plugin.my_loss", "_partial_": True}},
    })
    adv_fn = build(run.algo.advantage, allow=run.plugins.allow)
    loss_fn = build(run.algo.policy_loss, allow=run.plugins.allow, clip_low=run.algo.clip_low,
                    clip_high=run.algo.clip_high)
    check_advantage_fn(adv_fn)
    check_policy_loss_fn(loss_fn)
    torch.testing.assert_close(adv_fn(torch.tensor([[1.0, 0.0]])), torch.tensor([[1.0, -1.0]]))

    broken = build(TargetConfig(target="my_rl_plugin.broken_loss", partial=True),
                   allow=run.plugins.allow, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ContractError, match=r"policy loss 'my_rl_plugin.broken_loss' breaks its contract: loss "
                                            r"must be a float tensor of shape \[B, T\] = \(4, 5\), found \(4,\)"):
        check_policy_loss_fn(broken)
