"""HF Qwen3 / Qwen3-MoE weights <-> this rank's shards of the megatron ``GPTModel`` (the tensor math).

Every megatron parameter of a rank is one :class:`Entry`: its local name, the HF tensors it is made
of, and how it is cut (``kind``). Shapes, with ``d`` = head_dim, ``g = heads / kv_heads`` query heads
per group, ``T`` = tensor-parallel size, ``V'`` = vocabulary padded to a multiple of ``T``::

    kind    megatron tensor (full, before the TP cut)          from HF
    copy    as in HF (norms, router)                            the same tensor, on every TP rank
    vocab   [V', H] rows cut over T                             embed_tokens / lm_head, zero rows appended
    row     [H, X] columns cut over T (RowParallelLinear)       o_proj, down_proj
    qkv     [kv_heads * (g + 2) * d, H], per query group        q_proj [heads*d, H], k_proj, v_proj
            ``[q heads of the group; k; v]``, rows cut over T
    glu     per TP rank ``[gate rows of the rank; up rows]``    gate_proj / up_proj (or an expert's
                                                               ``gate_up_proj[e]`` = [gate; up])

:func:`cut_shard` reads only the regions of the HF tensors a rank keeps, through a ``read`` function:
from the checkpoint's files (:mod:`.load`) or from tensors in memory (:func:`shard`).

Layers: local layer ``j`` of pipeline stage ``p`` is global layer ``p * L / P + j`` (megatron's even
split). Experts: local expert ``j`` of expert-parallel rank ``r`` is global expert ``r * E / EP + j``.

transformers >= 5 keeps a Qwen3-MoE layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]); here they are *pieces* named ``<hf name>.<e>`` (one expert each),
split by :func:`split_experts` and stacked back by :func:`join_experts`. Every shard is made
``.contiguous()``: gloo sends the bytes of the storage, and a column slice is not contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from miles.train.megatron.arch import Arch

KINDS = ("copy", "vocab", "row", "qkv", "glu")


@dataclass(frozen=True, kw_only=True)
class Coords:
    """Where one rank sits: what :func:`entries` needs to name its parameters."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    ep: int = 1
    ep_rank: int = 0


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One megatron parameter of a rank and the HF pieces it is made of."""

    local: str
    """Name in this rank's ``GPTModel`` (``model.named_parameters()``)."""
    hf: tuple[str, ...]
    """HF names (or expert pieces ``<name>.<e>``) it is made of, in the order ``kind`` uses."""
    kind: str
    expert: bool = False
    """An expert's weight: replicated over the expert-data-parallel ranks, not the data-parallel ones."""
    tied_copy: bool = False
    """The last stage's copy of tied embeddings (PP > 1): loaded, never written out (the first stage's is)."""

    @property
    def tp_split(self) -> bool:
        return self.kind != "copy"


