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
depend on which other requests share its batch. Since ``argmax`` ignores a
per-row constant, the engine races on the filtered scaled logits directly,
``argmax(filtered(z / T) - log E)``, and reuses ``log_softmax(z / T)`` for the
reported log-probs; :func:`filter_logits_rows` gives every row of a
continuous batch its own top-k / top-p.
"""

from __future__ import annotations

import torch
from torch import Tensor


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Mask to ``-inf`` every token outside the top-k / top-p set.

    logits: [B, V] (already temperature-scaled; top-p is taken on their softmax)
    -> [B, V] fp32. ``top_k = 0`` and ``top_p = 1`` disable the filters.
    """
    if top_k == 0 and top_p >= 1.0:
        return logits.float()
    b = logits.shape[0]
    return filter_logits_rows(logits, torch.full((b,), top_k, dtype=torch.long, device=logits.device),
                              torch.full((b,), top_p, dtype=torch.float32, device=logits.device))


def filter_logits_rows(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """:func:`filter_logits` with its own ``top_k`` / ``top_p`` per row (a continuous batch mixes requests).

    logits: [B, V]; top_k: [B] int (0 = off); top_p: [B] float (1 = off) -> [B, V] fp32.
    One sort serves both filters: top-k keeps values ``>= `` the k-th largest (ties kept), then top-p
    drops a token when the top-k-renormalised mass of the strictly more likely tokens reaches ``p``.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(-1, (k - 1)[:, None])  # [B, 1]
    drop_sorted = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(drop_sorted, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # never drops the top token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


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
