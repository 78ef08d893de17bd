"""On-policy distillation: the torch engine's ``score`` against a plain forward and against its own sampling
log-probs, the per-token advantages of ``algo=opd`` computed by hand, and the config's refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from miles.config.schema import PrecisionConfig
from miles.rollout.torch_engine import TorchEngine
from miles.types import GenerateRequest, SamplingParams, ScoreRequest

FP32 = PrecisionConfig()


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir: Path) -> TorchEngine:
    eng = TorchEngine(str(tiny_qwen3_dir), FP32, seed=0, max_batch_size=8, max_prefill_tokens=64)
    yield eng
    eng.close()


def _reference(path: Path, prompt: tuple[int, ...], response: tuple[int, ...], t: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / t, dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_is_the_forward_of_prompt_and_response(engine: TorchEngine, tiny_qwen3_dir: Path,
                                                     temperature: float) -> None:
    # rows of different lengths in one call; max_prefill_tokens=64 splits them over several forwards
    reqs = [ScoreRequest(prompt_ids=(5, 9, 11), response_ids=(17, 3, 40, 41, 2)),
            ScoreRequest(prompt_ids=(7,), response_ids=(8, 9)),
            ScoreRequest(prompt_ids=tuple(range(3, 30)), response_ids=tuple(range(30, 50))),
            ScoreRequest(prompt_ids=(4, 4), response_ids=())]
    out = engine.score(reqs, temperature=temperature, top_k=3)
    assert [len(o.logprobs) for o in out] == [5, 2, 20, 0]
    for r, o in zip(reqs[:3], out[:3], strict=True):
        ref = _reference(tiny_qwen3_dir, r.prompt_ids, r.response_ids, temperature)
        assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-5), (o.logprobs, ref)
        for top, lp, tok in zip(o.top_logprobs, o.logprobs, r.response_ids, strict=True):
            values = [v for _, v in top]
            assert len(top) == 3 and values == sorted(values, reverse=True)
            assert all(v <= 0 for v in values)
            if tok in dict(top):  # the sampled token's log-prob is the same number in both
                assert math.isclose(dict(top)[tok], lp, abs_tol=1e-6)
            else:
                assert lp <= values[-1] + 1e-6
    assert out[3].top_logprobs == ()


def test_score_of_a_sampled_response_equals_its_sampling_logprobs(engine: TorchEngine) -> None:
    sp = SamplingParams(temperature=0.8, max_new_tokens=12)
    gen = engine.generate([GenerateRequest(request_id=f"r{i}", prompt_ids=(5 + i, 9, 11), seed=i) for i in range(3)], sp)
    scored = engine.score([ScoreRequest(prompt_ids=(5 + i, 9, 11), response_ids=g.response_ids)
                           for i, g in enumerate(gen)], temperature=0.8)
    for g, s in zip(gen, scored, strict=True):
        assert len(g.response_ids) > 0
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(g.logprobs), atol=1e-5)


def test_score_refuses_bad_input_naming_it(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match="request 1 holds token ids outside"):
        engine.score([ScoreRequest(prompt_ids=(1,), response_ids=(2,)),
                      ScoreRequest(prompt_ids=(1,), response_ids=(96,))])
    with pytest.raises(ValueError, match="request 0 has an empty prompt"):
        engine.score([ScoreRequest(prompt_ids=(), response_ids=(2,))])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        engine.score([ScoreRequest(prompt_ids=(1,), response_ids=(2,))], temperature=0.0)
    assert engine.score([]) == []


# ---- the advantages, by hand ---------------------------------------------------------------------

def test_opd_token_advantages_by_hand() -> None:
    from miles.algos.distill import opd_token_advantages

    adv, m = opd_token_advantages(
        [0.5, -1.0, 2.0],
        [[-1.0, -2.0, -0.5], [-0.1, -3.0], [-1.0]],
        [[-1.5, -1.0, -0.5], [-0.6, -0.2], None],  # the third was not scored (a failed sample)
        [[1, 0, 1], [1, 1], [1]],
        distill_coef=2.0, task_reward_weight=0.5)
    # A_t = 0.5 * A + 2 * (log q - log p) on loss tokens, 0 elsewhere
    assert adv == [[0.25 + 2 * -0.5, 0.0, 0.25 + 0.0], [-0.5 + 2 * -0.5, -0.5 + 2 * 2.8], [1.0]]
    # means over the 4 scored loss tokens: log p - log q = 0.5, 0.0, 0.5, -2.8
    assert m["distill/reverse_kl"] == pytest.approx((0.5 + 0.0 + 0.5 - 2.8) / 4)
    assert m["distill/teacher_logprob"] == pytest.approx((-1.5 - 0.5 - 0.6 - 0.2) / 4)
    assert m["distill/policy_logprob"] == pytest.approx((-1.0 - 0.5 - 0.1 - 3.0) / 4)
    assert m["distill/scored_samples"] == 2
    with pytest.raises(ValueError, match="sample 0 has 2 rollout log-probs, 1 teacher log-probs"):
        opd_token_advantages([0.0], [[-1.0, -1.0]], [[-1.0]], [[1, 1]], distill_coef=1.0, task_reward_weight=0.0)


# ---- the config ----------------------------------------------------------------------------------

TEACHER_SPEC = "{_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: null}"
TEACHER = f"teacher.model={TEACHER_SPEC}"


def _compose(overrides: list[str]):
    from miles.bench.e2e import compose

    return compose(overrides)[0]


@pytest.mark.parametrize(("overrides", "match"), [
    (["algo=opd"], r"algo.distill_coef=1 \(algo=opd\) needs a teacher .*set teacher.model"),
    ([TEACHER], r"teacher.model is set, but algo.distill_coef is 0"),
    (["algo=ppo", TEACHER, "+algo.distill_coef=1"], r"teacher cannot be combined with algo.estimator=gae"),
    (["algo=opd", "adapter=lora", f"+tenants=[{{name: a, task: count, teacher: {TEACHER_SPEC}}}, {{name: b, task: largest}}]"],
     r"tenant\(s\) b have no teacher; give each tenant one \(tenants\[i\].teacher\) or set teacher.model"),
    (["adapter=lora", f"+tenants=[{{name: a, task: count, teacher: {TEACHER_SPEC}}}]"],
     r"tenants\[i\].teacher is set, but algo.distill_coef is 0"),
    (["algo=opd", "adapter=lora", "+tenants=[{name: a, task: count, teacher: {_target_: miles.models.qwen3.qwen3_spec, "
      "flavor: tiny, path: /nonexistent}}]"], r"tenants\[a\].teacher: teacher.model.path: no config.json"),
    (["algo=opd", TEACHER, "teacher.num_engines=0"], r"teacher.num_engines: must be > 0"),
    (["algo=opd", TEACHER, "teacher.cpus_per_engine=2"], r"teacher.cpus_per_engine applies to teacher.placement=own"),
    (["algo=opd", TEACHER, "algo.task_reward_weight=-1"], r"algo.task_reward_weight: must be >= 0"),
    (["algo=opd", "teacher.model={_target_: miles.models.qwen3.qwen3_spec, flavor: tiny, path: /nonexistent}"],
     r"teacher.model.path: no config.json in '/nonexistent'"),
])
def test_teacher_refusals_say_why(overrides: list[str], match: str) -> None:
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        _compose(overrides)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path: Path) -> None:
    import json

    from miles.config import ConfigError

    for name, size in (("policy", 96), ("other", 128)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"vocab_size": size}))
    with pytest.raises(ConfigError, match=r"teacher's tokenizer \(.*other\) does not match the policy's \(.*policy\): "
                                          r"vocab_size 96 \(policy\) != 128 \(teacher\)"):
        _compose(["algo=opd", "experiment=none", f"model.path={tmp_path / 'policy'}",
                  f"teacher.model={{_target_: miles.models.hf.hf_spec, flavor: checkpoint, path: {tmp_path / 'other'}}}"])


def test_the_plan_places_teacher_engines_colocated_or_in_a_pool_of_their_own() -> None:
    from miles.core.plan import make_plan
    from miles.machine import Machine

    co = make_plan(_compose(["algo=opd", TEACHER, "teacher.num_engines=2", "placement.num_engines=2"]), Machine(cpus=4))
    assert [(s.role, s.pool, s.bundle, s.cpus) for s in co.teachers] == [("teacher", 0, 0, 0), ("teacher", 0, 1, 0)]
    assert len(co.pools) == 1 and "teacher: 2 engine(s)" in co.describe() and "no CPUs of their own" in co.describe()
    own = make_plan(_compose(["algo=opd", TEACHER, "teacher.placement=own", "teacher.cpus_per_engine=0.5"]),
                    Machine(cpus=4))
    assert [p.name for p in own.pools] == ["shared", "teacher"]
    assert [(s.pool, s.bundle, s.cpus) for s in own.teachers] == [(1, 0, 0.5)]
    assert own.key() != make_plan(_compose([]), Machine(cpus=4)).key()
    assert "prefix_cache_tokens" not in own.teacher_kwargs
    assert make_plan(_compose([]), Machine(cpus=4)).teachers == ()


def test_each_tenant_gets_teacher_engines_of_its_own_and_its_own_or_the_default_teacher() -> None:
    from miles.config.teacher import teacher_models
    from miles.core.plan import make_plan
    from miles.machine import Machine

    flat = "{_target_: miles.models.qwen3.qwen3_spec, flavor: 20m, path: null}"
    run = _compose(["algo=opd", "adapter=lora", TEACHER, "teacher.num_engines=2",
                    f"+tenants=[{{name: a, task: count, teacher: {flat}}}, {{name: b, task: largest}}]"])
    assert [(n, m.flavor) for n, m in teacher_models(run)] == [("a", "20m"), ("b", "tiny")]
    plan = make_plan(run, Machine(cpus=4))
    assert plan.teacher_names == ("a", "b") and len(plan.teachers) == 4
    assert [plan.teacher_name(i) for i in range(4)] == ["a", "a", "b", "b"]
    assert "2 for each of the tenants' teachers (a, b)" in plan.describe()


# ---- end to end ----------------------------------------------------------------------------------

def _flat_teacher(policy: Path, out: Path) -> Path:
    """The policy with its output layer scaled by 0.1: the same ranking of tokens, a much flatter
    distribution (higher entropy) at every position."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(policy, out)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short warm start for the module's runs (the student and, scaled, its teacher)."""
    return tmp_path_factory.mktemp("warm_cache")


