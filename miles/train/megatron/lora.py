"""LoRA adapters on megatron-core's parallel linears, with the parametrization of peft on the HF model.

Why not peft's own Megatron support (``LoraConfig(megatron_config=..., megatron_core="megatron.core")``,
``peft/tuners/lora/tp_layer.py``, peft 0.21): it wraps each megatron layer in ``LoraParallelLinear``
with *one* A/B pair, so on the fused ``linear_qkv`` one rank-r update of ``[q; k; v]`` (one A shared by
q, k and v) and on ``linear_fc1`` one update of ``[gate; up]``. peft on the HF model has three pairs
(q_proj, k_proj, v_proj) and two (gate_proj, up_proj) there: a different model (the fused update has
rank r, the separate ones up to 3r), whose adapters neither load into the engines' peft models nor
export as the PEFT directories the FSDP trainer writes. It also has no per-row adapters
(``adapter_names`` raises ``does not support mixed_batch_forward``). So miles adds the pairs itself.

What this module does (layout and names: :mod:`.lora_layout`):

* :meth:`MegatronLora.attach` gives each adapted megatron module a child ``lora`` (per adapter, per HF
  target, its parameters ``<target>_A`` / ``<target>_B``: this rank's part, initialized as peft
  initializes the HF model's, :func:`~.lora_layout.initial_adapters`) and a forward hook that adds
  ``(alpha / r) * B @ A x`` of the active adapter to the base layer's output. Column-parallel base
  (``linear_qkv``, ``linear_fc1``, ``output_layer``): ``u = x A^T`` with A whole on every TP rank, then
  megatron's ``copy_to_tensor_model_parallel_region`` (identity; the backward all-reduces the partial
  ``du`` of each rank's B rows, so A's gradient and the input's are the full ones on every rank),
  ``delta = u B_rank^T``; q/k/v deltas are interleaved per query group and gate/up stacked exactly as
  the fused base output is. Row-parallel base (``linear_proj``, ``linear_fc2``): ``u = x_rank A_rank^T``
  summed over TP ranks with ``reduce_from_tensor_model_parallel_region`` (all-reduce; identity
  backward), ``delta = u B^T`` with B whole on every rank. These are the operations of the base layers.
* the base is frozen before megatron's ``DistributedDataParallel`` wraps the model, so DDP's buffers
  hold the adapters only and reduce their gradients over data-parallel replicas;
  :meth:`MegatronLora.grad_norm` counts each gradient once (a whole tensor on TP rank 0 only);
* :class:`LoraIO` gathers adapter tensors (weights, gradients, Adam moments) to rank 0 in PEFT keys and
  shards PEFT tensors back to every rank, at any layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from miles.config.schema import AdapterConfig
from miles.train.megatron.arch import Arch
from miles.train.megatron.collect import flat, unflat
from miles.train.megatron.grads import clip_, global_grad_norm
from miles.train.megatron.lora_layout import (
    ROW_PARALLEL,
    LoraEntry,
    full_numel,
    lora_entries,
    shard_lora,
    unshard_lora,
)

Adapters = dict[str, dict[str, torch.Tensor]]
"""``{adapter name: {PEFT key: full fp32 CPU tensor}}``."""


class LoraIO:
    """Adapter tensors between this rank's parts and full PEFT tensors on rank 0 (parallel groups initialized)."""

    def __init__(self, arch: Arch, cfg: AdapterConfig, names: Sequence[str], device: torch.device) -> None:
        self.arch, self.device, self.names = arch, device, list(names)
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.pp, self.pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        self._targets, self._r = tuple(cfg.target_modules), cfg.rank
        self.stages = [self._entries(p) for p in range(self.pp)]
        self.entries = self.stages[self.pp_rank]
        self.owner = self.tp_rank == 0 and ps.get_data_parallel_rank() == 0  # holds its stage's full tensors
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mine = torch.tensor([self.pp_rank, int(self.owner)], device=device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        self._owners = sorted((int(t[0]), r) for r, t in enumerate(everyone) if int(t[1]) and r != 0)

    def _entries(self, pp_rank: int) -> list[LoraEntry]:
        return lora_entries(self.arch, self._targets, self.names, self._r, pp=self.pp, pp_rank=pp_rank)

    def shard(self, full: Adapters) -> dict[str, torch.Tensor]:
        """``{local name: this rank's part}`` of this stage's entries whose adapter is in ``full``."""
        return {e.local: shard_lora(e, full[e.adapter][e.peft_key], self.arch, self.tp, self.tp_rank)
                for e in self.entries if e.adapter in full}

    def gather(self, local: Mapping[str, torch.Tensor]) -> Adapters | None:
        """Rank 0: ``{adapter: {PEFT key: full fp32 CPU tensor}}`` (HF order) of per-parameter tensors
        ``local`` (``{local name: tensor}``: weights, gradients, moments); other ranks None. Collective."""
        split = [e for e in self.entries if e.tp_split]
        parts: dict[str, list[torch.Tensor]] = {e.local: [local[e.local]] for e in self.entries}
        if self.tp > 1 and split:
            mine = flat([local[e.local] for e in split], self.device)
            got = [torch.zeros_like(mine) for _ in range(self.tp)]
            dist.all_gather(got, mine, group=ps.get_tensor_model_parallel_group())
            shapes = [tuple(local[e.local].shape) for e in split]
            per_rank = [unflat(g.cpu(), shapes) for g in got]
            parts.update({e.local: [r[i] for r in per_rank] for i, e in enumerate(split)})
        full: list[torch.Tensor] = []
        if self.owner:
            full = [unshard_lora(e, parts[e.local], self.arch).detach().to("cpu", torch.float32, copy=True)
                    for e in self.entries]
        if self.rank != 0:
            if self.owner and full:
                dist.send(flat(full, self.device), dst=0)
            return None
        pairs = list(zip(self.entries, full, strict=True))
        for pp_rank, r in self._owners:
            ents = self.stages[pp_rank]
            if not ents:
                continue
            buf = torch.zeros(full_numel(ents), device=self.device)
            dist.recv(buf, src=r)
            pairs += zip(ents, unflat(buf.cpu(), [e.shape for e in ents]), strict=True)
        out: Adapters = {n: {} for n in self.names}
        for e, t in sorted(pairs, key=lambda p: self.names.index(p[0].adapter)):  # stable: stages stay in order
            out[e.adapter][e.peft_key] = t
        return out

    def broadcast(self, full: Adapters | None) -> Adapters:
        """Rank 0's ``full`` (every adapter, every stage) on every rank. Collective."""
        every = [e for stage in self.stages for e in stage]
        shapes = [e.shape for e in every]
        if self.rank == 0:
            assert full is not None
            buf = flat([full[e.adapter][e.peft_key] for e in every], self.device)
        else:
            buf = torch.zeros(full_numel(every), device=self.device)
        if self.world_size > 1:
            dist.broadcast(buf, src=0)
        out: Adapters = {n: {} for n in self.names}
        for e, t in zip(every, unflat(buf.cpu(), shapes), strict=True):
            out[e.adapter][e.peft_key] = t
        return out


class MegatronLora:
    """The LoRA adapters of one trainer rank (module docstring): parameters, forward hooks, the active adapter."""

    def __init__(self, arch: Arch, cfg: AdapterConfig, names: Sequence[str], hf_config: Any, *, seed: int,
                 device: torch.device) -> None:
        from miles.train.megatron.lora_layout import initial_adapters

        self.arch, self.cfg, self.names, self.device = arch, cfg, tuple(names), device
        self.scaling = cfg.alpha / cfg.rank
        self.io = LoraIO(arch, cfg, names, device)
        self.active: str = self.names[0]
        self._initial = initial_adapters(hf_config, cfg, names, seed)
        self.params: dict[str, torch.nn.Parameter] = {}
        """``{local name: parameter}`` of this rank, every adapter."""
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._tp = self.io.tp
        self._tp_rank = self.io.tp_rank

    # --- the model -----------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """Add this stage's adapters to ``model`` (this rank's ``GPTModel``, base already frozen)."""
        local = self.io.shard(self._initial)
        del self._initial
        modules: dict[str, list[LoraEntry]] = {}
        for e in self.io.entries:
            modules.setdefault(e.module, []).append(e)
        for path, ents in modules.items():
            base = model.get_submodule(path)
            slots = torch.nn.ModuleDict({n: torch.nn.ParameterDict() for n in self.names})
            for e in ents:
                slots[e.adapter][f"{e.target}_{e.part}"] = torch.nn.Parameter(local[e.local].to(self.device))
            base.add_module("lora", slots)
            base.register_forward_hook(self._hook(slots, list(dict.fromkeys(e.target for e in ents))))
        self.params = {n: p for n, p in model.named_parameters() if ".lora." in n}
        assert sorted(self.params) == sorted(e.local for e in self.io.entries), "LoRA parameters differ from the layout"

    def _hook(self, slots: torch.nn.ModuleDict, targets: list[str]) -> Any:
        arch, tp = self.arch, self._tp

        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
            out, bias = output
            p = slots[self.active]
            x = args[0]
            deltas = {t: self._delta(x, p[f"{t}_A"], p[f"{t}_B"], t in ROW_PARALLEL) for t in targets}
            if "q_proj" in targets or "k_proj" in targets or "v_proj" in targets:  # [q of the group; k; v] per group
                groups = arch.num_kv_heads // tp
                g = arch.num_heads // arch.num_kv_heads
                lead = out.shape[:-1]
                parts = []
                for t, heads in (("q_proj", g), ("k_proj", 1), ("v_proj", 1)):
                    d = deltas.get(t)
                    width = heads * arch.head_dim
                    parts.append(d.view(*lead, groups, width) if d is not None else out.new_zeros(*lead, groups, width))
                delta = torch.cat(parts, dim=-1).view_as(out)
            elif "gate_proj" in targets or "up_proj" in targets:  # [gate rows of this rank; up rows]
                half = out.shape[-1] // 2
                delta = torch.cat([deltas[t] if t in deltas else out.new_zeros(*out.shape[:-1], half)
                                   for t in ("gate_proj", "up_proj")], dim=-1)
            else:
                (delta,) = deltas.values()
            return out + delta, bias

        return hook

    def _delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_parallel: bool) -> torch.Tensor:
        """``scaling * B (A x)`` of one pair on this rank (module docstring); x: [S, B, in / in_rank]."""
        u = F.linear(x, a)
        if self._tp > 1:
            u = (reduce_from_tensor_model_parallel_region(u, group=self._tp_group) if row_parallel
                 else copy_to_tensor_model_parallel_region(u, group=self._tp_group))
        return F.linear(u, b) * self.scaling

    @contextlib.contextmanager
    def use(self, name: str | None) -> Iterator[None]:
        """Forwards (and their backwards) through adapter ``name`` (None: the first) within the block."""
        before, self.active = self.active, name if name is not None else self.names[0]
        try:
            yield
        finally:
            self.active = before

    # --- parameters and gradients ----------------------------------------------------------------

    def of(self, name: str | None) -> list[torch.nn.Parameter]:
        """This rank's parameters of adapter ``name`` (None: the first)."""
        name = name if name is not None else self.names[0]
        return [self.params[e.local] for e in self.io.entries if e.adapter == name]

    def param_groups(self) -> list[dict[str, Any]]:
        """One optimizer param group per adapter (as the FSDP trainer's)."""
        return [{"params": self.of(n)} for n in self.names]

    def grad_norm(self, name: str | None, world_sum: Any) -> torch.Tensor:
        """Global L2 norm of adapter ``name``'s reduced gradients (``main_grad``): a tensor cut over TP
        ranks counts on each, a whole one on TP rank 0; data-parallel replica 0 only."""
        name = name if name is not None else self.names[0]
        counted = []
        if ps.get_data_parallel_rank() == 0:
            counted = [self.params[e.local].main_grad for e in self.io.entries
                       if e.adapter == name and (e.tp_split or self._tp_rank == 0)]
        return global_grad_norm(counted, world_sum)

    @staticmethod
    def clip(params: Sequence[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
        clip_([p.main_grad for p in params], norm, max_norm)

    def numel(self) -> int:
        """Trainable parameters of every adapter, full sizes."""
        return sum(full_numel(stage) for stage in self.io.stages)


def sync_names(adapters: Adapters) -> dict[str, torch.Tensor]:
    """``adapter:<name>:<PEFT key>`` names of :func:`miles.adapters.lora.sync_state`."""
    from miles.adapters.lora import SYNC_PREFIX

    return {f"{SYNC_PREFIX}{name}:{k}": v for name, state in adapters.items() for k, v in state.items()}
