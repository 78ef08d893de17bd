"""Move HF-named tensors between rank 0 and the sharded megatron model (the collectives of the mapping).

:class:`ShardedIO` serves every per-parameter tensor the trainer writes or reads in HF layout: the
weights (``full_state_dict``, ``send_weights``, checkpoints), the gradients (``compute_gradients``)
and AdamW's moments (checkpoints).

* :meth:`ShardedIO.gather`: each TP group all-gathers its shards (one flat buffer), the rank that
  owns a piece (TP rank 0 of data-parallel rank 0, or of expert-data-parallel rank 0 for experts;
  never the last stage's copy of tied embeddings) cuts it out (:func:`~.mapping.unshard`), and rank
  0 receives every owner's pieces as one flat buffer, in an order both sides derive from the layout
  (:func:`~.mapping.entries` of the owner's coordinates). Rank 0 ends with the full fp32 CPU dict.
* :meth:`ShardedIO.shard`: from a full HF dict (every rank holds one) to this rank's shards;
  :meth:`ShardedIO.broadcast` first copies rank 0's dict to every rank (trainer state, :mod:`.state`;
  the initial weights are read from the checkpoint's files instead: :mod:`.load`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from miles.train.megatron.arch import Arch
from miles.train.megatron.mapping import (
    Coords,
    Entry,
    entries,
    join_experts,
    piece_shapes,
    shard,
    split_experts,
    unshard,
)


def flat(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One fp32 buffer on ``device`` of ``tensors`` flattened one after the other (what a collective sends)."""
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.cat([t.detach().to(device, torch.float32).reshape(-1) for t in tensors])


def unflat(buf: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``buf`` with ``shapes``, in order: the inverse of :func:`flat`."""
    return [p.view(s) for p, s in zip(buf.split([math.prod(s) for s in shapes]), shapes, strict=True)]


class ShardedIO:
    """HF-named tensors <-> this rank's megatron shards, for one model layout (parallel groups initialized)."""

    def __init__(self, arch: Arch, hf_shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> None:
        self.arch, self.device = arch, device  # collectives run on ``device`` (NCCL needs CUDA tensors)
        self.hf_shapes = dict(hf_shapes)
        self.piece_shapes = piece_shapes(hf_shapes)
        self.coords = Coords(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                             pp=ps.get_pipeline_model_parallel_world_size(),
                             pp_rank=ps.get_pipeline_model_parallel_rank(),
                             ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank())
        self.entries = entries(arch, self.coords)
        self.owns_dense = self.coords.tp_rank == 0 and ps.get_data_parallel_rank() == 0
        self.owns_experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mine = torch.tensor([self.coords.pp_rank, self.coords.ep_rank, int(self.owns_dense), int(self.owns_experts)],
                            device=device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        self._others = [tuple(int(x) for x in t.tolist()) for t in everyone]

    def check_names(self, local_names: list[str]) -> None:
        """The model's parameter names are the mapping's (an upgrade that renames them fails here)."""
        expected = [e.local for e in self.entries]
        if sorted(local_names) != sorted(expected):
            raise RuntimeError(
                "megatron GPTModel parameters differ from the HF mapping (miles/train/megatron/mapping.py): "
                f"model only {sorted(set(local_names) - set(expected))[:4]}, mapping only "
                f"{sorted(set(expected) - set(local_names))[:4]}")

    # --- HF -> shards ---------------------------------------------------------------------------

    def shard(self, hf: Mapping[str, torch.Tensor], *, skip_missing: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (``{local name: tensor}``) from a full HF dict."""
        pieces = split_experts(hf)
        c = self.coords
        tp_rank = c.tp_rank
        out = {}
        for e in self.entries:
            if skip_missing and any(n not in pieces for n in e.hf):
                continue
            out[e.local] = shard(e, pieces, self.arch, c.tp, tp_rank)
        return out

    def broadcast(self, hf: Mapping[str, torch.Tensor] | None, names: list[str]) -> dict[str, torch.Tensor]:
        """Rank 0's ``hf`` tensors named ``names`` (shapes from the HF model) on every rank, fp32. Collective."""
        shapes = [self.hf_shapes[n] for n in names]
        if self.rank == 0:
            assert hf is not None
            buf = flat([hf[n] for n in names], self.device)
        else:
            buf = torch.zeros(sum(int(torch.Size(s).numel()) for s in shapes), device=self.device)
        if self.world_size > 1:
            dist.broadcast(buf, src=0)
        return dict(zip(names, unflat(buf.cpu(), shapes), strict=True))

    # --- shards -> HF on rank 0 --------------------------------------------------------------------

    def _owned(self, pp_rank: int, ep_rank: int, dense: bool, experts: bool) -> list[Entry]:
        c = Coords(tp=self.coords.tp, tp_rank=0, pp=self.coords.pp, pp_rank=pp_rank, ep=self.coords.ep,
                   ep_rank=ep_rank)
        return [e for e in entries(self.arch, c) if not e.tied_copy and (experts if e.expert else dense)]

    def _tp_gather(self, local: Mapping[str, torch.Tensor], group_of: str) -> dict[str, list[torch.Tensor]]:
        """Every TP rank's shard of this rank's split entries of one group (``dense`` or ``expert``)."""
        expert = group_of == "expert"
        ents = [e for e in self.entries if e.expert == expert and e.tp_split]
        group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        size = dist.get_world_size(group)
        if size == 1 or not ents:
            return {e.local: [local[e.local]] for e in ents}
        shapes = [tuple(local[e.local].shape) for e in ents]
        mine = flat([local[e.local] for e in ents], self.device)
        parts = [torch.zeros_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine, group=group)
        per_rank = [unflat(p.cpu(), shapes) for p in parts]
        return {e.local: [r[i] for r in per_rank] for i, e in enumerate(ents)}

    def gather(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full HF dict (fp32, CPU, HF order) of per-parameter tensors ``local``
        (``{local name: tensor}``, e.g. weights or gradients); other ranks None. Collective."""
        shards = {**self._tp_gather(local, "dense"), **self._tp_gather(local, "expert")}
        mine: dict[str, torch.Tensor] = {}
        for e in self._owned(self.coords.pp_rank, self.coords.ep_rank, self.owns_dense, self.owns_experts):
            parts = shards.get(e.local) or [local[e.local]]
            # copies: a piece may be a view of a live parameter or gradient
            cut = unshard(e, parts, self.arch)
            mine.update({k: v.detach().to("cpu", torch.float32, copy=True) for k, v in cut.items()})
        if self.rank != 0:
            if mine:
                dist.send(flat(list(mine.values()), self.device), dst=0)
            return None
        pieces = dict(mine)
        for r in range(1, self.world_size):
            pp_rank, ep_rank, dense, experts = self._others[r]
            names = [n for e in self._owned(pp_rank, ep_rank, bool(dense), bool(experts)) for n in e.hf]
            if not names:
                continue
            shapes = [self.piece_shapes[n] for n in names]
            buf = torch.zeros(sum(int(torch.Size(s).numel()) for s in shapes), device=self.device)
            dist.recv(buf, src=r)
            pieces.update(zip(names, unflat(buf.cpu(), shapes), strict=True))
        return join_experts(pieces, self.hf_shapes, self.arch)
