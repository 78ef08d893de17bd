"""``python -m miles.bench e2e``: one GRPO run with miles and one with TRL's ``GRPOTrainer``, same settings.

Both sides get the same checkpoint (model and tokenizer, built by miles from the
workload's config), the same task and chat template, prompts per step, samples
per prompt, max new tokens, temperature, AdamW settings and learning-rate schedule (miles'
:func:`~miles.train.optim.lr_multiplier` on both sides), clip range,
loss aggregation (token mean over the batch: TRL's ``loss_type="dapo"``), group
reward scaling with Bessel's std as TRL does it (``algo.advantage.unbiased_std``), no KL, no dropout, activation checkpointing as miles has it (off; TRL's
default is on), and the same number of steps. They run one
after the other in this process's command, with the same CPU budget: TRL in
this process with ``--threads`` torch threads; miles with its actors at the
same thread count (colocated engine and trainer take turns, as TRL's
generation and training do).

Workloads:

* ``short``: the default tiny model and ``largest`` task, answers of at most
  8 tokens, 8 prompts x 8 samples. Per-step fixed costs dominate here (Ray
  calls, weight sync, process hops on the miles side).
* ``long``: the ``20m`` Qwen3 flavor (19M parameters) on the ``count`` task,
  whose answers run from one number to 64 (a few to ~190 tokens), 16 prompts x
  8 samples, 192 max new tokens. Generation and padding dominate here. miles trains
  it in micro-batches of 2048 padded tokens (``trainer.max_tokens_per_microbatch``; the
  default 8192 suits the tiny model, while on this 19M model on CPU smaller passes are faster:
  a train step of this shape takes 14.0 s at 8192, 12.2 s at 4096, 11.6 s at 2048); TRL
  trains the 128 samples in one pass, its default.

Step time is the median over steps 2..N (step 1 pays one-time warmup on both
sides). Eval accuracy is measured for both by the same function
(:func:`miles.core.evaluate.evaluate`: pass@1 from ``rollout.eval_samples_per_prompt``
samples on the task's held-out prompts, sampled with the run's seed on both sides),
on miles' final weights inside its run and on TRL's final model saved and loaded
into a miles engine.

Seeds (``--seeds 0,1,2``). Both sides start from the same checkpoint (built once,
with the config's seed); each RL seed then runs miles and TRL once. A few RL steps
at a warm-up learning rate move a small model by a noisy amount: on ``long``, the
final accuracy of one framework varies by ~0.2 between seeds, far more than the
standard error of one evaluation. So one seed cannot tell two frameworks apart;
several can. With one seed, ``eval_accuracy_se_*`` is the standard error over the
eval prompts; with several, it is the standard error of the mean over seeds, and
``eval_accuracy_diff_miles_minus_trl`` with ``eval_accuracy_diff_se`` and the interval
``eval_accuracy_diff_ci95`` (the shifts a sign-flip test does not reject) compares the
two sides seed by seed (same seed: same prompts for evaluation, same sampling noise
there). Step times pool the steps 2..N of every seed.

After each seed a line ``miles.bench e2e seed: {...}`` gives that seed's step times and
accuracies, so a run stopped part-way keeps what it finished: ``--pool LOG [LOG ...]`` runs
nothing and prints the summary below over the per-seed lines of earlier runs' output (a seed
found twice is an error).

The last line printed is JSON: per workload ``step_time_s_miles``,
``step_time_s_trl``, ``ratio_step_time_trl_over_miles``, ``eval_accuracy_miles``,
``eval_accuracy_trl`` (means over seeds), their standard errors
(``eval_accuracy_se_*``), the paired difference with its sign-flip p-value
(``eval_accuracy_diff_p``) and the number of seeds where miles ends lower, each seed's own step-time
ratio, ``per_seed`` results and the settings. TRL is the optional ``bench`` extra.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles.bench import names_from

log = logging.getLogger("miles.bench.e2e")

WORKLOADS: dict[str, list[str]] = {
    "short": [
        "model=qwen3", "task=largest", "algo=grpo", "algo.num_prompts_per_step=8",
        "algo.num_samples_per_prompt=8", "rollout.max_new_tokens=8",
    ],
    "long": [
        "model=qwen3", "model.flavor=20m", "task=count", "algo=grpo", "algo.num_prompts_per_step=16",
        "algo.num_samples_per_prompt=8", "rollout.max_new_tokens=192", "warm_start.steps=120",
        "warm_start.batch_size=32", "warm_start.lr=1e-3", "warm_start.max_tokens_per_microbatch=2048",
        "trainer.max_tokens_per_microbatch=2048", "task.num_eval_prompts=64",
    ],
}
"""Config overrides of each workload (on top of the defaults), before the shared ones."""

DEFAULT_STEPS: dict[str, int] = {"short": 100, "long": 6}
"""RL steps per side by default: a short step is ~0.1 s, so its median is taken over more of them."""


def compose(overrides: list[str]) -> tuple[Any, str]:
    """Hydra-compose ``miles.conf`` with ``overrides``; returns (validated MilesConfig, resolved YAML)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from miles.config import validate

    with initialize_config_module(config_module="miles.conf", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return validate(cfg), OmegaConf.to_yaml(cfg, resolve=True)


def built_checkpoint(overrides: list[str], threads: int) -> str:
    """The checkpoint the runs of ``overrides`` start from (built once, cached), and a local Ray cluster
    of at least ``threads`` CPUs (unless one is up), for benchmarks that run several jobs on it."""
    import ray

    from miles.core.run import build_components
    from miles.models.checkpoint import ensure_checkpoint

    run, _ = compose(overrides)
    parts = build_components(run)
    checkpoint = ensure_checkpoint(run, parts["spec"], parts["task"])
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, threads), include_dashboard=False, log_to_driver=False)
    return str(checkpoint)