@pytest.mark.parametrize(("trainer", "schedule"), [  # FSDP under sync: test_e2e.py's every-algo run
    pytest.param("megatron", "sync", marks=pytest.mark.megatron), ("fsdp", "one_step_off")])
def test_opd_pulls_the_student_toward_its_teacher(ray_cluster, tmp_path: Path, warm_cache: Path, trainer: str,
                                                  schedule: str) -> None:
    """``algo=opd`` with a teacher much flatter than the student: in 10 steps the student's entropy rises toward
    the teacher's and the reverse KL falls, with either trainer and under an async schedule. The per-token
    advantages reach the trainer unchanged: synchronously, with one mini-batch, the PPO-clip loss is
    ``mean(log p - log q)``, the logged reverse KL, at every step."""
    if trainer == "megatron":
        pytest.importorskip("megatron.core")
    from miles.bench.e2e import built_checkpoint, compose
    from miles.core.run import run_job

    base = ["tracking=none", "trainer.eval_every=0", "task.num_eval_prompts=4", "rollout.eval_samples_per_prompt=2",
            "algo.num_prompts_per_step=8", "algo.num_samples_per_prompt=4", f"trainer={trainer}",
            "warm_start.steps=40", f"warm_start.cache_dir={warm_cache}"]
    if schedule != "sync":
        base += [f"schedule={schedule}", "placement=disaggregated"]
    teacher = _flat_teacher(Path(built_checkpoint(base, 2)), tmp_path / "teacher")
    overrides = [*base, "algo=opd", "trainer.num_steps=10", "trainer.lr=3e-3", "trainer.lr_warmup_steps=0",
                 f"teacher.model={{_target_: miles.models.hf.hf_spec, flavor: checkpoint, path: {teacher}}}"]
    run, resolved = compose(overrides)
    seen: dict[int, dict] = {}
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.setdefault(s, dict(m)))
    steps = [seen[s] for s in range(1, 11)]
    for m in steps:
        assert m["distill/scored_samples"] == 32 and m["distill/teacher_engines"] == 1
        if schedule == "sync":
            assert m["train/loss"] == pytest.approx(m["distill/reverse_kl"], abs=1e-4)
    kl = [m["distill/reverse_kl"] for m in steps]
    entropy = [m["train/entropy"] for m in steps]
    print(f"{trainer} {schedule}: reverse KL {kl[0]:.3f} -> {kl[-1]:.3f}, entropy {entropy[0]:.3f} -> {entropy[-1]:.3f}")
    assert entropy[-1] > 1.5 * entropy[0]
    assert kl[-1] < 0.8 * kl[0]


