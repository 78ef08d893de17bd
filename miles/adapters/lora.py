"""LoRA adapters with ``peft``: the same wrapping on the trainer and in the engine, adapter-only weight
sync, per-row adapters in one batch, and export in PEFT's on-disk format.

Names. A model wrapped here is a ``peft.PeftModel``; an adapter ``name`` owns the parameters
``<module>.lora_A.<name>.weight`` and ``<module>.lora_B.<name>.weight``. The *PEFT key* of such a
parameter is its name without ``.<name>`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
which is what ``peft``'s ``save_pretrained`` writes to ``adapter_model.safetensors`` and what
:func:`adapter_parameters` maps to the live parameters, so trainer and engine agree on names
whatever the adapter is called on either side.

Weight sync. :func:`sync_state` names each tensor ``"adapter:<name>:<PEFT key>"``; an engine that
receives a state dict whose keys all carry that prefix (:func:`is_adapter_state`) updates those
adapters' tensors only: the base weights are frozen and never sent.

Rows. :func:`rows_use` runs a forward where row ``i`` of the batch goes through adapter
``names[i]`` (``None``: the base model alone), with peft's mixed-batch LoRA forward
(``adapter_names``): each LoRA layer computes the base output once for the whole batch and adds each
adapter's low-rank update to its own rows. Adapters stay unmerged, so several are served at once.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from miles.config.schema import AdapterConfig

SYNC_PREFIX = "adapter:"
BASE = "__base__"
"""peft's name for 'no adapter' in a mixed batch."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


VISION_TOWER = r".*\bvisual\b.*"
"""Modules a vision-language model's adapters skip: its vision tower and merger (``model.visual``), whose MLP
has the language model's projection names (``gate_proj``, ``up_proj``, ``down_proj``)."""


