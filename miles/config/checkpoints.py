"""Run checkpoints on disk, read: where they are and the loop state they hold (what ``trainer.resume_from`` names).

The layout, and how a checkpoint is written and resumed from: :mod:`miles.core.resume`. The config check
of ``trainer.resume_from`` (:mod:`miles.config.validate`) reads a checkpoint with :func:`load`, before Ray starts.
A checkpoint is complete when its SHA-256 manifest (:mod:`miles.config.manifest`, written last) is there;
:func:`load` checks the files it reads against it first, :func:`verify` every file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles.config import manifest

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class LoopState:
    """Where a run stands after ``step``: what :func:`miles.core.loop.train` needs to go on."""

    step: int
    rng_state: tuple
    """``random.Random.getstate()`` of the loop's prompt sampler."""
    next_group_id: int
    config: dict[str, Any]
    """The resolved config that wrote the checkpoint (for the comparison at resume)."""
    path: Path
    fingerprint: dict[str, Any] | None = None
    """The model's shape and the tokenizer the checkpoint was written with (:func:`miles.core.resume.fingerprint`;
    None: written before miles recorded them)."""
    ledger: dict[str, list[int]] | None = None
    """:meth:`miles.core.ledger.Ledger.state` at the checkpoint (None: written before the ledger was kept)."""
    stream: dict[str, Any] | None = None
    """Async schedules, prompts drawn but not settled: ``open`` (group ids), ``first_open`` (the oldest)
    and ``rng_state`` (the sampler's state before drawing it); None when there are none."""
    tenants: dict[str, tuple] | None = None
    """Runs with tenants: each tenant's prompt sampler state by name (:mod:`miles.core.tenants`)."""


def step_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir).expanduser() / f"step_{step:06d}"


def checkpoints(save_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints (with their manifest) in ``save_dir`` as ``(step, path)``, oldest first."""
    root = Path(save_dir).expanduser()
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(x for x in found if manifest.has_manifest(x[1]) and (x[1] / "loop_state.json").is_file())


def incomplete(save_dir: str | Path) -> list[Path]:
    """``step_<k>`` directories in ``save_dir`` without a manifest (saves that did not finish), oldest first."""
    root = Path(save_dir).expanduser()
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if not manifest.has_manifest(p)]


def find_checkpoint(path: str | Path) -> Path:
    """``path`` if it is a checkpoint, else the newest complete checkpoint inside it; ValueError if neither."""
    p = Path(path).expanduser()
    if (p / "loop_state.json").is_file() or manifest.has_manifest(p):
        return p
    found = checkpoints(p)
    if found:
        return found[-1][1]
    if not p.exists():
        raise ValueError(f"{path}: no such directory")
    partial = incomplete(p)
    if partial:
        raise ValueError(f"{path}: no complete checkpoint, only {', '.join(q.name for q in partial)} without "
                         f"{manifest.NAME} (saves that did not finish)")
    raise ValueError(f"{path}: neither a run checkpoint (no loop_state.json) nor a directory holding "
                     "step_<k> checkpoints; point it at one written with trainer.save_every")


_READ = ("loop_state.json", "config.yaml", "trainer/trainer_state.json", "critic/trainer_state.json")


def load(path: str | Path) -> LoopState:
    """Read the loop state of the checkpoint at (or newest under) ``path``, after checking the files read
    here against the manifest (and every file's size; :func:`verify` checks every digest)."""
    ckpt = find_checkpoint(path)
    manifest.verify(ckpt, only=_READ)
    meta = json.loads((ckpt / "loop_state.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{ckpt}: loop state format {meta.get('format')!r}; this miles reads {FORMAT}")
    if not (ckpt / "trainer" / "trainer_state.json").is_file():
        raise ValueError(f"{ckpt}: no trainer/ state next to loop_state.json (an incomplete checkpoint?)")
    config = yaml.safe_load((ckpt / "config.yaml").read_text()) if (ckpt / "config.yaml").is_file() else {}
    stream = meta.get("stream")
    if stream is not None:
        stream = stream | {"rng_state": rng_from_json(stream["rng_state"])}
    return LoopState(step=int(meta["step"]), rng_state=rng_from_json(meta["rng_state"]),
                     next_group_id=int(meta["next_group_id"]), config=config, path=ckpt, ledger=meta.get("ledger"),
                     stream=stream, fingerprint=meta.get("fingerprint"),
                     tenants={k: rng_from_json(v) for k, v in meta["tenants"].items()} if "tenants" in meta else None)


def verify(state: LoopState) -> None:
    """Every file of the checkpoint against its manifest's SHA-256 (before the trainers read any)."""
    manifest.verify(state.path)


def rng_to_json(state: tuple) -> list[Any]:
    """``random.Random.getstate()`` as JSON."""
    return [state[0], list(state[1]), state[2]]


def rng_from_json(value: list[Any]) -> tuple:
    version, internal, gauss = value
    return version, tuple(internal), gauss


def critic_state(state: LoopState) -> Path:
    """The critic state directory of a loaded checkpoint; ValueError when it was written without one."""
    d = state.path / "critic"
    if not (d / "trainer_state.json").is_file():
        raise ValueError(f"{state.path}: no critic/ state, but this run trains a critic (algo.estimator=gae); "
                         "the checkpoint was written by a run without one")
    return d
