"""A model spec: everything miles needs to know about one model family."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model family at one size.

    ``hf_config`` builds the model (``AutoModelForCausalLM.from_config``) when no
    checkpoint is given; ``router_modules`` names the MoE router submodules
    (a ``{layer}`` placeholder) for routing capture and replay.
    """

    name: str
    flavor: str
    hf_config: PretrainedConfig
    is_moe: bool = False
    router_modules: str | None = None
    source_path: str | None = None  # the HF checkpoint this spec was read from, if any
    build_from_scratch: bool = True
    """Whether miles may build this size from random weights and a task-trained tokenizer (the small
    flavors); a published size needs ``model.path``."""
    gguf: tuple[str, str] | None = None
    """(directory, file) of a GGUF file that the checkpoint is converted from, once, when ``path`` is unset."""
    extra: dict = field(default_factory=dict)
