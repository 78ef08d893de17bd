"""This rank's megatron weights read straight from the HF checkpoint's safetensors files, slice by slice.

No rank builds the HF model or holds the full state dict: each reads, in fp32, only the tensors of its
pipeline stage and expert-parallel rank, and of each tensor-parallel split only its rows or columns
(``safe_open(file).get_slice(name)[rows, cols]``; the regions are :func:`~.mapping.cut_shard`'s, the
same code that cuts a state dict in memory, so the weights equal those of a full load, bit for bit).

* The model's config comes from ``config.json`` (transformers' ``AutoConfig``); the HF names, shapes and
  order of the state dict (what the trainer sends and saves) from the transformers model built on the
  meta device (no storage): :func:`hf_layout`.
* Files: ``model.safetensors.index.json`` (sharded checkpoints) or every ``*.safetensors`` file of the
  directory (:class:`SafetensorsReader`). Stored fp32, bf16 or fp16, upcast exactly to fp32.
* Tied embeddings: ``lm_head.weight`` may be absent (the mapping reads ``embed_tokens`` for both uses).
* MoE experts: the pieces ``<layer>.mlp.experts.gate_up_proj.<e>`` / ``down_proj.<e>`` (one expert of
  transformers' fused tensors, :mod:`.mapping`) are read from fused tensors on disk
  (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) or from per-expert
  ones (``mlp.experts.<e>.{gate,up,down}_proj.weight``, how transformers saves Qwen3-MoE).

safetensors maps each file into memory; the pages a read touches stay resident until the file is closed,
so the reader closes its files whenever the rows it read since it last did span ``release_bytes`` (32 MiB
by default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from miles.train.megatron.arch import Arch
from miles.train.megatron.mapping import Entry, cut_shard

INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"F32": 4, "BF16": 2, "F16": 2}
"""Stored dtypes read (upcast exactly to fp32), with their bytes per element."""

_EXPERT_PIECE = re.compile(r"(?P<prefix>.*\.mlp\.experts\.)(?P<proj>gate_up_proj|down_proj)\.(?P<e>\d+)")


def read_config(directory: str | Path) -> Any:
    """The checkpoint's HF config (``config.json``); a quantized checkpoint is refused (read as-is, its
    weights would be its quantized values)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory))
    if getattr(config, "quantization_config", None):
        method = dict(config.quantization_config).get("quant_method", "?")
        raise ValueError(f"{directory}: a quantized checkpoint (quantization_config, quant_method={method!r}); the "
                         "megatron trainer reads fp32/bf16/fp16 safetensors. Dequantize it to bf16 first, or use "
                         "trainer=fsdp")
    return config


def hf_layout(config: Any) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The HF model's state dict as ``{name: shape}`` in its order, and its parameter names (a tied
    ``lm_head`` is in the first, not the second), from the model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes, [n for n, _ in model.named_parameters()]


@dataclass(frozen=True)
class _Part:
    """A block of rows of a piece, stored as (one expert of) a tensor on disk."""

    name: str
    expert: int | None
    offset: int
    rows: int


