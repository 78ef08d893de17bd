"""Run checkpoints: what a run needs to continue where it stopped, with the same numbers.

``trainer.save_every=N`` writes ``<trainer.save_dir>/step_<k>`` after every N-th step and after the
last one::

    trainer/            the trainer ranks' state (:meth:`miles.train.fsdp.FSDPTrainer.save_state`):
                        model, AdamW moments, learning-rate schedule counters (safetensors + JSON)
    critic/             with a critic (``algo.estimator: gae``): the critic ranks' state, same layout
    loop_state.json     the step, the prompt sampler's RNG state (with tenants, each tenant's) and the
                        next group id (every group's sampling seed follows from the run seed and its id), the sample
                        ledger's outcomes (:meth:`miles.core.ledger.Ledger.state`) and, under an
                        async schedule, the prompts still open (``stream``: their ids and the
                        sampler's state when the oldest was drawn; :mod:`miles.core.schedules`)
    config.yaml         the resolved config of the run that wrote it (secrets redacted)
    manifest.json       written last: every file above with its size and SHA-256 (:mod:`miles.config.manifest`)

Before writing anything the trainer ranks check that every parameter is finite, and refuse the
save otherwise (the previous checkpoints stay). A checkpoint is written into ``step_<k>.tmp``
(:func:`begin`, the ranks' state, :func:`write_loop`); its files are flushed to disk, the manifest is
written, atomically and last (:func:`seal`), and the directory is renamed into place (:func:`publish`).
With more than one FSDP rank every rank writes its own part of the trainer state
(:mod:`miles.train.shards`). A save killed at any point leaves the previous checkpoints as they were
and at worst a ``.tmp`` (or a ``step_<k>`` without manifest) that is never read: only a directory
with its manifest counts as a checkpoint, and the next save that completes removes the ``.tmp`` of
an earlier step. Only the newest ``trainer.keep_checkpoints`` stay; an old one is renamed out of the
``step_<k>`` names before it is deleted, so a half-deleted one is never taken for one. Resuming
checks every file against the manifest before anything is read (and a sharded trainer state, whose
DCP index is a pickle, against its own manifest too).

``trainer.resume_from=auto`` takes the newest complete checkpoint in ``trainer.save_dir``, or starts
afresh (and says so) when there is none: re-running the command of a run that was killed continues
it. ``trainer.resume_from=PATH`` (a ``step_<k>`` directory, or a save directory: its newest step) loads
the trainer state (and the critic's), sends the policy weights to the engines as version ``k`` and
runs steps ``k + 1`` to ``trainer.num_steps``. Prompts, sampling noise and updates then follow the
uninterrupted run's: on CPU with a fixed seed its per-step metrics equal that run's. Under an async
schedule the prompts open at the checkpoint (generating, or waiting for the trainer) are generated
again from the checkpoint's weights before new ones are drawn: every prompt is trained once (or
accounted for) across both parts, though the batches need not be the uninterrupted run's, which
depend on when each group finished. The trainer and the driver must see the same ``save_dir``
(one machine, or shared storage). A checkpoint records the model's shape and the tokenizer's
vocabulary (:func:`fingerprint`); a resume with another model shape or tokenizer is refused before
Ray starts (:func:`check_compatible`). Any world size and layout loads the trainer state: full tensors
(one rank, or the megatron trainer) or shards that are resharded on load. Finding and reading
checkpoints: :mod:`miles.config.checkpoints`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from miles.config import ConfigError, manifest
from miles.config.checkpoints import FORMAT, LoopState, checkpoints, incomplete, rng_to_json, step_dir
from miles.config.schema import MilesConfig
from miles.tracking.snapshot import redact_tree

log = logging.getLogger(__name__)

# keys a resumed run may change without changing what it computes
_MAY_DIFFER = ("trainer.resume_from", "trainer.num_steps", "trainer.save_every", "trainer.save_dir",
               "trainer.keep_checkpoints", "trainer.eval_every", "trainer.max_failures", "tracking.", "cluster.")


def save(trainers: list[Any], save_dir: str | Path, step: int, rng_state: tuple, next_group_id: int,
         config: dict[str, Any], keep: int, critics: Sequence[Any] = (), ledger: dict[str, list[int]] | None = None,
         stream: dict[str, Any] | None = None, fingerprint: dict[str, Any] | None = None,
         draft: Any | None = None, hang_timeout_s: float = 0.0, tenants: dict[str, tuple] | None = None) -> Path:
    """Write the checkpoint of ``step`` (collective over ``trainers``, then over ``critics``); returns
    its directory. ``ledger`` and ``stream``: see :class:`LoopState`; ``fingerprint``: :func:`fingerprint`;
    ``draft``: the online draft's trainer (``draft.online``), whose state goes into ``draft/``; ``tenants``:
    each tenant's prompt sampler state by name (:class:`LoopState`);
    ``hang_timeout_s``: the ranks are probed while they write (:func:`miles.core.recovery.get_ranks`): one that
    hangs is killed, and the checkpoint is not published.

    The steps, each a function: :func:`begin` (an empty ``step_<k>.tmp``), the ranks' state, :func:`write_loop`,
    :func:`seal` (the manifest), :func:`publish` (the rename, then pruning)."""
    import ray

    from miles.core.recovery import get_ranks

    tmp = begin(save_dir, step)
    get_ranks([t.save_state.remote(str(tmp / "trainer")) for t in trainers], trainers, "trainer", hang_timeout_s)
    if critics:
        get_ranks([c.save_state.remote(str(tmp / "critic")) for c in critics], critics, "critic", hang_timeout_s)
    if draft is not None:
        try:
            ray.get(draft.save_state.remote(str(tmp / "draft")))
        except ray.exceptions.RayActorError as err:  # the next weight push replaces it (miles.core.step.recover_draft)
            shutil.rmtree(tmp / "draft.tmp", ignore_errors=True)
            log.warning("step %d: the draft trainer died (%s); this checkpoint holds no draft state, a resume from it "
                        "continues with the draft as loaded", step, str(err).splitlines()[0] if str(err) else "")
    write_loop(tmp, step, rng_state, next_group_id, config, ledger=ledger, stream=stream, fingerprint=fingerprint,
               tenants=tenants)
    seal(tmp)
    return publish(tmp, keep)


def begin(save_dir: str | Path, step: int) -> Path:
    """An empty ``<save_dir>/step_<k>.tmp`` (what an earlier attempt left there is removed) to write into."""
    tmp = step_dir(save_dir, step).with_name(step_dir(save_dir, step).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_loop(tmp: Path, step: int, rng_state: tuple, next_group_id: int, config: dict[str, Any], *,
               ledger: dict[str, list[int]] | None = None, stream: dict[str, Any] | None = None,
               fingerprint: dict[str, Any] | None = None, tenants: dict[str, tuple] | None = None) -> None:
    """``config.yaml`` (secrets redacted) and ``loop_state.json`` into ``tmp``."""
    (tmp / "config.yaml").write_text(yaml.safe_dump(redact_tree(config), sort_keys=False))
    meta = {"format": FORMAT, "step": step, "next_group_id": next_group_id, "rng_state": rng_to_json(rng_state)}
    if ledger is not None:
        meta["ledger"] = ledger
    if stream is not None:
        meta["stream"] = stream | {"rng_state": rng_to_json(stream["rng_state"])}
    if fingerprint is not None:
        meta["fingerprint"] = fingerprint
    if tenants is not None:
        meta["tenants"] = {name: rng_to_json(state) for name, state in tenants.items()}
    (tmp / "loop_state.json").write_text(json.dumps(meta))


def seal(tmp: Path) -> None:
    """Flush every file of ``tmp`` and write its manifest, last (atomically)."""
    manifest.write(tmp)


def publish(tmp: Path, keep: int) -> Path:
    """Rename the sealed ``step_<k>.tmp`` to ``step_<k>`` (one ``os.replace``: from here on it is a checkpoint),
    then delete all but the newest ``keep`` checkpoints; returns the checkpoint's path."""
    if not manifest.has_manifest(tmp):
        raise ValueError(f"publish: {tmp} has no {manifest.NAME}; seal it first")
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replaced whole
        _remove(final)
    os.replace(tmp, final)
    manifest.fsync(final.parent)
    for _, old in checkpoints(final.parent)[:-keep]:
        _remove(old)
    for left in final.parent.glob("step_*.tmp"):  # saves of earlier steps that were killed
        if left.name < tmp.name:
            shutil.rmtree(left, ignore_errors=True)
    return final


