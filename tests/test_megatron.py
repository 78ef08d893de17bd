"""Megatron trainer (``trainer=megatron``): megatron-core trains on CPU over gloo and computes what FSDP computes.

Tolerances (fp32, tiny models): logits vs transformers 1e-6 at TP=1 / PP=2 / DP=2 / EP=2 and 1e-5 at
TP=2 (the row-parallel matmuls sum in another order; measured 1.5e-7 everywhere); gradients vs the
FSDP trainer atol 1e-6 (measured ~1e-7); metrics rel 1e-5 / abs 1e-6; weights after two AdamW steps
at lr 1e-4 atol 3e-5 (Adam's first update is ~lr * sign(g): a gradient entry that is ~0 up to
summation order can move by up to lr; measured 1.8e-5). Weight round trips are exact.

The multi-rank layouts run once (module fixture ``layouts``) on the session's two megatron ranks (fixture
``megatron_pair``: two Ray actors in one gloo group, shared with the other megatron test modules and reused
from layout to layout through ``reinit``, as the driver reuses parked actors). Each rank reads
only its slices of the checkpoint (the tied one is stored bf16 in several files); ``pp2_recompute``
runs PP=2 with megatron's activation recompute.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import _save_tiny  # noqa: E402
from fsdp_ranks import hf_model_from, local_trainer, poison_weight, rl_batch  # noqa: E402
from megatron_ranks import (  # noqa: E402
    MegatronPair,
    checkpoint_reads,
    gloo_threads,
    gradients_and_layer_calls,
    local_megatron,
    logits_of,
    redirected_sites,
)
from safetensors.torch import load_file  # noqa: E402

from miles.backends.contract import check_trainer, check_trainer_class  # noqa: E402
from miles.config.validate import ConfigError, validate  # noqa: E402
from miles.train.megatron import MegatronTrainer  # noqa: E402
from miles.train.optim import read_train_tensors  # noqa: E402

pytestmark = pytest.mark.megatron

BASE: dict[str, Any] = {
    "trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "shared_prompt_forward": False},
    "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "clip_high": 0.28, "num_minibatches": 2,
             "loss_agg": "seq_mean_token_mean"},
    "precision": {"tis_clip": 2.0},
}

LAYOUTS: dict[str, tuple[str, dict[str, int]]] = {
    # name: (checkpoint, trainer.* sizes); budgets force several micro-batches (1F1B in flight, DP counts)
    "tp2": ("dense", {"tensor_parallel": 2}),
    "pp2": ("dense", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24}),
    "pp2_tied": ("tied", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24}),
    "dp2": ("dense", {"max_tokens_per_microbatch": 12}),
    "ep2": ("moe", {"expert_parallel": 2, "max_tokens_per_microbatch": 24}),
    "pp2_recompute": ("dense", {"pipeline_parallel": 2, "max_tokens_per_microbatch": 24,
                                "activation_checkpointing": True}),
}

# megatron-core 0.16.1 on CPU: every CUDA call site the compatibility layer redirected in the layouts above
EXPECTED_SITES = {
    "distributed/param_and_grad_buffer.py:806": "torch.cuda.current_device()",
    "models/common/embeddings/rotary_pos_embedding.py:162": "torch.cuda.current_device()",
    "models/common/language_module/language_module.py:244": "Tensor.cuda()",
    "pipeline_parallel/p2p_communication.py:190": "torch.cuda.current_device()",
    "pipeline_parallel/p2p_communication.py:194": "torch.cuda.current_device()",
    "pipeline_parallel/p2p_communication.py:198": "torch.cuda.current_device()",
    "pipeline_parallel/p2p_communication.py:202": "torch.cuda.current_device()",
    "pipeline_parallel/p2p_communication.py:242": "torch.cuda.synchronize()",
    "pipeline_parallel/p2p_communication.py:313": "torch.cuda.current_device()",
    "pipeline_parallel/p2p_communication.py:321": "torch.cuda.current_device()",
    "pipeline_parallel/p2p_communication.py:398": "torch.cuda.synchronize()",
    "pipeline_parallel/schedules.py:596": "torch.zeros(device='cuda')",
    "pipeline_parallel/schedules.py:2138": "torch.zeros(device='cuda')",
    "tensor_parallel/mappings.py:141": "torch.cuda.current_device()",
    "tensor_parallel/mappings.py:442": "torch.cuda.current_device()",
    "tensor_parallel/mappings.py:444": "all_to_all_single split sizes as tensors",
    "tensor_parallel/random.py:55": "torch.cuda.random.get_rng_state()",
    "tensor_parallel/random.py:111": "torch.cuda._lazy_call() (CUDA generator state)",
    "transformer/moe/router.py:90": "torch.cuda.current_device()",
    "transformer/moe/token_dispatcher.py:445": "torch.cuda.Stream()",
    "transformer/moe/token_dispatcher.py:871": "torch.cuda.current_stream()",
    "transformer/moe/token_dispatcher.py:874": "torch.cuda.stream()",
    "utils.py:631": "torch.cuda.current_device()",
}


def _run(moe: bool = False, **trainer: int) -> Any:
    """The run of a layout (world size 2) or, with no sizes, of one rank; ``moe``: the Qwen3-MoE model spec."""
    cfg = copy.deepcopy(BASE)
    cfg["trainer"].update(trainer)
    cfg["placement"] = {"trainer_world_size": 2 if trainer else 1}
    if moe:
        cfg["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
    return validate(cfg)


@pytest.fixture(scope="module")
def checkpoints(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, Path]:
    """The tied checkpoint is stored bf16 in several files with an index (ranks read slices of every form)."""
    from transformers import AutoModelForCausalLM

    tied = _save_tiny(tmp_path_factory.mktemp("tiny_qwen3_tied_fp32"), moe=False, tie_word_embeddings=True)
    stored = tmp_path_factory.mktemp("tiny_qwen3_tied")
    AutoModelForCausalLM.from_pretrained(tied, dtype=torch.bfloat16).save_pretrained(stored, max_shard_size="20KB")
    assert (stored / "model.safetensors.index.json").is_file()
    return {"dense": tiny_qwen3_dir, "tied": stored, "moe": tiny_qwen3_moe_dir}


def _ids(batch: Any) -> list[list[int]]:
    return [p[:3] + r[:2] for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)][:4]


@dataclasses.dataclass
class Layouts:
    """The layouts' results, and the DP layout's state: saved, a step after, the same step after reloading."""

    seen: dict[str, Seen]
    saved: Path
    continued: list[dict[str, float]]
    reloaded: list[dict[str, float]]
    traces: list[bytes]
    """Each rank's torch profiler trace of the ``continued`` step (``profile.steps``)."""


