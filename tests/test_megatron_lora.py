"""LoRA on the megatron trainer (``adapter=lora trainer=megatron``, and tenants): the adapters, numbers, messages
and files of the FSDP trainer's peft model, at TP=1, TP=2, PP=2, DP=2 and EP=2 (the session's two megatron ranks),
and at TP=1 with int4 QAT, with bf16 and with routing replay.

Tolerances are tests/test_megatron.py's full-model ones: log-probs atol 2e-6, gradients atol 1e-6 rtol 1e-5,
metrics rel 1e-5 abs 1e-6, adapter weights after two AdamW steps atol 3e-5 (at adapter.lr 2e-4).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("peft")

from fsdp_ranks import engine_routes, free_port, hf_logprobs, hf_model_from, local_trainer, rl_batch  # noqa: E402
from megatron_ranks import MegatronPair, local_megatron, sent_weights  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from miles.adapters import lora  # noqa: E402
from miles.backends.contract import check_trainer_class  # noqa: E402
from miles.config import RankConfig  # noqa: E402
from miles.config.validate import ConfigError, validate  # noqa: E402
from miles.train.fsdp import FSDPTrainer  # noqa: E402
from miles.train.megatron import MegatronTrainer  # noqa: E402

pytestmark = pytest.mark.megatron

CFG: dict[str, Any] = {
    "adapter": {"kind": "lora", "rank": 4, "alpha": 8.0, "lr": 2e-4},
    "trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "shared_prompt_forward": False},
    "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "clip_high": 0.28, "num_minibatches": 2,
             "loss_agg": "seq_mean_token_mean"},
    "precision": {"tis_clip": 2.0},
}
LAYOUTS: dict[str, tuple[str, dict[str, int]]] = {
    # name: (checkpoint, trainer.* sizes); budgets force several micro-batches
    "tp2": ("dense", {"tensor_parallel": 2}),
    "pp2": ("dense", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24}),
    "dp2": ("dense", {"max_tokens_per_microbatch": 12}),
    "ep2": ("moe", {"expert_parallel": 2, "max_tokens_per_microbatch": 24}),
}
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]  # a Qwen3-MoE layer has no dense MLP
TENANTS = ("x", "y")
COMPARED = ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/entropy", "train/clip_frac_low",
            "train/clip_frac_high", "train/num_tokens", "train/lr", "train/trainable_param_frac")

TENANT_COMPARED = (*(f"tenant/{n}/{k}" for n in TENANTS for k in COMPARED[:-2]), *COMPARED[-3:])


def _run(world_size: int = 1, moe: bool = False, **trainer: int) -> Any:
    cfg = copy.deepcopy(CFG)
    cfg["trainer"].update(trainer)
    cfg["placement"] = {"trainer_world_size": world_size}
    if moe:
        cfg["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
        cfg["adapter"]["target_modules"] = MOE_TARGETS
    return validate(cfg)


def _mixed(batch: Any) -> Any:
    """The batch as two tenants' samples: the first half x's, the rest y's."""
    half = len(batch) // 2
    return dataclasses.replace(batch, adapters=["x"] * half + ["y"] * half)


