"""``python -m miles.bench distill``: on-policy distillation (``algo=opd``) from a stronger teacher against
GRPO alone, on the same student, steps and seeds, in one command.

1. **The teacher.** A model (``--teacher-flavor``, default the student's own tiny Qwen3) is built and
   warm-started on the task like every built model, then RL-trained by miles itself: ``--teacher-steps`` GRPO
   steps (default 300, the default run's length), with a run checkpoint at the end. That checkpoint is exported
   as an HF directory (:func:`miles.core.resume.export_policy`). The student then starts where the teacher
   started, and learns from a policy that RL made stronger.
2. **The student.** The tiny model (built once) is trained for ``--steps`` steps twice per seed, alternating:
   - ``grpo``: GRPO on the task reward alone;
   - ``opd``: ``algo=opd`` with the exported teacher, plus the task's GRPO advantage at ``--task-reward-weight``
     (0: the teacher's signal alone).

Everything else is the default run's (``python -m miles``): the ``largest`` task and the held-out set, with
``eval/accuracy`` every ``--eval-every`` steps.

Printed: the teacher's held-out accuracy before and after its RL steps, and one row per evaluated step with both
students' ``eval/accuracy`` and the gap (opd - grpo). The last line is JSON: per arm the mean over seeds of the
accuracy at each evaluated step, ``gap_final`` and ``gap_mean`` (over the evaluated steps after step 0), the
teacher's figures, and the wall times.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.bench.e2e import built_checkpoint

log = logging.getLogger("miles.bench.distill")

WORKLOAD = ["model=qwen3", "task=largest", "tracking=none"]
"""The default run's task on the tiny model (``python -m miles``'s defaults)."""


def run_one(overrides: list[str]) -> tuple[dict[int, float], float]:
    """One job: ``eval/accuracy`` at every step that evaluated (0 and the last included), and its wall time."""
    from miles.bench.e2e import compose
    from miles.core.run import run_job

    run, resolved = compose(overrides)
    evals: dict[int, float] = {}

    def seen(m: dict[str, float], step: int) -> None:
        if "eval/accuracy" in m:
            evals[step] = m["eval/accuracy"]

    t0 = time.perf_counter()
    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=seen)
    evals[run.trainer.num_steps] = final["eval/accuracy"]
    return evals, time.perf_counter() - t0


def train_teacher(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any]]:
    """The teacher: ``--teacher-flavor`` warm-started, then ``--teacher-steps`` GRPO steps; exported as HF."""
    from miles.core.resume import export_policy

    base = [*WORKLOAD, "algo=grpo", f"model.flavor={args.teacher_flavor}", f"seed={args.teacher_seed}",
            f"placement.torch_threads_per_actor={args.threads}"]
    start = Path(built_checkpoint(base, args.threads))
    save = work / "teacher_run"
    overrides = [*base, f"model.path={start}", f"trainer.num_steps={args.teacher_steps}",
                 f"trainer.eval_every={args.teacher_steps}", f"trainer.save_every={args.teacher_steps}",
                 f"trainer.save_dir={save}"]
    log.info("teacher: %s", " ".join(overrides))
    evals, wall = run_one(overrides)
    out = export_policy(save, start, work / "teacher")
    info = {"flavor": args.teacher_flavor, "rl_steps": args.teacher_steps, "eval_accuracy_start": evals[0],
            "eval_accuracy": evals[args.teacher_steps], "wall_s": wall}
    print("miles.bench distill teacher: " + json.dumps(info), flush=True)
    return out, info


def summarize(runs: dict[str, list[dict[int, float]]]) -> dict[str, Any]:
    """Per arm, the mean over seeds of the accuracy at each evaluated step; the gaps opd - grpo."""
    steps = sorted(set.intersection(*(set(r) for rows in runs.values() for r in rows)))
    mean = {arm: {s: statistics.fmean(r[s] for r in rows) for s in steps} for arm, rows in runs.items()}
    out: dict[str, Any] = {arm: {str(s): v for s, v in m.items()} for arm, m in mean.items()}
    if "grpo" in mean and "opd" in mean:
        later = [s for s in steps if s > 0]
        out["gap_final"] = mean["opd"][steps[-1]] - mean["grpo"][steps[-1]]
        out["gap_mean"] = statistics.fmean(mean["opd"][s] - mean["grpo"][s] for s in later) if later else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="RL steps of each student run")
    p.add_argument("--eval-every", type=int, default=10, help="trainer.eval_every of the student runs")
    p.add_argument("--seeds", default="0", help="comma-separated student seeds; each runs both arms")
    p.add_argument("--arms", default="grpo,opd", help="order within a seed")
    p.add_argument("--task-reward-weight", type=float, default=0.0,
                   help="algo.task_reward_weight of the opd arm (0: the teacher's signal alone)")
    p.add_argument("--distill-coef", type=float, default=1.0, help="algo.distill_coef of the opd arm")
    p.add_argument("--teacher-flavor", default="tiny", help="the teacher's model.flavor (qwen3: tiny, 20m)")
    p.add_argument("--teacher-steps", type=int, default=300, help="GRPO steps that train the teacher")
    p.add_argument("--teacher-seed", type=int, default=0)
    p.add_argument("--teacher", default=None,
                   help="an HF checkpoint directory to use as the teacher instead of training one (e.g. the "
                        "'teacher' export in an earlier run's --work-dir)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor")
    p.add_argument("--work-dir", default=None, help="where the teacher's run and export go (default: a temp dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ("grpo", "opd")]:
        raise SystemExit(f"--arms: {unknown} are not grpo or opd")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="miles-bench-distill-"))
    t0 = time.perf_counter()
    if args.teacher is not None:
        teacher, teacher_info = Path(args.teacher), {"path": args.teacher}
    else:
        teacher, teacher_info = train_teacher(args, work) if "opd" in arms else (None, {})
    base = [*WORKLOAD, f"trainer.num_steps={args.steps}", f"trainer.eval_every={args.eval_every}",
            f"placement.torch_threads_per_actor={args.threads}"]
    student = built_checkpoint(base, args.threads)
    runs: dict[str, list[dict[int, float]]] = {}
    walls: dict[str, list[float]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in arms:
            extra = ["algo=grpo"] if arm == "grpo" else [
                "algo=opd", f"algo.task_reward_weight={args.task_reward_weight}", f"algo.distill_coef={args.distill_coef}",
                f"teacher.model={{_target_: miles.models.hf.hf_spec, flavor: checkpoint, path: {teacher}}}"]
            overrides = [*base, f"seed={seed}", f"model.path={student}", *extra]
            log.info("seed %d, %s: %s", seed, arm, " ".join(overrides))
            evals, wall = run_one(overrides)
            runs.setdefault(arm, []).append(evals)
            walls.setdefault(arm, []).append(wall)
            print("miles.bench distill run: " + json.dumps({"seed": seed, "arm": arm, "wall_s": round(wall, 1),
                                                           "eval_accuracy": evals}), flush=True)
    summary = summarize(runs)
    if "grpo" in runs and "opd" in runs:
        print(f"{'step':>6} {'grpo':>8} {'opd':>8} {'gap':>8}")
        for s in summary["grpo"]:
            g, o = summary["grpo"][s], summary["opd"][s]
            print(f"{s:>6} {g:8.3f} {o:8.3f} {o - g:+8.3f}")
    out = summary | {"teacher": teacher_info, "wall_s": {a: statistics.fmean(w) for a, w in walls.items()},
                     "total_wall_s": time.perf_counter() - t0, "steps": args.steps, "seeds": args.seeds,
                     "task_reward_weight": args.task_reward_weight, "distill_coef": args.distill_coef}
    print(json.dumps(json.loads(json.dumps(out), parse_float=lambda x: round(float(x), 4))), flush=True)
    return 0
