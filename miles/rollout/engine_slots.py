"""The slot storage of :class:`miles.rollout.torch_engine.TorchEngine` and its MoE routing capture.

A base of the engine class (like :mod:`.engine_intake` and the others). Every running row holds one slot:
the per-slot tensors (``self._st``, first dimension = slot) keep its next token, position, sampling
settings, noise and outputs, and the cache (:class:`miles.rollout.slot_cache.SlotCache`) its K/V. The
buffers whose size depends on the requests (outputs, top-k log-probs, stops, routes, the cache) start
empty and grow by doubling as rows that need more are admitted.

MoE routing capture (``capture_routing=True``): forward hooks on the router
modules (``*.mlp.gate`` with a ``top_k``, e.g. ``Qwen3MoeTopKRouter``, whose
output is ``(logits, weights, indices)``) record, for each generated token, the
experts chosen in every MoE layer at the forward step that produced that
token's distribution, i.e. at input position ``P - 1 + t`` for response token
``t`` of a prompt of length ``P``: exactly the positions whose logits the
trainer's forward over prompt + response scores. ``GenerateResult.routing`` is
an int16 tensor ``[T, moe_layers, top_k]``; ``GenerateResult.prompt_routing``
(``[P - 1, moe_layers, top_k]``) holds the prefill's routes of positions
``0 .. P - 2``, so the two together cover every position ``0 .. P + T - 2`` of
that forward (routing replay, :mod:`miles.train.routing_replay`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from miles.rollout.engine_rows import _Row
from miles.rollout.slot_cache import SlotCache, pow2_at_least


class EngineSlots:
    """Per-slot tensors, their growth, and the router hooks (see the module docstring)."""

    def _alloc_slots(self) -> None:
        """Per-slot tensors (first dim = slot); capacity-dependent buffers start empty and grow."""
        s, v = self.max_batch_size, self.vocab_size
        long = dict(dtype=torch.long, device=self.device)
        self._st: dict[str, Tensor] = {
            "tok": torch.zeros(s, **long), "pos": torch.zeros(s, **long), "ngen": torch.zeros(s, **long),
            "max_new": torch.ones(s, **long), "top_k": torch.zeros(s, **long),
            "nidx": torch.zeros(s, **long), "nlen": torch.ones(s, **long), "stop": torch.full((s, 1), -1, **long),
            "delta": torch.zeros(s, **long),  # mRoPE: position of cache index t is t + delta
            "temp": torch.ones(s, device=self.device), "top_p": torch.ones(s, device=self.device),
            "greedy": torch.zeros(s, dtype=torch.bool, device=self.device),
            "noise": torch.zeros(s, self.noise_chunk, v, device=self.device),
            "out_tok": torch.zeros(s, 0, **long), "out_lp": torch.zeros(s, 0, device=self.device),
            "out_ver": torch.zeros(s, 0, **long),
            "prev": torch.zeros(s, **long), "spec_prop": torch.zeros(s, **long), "spec_acc": torch.zeros(s, **long),
            # speculative rounds' uniform draws, spec_noise_rounds at a time (spec_noise_buffer), and the next one
            "snoise": self._spec_noise_buffer(), "sidx": torch.zeros(s, **long),
            # draft heads: the final hidden state of each row's last fed token (what the heads propose from)
            "hid": torch.zeros(s, self._hidden_size() if self._draft_heads() else 0, dtype=self.dtype,
                               device=self.device),
            "top_v": torch.zeros(s, 0, 0, device=self.device), "top_i": torch.zeros(s, 0, 0, **long),
            "route": torch.zeros(s, 0, len(self._routers), self._router_top_k(), dtype=torch.int16,
                                 device=self.device),
        }
        self._rows: list[_Row | None] = [None] * s
        self._n = 0  # occupied slots are [0, n)
        self._count: Counter[str] = Counter()  # features of the occupied rows
        self._arange = torch.arange(s, device=self.device)
        self._positions = torch.arange(self.max_positions or 1 << 16, device=self.device)
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        self._cache = SlotCache(s)

    def _spec_noise_buffer(self) -> Tensor:
        """Per slot, the U[0, 1) draws of ``spec_noise_rounds`` speculative rounds ``[R, 2k + 1]`` (uninitialised: a
        row draws before it reads)."""
        return torch.empty(self.max_batch_size, self.spec_noise_rounds, 2 * self.draft_k + 1, device=self.device)

    def _draft_heads(self) -> bool:
        """Whether the draft is the policy's own heads (:class:`~miles.rollout.speculative.DraftHeads`)."""
        return self.draft is not None and self.draft.cache is None

    def _hidden_size(self) -> int:
        return int(self.model.config.get_text_config().hidden_size)

    def _grow(self, name: str, dim: int, size: int, fill: int = 0) -> None:
        """Widen ``self._st[name]`` along ``dim`` to ``size`` (new entries ``fill``), keeping its contents."""
        t = self._st[name]
        if t.shape[dim] >= size:
            return
        shape = list(t.shape)
        shape[dim] = size
        new = t.new_full(shape, fill)
        new.narrow(dim, 0, t.shape[dim]).copy_(t)
        self._st[name] = new

    def _ensure_capacity(self, rows: list[_Row]) -> None:
        """Grow the cache and output buffers (by doubling) so that ``rows``, joining the ``n`` running ones, fit."""
        need_new = max(r.sampling.max_new_tokens for r in rows)
        need_len = max(len(r.request.prompt_ids) + r.sampling.max_new_tokens for r in rows)
        cap_new = pow2_at_least(need_new)
        for name in ("out_tok", "out_lp", "out_ver", "top_v", "top_i", "route"):
            self._grow(name, 1, cap_new)
        self._grow("top_v", 2, max(r.sampling.logprobs_top_k for r in rows))
        self._grow("top_i", 2, self._st["top_v"].shape[2])
        self._grow("stop", 1, max(len(r.sampling.stop_token_ids) for r in rows), fill=-1)  # -1: no stop
        if self.draft is None:
            self._cache.reserve(self._n + len(rows), need_len, self.max_positions)
            return
        # a speculative round writes up to draft_k positions past a row's last token
        extra = self.draft_k + 1
        for cache in (self._cache, self.draft.cache) if self.draft.cache is not None else (self._cache,):
            cache.reserve(self._n + len(rows), need_len + extra, self.max_positions and self.max_positions + extra)

    # ---- MoE routing --------------------------------------------------------------------------

    def _hook_routers(self) -> list[torch.nn.Module]:
        routers = [m for name, m in self.model.named_modules()
                   if name.endswith(".mlp.gate") and hasattr(m, "top_k")]
        if not routers:
            raise ValueError(f"capture_routing=True needs an MoE model with router modules (*.mlp.gate with a "
                             f"top_k); {self.checkpoint_dir} is a {self.model.config.model_type!r} model without")
        for i, m in enumerate(routers):
            m.register_forward_hook(lambda _m, _in, out, i=i: self._step_routing.__setitem__(i, out[2]))
        return routers

    def _router_top_k(self) -> int:
        return int(self._routers[0].top_k) if self._routers else 0
