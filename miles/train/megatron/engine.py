"""The megatron side of a trainer rank: parallel groups, models, passes through the schedule, reductions.

:class:`Engine` owns everything that talks to megatron-core, so that
:class:`~miles.train.megatron.trainer.MegatronTrainer` reads like the FSDP trainer:

* ``parallel_state.initialize_model_parallel(TP, PP, expert_model_parallel_size=EP)`` over the rank's
  process group, megatron's RNG tracker seeded (dropout is off; the tracker only has to exist);
* :meth:`Engine.build`: this stage's ``GPTModel`` with the checkpoint's weights cut to this rank
  (:mod:`.collect`), in this order: the QAT forward on its linears (:mod:`.quant`), LoRA adapters on the
  frozen base (``adapt``: they see the quantized base's output, not quantized themselves), megatron's
  ``DistributedDataParallel`` when it trains, and on MoE models a :class:`~.replay.RouteReplay` on its
  routers (every model built so, the reference model too);
* :meth:`Engine.train_pass` / :meth:`Engine.logps`: micro-batches through
  ``get_forward_backward_func()`` (1F1B over stages), the objective or the log-probs computed on the
  last stage from vocab-parallel logits (:mod:`.logits`); gradients reduced by
  ``finalize_model_grads`` (DDP buckets over replicas, q/k-norm gradients over TP, tied embeddings
  over the first and last stage);
* the reductions the trainer needs, each over the group that holds distinct values.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from miles.config.schema import PrecisionConfig
from miles.train.batching import PaddedBatch
from miles.train.megatron.arch import Arch
from miles.train.megatron.collect import ShardedIO
from miles.train.megatron.dims import ParallelDims
from miles.train.megatron.grads import clip_, global_grad_norm
from miles.train.megatron.logits import vocab_parallel_logp_entropy
from miles.train.megatron.mapping import padded_vocab
from miles.train.megatron.model import (
    autocast_recomputed_layers,
    build_gpt_model,
    causal_mask,
    transformer_config,
)
from miles.train.megatron.quant import quantize_megatron_forward
from miles.train.megatron.replay import RouteReplay


def _output_requires_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    """Forward hook of a frozen embedding under recompute (as transformers' ``enable_input_require_grads``).

    megatron's recompute (``tensor_parallel.CheckpointFunction``, a reentrant autograd function) puts a
    checkpointed layer in the graph only when one of its inputs requires a gradient. After a frozen
    embedding none does (the first stage's hidden states; later stages receive theirs with a gradient): the
    layers' outputs would carry no graph, no layer would recompute, and the LoRA adapters inside them would
    get no gradient at all (only ``lm_head``'s). The embedding's output is marked as needing one.
    """
    if torch.is_grad_enabled():
        output.requires_grad_(True)


Objective = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(micro-batch index, logp [B, Tr], entropy [B, Tr]) -> loss share`` (called on the last stage)."""


class Engine:
    """Parallel groups, models and passes of one rank (see the module docstring)."""

    def __init__(self, arch: Arch, dims: ParallelDims, hf_shapes: Mapping[str, tuple[int, ...]], *, seed: int,
                 device: torch.device, bf16: bool = False, recompute: bool = False,
                 precision: PrecisionConfig | None = None, routing_replay: bool = False) -> None:
        if device.type == "cpu" and torch.cuda.is_available():
            raise ValueError("the megatron trainer on the CPU in a process that sees a CUDA device: megatron-core "
                             "allocates on the current CUDA device there. Use placement.device=cuda, or hide the "
                             "GPUs from the trainer (CUDA_VISIBLE_DEVICES=)")
        self.arch, self.dims, self.device, self.bf16, self.recompute = arch, dims, device, bf16, recompute
        self.precision, self.routing_replay = precision or PrecisionConfig(), routing_replay
        self.replays: dict[int, RouteReplay] = {}  # per model (the object passes get), MoE only
        logging.getLogger("megatron.core").setLevel(logging.WARNING)  # its INFO lists every bucket's parameters
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                     expert_model_parallel_size=dims.ep)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
        self.io = ShardedIO(arch, hf_shapes, device)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.is_last = ps.is_pipeline_last_stage()
        self.vocab_start = self.tp_rank * padded_vocab(arch, dims.tp) // dims.tp
        self._keep: torch.Tensor | None = None  # [B, Tr] positions whose logits the pass needs (None: all)
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()

    # --- models ------------------------------------------------------------------------------------

    def build(self, shards: Mapping[str, torch.Tensor], *, trainable: bool,
              adapt: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
        """This stage's model with the weights ``shards`` (``{local name: this rank's tensor}``, read one at a
        time: :class:`~.load.CheckpointShards`, or another model's parameters); DDP-wrapped when ``trainable``.
        ``adapt``: called with the frozen model after the QAT wrap and before DDP wraps it (LoRA adds its
        trainable adapters). The routes of passes through the returned model: :meth:`route_counts`."""
        config = transformer_config(self.arch, self.dims, bf16_autocast=self.bf16, recompute=self.recompute)
        model = build_gpt_model(self.arch, config, self.dims)
        autocast_recomputed_layers(model, config, self.device)  # bf16 + recompute: the recompute's autocast
        names = [n for n, _ in model.named_parameters()]
        self.io.check_names(names)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in names:
                t = shards[name]
                if params[name].shape != t.shape:
                    raise RuntimeError(f"megatron parameter {name}: shape {tuple(params[name].shape)}, the mapping "
                                       f"cut {tuple(t.shape)} from the checkpoint")
                params[name].copy_(t)
        model.to(self.device)
        model.eval()  # dropout is 0 anyway; the same mode as FSDP's model and the engines'
        if model.post_process:
            model.output_layer.register_forward_pre_hook(self._keep_positions, with_kwargs=True)
        # precision.train_quant: the base's linears compute with fake-quantized weights (their own parameters only)
        quantize_megatron_forward(model, self.io.entries, self.precision, bf16=self.bf16)
        if not trainable or adapt is not None:
            model.requires_grad_(False)
        if adapt is not None:  # after the QAT wrap, as FSDP's peft: the base layers compute quantized, adapters not
            adapt(model)
            if self.recompute and model.pre_process:
                model.embedding.register_forward_hook(_output_requires_grad)
        wrapped: torch.nn.Module = model
        if trainable:
            ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
            wrapped = DistributedDataParallel(config, ddp, model)
        if self.arch.is_moe:  # routes are measured whenever a batch carries them, replayed under routing replay
            self.replays[id(wrapped)] = RouteReplay(model, self.arch, replay=self.routing_replay)
        return wrapped

    def _keep_positions(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Forward pre-hook of the output layer: only the hidden states at ``self._keep`` ([S, B, H] ->
        [Tr, B, H]) reach the LM head, as FSDP's ``logits_to_keep`` (prompt positions need no logits)."""
        if self._keep is None:
            return None
        hidden = args[0]
        index = self._keep.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return (hidden.gather(0, index), *args[1:]), kwargs

    @staticmethod
    def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters by their local megatron names (DDP unwrapped)."""
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        return list(inner.named_parameters())

    @staticmethod
    def zero_grad(model: torch.nn.Module) -> None:
        model.zero_grad_buffer()

    # --- passes ------------------------------------------------------------------------------------

    def _run(self, model: torch.nn.Module, micro: list[PaddedBatch],
             on_logits: Callable[[int, torch.Tensor], torch.Tensor], *, forward_only: bool,
             responses_only: bool = True) -> None:
        """Every micro-batch through megatron's schedule; ``on_logits(j, logits)`` on the last stage returns
        the loss share to backpropagate. logits: [B, Tr, V/TP] at the positions that predict the response
        tokens (``logit_index``), or [B, L, V/TP] at every position without ``responses_only``."""
        replay = self.replays.get(id(model))

        def loss_func(j: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss = on_logits(j, logits)
            return loss, torch.tensor(int(micro[j].loss_mask.sum().item()), dtype=torch.int), {}

        def forward_step(data_iterator: object, model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
            j = next(data_iterator)  # type: ignore[call-overload]
            p = micro[j]
            self._keep = p.logit_index if responses_only else None
            if replay is not None:  # this micro-batch's routes, in its forward and its backward's recomputes
                replay.set_routes(p.routes)
            out = model(input_ids=p.input_ids, position_ids=p.position_ids,
                        attention_mask=causal_mask(p.input_ids.shape[1], self.device))
            if replay is not None:
                replay.hold(out, p.routes)
            return out, functools.partial(loss_func, j)

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(len(micro))), model=[model],
            num_microbatches=len(micro), seq_length=max(p.input_ids.shape[1] for p in micro),
            micro_batch_size=max(p.input_ids.shape[0] for p in micro), forward_only=forward_only)

    def _logp_entropy(self, logits: torch.Tensor, p: PaddedBatch, temperature: float, *, with_entropy: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and entropies [B, Tr] of the response tokens from this rank's vocabulary slice."""
        tp = self.dims.tp > 1

        def max_fn(x: torch.Tensor) -> torch.Tensor:
            return self._reduce(x, dist.ReduceOp.MAX, group=self._tp_group, size=self.dims.tp)

        def sum_fn(x: torch.Tensor) -> torch.Tensor:
            return reduce_from_tensor_model_parallel_region(x, group=self._tp_group) if tp else x

        return vocab_parallel_logp_entropy(
            logits, p.targets, vocab_start=self.vocab_start,
            vocab_size=self.arch.vocab_size, temperature=temperature, sum_fn=sum_fn, max_fn=max_fn,
            with_entropy=with_entropy)

    def train_pass(self, model: torch.nn.Module, micro: list[PaddedBatch], temperature: float,
                   objective: Objective) -> None:
        """Forward and backward of ``micro``; gradients accumulated in the DDP buffers, then reduced."""

        def on_logits(j: int, logits: torch.Tensor) -> torch.Tensor:
            logp, entropy = self._logp_entropy(logits, micro[j], temperature, with_entropy=True)
            return objective(j, logp, entropy)

        with self._recomputing(model):
            self._run(model, micro, on_logits, forward_only=False)
        finalize_model_grads([model])

    @contextlib.contextmanager
    def _recomputing(self, model: torch.nn.Module) -> Iterator[None]:
        """With ``recompute``: the decoder block in training mode while the pass runs. megatron's
        ``TransformerBlock`` recomputes layers only when ``self.training``; its layers stay in eval mode (as
        every module of these models does: dropout is 0, and the engines' forward is eval too)."""
        block = (model.module if isinstance(model, DistributedDataParallel) else model).decoder
        was = block.training
        block.training = self.recompute or was
        try:
            yield
        finally:
            block.training = was

    @torch.no_grad()
    def logps(self, model: torch.nn.Module, micro: list[PaddedBatch], temperature: float
              ) -> list[torch.Tensor | None]:
        """No-grad log-probs [B, Tr] of every micro-batch (on the last stage; None elsewhere). Collective."""
        out: list[torch.Tensor | None] = [None] * len(micro)

        def keep(j: int, logits: torch.Tensor) -> torch.Tensor:
            out[j] = self._logp_entropy(logits, micro[j], temperature, with_entropy=False)[0]
            return torch.zeros((), device=logits.device)

        self._run(model, micro, keep, forward_only=True)
        return out

    @torch.no_grad()
    def logits(self, model: torch.nn.Module, micro: list[PaddedBatch]) -> list[torch.Tensor | None]:
        """No-grad logits [B, L, V] over the whole vocabulary (TP slices gathered, padding dropped) on the
        last stage, None elsewhere. Collective; for checks against transformers' logits."""
        out: list[torch.Tensor | None] = [None] * len(micro)

        def keep(j: int, logits: torch.Tensor) -> torch.Tensor:
            if self.dims.tp > 1:
                parts = [torch.empty_like(logits) for _ in range(self.dims.tp)]
                dist.all_gather(parts, logits.contiguous(), group=self._tp_group)
                logits = torch.cat(parts, dim=-1)
            out[j] = logits[..., : self.arch.vocab_size]
            return torch.zeros((), device=logits.device)

        self._run(model, micro, keep, forward_only=True, responses_only=False)
        return out

    def route_counts(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The routing-replay counts of ``model`` since the last call, summed over every rank (None: no MoE).
        Collective (:mod:`.replay`)."""
        replay = self.replays.get(id(model))
        return None if replay is None else self.world_sum(replay.take_counts())

    # --- gradients ---------------------------------------------------------------------------------

    def clip_grads(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (:mod:`.grads`), then every gradient clipped to ``max_norm``."""
        params = dict(self.named_parameters(model))
        counted = []
        for e in self.io.entries:
            if e.tied_copy or (not e.tp_split and self.tp_rank != 0):
                continue
            if (self.edp_rank if e.expert else self.dp_rank) == 0:
                counted.append(params[e.local].main_grad)
        norm = global_grad_norm(counted, self.world_sum)
        clip_([p.main_grad for p in params.values()], norm, max_norm)
        return norm

    # --- reductions --------------------------------------------------------------------------------

    def _reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: object = None,
                size: int | None = None) -> torch.Tensor:
        """All-reduce a copy of ``t`` on the communication device; returns it where ``t`` was."""
        if (dist.get_world_size() if size is None else size) == 1:
            return t
        x = t.to(self.device, copy=True)
        dist.all_reduce(x, op=op, group=group)
        return x.to(t.device)

    def world_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t)

    def world_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel replicas (values the ranks of a replica share)."""
        return self._reduce(t, group=self._dp_group, size=self.dims.dp)

    def dp_max(self, n: int) -> int:
        return int(self._reduce(torch.tensor([n]), dist.ReduceOp.MAX, group=self._dp_group, size=self.dims.dp))

    def last_stage_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over replicas of a value the last stage computed (every TP rank holds it); on every rank."""
        mine = t.detach().float().cpu().clone() if self.is_last and self.tp_rank == 0 else torch.zeros_like(t).float()
        return self.world_sum(mine)

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """Replica 0's last-stage value of ``t`` on every rank."""
        mine = t.clone() if self.is_last and self.tp_rank == 0 and self.dp_rank == 0 else torch.zeros_like(t)
        return self.world_sum(mine)
