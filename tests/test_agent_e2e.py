"""Short training runs whose rollout is multi-turn: the tool loop (examples/agent_calculator.yaml) and an
openai-client agent (examples/openai_agent.yaml); the trainer gets exactly the sampled ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import validate

pytestmark = pytest.mark.slow


class KeepBatches:
    """Hook: the sampled groups and the batch the trainer gets, per step (in the class: the run builds it)."""

    groups: dict = {}
    batches: dict = {}
    rewards: dict = {}

    def after_rollout(self, ctx, groups) -> None:
        self.groups[ctx.step] = [[(list(s.prompt_ids), list(s.response_ids), list(s.loss_mask)) for s in g]
                                 for g in groups]

    def after_reward(self, ctx, groups) -> None:
        self.rewards[ctx.step] = [(s.response_text, s.label, s.reward, dict(s.metadata)) for g in groups for s in g]

    def before_train(self, ctx, batch) -> None:
        self.batches[ctx.step] = batch


def _run(config_name: str, tmp_path: Path, num_steps: int) -> dict[int, dict]:
    """A short run of an example config; the metrics of each step after the first evaluation."""
    from hydra import compose, initialize_config_dir

    from miles.core.run import run_job

    KeepBatches.groups.clear()
    KeepBatches.batches.clear()
    KeepBatches.rewards.clear()
    examples = Path(__file__).parents[1] / "examples"
    with initialize_config_dir(config_dir=str(examples), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=[
            f"trainer.num_steps={num_steps}", "trainer.eval_every=0", "algo.num_prompts_per_step=4",
            "algo.num_samples_per_prompt=4", "task.num_eval_prompts=4", "rollout.eval_samples_per_prompt=1",
            "tracking.backend=none", "warm_start.steps=100", "warm_start.batch_size=32",
            f"warm_start.cache_dir={tmp_path / 'cache'}",
            f"plugins.allow=[test_agent_e2e.,{'examples.' if 'openai' in config_name else 'miles.'}]",
            "hooks=[{_target_: test_agent_e2e.KeepBatches}]"])
    seen: list[tuple[int, dict]] = []
    run_job(validate(cfg), resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.append((s, dict(m))))
    return {s: m for s, m in seen if s > 0}


def _check_trained_ids(step: int, m: dict) -> None:
    # the trainer's log-probs of the policy tokens, in their multi-turn context, are the engine's
    assert m["train/logp_mismatch_abs_mean"] < 1e-4, m["train/logp_mismatch_abs_mean"]
    batch = KeepBatches.batches[step]
    sampled = [x for g in KeepBatches.groups[step] for x in g]
    assert list(zip(batch.prompt_ids, batch.response_ids, batch.loss_mask, strict=True)) == sampled


def test_an_openai_client_agent_trains(ray_cluster, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    steps = _run("openai_agent", tmp_path, num_steps=1)
    m = steps[1]
    print(f"openai agent: samples {m['rollout/samples']:.0f}, turns {m['rollout/agent/turns']:.0f}, "
          f"logp mismatch {m['train/logp_mismatch_abs_mean']:.2e}")
    assert m["rollout/agent/turns"] > m["rollout/samples"] and m["rollout/failed"] == 0
    _check_trained_ids(1, m)


def test_a_run_trains_on_the_multi_turn_tokens_the_engine_sampled(ray_cluster, tmp_path: Path) -> None:
    steps = _run("agent_calculator", tmp_path, num_steps=2)
    assert sorted(steps) == [1, 2]
    for step, m in steps.items():
        print(f"step {step}: samples {m['rollout/samples']:.0f}, turns {m['rollout/agent/turns']:.0f}, tool calls "
              f"{m['rollout/agent/tool_calls']:.0f} (success {m.get('rollout/agent/tool_success_rate', 0):.2f}), "
              f"reward {m['train/reward_mean']:.3f}, logp mismatch {m['train/logp_mismatch_abs_mean']:.2e}")
        # more policy turns than samples: sessions went past their first turn, through tool responses
        assert m["rollout/agent/turns"] > m["rollout/samples"], m
        assert m["rollout/agent/tool_calls"] > 0
        _check_trained_ids(step, m)
    # training rewards are the answer plus the bonus for working calls (the task's tool_answer_reward) ...
    from miles.agent.rewards import tool_answer_reward

    scored = [x for step in sorted(KeepBatches.rewards) for x in KeepBatches.rewards[step]]
    assert [r for _, _, r, _ in scored] == [tool_answer_reward(t, label, metadata=meta) for t, label, _, meta in scored]
    assert any(r % 1 for _, _, r, _ in scored)  # some were paid the bonus
    # ... while held-out accuracy is the exact answer alone (task.eval_reward): 4 prompts x 1 sample
    for key in ("eval/accuracy", "eval/greedy_accuracy"):
        assert (4 * steps[2][key]) % 1 == 0, (key, steps[2][key])
    # the held-out prompts' sessions are counted too; every later turn went to its session's engine
    assert steps[2]["eval/agent/turns"] > 0 and "eval/agent/tool_success_rate" in steps[2]
    assert steps[2]["rollout/affinity_hits"] > 0
