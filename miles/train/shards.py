"""Sharded trainer state: every rank writes its own part with ``torch.distributed.checkpoint`` (DCP).

The FSDP trainer with more than one rank writes its state so (``trainer_state.json`` format 2,
:func:`miles.train.optim.save_train_state`); nothing is gathered on one rank::

    trainer_state.json     format 2: optimizer hyperparameters per param group, the scheduler's counters
    shards/__<r>_0.distcp  rank r's part of every tensor (DCP's FileSystemWriter)
    shards/.metadata       DCP's index of the parts (written by DCP with pickle)
    shards/manifest.json   size and SHA-256 of the two above (:mod:`miles.config.manifest`), written last

The tensors are ``model.<parameter>`` (the model's sharded state dict) and ``optimizer.state.<parameter>.<key>``
(AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``; a number in the optimizer state becomes a 0-d fp64 tensor).
DCP reshards on load: a state written by W ranks loads at any world size (each rank reads the parts that
overlap its own), and :func:`read_full` reads full tensors in one process (tests, tools).
The megatron trainer writes and reads the same keys from its TP/PP/EP shards (:mod:`miles.train.megatron.state`).

``.metadata`` is a pickle. Before anything under ``shards/`` is read, every file there is checked against
the manifest (:func:`verify`), so a changed or foreign ``.metadata`` is refused and never unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.config import manifest

DIR = "shards"
MODEL = "model."
OPTIMIZER = "optimizer."


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flat_tensors(
    model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """``{"model.<name>": tensor, "optimizer.state.<name>.<key>": tensor}`` of sharded (or plain) state dicts as
    ``get_model_state_dict`` / ``get_optimizer_state_dict`` return them; the tensors themselves, not copies."""
    flat = {MODEL + k: v for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
            flat[f"{OPTIMIZER}state.{name}.{key}"] = t
    return flat


def refuse_nonfinite(model_state: dict[str, torch.Tensor], directory: str | Path, *, world_size: int) -> None:
    """Collective. ValueError on every rank when a rank's part of a tensor of ``model_state`` is not finite
    (the names of all ranks' non-finite tensors, once each)."""
    bad = sorted(
        k
        for k, v in model_state.items()
        if v.is_floating_point() and not bool(torch.isfinite(_local(v)).all())
    )
    if world_size > 1:
        every: list[list[str]] = [[] for _ in range(world_size)]
        dist.all_gather_object(every, bad)
        bad = sorted({k for names in every for k in names})
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(
            f"save_state: refusing to write {directory}: {len(bad)} parameter tensor(s) hold NaN or "
            f"inf ({shown}); the previous checkpoints stay as they were. The weights diverged: resume "
            "from an earlier checkpoint with a lower trainer.lr or trainer.max_grad_norm"
        )


def write(directory: str | Path, tensors: dict[str, torch.Tensor], *, rank: int, world_size: int) -> None:
    """Collective. Every rank writes its parts of ``tensors`` under ``directory/shards`` (which rank 0 created);
    then rank 0 writes the manifest of the files there (after DCP's ``.metadata``, which DCP writes last)."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory) / DIR
    dcp.save(
        tensors, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), no_dist=world_size == 1
    )
    if rank == 0:
        manifest.write(path)
    if world_size > 1:
        dist.barrier()


def verify(directory: str | Path) -> None:
    """ValueError unless every file under ``directory/shards`` (``.metadata`` included) matches its manifest."""
    path = Path(directory) / DIR
    try:
        manifest.verify(path)
    except ValueError as e:
        raise ValueError(
            f"load_state: refusing the sharded trainer state in {directory}: {e}. Nothing of it was "
            "read (DCP's .metadata is a pickle and is only read once it matches the manifest)"
        ) from None


def verify_collective(
    directory: str | Path, *, rank: int, world_size: int, device: torch.device | str
) -> None:
    """Collective. Rank 0 runs :func:`verify`; every rank raises its error (the other ranks read nothing before)."""
    error = [None]
    if rank == 0:
        try:
            verify(directory)
        except ValueError as e:
            error = [str(e)]
    if world_size > 1:
        dist.broadcast_object_list(error, src=0, device=torch.device(device))
    if error[0] is not None:
        raise ValueError(error[0])


def read_into(directory: str | Path, tensors: dict[str, torch.Tensor], *, world_size: int) -> None:
    """Collective. Fill ``tensors`` (this rank's sharded or plain tensors, keys as :func:`flat_tensors`) in place
    from ``directory/shards``, whatever world size wrote it. Call :func:`verify_collective` first."""
    import torch.distributed.checkpoint as dcp

    dcp.load(
        tensors, storage_reader=dcp.FileSystemReader(str(Path(directory) / DIR)), no_dist=world_size == 1
    )


def read_full(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """In one process: ``(model state, optimizer tensors)`` as full CPU tensors, the names of the format 1 files
    (``<name>``; ``state.<name>.<key>``). Verifies ``directory/shards`` against its manifest first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify(directory)
    reader = dcp.FileSystemReader(str(Path(directory) / DIR))
    full: dict[str, torch.Tensor] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(
                f"load_state: {directory}/{DIR} holds {key!r}, which is not a tensor; not a miles "
                "trainer state"
            )
        full[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(full, storage_reader=reader, no_dist=True)
    model = {k.removeprefix(MODEL): v for k, v in full.items() if k.startswith(MODEL)}
    optim = {k.removeprefix(OPTIMIZER): v for k, v in full.items() if k.startswith(OPTIMIZER)}
    return model, optim
