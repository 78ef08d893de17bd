"""Reward runner: deadlines that really stop a hung reward, failures reported per call; math-verify."""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles.config import ConfigError, TargetConfig
from miles.rewards.math import math_verify_reward
from miles.rewards.runner import RewardItem, RewardOutcome, RewardRunner

PLUGIN = "miles_test_plugin_rewards"
PLUGIN_SOURCE = '''
"""A user's reward module outside the miles package: behaviour chosen by the response text."""
import os
import time


def reward(response_text, label):
    if response_text == "hang":
        while True:
            pass
    if response_text == "sleep":
        time.sleep(3600)
    if response_text == "raise":
        raise ValueError("cannot grade this")
    if response_text == "nan":
        return float("nan")
    if response_text == "inf":
        return float("inf")
    if response_text == "text":
        return "1.0"
    if response_text == "crash":
        os._exit(7)
    return 1.0 if response_text == label else 0.0


def reward_with_prompt(response_text, label, prompt=""):
    return float(len(prompt))


def group_reward(responses, label):
    if label == "short":
        return [1.0]
    return [float(len(r)) for r in responses]


def scaled(response_text, label, scale=1.0):
    return scale * (response_text == label)
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("plugin")
    (d / f"{PLUGIN}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    sys.path.insert(0, str(d))  # spawned workers get the parent's sys.path
    yield d
    sys.path.remove(str(d))


def node(name: str, **kwargs) -> TargetConfig:
    return TargetConfig(target=f"{PLUGIN}.{name}", partial=True, kwargs=kwargs)


@pytest.fixture(scope="module")
def runner(plugin_dir: Path):
    with RewardRunner(node("reward"), allow=[f"{PLUGIN}."], timeout_s=0.5) as r:
        r.wait_ready()
        yield r


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_plain_rewards_in_order(runner: RewardRunner) -> None:
    items = [RewardItem(str(i % 3), "1") for i in range(300)]
    out = runner.score(items)
    assert [o.reward for o in out] == [1.0 if i % 3 == 1 else 0.0 for i in range(300)]
    assert all(o.ok for o in out)
    assert runner.score([]) == []


def test_hanging_reward_is_killed_within_its_deadline(runner: RewardRunner) -> None:
    pid = runner.worker_pids()[0]
    t0 = time.monotonic()
    out = runner.score([RewardItem("hang", "1")])
    elapsed = time.monotonic() - t0
    assert out == [RewardOutcome(None, "timeout after 0.5s")]
    assert 0.5 <= elapsed < 0.5 + 2.0
    assert gone(pid)  # killed and reaped, not left spinning
    assert runner.worker_pids()[0] != pid
    # the fresh worker scores the next call
    assert runner.score([RewardItem("1", "1")]) == [RewardOutcome(1.0, None)]


def test_a_hang_inside_a_chunk_blames_only_that_call(runner: RewardRunner) -> None:
    pid = runner.worker_pids()[0]
    items = [RewardItem("1", "1"), RewardItem("2", "1"), RewardItem("sleep", "1"), RewardItem("1", "1")]
    t0 = time.monotonic()
    out = runner.score(items)
    assert [o.reward for o in out] == [1.0, 0.0, None, 1.0]
    assert out[2].failure == "timeout after 0.5s"
    assert time.monotonic() - t0 < 2 * 0.55 + 6.0  # two deadlines plus two worker starts, at most
    assert gone(pid)


def test_exceptions_and_bad_values_are_failures(runner: RewardRunner) -> None:
    out = runner.score([RewardItem(t, "1") for t in ("raise", "nan", "inf", "text", "1")])
    assert out[0] == RewardOutcome(None, "raised ValueError: cannot grade this")
    assert out[1] == RewardOutcome(None, "non-finite reward: nan")
    assert out[2] == RewardOutcome(None, "non-finite reward: inf")
    assert out[3].reward is None and out[3].failure.startswith("non-finite reward: '1.0' is a str")
    assert out[4] == RewardOutcome(1.0, None)


def test_worker_crash_is_reported_with_its_exit_code(runner: RewardRunner) -> None:
    pid = runner.worker_pids()[0]
    out = runner.score([RewardItem("1", "1"), RewardItem("crash", "1"), RewardItem("0", "1")])
    assert out == [RewardOutcome(1.0), RewardOutcome(None, "reward worker died (exit code 7)"), RewardOutcome(0.0)]
    assert gone(pid)


def test_an_item_that_cannot_be_sent_fails_alone(runner: RewardRunner) -> None:
    out = runner.score([RewardItem("1", "1"), RewardItem("1", lambda: "1"), RewardItem("1", "1")])
    assert [o.reward for o in out] == [1.0, None, 1.0]
    assert out[1].failure.startswith("could not send to the reward worker:")


def test_plugin_needs_its_prefix_in_allow(plugin_dir: Path) -> None:
    with pytest.raises(ConfigError, match="plugins.allow"):
        RewardRunner(node("reward"), allow=[], timeout_s=1.0)


def test_broken_reward_config_fails_at_start(plugin_dir: Path) -> None:
    with RewardRunner(node("no_such_fn"), allow=[f"{PLUGIN}."]) as r, pytest.raises(ConfigError, match="no_such_fn"):
        r.wait_ready()
    with RewardRunner(node("scaled", scal=2.0), allow=[f"{PLUGIN}."]) as r, \
            pytest.raises(ConfigError, match="did you mean 'scale'"):
        r.wait_ready()


def test_group_rewards_and_extra_arguments(plugin_dir: Path) -> None:
    allow = [f"{PLUGIN}."]
    with RewardRunner(node("group_reward"), allow=allow, kind="group", num_workers=2) as r:
        groups = [[RewardItem("a", "x"), RewardItem("bbb", "x")], [], [RewardItem("cc", "short"), RewardItem("d", "short")]]
        out = r.score_groups(groups)
        assert [[o.reward for o in g] for g in out] == [[1.0, 3.0], [], [None, None]]
        assert out[2][0].failure == "group reward returned 1 rewards for a group of 2 responses"
        with pytest.raises(TypeError, match="score_groups"):
            r.score([RewardItem("a", "x")])
    with RewardRunner(node("reward_with_prompt"), allow=allow, timeout_s=0) as r:  # inline
        assert r.isolation == "inline" and r.worker_pids() == []
        assert r.score([RewardItem("a", "x", prompt="four")]) == [RewardOutcome(4.0)]


def test_inline_mode_catches_exceptions_and_non_finite(plugin_dir: Path) -> None:
    with RewardRunner(node("reward"), allow=[f"{PLUGIN}."], isolation="inline") as r:
        out = r.score([RewardItem("raise", "1"), RewardItem("nan", "1"), RewardItem("1", "1")])
    assert [o.failure for o in out] == ["raised ValueError: cannot grade this", "non-finite reward: nan", None]


def test_several_workers_share_a_batch_in_order(plugin_dir: Path) -> None:
    with RewardRunner(node("reward"), allow=[f"{PLUGIN}."], timeout_s=0.5, num_workers=2) as r:
        items = [RewardItem("hang" if i == 5 else str(i % 2), "1") for i in range(40)]
        out = r.score(items)
        assert out[5].failure == "timeout after 0.5s"
        assert [o.reward for i, o in enumerate(out) if i != 5] == [float(i % 2) for i in range(40) if i != 5]


def test_bad_runner_arguments() -> None:
    fn = TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True)
    for kwargs, match in (({"timeout_s": -1}, "timeout_s"), ({"timeout_s": math.nan}, "timeout_s"),
                          ({"num_workers": 0}, "num_workers"), ({"kind": "batch"}, "kind"),
                          ({"isolation": "process", "timeout_s": 0}, "deadline")):
        with pytest.raises(ConfigError, match=match):
            RewardRunner(fn, **kwargs)


def test_closed_runner_refuses_work() -> None:
    r = RewardRunner(TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True))
    pids = r.worker_pids()
    r.close()
    assert all(gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        r.score([RewardItem("1", "1")])


# --- math-verify ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("1/2", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{\\frac12}", "0.5", 1.0),
        ("x^2+2x+1", "(x+1)^2", 1.0),
        ("$\\sqrt{4}$", "2", 1.0),
        ("10/12", "\\frac{5}{6}", 1.0),
        ("42", 42, 1.0),
        ("0.6", "0.5", 0.0),
        ("", "0.5", 0.0),
        ("no idea", "3", 0.0),
    ],
)
def test_math_verify_equivalences(response: str, label: object, reward: float) -> None:
    assert math_verify_reward(response, label) == reward


def test_math_verify_runs_under_the_runner() -> None:
    fn = TargetConfig(target="miles.rewards.math.math_verify_reward", partial=True)
    with RewardRunner(fn, timeout_s=10.0) as r:
        out = r.score([RewardItem("\\frac{1}{2}", "0.5"), RewardItem("1/3", "0.5"), RewardItem("1", "")])
    assert [o.reward for o in out] == [1.0, 0.0, None]
    assert out[2].failure.startswith("raised ValueError: math_verify_reward: cannot parse the label")


UNGUARDED_SCRIPT = '''
from miles.config import TargetConfig
from miles.rewards.runner import RewardItem, RewardRunner