@dataclasses.dataclass
class Seen:
    """What one layout computed (rank 0's values unless named otherwise)."""

    state: dict[str, torch.Tensor]
    logits: torch.Tensor
    logprobs: list[list[list[float]]]  # per rank
    grads: dict[str, torch.Tensor]
    metrics: list[dict[str, float]]  # per rank
    after: dict[str, torch.Tensor]
    sites: dict[str, str]
    reads: list[dict[str, int]]  # per rank: elements read of each stored tensor
    layer_calls: list[int]  # per rank: decoder-layer forwards during compute_gradients


@pytest.fixture(scope="module")
def fsdp_reference(checkpoints: dict[str, Path]) -> dict[str, tuple]:
    """FSDP at world size 1 per checkpoint: (hf model, batch, gradients, train_step metrics, weights after)."""
    out = {}
    for name, ckpt in checkpoints.items():
        hf = hf_model_from(ckpt)
        batch = rl_batch(hf)
        with local_trainer(ckpt, _run()) as t:
            grads = t.compute_gradients(batch)
            metrics = t.train_step(batch)
            after = t.full_state_dict()
        out[name] = (hf, batch, grads, metrics, after)
    return out


@pytest.fixture(scope="module")
def layouts(megatron_pair: MegatronPair, checkpoints: dict[str, Path], fsdp_reference: dict[str, tuple],
            tmp_path_factory: pytest.TempPathFactory) -> Layouts:
    """Every layout of :data:`LAYOUTS` on two ranks; the DP layout also saves, continues and reloads its state."""
    seen: dict[str, Seen] = {}
    saved = tmp_path_factory.mktemp("megatron_state") / "state"
    for name, (ckpt_name, sizes) in LAYOUTS.items():
        ckpt, run = checkpoints[ckpt_name], _run(ckpt_name == "moe", **sizes)
        hf, batch = fsdp_reference[ckpt_name][:2]
        group = megatron_pair.load(ckpt, run)
        reads = group.probe(checkpoint_reads)
        state, none = group.call("full_state_dict")
        assert none is None
        logits = group.probe(logits_of, _ids(batch))[0]
        logprobs = group.call("compute_logprobs", batch)
        (grads, calls), (none, calls_1) = group.probe(gradients_and_layer_calls, batch)
        assert none is None
        metrics = group.call("train_step", batch)
        after, _ = group.call("full_state_dict")
        sites = {k: v for s in group.probe(redirected_sites) for k, v in s.items()}
        seen[name] = Seen(state, logits, logprobs, grads, metrics, after, sites, reads, [calls, calls_1])
        if name == "dp2":
            group.call("save_state", str(saved))
            group.call("start_profile")
            continued = group.call("train_step", batch)
            traces = group.call("stop_profile")
            group.call("load_state", str(saved))
            reloaded = group.call("train_step", batch)
    return Layouts(seen=seen, saved=saved, continued=continued, reloaded=reloaded, traces=traces)