def run_miles(run: Any, resolved: str, overrides: list[str]) -> dict[str, Any]:
    """One miles job; per-step times from the loop's metrics, final eval from the job."""
    from miles.core.run import run_job

    steps: list[float] = []

    def on_metrics(metrics: dict[str, float], step: int) -> None:
        if step >= 1 and "perf/step_time_s" in metrics:
            steps.append(metrics["perf/step_time_s"])

    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=on_metrics)
    return {"step_times": steps, "eval_accuracy": final["eval/accuracy"], "eval_accuracy_se": final["eval/accuracy_se"],
            "reward_mean": final.get("train/reward_mean")}


def run_trl(run: Any, checkpoint: Path, task: Any, reward_fn: Any, threads: int, out_dir: Path) -> dict[str, Any]:
    """TRL ``GRPOTrainer`` with the same settings; returns per-step times and the saved model dir."""
    import random

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.train.optim import lr_multiplier

    torch.set_num_threads(threads)
    a, r, t = run.algo, run.rollout, run.trainer
    rng = random.Random(run.seed)
    problems = task.sample(a.num_prompts_per_step * t.num_steps, rng)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "label": p.label}
                              for p in problems])

    def reward(completions: list[Any], label: list[Any], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward_fn(x, y)) for x, y in zip(texts, label, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            self.times.append(time.perf_counter() - self._t0)

    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), max_steps=t.num_steps, per_device_train_batch_size=a.num_prompts_per_step
        * a.num_samples_per_prompt, gradient_accumulation_steps=1, num_generations=a.num_samples_per_prompt,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
        learning_rate=t.lr, max_grad_norm=t.max_grad_norm,
        epsilon=a.clip_low, epsilon_high=a.clip_high, beta=0.0, loss_type="dapo", scale_rewards="group",
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=run.seed,
        disable_dropout=True, shuffle_dataset=False, dataloader_num_workers=0,
        gradient_checkpointing=t.activation_checkpointing,  # TRL's default is on; miles' is off
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    # miles' optimizer and LR schedule exactly: HF's "constant_with_warmup" starts at lr 0 (its first
    # update is a no-op) where miles' warmup starts at lr / warmup_steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, warmup_steps=t.lr_warmup_steps, total_steps=t.num_steps, schedule=t.lr_schedule,
        min_lr_ratio=t.min_lr_ratio))
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer], optimizers=(optimizer, scheduler))
    trainer.train()
    saved = out_dir / "trl-final"
    trainer.model.save_pretrained(saved, safe_serialization=True)
    tokenizer.save_pretrained(saved)
    model.generation_config.save_pretrained(saved)
    return {"step_times": timer.times, "model_dir": saved}


