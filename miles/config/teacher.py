"""Checks of the ``teacher:`` node and ``algo.distill_coef`` (on-policy distillation, docs/distillation.md),
before Ray starts; the tokenizer check of a built teacher runs again once its checkpoint exists
(:func:`miles.core.run.run_job`)."""

from __future__ import annotations

from miles.config.draft import checkpoint_problem
from miles.config.schema import MilesConfig


def teacher_problem(run: MilesConfig) -> str | None:
    """What makes the ``teacher:`` settings and ``algo.distill_coef`` impossible, naming the key; None when
    they can work."""
    t, a = run.teacher, run.algo
    for key, value in {"teacher.num_engines": t.num_engines, "teacher.cpus_per_engine": t.cpus_per_engine,
                       "teacher.timeout_s": t.timeout_s}.items():
        if not value > 0:
            return f"{key}: must be > 0, found {value}"
    if t.top_k < 0:
        return f"teacher.top_k: must be >= 0 (0: off), found {t.top_k}"
    if t.placement != "own" and t.cpus_per_engine != 1.0:
        return ("teacher.cpus_per_engine applies to teacher.placement=own only (colocated teacher engines hold no "
                "CPUs of their own)")
    for key, value in {"algo.distill_coef": a.distill_coef, "algo.task_reward_weight": a.task_reward_weight}.items():
        if value < 0:
            return f"{key}: must be >= 0, found {value}"
    if t.model is None:
        if a.distill_coef > 0:
            return (f"algo.distill_coef={a.distill_coef:g} (algo={a.name}) needs a teacher to score the samples: set "
                    "teacher.model, e.g. teacher.model='{_target_: miles.models.hf.hf_spec, flavor: checkpoint, path: "
                    "DIR}' (an HF directory; miles.core.resume.export_policy writes one from a run checkpoint)")
        return None
    if a.distill_coef == 0:
        return ("teacher.model is set, but algo.distill_coef is 0, so nothing would use the teacher's scores: use "
                "algo=opd (or set algo.distill_coef > 0), or set teacher.model=null")
    why = {
        "algo.estimator=gae": (a.estimator == "gae", "the per-token advantages come from the critic (GAE); "
                               "on-policy distillation adds to a group estimator's (algo=opd is GRPO's)"),
        "tenants": (bool(run.tenants), "a teacher per tenant is not built: one teacher scores one policy's samples"),
        "algo=sft": (a.name == "sft", "supervised fine-tuning has no sampled tokens to score"),
    }
    for setting, (on, reason) in why.items():
        if on:
            return f"teacher.model cannot be combined with {setting}: {reason}"
    return checkpoint_problem(run, t.model, "teacher")
