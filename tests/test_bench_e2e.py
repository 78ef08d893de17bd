"""``python -m miles.bench e2e``: argument checks and the per-seed summary (the runs themselves need TRL)."""

from __future__ import annotations

import statistics

import pytest

from miles.bench.e2e import main, sign_flip_p, summarize


def _seed(seed: int, acc_miles: float, acc_trl: float, steps_miles: list[float], steps_trl: list[float]) -> dict:
    return {"seed": seed, "step_times_miles": steps_miles, "step_times_trl": steps_trl,
            "eval_accuracy_miles": acc_miles, "eval_accuracy_trl": acc_trl,
            "eval_accuracy_se_miles": 0.03, "eval_accuracy_se_trl": 0.04}


def test_one_seed_keeps_the_eval_standard_errors() -> None:
    out = summarize([_seed(0, 0.5, 0.4, [9.0, 1.0, 2.0, 3.0], [9.0, 4.0, 6.0])])
    # step 1 is left out of the median
    assert out["step_time_s_miles"] == 2.0 and out["step_time_s_trl"] == 5.0
    assert out["ratio_step_time_trl_over_miles"] == 2.5
    assert (out["eval_accuracy_miles"], out["eval_accuracy_trl"]) == (0.5, 0.4)
    assert (out["eval_accuracy_se_miles"], out["eval_accuracy_se_trl"]) == (0.03, 0.04)
    assert out["eval_accuracy_diff_miles_minus_trl"] == pytest.approx(0.1)
    assert out["eval_accuracy_diff_se"] == pytest.approx(0.05)
    assert out["seeds"] == [0]


def test_several_seeds_average_and_pair_the_accuracies() -> None:
    rows = [_seed(0, 0.30, 0.45, [5.0, 1.0], [5.0, 2.0]), _seed(3, 0.50, 0.40, [5.0, 3.0], [5.0, 6.0]),
            _seed(4, 0.40, 0.44, [5.0, 2.0], [5.0, 4.0])]
    out = summarize(rows)
    # pooled steps 2..N of every seed
    assert out["step_time_s_miles"] == 2.0 and out["step_time_s_trl"] == 4.0
    assert out["eval_accuracy_miles"] == pytest.approx(0.4)
    assert out["eval_accuracy_se_miles"] == pytest.approx(round(statistics.stdev([0.3, 0.5, 0.4]) / 3 ** 0.5, 4))
    assert out["eval_accuracy_trl"] == pytest.approx(round(statistics.fmean([0.45, 0.40, 0.44]), 4))
    diffs = [-0.15, 0.10, -0.04]
    assert out["eval_accuracy_diff_miles_minus_trl"] == pytest.approx(round(statistics.fmean(diffs), 4))
    assert out["eval_accuracy_diff_se"] == pytest.approx(round(statistics.stdev(diffs) / 3 ** 0.5, 4))
    assert out["seeds_miles_lower"] == 2
    assert out["ratio_step_time_per_seed"] == [2.0, 2.0, 2.0]
    # |sum| of the 8 sign patterns of (-0.15, 0.10, -0.04) reaching |-0.09|: all but (+, +, -) and (-, -, +)
    assert out["eval_accuracy_diff_p"] == pytest.approx(6 / 8)
    assert out["seeds"] == [0, 3, 4]
    with pytest.raises(ValueError, match="no seeds"):
        summarize([])


@pytest.mark.parametrize("seeds", ["a,b", "1,1", "-1", ","])
def test_bad_seeds_are_usage_errors(seeds: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--seeds", seeds])
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err


def test_sign_flip_p_exact_and_sampled() -> None:
    assert sign_flip_p([0.1]) == 1.0
    assert sign_flip_p([0.1] * 10) == pytest.approx(2 / 2**10)  # only all-plus and all-minus reach it
    assert sign_flip_p([0.1, -0.1] * 5) == 1.0
    many = [0.05] * 20 + [-0.01] * 4  # 24 seeds: sampled; mostly one-sided, so small
    assert 0 < sign_flip_p(many) < 0.01
    assert sign_flip_p(many) == sign_flip_p(many)  # seeded
