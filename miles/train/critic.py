"""FSDP2 critic rank for PPO (``algo.estimator: gae``): the policy's backbone plus a value head.

The value model is the HF checkpoint's base model (``AutoModelForCausalLM(...).model``, the decoder
stack without the LM head) and a ``Linear(hidden, 1)`` value head (weight ~ N(0, 1/(hidden+1)),
bias 0, as in OpenRLHF), sharded per decoder layer with ``fully_shard`` exactly like
:class:`miles.train.fsdp.FSDPTrainer`, with its own AdamW (``algo.critic.*``). The critic ranks form
their own gloo/NCCL group, a Ray actor group separate from the policy trainer's.

``V_t``, the value of the state before response token ``t``, is read from the hidden state at the
position whose logits predict token ``t`` (prompt + first ``t`` response tokens), so values line up
with the log-probs token for token. One :meth:`train_step` splits the batch like the trainer
(``algo.num_minibatches`` contiguous mini-batches, each into W rank shards) and minimises the clipped
value loss (:func:`miles.algos.gae.value_loss`, token mean over the trained tokens with global
counts) against the GAE returns. :meth:`save_state` / :meth:`load_state` write and read the value
model, its AdamW state and scheduler counters in the trainer's layout (:mod:`miles.train.optim`), so
a resumed PPO run continues with the critic it had. Every method that runs the model is collective.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from miles.algos.gae import explained_variance, value_loss
from miles.config.rank import RankConfig
from miles.train.batching import PaddedBatch, pad_batch, response_logits, unpad_response
from miles.train.rank import FSDPRank, pad_token_id
from miles.types import TrainBatch


class ValueModel(torch.nn.Module):
    """A decoder backbone and a scalar head: ``(input_ids, ...) -> values [B, L, 1]`` fp32."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        # a fresh tensor, not Linear's reshaped view: FSDP hooks the root module's output for backward
        return self.value_head(hidden).float().clone()


