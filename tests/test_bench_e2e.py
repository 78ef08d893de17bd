"""``python -m miles.bench e2e``: argument checks and the per-seed summary (the runs themselves need TRL)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from miles.bench.e2e import main, sign_flip_ci, sign_flip_p, summarize


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
    assert out["eval_accuracy_diff_ci95"] == [None, None]  # 3 seeds: no shift can be rejected at 5%
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


def _brute_p(diffs: list[float]) -> float:
    signs = itertools.product((1, -1), repeat=len(diffs))
    observed = abs(sum(diffs)) - 1e-12
    return sum(abs(sum(s * d for s, d in zip(p, diffs, strict=True))) >= observed for p in signs) / 2 ** len(diffs)


def test_sign_flip_ci_is_the_set_the_test_does_not_reject() -> None:
    diffs = [0.023, 0.018, -0.054, -0.018, 0.005, -0.051, -0.059, -0.118, -0.013, -0.04, -0.032]
    lo, hi = sign_flip_ci(diffs)
    mean = statistics.fmean(diffs)
    assert lo < mean < hi < 0.0  # this made-up sample is lower on the whole, so 0 is outside
    assert _brute_p(diffs) < 0.05
    for bound, outward in ((lo, -1), (hi, 1)):
        assert _brute_p([d - (bound - outward * 1e-5) for d in diffs]) > 0.05  # just inside: kept
        assert _brute_p([d - (bound + outward * 1e-5) for d in diffs]) <= 0.05  # just outside: rejected
    # a difference of one sign and no spread: the interval shrinks to it
    assert sign_flip_ci([0.1] * 8) == pytest.approx((0.1, 0.1), abs=2e-6)
    assert sign_flip_ci([0.1, -0.2, 0.3, 0.0, 0.05]) == (None, None)  # 5 seeds: 2/32 > 0.05
    many = [0.05] * 20 + [-0.01] * 4  # sampled patterns
    lo, hi = sign_flip_ci(many)
    assert 0 < lo < statistics.fmean(many) < hi
    with pytest.raises(ValueError, match="level"):
        sign_flip_ci(diffs, level=1.0)


def test_pool_sums_up_the_per_seed_lines_of_earlier_runs(tmp_path, capsys: pytest.CaptureFixture) -> None:
    import json

    from miles.bench.e2e import SEED_LINE, pool

    rows = [_seed(0, 0.30, 0.45, [5.0, 1.0], [5.0, 2.0]), _seed(3, 0.50, 0.40, [5.0, 3.0], [5.0, 6.0]),
            _seed(4, 0.40, 0.44, [5.0, 2.0], [5.0, 4.0])]
    line = lambda w, r: SEED_LINE + json.dumps({"workload": w, **r})  # noqa: E731
    # two stopped runs, their log lines around the per-seed lines
    (tmp_path / "a.log").write_text(f"INFO something\n{line('long', rows[0])}\n{line('short', rows[2])}\n")
    (tmp_path / "b.log").write_text(f"{line('long', rows[1])}\nTraceback (most recent call last):\n")
    assert main(["--pool", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["long"] == json.loads(json.dumps(summarize(rows[:2]) | {"per_seed": rows[:2]}))
    assert out["short"]["seeds"] == [4] and out["short"]["eval_accuracy_se_miles"] == 0.03
    with pytest.raises(ValueError, match="seed 0 appears more than once"):
        pool([line("long", rows[0]), line("long", rows[0])])
    with pytest.raises(SystemExit) as e:
        main(["--pool", str(tmp_path / "missing.log")])
    assert e.value.code == 2 and "--pool" in capsys.readouterr().err
    (tmp_path / "empty.log").write_text("INFO nothing finished\n")
    with pytest.raises(SystemExit) as e:
        main(["--pool", str(tmp_path / "empty.log")])
    assert e.value.code == 2 and "no per-seed lines" in capsys.readouterr().err
