"""``train_step`` and ``compute_gradients`` of the megatron trainer with LoRA adapters (one, or one per tenant).

What :meth:`miles.train.fsdp.FSDPTrainer.train_step` does with adapters, on megatron's passes
(:meth:`~.policy.MegatronPolicy._prepare` / ``_backward``, :class:`~.lora.MegatronLora`):

* the batch is split per adapter (``batch.adapters``, multi-LoRA tenants) or is the first adapter's
  alone; every proximal and reference log-prob is computed before the first update, each through its
  own adapter (the reference model is the base: a copy without adapters);
* per mini-batch, adapter after adapter: its samples' forward and backward with its own loss
  normalization (its own global token counts), DDP's reduction of its gradients, its own global grad
  norm and clipping and its own non-finite check; its gradients move out of DDP's buffer (which is
  zeroed for the next adapter) into ``p.grad``. Then one AdamW step moves every adapter with gradients;
  an adapter without samples, or whose loss or norm was not finite, has ``p.grad = None`` and AdamW
  leaves it (and its moments) as they were. Metrics per adapter: ``tenant/<name>/train/...``; on MoE models
  ``moe/route_agreement`` and ``moe/replayed_route_share`` over the whole step (:mod:`.replay`).
"""

from __future__ import annotations

import math
import time

import torch

from miles.tracking.memory import actor_metrics, process_memory
from miles.train.megatron.policy import MegatronPolicy
from miles.train.megatron.replay import route_metrics
from miles.types import TrainBatch


def split_by_adapter(trainer: MegatronPolicy, batch: TrainBatch) -> list[tuple[str | None, TrainBatch]]:
    """``[(None, batch)]`` unless the samples name adapters, then ``[(name, its samples)]`` in adapter order."""
    assert trainer.lora is not None
    names = trainer.lora.names
    if batch.adapters is None:
        return [(None, batch)]
    unknown = sorted(set(batch.adapters) - set(names))
    if unknown:
        raise ValueError(f"train_step: samples name adapters {unknown} this trainer does not hold ({list(names)})")
    return [(n, batch.select([i for i, a in enumerate(batch.adapters) if a == n])) for n in names
            if n in batch.adapters]