def _unsync(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return lora.split_sync_state(sd)


@dataclasses.dataclass
class Seen:
    """What one trainer computed from the start state: sent adapters before and after two steps, log-probs,
    gradients, metrics (and a tenants step from the tenants' start state)."""

    before: dict[str, torch.Tensor]
    logprobs: list[list[float]]
    grads: dict[str, torch.Tensor]
    metrics: list[dict[str, float]]
    after: dict[str, torch.Tensor]
    tenant_metrics: dict[str, float] | None = None
    tenant_after: dict[str, torch.Tensor] | None = None
    peft_init: dict[str, torch.Tensor] | None = None
    """The adapters as constructed (peft's initialization)."""


@pytest.fixture(scope="module")
def hf(tiny_qwen3_dir: Path) -> torch.nn.Module:
    return hf_model_from(tiny_qwen3_dir)


def _randomize(trainer: FSDPTrainer, seed: int) -> None:
    """Non-zero adapters (peft starts B at zero, where A's gradient is exactly zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in trainer.adapter_names:
            for p in lora.adapter_parameters(trainer.model, name).values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Trainer states with random adapters that the FSDP trainer writes (one adapter; the two tenants')."""
    root = tmp_path_factory.mktemp("lora_starts")
    return {"dense": root / "dense", "moe": root / "moe", "tenants": root / "tenants"}


def _reference(ckpt: Path, run: Any, start: Path) -> Seen:
    """The FSDP trainer's peft model at world size 1: random adapters saved to ``start``, then two steps."""
    batch = rl_batch(hf_model_from(ckpt))
    with local_trainer(ckpt, run) as t:
        peft_init = lora.sync_state(t.model, ("default",))
        _randomize(t, 0)
        t.save_state(str(start))
        before = lora.sync_state(t.model, ("default",))
        logprobs = t.compute_logprobs(batch)
        grads = {k: v for k, v in t.compute_gradients(batch).items() if ".lora_" in k}
        metrics = [t.train_step(batch), t.train_step(batch)]
        after = lora.sync_state(t.model, ("default",))
    return Seen(before, logprobs, grads, metrics, after, peft_init=peft_init)


@pytest.fixture(scope="module")
def fsdp_moe(tiny_qwen3_moe_dir: Path, starts: dict[str, Path]) -> Seen:
    return _reference(tiny_qwen3_moe_dir, _run(moe=True), starts["moe"])


@pytest.fixture(scope="module")
def fsdp(tiny_qwen3_dir: Path, hf: torch.nn.Module, starts: dict[str, Path]) -> Seen:
    """The FSDP trainer's peft model at world size 1 from random adapters: two steps on the batch; a tenants step."""
    batch = rl_batch(hf)
    seen = _reference(tiny_qwen3_dir, _run(), starts["dense"])
    tenants = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                          checkpoint_dir=str(tiny_qwen3_dir), config=RankConfig.of(_run()), num_threads=1,
                          adapter_names=TENANTS)
    try:
        _randomize(tenants, 1)
        tenants.save_state(str(starts["tenants"]))
        tenant_metrics = tenants.train_step(_mixed(batch))
        tenant_after = lora.sync_state(tenants.model, TENANTS)
    finally:
        tenants.shutdown()
    return dataclasses.replace(seen, tenant_metrics=tenant_metrics, tenant_after=tenant_after)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, what: str) -> None:
    assert list(got) == list(want), f"{what}: names or order differ"
    for k, v in want.items():
        assert got[k].shape == v.shape, (what, k)
        torch.testing.assert_close(got[k], v, atol=atol, rtol=1e-5 if what == "gradients" else 0, msg=f"{what}: {k}")


def _same_metrics(got: dict[str, float], want: dict[str, float], names: tuple[str, ...] = COMPARED) -> None:
    assert set(got) == set(want)
    for k in names:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k


def _compare(seen: Seen, ref: Seen) -> None:
    _close(seen.peft_init, ref.peft_init, 0, "adapters as constructed")  # peft's initialization, bit for bit
    _close(seen.before, ref.before, 0, "adapters loaded from the FSDP trainer's state")
    for got, want in zip(seen.logprobs, ref.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-6, rtol=0)
    assert min(g.abs().max().item() for g in ref.grads.values()) > 1e-3  # A's and B's
    _close(seen.grads, ref.grads, 1e-6, "gradients")
    for got, want in zip(seen.metrics, ref.metrics, strict=True):
        _same_metrics(got, want)
        assert got["train/nonfinite_skipped"] == 0 and got["train/lr"] == pytest.approx(2e-4)
    moved = max((ref.after[k] - ref.before[k]).abs().max().item() for k in ref.after)
    assert moved > 2e-4
    _close(seen.after, ref.after, 3e-5, "adapters after two steps")


