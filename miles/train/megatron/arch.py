"""What the Megatron backend reads from an HF ``config.json``: Qwen3 and Qwen3-MoE dimensions.

Pure Python (no megatron import): :meth:`MegatronTrainer.check_config` uses it before Ray starts,
and :mod:`.model` / :mod:`.mapping` build and shard the model from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True, kw_only=True)
class Arch:
    """A Qwen3 / Qwen3-MoE decoder's dimensions (names as in megatron's ``TransformerConfig``)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    """Dense MLP width (``intermediate_size``)."""
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    max_position_embeddings: int
    num_experts: int = 0
    """0: dense."""
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    """Per layer: sparse (MoE) or dense MLP."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, config: Any) -> Arch:
        """Read an HF ``PretrainedConfig`` (Qwen3 or Qwen3-MoE); ValueError on anything else."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the megatron trainer builds {' and '.join(SUPPORTED_MODEL_TYPES)} models; the checkpoint "
                             f"is '{model_type}'. Use trainer=fsdp for it")
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias=true: Qwen3 checkpoints have no attention bias and the megatron "
                             "mapping has none; use trainer=fsdp for this checkpoint")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: the megatron model is SwiGLU (silu) only")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope type {rope.get('rope_type')!r}: the megatron model has the default RoPE only")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10_000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        common = dict(
            model_type=model_type, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps, rope_theta=float(theta),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )
        if model_type == "qwen3":
            return cls(**common)
        step = getattr(config, "decoder_sparse_step", 1)
        dense_only = set(getattr(config, "mlp_only_layers", None) or [])
        sparse = tuple(i not in dense_only and config.num_experts > 0 and (i + 1) % step == 0
                       for i in range(config.num_hidden_layers))
        return cls(**common, num_experts=config.num_experts, moe_top_k=config.num_experts_per_tok,
                   moe_ffn_hidden_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                   moe_layers=sparse)
