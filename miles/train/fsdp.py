"""FSDP2 trainer rank: one instance per data-parallel rank, wrapped in ``ray.remote`` by the driver.

The model is an HF causal LM loaded in fp32. ``fully_shard`` is applied to every decoder layer
(the classes in the model's ``_no_split_modules``) and then to the root, so each rank holds 1/W
of every parameter and of the AdamW state; weights are all-gathered per layer for compute. With
``precision.train_dtype=bfloat16`` the compute copies are bf16 and gradients are reduced in fp32;
master weights and optimizer state stay fp32 either way. Backend: gloo on CPU, NCCL on CUDA.

One ``train_step`` (every rank is called with the same full batch):

1. split the batch into ``algo.num_minibatches`` contiguous mini-batches, and each mini-batch into
   W contiguous rank shards (mini-batch first, so the updates do not depend on W);
2. ``old_logp``: with one mini-batch the current weights *are* the proximal policy, so
   ``logp.detach()`` (same numbers); otherwise a no-grad pass before the first update;
3. per mini-batch: forward, :func:`miles.train.objective.policy_objective` with the global token
   counts (one all-reduce), backward of ``W * loss`` (FSDP averages gradients over ranks; the
   objective is already this rank's share of a sum), grad-norm clip, AdamW step, unless the
   loss or the grad norm is not finite (then the step is skipped and counted).

Reference model (``algo.kl_coef > 0``): a second copy of the initial checkpoint, frozen, and
FSDP-sharded like the policy, so it costs 1/W of a model per rank instead of a whole one; its
forward all-gathers per layer inside ``train_step``, which every rank calls anyway.

Dropout is off (``model.eval()``): the trainer must compute the same log-probs as the engine and
as its own no-grad passes. Every method that runs the model is collective: all ranks must call it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from miles.algos.logprobs import entropy_from_logits, token_logprobs
from miles.config.build import build
from miles.config.schema import MilesConfig
from miles.config.validate import ConfigError
from miles.core.types import TrainBatch
from miles.train.batching import PaddedBatch, pad_batch, response_logits, unpad_response
from miles.train.objective import policy_objective


class FSDPTrainer:
    """One FSDP2 data-parallel rank (a plain class; the driver makes it a Ray actor)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        checkpoint_dir: str,
        run: MilesConfig,
        num_threads: int = 0,
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        if not run.algo.policy_loss.partial:
            raise ConfigError("algo.policy_loss._partial_: must be true (the trainer calls the loss per "
                              f"mini-batch), found false for '{run.algo.policy_loss.target}'")
        # clip_low/clip_high come from algo.*; setting them under policy_loss is refused by build()
        self.policy_loss_fn = build(run.algo.policy_loss, allow=run.plugins.allow, key="algo.policy_loss",
                                    clip_low=run.algo.clip_low, clip_high=run.algo.clip_high)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size))
        self.rank, self.world_size, self.run = rank, world_size, run
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=self.device)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.manual_seed(run.seed)

        mp = MixedPrecisionPolicy()  # compute in the parameters' dtype: fp32
        if run.precision.train_dtype == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def load_sharded() -> torch.nn.Module:
            model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).to(self.device)
            model.eval()
            layer_classes = set(getattr(model, "_no_split_modules", None) or [])
            layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
            if not layers:
                raise ValueError(f"FSDPTrainer: {type(model).__name__} names no decoder layer classes "
                                 "(_no_split_modules); cannot shard it per layer")
            for layer in layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            return model

        self.model = load_sharded()
        cfg = self.model.config
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
        self.pad_id = next(i for i in (cfg.pad_token_id, eos, 0) if i is not None)  # padding is masked anyway
        self.ref_model = None
        if run.algo.kl_coef > 0:
            self.ref_model = load_sharded()
            self.ref_model.requires_grad_(False)
        t = run.trainer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas,
                                           weight_decay=t.weight_decay)
        # linear warmup over the first optimizer steps: Adam's first updates are ~lr * sign(g) in every
        # coordinate, which on a noisy policy gradient undoes part of what the warm start taught
        warmup = max(1, t.lr_warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))

    # --- forward helpers -------------------------------------------------------------------------

    def _logits(self, model: torch.nn.Module, p: PaddedBatch) -> torch.Tensor:
        """Logits at the positions that predict each response token: [B, Tr, V]."""
        out = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids,
                    use_cache=False)
        return response_logits(out.logits, p.logit_index)

    def _logp(self, model: torch.nn.Module, p: PaddedBatch) -> torch.Tensor:
        return token_logprobs(self._logits(model, p), p.targets, temperature=self.run.rollout.temperature)

    def _all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t

    # --- public API --------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on ``batch`` (the full batch; every rank gets the same). Collective.

        Returns the same metrics dict on every rank (all-reduced; mini-batch values averaged).
        """
        start = time.perf_counter()
        algo, temp = self.run.algo, self.run.rollout.temperature
        num_mb, ws = algo.num_minibatches, self.world_size
        if len(batch) == 0 or len(batch) % (num_mb * ws):
            raise ValueError(f"train_step: {len(batch)} samples do not split evenly into "
                             f"algo.num_minibatches ({num_mb}) x world size ({ws})")
        mbs = [pad_batch(batch.shard(m, num_mb).shard(self.rank, ws), pad_id=self.pad_id).to(self.device)
               for m in range(num_mb)]
        counts = torch.tensor([[p.loss_mask.sum().item(), (p.loss_mask.sum(-1) > 0).sum().item()] for p in mbs],
                              dtype=torch.float64, device=self.device)
        counts = self._all_reduce(counts).float()  # [num_mb, 2]: global loss tokens, sequences

        with torch.no_grad():
            old_logps = [self._logp(self.model, p) for p in mbs] if num_mb > 1 else [None]
            ref_logps = [self._logp(self.ref_model, p) for p in mbs] if self.ref_model else [None] * num_mb

        lr_used = self.optimizer.param_groups[0]["lr"]  # of this step's first update
        sums: dict[str, torch.Tensor] = {}
        skipped, grad_norms = 0, []
        max_norm = self.run.trainer.max_grad_norm if self.run.trainer.max_grad_norm > 0 else math.inf
        for m, p in enumerate(mbs):
            logits = self._logits(self.model, p)
            logp = token_logprobs(logits, p.targets, temperature=temp)
            with torch.set_grad_enabled(algo.entropy_coef != 0):
                entropy = entropy_from_logits(logits, temperature=temp)
            old_logp = old_logps[m] if old_logps[m] is not None else logp.detach()
            loss, metrics = policy_objective(
                logp=logp, old_logp=old_logp, rollout_logp=p.rollout_logp, advantages=p.advantages,
                loss_mask=p.loss_mask, entropy=entropy, policy_loss_fn=self.policy_loss_fn, algo=algo,
                tis_clip=self.run.precision.tis_clip, mismatch_mode=self.run.precision.mismatch_mode,
                mismatch_level=self.run.precision.mismatch_level, ref_logp=ref_logps[m],
                global_tokens=counts[m, 0], global_seqs=counts[m, 1], norm_len=self.run.rollout.max_new_tokens,
            )
            (loss * ws).backward()  # FSDP divides the reduced gradient by ws; loss is a share of a sum
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            global_loss = self._all_reduce(loss.detach().clone())
            if torch.isfinite(global_loss) and torch.isfinite(grad_norm):
                self.optimizer.step()
                self.scheduler.step()
            else:
                skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm.detach().float())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float() / num_mb

        names = sorted(sums)
        reduced = self._all_reduce(torch.stack([sums[k] for k in names]))
        out = {k: float(v) for k, v in zip(names, reduced.tolist(), strict=True)}
        out["train/grad_norm"] = float(torch.stack(grad_norms).mean())
        out["train/nonfinite_skipped"] = float(skipped)
        out["train/lr"] = lr_used
        out["train/num_tokens"] = float(counts[:, 0].sum())
        elapsed = self._all_reduce(torch.tensor([time.perf_counter() - start], device=self.device),
                                   op=dist.ReduceOp.MAX)
        out["perf/train_tokens_per_s"] = out["train/num_tokens"] / max(float(elapsed), 1e-9)
        return out

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample response-token log-probs under the current weights, for the whole batch.

        Collective (the FSDP forward all-gathers weights): every rank must call it; each returns
        the same lists.
        """
        p = pad_batch(batch, pad_id=self.pad_id).to(self.device)
        return unpad_response(self._logp(self.model, p), p.response_lengths)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. Rank 0 gets the full fp32 CPU state dict with HF parameter names; others None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else None

    def publish_weights(self) -> list | None:
        """Collective. Rank 0 puts the full state dict in the Ray object store and returns ``[ref]``.

        The list keeps Ray from resolving the ref when it is returned; the driver passes the ref on
        to the engines' ``update_weights(state_dict, version)``. Other ranks return None.
        """
        sd = self.full_state_dict()
        if sd is None:
            return None
        import ray

        return [ray.put(sd)]

    def shutdown(self) -> None:
        """Barrier, then destroy the process group (gloo can abort at exit without the barrier)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