def _remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of the ``step_<k>`` names first, so that a crash while
    deleting never leaves a partial directory under a checkpoint's name."""
    gone = path.with_name(path.name + ".deleting")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts, leaving out those a resume may change
    (secret values are compared redacted: the checkpoint's config.yaml holds them so)."""
    from miles.tracking.mlflow_tracker import flatten

    a, b = flatten(saved), flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k, "<unset>") != b.get(k, "<unset>")
            and not any(k == m or (m.endswith(".") and k.startswith(m)) for m in _MAY_DIFFER)]


_SHAPE_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_experts",
               "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size")


def fingerprint(model_dir: str | Path, tokenizer: Any) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it: the HF ``config.json`` keys that set
    parameter shapes (``model.<key>``), and the tokenizer's size and a SHA-256 of its vocabulary."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    return ({f"model.{k}": cfg[k] for k in _SHAPE_KEYS if k in cfg}
            | {"tokenizer.size": len(tokenizer), "tokenizer.vocab_sha256": hashlib.sha256(vocab.encode()).hexdigest()})


def check_compatible(state: LoopState, current: dict[str, Any]) -> None:
    """ConfigError naming every key of :func:`fingerprint` in which ``state``'s checkpoint differs from
    this run's model or tokenizer (a checkpoint without a fingerprint is not checked)."""
    if state.fingerprint is None:
        log.warning("%s records no model shape or tokenizer (written by an older miles): not checked", state.path)
        return
    saved = state.fingerprint
    differ = [k for k in sorted(set(saved) | set(current)) if saved.get(k, "<unset>") != current.get(k, "<unset>")]
    if differ:
        found = "; ".join(f"{k}: this run has {current.get(k, '<unset>')!r}, the checkpoint {saved.get(k, '<unset>')!r}"
                          for k in differ)
        raise ConfigError(
            f"trainer.resume_from: {state.path} was written for another "
            f"{'tokenizer' if all(k.startswith('tokenizer.') for k in differ) else 'model'} ({found}); resume it "
            "with the model.* and tokenizer of the run that wrote it (its config.yaml), or start afresh without "
            "trainer.resume_from")


