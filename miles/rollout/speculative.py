"""Speculative sampling: the accept / reject rule, and the draft model the torch engine proposes with.

A draft proposes ``d_1 .. d_k``, each sampled from its own distribution ``q_j`` given the tokens
before it; the policy scores all ``k + 1`` positions in one forward, giving ``p_1 .. p_{k+1}``.
Proposal ``j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order; at the first
rejection the row takes a token from ``normalize(max(0, p_j - q_j))`` and stops there; when all ``k`` are
accepted it takes a bonus token from ``p_{k+1}``. Each emitted token is then distributed exactly as
plain sampling from the policy (Leviathan et al. 2023, Chen et al. 2023), whatever the draft; a better
draft only makes more tokens per step. Greedy rows accept a proposal iff it is the policy's argmax and
take the policy's argmax at the first mismatch, so their output is plain greedy decoding's.

``p`` and ``q`` are the distributions tokens are *sampled* from: ``softmax(filter(z / T))`` with the row's
temperature and top-k / top-p (:func:`miles.rollout.sampling.filter_logits_rows`) on the policy's and
the draft's logits. The engine reports each token's log-prob under the unfiltered temperature-scaled
policy, as without a draft.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles.models.draft_heads import load_heads
from miles.rollout.slot_cache import FastQwen3, SlotCache


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """One id per row of ``probs`` [..., V] (non-negative, any positive total), drawn with the uniform ``u`` [...] in
    [0, 1): the first id whose cumulative probability (summed in float64) exceeds ``u`` times the row's total.
    An id of probability 0 is never drawn; one uniform per draw, where Gumbel-max needs ``V``."""
    c = probs.double().cumsum(-1)
    idx = torch.searchsorted(c, (u.double() * c[..., -1])[..., None], right=True)[..., 0]
    return idx.clamp_max(probs.shape[-1] - 1)


def speculative_accept(
    p: Tensor,
    q: Tensor,
    draft: Tensor,
    uniform: Tensor,
    final_uniform: Tensor,
    greedy: Tensor | None = None,
    argmax: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The accept / reject rule over a batch of rows.

    p: [B, k + 1, V] policy probabilities; q: [B, k, V] draft probabilities; draft: [B, k] proposed ids;
    uniform: [B, k] U[0, 1) draws (proposal ``j`` is kept when ``uniform * q_j(d_j) < p_j(d_j)``);
    final_uniform: [B] U[0, 1) draws for the final token (:func:`sample_inverse_cdf`); greedy: [B] bool rows
    decoded greedily, whose final token is ``argmax`` [B, k + 1] (the policy's argmax per position) ->
    (accepted [B] in ``0 .. k``, tokens [B, k + 1]: the accepted proposals, then the resampled or bonus token
    at index ``accepted``; entries past it are meaningless).
    """
    b, k = draft.shape
    rows = torch.arange(b, device=p.device)
    p_d = p[:, :k].gather(-1, draft[..., None])[..., 0]
    q_d = q.gather(-1, draft[..., None])[..., 0]
    ok = uniform * q_d < p_d  # u < p / q, without dividing by a q that underflowed to 0
    if greedy is not None and argmax is not None:
        ok = torch.where(greedy[:, None], draft == argmax[:, :k], ok)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    p_a = p[rows, accepted]
    q_a = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[
        rows, accepted
    ]  # zero at k: the bonus is p itself
    residual = (p_a - q_a).clamp_min(0.0)
    residual = torch.where(
        residual.sum(-1, keepdim=True) > 0, residual, p_a
    )  # p == q to rounding: never rejected
    final = sample_inverse_cdf(residual, final_uniform)
    if greedy is not None and argmax is not None:
        final = torch.where(greedy, argmax[rows, accepted], final)
    tokens = torch.cat([draft, draft[:, :1]], dim=1).clone()
    tokens[rows, accepted] = final
    return accepted, tokens


class DraftModel:
    """The draft: a transformers causal LM with its own per-slot KV cache (slots as the engine's).

    ``forward`` runs the base model through :attr:`cache` (set its mode first, as the engine does with its
    own cache) and returns final-normed hidden states; ``logits`` applies the LM head in fp32. For Qwen3
    the forward is :class:`~miles.rollout.slot_cache.FastQwen3` (no start-up check: whatever the draft's
    forward computes is the ``q`` it samples from, so its rounding cannot bias the output).
    """

    def __init__(self, checkpoint_dir: str, dtype: torch.dtype, device: torch.device, slots: int) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype, attn_implementation="sdpa")
        self.checkpoint_dir = checkpoint_dir
        self.model = model.to(device).eval().requires_grad_(False)
        self.vocab_size = int(self.model.config.vocab_size)
        self._base = self.model.base_model
        self._lm_head = self.model.get_output_embeddings()
        params = inspect.signature(self._base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._fast = FastQwen3(self.model) if FastQwen3.supports(self.model) else None
        self.cache = SlotCache(slots)

    def forward(self, ids: Tensor, mask: Tensor, position_ids: Tensor) -> Tensor:
        """ids, position_ids: [B, T]; mask: [B, 1, T, kv] bool -> hidden states [B, T, D]."""
        if self._fast is not None:
            return self._fast(ids, mask, position_ids, self.cache)
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache}
        out = self._base(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kwargs
        )
        return out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        return self._lm_head(hidden).float()


def truncated_draft(policy_dir: str | Path, out_dir: str | Path, num_layers: int = 1) -> Path:
    """A draft made of the policy's first ``num_layers`` decoder layers, its embeddings, final norm and LM
    head (a layer-skipping draft: no training, same tokenizer, which is copied along). Returns ``out_dir``."""
    from transformers import AutoModelForCausalLM

    src, out = Path(policy_dir), Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    layers = model.base_model.layers
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}] (the policy's layers), got {num_layers}")
    model.base_model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(str(out))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and f.is_file():
            shutil.copy(f, out / f.name)
    return out


class DraftHeads:
    """The engine's side of a heads draft: :attr:`model` (the heads, in the engine's dtype; the weights that
    ``update_draft`` replaces) and no KV cache of its own (``cache`` is None)."""

    cache = None

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, hidden_size: int) -> None:
        self.checkpoint_dir = path
        self.model = load_heads(path, dtype).to(device).eval().requires_grad_(False)
        if self.model.weight.shape[1] != hidden_size:
            raise ValueError(f"the draft heads in {path} read hidden states of size {self.model.weight.shape[1]}; "
                             f"the policy's are {hidden_size}: train heads for this policy")
        self.k = self.model.k
