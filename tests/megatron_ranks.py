"""Megatron trainer ranks for tests: Ray actors in one gloo group, reused across layouts (``reinit``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fsdp_ranks import TIMEOUT_S, free_port
from ray import cloudpickle

from miles.config import RankConfig
from miles.config.schema import MilesConfig
from miles.train.rank import open_group_store


@contextlib.contextmanager
def local_megatron(ckpt: Path, run: MilesConfig, **extra: Any) -> Iterator[Any]:
    """One megatron rank (world size 1) in this process, shut down afterwards (``extra``: more constructor
    arguments, e.g. ``adapter_names``)."""
    from miles.train.megatron import MegatronTrainer

    trainer = MegatronTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                              checkpoint_dir=str(ckpt), config=RankConfig.of(run), num_threads=1, **extra)
    try:
        yield trainer
    finally:
        trainer.shutdown()


class MegatronGroup:
    """``world_size`` MegatronTrainer actors forming one gloo group; :meth:`reinit` starts the next job in them."""

    def __init__(self, ray: Any, world_size: int, ckpt: Path, run: MilesConfig, **extra: Any) -> None:
        from miles.train.megatron import MegatronTrainer

        self.ray, self.world_size = ray, world_size
        actor_cls = ray.remote(num_cpus=0.5)(MegatronTrainer)
        self.store = open_group_store()  # the group meets here while it lives
        self.actors = [actor_cls.remote(**self._kwargs(r, self.store.port, ckpt, run, extra))
                       for r in range(world_size)]

    def _kwargs(self, rank: int, port: int, ckpt: Path, run: MilesConfig, extra: dict[str, Any]) -> dict[str, Any]:
        """The driver's constructor arguments, and ``extra`` ones (e.g. ``adapter_names``)."""
        return dict(rank=rank, world_size=self.world_size, master_addr="127.0.0.1", master_port=port,
                    checkpoint_dir=str(ckpt), config=RankConfig.of(run), num_threads=1, **extra)

    def call(self, method: str, *args: Any) -> list[Any]:
        return self.ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=TIMEOUT_S)

    def probe(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(trainer, *args)`` inside every actor (Ray's ``__ray_call__``)."""
        return self.ray.get([a.__ray_call__.remote(fn, *args) for a in self.actors], timeout=TIMEOUT_S)

    def reinit(self, ckpt: Path, run: MilesConfig, **extra: Any) -> None:
        """Park every rank and construct it anew for ``run`` (a new process group on a new port)."""
        self.store = open_group_store()
        self.ray.get([a.reinit.remote(**self._kwargs(r, self.store.port, ckpt, run, extra))
                      for r, a in enumerate(self.actors)], timeout=TIMEOUT_S)

    def close(self) -> None:
        try:
            self.call("shutdown")
        finally:
            for a in self.actors:
                self.ray.kill(a)


class MegatronPair:
    """Two megatron ranks for every test module's layouts (session fixture ``megatron_pair``): started by the
    first :meth:`load`, constructed anew for each later one (:meth:`MegatronGroup.reinit`)."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.group: MegatronGroup | None = None

    def load(self, ckpt: Path, run: MilesConfig, **extra: Any) -> MegatronGroup:
        """The pair running ``run`` on ``ckpt`` (``extra``: more constructor arguments, e.g. ``adapter_names``)."""
        if self.group is None:
            self.group = MegatronGroup(self.ray, 2, ckpt, run, **extra)
        else:
            self.group.reinit(ckpt, run, **extra)
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


# ---- functions run inside a rank (Group.probe); pickled by value, since the ranks cannot import tests/ ----

def logits_of(trainer: Any, ids: list[list[int]]) -> Any:
    """Full-vocabulary logits [B, L, V] of equal-length ``ids`` (no padding), on every rank. Collective."""
    import torch

    from miles.train.batching import pad_batch
    from miles.types import TrainBatch

    n = len(ids)
    batch = TrainBatch(prompt_ids=[x[:-1] for x in ids], response_ids=[x[-1:] for x in ids],
                       rollout_logprobs=[[0.0]] * n, loss_mask=[[1]] * n, advantages=[0.0] * n)
    p = pad_batch(batch, pad_id=trainer.pad_id)
    out = trainer.engine.logits(trainer.model, [p])[0]
    shape = (n, len(ids[0]), trainer.arch.vocab_size)
    return trainer.engine.from_last_stage(out.contiguous() if out is not None else torch.zeros(shape))


def gloo_threads(trainer: Any) -> int:
    """Inside a rank: how many gloo threads its process runs (three per live process group)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum("gloo" in n for n in names)


def gradients_and_layer_calls(trainer: Any, batch: Any) -> tuple[Any, int]:
    """``compute_gradients(batch)``, and how many forwards this rank's decoder layers ran meanwhile (a layer
    that recomputes its activations runs twice per micro-batch). Collective."""
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    hooks = [layer.register_forward_hook(count) for layer in trainer.model.module.decoder.layers]
    try:
        return trainer.compute_gradients(batch), calls[0]
    finally:
        for h in hooks:
            h.remove()


def checkpoint_reads(trainer: Any) -> dict[str, int]:
    """How many elements of each stored tensor the rank read from the checkpoint at start."""
    return dict(trainer.checkpoint_reads)


def sent_weights(trainer: Any) -> dict[str, Any] | None:
    """What ``send_weights`` hands its sender on this rank (None where it sends nothing). Collective."""

    class Keep:
        got: dict[str, Any] | None = None

        def send(self, state_dict: dict[str, Any], version: int) -> int:
            self.got = {k: v.detach().clone() for k, v in state_dict.items()}
            return version

    keep = Keep()
    trainer.send_weights(keep, 0)
    return keep.got


def redirected_sites(trainer: Any) -> dict[str, str]:
    """The CUDA call sites the compatibility layer redirected in this rank's process."""
    from miles.train.megatron import compat

    return compat.redirected_sites()


def _moe_layers(trainer: Any) -> list[Any]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in trainer.model.module.modules() if isinstance(m, MoELayer)]  # DDP unwrapped


def experts_called(trainer: Any, batch: Any) -> dict[str, list]:
    """What this rank's MoE layers did in a no-grad pass over ``batch`` (one padded micro-batch). Collective.

    ``dispatched``: per layer forward, (global layer number, the routing map [L * B, E] megatron's token
    dispatcher received); ``computed``: per layer forward, (layer number, this rank's expert ids, the
    tokens each computed after the all-to-all).
    """
    from miles.train.batching import pad_batch

    dispatched: list = []
    computed: list = []
    hooks = []
    layers = _moe_layers(trainer)
    for layer in layers:
        original = layer.token_dispatcher.dispatch_preprocess

        def preprocess(hidden: Any, routing_map: Any, probs: Any, layer: Any = layer, original: Any = original) -> Any:
            dispatched.append((layer.layer_number, routing_map.detach().cpu().clone()))
            return original(hidden, routing_map, probs)

        layer.token_dispatcher.dispatch_preprocess = preprocess
        hooks.append(layer.experts.register_forward_pre_hook(
            lambda _m, args, layer=layer: computed.append(
                (layer.layer_number, list(layer.local_expert_indices), args[1].tolist()))))
    try:
        micro = [pad_batch(batch, pad_id=trainer.pad_id).to(trainer.device)]
        trainer.engine.logps(trainer.model, micro, 1.0)
    finally:
        for layer in layers:
            del layer.token_dispatcher.dispatch_preprocess
        for h in hooks:
            h.remove()
    return {"dispatched": dispatched, "computed": computed}


def recomputed_routes(trainer: Any, batch: Any) -> dict[str, Any]:
    """``compute_gradients(batch)`` under megatron's activation recompute, and per MoE layer the routing map
    each router call handed to the dispatcher, in call order: ``forward`` (megatron runs a checkpointed layer's
    forward without grad) and ``recomputed`` (the same layer again, with grad, in the backward). Collective."""
    import torch

    calls: dict[int, dict[str, list]] = {}

    def record(router: Any, _args: Any, out: Any) -> None:
        kind = "recomputed" if torch.is_grad_enabled() else "forward"
        calls.setdefault(router.layer_number, {"forward": [], "recomputed": []})[kind].append(out[1].detach().clone())

    hooks = [layer.router.register_forward_hook(record) for layer in _moe_layers(trainer)]
    try:
        grads = trainer.compute_gradients(batch)
    finally:
        for h in hooks:
            h.remove()
    return {"grads": grads, "routes": calls}


cloudpickle.register_pickle_by_value(sys.modules[__name__])
