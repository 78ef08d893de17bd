"""``miles reproduce RUN_ID``: the config comes back from the run's artifacts alone, and the run again."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from miles.config import ConfigError, validate
from miles.config.schema import to_yaml_dict
from miles.reproduce import code_differences, load_source, rebuild
from miles.tracking.mlflow_tracker import MlflowTracker
from miles.tracking.snapshot import Launch, git_info


def _compose(overrides: list[str]):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the module (creating its tables takes seconds)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlruns.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def _log_config_only(uri: str, overrides: list[str], resolved: str | None = None) -> tuple[str, str]:
    """A run that logged its snapshot but trained nothing: (run id, tracking URI)."""
    cfg = _compose([*overrides, f"tracking.uri={uri}"])
    run = validate(cfg)
    run = dataclasses.replace(run, tracking=dataclasses.replace(run.tracking, plots=False))
    tracker = MlflowTracker(run, resolved_yaml=resolved or OmegaConf.to_yaml(cfg, resolve=True), overrides=overrides,
                            config_dict=to_yaml_dict(dataclasses.asdict(run)),
                            launch=Launch(composed_yaml=OmegaConf.to_yaml(cfg)))
    tracker.finish()
    return tracker.run_id, uri


def test_config_is_rebuilt_from_the_artifacts_alone(store: str) -> None:
    overrides = ["algo=gspo", "trainer.lr=0.00123", "seed=7", "rollout.max_new_tokens=9"]
    run_id, uri = _log_config_only(store, overrides)
    source = load_source(run_id, uri)
    assert source.overrides == overrides and source.composed_yaml
    run, resolved = rebuild(source, [])
    assert run == validate(_compose([*overrides, f"tracking.uri={uri}"]))
    assert run.trainer.lr == 0.00123 and run.algo.name == "gspo" and run.rollout.max_new_tokens == 9
    changed, _ = rebuild(source, ["trainer.num_steps=3"])
    assert changed.trainer.num_steps == 3 and dataclasses.replace(changed, trainer=run.trainer) == run
    with pytest.raises(ConfigError, match="not a key=value"):
        rebuild(source, ["trainer.num_steps"])


def test_redacted_secrets_must_be_given_again(store: str) -> None:
    import yaml

    container = OmegaConf.to_container(_compose([]), resolve=True)
    container["task"]["source"]["api_key"] = "sk-1"
    run_id, uri = _log_config_only(store, [], resolved=yaml.safe_dump(container))
    source = load_source(run_id, uri)
    assert source.config["task"]["source"]["api_key"] == "***"
    with pytest.raises(ConfigError, match=r"redacted secrets: task.source.api_key; pass them"):
        rebuild(source, [])


def test_unknown_run_is_a_clear_error(store: str) -> None:
    with pytest.raises(ConfigError, match="no MLflow run 'f00' at .*--tracking-uri"):
        load_source("f00", store)


def test_code_differences() -> None:
    import miles

    now = git_info()
    same = {"miles.version": miles.__version__, "miles.git_commit": now["git_commit"], "miles.git_dirty": "false"}
    expected_dirty = ["the current checkout had uncommitted changes"] if now["git_dirty"] == "true" else []
    assert code_differences(same) == expected_dirty
    other = code_differences({**same, "miles.git_commit": "0" * 40, "miles.version": "0.0.1"})
    assert other[:2] == [f"version 0.0.1 -> {miles.__version__}", f"git_commit {'0' * 40} -> {now['git_commit']}"]


@pytest.mark.slow
def test_reproduced_run_matches_the_original_exactly(tmp_path: Path) -> None:
    """Two CPU runs of a fixed seed: the reproduction's per-step metrics equal the original's bit for bit."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    args = ["trainer.num_steps=2", "trainer.eval_every=1", "warm_start.steps=20", f"warm_start.cache_dir={tmp_path / 'c'}",
            "task.num_eval_prompts=8", "algo.num_prompts_per_step=4", "cluster.num_cpus=2", "seed=1", f"tracking.uri={uri}"]

    def miles(*a: str) -> None:
        p = subprocess.run([sys.executable, "-m", *a], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-5000:]}"

    miles("miles", *args)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("miles").experiment_id
    (original,) = client.search_runs([exp])
    miles("miles.reproduce", original.info.run_id, "--tracking-uri", uri)
    runs = client.search_runs([exp], filter_string=f"tags.`miles.reproduced_from` = '{original.info.run_id}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    copy = runs[0]
    assert copy.data.params == original.data.params
    for key in ("train/reward_mean", "train/loss", "train/grad_norm", "eval/accuracy", "rollout/response_len_mean"):
        a = [(m.step, m.value) for m in client.get_metric_history(original.info.run_id, key)]
        b = [(m.step, m.value) for m in client.get_metric_history(copy.info.run_id, key)]
        assert a and a == b, f"{key}: {a} != {b}"
