"""``python -m miles.bench precision --quick``: rows per recipe, the fp32 reference, and the JSON line."""

from __future__ import annotations

import json

import pytest


def test_precision_bench_quick(capsys: pytest.CaptureFixture) -> None:
    from miles.bench.precision import main

    assert main(["--quick", "--recipes", "fp32,int4,int4_qat", "--models", "dense"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-len(lines) + 4].startswith("model | recipe")  # 4 JSON rows, then the table header
    result = json.loads(lines[-1])
    rows = {r["recipe"]: r for r in result["rows"]}
    assert set(rows) == {"fp32", "int4", "int4_qat", "fp32 true_on_policy"}
    assert rows["fp32"]["step_ratio"] == 1.0
    assert rows["fp32 true_on_policy"]["bitwise"] and rows["int4_qat"]["bitwise"]  # same numbers on both sides
    assert rows["int4"]["mismatch"] > 1e-3 and rows["int4"]["tis_clip_frac"] is not None  # PTQ: TIS on
    assert rows["fp32"]["mismatch"] < 1e-5
    assert all(r["generate_s"] > 0 and r["train_s"] > 0 for r in rows.values())
