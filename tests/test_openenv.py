"""OpenEnv environments as a task (:mod:`miles.agent.openenv`): the example environment
(examples/openenv_largest/largest_env.py, OpenEnv's own server classes) runs from OpenEnv's venv as a
plain process, and a run trains on it unmodified, each sample an episode scored by the environment."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from env_examples import Capture, largest_of

from miles.bench.e2e import compose

pytestmark = pytest.mark.openenv

ROOT = Path(__file__).resolve().parents[1]


def openenv_python() -> Path:
    """OpenEnv's venv: ``MILES_OPENENV_PYTHON``, or ``<repo>/.venv-openenv`` (scripts/setup_openenv.sh)."""
    path = Path(os.environ.get("MILES_OPENENV_PYTHON", ROOT / ".venv-openenv" / "bin" / "python"))
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run scripts/setup_openenv.sh (or set MILES_OPENENV_PYTHON)")
    return path


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    """The example environment with two attempts per episode, on a free port of 127.0.0.1."""
    server = subprocess.Popen([str(openenv_python()), str(ROOT / "examples/openenv_largest/largest_env.py"), "--port", "0"],
                              stdout=subprocess.PIPE, text=True, env=os.environ | {"LARGEST_ENV_ATTEMPTS": "2"})
    try:
        first = server.stdout.readline()
        assert first.startswith("port "), f"the environment server did not start: {first!r}"
        yield f"http://127.0.0.1:{int(first.split()[1])}"
    finally:
        server.kill()
        server.wait()


def test_episodes_are_scored_by_the_environment_and_a_wrong_answer_is_asked_again(env_url: str,
                                                                                  ray_cluster, tmp_path: Path) -> None:
    """Two training steps on the environment (two attempts per episode, max_turns=2). A first answer
    that is the largest number ends the episode with reward 1; a wrong one gets the environment's "No."
    turn (in the response with loss mask 0) and a second answer, which earns 0.5 when right and 0 when
    not: the environment's rubric, checked against each seed's numbers."""
    from miles.core.run import run_job
    from miles.types import Status

    overrides = ["task=openenv", f"task.source.url={env_url}", "trainer.num_steps=2", "trainer.eval_every=0",
                 "algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4", "warm_start.steps=20",
                 f"warm_start.cache_dir={tmp_path}", "tracking=none", "rollout.generate_fn.max_turns=2",
                 "plugins.allow=[env_examples.,miles.]", "hooks=[{_target_: env_examples.Capture}]"]
    run, resolved = compose(overrides)
    seen: list[dict[str, float]] = []
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.append(dict(m)))
    assert len(Capture.samples) == 2 * 16
    by_steps = {1: 0, 2: 0}
    for sample in Capture.samples:
        counts = sample.metadata["counts"]
        steps, right = counts["env/steps"], sample.response_text.strip() == largest_of(sample.label["seed"])
        assert sample.reward == sample.metadata["env_reward"] == (1.0 / steps if right else 0.0)
        masked = [i for i, m in enumerate(sample.loss_mask) if m == 0]
        assert counts["agent/turns"] == steps and bool(masked) == (steps == 2)
        # the environment ends every episode it gets a second answer in; one that ends after a wrong first
        # answer without a second is a turn cut off at max_new_tokens
        assert counts["env/done"] == 1 or (steps == 1 and not right and sample.status is Status.TRUNCATED)
        by_steps[steps] += 1
    assert by_steps[1] > 0 and by_steps[2] > 0, by_steps  # both kinds of episode occurred
    assert seen[-1]["rollout/env/steps"] == sum(s.metadata["counts"]["env/steps"] for s in Capture.samples[16:])


def test_a_wrong_url_or_field_is_refused_before_anything_starts(env_url: str) -> None:
    from miles.agent.openenv import OpenEnvError, OpenEnvTask

    with pytest.raises(OpenEnvError, match=r"cannot reach the OpenEnv server at http://127.0.0.1:9 .*set task.source.url"):
        OpenEnvTask(url="http://127.0.0.1:9")
    with pytest.raises(OpenEnvError, match=r"the observation has no field 'question' .*its fields: prompt"):
        OpenEnvTask(url=env_url, observation_key="question")


def test_eval_seeds_never_ask_a_training_question(env_url: str) -> None:
    import random

    from miles.agent.openenv import OpenEnvTask

    task = OpenEnvTask(url=env_url, pool_size=400)
    held = {p.prompt for p in task.eval_problems(8)}
    assert len(held) == 8 and not held & {p.prompt for p in task.sample(300, random.Random(0))}
