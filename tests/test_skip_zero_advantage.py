"""Samples with no advantage stay out of the trainer's passes (``trainer.skip_zero_advantage``) and the
update is the one of the whole batch: same loss, gradients and weights, on one FSDP rank and on two."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_ranks import Group, hf_model_from, local_trainer, rl_batch

from miles.algos.losses import cispo_loss, ppo_clip_loss, sft_loss, vanishes_at_zero_advantage
from miles.config.validate import validate
from miles.train.batching import rows_with_gradient, topped_up
from miles.types import TrainBatch


@pytest.fixture(scope="module")
def batch(tiny_qwen3_dir: Path) -> TrainBatch:
    """12 samples: 4..7 with advantage 0 (a group whose rewards are all equal), 9 with an empty loss mask."""
    b = rl_batch(hf_model_from(tiny_qwen3_dir), n=12)
    adv = [0.0 if 4 <= i < 8 else a for i, a in enumerate(b.advantages)]
    assert all(a != 0 for i, a in enumerate(adv) if not 4 <= i < 8)
    mask = [[0] * len(m) if i == 9 else m for i, m in enumerate(b.loss_mask)]
    return dataclasses.replace(b, advantages=adv, loss_mask=mask)


def _run(skip: bool, **algo: Any) -> Any:
    return validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "skip_zero_advantage": skip,
                                 "max_tokens_per_microbatch": 24}, "algo": algo})


def test_rows_with_gradient_and_the_top_up(batch: TrainBatch) -> None:
    assert rows_with_gradient(batch) == [0, 1, 2, 3, 8, 10, 11]
    per_token = dataclasses.replace(batch, token_advantages=[[0.0] * len(r) for r in batch.response_ids])
    per_token.token_advantages[5][-1] = 0.5  # one token of a zero-advantage sample
    assert rows_with_gradient(per_token) == [5]
    none = dataclasses.replace(batch, advantages=[0.0] * len(batch))
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    shortest = min(range(len(batch)), key=lambda i: lengths[i])
    assert rows_with_gradient(none) == [shortest]  # a pass still runs
    # topped up with the shortest others, in batch order
    grown = topped_up(batch, [10, 11], 4)
    assert len(grown) == 4 and grown == sorted(grown) and {10, 11} < set(grown)
    assert all(lengths[i] <= min(lengths[j] for j in set(range(12)) - set(grown)) for i in set(grown) - {10, 11})
    assert topped_up(batch, [1, 2, 3], 2) == [1, 2, 3]


def test_only_losses_known_to_vanish_let_samples_be_skipped() -> None:
    import functools

    assert vanishes_at_zero_advantage(functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.2))
    assert vanishes_at_zero_advantage(cispo_loss)
    assert not vanishes_at_zero_advantage(sft_loss)  # its metric counts the zero-weight samples
    assert not vanishes_at_zero_advantage(lambda *a, **k: None)  # a loss of one's own


def _two_steps(ckpt: Path, run: Any, batch: TrainBatch) -> tuple[list[dict[str, float]], dict, dict]:
    """Gradients of ``batch``, then train_step on it and on an all-zero-advantage batch: (metrics, grads, weights)."""
    zero = dataclasses.replace(batch, advantages=[0.0] * len(batch))
    with local_trainer(ckpt, run) as trainer:
        grads = trainer.compute_gradients(batch)
        metrics = [trainer.train_step(batch), trainer.train_step(zero)]
        return metrics, grads, trainer.full_state_dict()


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_skipping_leaves_loss_gradients_and_weights_unchanged(tiny_qwen3_dir: Path, batch: TrainBatch,
                                                              num_minibatches: int) -> None:
    (on1, on2), g_on, w_on = _two_steps(tiny_qwen3_dir, _run(True, num_minibatches=num_minibatches), batch)
    (off1, off2), g_off, w_off = _two_steps(tiny_qwen3_dir, _run(False, num_minibatches=num_minibatches), batch)
    for k in g_off:
        torch.testing.assert_close(g_on[k], g_off[k], atol=1e-7, rtol=1e-5, msg=k)
    for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/num_tokens"):
        assert on1[k] == pytest.approx(off1[k], rel=1e-5, abs=1e-7), k
    assert off1["train/skipped_samples"] == 0 and on1["train/skipped_samples"] == 5
    assert on1["perf/train_forward_tokens"] < off1["perf/train_forward_tokens"]
    # an all-zero batch: one sample per mini-batch still runs, and AdamW's momentum moves the weights
    # exactly as it does after a full pass of zero gradients
    assert on2["train/skipped_samples"] == 12 - num_minibatches
    moved = max((w_on[k] - w_off[k]).abs().max().item() for k in w_off)
    assert moved < 3e-5  # Adam's first update is ~lr * sign(g) on entries that are ~0 up to summation order
    with local_trainer(tiny_qwen3_dir, _run(True, num_minibatches=num_minibatches)) as fresh:
        start = fresh.full_state_dict()
    assert max((w_on[k] - start[k]).abs().max().item() for k in start) > 1e-4


def test_no_skipping_when_the_samples_count_in_the_loss(tiny_qwen3_dir: Path, batch: TrainBatch) -> None:
    """An entropy term (or a KL term) gives zero-advantage samples a gradient: nothing is skipped."""
    with local_trainer(tiny_qwen3_dir, _run(True, entropy_coef=0.01)) as trainer:
        assert not trainer.skip_zero_advantage
        assert trainer.train_step(batch)["train/skipped_samples"] == 0


def test_two_ranks_top_up_and_equal_one_rank(ray_cluster, tiny_qwen3_dir: Path, batch: TrainBatch) -> None:
    """Rank 1's half holds every zero-advantage sample: it runs as many micro-batches as rank 0, topped up
    with skipped samples, and the update is the one rank's without skipping."""
    half = dataclasses.replace(batch, advantages=[0.0 if i >= 6 else a for i, a in enumerate(batch.advantages)])
    one = Group(ray_cluster, 1, tiny_qwen3_dir, _run(False))
    two = Group(ray_cluster, 2, tiny_qwen3_dir, _run(True))
    try:
        (m1,) = one.call("train_step", half)
        m2, _ = two.call("train_step", half)
        for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/num_tokens"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
        assert m2["train/skipped_samples"] > 0 and m2["train/num_microbatches"] >= 2
        (w1,) = one.call("full_state_dict")
        w2, _ = two.call("full_state_dict")
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], atol=3e-5, rtol=0, msg=k)
    finally:
        one.close()
        two.close()


def test_per_token_metrics_are_means_over_the_samples_computed(tiny_qwen3_dir: Path, batch: TrainBatch) -> None:
    """With the skip, entropy, clip fractions and the log-prob mismatch are those of the samples with a
    gradient alone (a step on just them, without the skip), not diluted by the skipped samples' tokens."""
    kept = rows_with_gradient(batch)
    assert len(kept) < len(batch)
    with local_trainer(tiny_qwen3_dir, _run(True)) as trainer:
        on = trainer.train_step(batch)
    with local_trainer(tiny_qwen3_dir, _run(False)) as trainer:
        alone = trainer.train_step(batch.select(kept))
    for k in ("train/entropy", "train/logp_mismatch_abs_mean", "train/clip_frac_low", "train/clip_frac_high"):
        assert on[k] == pytest.approx(alone[k], rel=1e-5, abs=1e-7), k
    assert on["train/entropy"] > 0
