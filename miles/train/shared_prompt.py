"""Shared-prompt forward: the n responses of one prompt attend to one copy of its prompt.

In GRPO-style batches every prompt appears ``n`` times (``algo.num_samples_per_prompt``). The
plain forward runs ``B`` rows of ``prompt + response``; when prompts are long next to responses,
most of that work is the same prompt computed ``n`` times. This forward runs in two passes:

1. :func:`prompt_pass`: the ``U`` distinct prompts (right-padded to the longest, ``P_max``) with
   the key/value cache on: the keys and values of every layer, and the logits at each prompt's last
   position (they predict the first response token);
2. :func:`response_logits_after`: the responses of ``B`` rows (all but their last token), with the
   cache rows repeated to ``B`` (``index_select``: the gradient of every response flows back into
   its prompt's pass), an attention mask that hides the prompt padding, and positions continuing
   from each row's own prompt length.

Every response token then sees the same keys, values and rotary positions as in the plain forward,
so the log-probs agree to float rounding (attention sums in a different order) and so do the
gradients; the tests check both against the plain path. Work goes from ``B * (P + R)`` tokens to
``U * P_max + B * (R - 1)``.

The trainer runs the prompt pass once per mini-batch and rank, not once per micro-batch: the
micro-batches, cut by response length, then hold few rows of any one prompt, so a per-micro-batch
prompt pass would recompute most prompts in every pass. The micro-batches before the last read
:meth:`PromptPass.leaves` (detached copies that collect their gradients); the last one reads the
pass itself, and its backward carries the collected gradients into the prompt pass
(:meth:`PromptPass.pending`), so the prompt pass runs forward and backward once and the gradient is
the plain forward's. On a 19M model at 16 prompts x 8 samples x (18 + 1..192) tokens this is
14.4k tokens per step instead of 16.9k (per-micro-batch sharing) or 16.6k (none).

:func:`worth_sharing` decides (at least 5% of the tokens saved).
Incompatible with activation checkpointing (the recomputed layer would append to the cache again)
and needs a model whose forward takes ``past_key_values`` (every HF decoder does); the trainer
falls back to the plain forward otherwise.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from miles.train.batching import PaddedBatch

MIN_SAVING = 0.05
"""Share the prompt pass only when it saves at least this fraction of the tokens of the plain forward."""


def cache_keyword(model: torch.nn.Module) -> str | None:
    """The name ``model.forward`` takes its key/value cache by (``cache``; ``past_key_values`` in older
    transformers), or None when it takes none (then the trainer uses the plain forward)."""
    params = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def distinct_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order, and each sample's index into them."""
    index: dict[tuple[int, ...], int] = {}
    of = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    return [list(p) for p in index], of