# ---- config checks -------------------------------------------------------------------------------

def test_check_config_refuses_impossible_layouts():
    def refused(match: str, model: str | None = None, **cfg: Any) -> None:
        full = copy.deepcopy(BASE)
        for key, value in cfg.items():
            group, field = key.split("__")
            full.setdefault(group, {})[field] = value
        if model:
            full["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
        with pytest.raises(ConfigError, match=match):
            check_trainer_class(MegatronTrainer, validate(full))

    refused(r"placement.trainer_world_size \(2\) must be a multiple of trainer.tensor_parallel \(2\) x "
            r"trainer.pipeline_parallel \(2\) = 4", placement__trainer_world_size=2, trainer__tensor_parallel=2,
            trainer__pipeline_parallel=2)
    refused(r"trainer.tensor_parallel \(4\) must divide the model's num_key_value_heads \(2\)",
            placement__trainer_world_size=4, trainer__tensor_parallel=4)
    refused(r"trainer.pipeline_parallel \(4\) must divide the model's num_hidden_layers \(2\)",
            placement__trainer_world_size=4, trainer__pipeline_parallel=4)
    refused(r"trainer.expert_parallel=2: the model \(qwen3\) has no experts", placement__trainer_world_size=2,
            trainer__expert_parallel=2)
    refused(r"trainer.expert_parallel \(8\) must divide the model's num_experts \(4\)", "moe",
            placement__trainer_world_size=8, trainer__expert_parallel=8)
    refused(r"trainer.expert_parallel \(2\) must divide the data-parallel size 1 = "
            r"placement.trainer_world_size \(2\) / \(trainer.tensor_parallel \(1\) x trainer.pipeline_parallel "
            r"\(2\)\)", "moe", placement__trainer_world_size=2, trainer__expert_parallel=2,
            trainer__pipeline_parallel=2)
    refused(r"trainer.tensor_parallel=2 with an MoE model", "moe", placement__trainer_world_size=2,
            trainer__tensor_parallel=2)
    refused(r"trainer.shared_prompt_forward=true", trainer__shared_prompt_forward=True)
    # what the layouts below run passes, and the FSDP trainer refuses the sizes it cannot do
    for ckpt_name, sizes in LAYOUTS.values():
        check_trainer_class(MegatronTrainer, _run(ckpt_name == "moe", **sizes))
    from miles.train.fsdp import FSDPTrainer

    with pytest.raises(ConfigError, match="FSDPTrainer does not support tensor parallelism"):
        check_trainer_class(FSDPTrainer, _run(tensor_parallel=2))


# ---- pure math -------------------------------------------------------------------------------------

def test_routing_is_transformers_qwen3_moe_router(tiny_qwen3_moe_dir: Path):
    from miles.train.megatron.model import hf_topk_routing

    hf = hf_model_from(tiny_qwen3_moe_dir)
    gate = hf.model.layers[0].mlp.gate
    x = torch.randn(50, gate.hidden_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = gate(x)[0]
    for normalize in (True, False):
        gate.norm_topk_prob = normalize
        with torch.no_grad():
            _, want, want_index = gate(x)
        probs, routing_map = hf_topk_routing(logits, gate.top_k, normalize=normalize)
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, want_index, True))
        assert torch.equal(probs.gather(1, want_index), want), "routing weights must be transformers' bit for bit"
        assert torch.equal(probs.count_nonzero(1), torch.full((50,), gate.top_k))
        if normalize:
            torch.testing.assert_close(probs.sum(-1), torch.ones(50))


