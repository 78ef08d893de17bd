"""Trainer ranks for tests: Ray actors in one gloo group, or one in-process rank; a small RL batch."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from miles.algos.advantages import group_normalized
from miles.algos.logprobs import token_logprobs
from miles.config import RankConfig
from miles.config.schema import MilesConfig
from miles.machine import free_port
from miles.train.fsdp import FSDPTrainer
from miles.train.rank import open_group_store
from miles.types import TrainBatch

TIMEOUT_S = 120


def hf_model_from(ckpt: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """Plain HF forward, one sequence at a time (no padding involved)."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]
        out.append(token_logprobs(logits, torch.tensor(r)).tolist())
    return out


def rl_batch(model: torch.nn.Module, n: int = 8) -> TrainBatch:
    """n samples of varied lengths; rollout log-probs are the fp32 HF ones (so mismatch is ~0 in fp32)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (3 + i % 4,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(3, 96, (2 + (3 * i) % 5,), generator=g).tolist() for i in range(n)]
    loss_mask = [[0 if (i % 3 == 0 and j == 1) else 1 for j in range(len(r))] for i, r in enumerate(responses)]
    rewards = torch.tensor([float(i % 3 == 0) for i in range(n)]).view(2, n // 2)
    return TrainBatch(prompt_ids=prompts, response_ids=responses,
                      rollout_logprobs=hf_logprobs(model, prompts, responses), loss_mask=loss_mask,
                      advantages=group_normalized(rewards).flatten().tolist())


def engine_routes(ckpt: Path, batch: TrainBatch) -> list[torch.Tensor]:
    """The routes an engine with other router weights (noise 0.2) records for each sample of ``batch`` on the MoE
    checkpoint ``ckpt``: [P + R - 1, layers, k] int16 per sample (``TrainBatch.routing``)."""
    from miles.train.routing_replay import find_routers

    hf = hf_model_from(ckpt)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(hf):
            router.weight.add_(0.2 * torch.randn(router.weight.shape, generator=g))
    captured: list[torch.Tensor] = []
    for router in find_routers(hf):
        router.register_forward_hook(lambda _m, _i, out: captured.append(out[2]))
    out = []
    for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True):
        captured.clear()
        with torch.no_grad():
            hf(input_ids=torch.tensor([p + r]))
        out.append(torch.stack([c[: len(p) + len(r) - 1] for c in captured], 1).to(torch.int16))
    return out


class Group:
    """``world_size`` trainer actors forming one gloo group."""

    def __init__(self, ray, world_size: int, ckpt: Path, run: MilesConfig) -> None:
        self.ray = ray
        actor_cls = ray.remote(num_cpus=0.5)(FSDPTrainer)
        self.store = open_group_store()  # the group meets here while it lives
        self.actors = [actor_cls.remote(rank=r, world_size=world_size, master_addr="127.0.0.1",
                                        master_port=self.store.port,
                                        checkpoint_dir=str(ckpt), config=RankConfig.of(run), num_threads=1)
                       for r in range(world_size)]

    def call(self, method: str, *args):
        return self.ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=TIMEOUT_S)

    def close(self) -> None:
        try:
            self.call("shutdown")
        finally:
            for a in self.actors:
                self.ray.kill(a)


@contextlib.contextmanager
def local_trainer(ckpt: Path, run: MilesConfig) -> Iterator[FSDPTrainer]:
    """One rank (world size 1) in this process, shut down afterwards."""
    trainer = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                          checkpoint_dir=str(ckpt), config=RankConfig.of(run), num_threads=1)
    try:
        yield trainer
    finally:
        trainer.shutdown()


def poison_weight(trainer: Any, rank: int) -> str | None:
    """Inside a rank (``ray.get(actor.__ray_call__.remote(poison_weight, r))``), FSDP or megatron: on rank
    ``rank`` only, this rank's part of its first weight becomes NaN (as a diverged update leaves it); its name."""
    if trainer.rank != rank:
        return None
    named = trainer.params.items() if isinstance(getattr(trainer, "params", None), dict) \
        else trainer.model.named_parameters()
    name, p = next(iter(named))
    with torch.no_grad():
        (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
    return name


try:
    from ray import cloudpickle
except ImportError:  # scripts/gpu_check.sh's machine has no Ray: tests/test_gpu.py uses the helpers above only
    pass
else:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import tests/
