"""Rollout routing replay (R3): the engine records every position's experts, samples carry them, the
trainer's forward uses exactly those experts with its own gate weights, the router still learns, and
route agreement is measured; configs that cannot replay are refused before Ray starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_ranks import hf_model_from, local_trainer

from miles.config import ConfigError, validate
from miles.config.schema import PrecisionConfig
from miles.rollout.generate import routes_of
from miles.rollout.torch_engine import TorchEngine
from miles.train.batching import pad_batch
from miles.train.routing_replay import RouteReplay, find_routers, replay_gate
from miles.types import GenerateRequest, SamplingParams, TrainBatch

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8)
NOISE = 0.5  # router perturbation that makes the trainer's own top-k differ on some tokens


def _requests() -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"r{i}", prompt_ids=tuple(3 + (11 * i + 5 * t) % 87 for t in range(n)), n=2,
                            seed=i) for i, n in enumerate([3, 6, 4, 5])]


def _perturbed_routers(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + NOISE * torch.randn(v.shape, generator=g) if k.endswith(".mlp.gate.weight") else v.clone()
            for k, v in model.state_dict().items()}


def _rollout(ckpt: Path, state_dict: dict[str, torch.Tensor] | None = None) -> TrainBatch:
    """Samples from a routing-capturing engine (optionally with other weights) as a TrainBatch."""
    eng = TorchEngine(str(ckpt), PrecisionConfig(), capture_routing=True, max_batch_size=8)
    try:
        if state_dict is not None:
            eng.update_weights(state_dict, version=1)
        reqs = _requests()
        results = eng.generate(reqs, SAMPLED)
    finally:
        eng.close()
    prompts = {q.request_id: list(q.prompt_ids) for q in reqs}
    return TrainBatch(prompt_ids=[prompts[r.request_id] for r in results],
                      response_ids=[list(r.response_ids) for r in results],
                      rollout_logprobs=[list(r.logprobs) for r in results],
                      loss_mask=[[1] * len(r.response_ids) for r in results],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(len(results))],
                      routing=[routes_of(r) for r in results])


def _expert_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Collects the top-k index every experts module receives (one entry per MoE layer per forward)."""
    seen: list[torch.Tensor] = []
    for name, m in model.named_modules():
        if name.endswith(".mlp.experts"):
            m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].detach().clone()))
    return seen


def test_replayed_gate_of_the_routers_own_choice_is_its_own_weights(tiny_qwen3_moe_dir: Path) -> None:
    router = find_routers(hf_model_from(tiny_qwen3_moe_dir))[0]
    hidden = torch.randn(50, router.hidden_dim, generator=torch.Generator().manual_seed(0))
    logits, weights, index = router(hidden)
    assert torch.equal(replay_gate(logits, index, normalize=router.norm_topk_prob), weights)
    other = index.flip(-1)  # same experts, other slot order: weights follow the slots
    assert torch.equal(replay_gate(logits, other, normalize=True), weights.flip(-1))


def test_engine_records_every_scored_position_and_the_batch_lays_them_out(tiny_qwen3_moe_dir: Path) -> None:
    batch = _rollout(tiny_qwen3_moe_dir)
    model = hf_model_from(tiny_qwen3_moe_dir)
    captured: list[torch.Tensor] = []
    for router in find_routers(model):
        router.register_forward_hook(lambda _m, _i, out: captured.append(out[2]))
    for p, r, routes in zip(batch.prompt_ids, batch.response_ids, batch.routing, strict=True):
        assert routes.dtype == torch.int16 and tuple(routes.shape) == (len(p) + len(r) - 1, 2, 2)
        captured.clear()
        with torch.no_grad():
            model(input_ids=torch.tensor([p + r]))
        ref = torch.stack([c[: len(p) + len(r) - 1] for c in captured], 1)  # positions 0 .. P + T - 2
        assert torch.equal(routes.long(), ref)
    padded = pad_batch(batch)
    assert padded.routes.shape == (*padded.input_ids.shape, 2, 2)
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True)):
        n = len(p) + len(r)
        assert (padded.routes[i, : n - 1] >= 0).all() and (padded.routes[i, n - 1 :] == -1).all()


@pytest.mark.parametrize("replay", [True, False])
def test_replay_uses_exactly_the_recorded_experts(tiny_qwen3_moe_dir: Path, replay: bool) -> None:
    engine_weights = _perturbed_routers(hf_model_from(tiny_qwen3_moe_dir))
    batch = _rollout(tiny_qwen3_moe_dir, engine_weights)
    p = pad_batch(batch)
    model = hf_model_from(tiny_qwen3_moe_dir)  # the trainer's routers differ from the engine's
    rr = RouteReplay(model, replay=replay)
    seen = _expert_inputs(model)
    rr.set_routes(p.routes)
    with torch.no_grad():
        model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids)
    agree, total, same_set, routes = rr.take_counts().tolist()
    recorded = p.routes.reshape(-1, 2, 2)
    have = recorded[:, 0, 0] >= 0
    assert total == have.sum() * 2 * 2 and 0 < agree < total  # the router's own choice differs on some routes
    used = torch.stack(seen, 1)  # [B * L, layers, k]
    assert torch.equal(used[have], recorded[have]) == replay
    # the experts actually called: all recorded token-layers under replay, only the agreeing ones without
    same = (used.sort(-1).values == recorded.sort(-1).values).all(-1)[have]
    assert routes == have.sum() * 2 and same_set == same.sum()
    assert (same_set == routes) == replay  # without replay some token-layers use other experts
    rr.set_routes(None)
    seen.clear()
    with torch.no_grad():
        model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids)
    own = torch.stack(seen, 1)
    assert not torch.equal(own[have], recorded[have])
    if not replay:
        assert torch.equal(own, used)  # measuring only: the trainer's own routes
    assert not rr.take_counts().any()  # no routes set: nothing measured


