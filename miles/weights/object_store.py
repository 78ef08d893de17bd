"""Weight sync through the Ray object store (the CPU default transport).

Trainer rank 0 gathers the full state dict and puts it in the object store
once; every engine reads the same object and applies it between requests as
one version. Time and bytes are measured per sync.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray


def sync_weights(trainers: Sequence[Any], engines: Sequence[Any], version: int) -> dict[str, float]:
    """Send the trainers' current weights to every engine as ``version``; returns timing metrics."""
    t0 = time.perf_counter()
    published = ray.get([t.publish_weights.remote() for t in trainers])
    (ref,) = next(p for p in published if p is not None)
    t_gather = time.perf_counter() - t0
    applied = ray.get([e.update_weights.remote(ref, version) for e in engines])
    seconds = time.perf_counter() - t0
    num_bytes = float(applied[0].get("bytes", 0.0))
    del ref
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/gather_s": t_gather,
        "weight_sync/bytes": num_bytes,
        "weight_sync/bytes_per_s": num_bytes * len(engines) / max(seconds, 1e-9),
        "weight_sync/version": float(version),
    }