def padded_vocab(arch: Arch, tp: int) -> int:
    return -(-arch.vocab_size // tp) * tp


def entries(arch: Arch, c: Coords) -> list[Entry]:
    """Every parameter of the rank at ``c``, in the model's order."""
    out: list[Entry] = []
    first, last = c.pp_rank == 0, c.pp_rank == c.pp - 1
    if first:
        out.append(Entry(local="embedding.word_embeddings.weight", hf=("model.embed_tokens.weight",), kind="vocab"))
    per_stage = arch.num_layers // c.pp
    for j in range(per_stage):
        i = c.pp_rank * per_stage + j
        m, h = f"decoder.layers.{j}.", f"model.layers.{i}."
        att = h + "self_attn."
        out += [
            Entry(local=m + "input_layernorm.weight", hf=(h + "input_layernorm.weight",), kind="copy"),
            Entry(local=m + "self_attention.linear_proj.weight", hf=(att + "o_proj.weight",), kind="row"),
            Entry(local=m + "self_attention.linear_qkv.weight",
                  hf=(att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), kind="qkv"),
            Entry(local=m + "self_attention.q_layernorm.weight", hf=(att + "q_norm.weight",), kind="copy"),
            Entry(local=m + "self_attention.k_layernorm.weight", hf=(att + "k_norm.weight",), kind="copy"),
            Entry(local=m + "pre_mlp_layernorm.weight", hf=(h + "post_attention_layernorm.weight",), kind="copy"),
        ]
        if arch.is_moe and arch.moe_layers[i]:
            out.append(Entry(local=m + "mlp.router.weight", hf=(h + "mlp.gate.weight",), kind="copy"))
            per_rank = arch.num_experts // c.ep
            for k in range(per_rank):
                e = c.ep_rank * per_rank + k
                x = f"{m}mlp.experts.local_experts.{k}."
                out += [
                    Entry(local=x + "linear_fc1.weight", hf=(f"{h}mlp.experts.gate_up_proj.{e}",), kind="glu",
                          expert=True),
                    Entry(local=x + "linear_fc2.weight", hf=(f"{h}mlp.experts.down_proj.{e}",), kind="row",
                          expert=True),
                ]
        else:
            out += [
                Entry(local=m + "mlp.linear_fc1.weight", hf=(h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                      kind="glu"),
                Entry(local=m + "mlp.linear_fc2.weight", hf=(h + "mlp.down_proj.weight",), kind="row"),
            ]
    if last:
        out.append(Entry(local="decoder.final_layernorm.weight", hf=("model.norm.weight",), kind="copy"))
        if not arch.tied_embeddings:
            out.append(Entry(local="output_layer.weight", hf=("lm_head.weight",), kind="vocab"))
        elif not first:
            out.append(Entry(local="output_layer.weight", hf=("model.embed_tokens.weight",), kind="vocab",
                             tied_copy=True))
    return out


# ---- HF tensors -> one rank's shard ---------------------------------------------------------------

ALL = slice(None)

Read = Callable[[str, slice, "slice | None"], torch.Tensor]
"""``read(piece, rows, cols)``: the region ``[rows, cols]`` of an HF tensor / expert piece (``cols`` None:
every column; 1-D tensors take ``rows`` only), as a tensor of its own (not a view of the source)."""


def chunk_bounds(n: int, parts: int, index: int) -> slice:
    """``torch.arange(n).chunk(parts)[index]`` as a slice (megatron's even split when ``parts`` divides ``n``)."""
    size = -(-n // parts)
    start = min(n, index * size)
    return slice(start, min(n, start + size))


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [heads*d, H], k and v [kv_heads*d, H] -> [kv_heads * (g + 2) * d, H], per query group ``[q; k; v]``."""
    hidden = q.shape[-1]
    groups = [q.reshape(num_kv_heads, -1, hidden), k.reshape(num_kv_heads, -1, hidden),
              v.reshape(num_kv_heads, -1, hidden)]
    return torch.cat(groups, dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, arch: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv`: [kv_heads * (g + 2) * d, H] -> q, k, v."""
    d, nkv, hidden = arch.head_dim, arch.num_kv_heads, qkv.shape[-1]
    g = arch.num_heads // nkv
    grouped = qkv.reshape(nkv, (g + 2) * d, hidden)
    q, k, v = grouped.split([g * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def cut_shard(entry: Entry, read: Read, shapes: Mapping[str, tuple[int, ...]], arch: Arch, tp: int,
              tp_rank: int) -> torch.Tensor:
    """This TP rank's part of ``entry`` (contiguous), reading only the regions of the HF pieces it keeps.

    ``shapes``: the full shape of each piece of ``entry``. The regions, per ``kind`` (``T`` TP ranks, ``r``
    this rank): ``vocab`` rows ``r`` of ``V'/T`` (rows past ``V`` are zeros), ``row`` columns ``r`` of
    ``X/T``, ``qkv`` the query groups ``r`` of ``kv_heads/T`` (their q, k and v rows, interleaved),
    ``glu`` rows ``r`` of ``I/T`` of the gate and of the up projection.
    """
    first = shapes[entry.hf[0]]
    if entry.kind == "copy":
        out = read(entry.hf[0], ALL, None)
    elif entry.kind == "vocab":
        rows = chunk_bounds(padded_vocab(arch, tp), tp, tp_rank)
        real = slice(min(rows.start, first[0]), min(rows.stop, first[0]))
        out = read(entry.hf[0], real, None)
        pad = (rows.stop - rows.start) - (real.stop - real.start)
        if pad:
            out = torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
    elif entry.kind == "row":
        out = read(entry.hf[0], ALL, chunk_bounds(first[1], tp, tp_rank))
    elif entry.kind == "qkv":
        assert arch.num_kv_heads % tp == 0, "each TP rank holds whole query groups (check_dims)"
        groups = chunk_bounds(arch.num_kv_heads, tp, tp_rank)
        d, g = arch.head_dim, arch.num_heads // arch.num_kv_heads
        q = read(entry.hf[0], slice(groups.start * g * d, groups.stop * g * d), None)
        k, v = (read(n, slice(groups.start * d, groups.stop * d), None) for n in entry.hf[1:])
        out = interleave_qkv(q, k, v, groups.stop - groups.start)
    elif entry.kind == "glu":
        if len(entry.hf) == 2:
            gate, up = (read(n, chunk_bounds(shapes[n][0], tp, tp_rank), None) for n in entry.hf)
        else:  # one piece [gate; up]
            half = first[0] // 2
            rows = chunk_bounds(half, tp, tp_rank)
            gate = read(entry.hf[0], rows, None)
            up = read(entry.hf[0], slice(half + rows.start, half + rows.stop), None)
        out = torch.cat([gate, up])
    else:
        raise AssertionError(f"unknown kind {entry.kind!r}")
    return out.contiguous()


def shard(entry: Entry, pieces: Mapping[str, torch.Tensor], arch: Arch, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's part of ``entry`` from full HF tensors / expert pieces in memory (contiguous, a copy)."""

    def read(name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        t = pieces[name].detach()
        return (t[rows] if cols is None else t[rows, cols]).clone()

    return cut_shard(entry, read, {n: tuple(pieces[n].shape) for n in entry.hf}, arch, tp, tp_rank)


# ---- all TP shards -> HF tensors ------------------------------------------------------------------

def unshard(entry: Entry, shards: list[torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    """The HF tensors / expert pieces of ``entry`` from its shards on every TP rank (in TP rank order)."""
    if entry.kind == "copy":
        return {entry.hf[0]: shards[0]}
    if entry.kind == "vocab":
        return {entry.hf[0]: torch.cat(shards)[: arch.vocab_size]}
    if entry.kind == "row":
        return {entry.hf[0]: torch.cat(shards, dim=1)}
    if entry.kind == "qkv":
        return dict(zip(entry.hf, split_qkv(torch.cat(shards), arch), strict=True))
    if entry.kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        if len(entry.hf) == 2:
            return {entry.hf[0]: gate, entry.hf[1]: up}
        return {entry.hf[0]: torch.cat([gate, up])}
    raise AssertionError(f"unknown kind {entry.kind!r}")


# ---- fused HF experts <-> per-expert pieces ------------------------------------------------------

FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def is_fused_experts(name: str) -> bool:
    return name.endswith(FUSED_EXPERTS)


def split_experts(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors with fused experts ([E, ...]) as pieces: ``<name>.<e>`` for each expert ``e``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if is_fused_experts(name):
            out.update({f"{name}.{e}": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def piece_shapes(hf_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """:func:`split_experts` on shapes."""
    out: dict[str, tuple[int, ...]] = {}
    for name, s in hf_shapes.items():
        if is_fused_experts(name):
            out.update({f"{name}.{e}": tuple(s[1:]) for e in range(s[0])})
        else:
            out[name] = tuple(s)
    return out


def join_experts(pieces: Mapping[str, torch.Tensor], hf_shapes: Mapping[str, tuple[int, ...]],
                 arch: Arch) -> dict[str, torch.Tensor]:
    """The HF state dict (names and order of ``hf_shapes``) from pieces; a tied ``lm_head`` is the embedding."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_shapes.items():
        if is_fused_experts(name):
            out[name] = torch.stack([pieces[f"{name}.{e}"] for e in range(shape[0])])
        elif name == "lm_head.weight" and arch.tied_embeddings and name not in pieces:
            out[name] = pieces["model.embed_tokens.weight"]
        else:
            out[name] = pieces[name]
    return out