class SafetensorsReader:
    """Regions of the tensors of an HF checkpoint directory, in fp32 (a context manager: closes its files).

    ``read_elements``: how many elements of each stored tensor were read (what this rank touched).
    """

    def __init__(self, directory: str | Path, *, release_bytes: int = 32 << 20) -> None:
        self.directory, self.release_bytes = Path(directory), release_bytes
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / f for name, f in weight_map.items()}
        else:
            from safetensors import safe_open

            self.files = {}
            for path in sorted(self.directory.glob("*.safetensors")):
                with safe_open(str(path), "pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), path))
        if not self.files:
            raise FileNotFoundError(f"{self.directory}: no {INDEX_FILE} and no *.safetensors file; the megatron "
                                    "trainer reads safetensors checkpoints (save the model with save_pretrained)")
        self.read_elements: dict[str, int] = {}
        self._open: dict[Path, Any] = {}
        self._since_release = 0

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.close()

    def close(self) -> None:
        """Close every file (their mapped pages leave this process)."""
        self._open.clear()
        self._since_release = 0

    def _slice(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path].get_slice(name)

    def _parts(self, piece: str, rows: int) -> list[_Part]:
        """Where the rows of ``piece`` (an HF name or an expert piece, :mod:`.mapping`) are stored."""
        if piece in self.files:
            return [_Part(piece, None, 0, rows)]
        m = _EXPERT_PIECE.fullmatch(piece)
        if m is not None:
            prefix, proj, e = m["prefix"], m["proj"], int(m["e"])
            if prefix + proj in self.files:  # transformers' fused tensor [E, ...]
                return [_Part(prefix + proj, e, 0, rows)]
            if proj == "down_proj":
                return [_Part(f"{prefix}{e}.down_proj.weight", None, 0, rows)]
            half = rows // 2
            return [_Part(f"{prefix}{e}.gate_proj.weight", None, 0, half),
                    _Part(f"{prefix}{e}.up_proj.weight", None, half, half)]
        raise KeyError(piece)

    def read(self, piece: str, shape: tuple[int, ...], rows: slice, cols: slice | None) -> torch.Tensor:
        """The region ``[rows, cols]`` of ``piece`` (full shape ``shape``), fp32, in memory of its own."""
        start, stop, _ = rows.indices(shape[0])
        try:
            parts = self._parts(piece, shape[0])
            for p in parts:
                if p.name not in self.files:
                    raise KeyError(p.name)
        except KeyError as e:
            raise KeyError(f"{self.directory}: the checkpoint has no tensor {e.args[0]!r} (the megatron mapping "
                           f"needs it for {piece!r}, shape {list(shape)}); do config.json and the safetensors "
                           "files belong to the same model?") from None
        row_elements = int(torch.Size(shape[1:]).numel())
        overlapping = [p for p in parts if max(start, p.offset) < min(stop, p.offset + p.rows)] or parts[:1]
        out = []
        for p in overlapping:
            lo = max(start, p.offset) - p.offset
            hi = max(lo, min(stop, p.offset + p.rows) - p.offset)
            sl = self._slice(p.name)
            stored, want = list(sl.get_shape()), [p.rows, *shape[1:]]
            if stored != (want if p.expert is None else [stored[0], *want]):
                raise ValueError(f"{self.files[p.name]}: tensor {p.name} has shape {stored}; the config "
                                 f"(config.json) makes it {want}" + (" per expert" if p.expert is not None else ""))
            dtype = sl.get_dtype()
            if dtype not in DTYPES:
                raise ValueError(f"{self.files[p.name]}: tensor {p.name} is stored as {dtype}; the megatron trainer "
                                 f"reads {', '.join(DTYPES)} (dequantize the checkpoint first)")
            index: tuple[Any, ...] = (slice(lo, hi),) if cols is None else (slice(lo, hi), cols)
            if p.expert is not None:
                index = (p.expert, *index)
            t = sl[index].to(torch.float32, copy=True)
            out.append(t)
            self.read_elements[p.name] = self.read_elements.get(p.name, 0) + t.numel()
            self._since_release += (hi - lo) * row_elements * DTYPES[dtype]  # the pages of whole rows are touched
        region = out[0] if len(out) == 1 else torch.cat(out)
        if self._since_release >= self.release_bytes:
            self.close()
        return region


class CheckpointShards(Mapping[str, torch.Tensor]):
    """This rank's parameters (``{local megatron name: tensor}``, :func:`~.mapping.entries`) read from a
    checkpoint on access, one at a time."""

    def __init__(self, reader: SafetensorsReader, entries: list[Entry], piece_shapes: Mapping[str, tuple[int, ...]],
                 arch: Arch, *, tp: int, tp_rank: int) -> None:
        self.reader, self.piece_shapes, self.arch, self.tp, self.tp_rank = reader, piece_shapes, arch, tp, tp_rank
        self._entries = {e.local: e for e in entries}

    @classmethod
    def of(cls, reader: SafetensorsReader, io: Any) -> CheckpointShards:
        """The shards of the rank whose :class:`~.collect.ShardedIO` is ``io`` (its entries, shapes, TP rank)."""
        return cls(reader, io.entries, io.piece_shapes, io.arch, tp=io.coords.tp, tp_rank=io.coords.tp_rank)

    def __getitem__(self, local: str) -> torch.Tensor:
        entry = self._entries[local]

        def read(name: str, rows: slice, cols: slice | None) -> torch.Tensor:
            return self.reader.read(name, self.piece_shapes[name], rows, cols)

        return cut_shard(entry, read, self.piece_shapes, self.arch, self.tp, self.tp_rank)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
