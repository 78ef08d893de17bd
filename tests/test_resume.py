"""Run checkpoints (``trainer.save_every``) and resuming from one (``trainer.resume_from``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from miles.config import ConfigError, checkpoints, validate
from miles.core import resume


def _fake_checkpoint(root: Path, step: int, *, trainer: bool = True) -> Path:
    """The files :func:`checkpoints.load` reads, with a loop state of ``step`` (for the config checks)."""
    d = checkpoints.step_dir(root, step)
    (d / "trainer").mkdir(parents=True)
    if trainer:
        (d / "trainer" / "trainer_state.json").write_text("{}")
    (d / "loop_state.json").write_text(json.dumps(
        {"format": checkpoints.FORMAT, "step": step, "next_group_id": 4 * step, "rng_state": [3, [1, 2, 3], None]}))
    return d


def test_newest_complete_checkpoint_is_found(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 10)
    (tmp_path / "step_000012.tmp").mkdir()  # an interrupted write is never read
    (tmp_path / "step_000011").mkdir()  # nor a directory without its loop state
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [2, 10]
    assert checkpoints.find_checkpoint(tmp_path) == checkpoints.step_dir(tmp_path, 10)
    assert checkpoints.find_checkpoint(checkpoints.step_dir(tmp_path, 2)) == checkpoints.step_dir(tmp_path, 2)
    state = checkpoints.load(tmp_path)
    assert (state.step, state.next_group_id, state.rng_state) == (10, 40, (3, (1, 2, 3), None))
    with pytest.raises(ValueError, match="no such directory"):
        checkpoints.find_checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match="neither a run checkpoint"):
        checkpoints.find_checkpoint(tmp_path / "step_000011")


def test_incomplete_or_foreign_checkpoint_is_refused(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "a", 3, trainer=False)
    with pytest.raises(ValueError, match="no trainer/ state"):
        checkpoints.load(tmp_path / "a")
    d = _fake_checkpoint(tmp_path / "b", 3)
    (d / "loop_state.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        checkpoints.load(d)


def test_config_checks_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.save_every: must be 0"):
        validate({"trainer": {"save_every": -1}})
    with pytest.raises(ConfigError, match="trainer.keep_checkpoints: must be at least 1"):
        validate({"trainer": {"keep_checkpoints": 0}})
    assert validate({"algo": {"estimator": "gae"}, "trainer": {"save_every": 5}}).trainer.save_every == 5
    with pytest.raises(ConfigError, match="trainer.resume_from: .*no such directory"):
        validate({"trainer": {"resume_from": str(tmp_path / "missing")}})
    _fake_checkpoint(tmp_path, 6)
    with pytest.raises(ConfigError, match="at step 6, and trainer.num_steps is 6: nothing left"):
        validate({"trainer": {"resume_from": str(tmp_path), "num_steps": 6}})
    assert validate({"trainer": {"resume_from": str(tmp_path), "num_steps": 7}}).trainer.resume_from == str(tmp_path)
    # a critic run needs the critic's state too
    gae = {"algo": {"estimator": "gae"}, "trainer": {"resume_from": str(tmp_path), "num_steps": 7}}
    with pytest.raises(ConfigError, match=r"no critic/ state, but this run trains a critic"):
        validate(gae)
    (checkpoints.step_dir(tmp_path, 6) / "critic").mkdir()
    (checkpoints.step_dir(tmp_path, 6) / "critic" / "trainer_state.json").write_text("{}")
    assert validate(gae).algo.estimator == "gae"


def test_config_differences_leave_out_what_a_resume_may_change() -> None:
    saved = {"seed": 0, "trainer": {"lr": 1e-3, "num_steps": 10, "save_dir": "a"}, "tracking": {"uri": "x"}}
    now = {"seed": 1, "trainer": {"lr": 1e-3, "num_steps": 20, "save_dir": "b", "resume_from": "a"},
           "tracking": {"uri": "y"}, "extra": {"k": 1}}
    assert resume.config_differences(saved, now) == ["extra.k", "seed"]


def test_only_the_newest_checkpoints_stay(ray_cluster, tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):  # no trainer ranks: the loop state and config alone
        resume.save([], tmp_path, step, (3, (1,), None), step, {"seed": 0}, keep=2)
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [3, 4]
    assert not list(tmp_path.glob("*.tmp"))


def test_checkpoint_config_keeps_no_secret(ray_cluster, tmp_path: Path) -> None:
    d = resume.save([], tmp_path, 1, (3, (1,), None), 1, {"task": {"api_key": "sk-live-123", "n": 2}}, keep=1)
    text = (d / "config.yaml").read_text()
    assert "sk-live-123" not in text and "n: 2" in text
    # the redacted value still compares equal to the live config's
    assert resume.config_differences(yaml.safe_load(text), {"task": {"api_key": "other", "n": 2}}) == []


@pytest.mark.slow
def test_resumed_run_continues_with_the_same_numbers(ray_cluster, tmp_path: Path) -> None:
    """A 2-step PPO run (policy and critic) checkpoints every step; a run resumed from step 1's
    checkpoint computes step 2 exactly as the uninterrupted run did, and does not evaluate step 0 again."""
    from miles.bench.e2e import compose
    from miles.core.run import run_job

    base = ["algo=ppo", "seed=1", "tracking=none", "task.num_eval_prompts=8", "algo.num_prompts_per_step=4",
            "warm_start.steps=20", f"warm_start.cache_dir={tmp_path / 'cache'}", "trainer.num_steps=2",
            "trainer.eval_every=0"]

    def job(trainer: list[str]) -> dict[int, dict]:
        run, resolved = compose(base + trainer)
        seen: dict[int, dict] = {}
        run_job(run, resolved_yaml=resolved, overrides=[],
                on_metrics=lambda m, s: seen.setdefault(s, {}).update(m))
        return seen

    full = job(["trainer.save_every=1", f"trainer.save_dir={tmp_path / 'ck'}"])
    assert [s for s, _ in checkpoints.checkpoints(tmp_path / "ck")] == [1, 2]
    assert (checkpoints.step_dir(tmp_path / "ck", 1) / "critic" / "model.safetensors").is_file()
    resumed = job([f"trainer.resume_from={checkpoints.step_dir(tmp_path / 'ck', 1)}"])
    assert sorted(resumed) == [2]
    for key in ("train/reward_mean", "train/loss", "train/grad_norm", "train/lr", "rollout/response_len_mean",
                "critic/value_loss", "critic/value_mean", "critic/grad_norm", "critic/lr", "eval/accuracy"):
        assert resumed[2][key] == full[2][key], key
