"""Any local Hugging Face causal-LM checkpoint as a model spec: ``model=hf model.path=DIR``.

The checkpoint's ``config.json`` says the family; its tokenizer and chat template are the ones the
rollout encodes prompts with (:func:`miles.models.tokenizer.encode_prompt`), and both engines and
the FSDP trainer load it through ``from_pretrained``. The families below are the ones whose engine
log-probs are checked against the trainer's in ``tests/test_hf_families.py``; the Megatron trainer
maps Qwen3 and Qwen3-MoE only (it refuses the others before anything starts).

A Qwen2.5-VL checkpoint (``model_type: qwen2_5_vl``) gets the vision spec of ``model=qwen_vl``
(:func:`miles.models.qwen_vl.qwen_vl_spec`): its image processor comes from the same directory.

Nothing is built or trained from scratch here: a checkpoint is used as it is.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from miles.models.qwen_vl import qwen_vl_spec
from miles.models.spec import ModelSpec

FAMILIES: dict[str, str | None] = {
    "qwen3": None,
    "qwen3_moe": "model.layers.{layer}.mlp.gate",
    "qwen2": None,
    "llama": None,
    "mistral": None,
}
"""Supported ``model_type`` -> MoE router module pattern (None for dense models)."""

VISION_FAMILIES = {"qwen2_5_vl": qwen_vl_spec}
"""Vision-language ``model_type`` -> its spec from a checkpoint directory (as ``model=qwen_vl model.path=DIR``)."""


def spec_from_config(config: PretrainedConfig, *, flavor: str, source_path: str | None = None,
                     gguf: tuple[str, str] | None = None) -> ModelSpec:
    """The spec of a checkpoint whose HF config is ``config`` (its ``model_type`` must be supported)."""
    family = config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model.path: a '{family}' checkpoint; supported families: "
                         f"{', '.join([*FAMILIES, *VISION_FAMILIES])}")
    return ModelSpec(name=family, flavor=flavor, hf_config=config, is_moe=FAMILIES[family] is not None,
                     router_modules=FAMILIES[family], source_path=source_path, build_from_scratch=False, gguf=gguf)


def hf_spec(flavor: str = "checkpoint", path: str | None = None) -> ModelSpec:
    """The spec of the HF checkpoint at ``path`` (``flavor`` only names the run)."""
    if path is None:
        raise ValueError("model.path: model=hf needs the directory of a local HF checkpoint (config.json, weights, "
                         "tokenizer), e.g. model.path=/data/Qwen3-0.6B")
    config = AutoConfig.from_pretrained(path)
    if config.model_type in VISION_FAMILIES:  # a VLM: the vision model group's spec, read from the same path
        return VISION_FAMILIES[config.model_type](flavor=flavor, path=path)
    return spec_from_config(config, flavor=flavor, source_path=path)
