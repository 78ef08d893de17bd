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
(one machine, or shared storage). Finding and reading checkpoints: :mod:`miles.config.checkpoints`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from miles.config.checkpoints import FORMAT, checkpoints, rng_to_json, step_dir
from miles.tracking.snapshot import redact_tree

# keys a resumed run may change without changing what it computes
_MAY_DIFFER = ("trainer.resume_from", "trainer.num_steps", "trainer.save_every", "trainer.save_dir",
               "trainer.keep_checkpoints", "trainer.eval_every", "tracking.", "cluster.")


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


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts, leaving out those a resume may change
    (secret values are compared redacted: the checkpoint's config.yaml holds them so)."""
    from miles.tracking.mlflow_tracker import flatten

    a, b = flatten(saved), flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k, "<unset>") != b.get(k, "<unset>")
            and not any(k == m or (m.endswith(".") and k.startswith(m)) for m in _MAY_DIFFER)]
