"""Qwen2.5-VL model spec: a vision tower, a patch merger and a Qwen2 language model in one HF model.

The ``tiny`` flavor builds offline on CPU from a config (about 0.5M parameters): a 2-block vision
transformer (14-pixel patches, 2x2 spatial merge, so a 112x112 image is 8x8 patches and 16 image
tokens) whose merger projects into a 2-layer, 128-wide language model with multimodal RoPE
(``mrope_section`` [4, 6, 6]: temporal, height and width share the 16 rotary frequencies). Its
``vocab_size`` and image-token ids are placeholders set from the task's tokenizer when
:func:`miles.models.checkpoint.ensure_checkpoint` builds it (the tokenizer gains the three vision
tokens ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``).

With ``path`` the checkpoint's ``config.json`` wins (it must be a ``qwen2_5_vl`` checkpoint).
Prompts with images are encoded by :func:`miles.models.vision.encode_image_prompt` with the
checkpoint's image processor (``preprocessor_config.json``).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, Qwen2_5_VLConfig

from miles.config.validate import suggest
from miles.models.spec import ModelSpec

IMAGE_PIXELS = (56 * 56, 112 * 112)
"""(min, max) pixels of the tiny flavor's image processor: images are resized into this range."""

QWEN_VL_FLAVORS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=128,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
            in_channels=3,
        ),
        text_config=dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 6, 6]},
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=0,
        ),
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    ),
}
"""Qwen2.5-VL dimensions by flavor name (only ``tiny``: a published size needs ``model.path``)."""


def qwen_vl_spec(flavor: str = "tiny", path: str | None = None) -> ModelSpec:
    """The Qwen2.5-VL spec at ``flavor`` (``tiny``), or read from the checkpoint at ``path``."""
    if flavor not in QWEN_VL_FLAVORS and path is None:
        raise ValueError(
            f"model.flavor: unknown qwen_vl flavor '{flavor}'{suggest(flavor, list(QWEN_VL_FLAVORS))}. "
            f"Valid flavors: {', '.join(QWEN_VL_FLAVORS)} (or set model.path to a qwen2_5_vl checkpoint)"
        )
    if path is None:
        config = Qwen2_5_VLConfig(**QWEN_VL_FLAVORS[flavor])
    else:
        config = AutoConfig.from_pretrained(path)
        if config.model_type != "qwen2_5_vl":
            raise ValueError(
                f"model.path: {path!r} holds a '{config.model_type}' checkpoint, but model=qwen_vl "
                "builds 'qwen2_5_vl'; pick the matching model group or another path"
            )
    return ModelSpec(
        name="qwen2_5_vl",
        flavor=flavor,
        hf_config=config,
        source_path=path,
        build_from_scratch=path is None,
        extra={"vision": True},
    )
