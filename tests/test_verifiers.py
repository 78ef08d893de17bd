"""verifiers environments as a task (:mod:`miles.agent.verifiers`): the example taskset
(examples/verifiers_largest/largest_taskset.py, verifiers' own classes) is played in verifiers' venv by
miles' runner, every model call through the run's rollout server, and scored by the taskset's reward."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from env_examples import Capture, largest_of

from miles.bench.e2e import compose

pytestmark = pytest.mark.verifiers

ROOT = Path(__file__).resolve().parents[1]
PATHS = f"[{ROOT / 'examples' / 'verifiers_largest'}]"


def test_episodes_are_played_in_verifiers_and_scored_by_the_taskset(ray_cluster, tmp_path: Path) -> None:
    """Two training steps: each sample is the session the runner's episode sent to the rollout server
    (the engine's tokens, all in the loss), and its reward is the taskset's verdict on that reply."""
    from miles.agent.verifiers import close_runners
    from miles.core.run import run_job

    overrides = ["task=verifiers", f"task.source.paths={PATHS}", "task.source.args={num_tasks: 400}", "task.num_eval_prompts=8",
                 "trainer.num_steps=2", "trainer.eval_every=0", "algo.num_prompts_per_step=4",
                 "algo.num_samples_per_prompt=4", "warm_start.steps=20", f"warm_start.cache_dir={tmp_path}",
                 "tracking=none", "plugins.allow=[env_examples.,miles.]", "hooks=[{_target_: env_examples.Capture}]"]
    run, resolved = compose(overrides)
    try:
        run_job(run, resolved_yaml=resolved, overrides=overrides)
    finally:
        close_runners()
    assert len(Capture.samples) == 2 * 16
    for sample in Capture.samples:
        right = sample.response_text.strip() == largest_of(sample.label["task"])
        assert sample.reward == sample.metadata["env_reward"] == (1.0 if right else 0.0)
        assert sample.response_ids and set(sample.loss_mask) == {1} and len(sample.rollout_logprobs) == len(sample.response_ids)
        assert sample.metadata["counts"]["agent/turns"] == 1
    assert {s.reward for s in Capture.samples} == {0.0, 1.0}


def test_a_missing_venv_or_taskset_or_server_is_one_clear_error(tmp_path: Path) -> None:
    from miles.agent.openai_rollout import SessionEndpoint
    from miles.agent.verifiers import VerifiersError, VerifiersTask, close_runners, find_python, runner_for

    with pytest.raises(FileNotFoundError, match=r"nowhere/python is missing: run scripts/setup_verifiers.sh"):
        find_python(str(tmp_path / "nowhere" / "python"))
    try:
        with pytest.raises(VerifiersError, match=r"the verifiers runner exited .*no_such_taskset"):
            VerifiersTask(env="no_such_taskset", timeout_s=120)
        # an episode whose model calls find no server: the runner answers for that episode, and goes on
        runner = runner_for("largest_taskset", {"num_tasks": 4}, [str(ROOT / "examples" / "verifiers_largest")])
        answer = asyncio.run(runner.run(0, SessionEndpoint("http://127.0.0.1:9/v1", "t", "s", None), 60))
        assert answer["ok"] is False and answer["error"] and answer["reward"] == 0.0
        assert runner.prompts(60)[0] == "Which is largest: 49 97 53 5 33?" and not runner._dead
        # a runner that dies fails its episodes with the reason, and the next episode gets a new runner
        runner.proc.kill()
        runner.proc.wait()
        deadline = time.monotonic() + 30
        while not runner._dead and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(VerifiersError, match=r"the verifiers runner exited \(-9\)"):
            asyncio.run(runner.run(0, SessionEndpoint("http://127.0.0.1:9/v1", "t", "s", None), 60))
        again = runner_for("largest_taskset", {"num_tasks": 4}, [str(ROOT / "examples" / "verifiers_largest")])
        assert again is not runner and again.prompts(60)[0] == "Which is largest: 49 97 53 5 33?" and not again._dead
    finally:
        close_runners()
