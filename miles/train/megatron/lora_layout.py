"""Where each LoRA tensor of the HF model sits on a megatron rank (pure Python and torch, no megatron import).

An adapter is peft's on the HF model (:mod:`miles.adapters.lora`): one pair ``A [r, in]``, ``B [out, r]``
per target module, update ``(alpha / r) * B @ A`` added to the module's output. On megatron the HF
modules are fused or split over tensor-parallel ranks, so each pair is placed to match its base layer
(``T`` = tensor-parallel size, ``V'`` = vocabulary padded to a multiple of ``T``)::

    HF target           megatron module (local)          A [r, in]          B [out, r]
    q_proj/k_proj/v_proj  linear_qkv   (column parallel) copy               rows: this rank's heads
    gate_proj/up_proj     linear_fc1   (column parallel) copy               rows: this rank's slice
    o_proj                linear_proj  (row parallel)    cols: this slice   copy
    down_proj             linear_fc2   (row parallel)    cols: this slice   copy
    lm_head               output_layer (column parallel) copy               vocab: [V', r] rows cut

``copy``: the full tensor on every TP rank; ``rows``/``cols``: ``chunk(T)`` along dim 0 / 1, as the
base weight is cut (:mod:`.mapping`: a rank holds whole query groups, so its q heads are a contiguous
row range of ``q_proj``, as its k and v heads are of ``k_proj`` and ``v_proj``); ``vocab``: zero rows
appended up to ``V'``, then rows cut (the padding is dropped when gathered).

Names: a LoRA tensor's PEFT key is what ``peft``'s ``save_pretrained`` writes
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``); in the megatron model it is the
parameter ``<module>.lora.<adapter>.<target>_<A|B>`` (``decoder.layers.<j>.self_attention.linear_qkv
.lora.default.q_proj_A``), local layer ``j`` of pipeline stage ``p`` being HF layer ``p * L / P + j``.
MoE layers have no dense MLP: ``gate_proj``/``up_proj``/``down_proj`` adapt the dense layers only, as
peft adapts the HF modules of those names (the fused experts are not ``Linear`` modules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.train.megatron.arch import Arch
from miles.train.megatron.mapping import padded_vocab

ATTENTION = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj"}
MLP = {"gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
SUPPORTED = (*ATTENTION, *MLP, "lm_head")
"""The HF modules the megatron trainer can adapt (peft's names), in the order of a Qwen3 layer."""
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoraEntry:
    """One LoRA tensor of one adapter on one pipeline stage."""

    adapter: str
    module: str
    """The megatron module it adapts, in this stage's ``GPTModel`` (``decoder.layers.0.self_attention.linear_qkv``)."""
    target: str
    """The HF module (``q_proj``, ..., ``lm_head``)."""
    part: str
    """``A`` or ``B``."""
    peft_key: str
    """PEFT's saved name (``base_model.model.<HF module>.lora_<part>.weight``)."""
    shape: tuple[int, int]
    """The full (HF, unsplit) shape."""
    kind: str
    """How tensor-parallel ranks cut it: ``copy``, ``rows``, ``cols`` or ``vocab`` (module docstring)."""

    @property
    def local(self) -> str:
        """Its parameter name in the megatron model."""
        return f"{self.module}.lora.{self.adapter}.{self.target}_{self.part}"

    @property
    def param_name(self) -> str:
        """Its parameter name in peft's model (``...q_proj.lora_A.<adapter>.weight``), as FSDP's trainer names it."""
        return self.peft_key.replace(f".lora_{self.part}.weight", f".lora_{self.part}.{self.adapter}.weight")

    @property
    def tp_split(self) -> bool:
        return self.kind != "copy"


def _dims(arch: Arch, target: str) -> tuple[int, int]:
    """(in, out) features of HF module ``target``."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, arch.ffn_hidden_size), "up_proj": (h, arch.ffn_hidden_size),
            "down_proj": (arch.ffn_hidden_size, h), "lm_head": (h, arch.vocab_size)}[target]


def _pair(adapter: str, module: str, target: str, hf_module: str, arch: Arch, r: int) -> list[LoraEntry]:
    fan_in, fan_out = _dims(arch, target)
    if target == "lm_head":
        kinds = ("copy", "vocab")
    elif target in ROW_PARALLEL:
        kinds = ("cols", "copy")
    else:
        kinds = ("copy", "rows")
    prefix = f"base_model.model.{hf_module}"
    return [LoraEntry(adapter=adapter, module=module, target=target, part="A", peft_key=f"{prefix}.lora_A.weight",
                      shape=(r, fan_in), kind=kinds[0]),
            LoraEntry(adapter=adapter, module=module, target=target, part="B", peft_key=f"{prefix}.lora_B.weight",
                      shape=(fan_out, r), kind=kinds[1])]


def lora_entries(arch: Arch, targets: Sequence[str], adapters: Sequence[str], r: int, *, pp: int = 1,
                 pp_rank: int = 0) -> list[LoraEntry]:
    """Every LoRA tensor of pipeline stage ``pp_rank``: adapter by adapter, each in the HF model's order."""
    out: list[LoraEntry] = []
    per_stage = arch.num_layers // pp
    for adapter in adapters:
        for j in range(per_stage):
            i = pp_rank * per_stage + j
            dense_mlp = not (arch.is_moe and arch.moe_layers[i])
            for target in SUPPORTED[:-1]:
                if target not in targets or (target in MLP and not dense_mlp):
                    continue
                if target in ATTENTION:
                    module, hf = f"decoder.layers.{j}.self_attention.{ATTENTION[target]}", f"self_attn.{target}"
                else:
                    module, hf = f"decoder.layers.{j}.mlp.{MLP[target]}", f"mlp.{target}"
                out += _pair(adapter, module, target, f"model.layers.{i}.{hf}", arch, r)
        if "lm_head" in targets and pp_rank == pp - 1:
            out += _pair(adapter, "output_layer", "lm_head", "lm_head", arch, r)
    return out


# ---- full (PEFT) tensor <-> one TP rank's part --------------------------------------------------

def shard_lora(e: LoraEntry, full: torch.Tensor, arch: Arch, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's part of ``full`` (contiguous, a copy)."""
    if e.kind == "copy":
        out = full
    elif e.kind == "rows":
        out = full.chunk(tp, dim=0)[tp_rank]
    elif e.kind == "cols":
        out = full.chunk(tp, dim=1)[tp_rank]
    elif e.kind == "vocab":
        pad = padded_vocab(arch, tp) - full.shape[0]
        out = (torch.cat([full, full.new_zeros(pad, full.shape[1])]) if pad else full).chunk(tp, dim=0)[tp_rank]
    else:
        raise AssertionError(f"unknown kind {e.kind!r}")
    return out.detach().clone().contiguous()


def unshard_lora(e: LoraEntry, parts: Sequence[torch.Tensor], arch: Arch) -> torch.Tensor:
    """The full tensor from every TP rank's part (in TP rank order)."""
    if e.kind == "copy":
        return parts[0]
    if e.kind == "cols":
        return torch.cat(list(parts), dim=1)
    full = torch.cat(list(parts), dim=0)
    return full[: arch.vocab_size] if e.kind == "vocab" else full


# ---- names of the base weights in peft's model --------------------------------------------------

def peft_base_name(hf_name: str, targets: Sequence[str]) -> str:
    """An HF parameter's name in peft's model: ``base_model.model.`` first, and ``.base_layer`` before the
    attribute of an adapted module (``...q_proj.weight`` -> ``...q_proj.base_layer.weight``)."""
    module, _, attr = hf_name.rpartition(".")
    if module.rpartition(".")[2] in targets:
        return f"base_model.model.{module}.base_layer.{attr}"
    return f"base_model.model.{hf_name}"


# ---- what the driver checks ------------------------------------------------------------------------

def check_lora(targets: Sequence[str], arch: Arch, pp: int) -> None:
    """``ValueError`` naming ``adapter.target_modules`` unless the megatron trainer can adapt them."""
    unknown = [t for t in targets if t not in SUPPORTED]
    if unknown:
        raise ValueError(f"adapter.target_modules: {unknown} with trainer=megatron; the megatron trainer adapts "
                         f"{list(SUPPORTED)} (peft's names of a Qwen3 model's linear layers); use those, or "
                         "trainer=fsdp")
    present = {e.target for p in range(pp) for e in lora_entries(arch, targets, ["x"], 1, pp=pp, pp_rank=p)}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ValueError(f"adapter.target_modules: {missing} name no module of the model ({arch.model_type}: its "
                         f"MoE layers have no dense MLP); adapt {[t for t in targets if t in present] or 'others'}")
    for p in range(pp):
        if not lora_entries(arch, targets, ["x"], 1, pp=pp, pp_rank=p):
            raise ValueError(
                f"adapter.target_modules={list(targets)} with trainer.pipeline_parallel={pp}: pipeline stage {p} "
                "would hold no adapter (nothing of it trains, so megatron's schedule has no backward to run there); "
                "add a module of every layer (e.g. q_proj) or set trainer.pipeline_parallel=1")


# ---- peft's initial adapters -------------------------------------------------------------------------

def initial_adapters(hf_config: Any, cfg: Any, names: Sequence[str], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """``{adapter: {PEFT key: tensor}}`` as :func:`miles.adapters.lora.add_adapters` initializes them after
    ``torch.manual_seed(seed)`` on the HF model of ``hf_config`` (what the FSDP trainer does).

    peft runs for real on a skeleton of the model: every module on the meta device (no memory), the
    linear layers' weights a one-element CPU tensor expanded to their shape, so that peft creates and
    initializes the adapters on the CPU with the CPU generator (its ``kaiming_uniform_`` for A, zeros for
    B) in its own module order. ``tests/test_megatron_lora.py`` checks the result against peft on the
    real model.
    """
    from transformers import AutoModelForCausalLM

    from miles.adapters import lora

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    for m in skeleton.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight = torch.nn.Parameter(torch.zeros((), dtype=torch.float32).expand(m.out_features, m.in_features),
                                          requires_grad=False)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = lora.add_adapters(skeleton, cfg, list(names), trainable=False)
        return {n: lora.adapter_state(model, n) for n in names}
    finally:
        torch.random.set_rng_state(state)


def full_numel(entries: Sequence[LoraEntry]) -> int:
    """Elements of the full (unsplit) tensors of ``entries``."""
    return sum(e.shape[0] * e.shape[1] for e in entries)
