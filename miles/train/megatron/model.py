"""A megatron ``GPTModel`` with the architecture of an HF Qwen3 / Qwen3-MoE checkpoint.

The model is megatron's own: ``get_gpt_decoder_block_spec`` with the local (non-Transformer-Engine)
layers (RMSNorm via ``torch.nn.RMSNorm``, ``ColumnParallelLinear`` / ``RowParallelLinear``, the
local ``DotProductAttention``), configured from :class:`~miles.train.megatron.arch.Arch`:

* attention: GQA with ``num_query_groups = num_key_value_heads``, ``kv_channels = head_dim``, RMSNorm
  on queries and keys per head (``qk_layernorm``), no biases, RoPE (``rope_theta``, not interleaved:
  transformers' ``rotate_half``), softmax scale ``1/sqrt(head_dim)``;
* MLP: SwiGLU (``gated_linear_unit`` with SiLU; fc1 holds ``[gate; up]``); MoE layers where the HF
  config has them (``decoder_sparse_step``, ``mlp_only_layers``), experts as a ``SequentialMLP`` of
  the same MLPs, tokens moved by the all-to-all dispatcher, no auxiliary loss, routed by
  :class:`HFTopKRouter` (transformers' Qwen3-MoE routing, :func:`hf_topk_routing`);
* embeddings: tied or untied as in the checkpoint; the vocabulary padded up to a multiple of TP
  (:func:`padded_vocab_size`; padded logits are masked in :mod:`.logits`);
* numerics: fp32 parameters; fp32 compute, or with ``precision.train_dtype=bfloat16`` bf16 compute under
  megatron's autocast (``enable_autocast``; on the CPU through :mod:`.compat`, tested; on CUDA untested
  on a GPU). Every fusion and every dropout is off, so the fp32 forward is deterministic and matches
  transformers' to fp32 rounding (``tests/test_megatron.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from miles.train.megatron.arch import Arch
from miles.train.megatron.dims import ParallelDims


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (megatron splits it evenly over TP ranks)."""
    return -(-vocab_size // tp) * tp


def hf_topk_routing(logits: torch.Tensor, top_k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3-MoE routing, as megatron's dispatcher takes it.

    logits: [T, E] -> (probs [T, E]: the top-k weights at the chosen experts, 0 elsewhere; routing_map
    [T, E] bool). The same operations as ``Qwen3MoeTopKRouter.forward``: softmax in fp32, top-k,
    renormalised over the k when ``normalize`` (``norm_topk_prob``), cast back to the logits' dtype.
    """
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, index = torch.topk(scores, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(logits.dtype)
    probs = torch.zeros_like(logits).scatter(1, index, top)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return probs, routing_map


class HFTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` (gating GEMM, dispatch interface) with :func:`hf_topk_routing`; with a
    :class:`~miles.train.megatron.replay.RouteReplay` attached (``replay``), the rollout's experts."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, *, normalize: bool = True) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.normalize = normalize
        self.replay: Any = None

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.view(-1, self.config.num_moe_experts)
        probs, routing_map = hf_topk_routing(logits, self.topk, normalize=self.normalize)
        if self.replay is not None:
            return self.replay.route(self, logits, probs, routing_map)
        return probs, routing_map


def transformer_config(arch: Arch, dims: ParallelDims, *, bf16_autocast: bool = False,
                       recompute: bool = False) -> TransformerConfig:
    """megatron's ``TransformerConfig`` for ``arch`` over ``dims`` (fusions and dropout off).

    Parameters are fp32 (they are the master weights AdamW updates); ``bf16_autocast`` runs the forward
    under megatron's ``enable_autocast`` (``torch.autocast("cuda", bfloat16)``, which :mod:`.compat` makes
    CPU autocast in a process without CUDA; untested on a GPU).
    ``recompute``: megatron's full activation recompute, one layer per checkpoint (``recompute_method=
    "uniform"``, ``recompute_num_layers=1``): each layer keeps only its input; the backward recomputes it.
    """
    recompute_kw: dict[str, Any] = {}
    if recompute:
        recompute_kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    moe: dict[str, Any] = {}
    if arch.is_moe:
        moe = dict(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size, moe_layer_freq=[int(s) for s in arch.moe_layers],
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        )
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # stages exchange what the layers output: bf16 under autocast (an fp32 buffer would misread the bytes)
        params_dtype=torch.float32, pipeline_dtype=torch.bfloat16 if bf16_autocast else torch.float32,
        enable_autocast=bf16_autocast, autocast_dtype=torch.bfloat16 if bf16_autocast else None,
        use_cpu_initialization=True, perform_initialization=False,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        expert_model_parallel_size=dims.ep,
        # micro-batches differ in rows and length: pipeline stages exchange shapes first (which megatron
        # allows with the all-to-all token dispatcher only; a dense model never dispatches)
        variable_seq_lengths=dims.pp > 1, moe_token_dispatcher_type="alltoall",
        cuda_graph_scope=[],  # the default "full" only warns that it is deprecated; no CUDA graphs here
        # the objective is already this rank's share of the global sum: DDP sums, nothing divides
        calculate_per_token_loss=True,
        **recompute_kw,
        **moe,
    )


def build_gpt_model(arch: Arch, config: TransformerConfig, dims: ParallelDims) -> GPTModel:
    """This rank's pipeline stage of the model (parallel groups already initialized), weights unset."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        if getattr(mlp, "module", None) is MoELayer:
            mlp.submodules.router = functools.partial(HFTopKRouter, normalize=arch.norm_topk_prob)
    return GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=padded_vocab_size(arch.vocab_size, dims.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta,
    )


def autocast_recomputed_layers(model: GPTModel, config: TransformerConfig, device: torch.device) -> None:
    """With bf16 autocast and activation recompute: every decoder layer of ``model`` enters the autocast itself.

    megatron-core 0.16.1 enters ``torch.autocast`` around each forward step only (``schedules.py``), and its
    recompute (``tensor_parallel.random.CheckpointFunction.backward``) runs the layer again inside the
    backward, outside that autocast: the layer's first linear then multiplies bf16 activations with fp32
    weights (``RuntimeError: expected m1 and m2 to have the same dtype``, ``tests/test_megatron_recompute.py``).
    Inside a forward step the layer's own autocast changes nothing; in the recompute it is the forward's,
    so the recompute computes what the forward computed.
    """
    if not (config.enable_autocast and config.recompute_granularity):
        return
    for layer in model.decoder.layers:
        forward = layer.forward

        @functools.wraps(forward)
        def under_autocast(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with torch.autocast(device.type, dtype=config.autocast_dtype):
                return _forward(*args, **kwargs)

        layer.forward = under_autocast


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, S, S] bool, True where a position may not attend (megatron's mask convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
