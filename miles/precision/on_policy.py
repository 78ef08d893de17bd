"""True on-policy numerics: one forward per sequence at a fixed padded length, on both sides.

The engine's usual path (KV cache, continuous batching) and the trainer's (a padded batch through
one forward) compute the same math with different shapes, and on this stack different shapes mean
different reduction orders: measured on the tiny fp32 Qwen3 on CPU, a plain HF forward over a
prefix of a sequence and over the whole sequence disagree in the last bits at 33 of 39 positions
(torch's CPU causal ``scaled_dot_product_attention`` blocks its work by sequence length, and
GEMMs with fewer than 4 rows take another kernel). So the two sides differ by ~1e-7 in log-prob
even in fp32 with identical weights.

With ``precision.true_on_policy=true`` both sides compute a sequence's logits the same way:
``prompt + tokens so far`` right-padded with the pad id to the fixed length

    L = len(prompt) + max_new_tokens

and run through the model alone (batch of one, causal mask only, logits for all L positions).
Every GEMM then has the same shape on both sides, and causal attention and the row-wise
operations make position ``i`` depend only on tokens ``<= i``, so the engine's forward after
``t`` generated tokens and the trainer's forward over the finished sequence agree bit for bit at
every position the engine sampled from. Log-probs are :func:`miles.algos.logprobs.token_logprobs`
of those logits on both sides.

Measured (tests/test_true_on_policy.py): bitwise equal for the tiny dense Qwen3 in fp32 (temperature
1 and 0.7) and in bf16, through the trainer's recompute and its training pass. Not for MoE models:
transformers' experts run one GEMM per expert over the tokens routed to it, and the padding tokens
route too, so those GEMMs change row count between the engine's forward and the trainer's (close to
1e-5, not bitwise); ``build_components`` refuses the combination.

Cost: the engine runs one forward of L tokens per generated token (no KV cache) and the trainer one
forward of L tokens per sequence (no batching): see ``python -m miles.bench precision``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from miles.algos.logprobs import token_logprobs


def fixed_length_logits(model: nn.Module, ids: list[int] | Tensor, length: int, pad_id: int) -> Tensor:
    """Logits of every position of ``ids`` right-padded to ``length``: one forward, batch of one.

    ids: [n] with n <= length -> [length, V] (rows past ``n - 1`` belong to the padding).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = ids.numel()
    if n > length:
        raise ValueError(f"true on-policy forward: {n} tokens do not fit the fixed length {length} "
                         "(prompt + max_new_tokens); a response is longer than max_new_tokens")
    device = next(model.parameters()).device
    padded = torch.full((1, length), pad_id, dtype=torch.long, device=device)
    padded[0, :n] = ids.to(device)
    return model(input_ids=padded, use_cache=False).logits[0]


def sequence_logits(model: nn.Module, ids: Tensor, prompt_len: int, max_new_tokens: int, pad_id: int,
                    width: int) -> Tensor:
    """The logits that score the response of ``ids`` = prompt + response ([n]): rows ``P - 1 ..
    P - 2 + width`` of :func:`fixed_length_logits` at ``L = P + max_new_tokens``: [width, V].

    Rows past the response are the padding's (masked by the caller); ``width <= max_new_tokens``.
    """
    logits = fixed_length_logits(model, ids, prompt_len + max_new_tokens, pad_id)
    return logits[prompt_len - 1 : prompt_len - 1 + width]


@torch.no_grad()
def generate_exact(model: nn.Module, prompt: list[int], *, max_new_tokens: int, temperature: float, greedy: bool,
                   generator: torch.Generator | None, stop_ids: set[int], pad_id: int,
                   on_first_token: Callable[[], None] | None = None) -> tuple[list[int], list[float], str]:
    """Sample one completion with :func:`fixed_length_logits` at every step (``on_first_token()`` is called
    once the first token is sampled).

    Returns ``(tokens, log-probs of the temperature-scaled distribution, finish reason)``: ``"eos"``
    when a token in ``stop_ids`` was sampled (it is kept), else ``"length"``.
    """
    length = len(prompt) + max_new_tokens
    tokens: list[int] = []
    logps: list[float] = []
    while len(tokens) < max_new_tokens:
        row = fixed_length_logits(model, list(prompt) + tokens, length, pad_id)[len(prompt) + len(tokens) - 1]
        if greedy:
            tok = int(row.argmax())
        else:
            probs = torch.softmax(row.float() / temperature, dim=-1)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        logps.append(float(token_logprobs(row[None], torch.tensor([tok], device=row.device),
                                          1.0 if greedy else temperature)[0]))
        tokens.append(tok)
        if on_first_token is not None and len(tokens) == 1:
            on_first_token()
        if tok in stop_ids:
            return tokens, logps, "eos"
    return tokens, logps, "length"