# ---- the layout of the adapters, without megatron's process groups ---------------------------------

def test_layout_names_shapes_and_cuts_are_peft_s(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, hf: torch.nn.Module):
    from miles.config.schema import AdapterConfig
    from miles.train.megatron.arch import Arch
    from miles.train.megatron.lora_layout import initial_adapters, lora_entries, shard_lora, unshard_lora

    for ckpt, targets in ((tiny_qwen3_dir, AdapterConfig().target_modules),
                          (tiny_qwen3_moe_dir, ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head"))):
        model = hf_model_from(ckpt)
        cfg = AdapterConfig(kind="lora", rank=4, alpha=8.0, target_modules=targets)
        torch.manual_seed(3)
        want = lora.adapter_state(lora.add_adapters(model, cfg, ["x"], trainable=True), "x")
        got = initial_adapters(model.config, cfg, ["x"], seed=3)["x"]  # from the config alone
        assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
        arch = Arch.from_hf(model.config)
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            entries = [e for p in range(pp) for e in lora_entries(arch, targets, ["x"], 4, pp=pp, pp_rank=p)]
            assert [e.peft_key for e in entries] == list(want), (tp, pp)
            assert all(e.shape == tuple(want[e.peft_key].shape) for e in entries)
            for e in entries:
                parts = [shard_lora(e, want[e.peft_key], arch, tp, r) for r in range(tp)]
                assert torch.equal(unshard_lora(e, parts, arch), want[e.peft_key]), (tp, e.peft_key)


def test_config_checks():
    run = _run(2, tensor_parallel=2)
    assert run.adapter.kind == "lora"
    check_trainer_class(MegatronTrainer, run)
    check_trainer_class(MegatronTrainer, validate(CFG | {"tenants": [{"name": "a", "task": "largest"}]}))

    def refused(match: str, **cfg: Any) -> None:
        full = copy.deepcopy(CFG)
        for key, value in cfg.items():
            group, field = key.split("__", 1)
            full.setdefault(group, {})[field] = value
        with pytest.raises(ConfigError, match=match):
            check_trainer_class(MegatronTrainer, validate(full))

    refused(r"adapter.target_modules: \['embed_tokens'\] with trainer=megatron", adapter__target_modules=["q_proj",
                                                                                                    "embed_tokens"])
    refused(r"pipeline stage 0 would hold no adapter", adapter__target_modules=["lm_head"], trainer__pipeline_parallel=2,
            placement__trainer_world_size=2)
    refused(r"\['gate_proj', 'up_proj', 'down_proj'\] name no module of the model \(qwen3_moe",
            model___target_="miles.models.qwen3.qwen3_moe_spec")


# ---- one rank in this process ----------------------------------------------------------------------

def test_one_rank_trains_fsdps_adapters_exports_them_and_writes_fsdps_state(
        tiny_qwen3_dir: Path, hf: torch.nn.Module, fsdp: Seen, starts: dict[str, Path], tmp_path: Path):
    from peft import PeftModel

    batch = rl_batch(hf)
    with local_megatron(tiny_qwen3_dir, _run()) as trainer:
        held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        assert held == {id(p) for p in trainer.lora.params.values()}, "the optimizer must hold the adapters only"
        assert not any(p.requires_grad for p in trainer.params.values())
        base = {k: p.detach().clone() for k, p in trainer.params.items()}
        peft_init = sent_weights(trainer)
        trainer.load_state(str(starts["dense"]))
        seen = Seen(sent_weights(trainer), trainer.compute_logprobs(batch), trainer.compute_gradients(batch),
                    [trainer.train_step(batch), trainer.train_step(batch)], {}, peft_init=peft_init)
        seen.after = sent_weights(trainer)
        _compare(seen, fsdp)
        assert all(torch.equal(p, base[k]) for k, p in trainer.params.items()), "a frozen base weight changed"
        counts = trainer.trainable_parameters()
        assert counts["trainable"] / counts["total"] == seen.metrics[0]["train/trainable_param_frac"] < 0.1

        # the policy in HF names: the adapter merged into the base
        merged = trainer.full_state_dict()
        delta = (2.0 * seen.after["adapter:default:base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
                 @ seen.after["adapter:default:base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
        torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"],
                                   hf.state_dict()["model.layers.0.self_attn.q_proj.weight"] + delta, atol=1e-7, rtol=0)
        assert torch.equal(merged["model.norm.weight"], hf.state_dict()["model.norm.weight"])

        # PEFT export: peft loads it onto the checkpoint and computes the trainer's log-probs
        (path,) = trainer.export_adapters(str(tmp_path / "export"))
        config = json.loads((Path(path) / lora.CONFIG_FILE).read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
        loaded = PeftModel.from_pretrained(hf_model_from(tiny_qwen3_dir), path).eval()
        want = trainer.compute_logprobs(batch)
        for got, w in zip(hf_logprobs(loaded, batch.prompt_ids, batch.response_ids), want, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(w), atol=1e-5, rtol=0)

        # trainer state: the FSDP trainer's peft layout; FSDP loads it and writes the same tensors back
        trainer.save_state(str(tmp_path / "megatron"))
    with local_trainer(tiny_qwen3_dir, _run()) as f:
        f.load_state(str(tmp_path / "megatron"))
        f.save_state(str(tmp_path / "fsdp"))
    for name in ("model.safetensors", "optimizer.safetensors", "adapters/default/adapter_model.safetensors"):
        ours, theirs = load_file(tmp_path / "megatron" / name), load_file(tmp_path / "fsdp" / name)
        assert sorted(ours) == sorted(theirs) and len(ours) >= 30, name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    meta = [json.loads((tmp_path / d / "trainer_state.json").read_text()) for d in ("megatron", "fsdp")]
    assert meta[0]["param_groups"] == meta[1]["param_groups"] and meta[0]["scheduler"] == meta[1]["scheduler"]


def test_one_rank_tenants_never_move_each_other(tiny_qwen3_dir: Path, hf: torch.nn.Module, fsdp: Seen,
                                                starts: dict[str, Path]):
    batch = rl_batch(hf)
    def state() -> dict[str, dict[str, torch.Tensor]]:
        return _unsync(sent_weights(trainer))

    with local_megatron(tiny_qwen3_dir, _run(), adapter_names=TENANTS) as trainer:
        # both tenants in one step: each through its own adapter, as FSDP's tenants step
        trainer.load_state(str(starts["tenants"]))
        _same_metrics(trainer.train_step(_mixed(batch)), fsdp.tenant_metrics, TENANT_COMPARED)
        _close(sent_weights(trainer), fsdp.tenant_after, 3e-5, "tenants' adapters")
        s1 = state()
        # x's samples only: y keeps its weights and its optimizer state
        b_state = {id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.lora.of("y")}
        metrics = trainer.train_step(dataclasses.replace(batch, adapters=["x"] * len(batch)))
        assert metrics["tenant/x/train/num_tokens"] == sum(map(sum, batch.loss_mask))
        assert not any(k.startswith("tenant/y/") for k in metrics)
        s2 = state()
        assert max((s2["x"][k] - s1["x"][k]).abs().max().item() for k in s2["x"]) > 1e-4
        assert all(torch.equal(s2["y"][k], s1["y"][k]) for k in s2["y"])
        assert all(torch.equal(trainer.optimizer.state[p][k], b_state[id(p)][k]) for p in trainer.lora.of("y")
                   for k in b_state[id(p)])
        # y's samples carry no loss token (as when its reward failed): y sits the step out, x trains
        half = len(batch) // 2
        mixed = dataclasses.replace(_mixed(batch), loss_mask=batch.loss_mask[:half]
                                    + [[0] * len(m) for m in batch.loss_mask[half:]])
        metrics = trainer.train_step(mixed)
        assert metrics["tenant/y/train/num_tokens"] == 0 and metrics["tenant/x/train/num_tokens"] > 0
        assert "tenant/y/train/loss" not in metrics and metrics["tenant/y/train/nonfinite_skipped"] == 2
        s3 = state()
        assert all(torch.equal(s3["y"][k], s2["y"][k]) for k in s3["y"])
        assert max((s3["x"][k] - s2["x"][k]).abs().max().item() for k in s3["x"]) > 1e-4
        with pytest.raises(ValueError, match=r"adapters \['z'\]"):
            trainer.train_step(dataclasses.replace(batch, adapters=["z"] * len(batch)))


COMBOS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    # name: (checkpoint, settings on top of CFG); both trainers correct the mismatch in bf16 (megatron does under
    # auto: its bf16 kernels are not the engine's; FSDP's forward is, so it is switched on to train alike)
    "int4_qat": ("dense", {"precision": {"rollout_quant": "int4", "train_quant": "int4", "quant_block_size": 32}}),
    "bf16": ("dense", {"precision": {"train_dtype": "bfloat16", "rollout_dtype": "bfloat16",
                                     "mismatch_correction": "on"}}),
    "replay": ("moe", {"algo": {"routing_replay": "rollout"}}),
}


def _combo_run(name: str) -> Any:
    ckpt_name, extra = COMBOS[name]
    cfg = copy.deepcopy(CFG)
    for group, values in extra.items():
        cfg[group] = cfg.get(group, {}) | values
    if ckpt_name == "moe":
        cfg["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
        cfg["adapter"]["target_modules"] = MOE_TARGETS
    return validate(cfg)


def _one_step(trainer: Any, start: Path, batch: Any) -> Seen:
    trainer.load_state(str(start))
    if isinstance(trainer, FSDPTrainer):
        before = lora.sync_state(trainer.model, ("default",))
        grads = {k: v for k, v in trainer.compute_gradients(batch).items() if ".lora_" in k}
    else:
        before, grads = sent_weights(trainer), trainer.compute_gradients(batch)
    logprobs = trainer.compute_logprobs(batch)
    metrics = [trainer.train_step(batch)]
    after = lora.sync_state(trainer.model, ("default",)) if isinstance(trainer, FSDPTrainer) else sent_weights(trainer)
    return Seen(before, logprobs, grads, metrics, after)


@pytest.mark.parametrize("combo", list(COMBOS))
def test_one_rank_lora_with_qat_bf16_or_replay_trains_what_fsdp_trains(
        tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, fsdp: Seen, fsdp_moe: Seen, starts: dict[str, Path],
        combo: str):
    """LoRA with the QAT forward (the base layers compute with int4 weights, the adapters unquantized, as FSDP's
    peft on its QAT-wrapped model), with bf16 (megatron's autocast against FSDP's bf16 copies: bf16 tolerances,
    as ``tests/test_megatron_replay_precision.py``) and with routing replay on the MoE model (attention and
    lm_head adapters): from the FSDP trainer's random adapters, log-probs, adapter gradients and one step."""
    ckpt_name = COMBOS[combo][0]
    ckpt, plain = (tiny_qwen3_moe_dir, fsdp_moe) if ckpt_name == "moe" else (tiny_qwen3_dir, fsdp)
    run = _combo_run(combo)
    check_trainer_class(MegatronTrainer, run)
    batch = rl_batch(hf_model_from(ckpt))
    if combo == "replay":
        batch = dataclasses.replace(batch, routing=engine_routes(ckpt, batch))
    with local_trainer(ckpt, run) as t:
        want = _one_step(t, starts[ckpt_name], batch)
    with local_megatron(ckpt, run) as trainer:
        got = _one_step(trainer, starts[ckpt_name], batch)
    _close(got.before, want.before, 0, "adapters loaded")
    bf16 = combo == "bf16"
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-2 if bf16 else 2e-6, rtol=0)
    # the combination changes the numbers (from the same adapters without it: fsdp / fsdp_moe)
    assert max(abs(a - b) for x, y in zip(got.logprobs, plain.logprobs, strict=True)
               for a, b in zip(x, y, strict=True)) > (1e-4 if bf16 else 1e-2)
    assert list(got.grads) == list(want.grads)
    for k, w in want.grads.items():
        if bf16:
            assert (got.grads[k] - w).norm() <= 1e-1 * w.norm() + 1e-6, k
        else:
            torch.testing.assert_close(got.grads[k], w, atol=1e-6, rtol=1e-5, msg=k)
    m, w = got.metrics[0], want.metrics[0]
    assert set(m) == set(w)
    for k in (*COMPARED, "moe/route_agreement", "moe/replayed_route_share"):
        if k in w:
            assert m[k] == pytest.approx(w[k], rel=5e-2 if bf16 else 1e-5, abs=1e-3 if bf16 else 1e-6), k
    if combo == "replay":
        assert m["moe/replayed_route_share"] == 1.0 and 0 < m["moe/route_agreement"] < 1
    _close(got.after, want.after, 1e-3 if bf16 else 3e-5, "adapters after a step")


# ---- two ranks: TP=2, PP=2, DP=2 (and tenants at TP=2) ---------------------------------------------------

@pytest.fixture(scope="module")
def layouts(megatron_pair: MegatronPair, tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, fsdp: Seen,
            fsdp_moe: Seen, starts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every layout of :data:`LAYOUTS` on two ranks (the session's pair) from the FSDP trainer's start state;
    DP=2 also saves, continues and reloads; then a tenants step at TP=2."""
    ckpts = {"dense": tiny_qwen3_dir, "moe": tiny_qwen3_moe_dir}
    out: dict[str, Any] = {}
    saved = tmp_path_factory.mktemp("megatron_lora_state") / "state"
    for name, (ckpt_name, sizes) in LAYOUTS.items():
        ckpt, run = ckpts[ckpt_name], _run(2, ckpt_name == "moe", **sizes)
        batch = rl_batch(hf_model_from(ckpt))
        group = megatron_pair.load(ckpt, run)
        peft_init, none = group.probe(sent_weights)
        assert none is None
        group.call("load_state", str(starts[ckpt_name]))
        before = group.probe(sent_weights)[0]
        logprobs = group.call("compute_logprobs", batch)
        assert logprobs[0] == logprobs[1], "every rank must return the same log-probs"
        grads, none = group.call("compute_gradients", batch)
        assert none is None
        metrics = [group.call("train_step", batch) for _ in range(2)]
        shared = [[{k: v for k, v in r.items() if not k.startswith("mem/")} for r in m] for m in metrics]
        assert all(m[0] == m[1] for m in shared), "every rank must return the same metrics"  # each rank's own memory (mem/trainer<rank>/...) aside
        after = group.probe(sent_weights)[0]
        out[name] = Seen(before, logprobs[0], grads, [m[0] for m in metrics], after, peft_init=peft_init)
        if name == "dp2":
            group.call("save_state", str(saved))
            out["continued"] = group.call("train_step", batch)[0]
            group.call("load_state", str(saved))
            out["reloaded"] = group.call("train_step", batch)[0]
    group = megatron_pair.load(tiny_qwen3_dir, _run(2, **LAYOUTS["tp2"][1]), adapter_names=TENANTS)
    with pytest.raises(Exception, match="load_state: .* lacks 60 tensor"):  # every rank leaves, none hangs
        group.call("load_state", str(starts["dense"]))
    group.call("load_state", str(starts["tenants"]))
    out["tenants"] = group.call("train_step", _mixed(rl_batch(hf_model_from(tiny_qwen3_dir))))[0]
    out["tenants_after"] = group.probe(sent_weights)[0]
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_what_fsdp_trains(layouts: dict[str, Any], fsdp: Seen, fsdp_moe: Seen, name: str):
    _compare(layouts[name], fsdp_moe if LAYOUTS[name][0] == "moe" else fsdp)


def test_tp2_tenants_train_what_fsdp_trains(layouts: dict[str, Any], fsdp: Seen):
    _same_metrics(layouts["tenants"], fsdp.tenant_metrics, TENANT_COMPARED)
    _close(layouts["tenants_after"], fsdp.tenant_after, 3e-5, "tenants' adapters")


def test_state_continues_exactly(layouts: dict[str, Any]):
    def train(m: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in m.items() if k.startswith("train/")}

    assert train(layouts["continued"]) == train(layouts["reloaded"])
    assert layouts["continued"]["train/loss"] != layouts["dp2"].metrics[1]["train/loss"]


# ---- the driver ------------------------------------------------------------------------------------------

def test_tenants_end_to_end_on_megatron(ray_cluster, tmp_path: Path):
    """The run loop with two tenants on trainer=megatron: 'ok' trains, 'broken' (its reward raises on every call)
    sits every update out; the torch engine takes the adapter-only syncs; both adapters are exported."""
    from miles.core.run import run_job

    parity = {"_target_": "plugin_rewards.length_parity", "_partial_": True}
    raises = {"_target_": "plugin_rewards.always_raises", "_partial_": True}
    cfg = {
        "seed": 1, "tracking": {"backend": "none"}, "plugins": {"allow": ["plugin_rewards."]},
        "warm_start": {"steps": 20, "cache_dir": str(tmp_path / "warm")},
        "trainer": {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False,
                    "num_steps": 2, "eval_every": 0},
        "algo": {"num_prompts_per_step": 4, "num_samples_per_prompt": 4},
        "adapter": {"kind": "lora", "rank": 4, "alpha": 8.0, "export_dir": str(tmp_path / "adapters")},
        "tenants": [
            {"name": "ok", "task": {"reward": parity, "reward_timeout_s": 0, "num_eval_prompts": 8}},
            {"name": "broken", "prompt_template": "Count: {prompt}", "max_new_tokens": 6,
             "task": {"name": "count", "source": {"_target_": "miles.tasks.count.CountTask", "max_span": 4},
                      "reward": raises, "reward_timeout_s": 0, "num_eval_prompts": 8}},
        ],
    }
    seen: dict[int, dict] = {}
    final = run_job(validate(cfg), resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.__setitem__(s, m))
    assert sorted(seen) == [0, 1, 2]
    for step in (1, 2):
        m = seen[step]
        assert m["tenant/ok/train/num_tokens"] > 0 and m["tenant/broken/train/num_tokens"] == 0
        assert m["tenant/ok/train/nonfinite_skipped"] == 0 and m["tenant/broken/rollout/failed"] == 16
        assert 0 < m["train/trainable_param_frac"] < 0.2 and m["weight_sync/bytes"] > 0
    assert seen[2]["tenant/ok/train/logp_mismatch_abs_mean"] < 1e-5  # the engine serves what megatron trained
    assert {"tenant/ok/eval/accuracy", "tenant/broken/eval/accuracy", "eval/accuracy"} <= set(final)
    ok = lora.load_adapter_file(tmp_path / "adapters" / "ok")
    broken = lora.load_adapter_file(tmp_path / "adapters" / "broken")
    lora_b = [k for k in ok if ".lora_B." in k]
    assert lora_b and max(ok[k].abs().max().item() for k in lora_b) > 0  # B starts at zero: ok trained
    assert all(broken[k].abs().max().item() == 0 for k in lora_b)  # broken never moved
