"""Run checkpoints: what a run needs to continue where it stopped, with the same numbers.

``trainer.save_every=N`` writes ``<trainer.save_dir>/step_<k>`` after every N-th step and after the
last one::

    trainer/            the trainer ranks' state (:meth:`miles.train.fsdp.FSDPTrainer.save_state`):
                        model, AdamW moments, learning-rate schedule counters (safetensors + JSON)
    critic/             with a critic (``algo.estimator: gae``): the critic ranks' state, same layout
    loop_state.json     the step, the prompt sampler's RNG state and the next group id (every
                        group's sampling seed follows from the run seed and its id), the sample
                        ledger's outcomes (:meth:`miles.core.ledger.Ledger.state`) and, under an
                        async schedule, the prompts still open (``stream``: their ids and the
                        sampler's state when the oldest was drawn; :mod:`miles.core.schedules`)
    config.yaml         the resolved config of the run that wrote it (secrets redacted)

A checkpoint is written into ``step_<k>.tmp`` and renamed into place once complete, so a crash
leaves the previous checkpoints and at worst a ``.tmp`` that is never read. Only the newest
``trainer.keep_checkpoints`` stay.

``trainer.resume_from=PATH`` (a ``step_<k>`` directory, or a save directory: its newest step) loads
the trainer state (and the critic's), sends the policy weights to the engines as version ``k`` and
runs steps ``k + 1`` to ``trainer.num_steps``. Prompts, sampling noise and updates then follow the
uninterrupted run's: on CPU with a fixed seed its per-step metrics equal that run's. Under an async
schedule the prompts open at the checkpoint (generating, or waiting for the trainer) are generated
again from the checkpoint's weights before new ones are drawn: every prompt is trained once (or
accounted for) across both parts, though the batches need not be the uninterrupted run's, which
depend on when each group finished. The trainer and the driver must see the same ``save_dir``
(one machine, or shared storage).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles.tracking.snapshot import redact_tree

log = logging.getLogger(__name__)

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
# keys a resumed run may change without changing what it computes
_MAY_DIFFER = ("trainer.resume_from", "trainer.num_steps", "trainer.save_every", "trainer.save_dir",
               "trainer.keep_checkpoints", "trainer.eval_every", "tracking.", "cluster.")


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
    ledger: dict[str, list[int]] | None = None
    """:meth:`miles.core.ledger.Ledger.state` at the checkpoint (None: written before the ledger was kept)."""
    stream: dict[str, Any] | None = None
    """Async schedules, prompts drawn but not settled: ``open`` (group ids), ``first_open`` (the oldest)
    and ``rng_state`` (the sampler's state before drawing it); None when there are none."""


def step_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir).expanduser() / f"step_{step:06d}"


def checkpoints(save_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``save_dir`` as ``(step, path)``, oldest first."""
    root = Path(save_dir).expanduser()
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(x for x in found if (x[1] / "loop_state.json").is_file())


def find_checkpoint(path: str | Path) -> Path:
    """``path`` if it is a checkpoint, else the newest checkpoint inside it; ValueError if neither."""
    p = Path(path).expanduser()
    if (p / "loop_state.json").is_file():
        return p
    found = checkpoints(p)
    if found:
        return found[-1][1]
    if not p.exists():
        raise ValueError(f"{path}: no such directory")
    raise ValueError(f"{path}: neither a run checkpoint (no loop_state.json) nor a directory holding "
                     "step_<k> checkpoints; point it at one written with trainer.save_every")


def save(trainers: list[Any], save_dir: str | Path, step: int, rng_state: tuple, next_group_id: int,
         config: dict[str, Any], keep: int, critics: Sequence[Any] = (), ledger: dict[str, list[int]] | None = None,
         stream: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step`` (collective over ``trainers``, then over ``critics``); returns
    its directory. ``ledger`` and ``stream``: see :class:`LoopState`."""
    import ray

    final = step_dir(save_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ray.get([t.save_state.remote(str(tmp / "trainer")) for t in trainers])
    if critics:
        ray.get([c.save_state.remote(str(tmp / "critic")) for c in critics])
    (tmp / "config.yaml").write_text(yaml.safe_dump(redact_tree(config), sort_keys=False))
    meta = {"format": FORMAT, "step": step, "next_group_id": next_group_id, "rng_state": rng_to_json(rng_state)}
    if ledger is not None:
        meta["ledger"] = ledger
    if stream is not None:
        meta["stream"] = stream | {"rng_state": rng_to_json(stream["rng_state"])}
    (tmp / "loop_state.json").write_text(json.dumps(meta))
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replaced whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in checkpoints(save_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str | Path) -> LoopState:
    """Read the loop state of the checkpoint at (or newest under) ``path``."""
    ckpt = find_checkpoint(path)
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
                     stream=stream)


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


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts, leaving out those a resume may change
    (secret values are compared redacted: the checkpoint's config.yaml holds them so)."""
    from miles.tracking.mlflow_tracker import flatten

    a, b = flatten(saved), flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k, "<unset>") != b.get(k, "<unset>")
            and not any(k == m or (m.endswith(".") and k.startswith(m)) for m in _MAY_DIFFER)]
