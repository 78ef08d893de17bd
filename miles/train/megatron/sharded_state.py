"""Sharded trainer state of the megatron trainer: every rank writes its own regions of the HF-named tensors.

With more than one rank the megatron trainer writes format 2 of :mod:`miles.train.optim` (the FSDP trainer's):
``torch.distributed.checkpoint`` (DCP) files under ``shards/``, listed in a SHA-256 manifest, with the keys
``model.<HF name>`` and ``optimizer.state.<HF name>.{step, exp_avg, exp_avg_sq}`` in the HF tensors' full
(global) shapes. Nothing is gathered: each rank hands DCP the *regions* of the HF tensors its megatron
parameters are made of, as ``ShardedTensor`` chunks (global shape, offsets), so a state written at one layout
is read back at any other, by the megatron trainer (TP, PP, DP, EP) or by the FSDP trainer.

A parameter's regions are :func:`~.mapping.cut_shard`'s, the code that cuts a rank's shard out of a checkpoint:
cutting once with a ``read`` that returns element numbers instead of weights gives, per element of the local
parameter, the region element it is (:class:`Layout`; 0 where the vocabulary is padded). Saving scatters the
parameter (or an AdamW moment) into its regions; loading gathers it back from the regions DCP filled. The
last stage's copy of tied embeddings is not written (the first stage's is) but is read; with tied embeddings
``lm_head.weight`` is written as a copy of ``embed_tokens`` (the HF state dict holds both).

Why not megatron-core's ``dist_checkpointing``: the optimizer is ``torch.optim.AdamW`` (megatron's distributed
optimizer does not run on the CPU), whose state megatron does not shard; its tensors would be named and laid out
as megatron's (fused ``linear_qkv``, padded vocabulary), which the FSDP trainer cannot read, and it adds a
pickled ``common.pt``. The DCP format here is the FSDP trainer's, checked against the manifest before DCP's
pickled ``.metadata`` is read (:func:`miles.train.shards.verify_collective`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles.train.megatron.arch import Arch
from miles.train.megatron.mapping import Entry, cut_shard, is_fused_experts


@dataclass(frozen=True)
class Region:
    """A block of an HF tensor: ``key`` (the HF name; the fused tensor of an expert piece), its ``offsets``
    and ``sizes`` in the tensor of shape ``global_shape``; ``shape``: the block as ``cut_shard`` reads it."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _region(
    piece: str,
    rows: slice,
    cols: slice | None,
    piece_shapes: Mapping[str, tuple[int, ...]],
    hf_shapes: Mapping[str, tuple[int, ...]],
) -> Region:
    shape = piece_shapes[piece]
    r0, r1, _ = rows.indices(shape[0])
    offsets, sizes = [r0], [max(0, r1 - r0)]
    if len(shape) > 1:
        c0, c1, _ = (slice(None) if cols is None else cols).indices(shape[1])
        offsets += [c0] + [0] * (len(shape) - 2)
        sizes += [max(0, c1 - c0), *shape[2:]]
    read_shape = tuple(sizes)
    fused, _, e = piece.rpartition(".")
    if is_fused_experts(fused) and fused in hf_shapes:  # one expert of a fused [E, ...] tensor
        return Region(fused, (int(e), *offsets), (1, *sizes), tuple(hf_shapes[fused]), read_shape)
    return Region(piece, tuple(offsets), tuple(sizes), tuple(shape), read_shape)


