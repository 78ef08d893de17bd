"""Next-token sampling: temperature, top-k and top-p (nucleus) filtering.

Given logits ``z [B, V]`` the policy is ``p = softmax(z / T)``. Top-k keeps the
``k`` largest logits, top-p keeps the smallest set of most likely tokens whose
mass reaches ``p`` (always at least one token); the rest get ``-inf`` and the
survivors are renormalised by the softmax. Filtering only changes *what is
sampled*: the log-prob reported for the sampled token is that of the full
temperature-scaled distribution (:func:`miles.algos.logprobs.token_logprobs`),
which is the policy the trainer optimises.

Sampling uses the exponential race (as vLLM does): with ``E_i ~ Exp(1)``
independent, ``argmax_i p_i / E_i`` is distributed as ``Categorical(p)``. The
noise ``E [B, V]`` is an input, so the engine can draw each request's rows
from that request's own seeded generator: a request's samples then do not
depend on which other requests share its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise ``ValueError`` for sampling parameters outside their domain."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 disables nucleus sampling), got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {top_k}")


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Mask to ``-inf`` every token outside the top-k / top-p set.

    logits: [B, V] (already temperature-scaled; top-p is taken on their softmax)
    -> [B, V] fp32. ``top_k = 0`` and ``top_p = 1`` disable the filters.
    """
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p  # never drops the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: Tensor, noise: Tensor | None, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """Sample one token per row.

    logits: [B, V]; noise: [B, V] i.i.d. Exp(1) draws, or None for greedy
    (argmax of the logits, ignoring temperature and the filters) -> tokens [B] int64.
    """
    if noise is None:
        return logits.argmax(dim=-1)
    logp = filter_logits(logits.float() / temperature, top_k, top_p).log_softmax(dim=-1)
    # argmax p / E == argmax (log p - log E); clamp guards log(0) for an exact zero draw.
    return (logp - noise.clamp_min(torch.finfo(noise.dtype).tiny).log()).argmax(dim=-1)