def test_each_tenant_is_distilled_from_its_own_teacher(ray_cluster, tmp_path: Path) -> None:
    """Multi-LoRA tenants with a teacher each: tenant ``same``'s teacher is the base model itself, so at step 1
    (LoRA adapters start as the identity) its reverse KL, and with it its PPO-clip loss, is 0 to rounding;
    tenant ``flat``'s teacher is the base with a flattened output layer, so its loss is the KL to it. Samples
    scored by the wrong teacher would swap the two."""
    from miles.bench.e2e import built_checkpoint, compose
    from miles.core.run import run_job

    base = ["tracking=none", "trainer.eval_every=0", "task.num_eval_prompts=4", "algo.num_prompts_per_step=4",
            "algo.num_samples_per_prompt=4", "warm_start.steps=0", f"warm_start.cache_dir={tmp_path / 'warm'}",
            "adapter=lora", "+tenants=[{name: same, task: arithmetic}, {name: flat, task: largest}]"]
    policy = Path(built_checkpoint(base, 2))
    flat = _flat_teacher(policy, tmp_path / "flat")
    tenants = (f"+tenants=[{{name: same, task: arithmetic, teacher: {TEACHER_SPEC}}}, {{name: flat, task: largest, "
               f"teacher: {{_target_: miles.models.hf.hf_spec, flavor: checkpoint, path: {flat}}}}}]")
    overrides = [*base[:-1], tenants, "algo=opd", "trainer.num_steps=1"]
    run, resolved = compose(overrides)
    seen: dict[int, dict] = {}
    run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=lambda m, s: seen.setdefault(s, dict(m)))
    m = seen[1]
    assert m["distill/teacher_engines"] == 2 and m["distill/scored_samples"] == 32
    assert abs(m["tenant/same/train/loss"]) < 1e-4, m["tenant/same/train/loss"]
    assert m["tenant/flat/train/loss"] > 0.01, m["tenant/flat/train/loss"]  # measured 0.026


