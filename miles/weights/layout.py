"""A flat byte layout of a state dict: where each named tensor lives in one contiguous buffer.

Transports that move raw bytes (broadcast, shm) describe a state dict once by its layout
(names, shapes, dtypes, byte offsets) and then send only the bytes of each version. Offsets are
aligned to 64 bytes so every tensor can be viewed in place with its own dtype.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import Tensor

ALIGN = 64


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight layout")
    return dtype


@dataclass(frozen=True)
class FlatLayout:
    """names[i] has shape shapes[i] and dtype dtypes[i] at bytes [offsets[i], offsets[i] + nbytes[i])."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total_bytes: int

    @staticmethod
    def of(state_dict: dict[str, Tensor]) -> FlatLayout:
        """The layout of ``state_dict`` in its iteration order."""
        names, shapes, dtypes, offsets, sizes = [], [], [], [], []
        pos = 0
        for name, t in state_dict.items():
            n = t.numel() * t.element_size()
            names.append(name)
            shapes.append(tuple(t.shape))
            dtypes.append(str(t.dtype).removeprefix("torch."))
            offsets.append(pos)
            sizes.append(n)
            pos += -(-n // ALIGN) * ALIGN
        return FlatLayout(tuple(names), tuple(shapes), tuple(dtypes), tuple(offsets), tuple(sizes), pos)

    @property
    def key(self) -> int:
        """A 63-bit id of the layout (equal layouts, equal keys)."""
        return int.from_bytes(hashlib.sha256(self.to_json().encode()).digest()[:8], "little") >> 1

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(self.nbytes)

    def to_json(self) -> str:
        return json.dumps([self.names, self.shapes, self.dtypes, self.offsets, self.nbytes, self.total_bytes])

    @staticmethod
    def from_json(text: str) -> FlatLayout:
        names, shapes, dtypes, offsets, nbytes, total = json.loads(text)
        return FlatLayout(tuple(names), tuple(tuple(s) for s in shapes), tuple(dtypes), tuple(offsets),
                          tuple(nbytes), int(total))

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """flat: uint8 [>= total_bytes] -> {name: tensor viewing its bytes} (no copy)."""
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < self.total_bytes:
            raise ValueError(f"expected a 1-D uint8 buffer of at least {self.total_bytes} bytes, "
                             f"found {flat.dtype} {tuple(flat.shape)}")
        return {
            name: flat[off:off + n].view(_dtype(dt)).view(shape)
            for name, shape, dt, off, n in zip(self.names, self.shapes, self.dtypes, self.offsets, self.nbytes,
                                               strict=True)
        }

    def check(self, state_dict: dict[str, Tensor]) -> None:
        """Raise if ``state_dict`` does not have exactly this layout's names, shapes and dtypes."""
        if FlatLayout.of(state_dict) != self:
            raise ValueError("state dict does not match the weight layout it is being packed into "
                             f"({len(state_dict)} tensors vs {len(self.names)} in the layout)")

    def pack(self, state_dict: dict[str, Tensor], out: Tensor, start: int = 0, end: int | None = None) -> None:
        """Copy the bytes [start, end) of the flat image of ``state_dict`` into ``out`` (uint8 [end - start]).

        Padding bytes between tensors are left as they are. ``state_dict`` must have this layout.
        """
        end = self.total_bytes if end is None else end
        assert out.dtype == torch.uint8 and out.numel() >= end - start
        first = max(0, bisect.bisect_right(self.offsets, start) - 1)
        for i in range(first, len(self.names)):
            off, n = self.offsets[i], self.nbytes[i]
            if off >= end:
                break
            lo, hi = max(off, start), min(off + n, end)
            if lo >= hi:
                continue
            src = state_dict[self.names[i]]
            src = src.contiguous().reshape(-1).view(torch.uint8)
            out[lo - start:hi - start].copy_(src[lo - off:hi - off])