def eval_checkpoint(run: Any, checkpoint: Path, task: Any) -> dict[str, float]:
    """The loop's own evaluation of ``checkpoint`` (``eval/accuracy``, ``eval/accuracy_se``, ...) on one engine."""
    import ray
    from transformers import AutoTokenizer

    from miles.core.actors import ENGINE_MAX_CONCURRENCY
    from miles.core.cluster import start_ray
    from miles.core.evaluate import evaluate
    from miles.core.loop import LoopContext
    from miles.core.plan import make_plan
    from miles.machine import Machine
    from miles.rewards import RewardRunner
    from miles.rollout.manager import RolloutManager
    from miles.rollout.torch_engine import TorchEngine

    started = start_ray(run.cluster)
    reward = RewardRunner(run.task.reward, allow=run.plugins.allow, timeout_s=run.task.reward_timeout_s,
                          num_workers=run.task.reward_num_workers, kind=run.task.reward_kind)
    rollout = None
    try:
        slot = make_plan(run, Machine.here()).engines[0]  # started as the run's engines are: same threads and env
        engine = ray.remote(TorchEngine).options(
            num_cpus=0.5, max_concurrency=ENGINE_MAX_CONCURRENCY, runtime_env={"env_vars": dict(slot.env)},
        ).remote(str(checkpoint), run.precision, seed=run.seed, num_threads=slot.threads)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        rollout = RolloutManager([engine], tokenizer, reward, config=run.rollout)
        ctx = LoopContext(run=run, task=task, rollout=rollout, trainers=[],
                          engines=[engine], advantage_fn=lambda x: x, log_metrics=lambda m, s: None)
        return evaluate(ctx, task.eval_problems(run.task.num_eval_prompts))
    finally:
        if rollout is not None:
            rollout.close()
        reward.close()
        if started:
            ray.shutdown()


def bench_workload(name: str, steps: int, threads: int, extra: list[str], out_dir: Path,
                   seeds: list[int] | None = None) -> dict[str, Any]:
    """Both sides on workload ``name`` for every RL seed in ``seeds`` (default: the config's seed)."""
    from miles.core.run import build_components
    from miles.models.checkpoint import ensure_checkpoint

    # TRL's GRPO divides by Bessel's std of the group (miles' default is the population std)
    overrides = [*WORKLOADS[name], "+algo.advantage.unbiased_std=true", f"trainer.num_steps={steps}",
                 "trainer.eval_every=0", "tracking=none",
                 f"placement.torch_threads_per_actor={threads}", *extra]
    run, _ = compose(overrides)
    parts = build_components(run)
    checkpoint = ensure_checkpoint(run, parts["spec"], parts["task"])  # once, with the config's seed
    per_seed = []
    for seed in seeds if seeds is not None else [run.seed]:
        seeded = [*overrides, f"seed={seed}", f"model.path={checkpoint}"]
        run_s, resolved = compose(seeded)
        task, reward_fn = parts["task"], parts["reward_fn"]  # neither depends on the seed
        log.info("[%s] seed %d, miles: %s", name, seed, " ".join(seeded))
        miles_out = run_miles(run_s, resolved, seeded)
        log.info("[%s] seed %d, TRL GRPOTrainer", name, seed)
        trl_out = run_trl(run_s, checkpoint, task, reward_fn, threads, out_dir / name / f"seed{seed}")
        trl_eval = eval_checkpoint(run_s, trl_out["model_dir"], task)
        per_seed.append({
            "seed": seed,
            "step_times_miles": [round(x, 4) for x in miles_out["step_times"]],
            "step_times_trl": [round(x, 4) for x in trl_out["step_times"]],
            "eval_accuracy_miles": round(miles_out["eval_accuracy"], 4),
            "eval_accuracy_trl": round(trl_eval["eval/accuracy"], 4),
            "eval_accuracy_se_miles": round(miles_out["eval_accuracy_se"], 4),
            "eval_accuracy_se_trl": round(trl_eval["eval/accuracy_se"], 4),
        })
        log.info("[%s] seed %d: eval accuracy miles %.3f, TRL %.3f", name, seed,
                 per_seed[-1]["eval_accuracy_miles"], per_seed[-1]["eval_accuracy_trl"])
        # one line per finished seed: a stopped or split run is summed up later with --pool
        print(SEED_LINE + json.dumps({"workload": name, **per_seed[-1]}), flush=True)
    a = run.algo
    return summarize(per_seed) | {
        "steps": steps,
        "prompts_per_step": a.num_prompts_per_step,
        "samples_per_prompt": a.num_samples_per_prompt,
        "max_new_tokens": run.rollout.max_new_tokens,
        "model": f"{run.model.target.rsplit('.', 1)[-1]}/{run.model.flavor}",
        "task": run.task.name,
        "threads": threads,
        "per_seed": per_seed,
    }


SEED_LINE = "miles.bench e2e seed: "
"""Prefix of the per-seed JSON line printed after each seed (what ``--pool`` reads back)."""


