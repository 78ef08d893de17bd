"""Online draft training (``draft.online``, miles.train.draft): the draft learns the policy from its samples,
the engines load it between steps, its state survives a run checkpoint, and the config refuses what cannot
work."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from test_speculative import _tiny  # a random tiny Qwen3 checkpoint

from miles.config import ConfigError, validate
from miles.config.schema import PrecisionConfig
from miles.rollout.torch_engine import TorchEngine
from miles.train.draft import DraftTrainer, draft_sequences
from miles.types import GenerateRequest, Sample, SamplingParams, Status

FP32 = PrecisionConfig()
DRAFT = "draft.model={_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: null}"


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of built checkpoints for the runs of this module (the same policy and draft builds)."""
    return tmp_path_factory.mktemp("draft_online_warm")


def _run(overrides: list[str]):
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=overrides))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_online")
    return {"policy": _tiny(root / "policy", 0, layers=2, vocab=48, head_scale=20.0),
            "draft": _tiny(root / "draft", 1, layers=1, vocab=48, head_scale=1.0)}


def _prompts(n: int, offset: int = 0) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=str(i), prompt_ids=tuple(3 + (7 * (i + offset) + 5 * t) % 40 for t in range(4)),
                            seed=1000 + i + offset) for i in range(n)]


def _samples(engine: TorchEngine, reqs: list[GenerateRequest]) -> tuple[list[Sample], float]:
    """The engine's samples of ``reqs`` (T = 1, 12 tokens) and its acceptance rate on them."""
    results = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=12))
    samples = [Sample(group_id=i, index=0, prompt_ids=list(q.prompt_ids), response_ids=list(r.response_ids),
                      rollout_logprobs=list(r.logprobs), loss_mask=[1] * len(r.response_ids),
                      status=Status.COMPLETED, weight_version=0) for i, (q, r) in enumerate(zip(reqs, results, strict=True))]
    proposed = sum(r.spec_counts[0] for r in results)  # type: ignore[index]
    return samples, sum(r.spec_counts[1] for r in results) / proposed  # type: ignore[index]


def test_the_engines_acceptance_rises_as_the_draft_learns_the_policy_from_its_samples(models: dict[str, Path]) -> None:
    """A random draft against a sharp policy: each step the engine's samples train the draft and the engine
    loads it (update_draft), as in a run; the acceptance rate on fresh prompts rises, the training loss falls."""
    eng = TorchEngine(str(models["policy"]), FP32, max_batch_size=16, draft_checkpoint_dir=str(models["draft"]),
                      draft_k=3)
    trainer = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-2)
    _, before = _samples(eng, _prompts(32, offset=500))
    kls = []
    for step in range(40):
        samples, _ = _samples(eng, _prompts(32, offset=32 * step))
        kls.append(trainer.train(draft_sequences(samples))["draft/kl"])
        assert eng.update_draft(trainer.state(), step + 1)["draft_update_s"] >= 0
    _, after = _samples(eng, _prompts(32, offset=500))
    assert eng.draft_version == 40
    assert sum(kls[-5:]) < 0.7 * sum(kls[:5])
    print(f"acceptance {before:.3f} -> {after:.3f}, KL {kls[0]:.3f} -> {kls[-1]:.3f}")
    assert after > before + 0.12, (before, after)


def test_a_draft_that_is_its_policy_has_kl_and_gradient_0(models: dict[str, Path]) -> None:
    """The distillation target is the policy's distribution, not its sampled tokens: for a draft equal to the
    policy the loss and its gradient are 0 to rounding, and its argmax is the policy's. (Cross-entropy on the
    sampled tokens has a gradient there as large as the policy's entropy: 14 on these samples.)"""
    eng = TorchEngine(str(models["policy"]), FP32, max_batch_size=16)
    trainer = DraftTrainer(str(models["policy"]), str(models["policy"]), lr=1e-3)
    results = eng.generate(_prompts(32), SamplingParams(temperature=1.0, max_new_tokens=12))
    seqs = [(list(q.prompt_ids), list(r.response_ids), [1] * len(r.response_ids))
            for q, r in zip(_prompts(32), results, strict=True)]
    m = trainer.train(seqs)
    assert abs(m["draft/kl"]) < 1e-6 and m["draft/top1"] == 1.0 and m["draft/grad_norm"] < 1e-5, m


