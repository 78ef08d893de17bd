"""``python -m miles.bench lora``: the summary's ratios, and bad modes refused before anything runs."""

from __future__ import annotations

import pytest

from miles.bench.lora import main, summarize


def test_summary_averages_seeds_and_takes_lora_over_full_ratios() -> None:
    row = {"trainable_param_frac": 1.0, "sync_bytes": 1000.0, "step_time_s": 0.4, "eval_accuracy_gain": 0.2}
    lora = {"trainable_param_frac": 0.05, "sync_bytes": 50.0, "step_time_s": 0.5, "eval_accuracy_gain": 0.3}
    out = summarize({"full": [row, row | {"step_time_s": 0.6}], "lora": [lora]})
    assert out["full"]["step_time_s"] == pytest.approx(0.5)
    assert out["ratio_step_time_lora_over_full"] == pytest.approx(1.0)
    assert out["ratio_sync_bytes_lora_over_full"] == pytest.approx(0.05)


def test_unknown_modes_are_refused_before_any_run() -> None:
    with pytest.raises(SystemExit, match="full or lora"):
        main(["--modes", "full,qlora"])
