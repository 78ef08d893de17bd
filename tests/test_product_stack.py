"""The product stack end to end: SGLang engines and the megatron trainer in one run, with the features
that meet there (``-m sglang``; needs megatron-core too).

One job of the product card's command, ``model=qwen3_moe algo=grpo precision=fp8 rollout=sglang
trainer=megatron``, with MoE routing replay and two LoRA tenants (adapters on attention: on SGLang's CPU
LoRA backend an ``lm_head`` adapter cannot share a batch with another), so one SGLang server (LoRA and
routing capture are launch flags of the server) shows every path at once: fp8 weights served
dequantized as the torch engine serves them, adapter-only weight syncs of both tenants from the
megatron trainer into SGLang's own adapter loading, both adapters served by the one server, the
engine's routes replayed by megatron's router, mismatch correction on, and each tenant's time to first
token as SGLang measures it. The async schedules on this stack are in tests/test_schedules.py
(``sglang-megatron-one_step_off``).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.megatron]

STEPS = 3


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from miles.config import validate

    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=overrides))


def test_the_product_card_runs_on_sglang_and_megatron_with_replay_and_lora_tenants(ray_cluster, tmp_path) -> None:
    pytest.importorskip("megatron.core")
    from miles.core.run import run_job

    run = _compose([
        "model=qwen3_moe", "algo=grpo", "precision=fp8", "rollout=sglang", "trainer=megatron",
        "algo.routing_replay=rollout", "adapter=lora", "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        "+tenants=[{name: sums, task: arithmetic}, {name: largest, task: largest}]",
        "tracking=none", f"trainer.num_steps={STEPS}", "trainer.eval_every=0", "task.num_eval_prompts=8",
        "algo.num_prompts_per_step=8", "algo.num_samples_per_prompt=4", "warm_start.steps=0",
        f"warm_start.cache_dir={tmp_path / 'cache'}", "placement.torch_threads_per_actor=1",
        "rollout.engine.max_total_tokens=8192", "rollout.engine.request_timeout_s=300",
    ])
    seen: dict[int, dict] = {}
    final = run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.__setitem__(s, dict(m)))

    assert sorted(s for s in seen if s > 0) == list(range(1, STEPS + 1))
    full_bytes = None
    for step in range(1, STEPS + 1):
        m = seen[step]
        for t in ("sums", "largest"):  # each tenant's own rollout and update
            assert m[f"tenant/{t}/rollout/failed"] == 0 and m[f"tenant/{t}/train/nonfinite_skipped"] == 0, (step, t)
            assert m[f"tenant/{t}/train/num_tokens"] > 0
            # SGLang's own first-token time (its metrics on) under each request's latency
            for q in ("p50", "p90", "p99"):
                ttft = m[f"tenant/{t}/rollout/time_to_first_token_s/{q}"]
                assert 0 < ttft <= m[f"tenant/{t}/rollout/request_latency_s/{q}"], (step, t, q, ttft)
        # megatron's router was called with exactly the experts SGLang chose, for every recorded route
        assert m["moe/replayed_route_share"] == 1.0, (step, m["moe/replayed_route_share"])
        # the adapters train, the base does not: a small share of the parameters, and adapter-only syncs
        assert 0 < m["train/trainable_param_frac"] < 0.2
        assert 0 < m["weight_sync/bytes"]
        full_bytes = full_bytes or m["weight_sync/bytes"]
        assert m["weight_sync/bytes"] == full_bytes  # the same two adapters' tensors every step
        for t in ("sums", "largest"):  # fp8 served, bf16 trained: correction on, the sides close, not equal
            mismatch = m[f"tenant/{t}/train/logp_mismatch_abs_mean"]
            assert 0 < mismatch < 0.1 and f"tenant/{t}/train/tis_clip_frac" in m, (step, t, mismatch)
    assert final["eval/accuracy"] >= 0
