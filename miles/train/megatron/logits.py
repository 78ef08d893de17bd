"""Token log-probs and entropies from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its vocabulary slice ``[start, start + V_r)``. With
``z = logits / T`` (fp32) and ``m`` the global max (a constant: the softmax does not depend on it)::

    S      = sum_r sum_v exp(z_v - m)                     one all-reduce (sum) of [N]
    logZ   = m + log S
    logp_t = z_t - logZ                                   z_t from the rank that holds token t (sum)
    H      = logZ - sum_v p_v z_v                         one all-reduce (sum) of [N]

The sums are megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity
backward): every TP rank computes the same loss, and each backpropagates into its own slice. Columns
at or past the real vocabulary (padding up to a multiple of TP) get weight 0. With one rank
(``sum_fn`` and ``max_fn`` the identity) these are exactly :func:`miles.algos.logprobs.token_logprobs`
and :func:`~miles.algos.logprobs.entropy_from_logits` up to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def vocab_parallel_logp_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                                vocab_size: int | None = None, temperature: float = 1.0,
                                sum_fn: Reduce = _identity, max_fn: Reduce = _identity,
                                with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target and the entropy, of ``softmax(logits / temperature)`` over all ranks' slices.

    logits: [..., V_r] (this rank's slice, any float dtype), targets: [...] int64 (global ids) ->
    (logp [...] fp32, entropy [...] fp32 or None). ``vocab_size``: the real vocabulary (columns at or
    past it are padding); ``sum_fn`` / ``max_fn``: the all-reduces over the TP group (differentiable
    sum with identity backward; max without gradient).
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    width = z.shape[-1]
    real = None
    if vocab_size is not None and vocab_start + width > vocab_size:
        real = torch.arange(vocab_start, vocab_start + width, device=z.device) < vocab_size
    zmax = z.detach() if real is None else z.detach().masked_fill(~real, float("-inf"))
    m = max_fn(zmax.amax(dim=-1))
    shifted = z - m.unsqueeze(-1)
    e = shifted.exp()
    if real is not None:  # padded columns: weight 0 (finite values, so no 0 * inf in the backward)
        e = e * real
    log_s = torch.log(sum_fn(e.sum(dim=-1)))
    local = targets - vocab_start
    here = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    logp = sum_fn(torch.where(here, picked, torch.zeros_like(picked))) - log_s
    if not with_entropy:
        return logp, None
    # H = log S - sum_v p_v (z_v - m), p_v = e_v / S
    entropy = log_s - sum_fn((e * shifted).sum(dim=-1)) / log_s.exp()
    return logp, entropy
