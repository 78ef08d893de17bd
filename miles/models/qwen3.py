"""Qwen3 and Qwen3-MoE model specs.

A flavor is a named set of dimensions. ``tiny`` builds offline on CPU in
well under a second and is the vehicle of every CPU test and default run; its
``vocab_size`` is a placeholder that :func:`miles.models.checkpoint.ensure_checkpoint`
replaces with the size of the tokenizer trained for the task. The real sizes
(``0.6b``, ``30b_a3b``) carry the published Hugging Face dimensions and are
never built from scratch: a run with one of them needs ``model.path`` (a local checkpoint).

With ``path`` the checkpoint's ``config.json`` wins over the flavor (the
flavor only names the run), after checking that it is the right model family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from transformers import AutoConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from miles.config.validate import suggest
from miles.models.spec import ModelSpec

_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=512,  # placeholder: set from the task's tokenizer before the model is built
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    tie_word_embeddings=False,
)

QWEN3_FLAVORS: dict[str, dict[str, Any]] = {
    "tiny": dict(_TINY_COMMON),
    # About 19M parameters (with the 320-token built vocabulary): the long-output benchmark model.
    "20m": dict(
        _TINY_COMMON, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
    ),
    # Qwen/Qwen3-0.6B (GPU only).
    "0.6b": dict(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=151_643, eos_token_id=151_645,
    ),
}
"""Dense Qwen3 dimensions by flavor name."""

QWEN3_MOE_FLAVORS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        _TINY_COMMON, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    ),
    # Qwen/Qwen3-30B-A3B (GPU only).
    "30b_a3b": dict(
        vocab_size=151_936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=40_960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=151_643, eos_token_id=151_645,
    ),
}
"""Qwen3-MoE dimensions by flavor name."""

FROM_SCRATCH = frozenset({"tiny", "20m"})
"""Flavors built from random weights offline; the published sizes need ``model.path``."""


def qwen3_spec(flavor: str = "tiny", path: str | None = None) -> ModelSpec:
    """The dense Qwen3 spec at ``flavor`` (``tiny``, ``20m`` or ``0.6b``), or read from the checkpoint at ``path``."""
    hf_config = _config("qwen3", flavor, path, QWEN3_FLAVORS, Qwen3Config)
    return ModelSpec(name="qwen3", flavor=flavor, hf_config=hf_config, source_path=path,
                     build_from_scratch=flavor in FROM_SCRATCH)


def qwen3_moe_spec(flavor: str = "tiny", path: str | None = None) -> ModelSpec:
    """The Qwen3-MoE spec at ``flavor`` (``tiny``: 4 experts, top-2, every layer sparse; ``30b_a3b``)."""
    hf_config = _config("qwen3_moe", flavor, path, QWEN3_MOE_FLAVORS, Qwen3MoeConfig)
    return ModelSpec(
        name="qwen3_moe", flavor=flavor, hf_config=hf_config, is_moe=True,
        router_modules="model.layers.{layer}.mlp.gate", source_path=path, build_from_scratch=flavor in FROM_SCRATCH,
    )


def _config(
    model_type: str,
    flavor: str,
    path: str | None,
    flavors: Mapping[str, Mapping[str, Any]],
    config_cls: Callable[..., PretrainedConfig],
) -> PretrainedConfig:
    if flavor not in flavors:
        raise ValueError(
            f"model.flavor: unknown {model_type} flavor '{flavor}'{suggest(flavor, list(flavors))}. "
            f"Valid flavors: {', '.join(flavors)}"
        )
    if path is None:
        return config_cls(**flavors[flavor])
    config = AutoConfig.from_pretrained(path)
    if config.model_type != model_type:
        raise ValueError(
            f"model.path: {path!r} holds a '{config.model_type}' checkpoint, but this spec builds "
            f"'{model_type}'; pick the matching model group (e.g. model={config.model_type}) or another path"
        )
    return config
