"""``python -m miles.bench precision --quick``: rows per recipe, the fp32 reference, and the JSON line; with
``--train-steps``, eval accuracy before and after a GRPO run per MoE row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_precision_bench_quick(capsys: pytest.CaptureFixture) -> None:
    from miles.bench.precision import main

    assert main(["--quick", "--recipes", "fp32,int4,int4_qat", "--models", "dense"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-len(lines) + 4].startswith("model | trainer | recipe")  # 4 JSON rows, then the table header
    result = json.loads(lines[-1])
    rows = {r["recipe"]: r for r in result["rows"]}
    assert set(rows) == {"fp32", "int4", "int4_qat", "fp32 true_on_policy"}
    assert rows["fp32"]["step_ratio"] == 1.0
    assert rows["fp32 true_on_policy"]["bitwise"] and rows["fp32 true_on_policy"]["mismatch"] == 0
    assert rows["int4"]["mismatch"] > 1e-3 and rows["int4"]["tis_clip_frac"] is not None  # PTQ: TIS on
    # QAT: both sides compute with the same int4 weights; what is left is the bf16 difference the bf16
    # recipe has too (not bitwise: 9.5e-5 mean here on 2026-12-02)
    assert rows["int4_qat"]["mismatch"] < 1e-3 and rows["int4_qat"]["tis_clip_frac"] is None
    assert rows["fp32"]["mismatch"] < 1e-5
    assert all(r["generate_s"] > 0 and r["train_s"] > 0 for r in rows.values())


@pytest.mark.megatron
def test_precision_bench_runs_the_megatron_trainer(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("megatron.core")
    from miles.bench.precision import main

    assert main(["--quick", "--recipes", "fp32,int4_qat", "--models", "moe", "--trainers", "megatron"]) == 0
    rows = {(r["recipe"], r["replay"]): r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {("fp32", "off"), ("fp32", "on"), ("int4_qat", "off"), ("int4_qat", "on")}
    assert all(r["trainer"] == "megatron" for r in rows.values())
    assert rows["fp32", "off"]["mismatch"] < 1e-5 and rows["fp32", "off"]["route_agreement"] == 1.0
    assert rows["int4_qat", "on"]["replayed_share"] == 1.0 and rows["int4_qat", "on"]["mismatch"] < 1e-3  # QAT


# two Ray jobs on the session's Ray cluster: 18 s here (26 s with the cluster's start), 75 s with its own cluster
# at load average 19
def test_precision_bench_trains_each_moe_row_and_reports_eval_accuracy(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                       ray_cluster) -> None:
    from miles.bench.precision import main

    cheap = (f"warm_start.steps=2 warm_start.batch_size=8 warm_start.cache_dir={tmp_path} algo.num_prompts_per_step=2 "
             "algo.num_samples_per_prompt=2 task.num_eval_prompts=8")
    assert main(["--quick", "--recipes", "fp32", "--models", "moe", "--train-steps", "1",
                 "--train-overrides", cheap]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["train_steps"] == 1
    off, on = sorted(result["rows"], key=lambda r: r["replay"])
    assert (off["replay"], on["replay"]) == ("off", "on")
    assert on["replayed_share"] == 1.0  # the experts used are the recorded ones under replay
    for r in (off, on):
        assert 0 <= r["eval_before"] <= 1 and 0 <= r["eval_after"] <= 1 and r["eval_se"] >= 0
    # the same checkpoint, seed and rollout numerics: replay changes only the trainer, not step 0's eval
    assert off["eval_before"] == on["eval_before"]
