"""Trainer and engine actors together: weight sync through every transport, and log-prob agreement."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import torch

from miles.config import RankConfig, validate
from miles.config.schema import WeightSyncConfig
from miles.rollout.torch_engine import TorchEngine
from miles.train.fsdp import FSDPTrainer
from miles.types import GenerateRequest, SamplingParams, TrainBatch
from miles.weights import sync as transports
from miles.weights.sync import sync_weights

ACTOR = dict(num_cpus=0.5, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})


def _free_port() -> int:
    from miles.machine import free_port

    return free_port()


def _pair(ckpt: str, precision: str, lr: float = 1e-3, trainer_cls: type = FSDPTrainer):
    run = validate({"precision": _precision(precision), "trainer": {"lr": lr, "lr_warmup_steps": 0}, "rollout": {"max_new_tokens": 6}})
    engine = ray.remote(TorchEngine).options(**ACTOR).remote(ckpt, run.precision, seed=0, num_threads=1)
    trainer = ray.remote(trainer_cls).options(**ACTOR).remote(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port(), checkpoint_dir=ckpt,
        config=RankConfig.of(run), num_threads=1,
    )
    return run, engine, trainer


def _precision(name: str) -> dict:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("miles.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=[f"precision={name}"]).precision)


def _rollout(engine, n_prompts: int = 6, n: int = 4) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    reqs = [GenerateRequest(request_id=str(i), prompt_ids=tuple(torch.randint(3, 90, (3 + i,), generator=g).tolist()),
                            n=n, seed=i) for i in range(n_prompts)]
    results = ray.get(engine.generate.remote(reqs, SamplingParams(temperature=1.0, max_new_tokens=6)))
    prompts = {r.request_id: list(r.prompt_ids) for r in reqs}
    return TrainBatch(
        prompt_ids=[prompts[r.request_id] for r in results], response_ids=[list(r.response_ids) for r in results],
        rollout_logprobs=[list(r.logprobs) for r in results], loss_mask=[[1] * len(r.response_ids) for r in results],
        advantages=[float(i % 3 - 1) for i in range(len(results))],
    )


def _mean_abs_mismatch(batch: TrainBatch, trainer_logps: list[list[float]]) -> float:
    diffs = [abs(a - b) for ro, tr in zip(batch.rollout_logprobs, trainer_logps, strict=True)
             for a, b in zip(ro, tr, strict=True)]
    return sum(diffs) / len(diffs)


def test_sync_makes_engine_weights_bit_identical_and_logprobs_agree(ray_cluster, tiny_qwen3_dir) -> None:
    run, engine, trainer = _pair(str(tiny_qwen3_dir), "fp32")
    batch = _rollout(engine)
    # same weights, fp32: the engine's log-probs are the trainer's within 1e-5
    assert _mean_abs_mismatch(batch, ray.get(trainer.compute_logprobs.remote(batch))) < 1e-5
    metrics = ray.get(trainer.train_step.remote(batch))
    assert metrics["train/logp_mismatch_abs_mean"] < 1e-5

    before = ray.get(engine.state_dict.remote())
    sync = sync_weights([trainer], [engine], version=1)
    assert sync["weight_sync/seconds"] > 0 and sync["weight_sync/bytes"] > 0
    sent = ray.get(trainer.full_state_dict.remote())
    got = ray.get(engine.state_dict.remote())
    assert set(got) == set(sent)
    assert all(torch.equal(got[k], sent[k]) for k in sent), "engine weights must be bit-identical after sync"
    assert any(not torch.equal(before[k], got[k]) for k in got), "the train step should have changed weights"
    assert ray.get(engine.weight_version.remote()) == 1

    # the next rollout samples from the new weights, and the trainer agrees with it again
    batch2 = _rollout(engine)
    assert _mean_abs_mismatch(batch2, ray.get(trainer.compute_logprobs.remote(batch2))) < 1e-5
    ray.get(trainer.shutdown.remote())


def test_every_transport_syncs_trained_fsdp_weights_bit_identically(ray_cluster, tiny_qwen3_dir) -> None:
    run, engine, trainer = _pair(str(tiny_qwen3_dir), "fp32", trainer_cls=FSDPTrainer)
    batch = _rollout(engine)
    for version, name in enumerate(transports.CPU_TRANSPORTS, start=1):
        before = ray.get(engine.state_dict.remote())
        ray.get(trainer.train_step.remote(batch))  # new weights for every transport
        transport = transports.make_transport(WeightSyncConfig(transport=name, bucket_mb=1), [trainer], [engine])
        try:
            m = transports.sync_weights([trainer], [engine], version, transport)
        finally:
            transport.close()
        sent, got = ray.get(trainer.full_state_dict.remote()), ray.get(engine.state_dict.remote())
        assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent), name
        assert any(not torch.equal(before[k], got[k]) for k in got), name
        assert ray.get(engine.weight_version.remote()) == version == m["weight_sync/version"]
    batch2 = _rollout(engine)
    assert _mean_abs_mismatch(batch2, ray.get(trainer.compute_logprobs.remote(batch2))) < 1e-5
    ray.get(trainer.shutdown.remote())
    ray.kill(engine)
    ray.kill(trainer)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fp8_rollout_mismatch_exceeds_bf16(ray_cluster, tiny_qwen3_dir, tiny_qwen3_moe_dir, moe: bool) -> None:
    ckpt = str(tiny_qwen3_moe_dir if moe else tiny_qwen3_dir)
    mismatch = {}
    for name in ("bf16", "fp8"):
        run, engine, trainer = _pair(ckpt, name)
        batch = _rollout(engine)
        mismatch[name] = _mean_abs_mismatch(batch, ray.get(trainer.compute_logprobs.remote(batch)))
        m = ray.get(trainer.train_step.remote(batch))
        assert abs(m["train/logp_mismatch_abs_mean"] - mismatch[name]) < 1e-3
        if run.precision.tis_clip is not None:
            assert 0.0 <= m["train/tis_clip_frac"] <= 1.0
        ray.get(trainer.shutdown.remote())
        ray.kill(engine)
        ray.kill(trainer)
    # on CPU the engine and trainer run the same bf16 kernels, so bf16 agrees exactly; fp8 does not
    assert mismatch["fp8"] > max(mismatch["bf16"], 1e-4), mismatch


def test_fp8_recipe_turns_on_tis() -> None:
    run = validate({"precision": _precision("fp8")})
    assert run.precision.tis_clip and run.precision.rollout_quant == "fp8_block"
    assert dataclasses.replace(run.precision, tis_clip=None).tis_clip is None
