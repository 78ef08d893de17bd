"""Multi-LoRA tenants: several adapters trained at once on one base model, each on its own task.

A run with ``tenants:`` (and ``adapter=lora``) holds one LoRA adapter per tenant, named after it, in
every trainer rank and every engine (:mod:`miles.adapters.lora`). Each tenant has its own task
source, reward (any ``_target_``, in its own reward workers), prompt template and sampling
(:func:`tenant_run`). One step:

1. **Rollout**, tenant after tenant: ``algo.num_prompts_per_step`` prompts from the tenant's task,
   generated through its adapter (every request names it; the engines serve all adapters, unmerged,
   from one copy of the base), scored by its reward.
2. **Train**: one batch of every tenant's groups; the trainer takes each tenant's samples through that
   tenant's adapter with its own normalization and clipping (round robin within the step), then one
   optimizer step moves every adapter that has gradients
   (:meth:`miles.train.fsdp.FSDPTrainer.train_step`). Samples of one tenant never reach another's
   adapter; a tenant whose every sample failed (e.g. its reward raised) sits the step out while the
   others train.
3. **Sync**: the adapters' tensors only, as one version. The tenants' rollouts share one engine pool:
   an engine that dies or hangs leaves the rotation for all of them, and the push replaces it (its
   replacement gets the base and every adapter before it serves a tenant; :mod:`miles.core.recovery`).
   When every engine dies in a tenant's rollout, they are replaced and that rollout runs again.
4. **Log**: each tenant's rollout, train and eval metrics under ``tenant/<name>/...`` (its request latency
   and time to first token quantiles among them), and its reward (scored samples) and response-length
   distributions as ``tenant/<name>/train/reward`` and ``tenant/<name>/rollout/response_len``; evaluation
   on each tenant's held-out prompts with its own adapter.

5. **Checkpoint** (``trainer.save_every``): the trainer state (every adapter and its optimizer state), the
   ledger, and each tenant's prompt sampler (:class:`miles.config.checkpoints.LoopState` ``tenants``).
   ``trainer.resume_from`` continues from one, and a trainer rank that dies is restored from the last
   one (:func:`miles.core.step.recover_trainers`), as in a run without tenants.

Group ids (and so the ledger and the sampling seeds) are one sequence over all tenants.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.config.schema import MilesConfig, TenantConfig

log = logging.getLogger(__name__)


def tenant_run(run: MilesConfig, tenant: TenantConfig) -> MilesConfig:
    """The run as ``tenant`` sees it: its task, and ``rollout.*`` sampling with its overrides."""
    sampling = {k: getattr(tenant, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens")
                if getattr(tenant, k) is not None}
    return dataclasses.replace(run, task=tenant.task, rollout=dataclasses.replace(run.rollout, **sampling))


@dataclass
class Tenant:
    """One tenant's parts for the loop."""

    name: str
    run: MilesConfig
    """:func:`tenant_run`."""
    task: Any
    rollout: Any
    """Its :class:`miles.rollout.manager.RolloutManager` (its adapter, template and reward)."""
    eval_set: list[Any] = dataclasses.field(default_factory=list)


class MixedTask:
    """The tenants' tasks as one, for what the base model is built from (the tiny model's tokenizer
    corpus and warm start): every task's corpus, and warm-start examples drawn from each task in turn,
    each prompt in its tenant's template."""

    def __init__(self, tasks: Sequence[Any], templates: Sequence[str]) -> None:
        self.tasks, self.templates = list(tasks), list(templates)
        self.chat_template = all(getattr(t, "chat_template", True) for t in self.tasks)

    def corpus(self) -> list[str]:
        out: list[str] = []
        for task, template in zip(self.tasks, self.templates, strict=True):
            out += task.corpus() + ([template.replace("{prompt}", "")] if template != "{prompt}" else [])
        return out

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        k = len(self.tasks)
        out: list[tuple[str, str]] = []
        for i, (task, template) in enumerate(zip(self.tasks, self.templates, strict=True)):
            share = n // k + (1 if i < n % k else 0)
            out += [(template.replace("{prompt}", p), r) for p, r in task.sft_examples(share, rng)] if share else []
        rng.shuffle(out)
        return out

    def sample(self, n: int, rng: random.Random) -> list[Any]:
        return self.tasks[0].sample(n, rng)

    def eval_problems(self, n: int) -> list[Any]:
        return self.tasks[0].eval_problems(n)


def _restore_samplers(rng: dict[str, random.Random], state: Any) -> None:
    """Each tenant's prompt sampler as the checkpoint ``state`` holds it."""
    if state.tenants is None or set(state.tenants) != set(rng):
        raise ValueError(f"{state.path}: its tenants' prompt samplers are {sorted(state.tenants or ())}, this run's "
                         f"tenants {sorted(rng)}: resume a run with tenants from a checkpoint of the same tenants")
    for name, r in rng.items():
        r.setstate(state.tenants[name])


