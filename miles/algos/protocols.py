"""The two algorithm edges a config may name, and their contract checks.

``algo.advantage`` is an :class:`AdvantageFn`, ``algo.policy_loss`` a :class:`PolicyLossFn` (after
``build`` has bound ``clip_low`` / ``clip_high``). Any callable with the signature works, built-in
or user code named by ``_target_`` (with its module prefix in ``plugins.allow``).
:func:`check_advantage_fn` and :func:`check_policy_loss_fn` run a function on small synthetic
inputs on CPU and raise :class:`ContractError` naming the first broken rule, so a custom
function is rejected in milliseconds at start-up rather than as a NaN hours into a run.

Rules for an advantage function ``(rewards [G, n]) -> advantages [G, n]``:

1. returns a float tensor of the same shape, for several G and n >= 2 (or the configured n);
2. every value is finite, also when a group's rewards are all equal (no spread);
3. the input is not modified in place.

Rules for a policy loss ``(logp, old_logp, advantages, *, loss_mask) -> (loss [B, T], indicators)``:

1. returns ``(loss, dict)``; ``loss`` is a float [B, T] tensor that is finite and carries a
   gradient to ``logp``; each indicator is a [B, T] tensor of 0/1 values without gradient;
2. the gradient of the masked token mean is finite and nonzero;
3. masked tokens (``loss_mask == 0``) neither receive gradient nor change the masked loss, even
   when their log-probs are far from the others (as on padding);
4. at ``logp == old_logp`` raising the log-prob of a token with positive advantage does not raise
   the loss, and with negative advantage does not lower it (gradient sign: a sign slip fails);
5. no input is modified in place;
6. with ``per_token=True`` (the default) it also accepts per-token advantages [B, T] (PPO/GAE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from miles.algos.losses import aggregate


class ContractError(ValueError):
    """A user-supplied algorithm function breaks its protocol; the message names the rule."""


class AdvantageFn(Protocol):
    """``(rewards [G, n]) -> advantages [G, n]`` fp32: G prompts, n samples per prompt."""

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor: ...


class PolicyLossFn(Protocol):
    """``(logp [B,T], old_logp [B,T], advantages [B] or [B,T], *, loss_mask [B,T]) -> (loss [B,T], {name: 0/1 [B,T]})``.

    ``loss_mask`` is 1 on trained tokens; token-level losses ignore it, sequence-level ones (GSPO)
    need it for their ratio. Each indicator's token mean becomes the metric ``train/<name>``.
    """

    def __call__(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def _name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"


def _fail(kind: str, fn: Any, rule: str) -> ContractError:
    return ContractError(f"{kind} '{_name(fn)}' breaks its contract: {rule} (see miles.algos.protocols)")


def check_advantage_fn(fn: Callable[[torch.Tensor], torch.Tensor], *, num_samples: int | None = None) -> None:
    """Raise :class:`ContractError` unless ``fn`` follows the advantage-function rules (module docstring).

    ``num_samples``: check only groups of this size (``algo.num_samples_per_prompt``), for estimators
    that need a minimum group size; default: groups of 4, 8 and 2.
    """
    g = torch.Generator().manual_seed(0)
    if num_samples is None:
        cases = [
            torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]),  # no-spread groups too
            torch.rand(5, 8, generator=g),
            torch.tensor([[0.3, -0.7]]),
        ]
    else:
        ties = torch.stack([torch.zeros(num_samples), torch.ones(num_samples), torch.arange(num_samples) % 2.0])
        cases = [ties, torch.rand(5, num_samples, generator=g), torch.rand(1, num_samples, generator=g)]
    for rewards in cases:
        before = rewards.clone()
        try:
            out = fn(rewards)
        except Exception as e:  # noqa: BLE001 - report any failure as a contract breach
            raise _fail("advantage function", fn, f"raised {type(e).__name__}: {e} on rewards of shape "
                        f"{tuple(rewards.shape)}") from e
        if not torch.equal(rewards, before):
            raise _fail("advantage function", fn, "modified its rewards input in place")
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise _fail("advantage function", fn, f"must return a float tensor, returned {type(out).__name__}"
                        + (f" of dtype {out.dtype}" if isinstance(out, torch.Tensor) else ""))
        if out.shape != rewards.shape:
            raise _fail("advantage function", fn, f"must return advantages of the rewards' shape [G, n] = "
                        f"{tuple(rewards.shape)}, returned {tuple(out.shape)}")
        if not torch.isfinite(out).all():
            raise _fail("advantage function", fn, f"returned non-finite advantages for rewards {rewards.tolist()}")


def check_policy_loss_fn(fn: PolicyLossFn, *, per_token: bool = True) -> None:
    """Raise :class:`ContractError` unless ``fn`` follows the policy-loss rules (module docstring).

    ``fn`` is the callable the trainer calls, i.e. with ``clip_low`` / ``clip_high`` already bound.
    ``per_token=False`` skips rule 6 for sequence-level losses that need one advantage per sequence.
    """
    g = torch.Generator().manual_seed(0)
    b, t = 4, 5
    old = -torch.rand(b, t, generator=g) * 2 - 0.1
    logp = old + 0.05 * torch.randn(b, t, generator=g)
    mask = torch.ones(b, t)
    mask[0, 3:] = 0.0  # right padding
    mask[2, 1] = 0.0  # an environment token inside a response
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2])
    shapes = [adv] + ([adv.unsqueeze(-1) * torch.linspace(0.5, 1.5, t)] if per_token else [])
    for a in shapes:
        where = f"advantages {list(a.shape)}"
        loss, grad = _run_loss(fn, logp, old, a, mask, where)
        if not torch.isfinite(grad).all() or grad.abs().sum() == 0:
            raise _fail("policy loss", fn, f"the masked mean of the loss must give a finite, nonzero gradient "
                        f"to logp ({where}); got {grad.tolist()}")
        if grad[mask == 0].abs().max() > 0:
            raise _fail("policy loss", fn, f"masked tokens (loss_mask == 0) received gradient ({where})")
        # masked positions far away (as padding can be) must not change the masked loss or its gradient
        far_logp = torch.where(mask > 0, logp, torch.full_like(logp, -30.0))
        far_old = torch.where(mask > 0, old, torch.full_like(old, -0.01))
        loss2, grad2 = _run_loss(fn, far_logp, far_old, a, mask, where + ", masked log-probs moved")
        if not torch.allclose(loss2, loss, rtol=1e-5, atol=1e-6) or not torch.allclose(grad2, grad, rtol=1e-5,
                                                                                          atol=1e-6):
            raise _fail("policy loss", fn, f"changing masked tokens' log-probs changed the masked loss "
                        f"({loss.item():.6g} -> {loss2.item():.6g}) or its gradient ({where})")
    # gradient sign at ratio 1: -A * dL/dlogp >= 0 on every trained token, > 0 somewhere
    _, grad = _run_loss(fn, old.clone(), old, adv, mask, "advantages [B] at logp == old_logp")
    descent = -(grad * adv.unsqueeze(-1))[mask > 0]
    if (descent < -1e-7).any() or descent.max() <= 0:
        raise _fail("policy loss", fn, "at logp == old_logp the loss must fall when the log-prob of a "
                    "positive-advantage token rises (and rise for a negative one); the gradient has the "
                    f"wrong sign: dloss/dlogp = {grad.tolist()} for advantages {adv.tolist()}")


def _run_loss(
    fn: PolicyLossFn, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``fn``, check its outputs and inputs, return (masked token-mean loss, d/dlogp)."""
    logp = logp.clone().requires_grad_(True)
    inputs = {"logp": logp, "old_logp": old, "advantages": adv, "loss_mask": mask}
    before = {k: v.detach().clone() for k, v in inputs.items()}
    try:
        out = fn(logp, old, adv, loss_mask=mask)
    except Exception as e:  # noqa: BLE001 - report any failure as a contract breach
        raise _fail("policy loss", fn, f"raised {type(e).__name__}: {e} ({where})") from e
    for k, v in inputs.items():
        if not torch.equal(v.detach(), before[k]):
            raise _fail("policy loss", fn, f"modified its input '{k}' in place ({where})")
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise _fail("policy loss", fn, f"must return (loss [B, T], {{name: indicator [B, T]}}), returned "
                    f"{type(out).__name__} ({where})")
    loss, indicators = out
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape or not loss.is_floating_point():
        found = f"{tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise _fail("policy loss", fn, f"loss must be a float tensor of shape [B, T] = {tuple(logp.shape)}, "
                    f"found {found} ({where})")
    if not torch.isfinite(loss).all():
        raise _fail("policy loss", fn, f"returned a non-finite per-token loss ({where})")
    if not loss.requires_grad:
        raise _fail("policy loss", fn, f"the loss carries no gradient to logp (detached?) ({where})")
    for name, ind in indicators.items():
        ok = isinstance(ind, torch.Tensor) and ind.shape == logp.shape and not ind.requires_grad
        if not ok or not ((ind == 0) | (ind == 1)).all():
            raise _fail("policy loss", fn, f"indicator '{name}' must be a [B, T] tensor of 0/1 values without "
                        f"gradient ({where})")
    agg = aggregate(loss, mask, "token_mean")
    (grad,) = torch.autograd.grad(agg, logp, allow_unused=True)
    return agg.detach(), torch.zeros_like(logp) if grad is None else grad
