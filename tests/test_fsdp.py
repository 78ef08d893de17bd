"""FSDP2 trainer ranks as Ray actors on gloo: world size 2 computes what world size 1 computes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from fsdp_ranks import Group, hf_model_from, rl_batch

from miles.config.validate import validate


def _shared(metrics: dict[str, float]) -> dict[str, float]:
    """A rank's train-step metrics without its own process memory (``mem/trainer<rank>/*``)."""
    return {k: v for k, v in metrics.items() if not k.startswith("mem/")}


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir: Path) -> torch.nn.Module:
    return hf_model_from(tiny_qwen3_dir)


def test_two_ranks_equal_one_rank(ray_cluster, tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    # every loss term on, two optimizer steps per batch (the second has ratios != 1), per-sequence mean.
    # lr 1e-4: Adam's first update is lr * g / (|g| + eps), about lr * sign(g), so a gradient entry
    # that is ~0 up to summation-order noise can differ by up to ~lr between world sizes (seen:
    # 1.9e-5 on one of 8192 entries at lr 1e-3). Gradient scale is checked through train/grad_norm.
    run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0}, "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "num_minibatches": 2, "clip_high": 0.28,
                             "loss_agg": "seq_mean_token_mean"},
                    "precision": {"tis_clip": 2.0}})
    batch = rl_batch(hf_model)
    # world size 2 also splits each rank's mini-batch into micro-batches of at most 12 padded tokens
    run2 = dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, max_tokens_per_microbatch=12))
    one, two = Group(ray_cluster, 1, tiny_qwen3_dir, run), Group(ray_cluster, 2, tiny_qwen3_dir, run2)
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
        assert _shared(m2a) == _shared(m2b), "every rank must return the same metrics"
        assert m2a["mem/trainer0/rss_bytes"] > 0 and m2b["mem/trainer1/rss_bytes"] > 0  # each rank's own
        for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/entropy",
                  "train/clip_frac_low", "train/clip_frac_high", "train/tis_clip_frac", "train/num_tokens"):
            assert m2a[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
        assert m1["train/num_tokens"] == sum(map(sum, batch.loss_mask))
        assert m1["train/logp_mismatch_abs_mean"] < 1e-5  # fp32 trainer vs fp32 HF "rollout"
        assert m1["train/nonfinite_skipped"] == 0 and m1["perf/train_tokens_per_s"] > 0
        assert m1["train/num_microbatches"] == 2 and m2a["train/num_microbatches"] > 2
        assert m1["train/kl"] > 0  # the second mini-batch moved away from the reference

        (sd1,) = one.call("full_state_dict")
        sd2, _ = two.call("full_state_dict")
        moved = max((sd1[k] - hf_sd[k]).abs().max().item() for k in hf_sd)
        assert moved > 5e-5, "the train step did not change the weights"
        for k in hf_sd:
            torch.testing.assert_close(sd2[k], sd1[k], atol=1e-5, rtol=0, msg=k)
        assert list(sd1) == list(hf_sd)
    finally:
        one.close()
        two.close()


def test_bf16_train_step(ray_cluster, tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    run = validate({"precision": {"train_dtype": "bfloat16", "tis_clip": 2.0}, "trainer": {"lr": 1e-3, "lr_warmup_steps": 0}})
    batch = rl_batch(hf_model)
    two = Group(ray_cluster, 2, tiny_qwen3_dir, run)
    try:
        ma, mb = two.call("train_step", batch)
        assert _shared(ma) == _shared(mb)
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
