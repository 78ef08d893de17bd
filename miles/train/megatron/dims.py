"""Parallel sizes of the Megatron trainer, validated together in one place (torchtitan's ``ParallelDims``).

``W = placement.trainer_world_size`` ranks are laid out as megatron lays them out (order
``tp-cp-ep-dp-pp``, context parallel 1)::

    W  = TP x PP x DP                 dense layers: DP = W / (TP x PP) data-parallel replicas
    W  = ETP x EP x EDP x PP          experts: ETP = TP (megatron's default), EP divides DP

Every error names each size and the key that sets it. Pure Python: the driver calls
:func:`check_dims` through ``MegatronTrainer.check_config`` before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.validate import ConfigError
from miles.train.megatron.arch import Arch


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of one Megatron trainer group (ranks are placed by megatron's ``parallel_state``)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the dense layers."""
        return self.world_size // (self.tp * self.pp)

    def describe(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp}" + (f" EP={self.ep}" if self.ep > 1 else "")


def check_dims(dims: ParallelDims, arch: Arch) -> None:
    """Raise :class:`ConfigError` unless megatron can lay ``arch`` out over ``dims``."""
    w, tp, pp, ep = dims.world_size, dims.tp, dims.pp, dims.ep
    sizes = {"placement.trainer_world_size": w, "trainer.tensor_parallel": tp, "trainer.pipeline_parallel": pp,
             "trainer.expert_parallel": ep}
    for key, v in sizes.items():
        if v < 1:
            raise ConfigError(f"{key}: must be at least 1, found {v}")
    if w % (tp * pp):
        raise ConfigError(
            f"placement.trainer_world_size ({w}) must be a multiple of trainer.tensor_parallel ({tp}) x "
            f"trainer.pipeline_parallel ({pp}) = {tp * pp}; the ranks left over are the data-parallel replicas. "
            f"Set placement.trainer_world_size to {tp * pp} (or a multiple) or lower the parallel sizes")
    heads = {"num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads}
    for name, n in heads.items():
        if n % tp:
            raise ConfigError(f"trainer.tensor_parallel ({tp}) must divide the model's {name} ({n}): each tensor-"
                              f"parallel rank holds whole heads (whole query groups)")
    if arch.num_layers % pp:
        raise ConfigError(f"trainer.pipeline_parallel ({pp}) must divide the model's num_hidden_layers "
                          f"({arch.num_layers}): every stage gets the same number of layers")
    if not arch.is_moe:
        if ep > 1:
            raise ConfigError(f"trainer.expert_parallel={ep}: the model ({arch.model_type}) has no experts; "
                              "set trainer.expert_parallel=1 or use model=qwen3_moe")
        return
    if tp > 1:
        raise ConfigError(
            f"trainer.tensor_parallel={tp} with an MoE model: megatron shards experts over tensor-parallel ranks "
            "only with sequence parallel, which its local (non-Transformer-Engine) layers cannot do. Use "
            "trainer.expert_parallel (and data parallel) for MoE, with trainer.tensor_parallel=1")
    if arch.num_experts % ep:
        raise ConfigError(f"trainer.expert_parallel ({ep}) must divide the model's num_experts "
                          f"({arch.num_experts}): each expert-parallel rank holds the same number of experts")
    if dims.dp % ep:
        raise ConfigError(
            f"trainer.expert_parallel ({ep}) must divide the data-parallel size {dims.dp} = "
            f"placement.trainer_world_size ({w}) / (trainer.tensor_parallel ({tp}) x trainer.pipeline_parallel "
            f"({pp})): expert-parallel groups are cut out of the data-parallel ranks")
