"""Turn a :class:`~miles.core.types.TrainBatch` (lists of token ids) into padded tensors.

Each sequence is ``prompt + response``, right-padded to the longest in the batch::

    input_ids      [B, L]   L = max_i (P_i + R_i), pad id after the last real token
    attention_mask [B, L]   1 on real tokens
    position_ids   [B, L]   0 .. L-1 (right padding: real tokens keep their natural positions)

Response-side tensors are ``[B, Tr]`` with ``Tr = max_i R_i``. Response token ``j`` of sample
``i`` sits at position ``p = P_i + j`` and is predicted by the logits at ``p - 1``, so
``logit_index[i, j] = P_i + j - 1`` and :func:`response_logits` gathers ``logits[i, P_i + j - 1]``.
Gathering before the softmax keeps the log-softmax off prompt positions.

``response_mask`` marks real response tokens; ``loss_mask`` is that times the sample's own loss
mask (0 for environment/tool tokens), and is what losses and metrics average over.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from miles.core.types import TrainBatch


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
    advantages: torch.Tensor  # [B] fp32
    response_lengths: tuple[int, ...]  # R_i

    def to(self, device: torch.device | str) -> PaddedBatch:
        """Move every tensor to ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PaddedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def pad_batch(batch: TrainBatch, *, pad_id: int = 0) -> PaddedBatch:
    """Pad a TrainBatch into tensors on CPU. Raises ValueError on inconsistent samples."""
    n = len(batch)
    if n == 0:
        raise ValueError("pad_batch: the batch is empty")
    for name in ("response_ids", "rollout_logprobs", "loss_mask", "advantages"):
        if len(getattr(batch, name)) != n:
            raise ValueError(f"pad_batch: batch.{name} has {len(getattr(batch, name))} entries, expected {n}")
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
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True))
    resp_len = max(1, max(len(r) for r in batch.response_ids))

    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, seq_len), dtype=torch.long)
    logit_index = torch.zeros((n, resp_len), dtype=torch.long)
    targets = torch.full((n, resp_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, resp_len))
    loss_mask = torch.zeros((n, resp_len))
    rollout_logp = torch.zeros((n, resp_len))
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True)):
        total, nr = len(p) + len(r), len(r)
        input_ids[i, :total] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, :total] = 1
        logit_index[i, :nr] = torch.arange(len(p) - 1, total - 1)
        targets[i, :nr] = torch.tensor(r, dtype=torch.long)
        response_mask[i, :nr] = 1.0
        loss_mask[i, :nr] = torch.tensor(batch.loss_mask[i], dtype=torch.float32)
        rollout_logp[i, :nr] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=torch.arange(seq_len).expand(n, seq_len).contiguous(),
        logit_index=logit_index,
        targets=targets,
        response_mask=response_mask,
        loss_mask=loss_mask * response_mask,
        rollout_logp=rollout_logp,
        advantages=torch.tensor(batch.advantages, dtype=torch.float32),
        response_lengths=tuple(len(r) for r in batch.response_ids),
    )


def response_logits(logits: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
    """The logits that predict each response token. logits: [B, L, V], logit_index: [B, Tr] -> [B, Tr, V]."""
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(-1)
    return logits[rows, logit_index]


def unpad_response(values: torch.Tensor, response_lengths: tuple[int, ...]) -> list[list[float]]:
    """Per-sample lists from a padded [B, Tr] tensor, cut to each response length."""
    rows = values.detach().float().cpu().tolist()
    return [row[:n] for row, n in zip(rows, response_lengths, strict=True)]
