"""Backends behind Protocols: the built-in engine and trainer meet their contracts, broken ones are
rejected with the promise they break, and a user's own classes plug in by ``_target_``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_ranks import free_port, hf_model_from, rl_batch

from miles.backends.contract import (
    BackendContractError,
    check_engine,
    check_engine_class,
    check_trainer,
    check_trainer_class,
)
from miles.config import ConfigError, RankConfig
from miles.config.schema import PrecisionConfig
from miles.config.validate import validate
from miles.core.plan import backends
from miles.rollout.torch_engine import TorchEngine
from miles.train.fsdp import FSDPTrainer


@pytest.fixture(scope="module")
def hf_state_dict(tiny_qwen3_dir: Path) -> dict[str, torch.Tensor]:
    return dict(hf_model_from(tiny_qwen3_dir).state_dict())


def _engine(cls: type, ckpt: Path, **kw) -> TorchEngine:
    return cls(str(ckpt), PrecisionConfig(), num_threads=1, max_batch_size=8, **kw)


def test_torch_engine_meets_the_engine_contract(tiny_qwen3_dir: Path, hf_state_dict) -> None:
    engine = _engine(TorchEngine, tiny_qwen3_dir)
    try:
        check_engine(engine, hf_state_dict)
    finally:
        engine.close()


@pytest.mark.parametrize("cls,promise", [
    ("NoPause", "generate\\(\\) finished while the engine was paused"),
    ("IgnoresWeights", "update_weights\\(\\) with perturbed weights left greedy tokens and log-probs unchanged"),
])
def test_a_broken_engine_fails_its_contract_naming_the_promise(tiny_qwen3_dir: Path, hf_state_dict, cls: str,
                                                               promise: str) -> None:
    import plugin_backends

    engine = _engine(getattr(plugin_backends, cls), tiny_qwen3_dir)
    try:
        with pytest.raises(BackendContractError, match=f"{cls}: {promise}"):
            check_engine(engine, hf_state_dict)
    finally:
        engine.close()


def _trainer(cls: type, ckpt: Path, **run) -> FSDPTrainer:
    cfg = validate({"trainer": {"lr": 1e-3, "lr_warmup_steps": 0}, "algo": {"num_minibatches": 2}, **run})
    return cls(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), checkpoint_dir=str(ckpt),
               config=RankConfig.of(cfg), num_threads=1)


def test_fsdp_trainer_meets_the_trainer_contract(tiny_qwen3_dir: Path, hf_state_dict) -> None:
    trainer = _trainer(FSDPTrainer, tiny_qwen3_dir)
    try:
        check_trainer(trainer, rl_batch(hf_model_from(tiny_qwen3_dir)), hf_state_dict)
    finally:
        trainer.shutdown()


def test_a_trainer_that_does_not_restore_its_state_fails_its_contract(tiny_qwen3_dir: Path, hf_state_dict) -> None:
    from plugin_backends import ForgetfulTrainer

    trainer = _trainer(ForgetfulTrainer, tiny_qwen3_dir)
    try:
        with pytest.raises(BackendContractError, match="ForgetfulTrainer: load_state\\(\\) must restore the weights"):
            check_trainer(trainer, rl_batch(hf_model_from(tiny_qwen3_dir)), hf_state_dict)
    finally:
        trainer.shutdown()


def test_class_checks_say_what_a_backend_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import plugin_backends

    with pytest.raises(ConfigError, match=r"rollout.engine._target_: plugin_backends.NoGenerate is not a "
                                          r"RolloutEngine backend: it has no abort\(\), generate\(\), health\(\)"):
        check_engine_class(plugin_backends.NoGenerate)
    with pytest.raises(ConfigError, match="rollout.engine: seed is set by the driver for every engine"):
        check_engine_class(TorchEngine, kwargs={"seed": 3})
    with pytest.raises(ConfigError, match="rollout.engine: .*TorchEngine.__init__ takes no 'max_batch_sise'"):
        check_engine_class(TorchEngine, kwargs={"max_batch_sise": 3})
    with pytest.raises(ConfigError, match=r"trainer.tensor_parallel=2: miles.train.fsdp.FSDPTrainer does not "
                                          r"support tensor parallelism \(it supports none besides data parallel\)"):
        check_trainer_class(FSDPTrainer, validate({"trainer": {"tensor_parallel": 2}}))
    with pytest.raises(ConfigError, match=r"trainer._target_: .*TorchEngine is not a Trainer backend: it has no "
                                          r"compute_logprobs\(\)"):
        check_trainer_class(TorchEngine, validate({}))

    class WholeRunTrainer(FSDPTrainer):  # a rank constructed with the whole run config, not its own part
        def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int, checkpoint_dir: str,
                     run: object, num_threads: int = 0, device: str = "cpu") -> None: ...

    with pytest.raises(ConfigError, match=r"trainer._target_: .*WholeRunTrainer.__init__ takes no 'config', which "
                                          r"the driver passes every trainer rank"):
        check_trainer_class(WholeRunTrainer, validate({}))
    # an async schedule takes an engine class that reports each token's weight version (a subclass of the
    # torch engine inherits it), and refuses one that does not
    asynchronous = validate({"schedule": {"name": "fully_async", "max_staleness": 2},
                             "placement": {"name": "disaggregated"}})
    check_engine_class(plugin_backends.NoPause, run=asynchronous)

    class Unversioned(TorchEngine):
        reports_token_versions = False

    with pytest.raises(ConfigError, match="schedule=fully_async: the rollout engine .*Unversioned does not report"):
        check_engine_class(Unversioned, run=asynchronous)
    check_engine_class(Unversioned, run=validate({}))  # sync does not need it
    # adapter=lora takes an engine class that holds adapters (a subclass of the torch engine inherits it)
    lora = validate({"adapter": {"kind": "lora"}})
    check_engine_class(plugin_backends.NoPause, run=lora)

    class NoAdapters(TorchEngine):
        takes_adapter_updates = False

    with pytest.raises(ConfigError, match="adapter=lora: the rollout engine .*NoAdapters does not take adapter-only"):
        check_engine_class(NoAdapters, run=lora)


def test_backends_resolve_from_config_and_refuse_unlisted_targets_before_import() -> None:
    run = validate({"algo": {"estimator": "gae", "policy_loss": {"_target_": "miles.algos.losses.ppo_clip_loss",
                                                                 "_partial_": True}}})
    b = backends(run)
    assert (b.engine, b.trainer, b.critic.__name__) == (TorchEngine, FSDPTrainer, "FSDPCritic")
    assert b.engine_kwargs == {"max_batch_size": 256, "max_prefill_tokens": 8192, "prefix_cache_tokens": 65536}
    for key, over in [("rollout.engine._target_", {"rollout": {"engine": {"_target_": "os.system"}}}),
                      ("trainer._target_", {"trainer": {"_target_": "subprocess.Popen"}})]:
        with pytest.raises(ConfigError, match=f"{key}: '.*' is not allowed"):
            backends(validate(over))


@pytest.mark.slow
def test_a_users_engine_and_trainer_plug_in_by_target(ray_cluster, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.bench.e2e import compose
    from miles.core.run import run_job

    calls = tmp_path / "calls.txt"
    overrides = ["algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4", "trainer.num_steps=2",
                 "trainer.eval_every=0", "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=2",
                 "warm_start.steps=40", f"warm_start.cache_dir={tmp_path / 'cache'}", "tracking=none",
                 "plugins.allow=[plugin_backends.]", "rollout.engine._target_=plugin_backends.LoggingEngine",
                 f"+rollout.engine.calls_file={calls}", "trainer._target_=plugin_backends.CountingTrainer"]
    # the Ray workers import the user's module like an installed package; here, tests/ is not on their
    # path, so the module travels by value
    import plugin_backends
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(plugin_backends)
    run, resolved = compose(overrides)
    seen: dict[int, dict[str, float]] = {}
    try:
        run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.update({s: m}))
    finally:
        cloudpickle.unregister_pickle_by_value(plugin_backends)
    assert [seen[s]["train/plugin_steps"] for s in (1, 2)] == [1.0, 2.0]
    lines = calls.read_text().splitlines()
    assert lines and all(line.startswith("0 ") for line in lines)  # the user's engine served every rollout
