"""``python -m miles.bench``: the dispatcher, and the rollout benchmark end to end in --quick mode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.bench import BENCHMARKS
from miles.bench.__main__ import main as bench_main


def test_dispatcher_lists_benchmarks_and_rejects_unknown_names(capsys: pytest.CaptureFixture) -> None:
    assert bench_main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and all(name in err for name in BENCHMARKS)
    assert bench_main([]) == 2 and bench_main(["--help"]) == 0
    # as a command: exit status 2, usage on stderr, nothing heavy imported
    p = subprocess.run([sys.executable, "-m", "miles.bench", "nope"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "benchmarks: rollout, train, sync, e2e" in p.stderr


def test_rollout_bench_quick_prints_json_last(capsys: pytest.CaptureFixture) -> None:
    from miles.bench.rollout import main

    assert bench_main(["rollout", "--quick", "--batch-sizes", "1,2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert {"tokens_per_s_miles", "tokens_per_s_hf_generate", "ratio_vs_hf_generate", "batch_sizes",
            "per_batch_size", "batch1_latency_s_miles", "batch1_latency_s_hf_generate"} <= result.keys()
    assert result["batch_sizes"] == [1, 2] and result["main_batch_size"] == 2
    assert [r["batch_size"] for r in result["per_batch_size"]] == [1, 2]
    for row in result["per_batch_size"]:
        assert row["tokens_per_s_miles"] > 0 and row["tokens_per_s_hf_generate"] > 0
        assert 1 <= row["mean_len_miles"] <= 16 and 1 <= row["mean_len_hf"] <= 16
        assert row["ratio_vs_hf_generate"] == pytest.approx(row["tokens_per_s_miles"] / row["tokens_per_s_hf_generate"])
    with pytest.raises(SystemExit):
        main(["--batch-sizes", "0"])


def test_rollout_bench_with_draft_heads_checks_greedy_outputs_and_reports_acceptance(capsys: pytest.CaptureFixture) -> None:
    from miles.bench.rollout import main

    assert bench_main(["rollout", "--quick", "--batch-sizes", "2", "--draft-heads", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["engines"] == ["hf", "miles", "heads"] and result["heads_greedy_outputs_equal"] is True
    assert 0 < result["heads_accept_rate"] <= 1 and result["tokens_per_s_heads"] > 0
    assert result["heads_ratio_vs_miles"] == pytest.approx(result["tokens_per_s_heads"] / result["tokens_per_s_miles"])
    with pytest.raises(SystemExit):
        main(["--draft-heads", "17"])
