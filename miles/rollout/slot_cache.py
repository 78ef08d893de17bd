"""How the engine runs the model: a static per-slot KV cache and a dispatch-free Qwen3 forward.

One static buffer per layer, ``[rows, kv_heads, capacity, head_dim]``, grown by
doubling when more rows run at once (up to the engine's slots) or a longer request
arrives (never per step), so a 128-row rollout holds 128 rows of cache, not the
engine's ``max_batch_size``. Token ``t``
of a row lives at index ``t`` (its position), so a decode step writes each
row's new K/V at its own position and attends to indices ``<= position``
through a boolean mask; the RoPE positions are the row's true positions. A
row's numbers therefore equal an unpadded forward over prompt + response
(to float rounding), whatever its neighbours. The model is the transformers
module (sdpa attention) driven through a :class:`~transformers.Cache`
subclass; for Qwen3 / Qwen3-MoE the same operations are replayed without the
module dispatch (:class:`FastQwen3`, 1.6-2x faster per step on the tiny CPU
model), used only when a start-up check finds it equal to the module forward:
bitwise, except that in fp32 on CPU a decode step's attention is
matmul -> softmax -> matmul (:func:`decode_attention`), equal to sdpa to float
rounding (checked to 1e-5) and 1.2-2.5x faster than sdpa's CPU kernel for
one query row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache


def pow2_at_least(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``): how the cache and the engine's buffers grow."""
    return 1 << (n - 1).bit_length()