def test_replay_of_the_trainers_own_routes_changes_nothing(tiny_qwen3_moe_dir: Path) -> None:
    batch = _rollout(tiny_qwen3_moe_dir)
    p = pad_batch(batch)
    model = hf_model_from(tiny_qwen3_moe_dir)
    with torch.no_grad():
        plain = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids).logits
    rr = RouteReplay(model, replay=True)
    rr.set_routes(p.routes)
    with torch.no_grad():
        replayed = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids).logits
    agree, total, same_set, routes = rr.take_counts().tolist()
    assert agree == total and same_set == routes > 0  # fp32, same weights: the same experts here
    assert torch.equal(plain, replayed)


def test_fsdp_trainer_replays_and_its_router_still_learns(tiny_qwen3_moe_dir: Path) -> None:
    batch = _rollout(tiny_qwen3_moe_dir, _perturbed_routers(hf_model_from(tiny_qwen3_moe_dir)))
    metrics = {}
    for mode in ("rollout", "off"):
        run = validate({"algo": {"routing_replay": mode, "num_prompts_per_step": 4, "num_samples_per_prompt": 2},
                        "trainer": {"lr": 1e-2, "lr_warmup_steps": 0, "max_tokens_per_microbatch": 0}})
        with local_trainer(tiny_qwen3_moe_dir, run) as trainer:
            assert trainer.cache_kw is None or mode == "off"
            seen = _expert_inputs(trainer.model)
            trainer.compute_logprobs(batch)
            (micro,) = trainer._plans([batch])[0][1].micro  # one pass, rows sorted by length
            recorded = micro.routes
            used = torch.stack(seen, 1).view(*recorded.shape)
            have = recorded[..., 0, 0] >= 0
            assert torch.equal(used[have], recorded[have]) == (mode == "rollout")
            before = {k: v.clone() for k, v in trainer.full_state_dict().items() if k.endswith(".mlp.gate.weight")}
            metrics[mode] = trainer.train_step(batch)
            after = trainer.full_state_dict()
            assert all(not torch.equal(after[k], v) for k, v in before.items())  # routers get gradients
    # measured both ways (they differ a little: from the second MoE layer on, replay changes the router's input)
    assert 0 < metrics["rollout"]["moe/route_agreement"] < 1 and 0 < metrics["off"]["moe/route_agreement"] < 1
    # the routes the experts were called with: every one recorded under replay, fewer without
    assert metrics["rollout"]["moe/replayed_route_share"] == 1.0
    assert 0 < metrics["off"]["moe/replayed_route_share"] < 1


def test_replay_configs_that_cannot_work_are_refused() -> None:
    from hydra import compose, initialize_config_module

    from miles.core.plan import engine_kwargs
    from miles.core.run import build_components

    def run(overrides: list[str]):
        with initialize_config_module("miles.conf", version_base="1.3"):
            return validate(compose("config", overrides=overrides))

    assert engine_kwargs(run(["model=qwen3_moe", "algo.routing_replay=rollout"]))["capture_routing"] is True
    assert "capture_routing" not in engine_kwargs(run(["model=qwen3_moe"]))
    replay_wins = run(["model=qwen3_moe", "algo.routing_replay=rollout", "+rollout.engine.capture_routing=false"])
    assert engine_kwargs(replay_wins)["capture_routing"] is True
    # the session prefix cache (its prefixes carry no routes) is off under replay, on by default otherwise
    assert engine_kwargs(replay_wins)["prefix_cache_tokens"] == 0
    assert engine_kwargs(run(["model=qwen3_moe"]))["prefix_cache_tokens"] > 0
    assert engine_kwargs(run(["precision=fp32", "precision.true_on_policy=true"]))["prefix_cache_tokens"] == 0
    with pytest.raises(ConfigError, match="dense model"):
        build_components(run(["model=qwen3", "algo.routing_replay=rollout"]))
    # the SGLang engine records prompt and response routes as the torch engine does (tests/test_sglang_lora_moe.py)
    sglang = run(["model=qwen3_moe", "rollout=sglang", "algo.routing_replay=rollout"])
    build_components(sglang)
    assert engine_kwargs(sglang)["capture_routing"] is True
    build_components(run(["model=qwen3_moe", "rollout=sglang", "trainer=megatron", "algo.routing_replay=rollout"]))
    # the megatron trainer replays too (tests/test_megatron_replay_precision.py); its check imports no megatron
    megatron = run(["model=qwen3_moe", "trainer=megatron", "algo.routing_replay=rollout"])
    assert engine_kwargs(megatron)["capture_routing"] is True
    build_components(megatron)


def test_cli_refuses_replay_of_a_dense_model_before_ray(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "miles", "model=qwen3", "algo.routing_replay=rollout", "tracking=none"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "config error: algo.routing_replay=rollout: qwen3 is a dense model" in out
    assert "ray" not in out.lower().replace("array", "")  # refused before Ray starts
