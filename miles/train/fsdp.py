"""FSDP2 trainer rank: one instance per data-parallel rank, wrapped in ``ray.remote`` by the driver.

The model is an HF causal LM loaded in fp32. ``fully_shard`` is applied to every decoder layer
(the classes in the model's ``_no_split_modules``) and then to the root, so each rank holds 1/W
of every parameter and of the AdamW state; weights are all-gathered per layer for compute. With
``precision.train_dtype=bfloat16`` the compute copies are bf16 and gradients are reduced in fp32;
master weights and optimizer state stay fp32 either way. Backend: gloo on CPU, NCCL on CUDA.
A single fp32 rank skips ``fully_shard`` (sharding over one rank is the identity; FSDP2 there cost
~19% of a tiny model's CPU step in copies and DTensor dispatch, ``python -m miles.bench train``).

One ``train_step`` (every rank is called with the same full batch):

1. split the batch into ``algo.num_minibatches`` contiguous mini-batches, and each mini-batch into
   W contiguous rank shards (mini-batch first, so the updates do not depend on W); each rank shard
   into micro-batches of at most ``trainer.max_tokens_per_microbatch`` padded tokens (sorted by
   length, padded per micro-batch; every rank runs the same number, the largest any rank needs).
   With ``trainer.shared_prompt_forward`` (when it saves tokens on every rank) the distinct prompts
   of a rank's mini-batch are computed once and the micro-batches hold the responses alone, cut by
   response length (:mod:`miles.train.shared_prompt`). With ``trainer.skip_zero_advantage`` (a loss
   that vanishes at zero advantage, no KL and no entropy term) samples with advantage 0 on every token
   stay out of the micro-batches (a rank keeps one at least, and tops up to the count every rank runs);
   the loss still counts their tokens, so the update is the whole batch's;
2. ``old_logp``: with one mini-batch the current weights *are* the proximal policy, so
   ``logp.detach()`` (same numbers); otherwise a no-grad pass before the first update;
3. per mini-batch: the prompt pass if shared, per micro-batch forward,
   :func:`miles.train.objective.policy_objective` with the
   mini-batch's global token counts (one all-reduce), backward of ``W * loss`` (FSDP averages
   gradients over ranks; the objective is already this micro-batch's share of a sum), gradients
   accumulated (reduced once, after the last micro-batch); then grad-norm clip, AdamW step, unless
   the loss or the grad norm is not finite (then the step is skipped and counted). The learning
   rate follows :func:`miles.train.optim.lr_multiplier` (warmup, then constant / linear / cosine).

``trainer.activation_checkpointing`` wraps each decoder layer's forward in non-reentrant
``torch.utils.checkpoint`` before ``fully_shard`` (HF's own switch is a no-op in eval mode): the
backward recomputes the layer inside FSDP's unsharded window, with identical gradients.

``save_state`` / ``load_state`` write and read the model, AdamW state and scheduler counters as
safetensors + JSON, or with more than one rank as each rank's own DCP shard (:mod:`miles.train.optim`,
:mod:`miles.train.shards`); a loaded trainer continues exactly where the saved one stopped, at any world size.

Reference model (``algo.kl_coef > 0``): a second copy of the initial checkpoint, frozen, and
FSDP-sharded like the policy, so it costs 1/W of a model per rank instead of a whole one; its
forward all-gathers per layer inside ``train_step``, which every rank calls anyway.

Precision and MoE options: ``precision.train_quant`` makes every forward compute with fake-quantized
weights, gradients straight through (:func:`miles.precision.recipe.quantize_train_forward`); the
mismatch-correction threshold is :func:`miles.precision.recipe.effective_tis_clip`. On MoE models the
routers carry :class:`miles.train.routing_replay.RouteReplay` hooks: a batch with rollout routes
reports ``moe/route_agreement`` (the router's own top-k against the engine's) and
``moe/replayed_route_share`` (the experts actually used against the engine's), and ``algo.routing_replay=rollout`` replays the routes (policy and
reference model). ``precision.true_on_policy`` runs each sequence alone at the engine's fixed length
(:mod:`miles.precision.on_policy`). Replay, true on-policy and batches with routes run without the
shared-prompt forward.

Dropout is off (``model.eval()``): the trainer must compute the same log-probs as the engine and
as its own no-grad passes. Every method that runs the model is collective: all ranks must call it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from miles.adapters import lora
from miles.algos.logprobs import token_logprobs
from miles.algos.microbatches import count_microbatches, split_microbatches
from miles.config.build import build
from miles.config.rank import RankConfig
from miles.precision.on_policy import sequence_logits
from miles.precision.recipe import quantize_train_forward
from miles.tracking.memory import actor_metrics, process_memory
from miles.train.batching import (
    PaddedBatch,
    pad_batch,
    response_logits,
    rows_with_gradient,
    step_counts,
    topped_up,
    unpad_response,
)
from miles.train.objective import mismatch_settings, policy_objective, skips_zero_advantage
from miles.train.optim import lr_scheduler
from miles.train.rank import FSDPRank, pad_token_id
from miles.train.routing_replay import RouteReplay, find_routers
from miles.train.shared_prompt import (
    PromptPass,
    cache_keyword,
    distinct_prompts,
    prompt_pass,
    response_logits_after,
    worth_sharing,
)
from miles.types import TrainBatch

log = logging.getLogger(__name__)


@dataclass
class _Plan:
    """One rank's share of a mini-batch as forward passes: micro-batches and, when the prompts are
    shared, the distinct prompts and each micro-batch's rows' index into them."""

    micro: list[PaddedBatch]
    prompts: list[list[int]] | None = None
    prompt_of: list[torch.Tensor] | None = None

    def forward_tokens(self) -> int:
        """Token positions the forward passes compute, padding included (the prompt pass once)."""
        if self.prompts is None:
            return sum(p.input_ids.numel() for p in self.micro)
        prompt = len(self.prompts) * max(len(x) for x in self.prompts)
        return prompt + sum(p.targets.shape[0] * max(1, p.targets.shape[1] - 1) for p in self.micro)


def checkpoint_activations(layer: torch.nn.Module) -> None:
    """Make ``layer`` recompute its activations in the backward pass (non-reentrant checkpoint).

    Wraps the instance's ``forward``, so module hooks (FSDP's unshard/reshard) stay outside the
    checkpointed region, as with torch's ``checkpoint_wrapper`` but keeping parameter names.
    """
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed


class FSDPTrainer(FSDPRank):
    """One FSDP2 data-parallel rank (a plain class; the driver makes it a Ray actor)."""

    parallelisms: frozenset[str] = frozenset()
    """Data parallel over the ranks only (:data:`miles.backends.contract.PARALLELISMS`)."""

    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int, checkpoint_dir: str,
                 config: RankConfig, num_threads: int = 0, device: str = "cpu",
                 adapter_names: tuple[str, ...] = ("default",)) -> None:
        from miles.models.vision import is_vision_config, load_model

        t = config.trainer  # ranges and combinations were checked by miles.config.validate
        # clip_low/clip_high come from algo.*; setting them under policy_loss is refused by build()
        self.policy_loss_fn = build(config.algo.policy_loss, allow=config.allow, key="algo.policy_loss",
                                    clip_low=config.algo.clip_low, clip_high=config.algo.clip_high)
        self.skip_zero_advantage = skips_zero_advantage(config, self.policy_loss_fn)
        self._init_rank(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                        config=config, num_threads=num_threads, device=device)
        # one fp32 rank: sharding is the identity, and FSDP would only add copies and DTensor dispatch
        # (~20% of a tiny model's step on CPU); bf16 keeps FSDP for its mixed-precision policy
        self.sharded = world_size > 1 or config.precision.train_dtype != "float32"
        if not self.sharded and rank == 0:
            log.info("trainer: one fp32 rank, so fully_shard is skipped (sharding over one rank is the identity)")

        # adapter=lora: the policy is the frozen checkpoint plus peft LoRA adapters (one per name), and only
        # the adapters train; the reference model is the checkpoint alone, which is what the policy starts as
        self.adapter_names: tuple[str, ...] = adapter_names if config.adapter.kind == "lora" else ()

        def load_sharded(trainable: bool) -> torch.nn.Module:
            model = load_model(checkpoint_dir, torch.float32).to(self.device)
            model.eval()
            if config.freeze_vision and is_vision_config(model.config):
                model.model.visual.requires_grad_(False)
            quantize_train_forward(model, config.precision)  # precision.train_quant: QAT through an STE
            if trainable and self.adapter_names:  # after the QAT wrap: the base layers serve quantized, adapters not
                torch.manual_seed(config.seed)  # the same adapter init on every rank
                model = lora.add_adapters(model, config.adapter, self.adapter_names, trainable=True)
            checkpointed = checkpoint_activations if trainable and t.activation_checkpointing else None
            return self._shard(model, set(getattr(model, "_no_split_modules", None) or []),
                               sharded=self.sharded, per_layer=checkpointed)

        self.model = load_sharded(trainable=True)
        self.pad_id = pad_token_id(self.model.config)
        mcfg = self.model.config
        # a vision-language model: batches with images get their pixels and mRoPE positions (pad_batch)
        self.vision = ((int(mcfg.image_token_id), int(mcfg.vision_config.spatial_merge_size))
                       if is_vision_config(mcfg) else None)
        self.ref_model = None
        if config.algo.kl_coef > 0:
            self.ref_model = load_sharded(trainable=False)
            self.ref_model.requires_grad_(False)
        # MoE: measure route agreement with the rollout's routes when a batch carries them; replay them
        # with algo.routing_replay=rollout (the reference model replays too: same experts, same tokens)
        replay = config.algo.routing_replay == "rollout"
        self.replays = {id(m): RouteReplay(m, replay=replay) for m in (self.model, self.ref_model)
                        if m is not None and find_routers(m)}
        hf_model = self.model.get_base_model() if self.adapter_names else self.model  # peft passes kwargs through
        self.keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
        # the n responses of a prompt attend to one copy of it (recomputed layers would re-append to the cache);
        # replayed routes are per position of the whole sequence, so replay runs unshared passes
        share = (t.shared_prompt_forward and self.keeps_logits and not t.activation_checkpointing
                 and not replay and not config.precision.true_on_policy)
        self.cache_kw = cache_keyword(hf_model) if share else None
        # foreach: one multi-tensor kernel per update instead of a DTensor dispatch per parameter (3x
        # faster on a sharded tiny model); plain tensors on CPU keep torch's default
        # (adapter=lora: the adapters' parameters only, at adapter.lr; the frozen base has no optimizer state)
        self.tenant_params = {n: list(lora.adapter_parameters(self.model, n).values()) for n in self.adapter_names}
        params: Any = ([{"params": ps} for ps in self.tenant_params.values()] if self.adapter_names
                       else self.model.parameters())
        lr = config.adapter.lr if self.adapter_names and config.adapter.lr is not None else t.lr
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=t.betas,
                                           weight_decay=t.weight_decay, foreach=True if self.sharded else None)
        trainable, total = lora.trainable_share(self.model)
        self.trainable_frac = trainable / total
        if self.adapter_names and rank == 0:
            log.info("trainer: LoRA adapters %s train %d of %d parameters (%.2f%%)", list(self.adapter_names),
                     trainable, total, 100 * trainable / total)
        # linear warmup over the first optimizer steps: Adam's first updates are ~lr * sign(g) in every
        # coordinate, which on a noisy policy gradient undoes part of what the warm start taught
        self.scheduler = lr_scheduler(self.optimizer, config)

    # --- forward helpers -------------------------------------------------------------------------

    def _logits(self, model: torch.nn.Module, p: PaddedBatch, prompts: PromptPass | None = None,
                prompt_of: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at the positions that predict each response token: [B, Tr, V].

        Only the positions from the earliest predicting one on reach the LM head (``logits_to_keep``):
        prompt positions need no logits. With ``prompts`` (the mini-batch's prompt pass) the rows'
        prompts are read from it (``prompt_of``: [B] index into it) and only the responses run.
        """
        replay = self.replays.get(id(model))
        if replay is not None:  # stays set through this pass's backward (recomputed layers replay the same)
            replay.set_routes(p.routes if prompts is None else None)
        if prompts is not None:
            assert self.cache_kw is not None and prompt_of is not None
            return response_logits_after(model, prompts, p, prompt_of, self.cache_kw)
        if self.config.precision.true_on_policy:  # each sequence alone at the engine's fixed length
            width, max_new = p.targets.shape[1], self.config.max_new_tokens
            return torch.stack([
                sequence_logits(model, p.input_ids[i, : n_p + n_r], n_p, max_new, self.pad_id, width)
                for i, (n_p, n_r) in enumerate(zip(p.prompt_lengths.tolist(), p.response_lengths, strict=True))])
        first = int(p.logit_index[:, 0].min()) if self.keeps_logits else 0
        kwargs = {"logits_to_keep": p.input_ids.shape[1] - first} if first > 0 else {}
        if p.pixel_values is not None:
            kwargs.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        out = model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids,
                    use_cache=False, **kwargs)
        return response_logits(out.logits, (p.logit_index - first).clamp(min=0))

    def _logp(self, model: torch.nn.Module, p: PaddedBatch, prompts: PromptPass | None = None,
              prompt_of: torch.Tensor | None = None) -> torch.Tensor:
        return token_logprobs(self._logits(model, p, prompts, prompt_of), p.targets,
                              temperature=self.config.temperature)

    def _prompt_pass(self, model: torch.nn.Module, plan: _Plan) -> PromptPass | None:
        if plan.prompts is None:
            return None
        assert self.cache_kw is not None
        return prompt_pass(model, plan.prompts, self.pad_id, self.cache_kw, device=self.device)

    @torch.no_grad()
    def _plan_logps(self, model: torch.nn.Module, plan: _Plan) -> list[torch.Tensor]:
        """No-grad log-probs [B, Tr] of every micro-batch of ``plan`` under ``model``. Collective."""
        prompts = self._prompt_pass(model, plan)
        return [self._logp(model, p, prompts, plan.prompt_of[j] if plan.prompt_of else None)
                for j, p in enumerate(plan.micro)]

    def _logp_and_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token log-probs and entropies [B, Tr] from one log-softmax of logits [B, Tr, V].

        The same operations as :func:`~miles.algos.logprobs.token_logprobs` and
        :func:`~miles.algos.logprobs.entropy_from_logits`, sharing the log-softmax. The entropy has
        a gradient only when ``algo.entropy_coef != 0``.
        """
        z = logits.float()
        if self.config.temperature != 1.0:
            z = z / self.config.temperature
        logp_all = torch.log_softmax(z, dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(self.config.algo.entropy_coef != 0 and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def _plans(self, shards: list[TrainBatch], skip: bool = False) -> list[tuple[list[list[int]], _Plan]]:
        """Each shard's sample indices per micro-batch and its :class:`_Plan`; all ranks get the same
        micro-batch counts and the same sharing decision (the passes are collective). ``skip``: leave
        out the samples with no advantage (:func:`~miles.train.batching.rows_with_gradient`), topped up
        to the micro-batch count every rank runs. Collective."""
        budget = self.config.trainer.max_tokens_per_microbatch
        full = shards
        rows = [rows_with_gradient(s) if skip else list(range(len(s))) for s in full]
        shards = [s.select(r) for s, r in zip(full, rows, strict=True)] if skip else full
        # a batch carrying rollout routes runs whole sequences (routes are per position of prompt + response)
        share = self.cache_kw is not None and all(
            s.routing is None and s.images is None and worth_sharing(s.prompt_ids, [len(r) for r in s.response_ids]) for s in shards)
        share = bool(self._all_reduce(torch.tensor([int(share)], device=self.device), op=dist.ReduceOp.MIN))

        def lengths_of(s: TrainBatch) -> list[int]:  # the tokens each row puts through its pass
            return [len(r) if share else len(p) + len(r) for p, r in zip(s.prompt_ids, s.response_ids, strict=True)]

        lengths = [lengths_of(s) for s in shards]
        need = self._all_reduce(torch.tensor([count_microbatches(n, budget) for n in lengths], device=self.device),
                                op=dist.ReduceOp.MAX).tolist()
        if skip and any(len(r) < k for r, k in zip(rows, need, strict=True)):
            rows = [topped_up(f, r, k) for f, r, k in zip(full, rows, need, strict=True)]
            shards = [f.select(r) for f, r in zip(full, rows, strict=True)]
            lengths = [lengths_of(s) for s in shards]
        out = []
        for s, r, n, k in zip(shards, rows, lengths, need, strict=True):
            groups = split_microbatches(n, budget, k)
            plan = _Plan(micro=[pad_batch(s.select(g), pad_id=self.pad_id, vision=self.vision).to(self.device)
                                for g in groups])
            if share:
                plan.prompts, of = distinct_prompts(s.prompt_ids)
                plan.prompt_of = [torch.tensor([of[i] for i in g], device=self.device) for g in groups]
            out.append(([[r[i] for i in g] for g in groups], plan))
        return out

    def _sync_gradients(self, sync: bool) -> None:
        """Reduce gradients in this backward (the last micro-batch) or only accumulate them locally."""
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)

    # --- public API --------------------------------------------------------------------------------

    def _prepare(self, batch: TrainBatch, num_mb: int) -> tuple[list[_Plan], torch.Tensor, list, list]:
        """This rank's plan per mini-batch, global counts, and the no-grad log-probs. Collective.

        Returns ``(plans, counts [num_mb, 4] (global loss tokens, sequences, loss tokens computed, samples
        skipped), old_logps, ref_logps)``;
        the log-prob lists are indexed ``[mini-batch][micro-batch]`` and hold None where not needed.
        """
        ws = self.world_size
        if len(batch) == 0 or len(batch) % (num_mb * ws):
            raise ValueError(f"train_step: {len(batch)} samples do not split evenly into "
                             f"algo.num_minibatches ({num_mb}) x world size ({ws})")
        shards = [batch.shard(m, num_mb).shard(self.rank, ws) for m in range(num_mb)]
        plans = [plan for _, plan in self._plans(shards, skip=self.skip_zero_advantage)]
        counts = torch.tensor([step_counts(s, plan.micro) for s, plan in zip(shards, plans, strict=True)],
                              dtype=torch.float64, device=self.device)
        counts = self._all_reduce(counts).float()
        none = [[None] * len(plan.micro) for plan in plans]
        old_logps = [self._plan_logps(self.model, plan) for plan in plans] if num_mb > 1 else none
        ref_logps = [self._plan_logps(self.ref_model, plan) for plan in plans] if self.ref_model else none
        return plans, counts, old_logps, ref_logps

    def _backward(self, plan: _Plan, counts: torch.Tensor, old_logps: list, ref_logps: list,
                  sums: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
        """Forward + backward of one mini-batch's micro-batches, gradients accumulated; returns the loss share.

        ``counts``: [2] global loss tokens and sequences of the mini-batch. Metrics are added to
        ``sums`` times ``weight``. With shared prompts, the micro-batches before the last read the
        prompt pass's leaves; the last backward carries what they collected into the prompt pass.
        """
        algo = self.config.algo
        loss_sum = torch.zeros((), device=self.device)
        mbs = plan.micro
        prompts = self._prompt_pass(self.model, plan)
        leaves = prompts.leaves() if prompts is not None and len(mbs) > 1 else prompts
        for j, p in enumerate(mbs):
            last = j == len(mbs) - 1
            self._sync_gradients(last)
            logits = self._logits(self.model, p, prompts if last else leaves,
                                  plan.prompt_of[j] if plan.prompt_of else None)
            logp, entropy = self._logp_and_entropy(logits, p.targets)
            loss, metrics = policy_objective(
                logp=logp, old_logp=logp.detach() if old_logps[j] is None else old_logps[j],
                rollout_logp=p.rollout_logp, advantages=p.advantages,
                loss_mask=p.loss_mask, entropy=entropy, policy_loss_fn=self.policy_loss_fn, algo=algo,
                **mismatch_settings(self.config), ref_logp=ref_logps[j],
                global_tokens=counts[0], global_seqs=counts[1], norm_len=self.config.max_new_tokens,
                metric_tokens=counts[2],
            )
            # FSDP divides the reduced gradient by W; loss is a share of a sum
            roots, grads = prompts.pending(leaves) if last and prompts is not None else ([], [])
            torch.autograd.backward([loss * self.world_size, *roots], [None, *grads])
            loss_sum += loss.detach()
            for k, v in metrics.items():  # shares of the mini-batch value: they add up over micro-batches
                sums[k] = sums.get(k, 0.0) + v.detach().float() * weight
        return loss_sum

    # --- public API --------------------------------------------------------------------------------

    def _tenants(self, batch: TrainBatch) -> list[tuple[str | None, TrainBatch]]:
        """The batch per adapter it trains: ``[(None, batch)]`` unless its samples name adapters
        (multi-LoRA tenants), then ``[(name, its samples)]`` in the trainer's adapter order."""
        if batch.adapters is None:
            return [(None, batch)]
        unknown = sorted(set(batch.adapters) - set(self.adapter_names))
        if unknown:
            raise ValueError(f"train_step: samples name adapters {unknown} this trainer does not hold "
                             f"({list(self.adapter_names)})")
        return [(name, batch.select([i for i, a in enumerate(batch.adapters) if a == name]))
                for name in self.adapter_names if name in batch.adapters]

    def _use(self, adapter: str | None) -> Any:
        """Forwards (and the backwards that recompute them) through adapter ``adapter`` for every row."""
        return lora.rows_use(self.model, adapter) if adapter is not None else contextlib.nullcontext()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on ``batch`` (the full batch; every rank gets the same). Collective.

        Returns the same metrics dict on every rank (all-reduced; mini-batch values averaged).

        Multi-LoRA tenants (``batch.adapters`` set): each adapter's samples are a batch of their own,
        through their own adapter (round robin within the step): their own loss normalization,
        gradient clipping and non-finite check; the one optimizer step per mini-batch then moves every
        adapter that has gradients, and an adapter without samples or gradients is left as it was (its
        Adam state included). Metrics come per adapter as ``tenant/<name>/train/...``.
        """
        start = time.perf_counter()
        num_mb = self.config.algo.num_minibatches
        policy_replay = self.replays.get(id(self.model))
        if policy_replay is not None:
            policy_replay.take_counts()  # count this step's passes only
        tenants = self._tenants(batch)
        prepared = []
        for name, sub in tenants:  # every proximal log-prob comes before the first update
            with self._use(name):
                prepared.append(self._prepare(sub, num_mb))
        lr_used = self.optimizer.param_groups[0]["lr"]  # of this step's first update
        sums: list[dict[str, torch.Tensor]] = [{} for _ in tenants]
        skipped, grad_norms = [0] * len(tenants), [[] for _ in tenants]
        max_norm = self.config.trainer.max_grad_norm if self.config.trainer.max_grad_norm > 0 else math.inf
        for m in range(num_mb):
            stepped = False
            for t, (name, _) in enumerate(tenants):
                plans, counts, old_logps, ref_logps = prepared[t]
                if name is not None and float(counts[m, 0]) == 0:  # no loss token (e.g. its reward failed)
                    skipped[t] += 1
                    continue
                with self._use(name):
                    loss_sum = self._backward(plans[m], counts[m], old_logps[m], ref_logps[m], sums[t], 1.0 / num_mb)
                params = self.model.parameters() if name is None else self.tenant_params[name]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                global_loss = self._all_reduce(loss_sum)
                if torch.isfinite(global_loss) and torch.isfinite(grad_norm):
                    stepped = True
                else:
                    skipped[t] += 1
                    if name is not None:  # this adapter sits the update out; the others take it
                        for p in self.tenant_params[name]:
                            p.grad = None
                grad_norms[t].append(grad_norm.detach().float())
            if stepped:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

        out: dict[str, float] = {}
        for t, (name, _) in enumerate(tenants):
            plans, counts = prepared[t][0], prepared[t][1]
            names = sorted(sums[t])
            reduced = self._all_reduce(torch.stack([sums[t][k] for k in names])) if names else torch.zeros(0)
            mine = {k: float(v) for k, v in zip(names, reduced.tolist(), strict=True)}
            mine["train/grad_norm"] = float(torch.stack(grad_norms[t]).mean()) if grad_norms[t] else 0.0
            mine["train/nonfinite_skipped"] = float(skipped[t])
            mine["train/num_tokens"] = float(counts[:, 0].sum())
            mine["train/skipped_samples"] = float(counts[:, 3].sum())
            mine["train/num_microbatches"] = float(sum(len(plan.micro) for plan in plans))
            out |= mine if name is None else {f"tenant/{name}/{k}": v for k, v in mine.items()}
        if tenants[0][0] is not None:  # totals over the adapters
            out["train/num_tokens"] = sum(out[f"tenant/{n}/train/num_tokens"] for n, _ in tenants)
            out["train/num_microbatches"] = sum(out[f"tenant/{n}/train/num_microbatches"] for n, _ in tenants)
            out["train/skipped_samples"] = sum(out[f"tenant/{n}/train/skipped_samples"] for n, _ in tenants)
        out["train/lr"] = lr_used
        out["train/trainable_param_frac"] = self.trainable_frac  # of the policy's parameters (LoRA: the adapters')
        if policy_replay is not None:
            agree, slots, used, routes = self._all_reduce(policy_replay.take_counts().to(self.device)).tolist()
            if slots > 0:  # share of recorded (token, layer, slot) routes the trainer's own top-k also chose
                out["moe/route_agreement"] = agree / slots
            if routes > 0:  # share of recorded (token, layer) routes the experts were called with (replay: 1)
                out["moe/replayed_route_share"] = used / routes
        # padded token positions every rank's passes computed, against train/num_tokens (the loss tokens)
        out["perf/train_forward_tokens"] = float(self._all_reduce(torch.tensor(
            [float(sum(plan.forward_tokens() for p in prepared for plan in p[0]))], device=self.device)))
        elapsed = self._all_reduce(torch.tensor([time.perf_counter() - start], device=self.device),
                                   op=dist.ReduceOp.MAX)
        out["perf/train_tokens_per_s"] = out["train/num_tokens"] / max(float(elapsed), 1e-9)
        return out | actor_metrics(f"trainer{self.rank}", process_memory())  # this rank's own: not reduced

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample response-token log-probs under the current weights, for the whole batch.

        Collective (the FSDP forward all-gathers weights): every rank must call it; each returns
        the same lists.
        """
        out: list[list[float]] = [[] for _ in range(len(batch))]
        groups, plan = self._plans([batch])[0]
        for g, p, logp in zip(groups, plan.micro, self._plan_logps(self.model, plan), strict=True):
            for i, row in zip(g, unpad_response(logp, p.response_lengths), strict=True):
                out[i] = row
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective. Rank 0 gets the full fp32 CPU state dict with HF parameter names; others None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else None

    def send_weights(self, sender: Any, version: int) -> Any:
        """Collective. Rank 0 hands the full state dict to ``sender.send(state_dict, version)`` and returns
        what it returns (:mod:`miles.weights.sync`); other ranks return None. With LoRA adapters it sends
        their tensors only (:func:`miles.adapters.lora.sync_state`)."""
        if self.adapter_names:  # LoRA: the adapters' tensors only; the engines hold the same frozen base
            sd = lora.sync_state(self.model, self.adapter_names)
            return sender.send(sd, version) if self.rank == 0 else None
        if not self.sharded:  # one unsharded rank: its live tensors, which ``send`` copies before returning
            return sender.send({k: v.detach() for k, v in self.model.state_dict().items()}, version)
        sd = self.full_state_dict()
        return None if sd is None else sender.send(sd, version)

    def trainable_parameters(self) -> dict[str, int]:
        """``{"trainable": ..., "total": ...}`` parameter counts of the policy (full sizes)."""
        trainable, total = lora.trainable_share(self.model)
        return {"trainable": trainable, "total": total}

    def export_adapters(self, directory: str) -> list[str]:
        """Collective. Write every LoRA adapter in PEFT format to ``directory/<name>``; rank 0 returns the
        paths, other ranks an empty list (:func:`miles.adapters.lora.export_adapter`)."""
        if not self.adapter_names:
            raise ValueError("export_adapters: this trainer trains no adapters (adapter=none)")
        paths = []
        for name in self.adapter_names:
            state = lora.adapter_state(self.model, name)  # collective when sharded
            if self.rank == 0:
                paths.append(str(lora.export_adapter(f"{directory}/{name}", state, self.config.adapter,
                                                     base_model=self.config.model_path,
                                                     vision=self.vision is not None)))
        return paths

    def save_state(self, directory: str) -> None:
        """Collective. :meth:`FSDPRank.save_state`, plus the adapters in PEFT format under ``directory/adapters``."""
        super().save_state(directory)
        if self.adapter_names:
            self.export_adapters(f"{directory}/adapters")

    def compute_gradients(self, batch: TrainBatch) -> dict[str, torch.Tensor] | None:
        """Collective. The gradient of the objective on ``batch`` as one mini-batch, without an update.

        For checks and diagnostics: the same forward/backward path as :meth:`train_step` (micro-batches,
        accumulation, reduction over ranks; the proximal policy is the current one), no clipping, no
        optimizer step, gradients cleared afterwards. Rank 0 gets ``{parameter name: full fp32 CPU
        gradient}``, other ranks None.
        """
        plans, counts, old_logps, ref_logps = self._prepare(batch, 1)
        self._backward(plans[0], counts[0], old_logps[0], ref_logps[0], {}, 1.0)
        grads = {}
        for name, param in self.model.named_parameters():
            g = param.grad if param.grad is not None else torch.zeros_like(param)
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            grads[name] = g.detach().float().cpu()
        self.optimizer.zero_grad(set_to_none=True)
        return grads if self.rank == 0 else None
