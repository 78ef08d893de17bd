"""Megatron trainer: MoE routing replay, the quantization-aware forward and bf16 compute, against FSDP on one batch.

Layouts on two ranks (session fixture ``megatron_pair``, the ranks of ``tests/test_megatron.py``): EP=2 and PP=2
(1F1B with several micro-batches; EP=1) replaying the routes a perturbed-router engine recorded, PP=2 replay
with megatron's activation recompute (each recompute replays its own micro-batch's routes), TP=2 with mxfp8
and int4 QAT, and bf16 at TP=2, PP=2 (the stages exchange bf16 activations) and EP=2 with replay. In fp32
Megatron computes what FSDP computes to fp32 rounding (the tolerances of ``tests/test_megatron.py``); in bf16 both trainers compute in bf16 by other
kernels (FSDP: bf16 weights; megatron: autocast over fp32 weights), measured at most 3.4e-3 apart in
log-probs, 3.2e-2 in gradients (per tensor, relative to its norm) and 3.7e-4 in the weights after a
step, so bf16 is checked at 2e-2 / 1e-1 / 1e-3, and against fp32 (it must differ from it).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from fsdp_ranks import engine_routes, hf_model_from, local_trainer, rl_batch  # noqa: E402
from megatron_ranks import MegatronPair, experts_called, local_megatron, recomputed_routes, redirected_sites  # noqa: E402
from test_megatron import EXPECTED_SITES  # noqa: E402

from miles.backends.contract import check_trainer_class  # noqa: E402
from miles.config.validate import ConfigError, validate  # noqa: E402
from miles.train.batching import pad_batch  # noqa: E402
from miles.train.megatron import MegatronTrainer  # noqa: E402

pytestmark = pytest.mark.megatron

BASE: dict[str, Any] = {
    "trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "shared_prompt_forward": False},
    "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "clip_high": 0.28, "num_minibatches": 2,
             "loss_agg": "seq_mean_token_mean"},
    "precision": {"tis_clip": 2.0},
}
BF16 = {"train_dtype": "bfloat16", "rollout_dtype": "bfloat16"}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (checkpoint, settings on top of BASE); the MoE variants train on a batch carrying routes
    "replay": ("moe", {"algo": {"routing_replay": "rollout"}}),
    "mxfp8": ("dense", {"precision": {"rollout_quant": "mxfp8", "train_quant": "mxfp8", "quant_block_size": 32}}),
    "int4": ("dense", {"precision": {"rollout_quant": "int4", "train_quant": "int4", "quant_block_size": 32}}),
    "bf16": ("dense", {"precision": BF16}),
    "bf16_replay": ("moe", {"algo": {"routing_replay": "rollout"}, "precision": BF16}),
}
LAYOUTS: dict[str, tuple[str, dict[str, int]]] = {
    "ep2_replay": ("replay", {"expert_parallel": 2, "max_tokens_per_microbatch": 24}),
    "pp2_replay": ("replay", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24}),
    "pp2_replay_recompute": ("replay", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24,
                                        "activation_checkpointing": True}),
    "tp2_mxfp8": ("mxfp8", {"tensor_parallel": 2}),
    "tp2_int4": ("int4", {"tensor_parallel": 2}),
    "tp2_bf16": ("bf16", {"tensor_parallel": 2}),
    "pp2_bf16": ("bf16", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24}),
    "ep2_bf16_replay": ("bf16_replay", {"expert_parallel": 2, "max_tokens_per_microbatch": 24}),
}
DISPATCH_CHECKED = [n for n in LAYOUTS if "replay" in n and "recompute" not in n]
"""Layouts whose dispatched and computed experts are probed (a no-grad pass: the recompute changes nothing there)."""
AUTOCAST_SITE = {"pipeline_parallel/schedules.py:418": "torch.autocast('cuda')"}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for group, values in extra.items():
        out.setdefault(group, {}).update(values)
    return out


def _run(variant: str, world_size: int = 1, **trainer: int) -> Any:
    ckpt_name, extra = VARIANTS[variant]
    cfg = _merge(BASE, extra)
    cfg["trainer"].update(trainer)
    cfg["placement"] = {"trainer_world_size": world_size}
    if ckpt_name == "moe":
        cfg["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
    return validate(cfg)


@dataclasses.dataclass
class Reference:
    """What the FSDP trainer (one rank) computes for a variant."""

    batch: Any
    logprobs: list[list[float]]
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]
    after: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def checkpoints(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path) -> dict[str, Path]:
    return {"dense": tiny_qwen3_dir, "moe": tiny_qwen3_moe_dir}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, Reference]:
    out = {}
    batches = {}
    for name, (ckpt_name, _) in VARIANTS.items():
        ckpt = checkpoints[ckpt_name]
        if ckpt_name not in batches:
            batch = rl_batch(hf_model_from(ckpt))
            batches[ckpt_name] = batch if ckpt_name == "dense" else dataclasses.replace(
                batch, routing=engine_routes(ckpt, batch))
        batch = batches[ckpt_name]
        with local_trainer(ckpt, _run(name)) as t:
            logprobs = t.compute_logprobs(batch)
            grads = t.compute_gradients(batch)
            metrics = t.train_step(batch)
            after = t.full_state_dict()
        out[name] = Reference(batch, logprobs, grads, metrics, after)
    return out


@pytest.fixture(scope="module")
def layouts(megatron_pair: MegatronPair, checkpoints: dict[str, Path], references: dict[str, Reference]
            ) -> dict[str, dict[str, Any]]:
    seen = {}
    for name, (variant, sizes) in LAYOUTS.items():
        ref = references[variant]
        group = megatron_pair.load(checkpoints[VARIANTS[variant][0]], _run(variant, 2, **sizes))
        got: dict[str, Any] = {"logprobs": group.call("compute_logprobs", ref.batch)}
        if name in DISPATCH_CHECKED:
            got["experts"] = group.probe(experts_called, ref.batch)
        if "recompute" in name:  # the gradients, and the routes of every forward and recompute
            got["recomputed"] = group.probe(recomputed_routes, ref.batch)
            got["grads"] = got["recomputed"][0]["grads"]
        else:
            got["grads"] = group.call("compute_gradients", ref.batch)[0]
        got["metrics"] = group.call("train_step", ref.batch)
        got["after"] = group.call("full_state_dict")[0]
        got["sites"] = {k: v for s in group.probe(redirected_sites) for k, v in s.items()}
        seen[name] = got
    return seen


# ---- config checks -------------------------------------------------------------------------------

def test_check_config_accepts_replay_qat_and_bf16_and_refuses_inexact_quantization() -> None:
    check_trainer_class(MegatronTrainer, _run("replay", 2, expert_parallel=2))
    check_trainer_class(MegatronTrainer, _run("bf16_replay", 2, pipeline_parallel=2))
    check_trainer_class(MegatronTrainer, _run("mxfp8", 2, tensor_parallel=2))
    qat = {"rollout_quant": "int4", "train_quant": "int4", "quant_block_size": 128}
    check_trainer_class(MegatronTrainer, validate(_merge(BASE, {"precision": qat})))  # TP=1: any block
    with pytest.raises(ConfigError, match=r"precision.train_quant=int4 with trainer.tensor_parallel=2: the "
                       r"row-parallel self_attn.o_proj splits its 64 input columns into 32 per rank, not a multiple "
                       r"of the block \(precision.quant_block_size=128\)"):
        check_trainer_class(MegatronTrainer, validate(_merge(BASE, {
            "precision": qat, "trainer": {"tensor_parallel": 2}, "placement": {"trainer_world_size": 2}})))
    for fmt, block, why in (("nvfp4", 16, "its per-tensor scale belongs to each HF tensor"),
                            ("fp8_block", 128, "its 128 x 128 tiles would span the q, k and v rows")):
        with pytest.raises(ConfigError, match=f"precision.train_quant={fmt}: the megatron trainer .*; {fmt}: {why}"):
            check_trainer_class(MegatronTrainer, validate(_merge(BASE, {"precision": {
                "rollout_quant": fmt, "train_quant": fmt, "quant_block_size": block}})))


def test_megatrons_linear_backward_under_cpu_autocast_needs_the_compat_layer() -> None:
    """megatron-core 0.16.1's own error without the compatibility layer, and bf16 compute with it."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear

    from miles.train.megatron import compat

    if not compat.needed():
        pytest.skip("the compatibility layer applies in a process without CUDA only")

    def step() -> tuple[torch.dtype, torch.dtype]:
        x, w = torch.randn(3, 2, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = Linear.apply(x, w, None, False, False, False, None, None, None)
        y.float().sum().backward()
        return y.dtype, w.grad.dtype

    compat.uninstall()
    try:
        with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype, but got: c10::BFloat16 "
                                               "!= float"):
            step()
    finally:
        compat.install()
    assert step() == (torch.bfloat16, torch.float32)  # bf16 matmuls, fp32 weight gradients


