"""What every FSDP2 rank shares, policy trainer and PPO critic alike.

A rank joins its own torch.distributed group (gloo on the CPU, NCCL on CUDA; the group's address
comes from the driver, :func:`miles.core.cluster.rendezvous`), shards its model per decoder layer
with ``fully_shard`` (the classes in the HF model's ``_no_split_modules``), and writes and reads
its model, optimizer and schedule in one layout (:mod:`miles.train.optim`). Subclasses build the
model and the optimizer; everything here only needs ``self.model``, ``self.optimizer`` and
``self.scheduler``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from miles.backends.reuse import Reusable
from miles.config.rank import RankConfig
from miles.tracking.profiler import Profiled
from miles.train.optim import load_train_state, save_train_state

log = logging.getLogger(__name__)


STORE_TIMEOUT = timedelta(seconds=300)
"""How long a rank waits to reach its group's store, and the group for its other ranks."""


def open_group_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The store a group of ranks meets at, hosted by whoever forms the group (the driver:
    :func:`miles.core.cluster.rendezvous`; a test) on a port the kernel gives. The port is bound as it is
    chosen, so no other process (a parallel sweep's job, another user) can take it before the ranks
    connect; keep the returned object for as long as the group lives (its ``port`` goes to the ranks)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def init_device_and_group(*, rank: int, world_size: int, master_addr: str, master_port: int,
                          device: str = "cpu") -> torch.device:
    """Join the rank's process group: NCCL on ``device="cuda"`` (the actor's visible GPU), else gloo.

    A group of several ranks meets at the store :func:`open_group_store` hosts at ``master_addr:master_port``.
    A rank alone hosts its own store on a free port (``master_port`` is not used).
    """
    if world_size == 1:
        store = dist.TCPStore(master_addr, 0, 1, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    else:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"rank {rank}: device 'cuda' was asked for, but this process sees no CUDA device "
                               "(did the placement reserve GPUs? placement.device)")
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=dev)
        return dev
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', found {device!r}")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return torch.device("cpu")


def pad_token_id(config: Any) -> int:
    """The padding id of an HF config: its pad token, else its (first) EOS, else 0 (padding is masked)."""
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    return next(i for i in (config.pad_token_id, eos, 0) if i is not None)


class FSDPRank(Reusable, Profiled):
    """Base of :class:`miles.train.fsdp.FSDPTrainer` and :class:`miles.train.critic.FSDPCritic`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def _init_rank(self, *, rank: int, world_size: int, master_addr: str, master_port: int,
                   config: RankConfig, num_threads: int, device: str) -> None:
        """Threads, process group, device and seed (the same parameter init on every rank)."""
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.rank, self.world_size, self.config = rank, world_size, config
        self.device = init_device_and_group(rank=rank, world_size=world_size, master_addr=master_addr,
                                            master_port=master_port, device=device)
        torch.manual_seed(config.seed)

    def _mp_policy(self) -> Any:
        """Compute in the parameters' dtype (fp32), or bf16 with fp32 gradient reduction."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.config.precision.train_dtype == "bfloat16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def _shard(self, model: torch.nn.Module, layer_classes: set[str], *, sharded: bool = True,
               per_layer: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
        """``fully_shard`` every decoder layer (after ``per_layer(layer)``), then the root; with
        ``sharded=False`` only ``per_layer`` runs (one fp32 rank: sharding would be the identity)."""
        from torch.distributed.fsdp import fully_shard

        layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
        if not layers:
            raise ValueError(f"{type(self).__name__}: {type(model).__name__} names no decoder layer classes "
                             "(_no_split_modules); cannot shard it per layer")
        mp = self._mp_policy()
        for layer in layers:
            if per_layer is not None:
                per_layer(layer)
            if sharded:
                fully_shard(layer, mp_policy=mp)
        if sharded:
            fully_shard(model, mp_policy=mp)
        return model

    def _all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t

    def save_state(self, directory: str) -> None:
        """Collective. Write model, optimizer and scheduler state to ``directory`` (safetensors + JSON; with more
        than one rank every rank writes its own shard).

        Layout and atomic rename in :func:`miles.train.optim.save_train_state`.
        """
        save_train_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                         rank=self.rank, world_size=self.world_size)

    def load_state(self, directory: str) -> None:
        """Collective. Restore what :meth:`save_state` wrote (any world size; shards are resharded)."""
        load_train_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                         rank=self.rank, world_size=self.world_size)

    def shutdown(self) -> None:
        """Barrier, then destroy the process group (gloo can abort at exit without the barrier)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _end_job(self) -> None:  # parking (miles.backends.reuse): collective, like the constructor
        self.shutdown()