def test_the_loss_is_the_kl_to_the_policy_set_last_on_its_tokens_at_the_rollout_temperature(
        models: dict[str, Path], tmp_path: Path) -> None:
    """Hand-computed: the mean over response tokens with loss_mask 1 of KL(p_T || q_T), p from the policy that
    set_policy gave it last (here an engine's weights of another model than the one it was built with)."""
    from transformers import AutoModelForCausalLM

    prompt, response, mask = [3, 4, 5], [6, 7, 8, 9], [1, 0, 1, 1]
    other = _tiny(tmp_path / "other", 5, layers=2, vocab=48, head_scale=3.0)
    trainer = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-3, temperature=0.5)
    trainer.set_policy(TorchEngine(str(other), FP32, max_batch_size=2).state_dict())
    got = trainer.train([(prompt, response, mask)])
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp, logq = ((AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)(input_ids=ids).logits[0]
                       .float() / 0.5).log_softmax(-1) for d in (other, models["draft"]))
    kl = (logp.exp() * (logp - logq)).sum(-1)
    want = sum(float(kl[len(prompt) - 1 + j]) for j in range(len(response)) if mask[j]) / 3
    assert got["draft/kl"] == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="not the policy's weights"):
        trainer.set_policy({"lm_head.weight": torch.zeros(48, 64)})
    assert got["draft/tokens"] == 3 and got["draft/nonfinite_skipped"] == 0
    assert trainer.train([(prompt, response, [0, 0, 0, 0])]) == {}  # nothing the policy generated: no step
    assert draft_sequences([Sample(group_id=0, index=0, prompt_ids=prompt, response_ids=[6], rollout_logprobs=[0.0],
                                   loss_mask=[0], status=Status.COMPLETED, weight_version=0)]) == []


def test_a_saved_draft_state_continues_exactly(models: dict[str, Path], tmp_path: Path) -> None:
    """save_state / load_state keep the weights, AdamW's moments and the step count: the next step is the same."""
    seqs = [([3, 4, 5], [6 + i, 7, 8], [1, 1, 1]) for i in range(6)]
    a = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-2)
    a.train(seqs[:3])
    a.save_state(str(tmp_path / "draft"))
    b = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-2)
    b.load_state(str(tmp_path / "draft"))
    assert b.steps == 1
    ma, mb = a.train(seqs[3:]), b.train(seqs[3:])
    assert {k: v for k, v in ma.items() if k != "draft/train_s"} == {k: v for k, v in mb.items() if k != "draft/train_s"}
    for k, v in a.state().items():
        torch.testing.assert_close(v, b.state()[k], rtol=0, atol=0)
    c = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-2)  # a replaced trainer's successor
    c.load_weights(a.state())
    assert c.steps == 0 and not c.optimizer.state  # the weights only: its optimizer starts anew
    for k, v in a.state().items():
        torch.testing.assert_close(v, c.state()[k], rtol=0, atol=0)
    with pytest.raises(ValueError, match="not this draft's weights"):
        c.load_weights(c.policy.state_dict())
    with torch.no_grad():
        next(a.model.parameters()).fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        a.save_state(str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()


def test_the_drafts_learning_rate_rises_over_its_warmup_steps(models: dict[str, Path]) -> None:
    """With lr_warmup_steps=4, steps 1..6 use lr 1/4, 2/4, 3/4, 1, 1, 1 of lr; the first step moves the draft
    less than a step at the full rate from the same start (Adam's first step is about lr per weight)."""
    seqs = [([3, 4, 5], [6 + i, 7, 8], [1, 1, 1]) for i in range(3)]
    rates = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-2, lr_warmup_steps=4)
    start = {k: v.clone() for k, v in rates.state().items()}

    def moved(t: DraftTrainer) -> float:
        return max(float((t.state()[k] - v).abs().max()) for k, v in start.items())

    assert rates.train(seqs)["draft/lr"] == pytest.approx(2.5e-3)
    first = moved(rates)
    assert [rates.train(seqs)["draft/lr"] for _ in range(5)] == pytest.approx([5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2])
    full = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-2)
    assert full.train(seqs)["draft/lr"] == 1e-2
    assert first < 0.3 * moved(full)