# ---- two ranks ------------------------------------------------------------------------------------

def _close(got: Any, want: Any, *, bf16: bool, what: str) -> None:
    if bf16:
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=2e-2, rtol=0, msg=what)
    else:
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=2e-6, rtol=0, msg=what)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_computes_what_fsdp_computes(layouts: dict[str, dict[str, Any]], references: dict[str, Reference],
                                            name: str):
    variant = LAYOUTS[name][0]
    ref, got = references[variant], layouts[name]
    bf16 = "bf16" in variant
    assert got["logprobs"][0] == got["logprobs"][1], "every rank must return the same log-probs"
    for i, (a, b) in enumerate(zip(got["logprobs"][0], ref.logprobs, strict=True)):
        _close(a, b, bf16=bf16, what=f"log-probs of sample {i}")
    assert list(got["grads"]) == list(ref.grads)
    for k, want in ref.grads.items():
        if bf16:  # relative to the tensor's size: bf16 rounding of every term
            assert (got["grads"][k] - want).norm() <= 1e-1 * want.norm() + 1e-6, k
        else:
            torch.testing.assert_close(got["grads"][k], want, atol=1e-6, rtol=1e-5, msg=k)
    m, want = got["metrics"][0], ref.metrics
    shared = [{k: v for k, v in r.items() if not k.startswith("mem/")} for r in got["metrics"]]
    assert shared[1] == shared[0], "every rank must return the same metrics"  # each rank's own memory (mem/trainer<rank>/...) aside
    assert set(m) == set(want)
    for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/entropy", "train/tis_clip_frac",
              "moe/route_agreement", "moe/replayed_route_share"):
        if k in want:
            assert m[k] == pytest.approx(want[k], rel=5e-2 if bf16 else 1e-5, abs=1e-3 if bf16 else 1e-6), k
    for k, v in ref.after.items():
        torch.testing.assert_close(got["after"][k], v, atol=1e-3 if bf16 else 3e-5, rtol=0, msg=k)
    if "replay" in variant:
        assert m["moe/replayed_route_share"] == 1.0 and 0 < m["moe/route_agreement"] < 1
    # bf16 is megatron's autocast, on the CPU through the compatibility layer; and it is not fp32
    assert (AUTOCAST_SITE.items() <= got["sites"].items()) == bf16
    assert got["sites"].items() <= (EXPECTED_SITES | AUTOCAST_SITE).items(), "a CUDA call site compat.py does not list"
    if bf16:  # the same batch in fp32: FSDP's under replay, else transformers' (the batch's rollout log-probs)
        fp32 = references["replay"].logprobs if "replay" in variant else ref.batch.rollout_logprobs
        assert max(abs(a - b) for x, y in zip(got["logprobs"][0], fp32, strict=True)
                   for a, b in zip(x, y, strict=True)) > 1e-4


