"""Trainer state of the megatron trainer in the layouts of :mod:`miles.train.optim`, with HF names.

More than one rank: format 2, every rank writes its own regions of the HF tensors with
``torch.distributed.checkpoint`` and reads back the regions of the layout it runs (:mod:`.sharded_state`);
nothing is gathered. One rank: format 1, as follows.

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

from miles.train.megatron import sharded_state
from miles.train.megatron.policy import MegatronPolicy
from miles.train.optim import (
    SHARDED_FORMAT,
    read_train_meta,
    read_train_tensors,
    refuse_nonfinite,
    write_sharded_state,
    write_train_state,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


def _groups(trainer: MegatronPolicy) -> list[dict[str, Any]]:
    """The optimizer's param groups as :func:`~miles.train.optim.flatten_optimizer_state` writes them."""
    groups = []
    for g in trainer.optimizer.state_dict()["param_groups"]:
        groups.append({**{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"},
                       "params": list(trainer.hf_param_names)})
    return groups


def save_state(trainer: MegatronPolicy, directory: str, *, sharded: bool | None = None) -> None:
    """Collective. ``sharded`` (default: more than one rank): every rank writes its regions (:func:`save_sharded`);
    else gather weights and AdamW moments in HF names and rank 0 writes them. None is written if a weight is not
    finite (:func:`~miles.train.optim.refuse_nonfinite`)."""
    if trainer.world_size > 1 if sharded is None else sharded:
        save_sharded(trainer, directory)
        return
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
    if meta["format"] == SHARDED_FORMAT:
        load_sharded(trainer, directory, meta)
        return
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
    _restore_schedule(trainer, meta)


def _restore_schedule(trainer: MegatronPolicy, meta: dict[str, Any]) -> None:
    opt = trainer.optimizer
    for group, old in zip(opt.param_groups, meta["param_groups"], strict=True):
        group.update({k: tuple(v) if k == "betas" else v for k, v in old.items() if k != "params" and k in group})
    trainer.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(opt.param_groups)})
    if trainer.world_size > 1:
        dist.barrier()


def _layouts(trainer: MegatronPolicy) -> list[sharded_state.Layout]:
    io = trainer.engine.io
    return [sharded_state.layout(e, io.piece_shapes, io.hf_shapes, io.arch, io.coords.tp, io.coords.tp_rank,
                                 trainer.device) for e in io.entries]


def _key_regions(layouts: list[sharded_state.Layout], values: dict[str, list[torch.Tensor]], prefix: str,
                 suffix: str = "") -> dict[str, list[tuple[sharded_state.Region, torch.Tensor]]]:
    out: dict[str, list[tuple[sharded_state.Region, torch.Tensor]]] = {}
    for lay in layouts:
        for r, t in zip(lay.regions, values[lay.entry.local], strict=True):
            out.setdefault(f"{prefix}{r.key}{suffix}", []).append((r, t))
    return out


def save_sharded(trainer: MegatronPolicy, directory: str) -> None:
    """Collective. Format 2 (:func:`_save_sharded`)."""
    with sharded_state.quiet():
        _save_sharded(trainer, directory)


def load_sharded(trainer: MegatronPolicy, directory: str, meta: dict[str, Any]) -> None:
    """Collective. Format 2 (:func:`_load_sharded`)."""
    with sharded_state.quiet():
        _load_sharded(trainer, directory, meta)


def _save_sharded(trainer: MegatronPolicy, directory: str) -> None:
    """Collective. Format 2: this rank's regions of the weights and AdamW moments (the last stage's copy of tied
    embeddings left out), and AdamW's step, through :func:`~miles.train.optim.write_sharded_state`."""
    from miles.train import shards

    opt = trainer.optimizer
    layouts = [lay for lay in _layouts(trainer) if not lay.entry.tied_copy]
    weights = {lay.entry.local: lay.scatter(trainer.params[lay.entry.local]) for lay in layouts}
    model = _key_regions(layouts, weights, shards.MODEL)
    tied = f"{shards.MODEL}lm_head.weight"
    embed = model.get(f"{shards.MODEL}model.embed_tokens.weight")
    if trainer.arch.tied_embeddings and "lm_head.weight" in trainer.hf_shapes and embed:  # the HF state dict has both
        model[tied] = embed
    shards.refuse_nonfinite({k.removeprefix(shards.MODEL): torch.cat([t.reshape(-1) for _, t in items])
                             for k, items in model.items() if k != tied}, directory, world_size=trainer.world_size)
    regions = dict(model)
    if len(opt.state) > 0:  # every parameter steps together (p.grad is set for all)
        for key in MOMENTS:
            moments = {lay.entry.local: lay.scatter(opt.state[trainer.params[lay.entry.local]][key])
                       for lay in layouts}
            regions |= _key_regions(layouts, moments, f"{shards.OPTIMIZER}state.", f".{key}")
    tensors = sharded_state.to_sharded(regions, rank=trainer.rank, world_size=trainer.world_size)
    if len(opt.state) > 0:
        step = next(iter(opt.state.values()))["step"].detach().cpu()
        tensors |= {f"{shards.OPTIMIZER}state.{n}.step": step.clone() for n in trainer.hf_param_names}
    write_sharded_state(directory, tensors, param_groups=_groups(trainer),
                        scheduler_state=trainer.scheduler.state_dict(), rank=trainer.rank,
                        world_size=trainer.world_size)


def _load_sharded(trainer: MegatronPolicy, directory: str, meta: dict[str, Any]) -> None:
    """Collective. Format 2 (the megatron trainer's at any layout, or the FSDP trainer's): after rank 0 checked
    every file against the manifest, each rank reads the regions of its own parameters and moments."""
    import torch.distributed.checkpoint as dcp

    from miles.train import shards

    shards.verify_collective(directory, rank=trainer.rank, world_size=trainer.world_size, device=trainer.device)
    path = f"{directory}/{shards.DIR}"
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # checked against the manifest above
    stepped = any(k.startswith(shards.OPTIMIZER) for k in stored)
    layouts = _layouts(trainer)
    kinds = {"": shards.MODEL, **({key: f"{shards.OPTIMIZER}state." for key in MOMENTS} if stepped else {})}
    targets: dict[str, dict[str, list[torch.Tensor]]] = {}
    regions: dict[str, list[tuple[sharded_state.Region, torch.Tensor]]] = {}
    for kind, prefix in kinds.items():
        empty = {lay.entry.local: [torch.zeros(r.sizes, device=trainer.device) for r in lay.regions]
                 for lay in layouts}
        targets[kind] = empty
        regions |= _key_regions(layouts, empty, prefix, f".{kind}" if kind else "")
    tensors = sharded_state.to_sharded(regions, rank=trainer.rank, world_size=trainer.world_size)
    first = trainer.hf_param_names[0]
    if stepped:
        tensors[f"{shards.OPTIMIZER}state.{first}.step"] = torch.zeros(())
    shards.read_into(directory, tensors, world_size=trainer.world_size)
    opt = trainer.optimizer
    opt.state.clear()
    for lay in layouts:
        p = trainer.params[lay.entry.local]
        lay.gather(targets[""][lay.entry.local], p)
        if stepped:
            moments = {key: torch.zeros_like(p) for key in MOMENTS}
            for key in MOMENTS:
                lay.gather(targets[key][lay.entry.local], moments[key])
            opt.state[p] = {"step": tensors[f"{shards.OPTIMIZER}state.{first}.step"].clone().float(), **moments}
    _restore_schedule(trainer, meta)
