"""Shared-prompt forward: the n responses of one prompt attend to one copy of its prompt.

In GRPO-style batches every prompt appears ``n`` times (``algo.num_samples_per_prompt``). The
plain forward runs ``B`` rows of ``prompt + response``; when prompts are long next to responses,
most of that work is the same prompt computed ``n`` times. This forward runs in two passes:

1. the ``U`` distinct prompts of the micro-batch (right-padded to the longest, ``P_max``) with the
   key/value cache on: the keys and values of every layer, and the logits at each prompt's last
   position (they predict the first response token);
2. the responses of all ``B`` rows (all but their last token), with the cache rows repeated to
   ``B`` (``index_select``: the gradient of every response flows back into its prompt's pass),
   an attention mask that hides the prompt padding, and positions continuing from each row's own
   prompt length.

Every response token then sees the same keys, values and rotary positions as in the plain forward,
so the log-probs agree to float rounding (attention sums in a different order) and so do the
gradients; the tests check both against the plain path. Work goes from ``B * (P + R)`` tokens to
``U * P_max + B * (R - 1)``.

:func:`worth_sharing` decides per micro-batch (at least 5% of the tokens saved). Measured on CPU:
a tiny model at 8 prompts x 8 samples x (26 + 4) tokens, 44 -> 25 ms per train step; a 19M model
at 16 x 8 x (20 + 1..192), 12.3 -> 11.6 s.
Incompatible with activation checkpointing (the recomputed layer would append to the cache again)
and needs a model whose forward takes ``past_key_values`` (every HF decoder does); the trainer
falls back to the plain forward otherwise.
"""

from __future__ import annotations

import inspect

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


def shared_tokens(p: PaddedBatch) -> tuple[int, int]:
    """(tokens of the plain forward, tokens of the two shared passes) for micro-batch ``p``."""
    rows, width = p.input_ids.shape
    prompt_width = int(p.prompt_lengths[p.prompt_rows].max())
    return rows * width, p.num_prompts * prompt_width + rows * (p.targets.shape[1] - 1)


def worth_sharing(p: PaddedBatch) -> bool:
    """True when the distinct prompts are fewer than the rows and the two passes save ``MIN_SAVING``."""
    if p.num_prompts >= p.input_ids.shape[0]:
        return False
    plain, shared = shared_tokens(p)
    return shared <= (1.0 - MIN_SAVING) * plain


def shared_prompt_logits(model: torch.nn.Module, p: PaddedBatch, pad_id: int, cache_kw: str = "cache"
                         ) -> torch.Tensor:
    """Logits predicting each response token, [B, Tr, V], computing each distinct prompt once.

    Same contract as the plain ``model(prompt + response)`` followed by
    :func:`~miles.train.batching.response_logits`. ``cache_kw``: :func:`cache_keyword` of ``model``.
    """
    device = p.input_ids.device
    lens = p.prompt_lengths[p.prompt_rows]  # [U]
    width = int(lens.max())
    positions = torch.arange(width, device=device)
    prompt_mask = (positions < lens.unsqueeze(-1)).long()  # [U, P_max]
    prompt_ids = torch.where(prompt_mask.bool(), p.input_ids[p.prompt_rows, :width], pad_id)
    first = int(lens.min()) - 1  # earliest last-prompt position: only positions from there need logits
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions.expand_as(prompt_ids),
                use_cache=True, logits_to_keep=width - first)
    last = out.logits[torch.arange(len(lens), device=device), lens - 1 - first]  # [U, V]
    head = last.index_select(0, p.prompt_index).unsqueeze(1)  # [B, 1, V]: predicts response token 0
    steps = p.targets.shape[1] - 1
    if steps == 0:
        return head
    cache = DynamicCache()
    for layer, entry in enumerate(getattr(out, cache_kw).layers):
        cache.update(entry.keys.index_select(0, p.prompt_index), entry.values.index_select(0, p.prompt_index), layer)
    rows = p.prompt_index
    mask = torch.cat([prompt_mask.index_select(0, rows), p.response_mask[:, :steps].long()], dim=1)
    position_ids = p.prompt_lengths.unsqueeze(-1) + torch.arange(steps, device=device)
    tail = model(input_ids=p.targets[:, :steps], attention_mask=mask, position_ids=position_ids,
                 use_cache=True, **{cache_kw: cache}).logits  # [B, Tr - 1, V]
    return torch.cat([head, tail], dim=1)
