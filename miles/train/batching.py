"""Turn a :class:`~miles.types.TrainBatch` (lists of token ids) into padded tensors.

Each sequence is ``prompt + response``, right-padded to the longest in the batch::

    input_ids      [B, L]   L = max_i (P_i + R_i), pad id after the last real token
    attention_mask [B, L]   1 on real tokens
    position_ids   [B, L]   0 .. L-1 (right padding: real tokens keep their natural positions)

Response-side tensors are ``[B, Tr]`` with ``Tr = max_i R_i``. Response token ``j`` of sample
``i`` sits at position ``p = P_i + j`` and is predicted by the logits at ``p - 1``, so
``logit_index[i, j] = P_i + j - 1`` and :func:`response_logits` gathers ``logits[i, P_i + j - 1]``.
Gathering before the softmax keeps the log-softmax off prompt positions.

``response_mask`` marks real response tokens; ``loss_mask`` is that times the sample's own loss
mask (0 for environment/tool tokens), and is what losses and metrics average over. ``advantages``
is ``[B]`` (one per sample), or ``[B, Tr]`` when the batch carries per-token advantages (PPO/GAE),
0 on padding.

``routes`` (when the batch carries the rollout's MoE routing) is ``[B, L, moe_layers, top_k]``: the
experts the engine chose at each input position, -1 where it recorded none.

Micro-batches: a rank's share of a mini-batch may be too large for one forward pass. Its samples are
sorted by length (longest first) and cut into contiguous groups whose *padded* size (rows x longest
row) stays within a token budget (:func:`count_microbatches`, :func:`split_microbatches`); each group
is padded only to its own longest sequence. The cut is the one with the fewest padded tokens plus a
fixed cost per pass (``budget / 64`` tokens): cutting greedily at the budget pads the short
sequences of a wide length range to the longest of them (RL responses of 3 to 190 tokens: 12% of
the tokens were padding, 6% with this cut, at 2048 tokens). A sequence longer than the budget
gets a micro-batch of its own. The split never changes the loss: the objective normalizes by the
mini-batch's global token / sequence counts, so micro-batch shares add up to the whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from miles.types import TrainBatch


@dataclass(frozen=True, kw_only=True)
class PaddedBatch:
    """A TrainBatch as padded tensors (shapes in the module docstring)."""

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    logit_index: torch.Tensor  # [B, Tr] int64: position whose logits predict response token j
    targets: torch.Tensor  # [B, Tr] int64: response token ids (pad id on padding)
    response_mask: torch.Tensor  # [B, Tr] fp32: 1 on real response tokens
    loss_mask: torch.Tensor  # [B, Tr] fp32: response_mask * sample loss mask
    rollout_logp: torch.Tensor  # [B, Tr] fp32: engine log-probs (0 on padding)
    advantages: torch.Tensor  # [B] fp32, or [B, Tr] fp32 with per-token advantages (0 on padding)
    response_lengths: tuple[int, ...]  # R_i
    prompt_lengths: torch.Tensor  # [B] int64: P_i
    prompt_index: torch.Tensor  # [B] int64: which distinct prompt row i has (0 .. U-1, first-seen order)
    prompt_rows: torch.Tensor  # [U] int64: the first row with each distinct prompt
    routes: torch.Tensor | None = None  # [B, L, moe_layers, top_k] int64 rollout MoE routes, -1 where none

    @property
    def num_prompts(self) -> int:
        """U: distinct prompts among the rows (GRPO's n samples of a prompt share one)."""
        return int(self.prompt_rows.numel())

    def to(self, device: torch.device | str) -> PaddedBatch:
        """Move every tensor to ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PaddedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def pad_batch(batch: TrainBatch, *, pad_id: int = 0) -> PaddedBatch:
    """Pad a TrainBatch into tensors on CPU. Raises ValueError on inconsistent samples."""
    n = len(batch)
    if n == 0:
        raise ValueError("pad_batch: the batch is empty")
    token_adv = batch.token_advantages
    for name in ("response_ids", "rollout_logprobs", "loss_mask", "advantages", "token_advantages"):
        value = getattr(batch, name)
        if value is not None and len(value) != n:
            raise ValueError(f"pad_batch: batch.{name} has {len(value)} entries, expected {n}")
    for i, (p, r, lp, m) in enumerate(
        zip(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, batch.loss_mask, strict=True)
    ):
        if not p:
            raise ValueError(f"pad_batch: sample {i} has an empty prompt; the first response token needs context")
        if len(lp) != len(r) or len(m) != len(r):
            raise ValueError(
                f"pad_batch: sample {i} has {len(r)} response tokens but {len(lp)} rollout log-probs and "
                f"{len(m)} loss-mask entries; all three must match"
            )
        if token_adv is not None and len(token_adv[i]) != len(r):
            raise ValueError(f"pad_batch: sample {i} has {len(r)} response tokens but {len(token_adv[i])} "
                             "token advantages; token_advantages needs one per response token")
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True))
    resp_len = max(1, max(len(r) for r in batch.response_ids))

    def rows(values: list, width: int, fill: float) -> list[list]:
        """Right-padded rows (one torch.tensor call per field is much cheaper than one per sample)."""
        return [list(v) + [fill] * (width - len(v)) for v in values]

    prompt_lens = torch.tensor([len(p) for p in batch.prompt_ids])
    resp_lens = torch.tensor([len(r) for r in batch.response_ids])
    input_ids = torch.tensor(rows([list(p) + list(r) for p, r in zip(batch.prompt_ids, batch.response_ids,
                                                                     strict=True)], seq_len, pad_id))
    attention_mask = (torch.arange(seq_len) < (prompt_lens + resp_lens).unsqueeze(-1)).long()
    real = torch.arange(resp_len) < resp_lens.unsqueeze(-1)  # [n, resp_len] bool
    logit_index = torch.where(real, prompt_lens.unsqueeze(-1) - 1 + torch.arange(resp_len), 0)
    targets = torch.tensor(rows(batch.response_ids, resp_len, pad_id), dtype=torch.long)
    response_mask = real.float()
    loss_mask = torch.tensor(rows(batch.loss_mask, resp_len, 0.0), dtype=torch.float32)
    rollout_logp = torch.tensor(rows(batch.rollout_logprobs, resp_len, 0.0), dtype=torch.float32)
    advantages = (torch.tensor(batch.advantages, dtype=torch.float32) if token_adv is None
                  else torch.tensor(rows(token_adv, resp_len, 0.0), dtype=torch.float32))
    distinct: dict[tuple[int, ...], int] = {}  # prompt -> index of its first row in prompt_rows
    prompt_index, prompt_rows = [], []
    for i, p in enumerate(batch.prompt_ids):
        u = distinct.setdefault(tuple(p), len(distinct))
        if u == len(prompt_rows):
            prompt_rows.append(i)
        prompt_index.append(u)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=torch.arange(seq_len).expand(n, seq_len).contiguous(),
        logit_index=logit_index,
        targets=targets,
        response_mask=response_mask,
        loss_mask=loss_mask * response_mask,
        rollout_logp=rollout_logp,
        advantages=advantages,
        response_lengths=tuple(len(r) for r in batch.response_ids),
        prompt_lengths=prompt_lens,
        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        prompt_rows=torch.tensor(prompt_rows, dtype=torch.long),
        routes=None if batch.routing is None else _pad_routes(batch.routing, seq_len),
    )


def _pad_routes(routing: list, seq_len: int) -> torch.Tensor:
    """Per-sample routes [P + R - 1, layers, k] -> [B, seq_len, layers, k] int64, -1 on positions without
    one (each sequence's last token, whose output nothing scores, and the padding)."""
    _, layers, k = routing[0].shape
    out = torch.full((len(routing), seq_len, layers, k), -1, dtype=torch.long)
    for i, r in enumerate(routing):
        out[i, : r.shape[0]] = r.long()
    return out


def response_logits(logits: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
    """The logits that predict each response token. logits: [B, L, V], logit_index: [B, Tr] -> [B, Tr, V]."""
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(-1)
    return logits[rows, logit_index]


def unpad_response(values: torch.Tensor, response_lengths: tuple[int, ...]) -> list[list[float]]:
    """Per-sample lists from a padded [B, Tr] tensor, cut to each response length."""
    rows = values.detach().float().cpu().tolist()
    return [row[:n] for row, n in zip(rows, response_lengths, strict=True)]


def count_microbatches(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches of at most ``max_tokens`` padded tokens the sequences are cut into (0: one).

    ``lengths``: the tokens each sequence puts through the forward pass. The cut is
    :func:`split_microbatches`' with no count imposed.
    """
    return len(_cheapest_groups(lengths, max_tokens))


def split_microbatches(lengths: list[int], max_tokens: int, num_microbatches: int) -> list[list[int]]:
    """Sample indices of exactly ``num_microbatches`` micro-batches, each within ``max_tokens`` if it can be.

    Starts from the cheapest cut (the module docstring) and halves the group with the most padded
    tokens until there are ``num_microbatches`` (data-parallel ranks must run the same number of
    passes, so a rank may split finer than its budget needs). Groups are in order of length, longest
    first; ``num_microbatches`` must be between :func:`count_microbatches` and ``len(lengths)``.
    """
    groups = _cheapest_groups(lengths, max_tokens)
    if not len(groups) <= num_microbatches <= len(lengths):
        raise ValueError(f"split_microbatches: {len(lengths)} sequences cannot form {num_microbatches} "
                         f"micro-batches of at most {max_tokens} tokens (need {len(groups)} to {len(lengths)})")
    while len(groups) < num_microbatches:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        k = max(splittable, key=lambda k: len(groups[k]) * lengths[groups[k][0]])
        g = groups[k]
        groups[k : k + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


PASS_COST_FRACTION = 1 / 64
"""Fixed cost of one forward/backward pass in the micro-batch cut, as a fraction of the token budget."""


def _cheapest_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Contiguous groups of the sequences sorted longest first, within the budget, with the fewest
    padded tokens plus ``PASS_COST_FRACTION * max_tokens`` per group (dynamic programming over the cut
    points; a group's padded size is its row count times its first, longest, length)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens_per_microbatch: must be 0 (off) or positive, found {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep batch order
    if max_tokens == 0:
        return [order] if order else []
    sizes = [max(1, lengths[i]) for i in order]
    pass_cost = PASS_COST_FRACTION * max_tokens
    n = len(sizes)
    best = [0.0] + [math.inf] * n  # best[i]: cheapest cut of the first i sequences
    cut = [0] * (n + 1)  # where the last group of that cut starts
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):  # group [j, i), padded to sizes[j]; wider groups only grow
            padded = (i - j) * sizes[j]
            if padded > max_tokens and j < i - 1:
                break
            cost = best[j] + padded + pass_cost
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups: list[list[int]] = []
    i = n
    while i > 0:
        groups.append(order[cut[i] : i])
        i = cut[i]
    return groups[::-1]
