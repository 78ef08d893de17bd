"""Learning-rate schedule and resumable trainer state (safetensors + JSON, never pickle).

Schedule, as a multiplier of ``trainer.lr`` at optimizer step ``s`` (0-based), ``W`` warmup steps,
``S`` total optimizer steps (``trainer.num_steps * algo.num_minibatches``), ``r = min_lr_ratio``::

    s < W:      (s + 1) / W                              linear warmup
    constant:   1
    linear:     r + (1 - r) * (1 - p)                    p = (s - W) / (S - W), clamped to [0, 1]
    cosine:     r + (1 - r) * (1 + cos(pi * p)) / 2

so a decaying schedule reaches ``r * lr`` at step ``S`` and stays there.

Trainer state on disk (:func:`save_train_state`; written into ``<directory>.tmp``, renamed into place at
the end; the policy trainer and the PPO critic write the same layouts). One rank (format 1, rank 0 writes;
also the megatron trainer's at one rank)::

    model.safetensors      full fp32 model state dict, HF parameter names
    optimizer.safetensors  ``state.<param name>.<key>`` for every per-parameter tensor (AdamW: step,
                           exp_avg, exp_avg_sq)
    trainer_state.json     optimizer hyperparameters per param group and the scheduler's counters

More than one rank (format 2): ``trainer_state.json`` as above, and instead of the two safetensors files
``shards/``, where every rank writes its own part of the same tensors with ``torch.distributed.checkpoint``
(:mod:`miles.train.shards`). Both formats load at any world size (:func:`load_train_state`), and
:func:`read_train_tensors` reads either as full tensors. The megatron trainer writes and reads both formats
with the same names, so either trainer resumes the other's state.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.config.rank import RankConfig

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """The learning-rate multiplier at 0-based optimizer step ``step`` (formulas in the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"trainer.lr_schedule: unknown schedule {schedule!r}; valid options: {', '.join(SCHEDULES)}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"trainer.min_lr_ratio: must be in [0, 1], found {min_lr_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay



def lr_scheduler(optimizer: torch.optim.Optimizer, config: RankConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The policy trainers' schedule: :func:`lr_multiplier` over ``trainer.num_steps`` x
    ``algo.num_minibatches`` optimizer steps, with ``trainer.lr_warmup_steps``, ``lr_schedule`` and
    ``min_lr_ratio``."""
    t = config.trainer
    total = t.num_steps * config.algo.num_minibatches
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        s, warmup_steps=t.lr_warmup_steps, total_steps=total, schedule=t.lr_schedule,
        min_lr_ratio=t.min_lr_ratio))

def flatten_optimizer_state(osd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Split a full optimizer state dict (parameter names as keys) into tensors and JSON-able groups.

    ``osd``: ``{"state": {name: {key: tensor or number}}, "param_groups": [{..., "params": [names]}]}``
    as returned by ``get_optimizer_state_dict``. Returns ``({"state.<name>.<key>": tensor}, groups)``;
    numbers in the per-parameter state become 0-d fp64 tensors so that everything lives in safetensors.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
            tensors[f"state.{name}.{key}"] = t.detach().cpu().contiguous()
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, groups


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Inverse of :func:`flatten_optimizer_state` (tuples restored for ``betas``)."""
    names = {n for g in groups for n in g["params"]}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for flat, t in tensors.items():
        name, key = flat.removeprefix("state.").rsplit(".", 1)
        if name not in names:
            raise ValueError(f"optimizer state names parameter {name!r}, which no param group holds")
        state.setdefault(name, {})[key] = t
    param_groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": param_groups}


STATE_FORMAT = 1
SHARDED_FORMAT = 2


def refuse_nonfinite(model_state: dict[str, torch.Tensor] | None, directory: str | Path, *, rank: int,
                     world_size: int, device: torch.device | str) -> None:
    """Collective. ValueError on every rank when a tensor of ``model_state`` (the full state dict, on rank 0;
    the other ranks pass None) is not finite: a checkpoint is never written with NaN or inf parameters."""
    bad = [k for k, v in (model_state or {}).items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    count = torch.tensor([len(bad)], dtype=torch.int64, device=device)
    if world_size > 1:
        dist.broadcast(count, src=0)
    if int(count):
        names = [bad[:5]]
        if world_size > 1:  # every rank's error names them
            dist.broadcast_object_list(names, src=0, device=torch.device(device))
        shown = ", ".join(names[0]) + (f" and {int(count) - 5} more" if int(count) > 5 else "")
        raise ValueError(f"save_state: refusing to write {directory}: {int(count)} parameter tensor(s) hold NaN or "
                         f"inf ({shown}); the previous checkpoints stay as they were. The weights diverged: resume "
                         "from an earlier checkpoint with a lower trainer.lr or trainer.max_grad_norm")


def save_train_state(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, rank: int, world_size: int,
                     sharded: bool | None = None) -> None:
    """Collective over the ranks of ``model``. Write model, optimizer and scheduler state to ``directory``.

    ``sharded`` (default: ``world_size > 1``): every rank writes its own part (format 2, :mod:`miles.train.shards`);
    else full state dicts gathered to CPU, written by rank 0 (format 1). Either way into ``<directory>.tmp``,
    renamed into place, so a crash leaves either the previous state or the new one. Nothing is written when a
    parameter is not finite (:func:`refuse_nonfinite`, on every rank).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if world_size > 1 if sharded is None else sharded:
        _save_sharded(directory, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank,
                      world_size=world_size)
        return
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    refuse_nonfinite(model_sd if rank == 0 else None, directory, rank=rank, world_size=world_size,
                     device=next(model.parameters()).device)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    if rank == 0:
        tensors, groups = flatten_optimizer_state(optim_sd)
        write_train_state(directory, model_state=model_sd, optimizer_tensors=tensors, param_groups=groups,
                          scheduler_state=scheduler.state_dict(), world_size=world_size)
    if world_size > 1:
        dist.barrier()


def _save_sharded(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, rank: int, world_size: int) -> None:
    """Format 2: the ranks' sharded state dicts through DCP into ``<directory>.tmp/shards``; rank 0 adds the
    manifest and ``trainer_state.json`` and renames the directory into place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from miles.train import shards

    model_sd = get_model_state_dict(model)
    shards.refuse_nonfinite(model_sd, directory, world_size=world_size)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in optim_sd["param_groups"]]
    write_sharded_state(directory, shards.flat_tensors(model_sd, optim_sd), param_groups=groups,
                        scheduler_state=scheduler.state_dict(), rank=rank, world_size=world_size)


def write_sharded_state(directory: str | Path, tensors: dict[str, Any], *, param_groups: list[dict[str, Any]],
                        scheduler_state: dict[str, Any], rank: int, world_size: int) -> None:
    """Collective. Format 2 from this rank's part of the state: ``tensors`` (keys as
    :func:`miles.train.shards.flat_tensors`; sharded, or plain tensors DCP writes once) through DCP into
    ``<directory>.tmp/shards``; rank 0 adds the manifest and ``trainer_state.json`` and renames the directory
    into place. The FSDP trainer and the megatron trainer (:mod:`miles.train.megatron.state`) write so."""
    from miles.train import shards

    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world_size > 1:
        dist.barrier()
    shards.write(tmp, tensors, rank=rank, world_size=world_size)
    if rank == 0:
        _write_meta(tmp, SHARDED_FORMAT, world_size, param_groups, scheduler_state)
        _publish(tmp, final)
    if world_size > 1:
        dist.barrier()


def write_train_state(directory: str | Path, *, model_state: dict[str, torch.Tensor],
                      optimizer_tensors: dict[str, torch.Tensor], param_groups: list[dict[str, Any]],
                      scheduler_state: dict[str, Any], world_size: int) -> None:
    """Write the files of the layout in the module docstring into ``<directory>.tmp``, then rename it into place.

    ``model_state``: full HF-named state dict; ``optimizer_tensors`` / ``param_groups``: as returned by
    :func:`flatten_optimizer_state`; ``scheduler_state``: the ``LambdaLR`` state dict.
    """
    from safetensors.torch import save_file

    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seen: set[int] = set()  # tied weights share storage, which safetensors refuses: save a copy
    model_state = {k: v.clone() if v.data_ptr() in seen or seen.add(v.data_ptr()) else v.contiguous()
                   for k, v in model_state.items()}
    save_file(model_state, str(tmp / "model.safetensors"))
    save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"))
    _write_meta(tmp, STATE_FORMAT, world_size, param_groups, scheduler_state)
    _publish(tmp, final)


def _write_meta(directory: Path, fmt: int, world_size: int, param_groups: list[dict[str, Any]],
                scheduler_state: dict[str, Any]) -> None:
    sched = {k: v for k, v in scheduler_state.items() if k != "lr_lambdas"}
    (directory / "trainer_state.json").write_text(json.dumps(
        {"format": fmt, "world_size": world_size, "param_groups": param_groups, "scheduler": sched}, indent=1))


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final`` (an existing ``final`` is moved aside first, then deleted)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def read_train_meta(directory: str | Path) -> dict[str, Any]:
    """``trainer_state.json`` of a directory :func:`write_train_state` wrote (its format checked)."""
    path = Path(directory)
    meta = json.loads((path / "trainer_state.json").read_text())
    if meta.get("format") not in (STATE_FORMAT, SHARDED_FORMAT):
        raise ValueError(f"load_state: {path} has trainer state format {meta.get('format')!r}; "
                         f"expected {STATE_FORMAT} or {SHARDED_FORMAT}")
    return meta


def read_train_tensors(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(model state, optimizer tensors)`` of a directory :func:`save_train_state` wrote, as full tensors in
    this process (format 2: every rank's part read and verified first, :func:`miles.train.shards.read_full`)."""
    from safetensors.torch import load_file

    path = Path(directory)
    if read_train_meta(path)["format"] == SHARDED_FORMAT:
        from miles.train import shards

        return shards.read_full(path)
    return load_file(str(path / "model.safetensors")), load_file(str(path / "optimizer.safetensors"))


def load_train_state(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, rank: int, world_size: int) -> None:
    """Collective. Restore what :func:`save_train_state` wrote, at any world size: format 1, rank 0 reads and
    broadcasts; format 2, every rank reads the parts of the shards it holds (after rank 0 checked them)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = read_train_meta(directory)
    if meta["format"] == SHARDED_FORMAT:
        _load_sharded(directory, meta, model=model, optimizer=optimizer, rank=rank, world_size=world_size)
    else:
        model_sd: dict[str, torch.Tensor] = {}
        optim_sd: dict[str, Any] = {}
        if rank == 0:
            model_sd, tensors = read_train_tensors(directory)
            optim_sd = unflatten_optimizer_state(tensors, meta["param_groups"])
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=world_size > 1)
        set_model_state_dict(model, model_sd, options=opts)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
    scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
    if world_size > 1:
        dist.barrier()


def _load_sharded(directory: str | Path, meta: dict[str, Any], *, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> None:
    """Format 2: DCP fills this rank's sharded state dicts in place (resharding), then they are set."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from miles.train import shards

    shards.verify_collective(directory, rank=rank, world_size=world_size, device=next(model.parameters()).device)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)  # initializes the optimizer state to fill
    flat = shards.flat_tensors(model_sd, optim_sd)
    shards.read_into(directory, flat, world_size=world_size)
    model_sd = {k: flat[shards.MODEL + k] for k in model_sd}
    state = {name: {key: flat[f"{shards.OPTIMIZER}state.{name}.{key}"] if isinstance(value, torch.Tensor)
                    else type(value)(flat[f"{shards.OPTIMIZER}state.{name}.{key}"].item())
                    for key, value in entry.items()} for name, entry in optim_sd["state"].items()}
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})
