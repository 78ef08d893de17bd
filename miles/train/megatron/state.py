"""Trainer state of the megatron trainer in the layout of :mod:`miles.train.optim`, with HF names.

``model.safetensors`` (full fp32 HF state dict), ``optimizer.safetensors`` (``state.<HF parameter>.
{step, exp_avg, exp_avg_sq}``) and ``trainer_state.json`` (param groups with HF names, the
``LambdaLR`` counters) are the files :class:`miles.train.fsdp.FSDPTrainer` writes: AdamW's moments are
per-element like the weights, so the same mapping gathers them (:meth:`~.collect.ShardedIO.gather`)
and cuts them back (:meth:`~.collect.ShardedIO.shard`). A state saved at one layout (or by the FSDP
trainer) loads at any other. Rank 0 writes (atomic rename) and reads; the others receive broadcasts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miles.train.megatron.policy import MegatronPolicy
from miles.train.optim import read_train_meta, read_train_tensors, refuse_nonfinite, write_train_state

MOMENTS = ("exp_avg", "exp_avg_sq")


def _groups(trainer: MegatronPolicy) -> list[dict[str, Any]]:
    """The optimizer's param groups as :func:`~miles.train.optim.flatten_optimizer_state` writes them."""
    groups = []
    for g in trainer.optimizer.state_dict()["param_groups"]:
        groups.append({**{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"},
                       "params": list(trainer.hf_param_names)})
    return groups


def save_state(trainer: MegatronPolicy, directory: str) -> None:
    """Collective. Gather weights and AdamW moments in HF names; rank 0 writes them (none if a weight is not
    finite: :func:`~miles.train.optim.refuse_nonfinite`)."""
    io, opt = trainer.engine.io, trainer.optimizer
    model_sd = io.gather({k: p.detach() for k, p in trainer.params.items()})
    refuse_nonfinite(model_sd, directory, rank=trainer.rank, world_size=trainer.world_size, device=trainer.device)
    stepped = len(opt.state) > 0  # every parameter steps together (p.grad is set for all)
    moments = {key: io.gather({k: opt.state[p][key] for k, p in trainer.params.items()}) for key in MOMENTS
               } if stepped else {}
    if trainer.rank == 0:
        assert model_sd is not None
        tensors: dict[str, torch.Tensor] = {}
        if stepped:
            step = next(iter(opt.state.values()))["step"]
            for name in trainer.hf_param_names:
                tensors[f"state.{name}.step"] = step.detach().cpu().clone()
                for key in MOMENTS:
                    tensors[f"state.{name}.{key}"] = moments[key][name]  # type: ignore[index]
        write_train_state(directory, model_state=model_sd, optimizer_tensors=tensors, param_groups=_groups(trainer),
                          scheduler_state=trainer.scheduler.state_dict(), world_size=trainer.world_size)
    if trainer.world_size > 1:
        dist.barrier()


def load_state(trainer: MegatronPolicy, directory: str) -> None:
    """Collective. Restore weights, AdamW state, hyperparameters and schedule from ``directory``."""
    io, opt = trainer.engine.io, trainer.optimizer
    meta = read_train_meta(directory)
    model_sd: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    if trainer.rank == 0:
        model_sd, tensors = read_train_tensors(directory)
    names = list(io.hf_shapes)
    local = io.shard(io.broadcast(model_sd, names))
    with torch.no_grad():
        for k, p in trainer.params.items():
            p.copy_(local[k])

    params = trainer.hf_param_names
    stepped = torch.tensor([int(any(k.startswith("state.") for k in tensors))], device=trainer.device)
    if trainer.world_size > 1:
        dist.broadcast(stepped, src=0)
    opt.state.clear()
    if bool(stepped):
        step = torch.zeros((), device=trainer.device)
        if trainer.rank == 0:
            step = tensors[f"state.{params[0]}.step"].to(trainer.device, torch.float32).reshape(())
        if trainer.world_size > 1:
            dist.broadcast(step, src=0)
        step = step.cpu()
        shards = {}
        for key in MOMENTS:
            full = io.broadcast({n: tensors[f"state.{n}.{key}"] for n in params} if trainer.rank == 0 else None,
                                params)
            shards[key] = io.shard(full)
        for k, p in trainer.params.items():
            opt.state[p] = {"step": step.clone(), **{key: shards[key][k].to(p.device) for key in MOMENTS}}
    saved = meta["param_groups"]
    for group, old in zip(opt.param_groups, saved, strict=True):
        group.update({k: tuple(v) if k == "betas" else v for k, v in old.items() if k != "params" and k in group})
    trainer.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(opt.param_groups)})
    if trainer.world_size > 1:
        dist.barrier()
