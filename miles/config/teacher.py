"""Checks of the ``teacher:`` node and ``algo.distill_coef`` (on-policy distillation, docs/distillation.md),
before Ray starts; the tokenizer check of a built teacher runs again once its checkpoint exists
(:func:`miles.core.run.run_job`)."""

from __future__ import annotations

from typing import Any

from miles.config.draft import checkpoint_problem
from miles.config.schema import MilesConfig


def teacher_models(run: MilesConfig) -> list[tuple[str, Any]]:
    """The teachers of a run as ``(name, model spec)``, one per group of teacher engines: ``("teacher",
    teacher.model)`` without tenants; with tenants, each tenant's (``tenants[i].teacher``, else ``teacher.model``)
    under its name, leaving out tenants with neither. Empty: no teacher."""
    if not run.tenants:
        return [("teacher", run.teacher.model)] if run.teacher.model is not None else []
    return [(t.name, t.teacher or run.teacher.model) for t in run.tenants if (t.teacher or run.teacher.model) is not None]


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
    teachers = teacher_models(run)
    if run.tenants and a.distill_coef > 0 and teachers and len(teachers) < len(run.tenants):
        named = {n for n, _ in teachers}
        return (f"algo.distill_coef={a.distill_coef:g}: tenant(s) "
                f"{', '.join(x.name for x in run.tenants if x.name not in named)} have no teacher; give each tenant "
                "one (tenants[i].teacher) or set teacher.model, which serves every tenant without its own")
    if not teachers:
        if a.distill_coef > 0:
            return (f"algo.distill_coef={a.distill_coef:g} (algo={a.name}) needs a teacher to score the samples: set "
                    "teacher.model, e.g. teacher.model='{_target_: miles.models.hf.hf_spec, flavor: checkpoint, path: "
                    "DIR}' (an HF directory; miles.core.resume.export_policy writes one from a run checkpoint)")
        return None
    if a.distill_coef == 0:
        return (f"{'teacher.model' if t.model is not None else 'tenants[i].teacher'} is set, but algo.distill_coef is 0, so nothing would use the teacher's scores: use "
                "algo=opd (or set algo.distill_coef > 0), or set teacher.model=null")
    why = {
        "algo.estimator=gae": (a.estimator == "gae", "the per-token advantages come from the critic (GAE); "
                               "on-policy distillation adds to a group estimator's (algo=opd is GRPO's)"),
        "algo=sft": (a.name == "sft", "supervised fine-tuning has no sampled tokens to score"),
    }
    for setting, (on, reason) in why.items():
        if on:
            return f"on-policy distillation's teacher cannot be combined with {setting}: {reason}"
    for name, model in teachers:
        problem = checkpoint_problem(run, model, "teacher")
        if problem is not None:
            return problem if model is t.model else f"tenants[{name}].teacher: {problem}"
    return None
