"""Config composition, validation, override pre-checks and the `_target_` allowlist."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from miles.config import ConfigError, MilesConfig, TargetConfig, build, check_overrides, validate
from miles.config.schema import GROUP_SCHEMAS, to_yaml_dict
from miles.config.validate import group_options


def compose_cfg(overrides: list[str] | None = None):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return compose("config", overrides=overrides or [])


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUP_SCHEMAS for o in group_options(g)]
)
def test_every_shipped_option_composes_and_validates(group: str, option: str) -> None:
    extra = ["placement=disaggregated"] if group == "schedule" and option != "sync" else []  # async needs it
    if (group, option) == ("algo", "opd"):  # on-policy distillation needs its teacher
        extra = ["teacher.model={_target_: miles.models.qwen3.qwen3_spec, flavor: 20m, path: null}"]
    run = validate(compose_cfg([f"{group}={option}", *extra]))
    assert isinstance(run, MilesConfig)
    node = getattr(run, group)
    assert isinstance(node, GROUP_SCHEMAS[group])


def test_every_group_has_an_option_and_a_documented_yaml() -> None:
    for group in GROUP_SCHEMAS:
        options = group_options(group)
        assert options, group
        for o in options:
            text = (Path(__import__("miles.conf").conf.__path__[0]) / group / f"{o}.yaml").read_text()
            assert text.lstrip().startswith("#"), f"{group}/{o}.yaml should open with a comment saying what it is"


def test_product_card_combination_validates() -> None:
    run = validate(compose_cfg(["model=qwen3_moe", "algo=grpo", "precision=fp8"]))
    assert run.model.target.endswith("qwen3_moe_spec")
    assert run.precision.rollout_quant == "fp8_block" and run.precision.train_dtype == "bfloat16"
    assert run.precision.tis_clip is not None  # TIS is on for the fp8 recipe


def test_schema_defaults_match_the_shipped_default_config() -> None:
    """The dataclass defaults and the default YAMLs describe the same run (no drift between them)."""
    assert validate(compose_cfg()) == MilesConfig()


def test_validated_config_is_frozen_and_picklable() -> None:
    run = validate(compose_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(run)) == run


def test_yaml_round_trip() -> None:
    run = validate(compose_cfg(["precision=fp8"]))
    assert validate(to_yaml_dict(dataclasses.asdict(run))) == run


# --- mistakes fail with the key, a suggestion and the valid options --------------------------

def test_mistyped_group_option() -> None:
    with pytest.raises(ConfigError) as e:
        check_overrides(["placement=colocat"])
    msg = str(e.value)
    assert "placement=colocat" in msg and "did you mean 'colocate'" in msg and "Valid options: colocate" in msg


def test_mistyped_option_inside_a_sweep() -> None:
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        check_overrides(["precision=fp32,bf61"])


def test_mistyped_key_on_command_line() -> None:
    with pytest.raises(ConfigError) as e:
        check_overrides(["algo.clip_hgh=0.3"])
    msg = str(e.value)
    assert "'algo.clip_hgh'" in msg and "did you mean 'clip_high'" in msg and "clip_low" in msg


def test_valid_overrides_pass_the_precheck() -> None:
    check_overrides(["algo.clip_high=0.3", "model=qwen3_moe", "seed=0,1", "+foo=1", "hydra.verbose=true",
                     "algo.advantage.normalize_std=false", "algo.advantage._target_=x.y", "--cfg", "job"])


def test_mistyped_key_in_yaml_is_caught_by_validate() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.clip_hgh' \(did you mean 'clip_high'\?\)"):
        validate({"algo": {"clip_hgh": 0.3}})


def test_bad_literal_value_lists_valid_options() -> None:
    with pytest.raises(ConfigError) as e:
        validate({"precision": {"rollout_quant": "fp8_blok"}})
    msg = str(e.value)
    assert "precision.rollout_quant" in msg and "did you mean 'fp8_block'" in msg and "none" in msg


def test_wrong_types_are_named() -> None:
    with pytest.raises(ConfigError, match="trainer.num_steps: expected an integer, found 'many'"):
        validate({"trainer": {"num_steps": "many"}})
    with pytest.raises(ConfigError, match="trainer.betas: expected a list of 2 values"):
        validate({"trainer": {"betas": [0.9]}})


def test_impossible_combinations() -> None:
    with pytest.raises(ConfigError, match="must divide evenly"):
        validate({"algo": {"num_prompts_per_step": 3, "num_samples_per_prompt": 3}, "placement": {"trainer_world_size": 2}})
    with pytest.raises(ConfigError, match="model.path: no config.json"):
        validate({"model": {"path": "/nonexistent/checkpoint"}})


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
def test_async_schedule_refuses_colocated_placement_and_says_what_to_use(schedule: str) -> None:
    with pytest.raises(ConfigError, match=f"schedule={schedule} with placement=colocate.*Use placement=disaggregated"):
        validate(compose_cfg([f"schedule={schedule}"]))
    run = validate(compose_cfg([f"schedule={schedule}", "placement=disaggregated"]))
    assert run.schedule.name == schedule and run.schedule.max_staleness >= 1
    for bad, match in ((["schedule.max_staleness=0"], "max_staleness: must be at least 1"),
                       (["schedule.behaviour_is_clip=0.5"], "behaviour_is_clip: must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            validate(compose_cfg([f"schedule={schedule}", "placement=disaggregated", *bad]))
    # both built-in engines report each token's weight version (an engine class that does not is refused
    # by its contract check: tests/test_backends.py)
    from miles.core.plan import backends

    sglang = validate(compose_cfg([f"schedule={schedule}", "placement=disaggregated", "rollout=sglang"]))
    assert backends(sglang).engine.reports_token_versions
    # run checkpoints hold the async stream's open prompts (miles.core.schedules)
    saving = ["trainer.save_every=2", "trainer.save_dir=/tmp/x"]
    assert validate(compose_cfg([f"schedule={schedule}", "placement=disaggregated", *saving])).trainer.save_every == 2


def test_sync_is_the_default_schedule() -> None:
    assert validate(compose_cfg()).schedule.name == "sync" == MilesConfig().schedule.name


def test_cli_fails_fast_on_typos_before_ray() -> None:
    for argv, expect in ((["placement=colocat"], "did you mean 'colocate'"),
                         (["algo.clip_hgh=0.3"], "did you mean 'clip_high'"),
                         (["precision.rollout_quant=fp9"], "Valid options")):
        p = subprocess.run([sys.executable, "-m", "miles", *argv], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        assert expect in p.stderr + p.stdout
        assert "ray" not in (p.stderr + p.stdout).lower().replace("array", "")


def test_cfg_job_prints_resolved_config() -> None:
    p = subprocess.run([sys.executable, "-m", "miles", "--cfg", "job", "precision=fp8"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "rollout_quant: fp8_block" in p.stdout and "num_samples_per_prompt: 8" in p.stdout


# --- the allowlist -------------------------------------------------------------------------

def test_disallowed_target_is_refused_without_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'evil_mod.f' is not allowed"):
        build(TargetConfig(target="evil_mod.f"))
    assert not marker.exists() and "evil_mod" not in sys.modules
    with pytest.raises(ConfigError, match="'os.system' is not allowed"):
        build(TargetConfig(target="os.system", kwargs={"command": "touch /tmp/miles_pwned"}))
    # a prefix must match whole module names: 'evil_mod' does not allow 'evil_mod_two'
    with pytest.raises(ConfigError):
        build(TargetConfig(target="evil_mod_two.f"), allow=("evil_mod",))
    assert build(TargetConfig(target="evil_mod.f"), allow=("evil_mod.",)) == 1
    assert marker.exists()


def test_nested_targets_are_checked_too() -> None:
    node = TargetConfig(target="miles.config.schema.TargetConfig",
                        kwargs={"target": "x", "kwargs": {"_target_": "subprocess.call"}})
    with pytest.raises(ConfigError, match="'subprocess.call' is not allowed"):
        build(node)


def test_build_checks_kwargs_and_runtime_shadowing() -> None:
    node = TargetConfig(target="miles.algos.logprobs.token_logprobs", partial=True, kwargs={"temperatur": 2.0})
    with pytest.raises(ConfigError, match="did you mean 'temperature'"):
        build(node)
    ok = TargetConfig(target="miles.algos.logprobs.token_logprobs", partial=True, kwargs={"temperature": 2.0})
    with pytest.raises(ConfigError, match="shadow"):
        build(ok, temperature=1.0)
    assert build(ok).keywords == {"temperature": 2.0}


def test_torch_optim_is_allowed() -> None:
    import torch

    opt = build(TargetConfig(target="torch.optim.SGD", kwargs={"lr": 0.1}), params=[torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(opt, torch.optim.SGD)


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_baselines_refuse_one_sample_per_prompt_before_anything_runs(algo: str) -> None:
    from miles.core.run import build_components

    run = validate(compose_cfg([f"algo={algo}", "algo.num_samples_per_prompt=1"]))
    with pytest.raises(ConfigError, match=r"algo.advantage: .*needs at least 2 samples per group, found 1"):
        build_components(run)


@pytest.mark.parametrize("preset", group_options("experiment"))
def test_every_experiment_preset_composes_and_validates(preset: str) -> None:
    run = validate(compose_cfg([f"experiment={preset}"]))
    assert run.preset == preset
    if preset == "moe_fp8":  # the product card's combination
        assert run.model.target.endswith("qwen3_moe_spec") and run.precision.rollout_quant == "fp8_block"
    if preset == "none":  # the groups' own defaults: settings for a real checkpoint, not the tiny model's
        assert run.trainer.lr == 1e-6 and run.rollout.max_new_tokens == 1024
    if preset == "smollm2_grpo":
        assert run.model.target.endswith("smollm2_spec") and run.trainer.lr == 5e-6
        assert run.task.reward.target == "miles.rewards.gym.gym_math_verify_reward"


def test_the_tiny_preset_refuses_a_real_checkpoint(tiny_qwen3_dir: Path) -> None:
    from miles.config import ConfigError
    from miles.core.run import build_components

    run = validate(compose_cfg(["model=hf", f"model.path={tiny_qwen3_dir}"]))
    with pytest.raises(ConfigError, match=r"is a real checkpoint, but experiment=tiny \(the default\) holds the tiny "
                                          r"model's settings .* Add experiment=none"):
        build_components(run)
