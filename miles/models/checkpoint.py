"""Build (or reuse) the HF checkpoint a run starts from.

With ``model.path`` set, that checkpoint is used as is. Otherwise miles builds
one offline: a BPE tokenizer trained on the task's text, the spec's model at
that vocabulary size (initialised under ``torch.manual_seed(seed)``), a short
supervised warm start (:mod:`miles.models.warm_start`), then ``save_pretrained``
(safetensors) of model, tokenizer and generation config.

Built checkpoints are cached under ``warm_start.cache_dir`` in a directory
named by a sha256 of everything that shapes the weights: spec name, flavor
and HF config, the task's target and keyword arguments, the warm-start
settings, the seed, :data:`FORMAT_VERSION` and the transformers version. A
build is written to a temporary directory and renamed into place, so a
crashed build never leaves a half-written checkpoint that a later run would
trust. Everything downstream loads the result with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``:
the same path a real checkpoint takes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from miles.config.manifest import sha256
from miles.config.schema import MilesConfig
from miles.models.spec import ModelSpec
from miles.models.tokenizer import train_tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when the build recipe changes in a way the hashed settings do not capture."""

TOKENIZER_VOCAB_SIZE = 320
"""BPE vocabulary of built checkpoints: the 256 bytes, 3 special tokens and merges of the task's words."""

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


def checkpoint_key(run: MilesConfig, spec: ModelSpec) -> str:
    """The sha256 (hex) of every setting that shapes a built checkpoint."""
    ws = run.warm_start
    payload = {
        "format": FORMAT_VERSION,
        "transformers": transformers.__version__,
        "spec": {"name": spec.name, "flavor": spec.flavor, "hf_config": spec.hf_config.to_dict()},
        "task": {"target": run.task.source.target, "kwargs": dict(run.task.source.kwargs),
                 "files": _file_digests(run.task.source.kwargs)} if not run.tenants else [
            {"target": t.task.source.target, "kwargs": dict(t.task.source.kwargs),
             "files": _file_digests(t.task.source.kwargs), "template": t.prompt_template} for t in run.tenants],
        "tokenizer_vocab_size": TOKENIZER_VOCAB_SIZE,
        "warm_start": {"steps": ws.steps, "batch_size": ws.batch_size, "lr": ws.lr,
                       "max_tokens_per_microbatch": ws.max_tokens_per_microbatch},
        "seed": run.seed,
    }
    blob = json.dumps(payload, sort_keys=True, default=_jsonable)
    return hashlib.sha256(blob.encode()).hexdigest()


def _file_digests(kwargs: object) -> dict[str, str]:
    """sha256 of every task argument that names an existing file: editing a data file rebuilds."""
    out: dict[str, str] = {}
    for k, v in dict(kwargs).items():  # type: ignore[call-overload]
        if isinstance(v, str) and v and Path(v).expanduser().is_file():
            out[k] = sha256(Path(v).expanduser())
    return out


def _jsonable(x: object) -> object:
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)  # type: ignore[call-overload]
    if isinstance(x, tuple | set | frozenset):
        return list(x)
    return repr(x)


def ensure_checkpoint(run: MilesConfig, spec: ModelSpec, task) -> Path:
    """The checkpoint directory for this run: ``run.model.path``, a cached build, or a fresh build.

    ``task`` provides ``corpus()`` (tokenizer text) and ``sft_examples(n, rng)`` (warm start).
    """
    if run.model.path is not None:
        return Path(run.model.path)
    root = Path(run.warm_start.cache_dir).expanduser()
    if spec.gguf is not None:
        return _from_gguf(spec, root)
    final = root / f"{spec.name}-{spec.flavor}-{checkpoint_key(run, spec)[:16]}"
    return cached_build(final, lambda tmp: _build(run, spec, task, tmp))


def cached_build(final: Path, build: Callable[[Path], None], required: tuple[str, ...] = _REQUIRED_FILES) -> Path:
    """``final`` if it holds every file of ``required``; else ``build(tmp)`` into a temporary sibling renamed to
    ``final``, so a crashed build leaves nothing a later run would trust."""
    if all((final / f).is_file() for f in required):
        log.info("reusing %s", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not all((final / f).is_file() for f in required):
                raise
            log.info("another process built %s first; using it", final)  # same key: same contents
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(run: MilesConfig, spec: ModelSpec, task, out: Path) -> None:
    """Tokenizer, model, warm start, save: everything in ``out``."""
    # transformers' modeling code and the trainer: a few seconds of imports that a cached build never needs
    from transformers import AutoModelForCausalLM, GenerationConfig

    from miles.models.warm_start import warm_start

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(task.corpus(), TOKENIZER_VOCAB_SIZE)
    if spec.extra.get("vision"):
        from miles.models.vision_build import build_vision_checkpoint

        metrics = build_vision_checkpoint(run, spec, task, out, tokenizer)
        (out / "miles_build.json").write_text(json.dumps({"key": checkpoint_key(run, spec), **metrics}, indent=2))
        log.info("built %s/%s checkpoint in %.1fs (warm start %s)", spec.name, spec.flavor,
                 time.perf_counter() - t0, metrics)
        return
    config = copy.deepcopy(spec.hf_config)
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.pad_token_id  # as in Qwen: <|endoftext|>; never prepended
    torch.manual_seed(run.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ws = run.warm_start
    metrics = warm_start(model, tokenizer, task, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, seed=run.seed,
                         max_tokens_per_microbatch=ws.max_tokens_per_microbatch)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "miles_build.json").write_text(json.dumps({"key": checkpoint_key(run, spec), **metrics}, indent=2))
    log.info(
        "built %s/%s checkpoint in %.1fs (%d params, warm start %s)", spec.name, spec.flavor,
        time.perf_counter() - t0, sum(p.numel() for p in model.parameters()), metrics,
    )


def _from_gguf(spec: ModelSpec, root: Path) -> Path:
    """The HF checkpoint converted from ``spec.gguf``, cached under ``root`` by the file's sha256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert spec.gguf is not None
    directory, name = spec.gguf
    final = root / f"{spec.name}-{spec.flavor}-gguf-{sha256(Path(directory) / name)[:16]}"

    def convert(tmp: Path) -> None:
        t0 = time.perf_counter()
        log.info("converting %s to an HF checkpoint in %s (once)", name, final)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        # the dequantized weights in a plain model: transformers refuses to save a model marked as GGUF-quantized
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        log.info("converted %s in %.1fs (%d params)", name, time.perf_counter() - t0,
                 sum(p.numel() for p in model.parameters()))

    return cached_build(final, convert)
