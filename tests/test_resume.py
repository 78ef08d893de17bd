"""Run checkpoints (``trainer.save_every``) and resuming from one (``trainer.resume_from``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from miles.config import ConfigError, checkpoints, manifest, validate
from miles.core import resume


def _fake_checkpoint(root: Path, step: int, *, trainer: bool = True, complete: bool = True) -> Path:
    """The files :func:`checkpoints.load` reads, with a loop state of ``step`` (for the config checks);
    ``complete``: with the manifest a finished save writes last."""
    d = checkpoints.step_dir(root, step)
    (d / "trainer").mkdir(parents=True)
    if trainer:
        (d / "trainer" / "trainer_state.json").write_text("{}")
    (d / "loop_state.json").write_text(json.dumps(
        {"format": checkpoints.FORMAT, "step": step, "next_group_id": 4 * step, "rng_state": [3, [1, 2, 3], None]}))
    if complete:
        manifest.write(d)
    return d


def test_newest_complete_checkpoint_is_found(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 10)
    (tmp_path / "step_000012.tmp").mkdir()  # an interrupted write is never read
    (tmp_path / "step_000011").mkdir()  # nor a directory without its loop state
    _fake_checkpoint(tmp_path, 13, complete=False)  # nor one without its manifest (written last)
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [2, 10]
    assert checkpoints.incomplete(tmp_path) == [tmp_path / "step_000011", tmp_path / "step_000013"]
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
    manifest.write(d)
    with pytest.raises(ValueError, match="format 99"):
        checkpoints.load(d)
    with pytest.raises(ValueError, match="no manifest.json, so the checkpoint is incomplete"):
        checkpoints.load(_fake_checkpoint(tmp_path / "c", 3, complete=False))
    with pytest.raises(ValueError, match="no complete checkpoint, only step_000003 without manifest.json"):
        checkpoints.load(tmp_path / "c")


def test_a_file_that_does_not_match_the_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    d = _fake_checkpoint(tmp_path, 4)
    (d / "trainer" / "model.safetensors").write_bytes(b"\x08" + bytes(range(200)))
    manifest.write(d)
    listed = json.loads((d / "manifest.json").read_text())["files"]
    assert sorted(listed) == ["loop_state.json", "trainer/model.safetensors", "trainer/trainer_state.json"]
    checkpoints.verify(checkpoints.load(d))
    data = bytearray((d / "trainer" / "model.safetensors").read_bytes())
    data[100] ^= 1  # one flipped bit, same size
    (d / "trainer" / "model.safetensors").write_bytes(bytes(data))
    state = checkpoints.load(d)  # the loop state still matches: the trainer's files are checked before they are read
    with pytest.raises(ValueError, match=r"trainer/model.safetensors: SHA-256 .* the manifest says"):
        checkpoints.verify(state)
    (d / "loop_state.json").write_text((d / "loop_state.json").read_text().replace("\"step\": 4", "\"step\": 5"))
    with pytest.raises(ConfigError, match=r"loop_state.json: SHA-256 .*refused before reading it"):
        validate({"trainer": {"resume_from": str(d), "num_steps": 9}})
    (d / "loop_state.json").write_text("{}")  # another size: refused without hashing
    with pytest.raises(ValueError, match=r"loop_state.json: 2 bytes, the manifest says"):
        checkpoints.load(d)
    (d / "trainer" / "extra.pt").write_bytes(b"x")  # a file the save did not write
    with pytest.raises(ValueError, match=r"not listed \['trainer/extra.pt'\]"):
        checkpoints.load(d)


def test_config_checks_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.save_every: must be 0"):
        validate({"trainer": {"save_every": -1}})
    with pytest.raises(ConfigError, match="trainer.keep_checkpoints: must be at least 1"):
        validate({"trainer": {"keep_checkpoints": 0}})
    with pytest.raises(ConfigError, match="trainer.max_nonfinite_steps: must be 0"):
        validate({"trainer": {"max_nonfinite_steps": -1}})
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
    manifest.write(checkpoints.step_dir(tmp_path, 6))
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
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.deleting"))


def test_checkpoint_config_keeps_no_secret(ray_cluster, tmp_path: Path) -> None:
    d = resume.save([], tmp_path, 1, (3, (1,), None), 1, {"task": {"api_key": "sk-live-123", "n": 2}}, keep=1)
    text = (d / "config.yaml").read_text()
    assert "sk-live-123" not in text and "n: 2" in text
    # the redacted value still compares equal to the live config's
    assert resume.config_differences(yaml.safe_load(text), {"task": {"api_key": "other", "n": 2}}) == []


def test_a_save_with_nonfinite_weights_is_refused_and_the_previous_checkpoint_stays(
        ray_cluster, tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """FSDP, two ranks: a NaN on rank 1's shard only; both ranks refuse (none waits on the other), nothing of
    step 2 becomes a checkpoint, and step 1 stays complete and loadable (auto takes it)."""
    from fsdp_ranks import Group, poison_weight

    group = Group(ray_cluster, 2, tiny_qwen3_dir, validate({}))
    try:
        resume.save(group.actors, tmp_path, 1, (3, (1,), None), 4, {"seed": 0}, keep=2)
        assert ray_cluster.get([a.__ray_call__.remote(poison_weight, 1) for a in group.actors])[1]
        refused = r"refusing to write .*step_000002.tmp/trainer: 1 parameter tensor\(s\) hold NaN or inf " \
                  r"\(model.embed_tokens.weight\); the previous"
        with pytest.raises(Exception, match=refused):
            resume.save(group.actors, tmp_path, 2, (3, (1,), None), 8, {"seed": 0}, keep=2)
        for ref in [a.save_state.remote(str(tmp_path / "direct")) for a in group.actors]:  # every rank refuses
            with pytest.raises(ray_cluster.exceptions.RayTaskError, match="1 parameter tensor"):
                ray_cluster.get(ref, timeout=60)
    finally:
        group.close()
    assert checkpoints.checkpoints(tmp_path) == [(1, checkpoints.step_dir(tmp_path, 1))]
    assert not (tmp_path / "step_000002.tmp" / "trainer").exists()
    checkpoints.verify(checkpoints.load(tmp_path))
    auto = {"trainer": {"resume_from": "auto", "save_dir": str(tmp_path), "num_steps": 3}}
    assert resume.resolve_auto(validate(auto)).trainer.resume_from == str(checkpoints.step_dir(tmp_path, 1))


def test_resume_from_auto_takes_the_newest_complete_checkpoint_or_starts_afresh(tmp_path: Path, caplog) -> None:
    ck = tmp_path / "ck"
    with pytest.raises(ConfigError, match="trainer.resume_from=auto: set trainer.save_dir too"):
        validate({"trainer": {"resume_from": "auto"}})
    auto = {"trainer": {"resume_from": "auto", "save_dir": str(ck), "save_every": 1, "num_steps": 6}}
    with caplog.at_level("INFO", logger="miles.core.resume"):
        assert resume.resolve_auto(validate(auto)).trainer.resume_from is None  # no directory yet
    assert f"no complete checkpoint in {ck}; starting afresh at step 1" in caplog.text
    _fake_checkpoint(ck, 2)
    _fake_checkpoint(ck, 3)
    (ck / "step_000004.tmp").mkdir()  # killed while writing step 4 ...
    _fake_checkpoint(ck, 5, complete=False)  # ... or before the manifest of step 5
    caplog.clear()
    with caplog.at_level("INFO", logger="miles.core.resume"):
        run = resume.resolve_auto(validate(auto))
    assert run.trainer.resume_from == str(checkpoints.step_dir(ck, 3))
    assert "step_000005 in" in caplog.text and "did not finish saving" in caplog.text
    assert resume.resolve_auto(validate({"trainer": {"resume_from": str(ck)}})).trainer.resume_from == str(ck)
    with pytest.raises(ConfigError, match="at step 3, and trainer.num_steps is 3: nothing left"):
        validate(auto | {"trainer": auto["trainer"] | {"num_steps": 3}})
    # an explicit path stays an error when it is missing or incomplete, never a fresh start
    with pytest.raises(ConfigError, match="no such directory"):
        validate({"trainer": {"resume_from": str(tmp_path / "missing"), "num_steps": 6}})
    with pytest.raises(ConfigError, match="no manifest.json, so the checkpoint is incomplete"):
        validate({"trainer": {"resume_from": str(checkpoints.step_dir(ck, 5)), "num_steps": 6}})


def test_another_model_shape_or_tokenizer_is_refused(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path,
                                                     tmp_path: Path) -> None:
    from miles.models.tokenizer import train_tokenizer

    words = ["the largest number is", "7 12 99 3", "answer"]
    tok, other_tok = train_tokenizer(words, 270), train_tokenizer(words + ["zebra quartz"], 270)
    mine = resume.fingerprint(tiny_qwen3_dir, tok)
    assert mine["model.hidden_size"] == 64 and mine["tokenizer.size"] == len(tok)
    assert resume.fingerprint(tiny_qwen3_dir, tok) == mine  # the same model and tokenizer: the same fingerprint
    state = checkpoints.LoopState(step=1, rng_state=(3, (1,), None), next_group_id=0, config={}, path=tmp_path,
                                  fingerprint=mine)
    resume.check_compatible(state, mine)
    with pytest.raises(ConfigError, match=r"written for another model \(model.architectures: this run has "
                                          r"\['Qwen3MoeForCausalLM'\].*model.num_local_experts: this run has 4"):
        resume.check_compatible(state, resume.fingerprint(tiny_qwen3_moe_dir, tok))
    from conftest import _save_tiny

    wider = _save_tiny(tmp_path / "wider", moe=False, hidden_size=96)
    with pytest.raises(ConfigError, match=r"another model \(model.hidden_size: this run has 96, the checkpoint 64\)"):
        resume.check_compatible(state, resume.fingerprint(wider, tok))
    with pytest.raises(ConfigError, match=r"written for another tokenizer \(tokenizer.vocab_sha256"):
        resume.check_compatible(state, resume.fingerprint(tiny_qwen3_dir, other_tok))


def test_nonfinite_steps_in_a_row_stop_the_run() -> None:
    from miles.core.step import count_nonfinite

    steps: list[int] = []
    count_nonfinite(steps, 1, {"train/nonfinite_skipped": 1.0}, limit=3)
    count_nonfinite(steps, 2, {"train/nonfinite_skipped": 0.0}, limit=3)  # a finite step ends the run of them
    assert steps == []
    count_nonfinite(steps, 3, {"train/nonfinite_skipped": 0.0, "critic/nonfinite_skipped": 2.0}, limit=3)
    count_nonfinite(steps, 4, {"train/nonfinite_skipped": 1.0}, limit=3)
    count_nonfinite(steps, 5, {"rollout/groups": 4.0}, limit=3)  # no update tried: neither counts nor resets
    assert steps == [3, 4]
    with pytest.raises(RuntimeError, match=r"steps 3, 4, 6: 3 steps in a row with a loss or gradient norm that is "
                                           r"not finite \(trainer.max_nonfinite_steps=3\)"):
        count_nonfinite(steps, 6, {"train/nonfinite_skipped": 2.0}, limit=3)
    never: list[int] = []
    for step in range(1, 20):
        count_nonfinite(never, step, {"train/nonfinite_skipped": 1.0}, limit=0)
    assert len(never) == 19


@pytest.mark.slow
def test_resumed_run_continues_with_the_same_numbers(ray_cluster, tmp_path: Path) -> None:
    """A 2-step PPO run (policy and critic) with ``trainer.resume_from=auto`` starts afresh and checkpoints every
    step; its save of step 2 is then left as a killed one leaves it (``step_2.tmp``). The same command again
    continues from step 1's checkpoint, computes step 2 exactly as the first run did, and does not evaluate
    step 0 again."""
    import os

    from miles.bench.e2e import compose
    from miles.core.run import run_job

    ck = tmp_path / "ck"
    command = ["algo=ppo", "seed=1", "tracking=none", "task.num_eval_prompts=8", "algo.num_prompts_per_step=4",
               "warm_start.steps=20", f"warm_start.cache_dir={tmp_path / 'cache'}", "trainer.num_steps=2",
               "trainer.eval_every=0", "trainer.save_every=1", f"trainer.save_dir={ck}", "trainer.resume_from=auto"]

    def job() -> dict[int, dict]:
        run, resolved = compose(command)
        seen: dict[int, dict] = {}
        run_job(run, resolved_yaml=resolved, overrides=[],
                on_metrics=lambda m, s: seen.setdefault(s, {}).update(m))
        return seen

    full = job()
    assert sorted(full) == [0, 1, 2]
    assert [s for s, _ in checkpoints.checkpoints(ck)] == [1, 2]
    assert (checkpoints.step_dir(ck, 1) / "critic" / "model.safetensors").is_file()
    fingerprint = checkpoints.load(ck).fingerprint
    assert fingerprint is not None and fingerprint["model.num_hidden_layers"] == 2
    os.replace(checkpoints.step_dir(ck, 2), ck / "step_000002.tmp")  # killed before step 2's rename
    resumed = job()
    assert sorted(resumed) == [2]
    assert [s for s, _ in checkpoints.checkpoints(ck)] == [1, 2] and not (ck / "step_000002.tmp").exists()
    for key in ("train/reward_mean", "train/loss", "train/grad_norm", "train/lr", "rollout/response_len_mean",
                "critic/value_loss", "critic/value_mean", "critic/grad_norm", "critic/lr", "eval/accuracy"):
        assert resumed[2][key] == full[2][key], key


@pytest.mark.slow
def test_the_same_command_continues_a_run_whose_driver_was_killed(tmp_path: Path) -> None:
    """``python -m miles ... trainer.resume_from=auto``, its driver (and the Ray cluster it started) SIGKILLed
    once step 1's checkpoint is there, wherever step 2 then stands; the same command again runs step 2 from it."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    ck = tmp_path / "ck"
    command = [sys.executable, "-m", "miles", "tracking=none", "task.num_eval_prompts=8",
               "algo.num_prompts_per_step=4", "warm_start.steps=20", f"warm_start.cache_dir={tmp_path / 'cache'}",
               "trainer.num_steps=2", "trainer.eval_every=0", "trainer.save_every=1", f"trainer.save_dir={ck}",
               "trainer.resume_from=auto", f"hydra.run.dir={tmp_path / 'out'}", "cluster.num_cpus=2"]
    env = os.environ | {"RAY_ADDRESS": ""}  # a cluster of its own, never the test session's
    first = subprocess.Popen(command, start_new_session=True, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not checkpoints.step_dir(ck, 1).is_dir() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.poll() is None, "the first run ended before it was killed"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # its session: the driver and every process it started
        first.wait()
    try:
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    finally:  # Ray's workers of the killed run leave once their raylet is gone; any left are ours to end
        for pid in subprocess.run(["ps", "-o", "pid=", "-s", str(first.pid)], capture_output=True,
                                  text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-3000:]
    assert f"trainer.resume_from=auto: resuming from {checkpoints.step_dir(ck, 1)}" in log
    assert "continuing at step 2" in log and "step 0: eval/accuracy" not in log
    assert [s for s, _ in checkpoints.checkpoints(ck)] == [1, 2]


def test_a_checkpoints_policy_exports_as_an_hf_directory(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """``export_policy``: the trained weights in the base checkpoint's config, loadable by transformers (and so
    as ``model.path`` or a teacher); a file that does not match the manifest, an existing target and a LoRA
    run's checkpoint are refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.train.optim import write_train_state

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    trained = {k: v + 0.01 * (i + 1) for i, (k, v) in enumerate(base.state_dict().items())}
    d = checkpoints.step_dir(tmp_path / "run", 3)
    d.mkdir(parents=True)
    write_train_state(d / "trainer", model_state=trained, optimizer_tensors={}, param_groups=[], scheduler_state={},
                      world_size=1)
    (d / "loop_state.json").write_text(json.dumps(
        {"format": checkpoints.FORMAT, "step": 3, "next_group_id": 12, "rng_state": [3, [1, 2, 3], None]}))
    manifest.write(d)
    out = resume.export_policy(tmp_path / "run", tiny_qwen3_dir, tmp_path / "hf")  # the save dir: its newest step
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 96
    with pytest.raises(ValueError, match="exists; export into a new directory"):
        resume.export_policy(d, tiny_qwen3_dir, out)
    (d / "trainer" / "adapters").mkdir()
    manifest.write(d)
    with pytest.raises(ValueError, match="a LoRA run's checkpoint; its adapters are in"):
        resume.export_policy(d, tiny_qwen3_dir, tmp_path / "hf2")
    (d / "trainer" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(ValueError, match="model.safetensors"):
        resume.export_policy(d, tiny_qwen3_dir, tmp_path / "hf3")
