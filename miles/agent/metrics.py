"""Per-sample counts a generate function reports, summed over a rollout."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from miles.types import Sample


def sample_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """Sums of the samples' ``metadata["counts"]`` as ``rollout/<name>``; with tool calls also
    ``rollout/agent/tool_success_rate`` (calls that returned without error / calls). Empty when no
    sample has counts."""
    total: Counter[str] = Counter()
    for s in samples:
        total.update(s.metadata.get("counts", {}))
    out = {f"rollout/{k}": float(v) for k, v in sorted(total.items())}
    if total["agent/tool_calls"]:
        out["rollout/agent/tool_success_rate"] = total["agent/tool_calls_ok"] / total["agent/tool_calls"]
    return out