def lora_config(cfg: AdapterConfig, *, inference: bool = False, vision: bool = False) -> Any:
    """The ``peft.LoraConfig`` of ``cfg`` (dropout off: see :func:`miles.config.validate.check_adapter_config`);
    ``vision``: a vision-language model, whose adapters sit on the language model alone."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM", inference_mode=inference,
                      exclude_modules=VISION_TOWER if vision else None)


def add_adapters(model: torch.nn.Module, cfg: AdapterConfig, names: Sequence[str], *,
                 trainable: bool) -> Any:
    """Wrap ``model`` (an HF causal LM, or a vision-language model: adapters on its language model only) in a
    ``PeftModel`` holding one LoRA adapter per name.

    Every adapter starts as peft initializes it (``lora_B`` zero: the model's outputs are unchanged).
    The base weights are frozen; the adapters' weights are trainable when ``trainable`` (all of them,
    whichever is peft's "active" one: :func:`rows_use` picks per row).
    """
    from peft import get_peft_model

    if not names or len(set(names)) != len(names) or BASE in names:
        raise ValueError(f"adapter names must be distinct and not {BASE!r}; got {list(names)}")
    missing = [m for m in cfg.target_modules if not any(n.split(".")[-1] == m for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"adapter.target_modules: {missing} name no module of {type(model).__name__}; "
                         f"its linear layers are {sorted(_linear_names(model))}")
    # a vision-language model (miles.models.vision.is_vision_config, which adapters sit below)
    vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
    peft_model = get_peft_model(model, lora_config(cfg, vision=vision), adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, lora_config(cfg, vision=vision))
    for n, p in peft_model.named_parameters():
        p.requires_grad_(trainable and _adapter_of(n) is not None)
    return peft_model.eval()  # no dropout on either side (and peft's per-row adapters need eval mode)


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _adapter_of(param_name: str) -> str | None:
    """The adapter a parameter belongs to (``...lora_A.<name>.weight``), or None for a base weight."""
    parts = param_name.split(".")
    for i, p in enumerate(parts[:-2]):
        if p in ("lora_A", "lora_B"):
            return parts[i + 1]
    return None


def peft_key(param_name: str, name: str) -> str:
    """``...q_proj.lora_A.<name>.weight`` -> ``...q_proj.lora_A.weight`` (PEFT's saved name)."""
    return param_name.replace(f".lora_A.{name}.", ".lora_A.").replace(f".lora_B.{name}.", ".lora_B.")


def adapter_parameters(model: torch.nn.Module, name: str) -> dict[str, torch.nn.Parameter]:
    """``{PEFT key: parameter}`` of adapter ``name`` (empty if the model has no such adapter)."""
    return {peft_key(n, name): p for n, p in model.named_parameters() if _adapter_of(n) == name}


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapters a wrapped model holds, in the order they were added."""
    return list(getattr(model, "peft_config", {}) or {})


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor's full value (a DTensor's: collective over its mesh), detached, fp32, on CPU."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().to("cpu", torch.float32, copy=True)


def adapter_state(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """``{PEFT key: full fp32 CPU tensor}`` of adapter ``name``. Collective when the model is sharded."""
    return {k: full_tensor(p) for k, p in adapter_parameters(model, name).items()}


def sync_state(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Every named adapter's tensors under sync names (``adapter:<name>:<PEFT key>``). Collective if sharded."""
    return {f"{SYNC_PREFIX}{name}:{k}": v for name in names for k, v in adapter_state(model, name).items()}


def is_adapter_state(state_dict: dict[str, Any]) -> bool:
    """True when every key is an adapter sync name (an adapter-only update)."""
    return bool(state_dict) and all(k.startswith(SYNC_PREFIX) for k in state_dict)


def split_sync_state(state_dict: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{adapter name: {PEFT key: tensor}}`` of a :func:`sync_state` dict."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state_dict.items():
        name, _, key = k[len(SYNC_PREFIX):].partition(":")
        out.setdefault(name, {})[key] = v
    return out


@contextmanager
def rows_use(model: Any, names: Sequence[str | None] | str) -> Iterator[None]:
    """Within the block, row ``i`` of every forward through ``model`` uses adapter ``names[i]`` (None: none);
    a single name: every row uses it, whatever the batch size.

    ``model`` is the ``PeftModel``; the forward may go through any of its submodules (the engine calls
    the decoder directly). A forward pre-hook on every LoRA layer passes peft's ``adapter_names``
    argument, so each layer takes its mixed-batch path (base output once, each adapter's update on its
    own rows), as ``PeftModel.forward(adapter_names=...)`` does. peft refuses that path in training
    mode; miles runs its models in eval mode (no dropout) on both sides, and gradients flow through it.
    Nothing is unregistered before the block ends: a backward that recomputes layers (activation
    checkpointing) must run inside it.
    """
    from peft.tuners.lora import LoraLayer

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rows = [names] * len(args[0]) if isinstance(names, str) else [BASE if n is None else n for n in names]
        return args, {**kwargs, "adapter_names": rows}

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if isinstance(m, LoraLayer)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def export_adapter(directory: str | Path, state: dict[str, torch.Tensor], cfg: AdapterConfig,
                   base_model: str | None = None, vision: bool = False) -> Path:
    """Write one adapter in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``
    (``vision``: of a vision-language model, whose config excludes the vision tower).

    ``state``: ``{PEFT key: tensor}`` (:func:`adapter_state`). The directory is written under a
    temporary name and renamed, so a reader never sees half an adapter. ``peft.PeftModel.from_pretrained``
    loads it (``tests/test_lora.py`` checks the logits). SGLang's ``--lora-paths`` expects the same
    layout: ``sglang/srt/lora/lora_config.py`` reads ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``target_modules``, ``rank_pattern``, ``alpha_pattern``, ``use_dora``) and ``sglang/srt/lora/lora.py``
    the safetensors weights of the directory, named ``...<module>.lora_A.weight`` /
    ``...<module>.lora_B.weight``. Loading into an SGLang server has not been run (its LoRA kernels
    need a GPU).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    config = lora_config(cfg, inference=True, vision=vision).to_dict()
    config["base_model_name_or_path"] = base_model
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_FILE),
              metadata={"format": "pt"})
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old")
        os.replace(directory, old)
        os.replace(tmp, directory)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    return directory


def load_adapter_file(directory: str | Path) -> dict[str, torch.Tensor]:
    """The ``{PEFT key: tensor}`` of an exported adapter (safetensors only, never unpickled)."""
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / WEIGHTS_FILE))


def trainable_share(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), counting a sharded tensor by its full size."""
    def numel(p: torch.Tensor) -> int:
        return int(torch.Size(p.shape).numel())
    params = list(model.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)