def test_vocab_parallel_logprobs_are_the_plain_ones():
    from miles.algos.logprobs import entropy_from_logits, token_logprobs
    from miles.train.megatron.logits import vocab_parallel_logp_entropy

    g = torch.Generator().manual_seed(0)
    real = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    padded = torch.cat([real, 50 * torch.ones(2, 3, 2)], dim=-1)  # padding columns must not count
    targets = torch.randint(0, 5, (2, 3), generator=g)
    logp, entropy = vocab_parallel_logp_entropy(padded, targets, vocab_size=5, temperature=0.7)
    want_logp, want_entropy = token_logprobs(real, targets, 0.7), entropy_from_logits(real, 0.7)
    torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-6, rtol=0)
    grad, = torch.autograd.grad((logp + 0.3 * entropy).sum(), real)
    want_grad, = torch.autograd.grad((want_logp + 0.3 * want_entropy).sum(), real)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("ckpt_name", ["dense", "tied", "moe"])
def test_mapping_round_trip_under_every_layout(checkpoints: dict[str, Path], ckpt_name: str):
    """HF -> every rank's megatron shards -> HF is the identity, under TP=2, PP=2, TP=2 x PP=2 and EP=2."""
    from miles.train.megatron.arch import Arch
    from miles.train.megatron.mapping import Coords, entries, join_experts, shard, split_experts, unshard

    hf = hf_model_from(checkpoints[ckpt_name])
    sd = hf.state_dict()
    arch = Arch.from_hf(hf.config)
    pieces = split_experts(sd)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    layouts = [(2, 1, 1), (1, 2, 1), (2, 2, 1)] if not arch.is_moe else [(1, 1, 2), (1, 2, 2)]
    for tp, pp, ep in layouts:
        back: dict[str, torch.Tensor] = {}
        for pp_rank in range(pp):
            for ep_rank in range(ep):
                per_tp = [{e.local: shard(e, pieces, arch, tp, r) for e in entries(arch, Coords(
                    tp=tp, tp_rank=r, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank))} for r in range(tp)]
                assert all(t.is_contiguous() for shards in per_tp for t in shards.values())
                for e in entries(arch, Coords(tp=tp, tp_rank=0, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)):
                    if not e.tied_copy:
                        back.update(unshard(e, [shards[e.local] for shards in per_tp], arch))
        out = join_experts(back, shapes, arch)
        assert list(out) == list(sd), (tp, pp, ep)
        for k, v in sd.items():
            assert torch.equal(out[k], v), (tp, pp, ep, k)


