"""Learning-rate schedule and resumable trainer state (safetensors + JSON, never pickle).

Schedule, as a multiplier of ``trainer.lr`` at optimizer step ``s`` (0-based), ``W`` warmup steps,
``S`` total optimizer steps (``trainer.num_steps * algo.num_minibatches``), ``r = min_lr_ratio``::

    s < W:      (s + 1) / W                              linear warmup
    constant:   1
    linear:     r + (1 - r) * (1 - p)                    p = (s - W) / (S - W), clamped to [0, 1]
    cosine:     r + (1 - r) * (1 + cos(pi * p)) / 2

so a decaying schedule reaches ``r * lr`` at step ``S`` and stays there.

Trainer state on disk (written by rank 0, the whole directory renamed into place at the end)::

    model.safetensors      full fp32 model state dict, HF parameter names
    optimizer.safetensors  ``state.<param name>.<key>`` for every per-parameter tensor (AdamW: step,
                           exp_avg, exp_avg_sq)
    trainer_state.json     optimizer hyperparameters per param group and the scheduler's counters
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
