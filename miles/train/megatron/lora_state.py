"""What leaves the megatron trainer with LoRA adapters: weight sync, PEFT export, merged weights, trainer state.

Everything is in the names the FSDP trainer's peft model uses, so either trainer loads the other's files
and the engines take the weight sync as they take the FSDP trainer's (``tests/test_megatron_lora.py``):

* :func:`send_weights`: the adapters' tensors only, ``adapter:<name>:<PEFT key>``
  (:func:`miles.adapters.lora.sync_state`'s names, shapes and order);
* :func:`export_adapters`: one PEFT directory per adapter (:func:`miles.adapters.lora.export_adapter`),
  which ``peft.PeftModel.from_pretrained`` loads onto the base checkpoint;
* :func:`full_state_dict`: the policy (the first adapter merged into the base, ``W + (alpha / r) B A``)
  in HF names;
* :func:`save_state` / :func:`load_state`: the layout of :mod:`miles.train.optim` as the FSDP trainer
  writes it for its peft model: ``model.safetensors`` with peft's parameter names (base weights under
  ``base_model.model.``, adapted modules' as ``<module>.base_layer.weight``, adapters as
  ``...lora_A.<adapter>.weight``), AdamW moments per adapter parameter (only for adapters that stepped),
  one param group per adapter, the scheduler; plus the adapters in PEFT format under ``adapters/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from miles.adapters import lora as peft_lora
from miles.train.megatron.lora import Adapters, sync_names
from miles.train.megatron.lora_layout import LoraEntry, peft_base_name
from miles.train.megatron.policy import MegatronPolicy
from miles.train.optim import read_train_meta, read_train_tensors, refuse_nonfinite, write_train_state

MOMENTS = ("exp_avg", "exp_avg_sq")


def _adapters(trainer: MegatronPolicy) -> Adapters | None:
    assert trainer.lora is not None
    return trainer.lora.io.gather({k: p.detach() for k, p in trainer.lora.params.items()})


def send_weights(trainer: MegatronPolicy, sender: Any, version: int) -> Any:
    """Collective. Rank 0 sends the adapters' tensors (sync names) and returns what ``sender.send`` returns."""
    adapters = _adapters(trainer)
    return None if adapters is None else sender.send(sync_names(adapters), version)


def export_adapters(trainer: MegatronPolicy, directory: str) -> list[str]:
    """Collective. Every adapter in PEFT format under ``directory/<name>``; rank 0 returns the paths."""
    adapters = _adapters(trainer)
    if adapters is None:
        return []
    config = trainer.config
    return [str(peft_lora.export_adapter(f"{directory}/{name}", state, config.adapter,
                                         base_model=config.model_path)) for name, state in adapters.items()]


