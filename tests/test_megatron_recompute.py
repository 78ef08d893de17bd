"""``trainer.activation_checkpointing=true`` on the megatron trainer: megatron-core's full recompute, one rank.

Each decoder layer keeps only its input in the forward and runs again in the backward (twice as many layer
forwards); the gradients are those of the run without it, bit for bit, also with bf16 compute and with the QAT
forward under LoRA adapters. PP=2 runs in ``tests/test_megatron.py`` (``pp2_recompute``), as does the check of
the CPU redirects it needs (megatron saves and restores the CUDA generator state around a recompute:
:mod:`miles.train.megatron.compat`); PP=2 with routing replay in ``tests/test_megatron_replay_precision.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from fsdp_ranks import hf_model_from, rl_batch  # noqa: E402
from megatron_ranks import local_megatron  # noqa: E402

from miles.backends.contract import check_trainer_class  # noqa: E402
from miles.config.validate import validate  # noqa: E402
from miles.train.megatron import MegatronTrainer  # noqa: E402

pytestmark = pytest.mark.megatron

BASE: dict[str, Any] = {
    "trainer": {"lr": 1e-4, "shared_prompt_forward": False, "max_tokens_per_microbatch": 24},
    "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "num_minibatches": 1},
    "placement": {"trainer_world_size": 1},
}
VARIANTS: dict[str, tuple[bool, dict[str, dict[str, Any]]]] = {
    # name: (MoE, settings on top of BASE)
    "dense": (False, {}),
    "moe": (True, {}),
    "bf16": (False, {"precision": {"train_dtype": "bfloat16", "rollout_dtype": "bfloat16"}}),
    "int4_qat_lora": (False, {"precision": {"rollout_quant": "int4", "train_quant": "int4", "quant_block_size": 32},
                              "adapter": {"kind": "lora", "rank": 4, "alpha": 8.0}}),
}


def _gradients(ckpt: Path, batch: Any, variant: str, *, recompute: bool,
               then: Callable[[MegatronTrainer], None] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Rank 0's gradients on ``batch`` and the number of decoder-layer forwards meanwhile; ``then(trainer)``
    runs before the trainer shuts down."""
    moe, extra = VARIANTS[variant]
    cfg = copy.deepcopy(BASE)
    for group, values in extra.items():
        cfg[group] = cfg.get(group, {}) | values
    cfg["trainer"]["activation_checkpointing"] = recompute
    if moe:
        cfg["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
    run = validate(cfg)
    check_trainer_class(MegatronTrainer, run)  # accepted before Ray starts
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    with local_megatron(ckpt, run) as trainer:
        assert trainer.model.module.config.recompute_granularity == ("full" if recompute else None)
        hooks = [layer.register_forward_hook(count) for layer in trainer.model.module.decoder.layers]
        grads = trainer.compute_gradients(batch)
        for h in hooks:
            h.remove()
        if then is not None:
            then(trainer)
    assert grads is not None
    return grads, calls[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recompute_gives_the_same_gradients(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, variant: str):
    ckpt = tiny_qwen3_moe_dir if VARIANTS[variant][0] else tiny_qwen3_dir
    batch = rl_batch(hf_model_from(ckpt))
    plain, plain_calls = _gradients(ckpt, batch, variant, recompute=False)

    def unwrapped_fails(trainer: MegatronTrainer) -> None:
        """megatron-core 0.16.1 recomputes a layer outside the forward step's autocast: without each layer's own
        (:func:`miles.train.megatron.model.autocast_recomputed_layers`), its first linear meets bf16 activations
        and fp32 weights."""
        for layer in trainer.model.module.decoder.layers:
            del layer.forward  # the class's forward again
        with pytest.raises(RuntimeError, match=r"expected m1 and m2 to have the same dtype, but got: c10::BFloat16 "
                                               r"!= float"):
            trainer.compute_gradients(batch)

    recomputed, calls = _gradients(ckpt, batch, variant, recompute=True,
                                   then=unwrapped_fails if variant == "bf16" else None)
    assert plain_calls > 0 and calls == 2 * plain_calls
    assert list(recomputed) == list(plain)
    assert max(g.abs().max().item() for g in plain.values()) > 1e-2
    for k, g in plain.items():
        assert torch.equal(recomputed[k], g), k