def resolve_auto(run: MilesConfig) -> MilesConfig:
    """``run`` with ``trainer.resume_from=auto`` replaced by the newest complete checkpoint in
    ``trainer.save_dir``, or by None (a fresh start, logged) when there is none; other values unchanged."""
    t = run.trainer
    if t.resume_from != "auto":
        return run
    if t.save_dir is None:
        raise ConfigError("trainer.resume_from=auto: set trainer.save_dir too (the same directory in every re-run)")
    found = checkpoints(t.save_dir)
    skipped = [p.name for p in incomplete(t.save_dir) if not found or p.name > found[-1][1].name]
    if skipped:
        log.warning("trainer.resume_from=auto: %s in %s did not finish saving (no %s); not used", ", ".join(skipped),
                    t.save_dir, manifest.NAME)
    if not found:
        log.warning("trainer.resume_from=auto: no complete checkpoint in %s; starting afresh at step 1", t.save_dir)
        path = None
    else:
        path = str(found[-1][1])
        log.info("trainer.resume_from=auto: resuming from %s, the newest complete checkpoint in %s", path, t.save_dir)
    return dataclasses.replace(run, trainer=dataclasses.replace(t, resume_from=path))



def export_policy(checkpoint: str | Path, base_model: str | Path, out: str | Path) -> Path:
    """The policy of a run checkpoint as an HF checkpoint directory, loadable as ``model.path`` or as a
    ``teacher.model`` / ``draft.model`` path.

    ``checkpoint``: a ``step_<k>`` directory, or a save directory (its newest); every file is checked against its
    manifest first. ``base_model``: the checkpoint the run started from, whose config, tokenizer and generation
    settings are kept. The trained weights (either trainer, any world size: shards are joined) replace its
    weights in ``out``, which must not exist. A LoRA run's checkpoint is refused: its adapters are exported in
    PEFT format (``adapter.export_dir``)."""
    from miles.config import checkpoints
    from miles.train.optim import read_train_tensors

    state = checkpoints.load(checkpoint)
    checkpoints.verify(state)
    out = Path(out)
    if out.exists():
        raise ValueError(f"export_policy: {out} exists; export into a new directory")
    if (state.path / "trainer" / "adapters").exists():
        raise ValueError(f"export_policy: {state.path} is a LoRA run's checkpoint; its adapters are in "
                         f"{state.path / 'trainer' / 'adapters'} (PEFT format)")
    weights, _ = read_train_tensors(state.path / "trainer")
    return _export(weights, state, base_model, out, "policy")