def train_tenants(ctx: Any, tenants: Sequence[Tenant]) -> dict[str, float]:
    """``trainer.num_steps`` steps over every tenant (module docstring); returns the last step's metrics."""
    from miles.core.evaluate import evaluate
    from miles.core.step import (
        begin_profile,
        collect_through_outage,
        end_profile,
        learn,
        log_batch_sizes,
        push_weights,
        resume_point,
        run_steps,
        sampling_params,
        save_checkpoint,
    )

    run, algo, hooks = ctx.run, ctx.run.algo, ctx.hooks
    rng = {t.name: random.Random(f"{run.seed}:{t.name}") for t in tenants}
    for t in tenants:
        t.eval_set = t.task.eval_problems(t.run.task.num_eval_prompts)
    log_batch_sizes(run)
    log.info("tenants: %s, each with %d prompts x %d samples per step", ", ".join(t.name for t in tenants),
             algo.num_prompts_per_step, algo.num_samples_per_prompt)

    def evaluate_all(step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in tenants:
            m = evaluate(dataclasses.replace(ctx, run=t.run, task=t.task, rollout=t.rollout), t.eval_set)
            out |= {f"tenant/{t.name}/{k}": v for k, v in m.items()}
            log.info("step %d: tenant %s eval/accuracy %.3f (greedy %.3f)", step, t.name, m["eval/accuracy"],
                     m["eval/greedy_accuracy"])
        # the mean over tenants, for the progress line and hooks that watch eval/accuracy
        for k in ("eval/accuracy", "eval/greedy_accuracy"):
            out[k] = sum(out[f"tenant/{t.name}/{k}"] for t in tenants) / len(tenants)
        return out

    first, next_group_id = resume_point(ctx, lambda state: _restore_samplers(rng, state))
    hooks.on_run_start(first - 1)
    metrics: dict[str, float] = {}
    if run.trainer.resume_from is None:
        metrics = evaluate_all(0)
        hooks.after_eval(0, metrics)
        ctx.log_metrics(metrics | hooks.pop_metrics(), 0)

    def one_step(step: int, next_group_id: int) -> tuple[dict[str, float], int]:
        begin_profile(ctx, step)
        t0 = time.perf_counter()
        groups: list[list[Any]] = []
        metrics: dict[str, float] = {}
        spread: dict[str, list[float]] = {}  # per-sample values of each tenant, logged as distributions
        for t in tenants:  # 1-2. each tenant's rollout through its adapter, scored by its reward
            def collect(t: Tenant = t, first: int = next_group_id,
                        state: tuple = rng[t.name].getstate()) -> tuple[list[list[Any]], dict[str, float]]:
                rng[t.name].setstate(state)  # a rollout repeated after an outage draws the same prompts
                return t.rollout.collect(
                    lambda count: t.task.sample(count, rng[t.name]), algo.num_prompts_per_step, algo.num_samples_per_prompt,
                    sampling_params(t.run), seed=run.seed * 1_000_003 + first, first_group_id=first)

            got, m = collect_through_outage(ctx, step, collect, f" in tenant {t.name}'s rollout")
            ctx.ledger.draw(range(next_group_id, next_group_id + int(m["rollout/groups"])))
            for group_id, outcome in t.rollout.left_out.items():
                ctx.ledger.settle(group_id, outcome)
            next_group_id += int(m["rollout/groups"])
            groups += got
            metrics |= {f"tenant/{t.name}/{k}": v for k, v in m.items()}
            samples = [s for g in got for s in g]
            scored = [s.reward for s in samples if s.failure is None]
            spread[f"tenant/{t.name}/train/reward"] = scored
            spread[f"tenant/{t.name}/rollout/response_len"] = [float(len(s.response_ids)) for s in samples]
            if scored:
                metrics[f"tenant/{t.name}/train/reward_mean"] = sum(scored) / len(scored)
            if not scored:
                log.warning("step %d: every sample of tenant %s failed (%s); it sits this update out", step,
                            t.name, samples[0].failure if samples else "no samples")
        hooks.after_rollout(step, groups)
        t1 = time.perf_counter()
        metrics["rollout/groups"] = float(len(groups))
        metrics, _ = learn(ctx, step, groups, metrics)  # 3-4. one batch; the trainer splits it per adapter
        ctx.ledger.settle_batch(groups)
        t2 = time.perf_counter()
        metrics |= push_weights(ctx, step)  # the adapters; engines out of rotation replaced (miles.core.recovery)
        hooks.after_weight_sync(step, step)
        t3 = time.perf_counter()
        end_profile(ctx, step)
        last = step == run.trainer.num_steps or hooks.stop_reason is not None
        if last or (run.trainer.eval_every and step % run.trainer.eval_every == 0):
            evaluated = evaluate_all(step)
            hooks.after_eval(step, evaluated)
            metrics |= evaluated
        metrics |= {"perf/step_time_s": t3 - t0, "perf/rollout_s": t1 - t0, "perf/train_s": t2 - t1,
                    "perf/sync_s": t3 - t2} | hooks.pop_metrics()
        if ctx.trainer_recovery is not None:
            metrics |= ctx.trainer_recovery.metrics()
        ctx.log_metrics(metrics, step)
        if ctx.log_distributions is not None:
            ctx.log_distributions(spread, step)
        every = run.trainer.save_every
        if every and (step % every == 0 or last):  # 5. the run checkpoint, with every tenant's prompt sampler
            save_checkpoint(ctx, step, rng[tenants[0].name].getstate(), next_group_id, ctx.ledger.state(),
                            tenants={name: r.getstate() for name, r in rng.items()})
        return metrics, next_group_id

    return run_steps(ctx, first, next_group_id, one_step, lambda state: _restore_samplers(rng, state), metrics)
