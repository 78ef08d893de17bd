"""The policy's own draft heads (``draft.heads``, miles.models.draft_heads): the engine proposes from them and
keeps the policy's outputs, training fits each head to the policy's distribution of its later token, the
driver builds and caches them, and the config refuses what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from test_speculative import VOCAB, _chi_square_p, _exact_distribution, _requests, _tiny

from miles.config import ConfigError, validate
from miles.config.schema import PrecisionConfig
from miles.models.draft_heads import PolicyHeads, is_heads_dir, load_heads, save_heads
from miles.rollout.torch_engine import TorchEngine
from miles.train.draft import DraftTrainer, draft_sequences, heads_kl
from miles.types import GenerateRequest, Sample, SamplingParams, Status

FP32 = PrecisionConfig()
DRAFT = "draft.model={_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: null}"


def _run(overrides: list[str]):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=overrides))


def _heads(path: Path, k: int, hidden: int = 64, scale: float = 0.0, seed: int = 0) -> Path:
    """Heads with weights ``scale * N(0, 1) / sqrt(hidden)`` (0: new heads)."""
    heads = PolicyHeads(k, hidden)
    torch.manual_seed(seed)
    with torch.no_grad():
        heads.weight.normal_(0, scale / hidden**0.5)
        heads.bias.normal_(0, scale)
    return save_heads(heads, path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {"policy": _tiny(root / "policy", seed=0, layers=2, head_scale=20.0),
            "new": _heads(root / "new", 3), "random": _heads(root / "random", 2, scale=3.0),
            "one": _heads(root / "one", 1, scale=1.0)}


def test_heads_are_a_directory_that_loads_as_saved(tmp_path: Path) -> None:
    path = _heads(tmp_path / "h", 3, hidden=8, scale=1.0)
    assert is_heads_dir(path) and not is_heads_dir(tmp_path)
    got = load_heads(path)
    assert got.k == 3 and got(torch.zeros(5, 8)).shape == (5, 3, 8)
    torch.testing.assert_close(got.state_dict()["weight"], load_heads(path).state_dict()["weight"])
    new = PolicyHeads(2, 8)  # new heads: every head is the identity, so each proposes the next-token distribution
    h = torch.randn(4, 8)
    torch.testing.assert_close(new(h), h[:, None].expand(4, 2, 8))


def test_greedy_is_plain_greedy_and_logprobs_are_the_policys(models: dict[str, Path]) -> None:
    """12 rows of different lengths through 5 slots (rows join mid-batch), with new, random and one-head drafts:
    greedy outputs, finish reasons and log-probs are plain decoding's."""
    reqs = _requests([SamplingParams(greedy=True, max_new_tokens=m, stop_token_ids=(7,)) for m in (3, 17, 5, 9, 2, 12)])
    plain = TorchEngine(str(models["policy"]), FP32, max_batch_size=5).generate(reqs)
    for name, k in (("new", 3), ("random", 2), ("one", 1)):
        eng = TorchEngine(str(models["policy"]), FP32, max_batch_size=5, draft_checkpoint_dir=str(models[name]),
                          draft_k=k)
        spec = eng.generate(reqs)
        assert [r.response_ids for r in spec] == [r.response_ids for r in plain]
        assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
        for a, b in zip(spec, plain, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert sum(r.spec_counts[0] for r in spec) > 0  # type: ignore[index]


def test_the_engine_refuses_heads_of_another_count_or_width(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="draft_k=2 needs one head per proposed token"):
        TorchEngine(str(models["policy"]), FP32, draft_checkpoint_dir=str(models["new"]), draft_k=2)
    with pytest.raises(ValueError, match="hidden states of size 32; the policy's are 64"):
        TorchEngine(str(models["policy"]), FP32, draft_checkpoint_dir=str(_heads(tmp_path / "w", 2, 32)), draft_k=2)


def test_head_speculative_samples_follow_the_policy(tmp_path: Path) -> None:
    """>= 20,000 responses of up to 3 tokens over a 6-token vocabulary proposed by random heads, against the exact
    distribution (teacher-forced): chi-square p > 0.01 (the same test catches a wrong accept rule with a draft
    model, test_speculative.py)."""
    policy = _tiny(tmp_path / "policy", seed=0, vocab=VOCAB, head_scale=8.0)
    eng = TorchEngine(str(policy), FP32, max_batch_size=4096, draft_checkpoint_dir=str(_heads(tmp_path / "h", 2, scale=3.0)),
                      draft_k=2)
    assert _chi_square_p(eng, _exact_distribution(policy), seed=3) > 0.01


def test_heads_kl_is_each_heads_kl_to_the_policys_later_token(models: dict[str, Path]) -> None:
    """Against a loop over positions: head j at position t is compared with the policy's distribution at t + 1 + j
    (the token at t + 2 + j), only where that token is a target."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(models["policy"]), dtype=torch.float32).eval()
    heads, lm_head, temp = load_heads(models["random"]), policy.get_output_embeddings(), 0.7
    ids = torch.tensor([[5, 9, 11, 4, 6, 8, 3, 12]])
    weight = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1]], dtype=torch.float32)
    with torch.no_grad():
        hidden = policy.base_model(input_ids=ids).last_hidden_state
        logp = (lm_head(hidden) / temp).log_softmax(-1)
        kl, agree = heads_kl(heads, lm_head, hidden, logp, weight, temp)
    want_kl, want_agree = torch.zeros(2), torch.zeros(2)
    for j in range(2):
        for t in range(8):
            target = t + 2 + j
            if target >= 8 or not weight[0, target]:
                continue
            p = logp[0, target - 1]
            q = (lm_head(heads(hidden[0, t])[j]) / temp).log_softmax(-1).detach()
            want_kl[j] += (p.exp() * (p - q)).sum()
            want_agree[j] += float(p.argmax() == q.argmax())
    torch.testing.assert_close(kl.detach(), want_kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(agree, want_agree)


def _samples(engine: TorchEngine, n: int, offset: int) -> tuple[list[Sample], float]:
    reqs = [GenerateRequest(request_id=str(i), prompt_ids=tuple(3 + (7 * (i + offset) + 5 * t) % 90 for t in range(4)),
                            seed=1000 + i + offset) for i in range(n)]
    results = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=12))
    samples = [Sample(group_id=i, index=0, prompt_ids=list(q.prompt_ids), response_ids=list(r.response_ids),
                      rollout_logprobs=list(r.logprobs), loss_mask=[1] * len(r.response_ids), status=Status.COMPLETED,
                      weight_version=0) for i, (q, r) in enumerate(zip(reqs, results, strict=True))]
    return samples, sum(r.spec_counts[1] for r in results) / sum(r.spec_counts[0] for r in results)  # type: ignore[index]


def test_the_engines_acceptance_rises_as_the_heads_learn_the_policy_from_its_samples(models: dict[str, Path]) -> None:
    """New heads on a sharp random policy (little of its future is predictable from one hidden state): each step
    the engine's samples train the heads (DraftTrainer) and the engine loads them (update_draft); the acceptance
    rate on fresh prompts rises by half or more (measured: 0.06 -> 0.10), the loss falls."""
    eng = TorchEngine(str(models["policy"]), FP32, max_batch_size=16, draft_checkpoint_dir=str(models["new"]), draft_k=3)
    trainer = DraftTrainer(str(models["new"]), str(models["policy"]), lr=1e-2)
    _, before = _samples(eng, 64, 5000)
    kls = []
    for step in range(40):
        samples, _ = _samples(eng, 32, 32 * step)
        out = trainer.train(draft_sequences(samples))
        kls.append(out["draft/kl"])
        eng.update_draft(trainer.state(), step + 1)
    _, after = _samples(eng, 64, 5000)
    print(f"acceptance {before:.3f} -> {after:.3f}, KL {kls[0]:.3f} -> {kls[-1]:.3f}")
    assert sum(kls[-5:]) < 0.7 * sum(kls[:5])
    assert after > 1.5 * before, (before, after)
    with pytest.raises(ValueError, match="wrong shapes"):
        eng.update_draft({"weight": torch.zeros(2, 64, 64), "bias": torch.zeros(3, 64)}, 99)
    assert eng.draft_version == 40


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ([DRAFT], "either the policy's own heads or a second model"),
        (["rollout=sglang"], "draft.heads with rollout.engine=.*SGLang"),
        (["adapter=lora"], "draft.heads cannot be combined with adapter=lora.*set draft.heads=false"),
    ],
)
def test_heads_refusals_say_why(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _run(["draft.heads=true", *overrides])


def test_heads_compose_and_train_online_beside_either_trainer() -> None:
    from miles.config.draft import draft_lr
    from miles.core.plan import make_plan
    from miles.machine import Machine

    run = _run(["draft.heads=true", "draft.online=true"])
    assert run.draft.heads and run.draft.model is None
    assert (draft_lr(run), draft_lr(_run([DRAFT])), draft_lr(_run(["draft.heads=true", "draft.lr=5e-4"]))) == (
        1e-2, 3e-3, 5e-4)  # null: the kind's default
    assert make_plan(run, Machine.here()).draft_trainer  # the draft trainer is placed as for a draft model
    with pytest.raises(ConfigError, match="set draft.model or draft.heads=true"):
        _run(["draft.online=true"])


def test_the_driver_builds_the_heads_on_the_task_and_caches_them(tmp_path: Path) -> None:
    """``draft.heads``: warm-started on the run's task with the policy frozen (trained away from new heads), cached
    by what shapes them, built anew when ``draft.k`` changes, loaded by an engine."""
    from miles.core.run import build_components, ensure_draft_checkpoint
    from miles.models.checkpoint import ensure_checkpoint

    over = ["draft.heads=true", "draft.k=2", "warm_start.steps=6", "warm_start.batch_size=16",
            f"warm_start.cache_dir={tmp_path}"]
    run = _run(over)
    parts = build_components(run)
    policy = ensure_checkpoint(run, parts["spec"], parts["task"])
    heads = ensure_draft_checkpoint(run, policy, parts["task"])
    assert heads is not None and is_heads_dir(heads) and heads.parent == tmp_path and load_heads(heads).k == 2
    mtime = (heads / "draft_heads.safetensors").stat().st_mtime_ns
    assert ensure_draft_checkpoint(run, policy, parts["task"]) == heads  # cached: not built again
    assert (heads / "draft_heads.safetensors").stat().st_mtime_ns == mtime
    assert float(load_heads(heads).weight.detach().abs().sum()) > 0  # trained away from the new heads
    other = ensure_draft_checkpoint(_run([*over[:1], "draft.k=3", *over[2:]]), policy, parts["task"])
    assert other != heads and load_heads(other).k == 3
    # keyed by the policy's weights, not its place or file times: a copy keeps the heads, and weights rewritten in
    # place with the same size and modification time get new ones
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(policy, tmp_path / "copy")
    assert ensure_draft_checkpoint(run, copy, parts["task"]) == heads
    weights = copy / "model.safetensors"
    stat, state = weights.stat(), load_file(str(weights))
    save_file({k: v + 1.0 for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert ensure_draft_checkpoint(run, copy, parts["task"]) not in (heads, other)
    eng = TorchEngine(str(policy), FP32, max_batch_size=8, draft_checkpoint_dir=str(heads), draft_k=2)
    results = eng.generate([GenerateRequest(request_id="0", prompt_ids=(5, 6, 7, 8), n=8, seed=0)],
                           SamplingParams(max_new_tokens=8))
    assert sum(r.spec_counts[0] for r in results) > 0  # type: ignore[index]


def test_a_run_trains_the_heads_online_checkpoints_and_exports_them(ray_cluster, tmp_path: Path) -> None:
    """``draft.heads`` with ``draft.online`` through the driver: every step trains the heads and pushes them to the
    engine, whose acceptance is reported; the run checkpoint holds their state, which exports as a heads directory
    that an engine loads."""
    import json

    from miles.bench.e2e import compose as compose_run
    from miles.core.resume import export_draft
    from miles.core.run import run_job

    overrides = ["tracking=none", "trainer.eval_every=0", "task.num_eval_prompts=4", "algo.num_prompts_per_step=4",
                 "algo.num_samples_per_prompt=4", "warm_start.steps=5", f"warm_start.cache_dir={tmp_path / 'warm'}",
                 "draft.heads=true", "draft.online=true", "draft.k=2", f"trainer.save_dir={tmp_path / 'ckpt'}",
                 "trainer.save_every=2", "trainer.num_steps=2"]
    seen: dict[int, dict] = {}
    run, resolved = compose_run(overrides)
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.setdefault(s, {}).update(m))
    for step in (1, 2):
        assert seen[step]["draft/steps"] == step and seen[step]["draft/tokens"] > 0
        assert 0 < seen[step]["rollout/spec_accept_rate"] <= 1
    saved = tmp_path / "ckpt" / "step_000002" / "draft"
    assert json.loads((saved / "draft_state.json").read_text())["steps"] == 2
    (base,) = (tmp_path / "warm").glob("draft-heads-*")
    out = export_draft(tmp_path / "ckpt" / "step_000002", base, tmp_path / "exported")
    from safetensors.torch import load_file

    for k, v in load_file(str(saved / "model.safetensors")).items():
        torch.testing.assert_close(load_heads(out).state_dict()[k], v, rtol=0, atol=0)
    assert not torch.equal(load_heads(out).weight, load_heads(base).weight)  # trained online