class FSDPCritic(FSDPRank):
    """One FSDP2 data-parallel critic rank (a plain class; the driver makes it a Ray actor)."""

    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int, checkpoint_dir: str,
                 config: RankConfig, num_threads: int = 0, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        c = config.algo.critic  # ranges were checked by miles.config.validate
        # the same seed on every rank: the same value-head init
        self._init_rank(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                        config=config, num_threads=num_threads, device=device)
        lm = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
        layer_classes = set(getattr(lm, "_no_split_modules", None) or [])
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        cfg = lm.config
        del lm  # drop the LM head
        self.model = ValueModel(backbone, cfg.hidden_size).to(self.device)
        self.model.eval()  # no dropout: values must be reproducible between compute_values and train_step
        self._shard(self.model, layer_classes)
        self.pad_id = pad_token_id(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=c.betas,
                                           weight_decay=c.weight_decay)
        warmup = max(1, c.lr_warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))

    def _values(self, p: PaddedBatch) -> torch.Tensor:
        """Values before each response token: [B, Tr] fp32."""
        v = self.model(input_ids=p.input_ids, attention_mask=p.attention_mask, position_ids=p.position_ids)
        return response_logits(v, p.logit_index).squeeze(-1)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> list[list[float]]:
        """Per-sample values ``V_t`` for every response token of the whole batch. Collective.

        Every rank returns the same lists (lengths = response lengths).
        """
        p = pad_batch(batch, pad_id=self.pad_id).to(self.device)
        return unpad_response(self._values(p), p.response_lengths)

    def train_step(
        self, batch: TrainBatch, returns: list[list[float]], old_values: list[list[float]]
    ) -> dict[str, float]:
        """Minimise the clipped value loss towards ``returns`` on ``batch`` (full batch, every rank). Collective.

        ``returns``, ``old_values``: per-sample lists of response-token floats (GAE returns and the
        values :meth:`compute_values` gave at rollout time). Returns the same metrics on every rank:
        ``critic/value_loss``, ``critic/vf_clip_frac``, ``critic/value_mean`` (mini-batch means, before
        each update), ``critic/explained_var`` (of ``old_values`` for ``returns``), ``critic/grad_norm``,
        ``critic/returns_mean``, ``critic/lr``, ``critic/nonfinite_skipped``, ``perf/critic_train_s``.
        ``explained_var`` is NaN when the returns have no spread (the tracker skips non-finite values).
        """
        start = time.perf_counter()
        num_mb, ws = self.config.algo.num_minibatches, self.world_size
        n = len(batch)
        if n == 0 or n % (num_mb * ws):
            raise ValueError(f"FSDPCritic.train_step: {n} samples do not split evenly into "
                             f"algo.num_minibatches ({num_mb}) x world size ({ws})")
        lengths = [len(r) for r in batch.response_ids]
        for name, lists in (("returns", returns), ("old_values", old_values)):
            if [len(x) for x in lists] != lengths:
                raise ValueError(f"FSDPCritic.train_step: {name} must hold one float per response token of each "
                                 f"sample; found lengths {[len(x) for x in lists]}, expected {lengths}")
        per_rank = n // (num_mb * ws)
        c = self.config.algo.critic
        max_norm = c.max_grad_norm if c.max_grad_norm > 0 else math.inf
        lr_used = self.optimizer.param_groups[0]["lr"]
        # value loss, clip fraction, value mean: each this rank's share of a global token mean
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        grad_norms, skipped = [], 0
        for m in range(num_mb):
            shard = batch.shard(m, num_mb).shard(self.rank, ws)
            p = pad_batch(shard, pad_id=self.pad_id).to(self.device)
            lo = (m * ws + self.rank) * per_rank
            ret = _pad(returns[lo:lo + per_rank], p.loss_mask.shape).to(self.device)
            old = _pad(old_values[lo:lo + per_rank], p.loss_mask.shape).to(self.device)
            tokens = self._all_reduce(p.loss_mask.sum().double().reshape(1)).float()[0]
            values = self._values(p)
            loss, clip_frac = value_loss(values, old, ret, p.loss_mask, clip=c.value_clip, global_tokens=tokens)
            (loss * ws).backward()  # FSDP averages gradients over ranks; loss is this rank's share of a sum
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if torch.isfinite(self._all_reduce(loss.detach().clone())) and torch.isfinite(grad_norm):
                self.optimizer.step()
                self.scheduler.step()
            else:
                skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            grad_norms.append(float(grad_norm))
            value_sum = (values.detach() * p.loss_mask).sum() / tokens.clamp(min=1.0)
            sums += torch.stack([loss.detach(), clip_frac, value_sum]).double() / num_mb
        sums = self._all_reduce(sums).cpu()
        full_mask = _pad(batch.loss_mask, (n, max(1, max(lengths))))
        shape = full_mask.shape
        out = {
            "critic/value_loss": float(sums[0]),
            "critic/vf_clip_frac": float(sums[1]),
            "critic/value_mean": float(sums[2]),
            "critic/explained_var": explained_variance(_pad(old_values, shape), _pad(returns, shape), full_mask),
            "critic/returns_mean": float((_pad(returns, shape) * full_mask).sum() / full_mask.sum().clamp(min=1.0)),
            "critic/grad_norm": sum(grad_norms) / len(grad_norms),
            "critic/lr": lr_used,
            "critic/nonfinite_skipped": float(skipped),
        }
        elapsed = self._all_reduce(torch.tensor([time.perf_counter() - start], device=self.device),
                                   op=dist.ReduceOp.MAX)
        out["perf/critic_train_s"] = float(elapsed)
        return out


def _pad(lists: list[list[float]] | list[list[int]], shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Right-pad per-sample lists with 0 into a [B, T] fp32 tensor of ``shape``."""
    out = torch.zeros(tuple(shape))
    for i, row in enumerate(lists):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out
