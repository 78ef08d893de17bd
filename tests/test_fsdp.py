"""FSDP2 trainer ranks as Ray actors on gloo: world size 2 computes what world size 1 computes."""

from __future__ import annotations

import dataclasses
import math
import socket
from pathlib import Path

import pytest
import torch

from miles.algos.advantages import group_normalized
from miles.algos.logprobs import token_logprobs
from miles.config.schema import MilesConfig
from miles.config.validate import validate
from miles.core.types import TrainBatch
from miles.train.fsdp import FSDPTrainer

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_model(ckpt: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """Plain HF forward, one sequence at a time (no padding involved)."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
        out.append(token_logprobs(logits, torch.tensor(r)).tolist())
    return out


def _batch(model: torch.nn.Module, n: int = 8) -> TrainBatch:
    """n samples of varied lengths; rollout log-probs are the fp32 HF ones (so mismatch is ~0 in fp32)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (3 + i % 4,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(3, 96, (2 + (3 * i) % 5,), generator=g).tolist() for i in range(n)]
    loss_mask = [[0 if (i % 3 == 0 and j == 1) else 1 for j in range(len(r))] for i, r in enumerate(responses)]
    rewards = torch.tensor([float(i % 3 == 0) for i in range(n)]).view(2, n // 2)
    return TrainBatch(prompt_ids=prompts, response_ids=responses,
                      rollout_logprobs=_hf_logprobs(model, prompts, responses), loss_mask=loss_mask,
                      advantages=group_normalized(rewards).flatten().tolist())


class _Group:
    """``world_size`` trainer actors forming one gloo group."""

    def __init__(self, ray, world_size: int, ckpt: Path, run: MilesConfig) -> None:
        self.ray = ray
        actor_cls = ray.remote(num_cpus=0.5)(FSDPTrainer)
        port = _free_port()
        self.actors = [actor_cls.remote(rank=r, world_size=world_size, master_addr="127.0.0.1", master_port=port,
                                        checkpoint_dir=str(ckpt), run=run, num_threads=1)
                       for r in range(world_size)]

    def call(self, method: str, *args):
        return self.ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=TIMEOUT_S)

    def close(self) -> None:
        try:
            self.call("shutdown")
        finally:
            for a in self.actors:
                self.ray.kill(a)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir: Path) -> torch.nn.Module:
    return _hf_model(tiny_qwen3_dir)


def test_two_ranks_equal_one_rank(ray_cluster, tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    # every loss term on, two optimizer steps per batch (the second has ratios != 1), per-sequence mean.
    # lr 1e-4: Adam's first update is lr * g / (|g| + eps), about lr * sign(g), so a gradient entry
    # that is ~0 up to summation-order noise can differ by up to ~lr between world sizes (seen:
    # 1.9e-5 on one of 8192 entries at lr 1e-3). Gradient scale is checked through train/grad_norm.
    run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0}, "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "num_minibatches": 2, "clip_high": 0.28,
                             "loss_agg": "seq_mean_token_mean"},
                    "precision": {"tis_clip": 2.0}})
    batch = _batch(hf_model)
    one, two = _Group(ray_cluster, 1, tiny_qwen3_dir, run), _Group(ray_cluster, 2, tiny_qwen3_dir, run)
    try:
        # log-probs under the initial weights equal a plain HF forward, on every rank
        for lp in one.call("compute_logprobs", batch) + two.call("compute_logprobs", batch):
            assert [len(x) for x in lp] == [len(x) for x in batch.response_ids]
            for got, want in zip(lp, batch.rollout_logprobs, strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)

        sd0, none = two.call("full_state_dict")
        assert none is None
        hf_sd = hf_model.state_dict()
        assert list(sd0) == list(hf_sd)
        for k, v in hf_sd.items():
            assert sd0[k].dtype == torch.float32 and sd0[k].device.type == "cpu"
            torch.testing.assert_close(sd0[k], v, atol=0, rtol=0, msg=k)

        (m1,) = one.call("train_step", batch)
        m2a, m2b = two.call("train_step", batch)
        assert m2a == m2b, "every rank must return the same metrics"
        for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/entropy",
                  "train/clip_frac_low", "train/clip_frac_high", "train/tis_clip_frac", "train/num_tokens"):
            assert m2a[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
        assert m1["train/num_tokens"] == sum(map(sum, batch.loss_mask))
        assert m1["train/logp_mismatch_abs_mean"] < 1e-5  # fp32 trainer vs fp32 HF "rollout"
        assert m1["train/nonfinite_skipped"] == 0 and m1["perf/train_tokens_per_s"] > 0
        assert m1["train/kl"] > 0  # the second mini-batch moved away from the reference

        (sd1,) = one.call("full_state_dict")
        sd2, _ = two.call("full_state_dict")
        moved = max((sd1[k] - hf_sd[k]).abs().max().item() for k in hf_sd)
        assert moved > 5e-5, "the train step did not change the weights"
        for k in hf_sd:
            torch.testing.assert_close(sd2[k], sd1[k], atol=1e-5, rtol=0, msg=k)

        ref, none = two.call("publish_weights")
        assert none is None and isinstance(ref, list) and len(ref) == 1
        published = ray_cluster.get(ref[0], timeout=TIMEOUT_S)
        assert list(published) == list(hf_sd)
        torch.testing.assert_close(published["lm_head.weight"], sd2["lm_head.weight"], atol=0, rtol=0)
    finally:
        one.close()
        two.close()


def test_bf16_train_step(ray_cluster, tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    run = validate({"precision": {"train_dtype": "bfloat16", "tis_clip": 2.0}, "trainer": {"lr": 1e-3, "lr_warmup_steps": 0}})
    batch = _batch(hf_model)
    two = _Group(ray_cluster, 2, tiny_qwen3_dir, run)
    try:
        ma, mb = two.call("train_step", batch)
        assert ma == mb
        assert all(math.isfinite(v) for v in ma.values()), ma
        assert ma["train/nonfinite_skipped"] == 0
        # bf16 compute vs the fp32 rollout log-probs: a visible but small mismatch
        assert 1e-4 < ma["train/logp_mismatch_abs_mean"] < 0.1, ma["train/logp_mismatch_abs_mean"]
        assert "train/kl" not in ma
        sd, _ = two.call("full_state_dict")
        assert all(v.dtype == torch.float32 for v in sd.values()), "master weights must stay fp32"
        hf_sd = hf_model.state_dict()
        assert max((sd[k] - hf_sd[k]).abs().max().item() for k in hf_sd) > 1e-4

        # a NaN advantage makes the loss non-finite: the update is skipped and counted, weights stay
        bad = dataclasses.replace(batch, advantages=[math.nan] + batch.advantages[1:])
        ma, mb = two.call("train_step", bad)
        assert ma["train/nonfinite_skipped"] == mb["train/nonfinite_skipped"] == 1
        after, _ = two.call("full_state_dict")
        for k in sd:
            torch.testing.assert_close(after[k], sd[k], atol=0, rtol=0, msg=k)
    finally:
        two.close()