def pool(texts: list[str]) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per workload over the per-seed lines found in ``texts`` (the output of runs).

    A (workload, seed) pair found twice is an error: two runs of one seed are not two seeds.
    """
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for text in texts:
        for line in text.splitlines():
            if not line.startswith(SEED_LINE):
                continue
            record = json.loads(line[len(SEED_LINE):])
            rows = by_workload.setdefault(record.pop("workload"), [])
            if any(r["seed"] == record["seed"] for r in rows):
                raise ValueError(f"seed {record['seed']} appears more than once")
            rows.append(record)
    if not by_workload:
        raise ValueError(f"no per-seed lines (starting {SEED_LINE.strip()!r}) found")
    return {name: summarize(rows) | {"per_seed": rows} for name, rows in by_workload.items()}


def summarize(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Step times and eval accuracies of both sides over the seeds of one workload.

    Step times: the median of every seed's steps 2..N together. Accuracy: the mean over seeds; its
    standard error is the one over eval prompts for a single seed, the one over seeds otherwise. The
    difference miles - TRL is taken seed by seed (paired) with the standard error of its mean.
    """
    if not per_seed:
        raise ValueError("summarize: no seeds")

    def after_first(xs: list[float]) -> list[float]:
        return xs[1:] if len(xs) > 1 else xs

    s_miles = statistics.median([x for p in per_seed for x in after_first(p["step_times_miles"])])
    s_trl = statistics.median([x for p in per_seed for x in after_first(p["step_times_trl"])])
    ratios = [statistics.median(after_first(p["step_times_trl"])) / statistics.median(after_first(p["step_times_miles"]))
              for p in per_seed]
    acc = {side: [p[f"eval_accuracy_{side}"] for p in per_seed] for side in ("miles", "trl")}
    diff = [m - t for m, t in zip(acc["miles"], acc["trl"], strict=True)]
    mean = {side: statistics.fmean(xs) for side, xs in acc.items()}
    diff_mean = statistics.fmean(diff)
    if len(per_seed) == 1:
        se = {side: per_seed[0][f"eval_accuracy_se_{side}"] for side in acc}
        # as if independent: the two evaluations share prompts and sampling noise, so this overstates it
        diff_se = (se["miles"] ** 2 + se["trl"] ** 2) ** 0.5
    else:
        se = {side: statistics.stdev(xs) / len(xs) ** 0.5 for side, xs in acc.items()}
        diff_se = statistics.stdev(diff) / len(diff) ** 0.5
    return {
        "step_time_s_miles": round(s_miles, 4),
        "step_time_s_trl": round(s_trl, 4),
        "ratio_step_time_trl_over_miles": round(s_trl / s_miles, 3),
        "eval_accuracy_miles": round(mean["miles"], 4),
        "eval_accuracy_trl": round(mean["trl"], 4),
        # a difference within ~2 standard errors is noise
        "eval_accuracy_se_miles": round(se["miles"], 4),
        "eval_accuracy_se_trl": round(se["trl"], 4),
        "eval_accuracy_diff_miles_minus_trl": round(diff_mean, 4),
        "eval_accuracy_diff_se": round(diff_se, 4),
        "eval_accuracy_diff_p": round(sign_flip_p(diff), 4),
        # None: too few seeds (5 or fewer) for the sign-flip test to reject any difference at 5%
        "eval_accuracy_diff_ci95": [None if b is None else round(b, 4) for b in sign_flip_ci(diff)],
        "seeds_miles_lower": sum(d < 0 for d in diff),
        "ratio_step_time_per_seed": [round(x, 3) for x in ratios],
        "seeds": [p["seed"] for p in per_seed],
    }


def _sign_patterns(n: int, draws: int) -> tuple[torch.Tensor, int]:
    """Sign patterns for the sign-flip test of ``n`` paired differences: all ``2**n`` of them up to 16
    seeds, else ``draws`` seeded random ones. Returns ``([P, n] of +-1 (float64), counted)``, where
    ``counted`` is 1 for sampled patterns (the observed one then counts once, so a p-value is never 0)."""
    if n <= 16:
        bits = (torch.arange(2**n)[:, None] >> torch.arange(n)) & 1
        return (1 - 2 * bits).double(), 0
    gen = torch.Generator().manual_seed(0)
    return (1 - 2 * torch.randint(0, 2, (draws, n), generator=gen)).double(), 1


def _flip_p(patterns: torch.Tensor, counted: int, x: torch.Tensor) -> float:
    observed = abs(float(x.sum())) - 1e-12
    hits = int(((patterns @ x).abs() >= observed).sum())
    return (hits + counted) / (patterns.shape[0] + counted)


