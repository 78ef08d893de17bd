"""``python -m miles.bench async``: the per-run numbers from the loop's per-step metrics."""

from __future__ import annotations

import importlib

import pytest

bench = importlib.import_module("miles.bench.async")  # `async` is a keyword: no plain import


def _step(step_s: float, train_s: float, rollout_s: float, busy_frac: float | None) -> dict[str, float]:
    m = {"perf/step_time_s": step_s, "perf/train_s": train_s, "perf/rollout_s": rollout_s}
    return m | ({} if busy_frac is None else {"perf/engine_busy_frac": busy_frac})


FINAL = {"eval/accuracy": 0.5, "eval/accuracy_se": 0.1}


def test_engine_busy_fraction_is_weighted_by_step_time_next_to_the_trainers() -> None:
    # a 1 s step with the engine busy 90% of it, a 3 s step with the engine busy 10%: 1.2 s of 4 s
    row = bench.run_summary([_step(1.0, 0.5, 0.5, 0.9), _step(3.0, 2.0, 1.0, 0.1)], 8, FINAL)
    assert row["engine_busy_frac"] == pytest.approx(1.2 / 4)
    assert row["trainer_busy_frac"] == pytest.approx(2.5 / 4)
    assert row["rollout_wait_frac"] == pytest.approx(1.5 / 4)
    assert row["samples_per_s"] == pytest.approx(16 / 4)


def test_engines_without_a_busy_counter_give_none_and_the_summary_keeps_the_others() -> None:
    row = bench.run_summary([_step(1.0, 0.5, 0.5, None)], 8, FINAL)
    assert row["engine_busy_frac"] is None
    counted = bench.run_summary([_step(2.0, 1.0, 1.0, 0.5)], 8, FINAL)
    out = bench.summarize({"sync": [row], "fully_async": [counted, counted]})
    assert out["sync"]["engine_busy_frac"] is None and out["sync"]["trainer_busy_frac"] == 0.5
    assert out["fully_async"]["engine_busy_frac"] == 0.5
    assert out["ratio_throughput_fully_async_over_sync"] == 0.5


def test_eval_curves_are_drawn_per_schedule(tmp_path) -> None:
    dest = tmp_path / "curves" / "eval.png"
    bench.plot_curves({"sync": [(0, {0: 0.5, 50: 0.6})], "fully_async": [(0, {0: 0.5, 50: 0.7}), (1, {0: 0.4})]},
                      dest, "title")
    assert dest.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