@pytest.mark.parametrize("name", DISPATCH_CHECKED)
def test_replay_dispatches_and_computes_exactly_the_recorded_experts(layouts: dict[str, dict[str, Any]],
                                                                     references: dict[str, Reference], name: str):
    """The routing map megatron's dispatcher receives is the engine's routes, and the experts (over the all-to-all
    at EP=2) compute exactly the tokens that map sends them."""
    batch = references[LAYOUTS[name][0]].batch
    routes = pad_batch(batch).routes  # [B, L, layers, k]
    recorded = routes.transpose(0, 1).reshape(-1, *routes.shape[-2:])  # megatron's token order: [L * B, ...]
    have = recorded[:, 0, 0] >= 0
    assert 0 < have.sum() < len(have)  # last positions and padding keep the trainer's own routing
    per_rank = layouts[name]["experts"]
    dispatched: dict[int, torch.Tensor] = {}
    for rank in per_rank:
        for layer, routing_map in rank["dispatched"]:
            want = torch.zeros_like(routing_map).scatter(1, recorded[:, layer - 1].long().clamp(min=0), True)
            assert torch.equal(routing_map[have], want[have]), (name, layer)
            dispatched[layer] = dispatched.get(layer, 0) + routing_map.sum(0)
    assert sorted(dispatched) == [1, 2]  # both MoE layers ran (on one stage each at PP=2)
    computed: dict[int, torch.Tensor] = {}
    for rank in per_rank:
        for layer, experts, tokens in rank["computed"]:
            counts = computed.setdefault(layer, torch.zeros(4, dtype=torch.long))
            counts[experts] += torch.tensor(tokens)
    assert {k: v.tolist() for k, v in computed.items()} == {k: v.tolist() for k, v in dispatched.items()}