def sign_flip_p(diffs: list[float], draws: int = 20_000) -> float:
    """Two-sided p-value of the mean paired difference under "same distribution on both sides" (each
    difference's sign is then a coin flip): exact over all sign patterns up to 16 seeds, else from
    ``draws`` seeded random patterns (counting the observed one). 1.0 for a single seed."""
    patterns, counted = _sign_patterns(len(diffs), draws)
    return _flip_p(patterns, counted, torch.tensor(diffs, dtype=torch.float64))


def sign_flip_ci(diffs: list[float], level: float = 0.95,
                 draws: int = 20_000) -> tuple[float | None, float | None]:
    """Confidence interval of the mean paired difference: the shifts ``delta`` that the sign-flip test
    of ``diffs - delta`` does not reject at ``1 - level`` (differences symmetric about ``delta``).

    Each bound is found by bisection, to 1e-6, between the mean (p = 1) and a shift beyond every
    difference on its side (all shifted differences of one sign: only the all-plus and all-minus
    patterns reach the sum, the smallest p there is). ``(None, None)``: too few seeds for any shift
    to be rejected at this level (``2 / 2**n > 1 - level``: 5 seeds or fewer at 95%).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    alpha = 1 - level
    d = torch.tensor(diffs, dtype=torch.float64)
    patterns, counted = _sign_patterns(len(diffs), draws)
    mean = float(d.mean())
    low, high = float(d.min()) - 1.0, float(d.max()) + 1.0
    if _flip_p(patterns, counted, d - low) > alpha:  # even a shift past every difference stands
        return None, None

    def bound(far: float) -> float:
        inside, outside = mean, far  # p(inside) > alpha >= p(outside)
        while abs(outside - inside) > 1e-6:
            mid = (inside + outside) / 2
            if _flip_p(patterns, counted, d - mid) > alpha:
                inside = mid
            else:
                outside = mid
        return inside

    return bound(low), bound(high)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", type=names_from(WORKLOADS), default="short,long", help="comma-separated: short, long")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps per side (the median skips step 1); default: short 100, long 6")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process on each side")
    p.add_argument("--seeds", default=None,
                   help="comma-separated RL seeds, each run on both sides from the same checkpoint "
                        "(default: the config's seed); accuracy is then averaged over seeds")
    p.add_argument("--override", action="append", default=[], help="extra miles config override (repeatable)")
    p.add_argument("--pool", nargs="+", metavar="LOG", default=None,
                   help="run nothing: summarize the per-seed lines that earlier runs printed into these files")
    args = p.parse_args(argv)
    if args.pool is not None:
        try:
            result = pool([Path(f).read_text(errors="replace") for f in args.pool])
        except (OSError, ValueError) as e:
            p.error(f"--pool: {e}")
        for name, w in result.items():
            _print_summary(name, w)
        print(json.dumps(result))
        return 0
    if args.steps is not None and args.steps < 2:
        p.error("--steps must be >= 2 (the median skips step 1)")
    seeds = None
    if args.seeds is not None:
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
        if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
            p.error(f"--seeds must list distinct non-negative integers, got {args.seeds!r}")
    try:
        import trl  # noqa: F401
    except ImportError:
        print("miles.bench e2e needs TRL: pip install 'miles-rl[bench]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-e2e-") as tmp:
        for name in args.workloads:
            steps = args.steps or DEFAULT_STEPS[name]
            result[name] = bench_workload(name, steps, args.threads, args.override, Path(tmp), seeds)
            _print_summary(name, result[name])
    print(json.dumps(result))
    return 0


def _print_summary(name: str, w: dict[str, Any]) -> None:
    print(f"{name}: miles {w['step_time_s_miles']:.3f} s/step, TRL {w['step_time_s_trl']:.3f} s/step, "
          f"TRL/miles {w['ratio_step_time_trl_over_miles']:.2f}x; eval accuracy miles "
          f"{w['eval_accuracy_miles']:.3f} +- {w['eval_accuracy_se_miles']:.3f}, TRL "
          f"{w['eval_accuracy_trl']:.3f} +- {w['eval_accuracy_se_trl']:.3f}, miles - TRL "
          f"{w['eval_accuracy_diff_miles_minus_trl']:+.3f} +- {w['eval_accuracy_diff_se']:.3f}, "
          f"95% interval {w['eval_accuracy_diff_ci95']} (seeds {w['seeds']})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
