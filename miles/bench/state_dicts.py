"""State dicts of random weights with the names and shapes of a Qwen3 decoder, for the weight-sync benchmarks."""

from __future__ import annotations

import torch
from torch import Tensor

# name -> (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim); untied lm_head
SIZES: dict[str, tuple[int, ...]] = {
    "20M": (8192, 512, 1536, 4, 8, 4, 64),   # 21.0M parameters
    "100M": (32000, 768, 2048, 8, 12, 4, 64),  # 99.5M parameters
    "tiny": (96, 64, 128, 2, 4, 2, 16),  # for tests
}


def qwen_like_state_dict(size: str, seed: int = 0) -> dict[str, Tensor]:
    """Random fp32 tensors with the names and shapes of a Qwen3 decoder of ``size`` (see SIZES)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid: {', '.join(SIZES)}")
    vocab, h, inter, layers, heads, kv, hd = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
