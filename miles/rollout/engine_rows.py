"""Per-row bookkeeping of :class:`miles.rollout.torch_engine.TorchEngine` and small helpers.

``_Job`` is one ``generate`` call waiting for its results, ``_Row`` one completion of a request from
submission to result; ``_row_seed`` derives a completion's generator seed, ``_ids`` reads token ids from
a model config, ``_listing`` shortens name lists for error messages.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from miles.types import GenerateRequest, GenerateResult, SamplingParams


def _ids(value: Any) -> list[int]:
    """An int, a list of ints, or None -> list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _row_seed(seed: int, index: int) -> int:
    """The generator seed of completion ``index`` of a request seeded with ``seed`` (63 bits)."""
    digest = hashlib.sha256(f"miles-row:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(eq=False)
class _Job:
    """One ``generate`` call: its results fill in as rows finish; ``done`` fires with the last."""

    results: list[list[GenerateResult | None]]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass(eq=False)
class _Row:
    """One completion (request, index) from submission to result."""

    job: _Job
    request_pos: int  # the request's position in its generate() call
    request: GenerateRequest
    index: int
    sampling: SamplingParams
    greedy: bool
    generator: torch.Generator | None  # None for greedy rows (no noise)
    features: tuple[str, ...]  # per-row options the batched step must handle (see _emit)
    prompt_route: Tensor | None = None  # capture_routing: [P - 1, moe_layers, top_k] int16, set at prefill
    prefill_version: int = -1  # weight version of its prefill (a prefix is stored only if still current)


def _listing(names: list[str], limit: int = 10) -> str:
    """``[a, b, ...] (N)``: the first ``limit`` names and the count, for error messages."""
    more = " ..." if len(names) > limit else ""
    return f"{names[:limit]}{more} ({len(names)})"