def shared_tokens(prompt_ids: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> tuple[int, int]:
    """(real tokens of the plain forward, of the two shared passes) for these rows: every row's prompt
    plus response, against ``U * P_max`` prompt tokens plus every response but its last token."""
    prompts, _ = distinct_prompts(prompt_ids)
    plain = sum(len(p) for p in prompt_ids) + sum(response_lengths)
    shared = len(prompts) * max(len(p) for p in prompts) + sum(max(1, r - 1) for r in response_lengths)
    return plain, shared


def worth_sharing(prompt_ids: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> bool:
    """True when the distinct prompts are fewer than the rows and the two passes save ``MIN_SAVING``."""
    if len({tuple(p) for p in prompt_ids}) >= len(prompt_ids):
        return False
    plain, shared = shared_tokens(prompt_ids, response_lengths)
    return shared <= (1.0 - MIN_SAVING) * plain


@dataclass(frozen=True, kw_only=True)
class PromptPass:
    """The distinct prompts' pass: per-layer keys and values, next-token logits, padding mask."""

    keys: tuple[torch.Tensor, ...]  # per layer [U, kv_heads, P_max, head_dim]
    values: tuple[torch.Tensor, ...]  # per layer [U, kv_heads, P_max, head_dim]
    head: torch.Tensor  # [U, V]: logits at each prompt's last position
    mask: torch.Tensor  # [U, P_max] int64: 1 on real prompt tokens
    lengths: torch.Tensor  # [U] int64

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values, self.head)

    def leaves(self) -> PromptPass:
        """Detached copies that collect the gradients of the passes that read them (no grad mode: self)."""
        if not torch.is_grad_enabled() or not self.head.requires_grad:
            return self
        keys, values = ([t.detach().requires_grad_() for t in ts] for ts in (self.keys, self.values))
        return dataclasses.replace(self, keys=tuple(keys), values=tuple(values),
                                   head=self.head.detach().requires_grad_())

    def pending(self, leaves: PromptPass) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors of this pass, gradients ``leaves`` collected for them): the extra roots and grads of
        a ``torch.autograd.backward`` that carries those gradients into the prompt pass."""
        if leaves is self:
            return [], []
        pairs = [(t, leaf.grad) for t, leaf in zip(self.tensors(), leaves.tensors(), strict=True)
                 if leaf.grad is not None]
        return [t for t, _ in pairs], [g for _, g in pairs]


def prompt_pass(model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_id: int, cache_kw: str = "cache",
                device: torch.device | str = "cpu") -> PromptPass:
    """One forward over the distinct ``prompts`` with the cache on (:class:`PromptPass`)."""
    lens = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lens.max())
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    ids = ids.to(device)
    positions = torch.arange(width, device=device)
    mask = (positions < lens.unsqueeze(-1)).long()  # [U, P_max]
    first = int(lens.min()) - 1  # earliest last-prompt position: only positions from there need logits
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions.expand_as(ids),
                use_cache=True, logits_to_keep=width - first)
    head = out.logits[torch.arange(len(prompts), device=device), lens - 1 - first]  # [U, V]
    layers = getattr(out, cache_kw).layers
    return PromptPass(keys=tuple(e.keys for e in layers), values=tuple(e.values for e in layers), head=head,
                      mask=mask, lengths=lens)


def response_logits_after(model: torch.nn.Module, pp: PromptPass, p: PaddedBatch, prompt_of: torch.Tensor,
                          cache_kw: str = "cache") -> torch.Tensor:
    """Logits predicting each response token of micro-batch ``p``, [B, Tr, V], its rows' prompts read
    from ``pp`` (``prompt_of``: [B] index of each row's prompt in ``pp``).

    The response pass always runs, over at least one position (for one-token responses its logits are
    dropped): data-parallel ranks must run the same passes.
    """
    head = pp.head.index_select(0, prompt_of).unsqueeze(1)  # [B, 1, V]: predicts response token 0
    width = p.targets.shape[1]
    steps = max(1, width - 1)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(pp.keys, pp.values, strict=True)):
        cache.update(k.index_select(0, prompt_of), v.index_select(0, prompt_of), layer)
    mask = torch.cat([pp.mask.index_select(0, prompt_of), p.response_mask[:, :steps].long()], dim=1)
    position_ids = pp.lengths.index_select(0, prompt_of).unsqueeze(-1) + torch.arange(steps, device=head.device)
    tail = model(input_ids=p.targets[:, :steps], attention_mask=mask, position_ids=position_ids,
                 use_cache=True, **{cache_kw: cache}).logits  # [B, steps, V]
    return torch.cat([head, tail[:, : width - 1]], dim=1)


def shared_prompt_logits(model: torch.nn.Module, p: PaddedBatch, pad_id: int, cache_kw: str = "cache"
                         ) -> torch.Tensor:
    """Logits predicting each response token, [B, Tr, V], computing each distinct prompt of ``p`` once.

    Same contract as the plain ``model(prompt + response)`` followed by
    :func:`~miles.train.batching.response_logits`. ``cache_kw``: :func:`cache_keyword` of ``model``.
    """
    prompts = [p.input_ids[r, : int(p.prompt_lengths[r])].tolist() for r in p.prompt_rows.tolist()]
    pp = prompt_pass(model, prompts, pad_id, cache_kw, device=p.input_ids.device)
    return response_logits_after(model, pp, p, p.prompt_index, cache_kw)