def full_state_dict(trainer: MegatronPolicy) -> dict[str, torch.Tensor] | None:
    """Collective. Rank 0: the base weights in HF names with the first adapter merged in; others None."""
    base = trainer.engine.io.gather({k: p.detach() for k, p in trainer.params.items()})
    adapters = _adapters(trainer)
    if base is None or adapters is None:
        return None
    assert trainer.lora is not None
    state = adapters[trainer.lora.names[0]]
    for key, a in state.items():
        if ".lora_A." not in key:
            continue
        b = state[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        base[name] = base[name] + trainer.lora.scaling * (b @ a)
    return base


def _param_name(key: str, adapter: str) -> str:
    return key.replace(".lora_A.weight", f".lora_A.{adapter}.weight").replace(".lora_B.weight",
                                                                            f".lora_B.{adapter}.weight")


def save_state(trainer: MegatronPolicy, directory: str) -> None:
    """Collective. Gather base, adapters and AdamW moments; rank 0 writes (module docstring)."""
    lora, opt = trainer.lora, trainer.optimizer
    assert lora is not None
    base = trainer.engine.io.gather({k: p.detach() for k, p in trainer.params.items()})
    adapters = _adapters(trainer)
    flat = None if adapters is None else (base or {}) | {f"{n}.{k}": v for n, a in adapters.items()
                                                          for k, v in a.items()}
    refuse_nonfinite(flat, directory, rank=trainer.rank, world_size=trainer.world_size, device=trainer.device)
    stepped = [n for n in lora.names if lora.of(n)[0] in opt.state]  # an adapter's parameters step together
    moments = {key: lora.io.gather({k: opt.state[p][key] if p in opt.state else torch.zeros_like(p)
                                    for k, p in lora.params.items()}) for key in MOMENTS}
    if trainer.rank == 0:
        assert base is not None and adapters is not None
        targets = trainer.config.adapter.target_modules
        model = {peft_base_name(k, targets): v for k, v in base.items()}
        tensors: dict[str, torch.Tensor] = {}
        for name, state in adapters.items():
            model |= {_param_name(k, name): v for k, v in state.items()}
            if name in stepped:
                step = opt.state[lora.of(name)[0]]["step"].detach().cpu().clone()
                for k in state:
                    tensors[f"state.{_param_name(k, name)}.step"] = step.clone()
                    for key in MOMENTS:
                        tensors[f"state.{_param_name(k, name)}.{key}"] = moments[key][name][k]  # type: ignore[index]
        groups = []
        for name, g in zip(lora.names, opt.state_dict()["param_groups"], strict=True):
            groups.append({**{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"},
                           "params": [_param_name(k, name) for k in adapters[name]]})
        write_train_state(directory, model_state=model, optimizer_tensors=tensors, param_groups=groups,
                          scheduler_state=trainer.scheduler.state_dict(), world_size=trainer.world_size)
    if trainer.world_size > 1:
        dist.barrier()
    export_adapters(trainer, f"{directory}/adapters")


def load_state(trainer: MegatronPolicy, directory: str) -> None:
    """Collective. Restore what :func:`save_state` (or the FSDP trainer with the same adapters) wrote."""
    lora, opt, io = trainer.lora, trainer.optimizer, trainer.engine.io
    assert lora is not None
    meta = read_train_meta(directory)
    model: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    if trainer.rank == 0:
        model, tensors = read_train_tensors(directory)
    targets = trainer.config.adapter.target_modules
    names = list(io.hf_shapes)
    every = [e for stage in lora.io.stages for e in stage]
    missing = []  # rank 0 reads; every rank must leave before the broadcasts if it lacks a tensor
    if trainer.rank == 0:
        missing = [k for k in [peft_base_name(n, targets) for n in names] + [e.param_name for e in every]
                   if k not in model]
    lacking = torch.tensor([len(missing)], device=trainer.device)
    if trainer.world_size > 1:
        dist.broadcast(lacking, src=0)
    if int(lacking):
        raise ValueError(f"load_state: {directory}/model.safetensors lacks {int(lacking)} tensor(s) this trainer "
                         f"holds{' (e.g. ' + ', '.join(missing[:3]) + ')' if missing else ''}; it was written for "
                         f"other adapters ({list(lora.names)} here, adapter.target_modules={list(targets)})")
    base = io.shard(io.broadcast({n: model[peft_base_name(n, targets)] for n in names} if trainer.rank == 0
                                 else None, names))

    def adapters_of(fn: Callable[[LoraEntry], torch.Tensor]) -> Adapters | None:
        """Rank 0: ``fn(entry)`` for every adapter tensor of every stage; other ranks None."""
        if trainer.rank != 0:
            return None
        out: Adapters = {n: {} for n in lora.names}
        for e in every:
            out[e.adapter][e.peft_key] = fn(e)
        return out

    weights = lora.io.shard(lora.io.broadcast(adapters_of(lambda e: model[e.param_name])))
    with torch.no_grad():
        for k, t in base.items():
            trainer.params[k].copy_(t)
        for k, t in weights.items():
            lora.params[k].copy_(t)
    steps = torch.zeros(len(lora.names), device=trainer.device)  # per adapter; 0: it never stepped
    if trainer.rank == 0:
        for i, n in enumerate(lora.names):
            first = next(e for e in every if e.adapter == n)
            steps[i] = float(tensors.get(f"state.{first.param_name}.step", torch.zeros(())))
    if trainer.world_size > 1:
        dist.broadcast(steps, src=0)
    opt.state.clear()
    if bool(steps.any()):
        shards = {key: lora.io.shard(lora.io.broadcast(adapters_of(
            lambda e, key=key: tensors.get(f"state.{e.param_name}.{key}", torch.zeros(e.shape))))) for key in MOMENTS}
        for i, n in enumerate(lora.names):
            if float(steps[i]) == 0:
                continue
            for e in lora.io.entries:
                if e.adapter == n:
                    p = lora.params[e.local]
                    opt.state[p] = {"step": torch.tensor(float(steps[i])),
                                    **{key: shards[key][e.local].to(p.device) for key in MOMENTS}}
    for group, old in zip(opt.param_groups, meta["param_groups"], strict=True):
        group.update({k: tuple(v) if k == "betas" else v for k, v in old.items() if k != "params" and k in group})
    trainer.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(opt.param_groups)})
    if trainer.world_size > 1:
        dist.barrier()