def export_draft(checkpoint: str | Path, base_draft: str | Path, out: str | Path) -> Path:
    """The online-trained draft of a run checkpoint (``draft.online``; its ``draft/`` part) as an HF checkpoint
    directory, loadable as a ``draft.model`` path; draft heads (``draft.heads``) as a heads directory.
    ``base_draft``: the draft the run started from (config, tokenizer; the heads directory it loaded);
    ``checkpoint`` and ``out`` as in :func:`export_policy`."""
    from safetensors.torch import load_file

    from miles.config import checkpoints

    state = checkpoints.load(checkpoint)
    checkpoints.verify(state)
    if not (state.path / "draft" / "model.safetensors").is_file():
        raise ValueError(f"export_draft: {state.path} holds no draft (it was written without draft.online)")
    if Path(out).exists():
        raise ValueError(f"export_draft: {out} exists; export into a new directory")
    weights = load_file(str(state.path / "draft" / "model.safetensors"))
    from miles.models.draft_heads import META, is_heads_dir, load_heads, save_heads

    if is_heads_dir(base_draft):  # draft.heads: a heads directory, loadable by engines and DraftTrainer alike
        heads = load_heads(base_draft)
        missing, unexpected = heads.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"export_draft: {state.path} does not hold {base_draft}'s heads: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        save_heads(heads, out, **{k: v for k, v in json.loads((Path(base_draft) / META).read_text()).items()
                                  if k not in ("k", "hidden_size")} | {"exported_from": str(state.path)})
        log.info("exported the draft heads of %s (step %d) to %s", state.path, state.step, out)
        return Path(out)
    return _export(weights, state, base_draft, Path(out), "draft")


def _export(weights: dict[str, torch.Tensor], state: Any, base: str | Path, out: Path, what: str) -> Path:
    """``base``'s directory with ``weights`` in place of its own, written to ``out``."""
    import shutil

    from transformers import AutoModelForCausalLM

    from miles.train.draft import tied_names

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - tied_names(model) or unexpected:
        raise ValueError(f"export_{what}: {state.path} does not hold {base}'s weights: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    model.save_pretrained(out, safe_serialization=True)
    log.info("exported the %s of %s (step %d) to %s", what, state.path, state.step, out)
    return out