class SlotCache(Cache):
    """Static per-slot K/V buffers driven by the engine; transformers' attention calls :meth:`update`.

    Layer ``l`` holds ``k[l], v[l]: [rows, kv_heads, capacity, head_dim]`` (allocated at first
    use, from the shapes the model hands in; grown when :meth:`reserve` raises ``rows`` or
    ``capacity``, keeping the contents). Before each forward the engine sets the mode:
    ``prefill(dst, src)``: prompt row ``src[i]`` is written into slot ``dst[i]`` at indices
    ``[0, T)`` and attention runs over the prompts alone; ``decode(arange, pos, kv_len)``: slot
    ``b < len(arange)`` gets its new K/V at index ``pos[b]`` (its ``T`` new K/V at ``pos[b] .. pos[b] + T - 1``
    when a speculative step verifies several tokens at once) and attends to indices ``[0, kv_len)``;
    ``extend(dst, src, start, prefixes, kv_len)``: prompt row ``src[i]`` continues a stored prefix
    (:mod:`miles.rollout.prefix_cache`) in slot ``dst[i]``: the prefix's K/V fill indices
    ``[0, start)``, the row's new K/V go to ``[start, start + T)``, and attention runs over the first
    slot of each prompt row, indices ``[0, kv_len)``.
    """

    def __init__(self, slots: int) -> None:
        super().__init__(layers=[])
        self.slots, self.rows, self.capacity = slots, 0, 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self._decode = False
        self._pos, self._kv_len = torch.zeros(0, dtype=torch.long), 0
        self._dst = self._src = torch.zeros(0, dtype=torch.long)
        self._arange = torch.zeros(0, dtype=torch.long)
        self._extend: tuple[Tensor, list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]], Tensor] | None = None

    def reserve(self, rows: int, length: int, max_length: int | None = None) -> None:
        """Room for slots ``[0, rows)`` and ``length`` positions, both rounded up to a power of two
        (capped at ``slots`` and ``max_length``) and never shrunk; the buffers grow at their next use."""
        if not 1 <= rows <= self.slots:
            raise ValueError(f"SlotCache.reserve: rows must be in [1, {self.slots}], got {rows}")
        capacity = pow2_at_least(length)
        self.rows = max(self.rows, min(self.slots, pow2_at_least(rows)))
        self.capacity = max(self.capacity, min(capacity, max_length) if max_length else capacity)

    def prefill(self, dst: Tensor, src: Tensor) -> None:
        self._decode, self._dst, self._src, self._extend = False, dst, src, None

    def decode(self, arange: Tensor, pos: Tensor, kv_len: int) -> None:
        self._decode, self._arange, self._pos, self._kv_len = True, arange, pos, kv_len

    def extend(self, dst: Tensor, src: Tensor, start: Tensor,
               prefixes: list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]], kv_len: int) -> None:
        """``start[u]``: length of prompt row ``u``'s stored prefix, whose per-layer K/V are
        ``prefixes[u] = (k, v)``, each ``[kv_heads, start[u], head_dim]``."""
        first: dict[int, int] = {}
        for d, s in zip(dst.tolist(), src.tolist(), strict=True):
            first.setdefault(s, d)
        heads = torch.tensor([first[u] for u in range(len(prefixes))], dtype=torch.long, device=dst.device)
        self._decode, self._dst, self._src, self._kv_len = False, dst, src, kv_len
        self._extend = (start, prefixes, heads)

    def read(self, slot: int, length: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Copies of slot ``slot``'s K/V at indices ``[0, length)``, per layer ``[kv_heads, length, head_dim]``."""
        return (tuple(k[slot, :, :length].clone() for k in self.k),
                tuple(v[slot, :, :length].clone() for v in self.v))

    def _layer(self, i: int, like: Tensor) -> tuple[Tensor, Tensor]:
        if i == len(self.k):
            shape = (self.rows, like.shape[1], self.capacity, like.shape[3])
            self.k.append(like.new_zeros(shape))
            self.v.append(like.new_zeros(shape))
        elif self.k[i].shape[0] < self.rows or self.k[i].shape[2] < self.capacity:  # grown since: copy over
            for buf in (self.k, self.v):
                old = buf[i]
                buf[i] = old.new_zeros((self.rows, old.shape[1], self.capacity, old.shape[3]))
                buf[i][: old.shape[0], :, : old.shape[2]] = old
        return self.k[i], self.v[i]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[Tensor, Tensor]:
        k, v = self._layer(layer_idx, key_states)
        if self._decode:  # key_states: [B, kv_heads, T, head_dim], T = 1 but for speculative verification
            b, t = key_states.shape[0], key_states.shape[2]
            if t == 1:
                k[self._arange, :, self._pos] = key_states[:, :, 0]
                v[self._arange, :, self._pos] = value_states[:, :, 0]
            else:  # row b's tokens at indices pos[b] .. pos[b] + T - 1
                idx = self._pos[:, None] + torch.arange(t, device=self._pos.device)[None]
                k[self._arange[:, None], :, idx] = key_states.transpose(1, 2)
                v[self._arange[:, None], :, idx] = value_states.transpose(1, 2)
            return k[:b, :, : self._kv_len], v[:b, :, : self._kv_len]
        t = key_states.shape[2]
        if self._extend is not None:
            return self._extend_layer(k, v, key_states, value_states, layer_idx)
        k[self._dst, :, :t] = key_states[self._src]
        v[self._dst, :, :t] = value_states[self._src]
        return key_states, value_states

    def _extend_layer(self, k: Tensor, v: Tensor, key_states: Tensor, value_states: Tensor, layer: int
                      ) -> tuple[Tensor, Tensor]:
        start, prefixes, heads = self._extend  # type: ignore[misc]
        for d, s in zip(self._dst.tolist(), self._src.tolist(), strict=True):
            pk, pv = prefixes[s]
            n = pk[layer].shape[1]
            k[d, :, :n] = pk[layer]
            v[d, :, :n] = pv[layer]
        t = key_states.shape[2]
        # padded positions past a row's prompt may land anywhere past it (clamped into the buffer): decode
        # overwrites each position before it is attended to
        idx = (start[:, None] + torch.arange(t, device=start.device)[None]).clamp_max(k.shape[2] - 1)[self._src]
        k[self._dst[:, None], :, idx] = key_states[self._src].transpose(1, 2)
        v[self._dst[:, None], :, idx] = value_states[self._src].transpose(1, 2)
        return k[heads, :, : self._kv_len], v[heads, :, : self._kv_len]

    def move(self, dst: Tensor, src: Tensor) -> None:
        """Slot ``src[i]`` -> slot ``dst[i]`` in every layer."""
        for buf in itertools.chain(self.k, self.v):
            buf[dst] = buf[src]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity


class FastQwen3:
    """The Qwen3 / Qwen3-MoE decoder forward written out as plain tensor ops (no module dispatch).

    The same operations in the same order as transformers' modelling code with sdpa attention (so
    the same numbers: the engine checks bitwise equality against the module forward at start-up and
    falls back to the module forward if they differ), minus the per-module Python overhead, which
    dominates a tiny model on CPU: about 2x faster per step at batch 1, 1.6x at 32. Weights are read
    from the live parameters at every call, so weight updates need nothing here. The MLP is still
    called as a module (dense, or MoE with its router hooks; inlining the dense one measured no faster).

    ``matmul_decode`` (on for an fp32 model on CPU, where it is faster): one-token forwards (decode
    steps) use :func:`decode_attention` instead of sdpa; equal to float rounding, not bitwise, so
    the start-up check compares decode steps to :attr:`decode_atol` and prefills still bitwise.
    Those decode steps also run each layer with fewer, larger ops (:meth:`_decode_layer`): one
    projection for q, k and v, one RMS norm and one rotation (rotate-half as a matmul) over the q
    and k heads together, and one projection for a dense MLP's gate and up, over weights
    concatenated once (:class:`_DecodeWeights`) and again whenever a source tensor was written or
    replaced.
    """

    SUPPORTED = ("qwen3", "qwen3_moe")

    def __init__(self, model: torch.nn.Module) -> None:
        weight = model.get_input_embeddings().weight
        self.matmul_decode = weight.device.type == "cpu" and weight.dtype == torch.float32
        cfg = model.config
        self.model, self.layers = model.base_model, list(model.base_model.layers)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rep = self.heads // self.kv_heads
        rotary = self.model.rotary_emb
        self.inv_freq, self.rope_scaling = rotary.inv_freq, rotary.attention_scaling
        self._decode_weights: dict[int, _DecodeWeights | None] = {}
        self._rot: Tensor | None = None

    @property
    def decode_atol(self) -> float:
        """The start-up check's tolerance on decode steps: 0 (bitwise) unless ``matmul_decode``."""
        return DECODE_ATOL if self.matmul_decode else 0.0

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        cfg = model.config
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        return (cfg.model_type in FastQwen3.SUPPORTED and rope == "default"
                and all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or [])
                and not getattr(cfg, "use_sliding_window", False))

    def _norm(self, module: torch.nn.Module, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # fused, bitwise equal to the module's fp32 math (checked at start-up)
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
        return module(x)

    def __call__(self, ids: Tensor, mask: Tensor, position_ids: Tensor, cache: SlotCache) -> Tensor:
        """ids, position_ids: [B, T]; mask: [B, 1, T, kv] bool -> normed hidden states [B, T, D]."""
        F = torch.nn.functional
        b, t = ids.shape
        h_, kv_, d_ = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.model.embed_tokens.weight)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)[:, None]  # [B, 1, T, hd]
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)[:, None]
        half = d_ // 2
        bias = decode_bias(mask, x.dtype) if self.matmul_decode and t == 1 else None
        for i, layer in enumerate(self.layers):
            fused = self._fused(i, layer) if bias is not None else None
            if fused is not None:
                x = self._decode_layer(x, layer, fused, cos, sin, bias, cache, i)
                continue
            attn = layer.self_attn
            h = self._norm(layer.input_layernorm, x)
            q = self._norm(attn.q_norm, _linear(attn.q_proj, h).view(b, t, h_, d_))
            k = self._norm(attn.k_norm, _linear(attn.k_proj, h).view(b, t, kv_, d_))
            v = _linear(attn.v_proj, h).view(b, t, kv_, d_).transpose(1, 2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = (q * cos) + (torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin)
            k = (k * cos) + (torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin)
            keys, values = cache.update(k, v, i)
            if bias is not None:
                out = decode_attention(q, keys, values, bias, attn.scaling)
            elif self.rep == 1:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            elif t == 1:  # as transformers' pack_gqa: the query heads of a KV head become its rows
                out = F.scaled_dot_product_attention(q.reshape(b, kv_, self.rep, d_), keys, values,
                                                     attn_mask=mask, scale=attn.scaling).reshape(b, -1, 1, d_)
            else:  # as transformers' repeat_kv
                keys = keys[:, :, None].expand(b, kv_, self.rep, *keys.shape[2:]).reshape(b, h_, -1, d_)
                values = values[:, :, None].expand(b, kv_, self.rep, *values.shape[2:]).reshape(b, h_, -1, d_)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            out = out.transpose(1, 2).contiguous().reshape(b, t, -1).contiguous()
            x = x + _linear(attn.o_proj, out)
            x = x + layer.mlp(self._norm(layer.post_attention_layernorm, x))
        return self._norm(self.model.norm, x)

    def _rotation(self, like: Tensor) -> Tensor:
        """``[hd, hd]`` with ``x @ R == cat(-x[..., hd/2:], x[..., :hd/2])`` exactly (one signed 1 per column):
        RoPE's rotate-half as one matmul."""
        if self._rot is None or self._rot.dtype != like.dtype or self._rot.device != like.device:
            d, half = self.head_dim, self.head_dim // 2
            rot = torch.zeros(d, d, dtype=like.dtype, device=like.device)
            idx = torch.arange(half, device=like.device)
            rot[idx + half, idx] = -1.0
            rot[idx, idx + half] = 1.0
            self._rot = rot
        return self._rot

    def forget(self) -> None:
        """Drop every layer's fused weights (the model's weights were given new storage: a shared slot's
        pages can come back at an address, and with a version counter, they had before)."""
        self._decode_weights.clear()

    def _fused(self, i: int, layer: torch.nn.Module) -> _DecodeWeights | None:
        """Layer ``i``'s :class:`_DecodeWeights`, rebuilt when a source tensor changed since they were built."""
        held = self._decode_weights.get(i)
        if held is not None and held.current():
            return held
        if held is None and i in self._decode_weights:
            return None  # the layer cannot be fused (see _DecodeWeights.build)
        built = _DecodeWeights.build(layer, self.heads, self.kv_heads, self.head_dim)
        self._decode_weights[i] = built
        return built

    def _decode_layer(self, x: Tensor, layer: torch.nn.Module, w: _DecodeWeights, cos: Tensor, sin: Tensor,
                      bias: Tensor, cache: SlotCache, i: int) -> Tensor:
        """One decoder layer over one token per row (x: [B, 1, D], fp32) with ``w``'s weights."""
        F = torch.nn.functional
        b, d = x.shape[0], x.shape[-1]
        h_, kv_, d_ = self.heads, self.kv_heads, self.head_dim
        nq, nqk = h_ * d_, (h_ + kv_) * d_
        qkv = F.linear(F.rms_norm(x, (d,), w.in_norm, w.in_eps), w.qkv)  # [B, 1, (H + 2 KV) * hd]
        qk = F.rms_norm(qkv[..., :nqk].view(b, 1, h_ + kv_, d_), (d_,), None, w.qk_eps).mul_(w.qk_norm)
        qk = qk.transpose(1, 2)  # [B, H + KV, 1, hd]
        qk = torch.addcmul(qk * cos, torch.matmul(qk, self._rotation(qk)), sin)
        v = qkv[..., nqk:].view(b, 1, kv_, d_).transpose(1, 2)
        keys, values = cache.update(qk[:, h_:], v, i)
        out = decode_attention(qk[:, :h_], keys, values, bias, w.scaling)
        x = x + F.linear(out.transpose(1, 2).reshape(b, 1, nq), w.o_proj)
        h = F.rms_norm(x, (d,), w.post_norm, w.post_eps)
        if w.gate_up is None:
            return x + w.mlp(h)
        gate_up = F.linear(h, w.gate_up)
        inter = w.gate_up.shape[0] // 2
        return x + F.linear(w.mlp.act_fn(gate_up[..., :inter]) * gate_up[..., inter:], w.down)


class _DecodeWeights:
    """A layer's weights for :meth:`FastQwen3._decode_layer`.

    Concatenated at build: ``qkv`` (the q, k and v projections' rows, in that order), ``qk_norm``
    (``[heads + kv_heads, head_dim]``: q_norm's weight for each query head, then k_norm's for each KV
    head) and ``gate_up`` (a dense MLP's gate then up rows; None for any other MLP, called as ``mlp``).
    Held as the layer's own parameters (read live): ``in_norm``, ``post_norm``, ``o_proj``, ``down``.
    :meth:`current` tells whether the concatenated ones still match their sources (``sources``: the
    parameters, whose data pointer changes when their storage is replaced and whose version counter
    changes when they are written in place).
    """

    def __init__(self, layer: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        dense = _plain_mlp(mlp)
        self.sources: tuple[Tensor, ...] = (
            attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight,
            *((mlp.gate_proj.weight, mlp.up_proj.weight) if dense else ()))
        self.key = self._key()
        self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.qk_norm = torch.cat([attn.q_norm.weight.expand(heads, head_dim),
                                  attn.k_norm.weight.expand(kv_heads, head_dim)])
        self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) if dense else None
        self.qk_eps = attn.q_norm.variance_epsilon
        self.in_norm, self.in_eps = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.post_norm = layer.post_attention_layernorm.weight
        self.post_eps = layer.post_attention_layernorm.variance_epsilon
        self.o_proj, self.scaling, self.mlp = attn.o_proj.weight, attn.scaling, mlp
        self.down = mlp.down_proj.weight if dense else None

    def _key(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.data_ptr(), t._version) for t in self.sources)

    def current(self) -> bool:
        """Whether no source parameter was written or given new storage since the build."""
        return self._key() == self.key

    @staticmethod
    def build(layer: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> _DecodeWeights | None:
        """The layer's weights; None unless q, k, v and o are plain bias-free ``nn.Linear`` layers (not
        LoRA-wrapped) and the two head norms share their epsilon."""
        attn = layer.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        if (any(type(m) is not torch.nn.Linear or m.bias is not None for m in projections)
                or attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon):
            return None
        return _DecodeWeights(layer, heads, kv_heads, head_dim)


def _plain_mlp(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp`` is a dense gated MLP (``down(act(gate(x)) * up(x))``) of plain bias-free linears."""
    names = ("gate_proj", "up_proj", "down_proj")
    return (type(mlp).__name__ == "Qwen3MLP" and hasattr(mlp, "act_fn")
            and all(type(getattr(mlp, n, None)) is torch.nn.Linear and getattr(mlp, n).bias is None for n in names))


def _linear(module: torch.nn.Module, x: Tensor) -> Tensor:
    """A projection: ``F.linear`` on a plain ``nn.Linear``'s weights, else the module itself (a LoRA layer
    adds its adapters' updates, :mod:`miles.adapters.lora`)."""
    if type(module) is torch.nn.Linear:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return module(x)


DECODE_ATOL = 1e-5
"""How far a fast forward with :func:`decode_attention` may be from the module's hidden states (fp32)."""


def decode_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask (True: attend) as the additive bias :func:`decode_attention` takes."""
    return torch.where(mask, 0.0, float("-inf")).to(dtype)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Attention of one query position per row as two batched matmuls around a softmax.

    q: ``[B, H, 1, D]``; keys, values: ``[B, KV, L, D]`` with ``H`` a multiple of ``KV`` (the query
    heads of a KV head become its rows, as transformers' pack_gqa); bias: ``[B, 1, 1, L]``, 0 or
    -inf. Returns ``[B, H, 1, D]``, sdpa's result to float rounding. On CPU, sdpa's flash kernel
    is slow for a single query row: this measured 1.2-2.5x faster at 16-128 rows and 60-250 keys
    (fp32, 2 threads, the 20m model's 8 query / 4 KV heads of 64).
    """
    b, h, _, d = q.shape
    kv = keys.shape[1]
    scores = torch.matmul(q.reshape(b, kv, h // kv, d), keys.transpose(-1, -2)).mul_(scale).add_(bias)
    return torch.matmul(scores.softmax(-1), values).reshape(b, h, 1, d)


def forward_matches(run: Callable[..., Tensor], vocab_size: int, device: torch.device,
                    decode_atol: float = 0.0) -> bool:
    """Whether ``run(fast=True, ...)`` gives ``run(fast=False, ...)``'s hidden states.

    ``run(fast, ids, mask, position_ids, cache)`` is the engine's forward through a :class:`SlotCache`;
    checked over a prefill of two rows of different lengths (bitwise) and two decode steps (bitwise,
    or to ``decode_atol`` when it is > 0: a fast forward with :func:`decode_attention`).
    """
    ids = torch.randint(0, vocab_size, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    lens, arange = torch.tensor([3, 5], device=device), torch.arange(2, device=device)
    positions = torch.arange(8, device=device)
    prefill_mask = (positions[None, :5] <= positions[:5, None])[None] & (positions[None, None, :5] < lens[:, None, None])
    outs = []
    for fast in (False, True):
        cache = SlotCache(2)
        cache.reserve(2, 8)
        cache.prefill(arange, arange)
        hidden = [run(fast, ids, prefill_mask[:, None], positions[:5].expand(2, 5), cache)[arange, lens - 1]]
        pos, tok = lens.clone(), ids[:, 0]
        for _ in range(2):
            cache.decode(arange, pos, int(pos.max()) + 1)
            mask = (positions[: int(pos.max()) + 1][None, :] <= pos[:, None])[:, None, None, :]
            hidden.append(run(fast, tok[:, None], mask, pos[:, None], cache)[:, -1])
            pos = pos + 1
        outs.append(hidden)
    (prefill, *decode), (fast_prefill, *fast_decode) = outs
    if not torch.equal(prefill, fast_prefill):
        return False
    if decode_atol > 0:
        return all(torch.allclose(a, f, rtol=0, atol=decode_atol) for a, f in zip(decode, fast_decode, strict=True))
    return all(torch.equal(a, f) for a, f in zip(decode, fast_decode, strict=True))
