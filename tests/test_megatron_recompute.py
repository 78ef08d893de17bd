"""``trainer.activation_checkpointing=true`` on the megatron trainer: megatron-core's full recompute, one rank.

Each decoder layer keeps only its input in the forward and runs again in the backward (twice as many layer
forwards); the gradients are those of the run without it, bit for bit. PP=2 runs in ``tests/test_megatron.py``
(``pp2_recompute``), as does the check of the CPU redirects it needs (megatron saves and restores the CUDA
generator state around a recompute: :mod:`miles.train.megatron.compat`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from fsdp_ranks import free_port, hf_model_from, rl_batch  # noqa: E402

from miles.backends.contract import check_trainer_class  # noqa: E402
from miles.config.validate import validate  # noqa: E402
from miles.train.megatron import MegatronTrainer  # noqa: E402

pytestmark = pytest.mark.megatron

BASE: dict[str, Any] = {
    "trainer": {"lr": 1e-4, "shared_prompt_forward": False, "max_tokens_per_microbatch": 24},
    "algo": {"kl_coef": 0.05, "entropy_coef": 0.01, "num_minibatches": 1},
    "placement": {"trainer_world_size": 1},
}


def _gradients(ckpt: Path, batch: Any, *, recompute: bool, moe: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Rank 0's gradients on ``batch`` and the number of decoder-layer forwards meanwhile."""
    cfg = copy.deepcopy(BASE)
    cfg["trainer"]["activation_checkpointing"] = recompute
    if moe:
        cfg["model"] = {"_target_": "miles.models.qwen3.qwen3_moe_spec"}
    run = validate(cfg)
    check_trainer_class(MegatronTrainer, run)  # accepted before Ray starts
    trainer = MegatronTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                              checkpoint_dir=str(ckpt), run=run, num_threads=1)
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    try:
        assert trainer.model.module.config.recompute_granularity == ("full" if recompute else None)
        hooks = [layer.register_forward_hook(count) for layer in trainer.model.module.decoder.layers]
        grads = trainer.compute_gradients(batch)
        for h in hooks:
            h.remove()
    finally:
        trainer.shutdown()
    assert grads is not None
    return grads, calls[0]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_recompute_gives_the_same_gradients(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, moe: bool):
    ckpt = tiny_qwen3_moe_dir if moe else tiny_qwen3_dir
    batch = rl_batch(hf_model_from(ckpt))
    plain, plain_calls = _gradients(ckpt, batch, recompute=False, moe=moe)
    recomputed, calls = _gradients(ckpt, batch, recompute=True, moe=moe)
    assert plain_calls > 0 and calls == 2 * plain_calls
    assert list(recomputed) == list(plain)
    assert max(g.abs().max().item() for g in plain.values()) > 1e-2
    for k, g in plain.items():
        assert torch.equal(recomputed[k], g), k
