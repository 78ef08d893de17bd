"""LoRA (adapter=lora): the trainer trains peft adapters only, the engine serves them per request on one
base, the weight sync sends adapter tensors only, and exported adapters load in peft unchanged."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from fsdp_ranks import Group, free_port, hf_logprobs, hf_model_from, local_trainer, rl_batch

from miles.adapters import lora
from miles.config import RankConfig
from miles.config.schema import AdapterConfig, PrecisionConfig
from miles.config.validate import ConfigError, validate
from miles.rollout.torch_engine import TorchEngine
from miles.tracking import prometheus
from miles.train.fsdp import FSDPTrainer
from miles.types import GenerateRequest, SamplingParams

pytest.importorskip("peft")

LORA = {"adapter": {"kind": "lora", "rank": 4, "alpha": 8.0, "lr": 1e-2},
        "trainer": {"lr_warmup_steps": 0}}
GREEDY = SamplingParams(greedy=True, max_new_tokens=6)


def _random_adapters(state: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in state.items()}


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir: Path) -> torch.nn.Module:
    return hf_model_from(tiny_qwen3_dir)


def test_a_train_step_moves_the_adapters_only_and_the_export_loads_in_peft(tiny_qwen3_dir, hf_model, tmp_path):
    from peft import PeftModel

    run = validate(LORA)
    batch = rl_batch(hf_model)
    with local_trainer(tiny_qwen3_dir, run) as trainer:
        counts = trainer.trainable_parameters()
        assert 0 < counts["trainable"] < 0.1 * counts["total"]
        # the optimizer holds the adapters' parameters only
        held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        names = {n for n, p in trainer.model.named_parameters() if id(p) in held}
        assert names and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
        base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in names}
        before = lora.adapter_state(trainer.model, "default")
        metrics = trainer.train_step(batch)
        assert metrics["train/nonfinite_skipped"] == 0
        after = lora.adapter_state(trainer.model, "default")
        assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-4, "the adapters did not train"
        for n, p in trainer.model.named_parameters():
            if n in base_before:
                assert torch.equal(p, base_before[n]), f"frozen base weight {n} changed"

        # export in PEFT format; peft loads it onto the checkpoint and computes the trainer's log-probs
        (path,) = trainer.export_adapters(str(tmp_path / "export"))
        assert sorted(p.name for p in Path(path).iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
        config = json.loads((Path(path) / lora.CONFIG_FILE).read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
        loaded = PeftModel.from_pretrained(hf_model_from(tiny_qwen3_dir), path).eval()
        want = trainer.compute_logprobs(batch)
    got = hf_logprobs(loaded, batch.prompt_ids, batch.response_ids)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-5, rtol=0)
    # and the base model alone is what the policy started as (the exported adapter changes it)
    base = hf_logprobs(hf_model, batch.prompt_ids, batch.response_ids)
    assert max(abs(a - b) for g, b_ in zip(got, base, strict=True) for a, b in zip(g, b_, strict=True)) > 1e-4


def test_world_sizes_1_2_4_train_the_same_adapter(ray_cluster, tiny_qwen3_dir, hf_model, tmp_path):
    run = validate(LORA | {"algo": {"num_minibatches": 2}})
    batch = rl_batch(hf_model)
    with local_trainer(tiny_qwen3_dir, run) as one:
        want_metrics = one.train_step(batch)
        want = lora.adapter_state(one.model, "default")
    for ws in (2, 4):
        group = Group(ray_cluster, ws, tiny_qwen3_dir, run)
        try:
            metrics = group.call("train_step", batch)[0]
            assert metrics["train/loss"] == pytest.approx(want_metrics["train/loss"], rel=1e-5, abs=1e-6)
            paths = group.call("export_adapters", str(tmp_path / f"ws{ws}"))
            assert paths[0] and not any(paths[1:])  # rank 0 writes
            got = lora.load_adapter_file(paths[0][0])
            assert sorted(got) == sorted(want)
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, atol=1e-5, rtol=0, msg=f"world size {ws}: {k}")
        finally:
            group.close()


def test_engine_serves_several_adapters_in_one_batch(tiny_qwen3_dir):
    # lm_head too: the engine calls it apart from the decoder, and each row must still use its own adapter
    adapter = AdapterConfig(kind="lora", rank=4, alpha=8.0,
                            target_modules=AdapterConfig().target_modules)
    eng = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig(), adapter=adapter, adapter_names=("a", "b"))
    plain = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig())
    try:
        assert eng.health()["adapters"] == ["a", "b"]
        sd = {f"{lora.SYNC_PREFIX}{n}:{k}": v for n in ("a", "b")
              for k, v in _random_adapters(eng.adapter_state(n), seed=ord(n)).items()}
        metrics = eng.update_weights(sd, 3)
        assert eng.weight_version() == 3 and metrics["bytes"] == sum(v.numel() * 4 for v in sd.values())
        reqs = [GenerateRequest(request_id=f"r{i}", prompt_ids=(3, 4, 5 + i % 3), adapter=name)
                for i, name in enumerate(["a", "b", lora.BASE, None, "b", "a"])]
        mixed = eng.generate(reqs, GREEDY)
        # each row as if it were alone in the batch; the base rows as the engine without adapters
        for req, res in zip(reqs, mixed, strict=True):
            alone = (plain if req.adapter == lora.BASE else eng).generate([req], GREEDY)[0]
            assert res.response_ids == alone.response_ids
            torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        # no adapter named: the default (first) one; the adapters change the outputs
        assert (eng.generate([reqs[3]], GREEDY)[0].logprobs
                == eng.generate([dataclasses.replace(reqs[3], adapter="a")], GREEDY)[0].logprobs)
        assert len({tuple(r.logprobs) for r in mixed[:3]}) == 3
        with pytest.raises(ValueError, match="adapter 'c' is not one this engine holds"):
            eng.generate([dataclasses.replace(reqs[0], adapter="c")], GREEDY)
        # a full state dict, an unknown adapter or a wrong shape is refused with nothing applied
        with pytest.raises(ValueError, match="takes adapter tensors only"):
            eng.update_weights(plain.state_dict(), 4)
        with pytest.raises(ValueError, match="unknown adapter 'c'"):
            eng.update_weights({k.replace(":a:", ":c:"): v for k, v in sd.items()}, 4)
        bad = {k: (v[:, :1] if i == 0 else v) for i, (k, v) in enumerate(sd.items())}
        with pytest.raises(ValueError, match="expected"):
            eng.update_weights(bad, 4)
        assert eng.weight_version() == 3
        torch.testing.assert_close(torch.tensor(eng.generate(reqs[:1], GREEDY)[0].logprobs),
                                   torch.tensor(mixed[0].logprobs), atol=1e-5, rtol=0)
    finally:
        eng.close()
        plain.close()


def test_adapter_only_sync_equals_full_weight_sync(tiny_qwen3_dir, hf_model):
    """The engine with the adapter synced generates what an engine given the merged full weights does."""
    run = validate(LORA)
    with local_trainer(tiny_qwen3_dir, run) as trainer:
        trainer.train_step(rl_batch(hf_model))
        adapter_sd = lora.sync_state(trainer.model, ("default",))
        merged = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    with_adapter = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig(), adapter=run.adapter)
    full = TorchEngine(str(tiny_qwen3_dir), PrecisionConfig())
    try:
        small = with_adapter.update_weights(adapter_sd, 1)
        big = full.update_weights(merged, 1)
        assert small["bytes"] < 0.2 * big["bytes"]
        reqs = [GenerateRequest(request_id=f"r{i}", prompt_ids=tuple(3 + (5 * i + t) % 80 for t in range(2 + i)),
                                n=2, seed=i) for i in range(6)]
        sampled = SamplingParams(temperature=1.0, max_new_tokens=8)
        for sp in (GREEDY, sampled):
            a, b = with_adapter.generate(reqs, sp), full.generate(reqs, sp)
            for x, y in zip(a, b, strict=True):
                assert x.response_ids == y.response_ids
                torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    finally:
        with_adapter.close()
        full.close()


@pytest.mark.parametrize(("overrides", "match"), [
    ({"trainer": {"_target_": "miles.train.critic.FSDPCritic"}}, "does not train adapters"),
    ({"adapter": {"dropout": 0.1}}, "adapter.dropout=0.1"),
    ({"adapter": {"rank": 0}}, "adapter.rank"),
    ({"precision": {"true_on_policy": True}}, "true_on_policy"),
])
def test_config_errors(overrides: dict, match: str) -> None:
    cfg = copy.deepcopy(LORA)
    for k, v in overrides.items():
        cfg[k] = cfg.get(k, {}) | v
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_an_adapters_samples_never_move_another_adapter(tiny_qwen3_dir, hf_model):
    run = validate(LORA)
    batch = rl_batch(hf_model)
    trainer = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                          checkpoint_dir=str(tiny_qwen3_dir), config=RankConfig.of(run), num_threads=1,
                          adapter_names=("a", "b"))
    try:
        start = {n: lora.adapter_state(trainer.model, n) for n in ("a", "b")}
        # a batch of a's samples only: b keeps its weights and gets no optimizer state
        metrics = trainer.train_step(dataclasses.replace(batch, adapters=["a"] * len(batch)))
        assert metrics["tenant/a/train/num_tokens"] == sum(map(sum, batch.loss_mask))
        assert not any(k.startswith("tenant/b/") for k in metrics)
        a1, b1 = (lora.adapter_state(trainer.model, n) for n in ("a", "b"))
        assert max((a1[k] - start["a"][k]).abs().max().item() for k in a1) > 1e-4
        assert all(torch.equal(b1[k], start["b"][k]) for k in b1)
        assert not any(trainer.optimizer.state.get(p) for p in trainer.tenant_params["b"])
        # both in one batch, b's samples with no loss token (as when its reward failed): b sits it out
        half = len(batch) // 2
        mixed = dataclasses.replace(batch, adapters=["a"] * half + ["b"] * half,
                                    loss_mask=batch.loss_mask[:half] + [[0] * len(m) for m in batch.loss_mask[half:]])
        metrics = trainer.train_step(mixed)
        assert metrics["tenant/b/train/num_tokens"] == 0 and metrics["tenant/a/train/num_tokens"] > 0
        a2, b2 = (lora.adapter_state(trainer.model, n) for n in ("a", "b"))
        assert max((a2[k] - a1[k]).abs().max().item() for k in a2) > 1e-4
        assert all(torch.equal(b2[k], start["b"][k]) for k in b2)
        # a's samples through b: the same samples move b, and a no more
        trainer.train_step(dataclasses.replace(batch, adapters=["b"] * len(batch)))
        a3, b3 = (lora.adapter_state(trainer.model, n) for n in ("a", "b"))
        assert all(torch.equal(a3[k], a2[k]) for k in a3)
        assert max((b3[k] - b2[k]).abs().max().item() for k in b3) > 1e-4
        with pytest.raises(ValueError, match=r"adapters \['c'\]"):
            trainer.train_step(dataclasses.replace(batch, adapters=["c"] * len(batch)))
    finally:
        trainer.shutdown()


def test_tenants_train_their_own_adapters_and_a_broken_reward_stops_only_its_tenant(ray_cluster, tmp_path):
    """Two tenants end to end: 'ok' (reward varies within every group) trains, 'broken' (its reward raises
    on every call) sits every update out; the run finishes and exports both adapters."""
    from miles.core.run import run_job

    parity = {"_target_": "plugin_rewards.length_parity", "_partial_": True}
    raises = {"_target_": "plugin_rewards.always_raises", "_partial_": True}
    cfg = {
        "seed": 1, "tracking": {"backend": "none", "prometheus_port": 0}, "plugins": {"allow": ["plugin_rewards."]},
        "warm_start": {"steps": 20}, "trainer": {"num_steps": 3, "eval_every": 0},
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
    served: dict[str, list] = {}

    def on_metrics(m: dict, step: int) -> None:
        seen[step] = m
        if step == 3:  # what Prometheus would scrape now (step 2's distributions are in)
            from prometheus_client import generate_latest
            from prometheus_client.parser import text_string_to_metric_families

            text = generate_latest(prometheus.active().registry).decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    served.setdefault(sample.name, []).append(sample.labels.get("tenant"))

    final = run_job(validate(cfg), resolved_yaml="", overrides=[], on_metrics=on_metrics)
    assert sorted(seen) == [0, 1, 2, 3]
    # per tenant: MLflow keys, and the tenant label on its reward distribution and request latencies
    assert {"ok", "broken"} <= set(served["miles_rollout_request_latency_seconds_count"])
    assert {"ok", "broken"} <= set(served["miles_rollout_time_to_first_token_seconds_count"])
    assert served["miles_train_reward_p50"] == ["ok"]  # every sample of 'broken' failed: it has no reward
    assert {"ok", "broken"} <= set(served["miles_rollout_request_latency_s_p50"])
    for step in (1, 2, 3):
        m = seen[step]
        assert m["tenant/ok/rollout/time_to_first_token_s/p50"] <= m["tenant/ok/rollout/request_latency_s/p50"]
        assert m["tenant/ok/train/num_tokens"] > 0 and m["tenant/broken/train/num_tokens"] == 0
        assert m["tenant/broken/rollout/failed"] == 16 and m["tenant/ok/rollout/failed"] == 0
        assert m["weight_sync/bytes"] > 0
    assert {"tenant/ok/eval/accuracy", "tenant/broken/eval/accuracy", "eval/accuracy"} <= set(final)
    ok = lora.load_adapter_file(tmp_path / "adapters" / "ok")
    broken = lora.load_adapter_file(tmp_path / "adapters" / "broken")
    lora_b = [k for k in ok if ".lora_B." in k]
    assert lora_b and max(ok[k].abs().max().item() for k in lora_b) > 0  # B starts at zero: ok trained
    assert all(broken[k].abs().max().item() == 0 for k in lora_b)  # broken never moved


def test_rollout_quantization_applies_to_the_base_and_not_to_the_adapters(tiny_qwen3_dir):
    from miles.precision.recipe import apply_rollout_quant, is_quantized_weight

    fp8 = PrecisionConfig(rollout_quant="fp8_block", quant_block_size=32)
    eng = TorchEngine(str(tiny_qwen3_dir), fp8, adapter=AdapterConfig(kind="lora", rank=4, alpha=8.0))
    try:
        base = hf_model_from(tiny_qwen3_dir).state_dict()
        want = apply_rollout_quant(base, fp8)
        got = eng.state_dict()  # the base weights as the engine computes with them
        quantized = [k for k, v in base.items() if is_quantized_weight(k, v)]
        assert quantized and all(not torch.equal(got[k], base[k]) for k in quantized)
        assert all(torch.equal(got[k], want[k]) for k in base)
        sd = {f"{lora.SYNC_PREFIX}default:{k}": v
              for k, v in _random_adapters(eng.adapter_state("default"), seed=5).items()}
        eng.update_weights(sd, 1)  # the adapters arrive as sent (fp32), the base is not requantized
        held = eng.adapter_state("default")
        assert all(torch.equal(held[k.split(":", 2)[2]], v) for k, v in sd.items())
        assert all(torch.equal(eng.state_dict()[k], want[k]) for k in base)
    finally:
        eng.close()


def test_the_tenants_example_composes_and_validates() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "examples"), version_base="1.3"):
        run = validate(compose(config_name="lora_tenants"))
    assert run.adapter.kind == "lora" and [t.name for t in run.tenants] == ["largest", "count", "arithmetic"]
    assert run.tenants[1].max_new_tokens == 24 and run.tenants[2].task.name == "arithmetic"
    with pytest.raises(ConfigError, match="no task option 'arithmetik'"):
        validate({"adapter": {"kind": "lora"}, "tenants": [{"name": "a", "task": "arithmetik"}]})
    with pytest.raises(ConfigError, match="add adapter=lora"):
        validate({"tenants": [{"name": "a", "task": "largest"}]})
    with pytest.raises(ConfigError, match="schedule=sync"):
        validate({"adapter": {"kind": "lora"}, "tenants": [{"name": "a", "task": "largest"}],
                  "schedule": {"name": "fully_async", "max_staleness": 1}, "placement": {"name": "disaggregated"}})