@dataclass(frozen=True)
class Layout:
    """Where the elements of one local megatron parameter sit in the HF tensors."""

    entry: Entry
    regions: list[Region]
    index: torch.Tensor
    """int64, the local parameter's shape: ``1 + `` the element's position in the regions flattened one after
    the other, 0 for vocabulary padding."""

    def scatter(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The regions' values (fp32, fresh tensors of ``Region.sizes``) of ``local`` (the parameter, or a
        tensor of its shape: an AdamW moment)."""
        flat_index = self.index.reshape(-1)
        keep = flat_index > 0
        buf = torch.empty(sum(r.numel for r in self.regions), dtype=torch.float32, device=local.device)
        buf[flat_index[keep] - 1] = local.detach().reshape(-1)[keep].to(torch.float32)
        return [
            t.reshape(r.sizes).clone()
            for t, r in zip(buf.split([r.numel for r in self.regions]), self.regions, strict=True)
        ]

    def gather(self, regions: list[torch.Tensor], into: torch.Tensor) -> None:
        """Write the regions' values into ``into`` (the local parameter or moment; padding left as it is)."""
        flat_index = self.index.reshape(-1)
        keep = flat_index > 0
        buf = torch.cat([t.reshape(-1) for t in regions]).to(into.device, into.dtype)
        with torch.no_grad():
            flat = into.detach().reshape(-1).clone()
            flat[keep] = buf[flat_index[keep] - 1]
            into.copy_(flat.view_as(into))


def layout(
    entry: Entry,
    piece_shapes: Mapping[str, tuple[int, ...]],
    hf_shapes: Mapping[str, tuple[int, ...]],
    arch: Arch,
    tp: int,
    tp_rank: int,
    device: torch.device,
) -> Layout:
    """The :class:`Layout` of ``entry`` at TP rank ``tp_rank``: :func:`~.mapping.cut_shard` over element numbers."""
    regions: list[Region] = []
    count = [0]

    def read(piece: str, rows: slice, cols: slice | None) -> torch.Tensor:
        r = _region(piece, rows, cols, piece_shapes, hf_shapes)
        regions.append(r)
        numbers = torch.arange(count[0] + 1, count[0] + 1 + r.numel, dtype=torch.int64, device=device)
        count[0] += r.numel
        return numbers.reshape(r.shape)

    index = cut_shard(entry, read, piece_shapes, arch, tp, tp_rank)
    return Layout(entry, regions, index)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch 2.13 warns on every DCP call that meets a ``ShardedTensor`` that it prefers ``DTensor``; a DTensor
    cannot describe these regions (a rank's qkv shard is three blocks of three tensors), so the warning is off."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def to_sharded(
    regions: Mapping[str, list[tuple[Region, torch.Tensor]]], *, rank: int, world_size: int
) -> dict[str, Any]:
    """Collective. ``{key: ShardedTensor}`` whose local shards are this rank's regions of ``key`` (empty ones left
    out), with every rank's chunks in its metadata (one ``all_gather_object`` of offsets and sizes; a chunk that
    ranks share is listed once, as this rank's where it holds it). DCP writes each chunk once and reads into the
    local shards whatever chunks wrote the state."""
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    local = {key: [(r, t) for r, t in items if r.numel > 0] for key, items in regions.items()}
    local = {key: items for key, items in local.items() if items}
    mine = {key: [(r.offsets, r.sizes) for r, _ in items] for key, items in local.items()}
    every = [mine]
    if world_size > 1:
        every = [{} for _ in range(world_size)]
        dist.all_gather_object(every, mine)
    out = {}
    for key, items in local.items():
        owner: dict[tuple, int] = {}
        for r, chunks in enumerate(every):
            for chunk in chunks.get(key, []):
                owner.setdefault(chunk, r)
        owner.update(dict.fromkeys(mine[key], rank))
        device = items[0][1].device
        listed = [
            ShardMetadata(shard_offsets=list(off), shard_sizes=list(size), placement=f"rank:{r}/{device}")
            for (off, size), r in owner.items()
        ]
        shards = [
            Shard(
                tensor=t,
                metadata=ShardMetadata(
                    shard_offsets=list(reg.offsets),
                    shard_sizes=list(reg.sizes),
                    placement=f"rank:{rank}/{device}",
                ),
            )
            for reg, t in items
        ]
        meta = ShardedTensorMetadata(
            shards_metadata=listed,
            size=torch.Size(items[0][0].global_shape),
            tensor_properties=TensorProperties(dtype=items[0][1].dtype),
        )
        out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
    return out