# ---- one rank in this process ----------------------------------------------------------------------

def test_one_rank_meets_the_trainer_contract(checkpoints: dict[str, Path], fsdp_reference: dict[str, tuple]):
    """World size 1 with tied embeddings (one stage holds both uses of the weight)."""
    from miles.train.megatron import compat

    hf, batch, grads = fsdp_reference["tied"][:3]
    run = _run()
    check_trainer_class(MegatronTrainer, run)
    with local_megatron(checkpoints["tied"], run) as trainer:
        ids = _ids(batch)
        with torch.no_grad():
            want = hf(input_ids=torch.tensor(ids)).logits
        torch.testing.assert_close(logits_of(trainer, ids), want, atol=1e-6, rtol=0)
        got = trainer.compute_gradients(batch)  # the tied weight's gradient sums both of its uses
        assert got is not None and list(got) == list(grads)
        for k in grads:
            torch.testing.assert_close(got[k], grads[k], atol=1e-6, rtol=1e-5, msg=k)
        check_trainer(trainer, batch, hf.state_dict())
        assert set(compat.redirected_sites()) <= set(EXPECTED_SITES)
        # a NaN advantage in each mini-batch makes its loss non-finite: both updates are skipped and counted
        before = trainer.full_state_dict()
        nan = [float("nan") if i in (0, 4) else a for i, a in enumerate(batch.advantages)]
        assert trainer.train_step(dataclasses.replace(batch, advantages=nan))["train/nonfinite_skipped"] == 2
        after = trainer.full_state_dict()
        assert before is not None and after is not None
        assert all(torch.equal(after[k], v) for k, v in before.items())


def test_one_rank_skips_zero_advantage_samples_with_the_same_gradients(checkpoints: dict[str, Path],
                                                                      fsdp_reference: dict[str, tuple]):
    """``trainer.skip_zero_advantage`` (GRPO's defaults: no KL, no entropy term): a group with no spread stays
    out of the passes, and the gradients and the loss are those of the whole batch."""
    batch = fsdp_reference["dense"][1]
    batch = dataclasses.replace(batch, advantages=[0.0 if i < 4 else a for i, a in enumerate(batch.advantages)])
    got = {}
    for skip in (True, False):
        run = validate({"trainer": {"lr": 1e-4, "lr_warmup_steps": 0, "shared_prompt_forward": False,
                                    "skip_zero_advantage": skip}, "algo": {"num_minibatches": 1}})
        with local_megatron(checkpoints["dense"], run) as trainer:
            assert trainer.skip_zero_advantage is skip
            got[skip] = trainer.compute_gradients(batch), trainer.train_step(batch)
    (g_on, m_on), (g_off, m_off) = got[True], got[False]
    assert m_on["train/skipped_samples"] == 4 and m_off["train/skipped_samples"] == 0
    for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/num_tokens"):
        assert m_on[k] == pytest.approx(m_off[k], rel=1e-5, abs=1e-7), k
    for k in g_off:
        torch.testing.assert_close(g_on[k], g_off[k], atol=1e-7, rtol=1e-5, msg=k)


def test_one_rank_moe_logits_are_transformers(checkpoints: dict[str, Path], fsdp_reference: dict[str, tuple]):
    from miles.train.megatron import compat

    hf, batch = fsdp_reference["moe"][:2]
    with local_megatron(checkpoints["moe"], _run()) as trainer:
        assert sorted(compat.patched_names()) == [
            "megatron.core.tensor_parallel.layers.LinearWithFrozenWeight",
            "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication",
            "megatron.core.transformer.moe.moe_utils.te_general_gemm"]
        ids = _ids(batch)
        with torch.no_grad():
            want = hf(input_ids=torch.tensor(ids)).logits
        torch.testing.assert_close(logits_of(trainer, ids), want, atol=1e-6, rtol=0)
        for got, ref in zip(trainer.compute_logprobs(batch), batch.rollout_logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-6, rtol=0)