def train_step(trainer: MegatronPolicy, batch: TrainBatch) -> dict[str, float]:
    """One RL update of the adapters on ``batch`` (module docstring). Collective; the same metrics on every rank."""
    lora, engine, opt = trainer.lora, trainer.engine, trainer.optimizer
    assert lora is not None
    start = time.perf_counter()
    num_mb = trainer.config.algo.num_minibatches
    engine.route_counts(trainer.model)  # count this step's passes only
    tenants = split_by_adapter(trainer, batch)
    prepared = []
    for name, sub in tenants:
        with lora.use(name):
            prepared.append(trainer._prepare(sub, num_mb))
    lr_used = opt.param_groups[0]["lr"]
    sums: list[dict[str, torch.Tensor]] = [{} for _ in tenants]
    skipped, ran = [0] * len(tenants), [0] * len(tenants)
    grad_norms: list[list[torch.Tensor]] = [[] for _ in tenants]
    max_norm = trainer.config.trainer.max_grad_norm if trainer.config.trainer.max_grad_norm > 0 else math.inf
    for m in range(num_mb):
        stepped = False
        opt.zero_grad(set_to_none=True)
        for t, (name, _) in enumerate(tenants):
            plans, counts, old, ref = prepared[t]
            if name is not None and float(counts[m, 0]) == 0:  # no loss token (e.g. its reward failed): sits out
                skipped[t] += 1
                continue
            engine.zero_grad(trainer.model)
            with lora.use(name):
                loss_sum = trainer._backward(plans[m], counts[m], old[m], ref[m], sums[t], 1.0 / num_mb)
            ran[t] += 1
            params = lora.of(name)
            norm = lora.grad_norm(name, engine.world_sum)
            lora.clip(params, norm, max_norm)
            global_loss = engine.last_stage_sum(loss_sum.reshape(1))
            if torch.isfinite(global_loss).all() and torch.isfinite(norm):
                for p in params:
                    p.grad = p.main_grad.detach().clone()
                stepped = True
            else:
                skipped[t] += 1
            grad_norms[t].append(norm.detach().float())
        if stepped:
            opt.step()
            trainer.scheduler.step()
        opt.zero_grad(set_to_none=True)
    engine.zero_grad(trainer.model)

    out: dict[str, float] = {}
    for t, (name, _) in enumerate(tenants):
        plans, counts = prepared[t][0], prepared[t][1]
        mine: dict[str, float] = {}
        if ran[t]:  # every rank knows: the counts are global
            values = torch.stack([sums[t].get(k, torch.zeros(())) for k in trainer.metric_names])
            mine = {k: float(v) for k, v in zip(trainer.metric_names, engine.last_stage_sum(values).tolist(),
                                                strict=True)}
        mine["train/grad_norm"] = float(torch.stack(grad_norms[t]).mean()) if grad_norms[t] else 0.0
        mine["train/nonfinite_skipped"] = float(skipped[t])
        mine["train/num_tokens"] = float(counts[:, 0].sum())
        mine["train/skipped_samples"] = float(counts[:, 3].sum())
        mine["train/num_microbatches"] = float(sum(len(micro) for micro in plans))
        out |= mine if name is None else {f"tenant/{name}/{k}": v for k, v in mine.items()}
    if tenants[0][0] is not None:  # totals over the adapters
        out["train/num_tokens"] = sum(out[f"tenant/{n}/train/num_tokens"] for n, _ in tenants)
        out["train/num_microbatches"] = sum(out[f"tenant/{n}/train/num_microbatches"] for n, _ in tenants)
        out["train/skipped_samples"] = sum(out[f"tenant/{n}/train/skipped_samples"] for n, _ in tenants)
    out["train/lr"] = lr_used
    out["train/trainable_param_frac"] = trainer.trainable_frac
    routes = engine.route_counts(trainer.model)
    if routes is not None:  # MoE: over every adapter's passes, as the FSDP trainer's (:mod:`.replay`)
        out |= route_metrics(routes)
    forward = float(sum(p.input_ids.numel() for prep in prepared for micro in prep[0] for p in micro))
    out["perf/train_forward_tokens"] = float(engine.dp_sum(torch.tensor([forward])))
    elapsed = engine.world_max(torch.tensor([time.perf_counter() - start]))
    out["perf/train_tokens_per_s"] = out["train/num_tokens"] / max(float(elapsed), 1e-9)
    return out | actor_metrics(f"trainer{trainer.rank}", process_memory())  # this rank's own: not reduced


def compute_gradients(trainer: MegatronPolicy, batch: TrainBatch) -> dict[str, torch.Tensor] | None:
    """Rank 0: ``{peft parameter name (...lora_A.<adapter>.weight): full gradient}`` of every adapter
    (zeros for an adapter without samples) on ``batch`` as one mini-batch; no clipping, no step. Collective."""
    lora, engine = trainer.lora, trainer.engine
    assert lora is not None
    grads = {name: torch.zeros_like(p) for name, p in lora.params.items()}
    for name, sub in split_by_adapter(trainer, batch):
        with lora.use(name):
            plans, counts, old, ref = trainer._prepare(sub, 1)
            engine.zero_grad(trainer.model)
            trainer._backward(plans[0], counts[0], old[0], ref[0], {}, 1.0)
        adapter = name if name is not None else lora.names[0]
        grads |= {e.local: lora.params[e.local].main_grad.detach().clone() for e in lora.io.entries
                  if e.adapter == adapter}
    engine.zero_grad(trainer.model)
    full = lora.io.gather(grads)
    if full is None:
        return None
    keyed = {(e.adapter, e.peft_key): e.param_name for stage in lora.io.stages for e in stage}
    return {keyed[(a, k)]: v for a, state in full.items() for k, v in state.items()}
