"""Per-row bookkeeping of :class:`miles.rollout.torch_engine.TorchEngine` and small helpers.

``_Job`` is one ``generate`` call waiting for its results, ``_Row`` one completion of a request from
submission to result; ``_listing`` shortens name lists for error messages.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from miles.types import GenerateRequest, GenerateResult, SamplingParams


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
    received: float = 0.0  # time.perf_counter() when its generate() call arrived
    ttft_s: float | None = None  # seconds from ``received`` to its first token (set at its prefill)


def _listing(names: list[str], limit: int = 10) -> str:
    """``[a, b, ...] (N)``: the first ``limit`` names and the count, for error messages."""
    more = " ..." if len(names) > limit else ""
    return f"{names[:limit]}{more} ({len(names)})"