def test_compat_warns_on_another_megatron_version(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    import megatron.core

    from miles.train.megatron import compat

    compat.uninstall()
    try:
        monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
        # the record reaches caplog whatever logging set-up an earlier test in this process left behind
        monkeypatch.setattr(compat.log, "disabled", False)
        monkeypatch.setattr(compat.log, "propagate", True)
        with caplog.at_level("WARNING", logger=compat.__name__):
            assert compat.install()
        assert "megatron-core 0.17.0" in caplog.text and "must be re-checked" in caplog.text
    finally:
        compat.uninstall()
        monkeypatch.undo()
        compat.install()


# ---- two ranks: TP, PP, PP with tied embeddings, DP, MoE EP --------------------------------------------

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_computes_what_fsdp_computes(layouts: Layouts, fsdp_reference: dict[str, tuple], name: str):
    hf, batch, grads, metrics, after = fsdp_reference[LAYOUTS[name][0]]
    seen = layouts.seen[name]
    hf_sd = hf.state_dict()
    # weights in: HF -> shards -> HF exactly, with real collectives
    assert list(seen.state) == list(hf_sd)
    for k, v in hf_sd.items():
        assert seen.state[k].dtype == torch.float32 and torch.equal(seen.state[k], v), k
    # logits and log-probs are transformers'
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(_ids(batch))).logits
    torch.testing.assert_close(seen.logits, want, atol=1e-5 if name == "tp2" else 1e-6, rtol=0)
    assert seen.logprobs[0] == seen.logprobs[1], "every rank must return the same log-probs"
    for got, ref in zip(seen.logprobs[0], batch.rollout_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=2e-6, rtol=0)
    # the gradient of the same objective, in HF names
    assert list(seen.grads) == list(grads)
    assert max(g.abs().max().item() for g in grads.values()) > 1e-2
    for k in grads:
        torch.testing.assert_close(seen.grads[k], grads[k], atol=1e-6, rtol=1e-5, msg=k)
    # one train step: the same metrics on every rank, FSDP's values, FSDP's weights
    m = seen.metrics[0]
    shared = [{k: v for k, v in r.items() if not k.startswith("mem/")} for r in seen.metrics]
    assert shared[1] == shared[0], "every rank must return the same metrics"  # each rank's own memory (mem/trainer<rank>/...) aside
    assert set(m) == set(metrics)
    for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/entropy", "train/clip_frac_low",
              "train/clip_frac_high", "train/tis_clip_frac", "train/num_tokens", "train/lr"):
        assert m[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k
    assert m["train/kl"] > 0 and m["train/nonfinite_skipped"] == 0
    moved = max((after[k] - hf_sd[k]).abs().max().item() for k in hf_sd)
    assert moved > 1e-4
    for k in hf_sd:
        torch.testing.assert_close(seen.after[k], after[k], atol=3e-5, rtol=0, msg=k)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_reads_only_its_slices(layouts: Layouts, checkpoints: dict[str, Path], name: str):
    """TP ranks read their rows or columns, PP stages their layers, EP ranks their experts; nothing twice."""
    from safetensors import safe_open

    ckpt_name, sizes = LAYOUTS[name]
    stored: dict[str, int] = {}
    for path in checkpoints[ckpt_name].glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            stored.update({n: int(torch.Size(f.get_slice(n).get_shape()).numel()) for n in f.keys()})
    assert "lm_head.weight" not in stored if ckpt_name == "tied" else "lm_head.weight" in stored

    def share(rank: int, n: str) -> float:
        """The part of stored tensor ``n`` that ``rank`` keeps."""
        layer = int(n.split(".")[2]) if n.startswith("model.layers.") else None
        if sizes.get("pipeline_parallel", 1) == 2:
            stage = {"model.embed_tokens.weight": 0, "model.norm.weight": 1, "lm_head.weight": 1}.get(n, layer)
            tied_head = ckpt_name == "tied" and n == "model.embed_tokens.weight"  # the last stage's copy
            return 1.0 if stage == rank or tied_head else 0.0
        if sizes.get("tensor_parallel", 1) == 2:
            return 1.0 if n.endswith("norm.weight") else 0.5
        if sizes.get("expert_parallel", 1) == 2 and ".mlp.experts." in n:
            return 1.0 if int(n.split(".")[5]) // 2 == rank else 0.0
        return 1.0

    for rank, reads in enumerate(layouts.seen[name].reads):
        want = {n: int(numel * share(rank, n)) for n, numel in stored.items() if share(rank, n) > 0}
        assert reads == want, (name, rank)


def test_activation_recompute_gives_the_same_gradients_at_pp2(layouts: Layouts):
    """megatron's full recompute: every layer runs its forward again in the backward; the gradients are the
    plain run's, bit for bit (CPU ops are deterministic; the recompute repeats them)."""
    plain, recomputed = layouts.seen["pp2"], layouts.seen["pp2_recompute"]
    assert min(plain.layer_calls) > 0 and recomputed.layer_calls == [2 * c for c in plain.layer_calls]
    assert list(recomputed.grads) == list(plain.grads)
    for k, g in plain.grads.items():
        assert torch.equal(recomputed.grads[k], g), k


def test_state_continues_exactly_and_is_fsdps_layout(layouts: Layouts, checkpoints: dict[str, Path], tmp_path: Path):
    directory = layouts.saved
    def train(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{k: v for k, v in m.items() if k.startswith("train/")} for m in metrics]

    assert train(layouts.continued) == train(layouts.reloaded), "a step after load_state must repeat the step after " \
        "save_state exactly"
    assert layouts.continued[0]["train/loss"] != layouts.seen["dp2"].metrics[0]["train/loss"]
    # profiled (profile.steps): each rank's trace names the forward and backward ops; each reports its memory
    for rank, (trace, metrics) in enumerate(zip(layouts.traces, layouts.continued, strict=True)):
        names = {e["name"] for e in json.loads(gzip.decompress(trace))["traceEvents"] if e.get("ph") == "X"}
        assert "aten::mm" in names and any(n.startswith("autograd::engine::evaluate_function") for n in names), rank
        assert metrics[f"mem/trainer{rank}/rss_bytes"] > 0
    # the FSDP trainer (one rank) reads the sharded state megatron's two ranks wrote and writes the same tensors
    # back (names, layout, values)
    with local_trainer(checkpoints["dense"], _run()) as fsdp:
        fsdp.load_state(str(directory))
        fsdp.save_state(str(tmp_path / "fsdp"))
    assert json.loads((directory / "trainer_state.json").read_text())["format"] == 2
    for ours, name in zip(read_train_tensors(directory), ("model.safetensors", "optimizer.safetensors"), strict=True):
        theirs = load_file(tmp_path / "fsdp" / name)
        assert sorted(ours) == sorted(theirs), name
        assert len(ours) > 20
        for k in ours:
            assert torch.equal(ours[k], theirs[k]), (name, k)
    meta = json.loads((directory / "trainer_state.json").read_text())
    assert meta["scheduler"] == json.loads((tmp_path / "fsdp" / "trainer_state.json").read_text())["scheduler"]


def test_compat_redirects_exactly_the_known_sites(layouts: Layouts):
    """An upgrade of megatron-core that moves, adds or removes a CUDA call site fails here, saying which."""
    seen = {k: v for name in LAYOUTS for k, v in layouts.seen[name].sites.items()}
    new = {k: v for k, v in seen.items() if k not in EXPECTED_SITES}
    gone = {k: v for k, v in EXPECTED_SITES.items() if k not in seen}
    changed = {k: (EXPECTED_SITES[k], v) for k, v in seen.items() if k in EXPECTED_SITES and EXPECTED_SITES[k] != v}
    assert not (new or gone or changed), (
        f"megatron-core's CUDA call sites moved (miles/train/megatron/compat.py, pinned to 0.16.1): new {new}, "
        f"no longer seen {gone}, changed {changed}; update compat.py's table and EXPECTED_SITES")


def test_the_driver_side_imports_no_megatron():
    """``import miles``, resolving ``trainer=megatron`` and its class checks import nothing from megatron."""
    import subprocess
    import sys

    code = ("import sys; import miles; from miles.config.validate import validate; "
            "from miles.core.plan import backends; "
            "b = backends(validate({'trainer': {'_target_': 'miles.train.megatron.MegatronTrainer', "
            "'tensor_parallel': 2, 'shared_prompt_forward': False}, 'placement': {'trainer_world_size': 2}})); "
            "print(b.trainer.__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "MegatronTrainer []", out.stdout + out.stderr


@pytest.mark.slow
def test_ppo_with_kl_and_two_minibatches_runs_end_to_end_on_megatron(ray_cluster, tmp_path: Path) -> None:
    """The driver with trainer=megatron and PPO: the policy on megatron, the critic (FSDP) beside it."""
    import math

    from miles.bench.e2e import compose
    from miles.core.run import run_job

    overrides = ["trainer=megatron", "algo=ppo", "algo.kl_coef=0.05", "algo.num_minibatches=2",
                 "algo.num_prompts_per_step=4", "algo.num_samples_per_prompt=4", "trainer.num_steps=2",
                 "trainer.eval_every=0", "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=2",
                 "warm_start.steps=40", f"warm_start.cache_dir={tmp_path}", "tracking=none"]
    run, resolved = compose(overrides)
    seen: dict[int, dict[str, float]] = {}
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.update({s: m}))
    for step in (1, 2):
        m = seen[step]
        for k in ("train/loss", "train/kl", "train/grad_norm", "critic/value_loss", "critic/grad_norm"):
            assert math.isfinite(m[k]), (step, k)
        assert m["train/nonfinite_skipped"] == 0
    assert seen[2]["train/kl"] > 0  # the policy moved away from its reference
    assert "eval/accuracy" in seen[2]


def test_a_state_with_nonfinite_weights_is_never_written(megatron_pair: MegatronPair, checkpoints: dict[str, Path],
                                                         tmp_path: Path):
    """TP=2, a NaN in rank 1's half of a weight only: both ranks refuse the save (neither waits on the other)
    and nothing is written."""
    import ray

    group = megatron_pair.load(checkpoints["dense"], _run(tensor_parallel=2))
    assert group.probe(poison_weight, 1)[1] is not None
    refs = [a.save_state.remote(str(tmp_path / "state")) for a in group.actors]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"refusing to write .*/state: 1 parameter tensor\(s\) "
                                                              r"hold NaN or inf \(model.embed_tokens.weight\)"):
            ray.get(ref, timeout=60)
    assert not (tmp_path / "state").exists() and not (tmp_path / "state.tmp").exists()


def test_a_reused_rank_keeps_no_process_group_of_its_last_job(megatron_pair: MegatronPair,
                                                              checkpoints: dict[str, Path]):
    """A job ends with its process groups destroyed, even those megatron's rotary embedding cache would keep
    (each would hold three gloo threads for the rest of the process): a TP=2 job and a step, run again and
    again in the parked ranks, leaves no more gloo threads each time. (After the first reuse a rank runs three
    more than a fresh one, once; later jobs add none.)"""
    batch = rl_batch(hf_model_from(checkpoints["dense"]))
    counts = []
    for _ in range(3):
        group = megatron_pair.load(checkpoints["dense"], _run(tensor_parallel=2))
        group.call("train_step", batch)
        counts.append(group.probe(gloo_threads))
    assert counts[1] == counts[2], counts
