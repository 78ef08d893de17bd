"""Process memory of one actor, as step metrics ``mem/<actor>/<field>``.

Every engine (in its ``health()``), trainer rank (with its train step) and the driver report
:func:`process_memory` once a step; the loop logs them as ``mem/engine0/rss_bytes``,
``mem/trainer1/rss_bytes``, ``mem/driver/rss_bytes`` ... (:func:`actor_metrics`), and the Prometheus
exporter serves each field as one family labelled by ``actor`` (``miles_mem_rss_bytes{actor="engine0"}``).

- ``rss_bytes``: resident memory of the process and of every process it started (an SGLang engine's
  server, a reward worker), read with psutil. Finding the children scans every process of the machine
  (about 1.4 ms with 80 processes, more on a busy machine, once a step in every actor), so the list is
  kept for :data:`CHILDREN_TTL_S` and read anew when it is older or one of them has ended; their memory
  is read every time.
- On CUDA, also ``cuda_allocated_bytes`` and ``cuda_reserved_bytes`` (the caching allocator's counters
  for the current device) and ``cuda_fragmentation``: reserved minus allocated, over reserved (0 when
  nothing is reserved). Untested: no GPU has run these lines yet.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

MEM_PREFIX = "mem/"
CHILDREN_TTL_S = 10.0
"""How long :func:`process_memory` reuses a process's list of children (module docstring)."""
_children: dict[int, tuple[float, Any, list[Any]]] = {}  # pid -> (listed at, the process, its children)
_KEY = re.compile(r"^mem/([A-Za-z0-9_]+)/([A-Za-z0-9_]+)$")


def process_memory(pid: int | None = None) -> dict[str, float]:
    """Memory of process ``pid`` (default: this one) and its children; the CUDA counters when this process
    has CUDA initialised."""
    import psutil

    pid = pid or os.getpid()
    now = time.monotonic()
    try:
        listed, proc, children = _children.get(pid, (-math.inf, None, []))
        if proc is None or now - listed > CHILDREN_TTL_S:
            proc = psutil.Process(pid)
            listed, children = now, proc.children(recursive=True)
            _children[pid] = (listed, proc, children)
        rss = proc.memory_info().rss
        for child in children:
            try:
                rss += child.memory_info().rss
            except psutil.Error:  # it ended: list them anew next time
                _children[pid] = (-math.inf, proc, children)
    except psutil.Error:
        _children.pop(pid, None)
        return {}
    out = {"rss_bytes": float(rss)}
    import sys

    torch = sys.modules.get("torch")  # never import torch only to find no GPU
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        out |= {
            "cuda_allocated_bytes": float(allocated),
            "cuda_reserved_bytes": float(reserved),
            "cuda_fragmentation": (reserved - allocated) / reserved if reserved else 0.0,
        }
    return out


def actor_metrics(actor: str, memory: Mapping[str, float]) -> dict[str, float]:
    """``{"rss_bytes": 1e9}`` of ``engine0`` -> ``{"mem/engine0/rss_bytes": 1e9}``."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", actor):
        raise ValueError(f"actor name {actor!r}: letters, digits and _ only")
    return {f"{MEM_PREFIX}{actor}/{field}": float(v) for field, v in memory.items()}


def split_key(key: str) -> tuple[str, str] | None:
    """``mem/engine0/rss_bytes`` -> ``("engine0", "rss_bytes")``; None for any other key."""
    m = _KEY.match(key)
    return (m.group(1), m.group(2)) if m else None


def rank_memory(metrics: list[Mapping[str, Any]]) -> dict[str, float]:
    """The ``mem/*`` entries of every rank's train-step metrics (each rank reports only its own)."""
    return {k: float(v) for m in metrics for k, v in m.items() if k.startswith(MEM_PREFIX)}
