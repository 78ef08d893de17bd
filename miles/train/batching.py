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

Micro-batches by token budget: :mod:`miles.algos.microbatches`.
"""

from __future__ import annotations

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
    pixel_values: torch.Tensor | None = None  # [N_patches, D] fp32: the rows' images, in row order
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3] int64, in row order

    @property
    def num_prompts(self) -> int:
        """U: distinct prompts among the rows (GRPO's n samples of a prompt share one)."""
        return int(self.prompt_rows.numel())

    def to(self, device: torch.device | str) -> PaddedBatch:
        """Move every tensor to ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PaddedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def pad_batch(batch: TrainBatch, *, pad_id: int = 0, vision: tuple[int, int] | None = None) -> PaddedBatch:
    """Pad a TrainBatch into tensors on CPU. Raises ValueError on inconsistent samples.

    ``vision`` (a vision-language model: ``(image_token_id, spatial_merge_size)``): a batch with images
    gets their pixel values and grids concatenated in row order and mRoPE ``position_ids [3, B, L]``
    (:func:`miles.models.vision.mrope_positions`; text-only rows count up in all three).
    """
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
    position_ids = torch.arange(seq_len).expand(n, seq_len).contiguous()
    pixels = None
    if batch.images is not None and any(x is not None for x in batch.images):
        if vision is None:
            raise ValueError("pad_batch: the batch carries images, but the model is a text-only model")
        from miles.models.vision import cat_images, sequence_positions

        position_ids = torch.arange(seq_len).expand(3, n, seq_len).clone()
        for i, (p, r, im) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.images, strict=True)):
            grid = im.grid_thw if im is not None else None
            position_ids[:, i, : len(p) + len(r)] = sequence_positions(p, r, grid, *vision)
        pixels = cat_images(batch.images)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        pixel_values=None if pixels is None else pixels[0],
        image_grid_thw=None if pixels is None else pixels[1],
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


def step_counts(shard: TrainBatch, micro: list[PaddedBatch]) -> list[int]:
    """``[loss tokens, sequences with one, loss tokens computed, samples skipped]`` of a rank's ``shard``
    whose passes are ``micro``: the loss normalizes by the first two (every sample's), the per-token
    metrics by the third (the samples in ``micro``)."""
    tokens = [sum(m) for m in shard.loss_mask]
    return [sum(tokens), sum(t > 0 for t in tokens), int(sum(p.loss_mask.sum().item() for p in micro)),
            len(shard) - sum(p.input_ids.shape[0] for p in micro)]


def _length(batch: TrainBatch, i: int) -> int:
    return len(batch.prompt_ids[i]) + len(batch.response_ids[i])


def rows_with_gradient(batch: TrainBatch) -> list[int]:
    """Indices of the samples whose advantage is non-zero on some loss-mask token.

    Under a policy loss that vanishes at zero advantage
    (:func:`miles.algos.losses.vanishes_at_zero_advantage`), with no KL and no entropy term, the others
    add exactly nothing to the loss or its gradient: a group whose rewards are all equal, a sample
    whose loss mask is empty. A batch with none of them keeps its shortest sample, so that every
    rank still runs a pass and every parameter gets a (zero) gradient, as AdamW expects.
    """
    keep = []
    for i, mask in enumerate(batch.loss_mask):
        if batch.token_advantages is not None:
            live = any(a != 0 and m for a, m in zip(batch.token_advantages[i], mask, strict=False))
        else:
            live = batch.advantages[i] != 0 and any(mask)
        if live:
            keep.append(i)
    if not keep and len(batch):
        keep = [min(range(len(batch)), key=lambda i: _length(batch, i))]
    return keep


def topped_up(batch: TrainBatch, rows: list[int], count: int) -> list[int]:
    """``rows`` and, when they are fewer than ``count``, the shortest other samples of ``batch`` up to
    ``count`` (a rank runs as many micro-batches as the rank that needs most, one sample at least
    each), in batch order."""
    if len(rows) >= count:
        return rows
    taken = set(rows)
    rest = sorted((i for i in range(len(batch)) if i not in taken), key=lambda i: _length(batch, i))
    return sorted([*rows, *rest[: count - len(rows)]])
