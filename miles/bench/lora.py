"""``python -m miles.bench lora``: LoRA (``adapter=lora``) against full fine-tuning on the same workload,
alternating, in one command.

Every seed (``--seeds``) runs ``full`` then ``lora`` (the order of ``--modes``) from the same built
checkpoint, the same prompts and the same number of steps; everything but ``adapter=`` is equal
(``--lora-lr``: the adapter's learning rate; full fine-tuning keeps ``trainer.lr``).

Per run: the trainable share of the policy's parameters (``train/trainable_param_frac``), bytes per
weight sync (``weight_sync/bytes``: the adapters' tensors against the whole model), the median step
time and its train and sync parts, and ``eval/accuracy`` at step 0 and after the run (its gain).

The last line printed is JSON: per mode the means over seeds, and ``ratio_step_time_lora_over_full``,
``ratio_sync_bytes_lora_over_full``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from typing import Any

from miles.bench.e2e import built_checkpoint, compose

log = logging.getLogger("miles.bench.lora")

WORKLOAD = ["model=qwen3", "task=largest", "algo=grpo", "tracking=none"]
"""The default task on the tiny model (``python -m miles``'s defaults)."""


def run_one(overrides: list[str]) -> dict[str, Any]:
    """One job; per-step metrics from the loop, eval at step 0 and at the end."""
    from miles.core.run import run_job

    run, resolved = compose(overrides)
    steps: dict[int, dict[str, float]] = {}
    final = run_job(run, resolved_yaml=resolved, overrides=overrides,
                    on_metrics=lambda m, s: steps.__setitem__(s, dict(m)))
    later = [m for s, m in sorted(steps.items()) if s >= 1]
    first = steps[0]["eval/accuracy"]
    return {
        "trainable_param_frac": later[-1]["train/trainable_param_frac"],
        "sync_bytes": statistics.fmean(m["weight_sync/bytes"] for m in later),
        "step_time_s": statistics.median(m["perf/step_time_s"] for m in later),
        "train_s": statistics.median(m["perf/train_s"] for m in later),
        "sync_s": statistics.median(m["perf/sync_s"] for m in later),
        "eval_accuracy_first": first, "eval_accuracy": final["eval/accuracy"],
        "eval_accuracy_gain": final["eval/accuracy"] - first, "eval_accuracy_se": final["eval/accuracy_se"],
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
                           for name, rows in runs.items()}
    if "full" in out and "lora" in out:
        out["ratio_step_time_lora_over_full"] = out["lora"]["step_time_s"] / out["full"]["step_time_s"]
        out["ratio_sync_bytes_lora_over_full"] = out["lora"]["sync_bytes"] / out["full"]["sync_bytes"]
    return json.loads(json.dumps(out), parse_float=lambda x: round(float(x), 6))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="RL steps per run (300: the default run's length)")
    p.add_argument("--seeds", default="0", help="comma-separated RL seeds; each runs every mode once")
    p.add_argument("--modes", default="full,lora", help="order within a seed")
    p.add_argument("--lora-lr", type=float, default=None, help="adapter.lr (default: conf/adapter/lora.yaml's)")
    p.add_argument("--eval-every", type=int, default=0, help="trainer.eval_every (0: at the start and the end)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per actor")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    base = [*WORKLOAD, f"trainer.num_steps={args.steps}", f"trainer.eval_every={args.eval_every}",
            f"placement.torch_threads_per_actor={args.threads}"]
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in ("full", "lora")]:
        raise SystemExit(f"--modes: {unknown} are not full or lora")
    checkpoint = built_checkpoint(base, args.threads)
    runs: dict[str, list[dict[str, Any]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode in modes:
            extra = ["adapter=lora"] + ([f"adapter.lr={args.lora_lr}"] if args.lora_lr else []) if mode == "lora" else []
            overrides = [*base, f"seed={seed}", f"model.path={checkpoint}", *extra]
            log.info("seed %d, %s: %s", seed, mode, " ".join(overrides))
            result = run_one(overrides)
            runs.setdefault(mode, []).append(result)
            print("miles.bench lora run: " + json.dumps({"seed": seed, "mode": mode, **result}), flush=True)
    print(json.dumps(summarize(runs) | {"steps": args.steps, "seeds": args.seeds, "threads": args.threads}),
          flush=True)
    return 0