def test_megatrons_recompute_replays_each_micro_batchs_own_routes(layouts: dict[str, dict[str, Any]]):
    """PP=2, 1F1B, ``trainer.activation_checkpointing``: the first stage runs micro-batch 1's forward before
    micro-batch 0's backward, whose recompute of the MoE layer must replay micro-batch 0's routes (set again when
    its backward starts, :meth:`RouteReplay.hold`). Every recompute dispatches what its micro-batch's forward
    dispatched, and the gradients are those of the run without recompute, bit for bit."""
    for rank, seen in enumerate(layouts["pp2_replay_recompute"]["recomputed"]):
        ((layer, calls),) = seen["routes"].items()  # one MoE layer per stage
        forward, recomputed = calls["forward"], calls["recomputed"]
        assert len(forward) == len(recomputed) >= 2, (rank, layer)
        assert forward[0].shape != forward[1].shape or not torch.equal(forward[0], forward[1])  # routes differ
        for j, (a, b) in enumerate(zip(forward, recomputed, strict=True)):
            assert torch.equal(a, b), f"rank {rank}, layer {layer}: micro-batch {j} recomputed with other routes"
    plain, got = layouts["pp2_replay"]["grads"], layouts["pp2_replay_recompute"]["grads"]
    assert list(got) == list(plain)
    for k, g in plain.items():
        assert torch.equal(got[k], g), k


# ---- one rank: QAT recipes at TP=1 --------------------------------------------------------------------

def _recipe(name: str) -> Any:
    from hydra import compose, initialize_config_module

    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=[f"precision={name}"])).precision


@pytest.mark.parametrize("recipe", ["int4_qat", "mxfp8"])
def test_one_rank_qat_recipes_compute_what_fsdp_computes(checkpoints: dict[str, Path], recipe: str):
    """The shipped QAT recipes at TP=1: in fp32, FSDP's numbers to fp32 rounding; as shipped (bf16), to bf16
    rounding, and with mismatch correction on under ``auto`` (megatron's bf16 kernels are not the engine's)."""
    ckpt = checkpoints["moe"]
    batch = rl_batch(hf_model_from(ckpt))
    shipped = _recipe(recipe)
    base = _run("replay")
    base = dataclasses.replace(base, algo=dataclasses.replace(base.algo, routing_replay="off"))
    for precision in (dataclasses.replace(shipped, train_dtype="float32", rollout_dtype="float32"), shipped):
        bf16 = precision.train_dtype == "bfloat16"
        run = dataclasses.replace(base, precision=precision)
        # FSDP corrects nothing under auto here (its forward is the engine's): switched on to train alike
        fsdp_run = dataclasses.replace(base, precision=dataclasses.replace(precision, mismatch_correction="on"))
        with local_trainer(ckpt, fsdp_run if bf16 else run) as t:
            want_logp, want_grads = t.compute_logprobs(batch), t.compute_gradients(batch)
        with local_megatron(ckpt, run) as trainer:
            assert trainer.mismatch["tis_clip"] == (2.0 if bf16 else None)
            logp, grads = trainer.compute_logprobs(batch), trainer.compute_gradients(batch)
        for a, b in zip(logp, want_logp, strict=True):
            _close(a, b, bf16=bf16, what=f"{recipe} {precision.train_dtype}")
        for k, want in want_grads.items():
            if bf16:
                assert (grads[k] - want).norm() <= 1e-1 * want.norm() + 1e-6, k
            else:
                torch.testing.assert_close(grads[k], want, atol=1e-6, rtol=1e-5, msg=k)
        unquantized = [x for lp in batch.rollout_logprobs for x in lp]
        assert max(abs(a - b) for a, b in zip(sum(logp, []), unquantized, strict=True)) > 1e-2  # it is quantized
