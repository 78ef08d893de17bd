"""Megatron-core trainer rank: one instance per rank of a TP x PP x DP (x EP) group, a Ray actor of the driver.

The policy is megatron's ``GPTModel`` (:mod:`.model`) with the weights of the HF checkpoint (each rank
reads only its slices of the safetensors files, in fp32: :mod:`.load`, :mod:`.mapping`), wrapped in megatron's
``DistributedDataParallel`` (fp32 gradient buffers, one all-reduce per bucket after the last
micro-batch), trained by ``torch.optim.AdamW`` on ``p.grad = p.main_grad``. Process groups:
megatron's ``parallel_state`` over the rank's torch.distributed group (gloo on CPU, with the
:mod:`.compat` redirects; NCCL on CUDA, untested on a GPU).

One ``train_step`` computes what :class:`miles.train.fsdp.FSDPTrainer` computes on the same batch:

1. ``algo.num_minibatches`` contiguous mini-batches, each cut into DP contiguous shards (mini-batch
   first, so updates do not depend on the layout); the TP and PP ranks of a replica share its shard.
   Each shard becomes micro-batches of at most ``trainer.max_tokens_per_microbatch`` padded tokens
   (:mod:`miles.train.batching`; every replica runs the same count, the largest any needs, since
   expert-parallel all-to-alls span replicas). With ``trainer.skip_zero_advantage`` the samples without
   advantage stay out of them when they add nothing to the loss (as in FSDP, below);
2. forward and backward through ``get_forward_backward_func()`` (1F1B across pipeline stages; one
   stage: megatron's no-pipelining loop); on the last stage, log-probs and entropies of the
   temperature-scaled distribution from the vocab-parallel logits (:mod:`.logits`), then
   :func:`miles.train.objective.policy_objective` with the mini-batch's global token / sequence
   counts: the loss is this rank's share of a sum, so DDP sums gradients over replicas
   (``calculate_per_token_loss``) and ``finalize_model_grads`` adds the TP-split q/k-norm gradients
   and the tied-embedding gradients of the first and last stage;
3. the proximal log-probs (``num_minibatches > 1``) and the reference model's (``algo.kl_coef > 0``,
   a copy of the policy's initial shards) come from no-grad passes through the same schedule;
4. global grad norm and clipping (:mod:`.grads`), AdamW step and the schedule of
   :func:`miles.train.optim.lr_multiplier`, unless the loss or the norm is not finite (skipped and
   counted). Metrics (same names as FSDP's) are summed over replicas and read by every rank.

``trainer.activation_checkpointing``: megatron's full activation recompute, one layer per checkpoint
(:func:`.model.transformer_config`); each layer keeps its input and runs again in the backward, with the
same gradients (on CPU through :mod:`.compat`, which stands in for the CUDA generator megatron saves
around a recompute; on a GPU megatron's own CUDA path, untested on a GPU).

LoRA (``adapter=lora``, and ``tenants:``): adapters on megatron's parallel linears with peft's
parametrization of the HF model (:mod:`.lora`), the base frozen, AdamW on the adapters at
``adapter.lr``; ``train_step`` per adapter as the FSDP trainer's (:mod:`.tenants`); adapter-only weight
sync, PEFT export, state in the FSDP trainer's peft layout (:mod:`.lora_state`).

Precision and MoE options, as the FSDP trainer's: ``precision.train_dtype=bfloat16`` computes in bf16
under megatron's autocast with fp32 weights, gradients and AdamW state (on the CPU through
:mod:`.compat`; FSDP instead computes with bf16 copies of the weights, so the two agree to bf16
rounding, not bit for bit); ``precision.train_quant`` (``int4``, ``mxfp8``) runs every forward with
fake-quantized linear weights, gradients straight through, the same numbers as FSDP's (:mod:`.quant`);
on MoE models the routers measure the rollout's routes of a batch that carries them
(``moe/route_agreement``, ``moe/replayed_route_share``) and, with ``algo.routing_replay=rollout``,
send every token to the engine's experts in the policy and the reference model (:mod:`.replay`).

Together: with ``trainer.activation_checkpointing`` a recomputed layer computes what its forward computed,
in bf16 too (megatron recomputes outside the forward step's autocast; each layer enters it itself:
:func:`.model.autocast_recomputed_layers`), with its own micro-batch's routes under routing replay (set
again when that micro-batch's backward starts, :mod:`.replay`) and, under LoRA, with the frozen embedding's
output marked as needing a gradient, without which megatron's recompute passes none to the layers' adapters
(:mod:`.engine`). The gradients are those without recompute, bit for bit. LoRA adapters sit on the
QAT-wrapped base layers and are not quantized themselves (FSDP's order), compute in bf16 under the autocast,
and on MoE models adapt attention and ``lm_head`` only, with routes measured and replayed as without
adapters. The reference model is built as the policy is (QAT forward, routing replay) from the policy's
base weights.

Not supported (``check_config`` refuses them before Ray starts): ``trainer.shared_prompt_forward``,
``precision.true_on_policy``, MoE with TP > 1, ``precision.train_quant`` ``fp8_block`` / ``nvfp4``, and QAT at a TP size that cuts a
quantization block of a row-parallel layer (:mod:`.quant`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from miles.algos.microbatches import count_microbatches, split_microbatches
from miles.backends.reuse import Reusable
from miles.config.build import build
from miles.config.schema import MilesConfig, TargetConfig
from miles.config.validate import ConfigError
from miles.tracking.memory import actor_metrics, process_memory
from miles.tracking.profiler import Profiled
from miles.train.batching import pad_batch
from miles.train.megatron.arch import Arch
from miles.train.megatron.dims import check_dims
from miles.train.megatron.policy import MegatronPolicy, parallel_dims
from miles.train.megatron.quant import check_train_quant
from miles.train.megatron.replay import route_metrics
from miles.types import TrainBatch


class MegatronTrainer(MegatronPolicy, Reusable, Profiled):
    """One rank of the megatron trainer (a plain class; the driver makes it a Ray actor): the policy's
    passes (:class:`.policy.MegatronPolicy`) behind the trainer's API."""

    parallelisms: frozenset[str] = frozenset({"tensor", "pipeline", "expert"})
    """TP, PP (1F1B) and MoE EP; data parallel over the ranks left (:data:`miles.backends.contract.PARALLELISMS`)."""

    @staticmethod
    def check_config(run: MilesConfig) -> None:
        """Refuse what this backend cannot do, naming the key, before any actor starts."""
        t = run.trainer
        if t.shared_prompt_forward:
            raise ConfigError("trainer.shared_prompt_forward=true: the megatron trainer has no shared-prompt forward "
                              "(it needs a KV cache across passes); set trainer.shared_prompt_forward=false "
                              "(conf/trainer/megatron.yaml does)")
        if run.precision.true_on_policy:
            raise ConfigError("precision.true_on_policy=true: the megatron trainer's forward is not the engine's "
                              "(transformers) forward; use trainer=fsdp")
        node = TargetConfig(target=run.model.target, kwargs={"flavor": run.model.flavor, "path": run.model.path})
        spec = build(node, allow=run.plugins.allow, key="model._target_")
        try:
            arch = Arch.from_hf(spec.hf_config)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        dims = parallel_dims(t, run.placement.trainer_world_size)
        check_dims(dims, arch)
        check_train_quant(run.precision, arch, dims)
        if run.adapter.kind == "lora":
            from miles.train.megatron.lora_layout import check_lora

            try:
                check_lora(run.adapter.target_modules, arch, run.trainer.pipeline_parallel)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    # --- public API --------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on ``batch`` (the full batch; every rank gets the same). Collective.

        Returns the same metrics dict on every rank (summed over replicas; mini-batch values averaged).
        With LoRA: :func:`.tenants.train_step` (per adapter, ``tenant/<name>/...`` metrics with tenants).
        """
        if self.lora is not None:
            from miles.train.megatron import tenants

            return tenants.train_step(self, batch)
        start = time.perf_counter()
        num_mb = self.config.algo.num_minibatches
        self.engine.route_counts(self.model)  # count this step's passes only
        plans, counts, old, ref = self._prepare(batch, num_mb)
        lr_used = self.optimizer.param_groups[0]["lr"]  # of this step's first update
        sums: dict[str, torch.Tensor] = {}
        skipped, grad_norms = 0, []
        max_norm = self.config.trainer.max_grad_norm if self.config.trainer.max_grad_norm > 0 else math.inf
        for m, micro in enumerate(plans):
            self.engine.zero_grad(self.model)
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = self._backward(micro, counts[m], old[m], ref[m], sums, 1.0 / num_mb)
            grad_norm = self.engine.clip_grads(self.model, max_norm)
            global_loss = self.engine.last_stage_sum(loss_sum.reshape(1))
            if torch.isfinite(global_loss).all() and torch.isfinite(grad_norm):
                for p in self.params.values():
                    p.grad = p.main_grad
                self.optimizer.step()
                self.scheduler.step()
            else:
                skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm.detach().float())

        values = torch.stack([sums.get(k, torch.zeros(())) for k in self.metric_names]) if self.metric_names \
            else torch.zeros(0)
        reduced = self.engine.last_stage_sum(values)
        out = {k: float(v) for k, v in zip(self.metric_names, reduced.tolist(), strict=True)}
        out["train/grad_norm"] = float(torch.stack(grad_norms).mean())
        out["train/nonfinite_skipped"] = float(skipped)
        out["train/lr"] = lr_used
        out["train/trainable_param_frac"] = self.trainable_frac
        out["train/num_tokens"] = float(counts[:, 0].sum())
        out["train/skipped_samples"] = float(counts[:, 3].sum())
        out["train/num_microbatches"] = float(sum(len(micro) for micro in plans))
        routes = self.engine.route_counts(self.model)
        if routes is not None:  # MoE: how the routes of a batch that carries them were used (.replay)
            out |= route_metrics(routes)
        forward_tokens = float(sum(p.input_ids.numel() for micro in plans for p in micro))
        out["perf/train_forward_tokens"] = float(self.engine.dp_sum(torch.tensor([forward_tokens])))
        elapsed = self.engine.world_max(torch.tensor([time.perf_counter() - start]))
        out["perf/train_tokens_per_s"] = out["train/num_tokens"] / max(float(elapsed), 1e-9)
        return out | actor_metrics(f"trainer{self.rank}", process_memory())  # this rank's own: not reduced

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample response-token log-probs under the current weights, for the whole batch (every replica
        runs all of it). Collective; every rank returns the same lists."""
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
        budget = self.config.trainer.max_tokens_per_microbatch
        groups = split_microbatches(lengths, budget, count_microbatches(lengths, budget))
        micro = [pad_batch(batch.select(g), pad_id=self.pad_id).to(self.device) for g in groups]
        logps = self.engine.logps(self.model, micro, self._temperature)
        flat = torch.zeros(sum(len(r) for r in batch.response_ids))
        offsets = [0]
        for r in batch.response_ids:
            offsets.append(offsets[-1] + len(r))
        if logps[0] is not None:
            for g, lp in zip(groups, logps, strict=True):
                for row, i in enumerate(g):
                    flat[offsets[i] : offsets[i + 1]] = lp[row, : len(batch.response_ids[i])].cpu()
        flat = self.engine.from_last_stage(flat)
        return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(batch))]

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. Rank 0 gets the full fp32 CPU state dict with HF names (LoRA: the first adapter merged
        into the base, :func:`.lora_state.full_state_dict`); others None."""
        if self.lora is not None:
            from miles.train.megatron import lora_state

            return lora_state.full_state_dict(self)
        return self.engine.io.gather({k: p.detach() for k, p in self.params.items()})

    def send_weights(self, sender: Any, version: int) -> Any:
        """Collective. Rank 0 hands the full HF state dict to ``sender.send(state_dict, version)`` and returns
        what it returns (:mod:`miles.weights.sync`); other ranks return None. With LoRA adapters it sends their
        tensors only, as the FSDP trainer does (:func:`.lora_state.send_weights`)."""
        if self.lora is not None:
            from miles.train.megatron import lora_state

            return lora_state.send_weights(self, sender, version)
        sd = self.full_state_dict()
        return None if sd is None else sender.send(sd, version)

    def trainable_parameters(self) -> dict[str, int]:
        """``{"trainable": ..., "total": ...}`` parameter counts of the policy (full sizes)."""
        total = sum(int(torch.Size(self.hf_shapes[n]).numel()) for n in self.hf_param_names)
        if self.lora is None:
            return {"trainable": total, "total": total}
        return {"trainable": self.lora.numel(), "total": total + self.lora.numel()}

    def export_adapters(self, directory: str) -> list[str]:
        """Collective. Every LoRA adapter in PEFT format to ``directory/<name>``; rank 0 returns the paths,
        other ranks an empty list (:func:`.lora_state.export_adapters`)."""
        if self.lora is None:
            raise ValueError("export_adapters: this trainer trains no adapters (adapter=none)")
        from miles.train.megatron import lora_state

        return lora_state.export_adapters(self, directory)

    def compute_gradients(self, batch: TrainBatch) -> dict[str, torch.Tensor] | None:
        """Collective. The gradient of the objective on ``batch`` as one mini-batch, without an update.

        The same path as :meth:`train_step` (micro-batches, reductions over ranks; the proximal policy is
        the current one), no clipping, no step, gradients cleared afterwards. Rank 0 gets ``{HF parameter
        name: full fp32 CPU gradient}`` (as FSDP's ``named_parameters``), other ranks None. With LoRA: the
        adapters' gradients in peft's parameter names (:func:`.tenants.compute_gradients`).
        """
        if self.lora is not None:
            from miles.train.megatron import tenants

            return tenants.compute_gradients(self, batch)
        plans, counts, old, ref = self._prepare(batch, 1)
        self.engine.zero_grad(self.model)
        self._backward(plans[0], counts[0], old[0], ref[0], {}, 1.0)
        grads = self.engine.io.gather({k: p.main_grad for k, p in self.params.items()})
        self.engine.zero_grad(self.model)
        return None if grads is None else {k: grads[k] for k in self.hf_param_names}

    def save_state(self, directory: str) -> None:
        """Collective. Model, AdamW state and schedule in the layout of :mod:`miles.train.optim` (HF names; with
        LoRA the FSDP trainer's peft names and the adapters in PEFT format, :mod:`.lora_state`)."""
        from miles.train.megatron import lora_state, state

        (state if self.lora is None else lora_state).save_state(self, directory)

    def load_state(self, directory: str) -> None:
        """Collective. Restore what :meth:`save_state` (or FSDP's) wrote, at any layout."""
        from miles.train.megatron import lora_state, state

        (state if self.lora is None else lora_state).load_state(self, directory)

    def shutdown(self) -> None:
        """Barrier, megatron's model-parallel state destroyed, the process group destroyed."""
        if dist.is_initialized():
            dist.barrier()
        from megatron.core import parallel_state

        from miles.train.megatron import compat

        parallel_state.destroy_model_parallel()
        compat.reset()
        _clear_rotary_caches()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _end_job(self) -> None:  # parking (miles.backends.reuse): collective, like the constructor
        self.shutdown()


def _clear_rotary_caches() -> None:
    """Empty the ``functools.lru_cache`` on megatron's rotary embedding ``forward`` methods.

    The cache is keyed on ``self``, so it keeps every rotary module it has seen alive after its model is
    gone, and with it the module's context-parallel process group: the group's gloo threads (three per
    group) then outlive ``destroy_process_group``, one group more on each job a parked rank takes on.
    """
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core.models.common.embeddings") or module is None:
            continue
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == name:
                for attr in vars(cls).values():
                    if callable(getattr(attr, "cache_clear", None)):
                        attr.cache_clear()
