"""One rank's policy on megatron: the model built from the checkpoint, its optimizer, and its passes.

:class:`MegatronPolicy` holds what every part of the megatron trainer works on (the model and its reference
copy, the LoRA adapters, AdamW and its schedule) and the passes a train step is made of: micro-batches,
no-grad log-probs, the forward and backward of a mini-batch. :class:`.trainer.MegatronTrainer` is the
actor's API on top of it; :mod:`.state`, :mod:`.tenants` and :mod:`.lora_state` work on a policy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from miles.algos.microbatches import count_microbatches, split_microbatches
from miles.config.build import build
from miles.config.rank import RankConfig
from miles.config.schema import TrainerConfig
from miles.train.batching import PaddedBatch, pad_batch, rows_with_gradient, step_counts, topped_up
from miles.train.megatron.arch import Arch
from miles.train.megatron.dims import ParallelDims, check_dims
from miles.train.objective import mismatch_settings, policy_objective, skips_zero_advantage
from miles.train.optim import lr_scheduler
from miles.train.rank import init_device_and_group, pad_token_id
from miles.types import TrainBatch

log = logging.getLogger(__name__)


def parallel_dims(t: TrainerConfig, world_size: int) -> ParallelDims:
    return ParallelDims(world_size=world_size, tp=t.tensor_parallel, pp=t.pipeline_parallel, ep=t.expert_parallel)


def _import_megatron() -> tuple[Any, Any]:
    """The modules that import megatron-core (:mod:`.engine`, :mod:`.compat`), without its warnings that
    Apex and Transformer Engine are missing (this backend uses megatron's local layers on purpose)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
        from miles.train.megatron import compat, engine
    return engine, compat


class MegatronPolicy:
    """One rank's model, optimizer and passes (module docstring); built collectively by every rank."""

    same_forward_as_engine: bool = False
    """megatron's model is not the engines' (transformers'): in bf16 their kernels round apart, which mismatch
    correction counts as other numerics (:func:`miles.precision.recipe.numerics_differ`; the driver logs it)."""

    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int, checkpoint_dir: str,
                 config: RankConfig, num_threads: int = 0, device: str = "cpu",
                 adapter_names: tuple[str, ...] = ("default",)) -> None:
        from miles.train.megatron import load

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        t, p, algo = config.trainer, config.precision, config.algo
        self.rank, self.world_size, self.config = rank, world_size, config
        self.mismatch = mismatch_settings(config, same_forward=self.same_forward_as_engine)
        self.policy_loss_fn = build(algo.policy_loss, allow=config.allow, key="algo.policy_loss",
                                    clip_low=algo.clip_low, clip_high=algo.clip_high)
        self.skip_zero_advantage = skips_zero_advantage(config, self.policy_loss_fn)
        self.device = init_device_and_group(rank=rank, world_size=world_size, master_addr=master_addr,
                                            master_port=master_port, device=device)
        engine, compat = _import_megatron()
        if self.device.type == "cpu":
            compat.install()
        torch.manual_seed(config.seed)
        hf_config = load.read_config(checkpoint_dir)
        self.arch = Arch.from_hf(hf_config)
        self.dims = parallel_dims(t, world_size)
        check_dims(self.dims, self.arch)
        self.pad_id = pad_token_id(hf_config)
        self.hf_shapes, self.hf_param_names = load.hf_layout(hf_config)
        self.engine = engine.Engine(self.arch, self.dims, self.hf_shapes, seed=config.seed, device=self.device,
                                    bf16=p.train_dtype == "bfloat16", recompute=t.activation_checkpointing,
                                    precision=p, routing_replay=algo.routing_replay == "rollout")
        # adapter=lora: the base frozen, one LoRA adapter per name trains (the reference model is the base alone)
        self.lora = None
        if config.adapter.kind == "lora":
            from miles.train.megatron.lora import MegatronLora

            self.lora = MegatronLora(self.arch, config.adapter, adapter_names, hf_config, seed=config.seed,
                                     device=self.device)
        with load.SafetensorsReader(checkpoint_dir) as reader:  # this rank's slices only (:mod:`.load`)
            self.model = self.engine.build(load.CheckpointShards.of(reader, self.engine.io), trainable=True,
                                           adapt=self.lora.attach if self.lora else None)
            self.checkpoint_reads = dict(reader.read_elements)  # {stored tensor: elements this rank read}
        self.params = {k: p for k, p in self.engine.named_parameters(self.model) if ".lora." not in k}
        """The base model's parameters by local name (what the mapping gathers and shards)."""
        # the reference policy starts as a copy of the policy's base weights (built as the policy: QAT, replay)
        self.ref_model = self.engine.build(dict(self.params), trainable=False) if algo.kl_coef > 0 else None
        base_numel = sum(int(torch.Size(self.hf_shapes[n]).numel()) for n in self.hf_param_names)
        self.trainable_frac = 1.0
        if self.lora is not None:
            self.optimizer = torch.optim.AdamW(self.lora.param_groups(), lr=config.adapter.lr or t.lr,
                                               betas=t.betas, weight_decay=t.weight_decay)
            self.trainable_frac = self.lora.numel() / (self.lora.numel() + base_numel)
        else:
            self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=t.lr, betas=t.betas,
                                               weight_decay=t.weight_decay)
        self.scheduler = lr_scheduler(self.optimizer, config)
        self.metric_names = self._metric_names()
        if rank == 0:
            log.info("megatron trainer: %s over %d rank(s), %s; compute %s%s%s%s", self.dims.describe(), world_size,
                     "MoE " + f"{self.arch.num_experts} experts top-{self.arch.moe_top_k}" if self.arch.is_moe
                     else "dense", "bf16 (autocast over fp32 weights)" if p.train_dtype == "bfloat16" else "fp32",
                     f", {p.train_quant} weights (QAT)" if p.train_quant != "none" else "",
                     ", replaying the rollout's routes" if algo.routing_replay == "rollout" else "",
                     ", activations recomputed in the backward" if t.activation_checkpointing else "")
            if self.lora is not None:
                log.info("megatron trainer: LoRA adapters %s train %d of %d parameters (%.2f%%)",
                         list(self.lora.names), self.lora.numel(), self.lora.numel() + base_numel,
                         100 * self.trainable_frac)

    # --- batches -----------------------------------------------------------------------------------

    def _metric_names(self) -> list[str]:
        """The metric names :func:`policy_objective` returns for this run (from a one-token call)."""
        one = torch.zeros(1, 1)
        _, metrics = self._objective(one, one, one, torch.zeros(1), torch.ones(1, 1), one,
                                     one if self.ref_model is not None else None, torch.ones(4))
        return sorted(metrics)

    def _objective(self, logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                   advantages: torch.Tensor, loss_mask: torch.Tensor, entropy: torch.Tensor,
                   ref_logp: torch.Tensor | None, counts: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return policy_objective(
            logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, advantages=advantages, loss_mask=loss_mask,
            entropy=entropy, policy_loss_fn=self.policy_loss_fn, algo=self.config.algo, **self.mismatch,
            ref_logp=ref_logp, global_tokens=counts[0], global_seqs=counts[1],
            norm_len=self.config.max_new_tokens, metric_tokens=counts[2])

    def _micro(self, shard: TrainBatch, skip: bool = False) -> list[PaddedBatch]:
        """A replica's share as padded micro-batches; every replica runs the same count. ``skip``: leave out
        the samples with no advantage (:func:`~miles.train.batching.rows_with_gradient`), topped up to
        that count. Collective."""
        budget = self.config.trainer.max_tokens_per_microbatch
        rows = rows_with_gradient(shard) if skip else list(range(len(shard)))

        def lengths_of(r: list[int]) -> list[int]:
            return [len(shard.prompt_ids[i]) + len(shard.response_ids[i]) for i in r]

        need = self.engine.dp_max(count_microbatches(lengths_of(rows), budget))
        rows = topped_up(shard, rows, need)
        part = shard.select(rows)
        return [pad_batch(part.select(g), pad_id=self.pad_id).to(self.device)
                for g in split_microbatches(lengths_of(rows), budget, need)]

    def _prepare(self, batch: TrainBatch, num_mb: int) -> tuple[list[list[PaddedBatch]], torch.Tensor, list, list]:
        """Micro-batches per mini-batch, global counts [num_mb, 4] (loss tokens, sequences, loss tokens
        computed, samples skipped), and the no-grad log-probs (old, ref) indexed ``[mini-batch][micro-batch]``
        (None where not needed). Collective."""
        dp, dp_rank = self.dims.dp, self.engine.dp_rank
        if len(batch) == 0 or len(batch) % (num_mb * dp):
            raise ValueError(f"train_step: {len(batch)} samples do not split evenly into algo.num_minibatches "
                             f"({num_mb}) x data-parallel size ({dp} = {self.dims.describe()})")
        shards = [batch.shard(m, num_mb).shard(dp_rank, dp) for m in range(num_mb)]
        plans = [self._micro(s, skip=self.skip_zero_advantage) for s in shards]
        counts = torch.tensor([step_counts(s, micro) for s, micro in zip(shards, plans, strict=True)],
                              dtype=torch.float64)
        counts = self.engine.dp_sum(counts).float()
        none = [[None] * len(micro) for micro in plans]
        old = [self.engine.logps(self.model, micro, self._temperature) for micro in plans] if num_mb > 1 else none
        ref = ([self.engine.logps(self.ref_model, micro, self._temperature) for micro in plans]
               if self.ref_model is not None else none)
        return plans, counts, old, ref

    @property
    def _temperature(self) -> float:
        return self.config.temperature

    def _backward(self, micro: list[PaddedBatch], counts: torch.Tensor, old: list, ref: list,
                  sums: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
        """Forward + backward of one mini-batch, gradients accumulated and reduced; returns this rank's loss
        share (0 off the last stage). Metrics are added to ``sums`` times ``weight`` (last stage)."""
        loss_sum = torch.zeros(())
        entropy_grad = self.config.algo.entropy_coef != 0

        def objective(j: int, logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            nonlocal loss_sum
            p = micro[j]
            if not entropy_grad:
                entropy = entropy.detach()
            loss, metrics = self._objective(logp, logp.detach() if old[j] is None else old[j], p.rollout_logp,
                                            p.advantages, p.loss_mask, entropy, ref[j], counts)
            loss_sum = loss_sum + loss.detach().cpu()
            for k, v in metrics.items():  # shares of the mini-batch value: they add up over micro-batches
                sums[k] = sums.get(k, 0.0) + v.detach().float().cpu() * weight
            return loss

        self.engine.train_pass(self.model, micro, self._temperature, objective)
        return loss_sum