# top-level code, no __main__ guard: every spawned worker re-runs it while importing this script
with RewardRunner(TargetConfig(target="miles.tasks.count.count_reward", partial=True), timeout_s=30.0) as r:
    r.score([RewardItem("1 2", "1 2")])
'''


def test_a_script_without_a_main_guard_is_told_so(tmp_path: Path) -> None:
    """A worker that dies while starting names the cause when the main script has no ``__main__`` guard."""
    import subprocess

    script = tmp_path / "train_without_guard.py"
    script.write_text(UNGUARDED_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "exited with code 1 while importing the reward function" in p.stderr
    assert 'if __name__ == "__main__":' in p.stderr and str(script) in p.stderr
    # under the guard the same code runs
    guarded = tmp_path / "train_with_guard.py"
    body = UNGUARDED_SCRIPT.split("\n# top-level")[0] + "\n\nif __name__ == \"__main__\":\n" + "\n".join(
        "    " + line for line in UNGUARDED_SCRIPT.split("\n") if line.startswith(("with ", "    r.score")))
    guarded.write_text(body + "\n")
    p = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


LOKY_JOB = """
from joblib.externals.loky import get_reusable_executor


def job():
    from miles.config import TargetConfig
    from miles.rewards.runner import RewardItem, RewardRunner

    node = TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True)
    with RewardRunner(node, timeout_s=30.0, isolation="process", startup_timeout_s=60.0) as r:
        out = r.score([RewardItem("7", "7"), RewardItem("8", "7")])
        return [o.reward for o in out], r.num_crashes, r.num_restarts


if __name__ == "__main__":
    print("result", get_reusable_executor(max_workers=1).submit(job).result())
"""


def test_reward_workers_start_inside_a_joblib_launchers_job(tmp_path: Path) -> None:
    """A joblib sweep runs each job in a loky worker, whose start method is "loky": a spawned reward
    worker restored that first and died ("cannot find context for 'loky'")."""
    import subprocess

    pytest.importorskip("joblib")
    script = tmp_path / "job.py"
    script.write_text(LOKY_JOB)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "result ([1.0, 0.0], 0, 0)" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "cannot find context" not in p.stderr
