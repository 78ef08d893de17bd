"""Trainer depth: micro-batching, per-token advantages, LR schedules, activation checkpointing,
resumable state, and world sizes 1, 2 and 4 computing the same update."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch
from fsdp_ranks import Group, hf_model_from, local_trainer, rl_batch
from safetensors.torch import load_file

from miles.algos.microbatches import count_microbatches, split_microbatches
from miles.config.schema import MilesConfig
from miles.config.validate import validate
from miles.train.fsdp import checkpoint_activations
from miles.train.optim import lr_multiplier
from miles.types import TrainBatch


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir: Path) -> torch.nn.Module:
    return hf_model_from(tiny_qwen3_dir)


def _with_trainer(run: MilesConfig, **trainer: object) -> MilesConfig:
    return dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, **trainer))


def _lengths(batch: TrainBatch) -> list[int]:
    return [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]


def _assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert list(got) == list(want)
    assert max(g.abs().max().item() for g in want.values()) > 1e-3, "the gradient is ~0: the check would be empty"
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=k)


# --- pure functions ---------------------------------------------------------------------------------

def test_microbatch_plan_respects_the_budget():
    lengths = [5, 9, 3, 9, 4, 7, 2, 8]
    assert count_microbatches(lengths, 0) == 1 and split_microbatches(lengths, 0, 1) == [[1, 3, 7, 5, 0, 4, 2, 6]]
    # budget 360, a pass costs 360 / 64 = 5.6 tokens: [90..87] pads 6 tokens and saves a pass; [50, 49, 10, 9]
    # would pad 82 (cutting at the budget, as a greedy cut does), [50, 49] + [10, 9] pads 1 for one more pass
    spread = [10, 90, 49, 88, 9, 89, 50, 87]
    assert split_microbatches(spread, 360, count_microbatches(spread, 360)) == [[1, 5, 3, 7], [6, 2], [0, 4]]
    # ranks may need more passes than this one: split further, never over the budget, nothing lost
    assert count_microbatches(lengths, 18) == 7
    for k in range(7, 9):
        groups = split_microbatches(lengths, 18, k)
        assert len(groups) == k and sorted(i for g in groups for i in g) == list(range(8))
        assert all(len(g) * max(lengths[i] for i in g) <= 18 for g in groups)
    # a sequence longer than the budget gets a micro-batch of its own
    assert split_microbatches([30, 4, 4], 10, 2) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="cannot form 9 micro-batches"):
        split_microbatches(lengths, 18, 9)
    with pytest.raises(ValueError, match="must be 0 .off. or positive"):
        count_microbatches(lengths, -1)


def test_microbatch_cut_is_the_cheapest_one():
    """Against every contiguous cut of the sorted lengths: none within the budget costs less."""
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        budget = rng.randint(40, 160)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        cuts = []
        for mask in range(2 ** (len(order) - 1)):
            groups, start = [], 0
            for k in range(1, len(order)):
                if mask >> (k - 1) & 1:
                    groups.append(order[start:k])
                    start = k
            groups.append(order[start:])
            if all(len(g) == 1 or len(g) * lengths[g[0]] <= budget for g in groups):
                cuts.append(groups)
        got = split_microbatches(lengths, budget, count_microbatches(lengths, budget))
        assert sorted(i for g in got for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or len(g) * lengths[g[0]] <= budget for g in got)
        def cost(groups: list[list[int]], lengths: list[int] = lengths, budget: int = budget) -> float:
            return sum(len(g) * max(lengths[i] for i in g) + budget / 64 for g in groups)

        assert cost(got) == pytest.approx(min(cost(c) for c in cuts))


def test_lr_schedules_hand_checked():
    def f(step: int, schedule: str) -> float:
        return lr_multiplier(step, warmup_steps=2, total_steps=12, schedule=schedule, min_lr_ratio=0.1)

    for schedule in ("constant", "linear", "cosine"):
        assert [f(s, schedule) for s in (0, 1, 2)] == pytest.approx([0.5, 1.0, 1.0])
    assert [f(s, "constant") for s in (7, 12, 50)] == [1.0, 1.0, 1.0]
    # decay over steps 2..12: half way at step 7, the floor from step 12 on
    assert [f(s, "linear") for s in (7, 12, 50)] == pytest.approx([0.55, 0.1, 0.1])
    assert [f(s, "cosine") for s in (7, 12, 50)] == pytest.approx([0.55, 0.1, 0.1])
    assert f(4, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_multiplier(0, warmup_steps=0, total_steps=10, schedule="linear", min_lr_ratio=0.0) == 1.0
    with pytest.raises(ValueError, match="valid options: constant, linear, cosine"):
        f(0, "step")
    with pytest.raises(ValueError, match="min_lr_ratio: must be in"):
        lr_multiplier(0, warmup_steps=0, total_steps=10, schedule="linear", min_lr_ratio=1.5)


def test_checkpointed_layers_give_the_same_gradients(hf_model: torch.nn.Module, tiny_qwen3_dir: Path):
    ids = torch.randint(3, 96, (3, 12), generator=torch.Generator().manual_seed(0))

    def grads_and_saved(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads, len(saved)

    plain, saved_plain = grads_and_saved(hf_model)
    ckpt = hf_model_from(tiny_qwen3_dir)
    for layer in ckpt.model.layers:
        checkpoint_activations(layer)
    got, saved_ckpt = grads_and_saved(ckpt)
    assert saved_ckpt < saved_plain / 2, (saved_ckpt, saved_plain)  # the layers' activations were not stored
    _assert_same_grads(got, plain, atol=1e-7)


# --- one in-process rank (world size 1) --------------------------------------------------------------

@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                      "seq_mean_token_sum_norm"])
def test_microbatches_give_the_gradient_of_one(tiny_qwen3_dir: Path, hf_model: torch.nn.Module, loss_agg: str):
    run = validate({"algo": {"loss_agg": loss_agg, "kl_coef": 0.05, "entropy_coef": 0.01},
                    "precision": {"tis_clip": 2.0}, "rollout": {"max_new_tokens": 8}})
    batch = rl_batch(hf_model)
    budget = 24  # lengths 12, 10, 9, 9, 8, 7, 6, 5 -> [12], [10], [9, 9], [8], [7], [6], [5] (a pass costs 0.4)
    assert count_microbatches(_lengths(batch), budget) == 7
    with local_trainer(tiny_qwen3_dir, run) as t:
        whole = t.compute_gradients(batch)
    with local_trainer(tiny_qwen3_dir, _with_trainer(run, max_tokens_per_microbatch=budget)) as t:
        split = t.compute_gradients(batch)
    _assert_same_grads(split, whole)


def test_token_advantages_in_the_trainer(tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    run = _with_trainer(validate({}), max_tokens_per_microbatch=18)
    batch = rl_batch(hf_model)
    broadcast = dataclasses.replace(batch, token_advantages=[[a] * len(r) for a, r in
                                                             zip(batch.advantages, batch.response_ids, strict=True)])
    # only the last response token of each sample carries (its sample's) advantage
    last_only = dataclasses.replace(batch, token_advantages=[[0.0] * (len(r) - 1) + [a] for a, r in
                                                             zip(batch.advantages, batch.response_ids, strict=True)])
    with local_trainer(tiny_qwen3_dir, run) as t:
        per_sample, per_token, last = (t.compute_gradients(b) for b in (batch, broadcast, last_only))
    _assert_same_grads(per_token, per_sample)
    assert max((last[k] - per_sample[k]).abs().max().item() for k in last) > 1e-3


def test_activation_checkpointing_in_the_trainer(tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    run = validate({"algo": {"entropy_coef": 0.01}})
    batch = rl_batch(hf_model)
    with local_trainer(tiny_qwen3_dir, run) as t:
        plain = t.compute_gradients(batch)
    with local_trainer(tiny_qwen3_dir, _with_trainer(run, activation_checkpointing=True)) as t:
        ckpt = t.compute_gradients(batch)
        m = t.train_step(batch)
    _assert_same_grads(ckpt, plain, atol=1e-7)
    assert m["train/nonfinite_skipped"] == 0


def test_lr_follows_the_schedule_in_the_trainer(tiny_qwen3_dir: Path, hf_model: torch.nn.Module):
    # 2 RL steps x 2 mini-batches = 4 optimizer steps; warmup 1, then linear decay to 0.2 * lr
    run = validate({"trainer": {"lr": 1e-3, "lr_warmup_steps": 1, "num_steps": 2, "lr_schedule": "linear",
                                "min_lr_ratio": 0.2}, "algo": {"num_minibatches": 2}})
    batch = rl_batch(hf_model)
    with local_trainer(tiny_qwen3_dir, run) as t:
        lrs = [t.train_step(batch)["train/lr"] for _ in range(2)]  # the lr of each step's first update
        last = t.optimizer.param_groups[0]["lr"]
    assert lrs == pytest.approx([1e-3, 1e-3 * (0.2 + 0.8 * (1 - 1 / 3))])
    assert last == pytest.approx(0.2e-3)


def test_saved_state_resumes_exactly(tiny_qwen3_dir: Path, hf_model: torch.nn.Module, tmp_path: Path):
    run = validate({"trainer": {"lr": 1e-3, "lr_warmup_steps": 1, "num_steps": 4, "lr_schedule": "cosine",
                                "min_lr_ratio": 0.1, "max_tokens_per_microbatch": 18},
                    "algo": {"num_minibatches": 2, "entropy_coef": 0.01}})
    batch = rl_batch(hf_model)
    shifted = dataclasses.replace(batch, advantages=[-a for a in batch.advantages])
    with local_trainer(tiny_qwen3_dir, run) as t:
        t.train_step(batch)
        t.save_state(str(tmp_path / "state"))
        want_metrics = t.train_step(shifted)
        want = t.full_state_dict()
    saved = load_file(str(tmp_path / "state" / "optimizer.safetensors"))
    assert {k.rsplit(".", 1)[1] for k in saved} == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state.lm_head.weight.step"].item() == 2  # two mini-batches, two AdamW steps
    meta = json.loads((tmp_path / "state" / "trainer_state.json").read_text())
    assert meta["scheduler"]["last_epoch"] == 2 and not (tmp_path / "state.tmp").exists()

    with local_trainer(tiny_qwen3_dir, run) as t:
        t.load_state(str(tmp_path / "state"))
        got_metrics = t.train_step(shifted)
        got = t.full_state_dict()
    assert got_metrics["train/lr"] == want_metrics["train/lr"] < 1e-3
    for k in ("train/loss", "train/grad_norm", "train/entropy"):
        assert got_metrics[k] == want_metrics[k], k
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0, msg=k)


# --- Ray actors ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_world_sizes_1_2_4_compute_the_same_update(ray_cluster, tiny_qwen3_dir: Path, hf_model: torch.nn.Module,
                                                   tmp_path: Path):
    """Same gradients and updated weights at W = 1, 2, 4 (micro-batched at W = 4); the state saved at
    W = 2 loads into W = 4 and continues like W = 2 does."""
    # lr 1e-4: see test_fsdp.test_two_ranks_equal_one_rank on Adam's first steps and summation order
    run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0}, "algo": {"kl_coef": 0.05, "entropy_coef": 0.01,
                    "loss_agg": "seq_mean_token_mean"}, "precision": {"tis_clip": 2.0}})
    batch = rl_batch(hf_model)
    shifted = dataclasses.replace(batch, advantages=[-a for a in batch.advantages])
    with local_trainer(tiny_qwen3_dir, run) as t:
        grads1 = t.compute_gradients(batch)
        m1 = t.train_step(batch)
        sd1 = t.full_state_dict()

    two = Group(ray_cluster, 2, tiny_qwen3_dir, run)
    try:
        grads2, _ = two.call("compute_gradients", batch)
        m2, _ = two.call("train_step", batch)
        sd2, _ = two.call("full_state_dict")
        two.call("save_state", str(tmp_path / "state"))
        m2_next, _ = two.call("train_step", shifted)
        sd2_next, _ = two.call("full_state_dict")
    finally:
        two.close()

    four = Group(ray_cluster, 4, tiny_qwen3_dir, _with_trainer(run, max_tokens_per_microbatch=12))
    try:
        grads4 = four.call("compute_gradients", batch)[0]
        m4 = four.call("train_step", batch)[0]
        sd4 = four.call("full_state_dict")[0]
        four.call("load_state", str(tmp_path / "state"))
        loaded = four.call("full_state_dict")[0]
        m4_next = four.call("train_step", shifted)[0]
        sd4_next = four.call("full_state_dict")[0]
    finally:
        four.close()

    _assert_same_grads(grads2, grads1)
    _assert_same_grads(grads4, grads1)
    for m in (m2, m4):
        for k in ("train/loss", "train/grad_norm", "train/kl", "train/entropy", "train/num_tokens"):
            assert m[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), k
    assert max((sd1[k] - hf_model.state_dict()[k]).abs().max().item() for k in sd1) > 5e-5
    for k in sd1:
        torch.testing.assert_close(sd2[k], sd1[k], atol=1e-5, rtol=0, msg=k)
        torch.testing.assert_close(sd4[k], sd1[k], atol=1e-5, rtol=0, msg=k)
        torch.testing.assert_close(loaded[k], sd2[k], atol=0, rtol=0, msg=k)
        torch.testing.assert_close(sd4_next[k], sd2_next[k], atol=1e-5, rtol=0, msg=k)
    assert m4_next["train/loss"] == pytest.approx(m2_next["train/loss"], rel=1e-5, abs=1e-6)