def test_update_draft_refuses_a_state_of_another_shape_and_keeps_its_draft(models: dict[str, Path]) -> None:
    eng = TorchEngine(str(models["policy"]), FP32, max_batch_size=4, draft_checkpoint_dir=str(models["draft"]),
                      draft_k=2)
    state = DraftTrainer(str(models["draft"]), str(models["policy"]), lr=1e-3).state()
    before = {k: v.clone() for k, v in eng.draft.model.state_dict().items()}  # type: ignore[union-attr]
    wrong = {**state, "lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="wrong shapes"):
        eng.update_draft(wrong, 1)
    with pytest.raises(ValueError, match="missing"):
        eng.update_draft({k: v for k, v in state.items() if k != "lm_head.weight"}, 1)
    for k, v in eng.draft.model.state_dict().items():  # type: ignore[union-attr]
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    plain = TorchEngine(str(models["policy"]), FP32, max_batch_size=4)
    with pytest.raises(ValueError, match="no draft model"):
        plain.update_draft(state, 1)


@pytest.mark.parametrize(("overrides", "match"), [
    (["draft.online=true"], "draft.online: there is no draft to train"),
    ([DRAFT, "draft.online=true", "draft.lr=0"], r"draft.lr: must be > 0"),
    ([DRAFT, "draft.online=true", "draft.lr_warmup_steps=-1"], r"draft.lr_warmup_steps: must be 0 or more"),
])
def test_online_draft_refusals_say_why(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _run(overrides)


def test_the_plan_places_the_draft_trainer_on_trainer_rank_0s_bundle() -> None:
    from miles.core.plan import make_plan
    from miles.machine import Machine

    assert make_plan(_run([DRAFT]), Machine.here()).draft_trainer == ()
    plan = make_plan(_run([DRAFT, "draft.online=true"]), Machine.here())
    (slot,) = plan.draft_trainer
    assert (slot.pool, slot.bundle, slot.cpus) == (plan.trainers[0].pool, plan.trainers[0].bundle, 0)
    assert "draft trainer (draft.online)" in plan.describe()


class KillDraftTrainer:
    """Hook: at ``step``, before its train step, send ``sig`` (SIGKILL, or SIGSTOP: a hung trainer) to this run's
    draft trainer (found in Ray's actor table), and SIGCONT ``resume_after_s`` later when given (a slow trainer);
    :attr:`pids` records the process."""

    pids: list[int] = []

    def __init__(self, step: int, sig: str = "SIGKILL", resume_after_s: float | None = None,
                 name: str = "kill_draft_trainer") -> None:
        self.step, self.sig, self.resume_after_s, self.name = step, sig, resume_after_s, name

    def before_train(self, ctx, batch) -> None:
        import os
        import signal

        import ray

        if ctx.step != self.step:
            return
        job = ray.get_runtime_context().get_job_id()
        (pid,) = [a["Pid"] for a in ray._private.state.actors().values()
                  if a["ActorClassName"] == "DraftTrainer" and a["State"] == "ALIVE" and a["JobID"] == job]
        os.kill(pid, getattr(signal, self.sig))
        KillDraftTrainer.pids.append(pid)
        if self.resume_after_s is not None:
            import threading

            threading.Timer(self.resume_after_s, os.kill, (pid, signal.SIGCONT)).start()


class Pause:
    """Hook: at ``step``, before its train step, wait ``seconds`` (time for work in flight elsewhere to end)."""

    name = "pause"

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def before_train(self, ctx, batch) -> None:
        if ctx.step == self.step:
            time.sleep(self.seconds)


def test_a_run_trains_the_draft_pushes_it_and_resumes_it_from_its_checkpoint(ray_cluster, tmp_path: Path,
                                                                             warm_cache: Path) -> None:
    """``draft.online`` through the driver: every step trains the draft (``draft/*``) and pushes it to the engine;
    a draft trainer killed (step 1) or stopped (step 4: its liveness probe finds it) is replaced and the run
    goes on with the engine in rotation; the run checkpoint holds the draft's state, and a run resumed from it
    continues the draft's step count."""
    import json

    import psutil

    from miles.bench.e2e import compose
    from miles.core.run import run_job

    base = ["tracking=none", "trainer.eval_every=0", "task.num_eval_prompts=4", "algo.num_prompts_per_step=4",
            "algo.num_samples_per_prompt=4", "warm_start.steps=5", f"warm_start.cache_dir={warm_cache}",
            DRAFT, "draft.online=true", "draft.k=2", f"trainer.save_dir={tmp_path / 'ckpt'}", "trainer.save_every=2",
            "plugins.allow=[test_draft_online.,miles.]", "trainer.hang_timeout_s=5"]
    KillDraftTrainer.pids = []
    seen: dict[int, dict] = {}
    for steps, kill in ((2, "{step: 1}"), (4, "{step: 4, sig: SIGSTOP}")):  # the second resumes at step 3
        overrides = [*base, f"trainer.num_steps={steps}", "trainer.resume_from=auto",
                     f"hooks=[{{_target_: test_draft_online.KillDraftTrainer, {kill[1:-1]}}}]"]
        run, resolved = compose(overrides)
        run_job(run, resolved_yaml=resolved, overrides=overrides,
                on_metrics=lambda m, s: seen.setdefault(s, {}).update(m))
    assert [s for s in sorted(seen) if s > 0] == [1, 2, 3, 4]
    # step 1's draft update died with its trainer; the new one trained at step 2, and (resumed) at step 3
    assert seen[1]["draft/restarts"] == 1 and "draft/steps" not in seen[1] and "draft/stopped" not in seen[1]
    assert (seen[2]["draft/steps"], seen[2]["draft/restarts"]) == (1, 1)
    assert (seen[3]["draft/steps"], seen[3]["draft/restarts"]) == (2, 0)
    assert seen[4]["draft/restarts"] == 1 and "draft/steps" not in seen[4]  # stopped: found hung, replaced
    # the stopped process was killed, not left behind (Ray delivers the kill on its own time: wait for it)
    deadline, stopped = time.monotonic() + 60, KillDraftTrainer.pids[1]
    while psutil.pid_exists(stopped) and psutil.Process(stopped).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the stopped draft trainer {stopped} is still there after 60 s"
        time.sleep(0.2)
    for step in (2, 3):
        assert seen[step]["draft/tokens"] > 0 and seen[step]["draft/update_s"] >= 0
    for step in (1, 2, 3, 4):  # the engine never left the rotation
        assert 0 < seen[step]["rollout/spec_accept_rate"] <= 1 and seen[step]["rollout/engines_alive"] == 1
    saved = tmp_path / "ckpt" / "step_000002" / "draft"
    assert json.loads((saved / "draft_state.json").read_text())["steps"] == 1 and (saved / "model.safetensors").is_file()
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.core.resume import export_draft

    (base_draft,) = warm_cache.glob("qwen3-tiny-*")  # the draft's build: the policy's flavor and task
    out = export_draft(tmp_path / "ckpt" / "step_000002", base_draft, tmp_path / "exported")
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for k, v in load_file(str(saved / "model.safetensors")).items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exists"):
        export_draft(tmp_path / "ckpt" / "step_000002", base_draft, out)


def test_without_wait_a_push_keeps_the_engines_draft_while_its_training_runs_and_still_finds_a_hang(
        ray_cluster, warm_cache: Path) -> None:
    """``draft.wait=false``: at step 1 the draft trainer is stopped for 2 s (slow, not hung: it answers its probe once
    it runs again), so step 1's push leaves the engines' draft as loaded (no ``draft/steps``, lag 1) and step 2 takes
    no new batch while that training is in flight; step 2 (which waits 2 s before its train step, so that training
    has ended) pushes it (lag 1: step 1's samples). At step 3 the trainer is stopped for good: the push does not
    wait for its training, but its liveness probe finds it hung and it is replaced; the engine serves every step."""
    from miles.bench.e2e import compose
    from miles.core.run import run_job

    KillDraftTrainer.pids = []
    hooks = ("hooks=[{_target_: test_draft_online.KillDraftTrainer, step: 1, sig: SIGSTOP, resume_after_s: 2.0, "
             "name: slow}, {_target_: test_draft_online.Pause, step: 2, seconds: 2.0}, "
             "{_target_: test_draft_online.KillDraftTrainer, step: 3, sig: SIGSTOP, name: hung}]")
    overrides = ["tracking=none", "trainer.eval_every=0", "task.num_eval_prompts=4", "algo.num_prompts_per_step=4",
                 "algo.num_samples_per_prompt=4", "warm_start.steps=5", f"warm_start.cache_dir={warm_cache}",
                 DRAFT, "draft.online=true", "draft.wait=false", "draft.k=2", "trainer.num_steps=3",
                 "plugins.allow=[test_draft_online.,miles.]", "trainer.hang_timeout_s=4", hooks]
    seen: dict[int, dict] = {}
    run, resolved = compose(overrides)
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.setdefault(s, {}).update(m))
    assert "draft/steps" not in seen[1] and seen[1]["draft/lag_steps"] == 1 and seen[1]["draft/restarts"] == 0
    assert seen[2]["draft/steps"] == 1 and seen[2]["draft/lag_steps"] == 1 and seen[2]["draft/update_s"] >= 0
    assert "draft/steps" not in seen[3] and seen[3]["draft/restarts"] == 1
    for step in (1, 2, 3):
        assert 0 < seen[step]["rollout/spec_accept_rate"] <= 1 and seen[step]["rollout/engines_alive"] == 1


def test_a_lost_draft_trainer_with_no_replacement_stops_the_drafts_training_not_the_run(ray_cluster, models) -> None:
    """trainer.max_failures=0, or a replacement that does not start (here: its draft checkpoint is missing):
    the weight push returns ``draft/stopped`` 1, the loop holds no draft trainer from then on, and nothing is
    raised."""
    import ray

    from miles.core.step import LoopContext, push_draft

    def failing_start():
        new = ray.remote(DraftTrainer).options(num_cpus=0).remote(str(models["draft"] / "missing"),
                                                                  str(models["policy"]), lr=1e-2)
        ray.get(new.health.remote())
        return new

    seqs = [([3, 4, 5], [6, 7, 8], [1, 1, 1])]
    for max_failures, restart, restarts in ((0, None, 0.0), (1, failing_start, 1.0)):
        trainer = ray.remote(DraftTrainer).options(num_cpus=0).remote(str(models["draft"]), str(models["policy"]),
                                                                      lr=1e-2)
        ray.kill(trainer, no_restart=True)  # its calls fail as a dead actor's (RayActorError)
        ctx = LoopContext(run=validate({"trainer": {"max_failures": max_failures}}), task=None, rollout=None,
                          trainers=[], engines=[], advantage_fn=None, log_metrics=None, draft=trainer,
                          restart_draft=restart)
        ctx.draft_training = trainer.train.remote(seqs)
        assert push_draft(ctx, 1) == {"draft/restarts": restarts, "draft/stopped": 1.0}
        assert ctx.draft is None and ctx.draft_restarts == restarts
