"""``python -m miles.bench async``: the same workload under ``schedule=sync``, ``one_step_off`` and
``fully_async``, alternating, in one command.

``sync`` runs colocated, engine and trainer taking turns with all ``--threads`` torch threads each;
``sync_disaggregated`` is the same loop on the async schedules' placement, for the ratio at equal
cores per phase. The async schedules run disaggregated, the engine and the trainer rank each on its
own share of the threads (``--threads // 2``, at least 1), since their phases overlap. Every seed
(``--seeds``) runs the four once, in the order of ``--schedules``, from the same checkpoint (built
once); a seed draws the same sequence of prompts in every schedule (the procedural tasks draw one
prompt at a time), though the async schedules train on them in the order their groups finish.

Per run: trained samples per second over steps 1..N (``algo.num_prompts_per_step x
num_samples_per_prompt`` per step, divided by the sum of ``perf/step_time_s``: rollout or the wait
for it, train step and weight sync; evaluation excluded; step 1 included: every schedule starts with
no rollout done), the trainer's busy fraction (``perf/train_s`` over the step time), the engines'
busy fraction (the share of the step time the engines spent generating, ``perf/engine_busy_frac``
from the engines' own counters, weighted by step time; under sync at most the rollout's share), the
share of the step spent on the rollout (sync) or waiting for it (async), staleness, the share of trained
samples whose tokens come from more than one weight version (partial rollouts), and
``eval/accuracy`` after the run (the same number of trained samples in every schedule).

``--engine sglang`` runs every schedule with ``rollout=sglang`` (real SGLang servers; weight pushes
interrupt the rows in flight and continue them on the new weights, :mod:`miles.rollout.sglang_calls`).
A server is started for each placement (``sync`` colocated, the others disaggregated) and kept
between the jobs that share one (:mod:`miles.rollout.sglang_engine`); the engine busy fraction is
then the share of time with a request in flight on the server. ``--trainer megatron`` runs every
schedule on the megatron trainer.

Each run's line also holds its ``eval/accuracy`` by step (step 0, every ``--eval-every`` steps and
the last); ``--plot PATH`` draws those curves, one line per schedule and seed, into a PNG.

The last line printed is JSON: per schedule the mean over seeds of throughput, busy fractions and
eval accuracy (with the standard error over seeds, or over eval prompts with one seed), and
``ratio_throughput_<schedule>_over_sync`` and ``..._over_sync_disaggregated`` (ratios of those
means).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles.bench.e2e import WORKLOADS, built_checkpoint, compose

log = logging.getLogger("miles.bench.async")

SCHEDULES = ("sync", "sync_disaggregated", "one_step_off", "fully_async")

WORKLOADS_ASYNC: dict[str, list[str]] = {
    **WORKLOADS,
    "count_tiny": ["model=qwen3", "task=count", "algo=grpo", "algo.num_prompts_per_step=16",
                   "algo.num_samples_per_prompt=8", "rollout.max_new_tokens=64", "task.num_eval_prompts=64"],
    "default": [],
}
"""``short`` and ``long`` as in ``bench e2e``; ``count_tiny``: the long-output ``count`` task on the tiny model;
``default``: the default run (``python -m miles``)."""


def schedule_overrides(schedule: str, threads: int) -> list[str]:
    """Placement and schedule of one side (see the module docstring)."""
    if schedule == "sync":
        return ["schedule=sync", "placement=colocate", f"placement.torch_threads_per_actor={threads}"]
    half = max(1, threads // 2)
    name = "sync" if schedule == "sync_disaggregated" else schedule
    return [f"schedule={name}", "placement=disaggregated", f"placement.torch_threads_per_actor={half}"]


def run_one(overrides: list[str]) -> tuple[dict[str, Any], dict[int, float]]:
    """One job; per-step metrics from the loop, final eval from the job. Returns its numbers and its
    ``eval/accuracy`` by step (step 0 and the evaluation steps)."""
    from miles.core.run import run_job

    run, resolved = compose(overrides)
    steps: dict[int, dict[str, float]] = {}
    final = run_job(run, resolved_yaml=resolved, overrides=overrides,
                    on_metrics=lambda m, s: steps.setdefault(s, {}).update(m))
    per_step = run.algo.num_prompts_per_step * run.algo.num_samples_per_prompt
    curve = {s: m["eval/accuracy"] for s, m in sorted(steps.items()) if "eval/accuracy" in m}
    later = [m for s, m in sorted(steps.items()) if s >= 1 and "perf/step_time_s" in m]
    return run_summary(later, per_step, final), curve


def run_summary(later: list[dict[str, float]], samples_per_step: int, final: dict[str, float]) -> dict[str, Any]:
    """The numbers of one run (module docstring) from its per-step metrics (steps 1..N) and final ones."""
    step_s = sum(m["perf/step_time_s"] for m in later)
    with_busy = [m for m in later if "perf/engine_busy_frac" in m]
    engine_busy = (sum(m["perf/engine_busy_frac"] * m["perf/step_time_s"] for m in with_busy)
                   / sum(m["perf/step_time_s"] for m in with_busy)) if with_busy else None
    return {
        "samples_per_s": samples_per_step * len(later) / step_s,
        "trainer_busy_frac": sum(m["perf/train_s"] for m in later) / step_s,
        "engine_busy_frac": engine_busy,
        "rollout_wait_frac": sum(m["perf/rollout_s"] for m in later) / step_s,
        "staleness_mean": statistics.fmean(m.get("train/staleness_mean", 0.0) for m in later),
        "partial_rollout_frac": statistics.fmean(m.get("train/partial_rollout_frac", 0.0) for m in later),
        "stale_dropped_frac": later[-1].get("train/stale_dropped_frac", 0.0),
        "eval_accuracy": final["eval/accuracy"], "eval_accuracy_se": final["eval/accuracy_se"],
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rows in runs.items():
        acc = [r["eval_accuracy"] for r in rows]
        out[name] = {k: _mean(r[k] for r in rows) for k in rows[0]} | {
            "eval_accuracy_se": round(statistics.stdev(acc) / len(acc) ** 0.5 if len(acc) > 1
                                      else rows[0]["eval_accuracy_se"], 4)}
    for ref in ("sync", "sync_disaggregated"):
        for name in runs:
            if name not in ("sync", ref) and ref in runs:
                out[f"ratio_throughput_{name}_over_{ref}"] = round(
                    out[name]["samples_per_s"] / out[ref]["samples_per_s"], 3)
    return out


def _mean(values: Iterable[float | None]) -> float | None:
    """Mean of the values that are there, rounded (None when none is: an engine without a busy counter)."""
    there = [v for v in values if v is not None]
    return round(statistics.fmean(there), 4) if there else None


def plot_curves(curves: dict[str, list[tuple[int, dict[int, float]]]], dest: Path, title: str) -> None:
    """``eval/accuracy`` against the step, one line per schedule and seed, into the PNG ``dest``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    for i, (schedule, runs) in enumerate(curves.items()):
        for j, (seed, curve) in enumerate(runs):
            ax.plot(list(curve), list(curve.values()), marker="o", color=f"C{i}", alpha=1.0 if j == 0 else 0.5,
                    label=f"{schedule} (seed {seed})")
    ax.set(xlabel="step", ylabel="eval/accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, not over them
    fig.tight_layout()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench async", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS_ASYNC), default="count_tiny")
    p.add_argument("--engine", choices=("torch", "sglang"), default="torch",
                   help="rollout engine of every run (sglang: needs scripts/setup_sglang.sh)")
    p.add_argument("--trainer", choices=("fsdp", "megatron"), default="fsdp",
                   help="trainer of every run (megatron: needs the megatron extra)")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds; each runs every schedule once")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="order within a seed")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the sync side (split when async)")
    p.add_argument("--eval-every", type=int, default=0, help="trainer.eval_every (0: step 0 and the end only)")
    p.add_argument("--plot", type=Path, default=None, help="write eval/accuracy per step, per schedule, to this PNG")
    p.add_argument("--async-override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the one_step_off and fully_async runs only (repeatable), "
                        "e.g. schedule.max_staleness=1")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    base = [*WORKLOADS_ASYNC[args.workload], f"rollout={args.engine}", f"trainer={args.trainer}",
            f"trainer.num_steps={args.steps}",
            f"trainer.eval_every={args.eval_every}", "tracking=none"]
    checkpoint = built_checkpoint(base, args.threads)
    runs: dict[str, list[dict[str, Any]]] = {}
    curves: dict[str, list[tuple[int, dict[int, float]]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for schedule in args.schedules.split(","):
            overrides = [*base, f"seed={seed}", f"model.path={checkpoint}",
                         *schedule_overrides(schedule, args.threads)]
            if schedule in ("one_step_off", "fully_async"):
                overrides += args.async_override
            log.info("seed %d, %s: %s", seed, schedule, " ".join(overrides))
            result, curve = run_one(overrides)
            runs.setdefault(schedule, []).append(result)
            curves.setdefault(schedule, []).append((seed, curve))
            print("miles.bench async run: " + json.dumps({"seed": seed, "schedule": schedule, **result,
                                                          "eval_curve": curve}), flush=True)
    if args.plot is not None:
        plot_curves(curves, args.plot, f"{args.workload}: eval/accuracy, {args.steps} steps")
    print(json.dumps(summarize(runs) | {"workload": args.workload, "engine": args.engine,
                                        "trainer": args.trainer, "steps": args.steps,
                                        "threads": args.threads,
                                        "seeds": args.seeds, "async_overrides": args.async_override}), flush=True)
    return 0
