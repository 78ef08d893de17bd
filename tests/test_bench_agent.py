"""``python -m miles.bench agent --quick``: both sides run on real engine actors, the JSON line is last,
and only the reuse side reuses prefixes (every later turn a prefix hit on its session's engine)."""

from __future__ import annotations

import json

import pytest

from miles.bench.__main__ import main as bench_main


def test_agent_bench_quick_prints_json_last(ray_cluster, capsys: pytest.CaptureFixture) -> None:
    assert bench_main(["agent", "--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    for side in ("reuse", "none"):
        for key in ("tokens_per_s", "generated_tokens_per_s", "turn_latency_s_p50", "turn_latency_s_p90",
                    "turn_latency_s_p99", "prefix_hit_share", "affinity_hits"):
            assert f"{key}_{side}" in result, key
        assert result[f"tokens_per_s_{side}"] > result[f"generated_tokens_per_s_{side}"] > 0
    assert result["ratio_tokens_per_s_reuse_over_none"] == pytest.approx(
        result["tokens_per_s_reuse"] / result["tokens_per_s_none"])
    assert result["prefix_hit_share_reuse"] > 0 and result["prefix_hit_share_none"] == 0
    assert result["affinity_hits_reuse"] == 4 and result["affinity_hits_none"] == 0  # 4 sessions x 1 later turn
    # 4 sessions x 2 turns: prompts of 16 and 16 + 4 + 16 tokens, 4 generated per turn
    assert result["workload"]["tokens_per_repeat"] == 4 * (16 + 36 + 2 * 4)


def test_agent_bench_refuses_bad_sizes() -> None:
    from miles.bench.agent import main

    with pytest.raises(SystemExit):
        main(["--sessions", "0"])
    with pytest.raises(SystemExit):
        main(["--obs-tokens", "5000"])