# ---- the teacher pool ----------------------------------------------------------------------------

def _samples(n: int) -> list:
    from miles.types import Sample, Status

    return [Sample(group_id=i, index=0, prompt_ids=[5 + i, 9], response_ids=[11, 12 + i, 2], rollout_logprobs=[-1.0] * 3,
                   loss_mask=[1, 1, 1], status=Status.COMPLETED, weight_version=0) for i in range(n)]


def test_a_lost_teacher_engine_leaves_the_pool_and_a_new_one_takes_its_place(ray_cluster, engine: TorchEngine,
                                                                             tiny_qwen3_dir: Path) -> None:
    """A dead teacher engine and a stopped one (SIGSTOP, no answer within ``teacher.timeout_s``) are taken out and
    their samples scored by the one left, with the same numbers; new engines start in their place and join the
    pool without holding up the step. Without replacements, and none left, the step fails naming each engine."""
    import os
    import signal

    import ray

    from miles.rollout.teacher import TeacherLostError, TeacherPool
    from miles.types import Status

    remote = ray.remote(TorchEngine).options(num_cpus=0.1, max_concurrency=4)

    def new() -> object:
        return remote.remote(str(tiny_qwen3_dir), FP32, max_batch_size=4)

    engines = [new() for _ in range(3)]
    pids = ray.get([e.__ray_call__.remote(lambda self: os.getpid()) for e in engines])
    replaced: list[int] = []
    pool = TeacherPool(engines, temperature=0.9, top_k=2, timeout_s=10,
                       replace=lambda i: replaced.append(i) or new())
    samples = _samples(7)
    samples[6].status = Status.FAILED  # not trainable: not scored
    ray.kill(engines[0], no_restart=True)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        metrics = pool.score(samples)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert metrics["distill/teacher_engines"] == 1 and pool.alive == [2] and metrics["distill/teacher_restarts"] == 0
    assert "died" in pool.lost[0] and "teacher.timeout_s=10s" in pool.lost[1]
    assert sorted(replaced) == [0, 1] and sorted(pool.starting) == [0, 1]  # started, not waited for
    expect = engine.score([ScoreRequest(prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids))
                           for s in samples[:6]], temperature=0.9, top_k=2)
    for s, e in zip(samples[:6], expect, strict=True):
        assert s.metadata["teacher_logprobs"] == pytest.approx(e.logprobs, abs=1e-6)
        assert len(s.metadata["teacher_top_logprobs"]) == 3
    assert "teacher_logprobs" not in samples[6].metadata

    pool._join(60)  # the replacements come up; the next step scores on all three
    again = _samples(6)
    metrics = pool.score(again)
    assert pool.alive == [0, 1, 2] and pool.lost == {} and metrics["distill/teacher_restarts"] == 2
    for s, e in zip(again, expect, strict=True):
        assert s.metadata["teacher_logprobs"] == pytest.approx(e.logprobs, abs=1e-6)

    alone = TeacherPool([pool.engines[2]], temperature=0.9, timeout_s=10)
    ray.kill(pool.engines[2], no_restart=True)
    with pytest.raises(TeacherLostError, match=r"every teacher engine is lost \(engine 0: died"):
        alone.score(_samples(2))


def test_bench_distill_summary_gaps_by_hand() -> None:
    from miles.bench.distill import main, summarize

    runs = {"grpo": [{0: 0.5, 10: 0.6, 20: 0.7}, {0: 0.5, 10: 0.4, 20: 0.5}],
            "opd": [{0: 0.5, 10: 0.7, 20: 0.8}, {0: 0.5, 10: 0.5, 20: 0.6}]}
    out = summarize(runs)
    assert out["grpo"] == {"0": 0.5, "10": 0.5, "20": 0.6} and out["opd"] == {"0": 0.5, "10": 0.6, "20": 0.7}
    assert out["gap_final"] == pytest.approx(0.1) and out["gap_mean"] == pytest.approx(0.1)
    with pytest.raises(SystemExit, match=r"--arms: \['ppo'\] are not grpo or opd"):
        main(["--arms", "grpo,ppo"])
