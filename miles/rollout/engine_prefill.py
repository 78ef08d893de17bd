"""Admission and prefill of :class:`miles.rollout.torch_engine.TorchEngine` (a base of the engine class, like
:mod:`.engine_intake` and the others).

On the scheduler thread, before each decode step, :meth:`EnginePrefill._admit` moves waiting rows into free
slots within ``max_prefill_tokens`` (and, while rows run, only once ``admit_batch`` slots are free), and
:meth:`EnginePrefill._prefill` runs one forward over their distinct prompts: the ``n`` rows of one request
share a prompt, computed once and copied into each row's slot. Prompts that continue a session's stored
prefix (:mod:`miles.rollout.prefix_cache`) are computed from where it ends, in a forward of their own.
Each row then samples its first token from the prompt's last position.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from miles.rollout.engine_rows import _Row
from miles.rollout.prefix_cache import PrefixEntry


class EnginePrefill:
    """Admission of waiting rows and their prefill (see the module docstring); the engine's constructor and
    its other bases provide the state and the helpers used here."""

    def _admit(self) -> None:
        """Move waiting rows into free slots, within the prefill token budget, and prefill them."""
        free = self.max_batch_size - self._n
        if not free or not self._waiting:
            return
        if self._n and free < min(self.admit_batch, len(self._waiting)):
            return  # wait until a prefill can take several rows at once (see admit_batch)
        take: list[_Row] = []
        with self._cv:
            prompts, longest = 0, 0
            while self._waiting and len(take) < free:
                row = self._waiting[0]
                if not take or row.request is not take[-1].request or row.job is not take[-1].job:
                    longest_next = max(longest, len(row.request.prompt_ids))
                    if take and (prompts + 1) * longest_next > self.max_prefill_tokens:
                        break
                    prompts, longest = prompts + 1, longest_next
                take.append(self._waiting.popleft())
        self._prefill(take)

    def _prefill(self, rows: list[_Row]) -> None:
        """Forwards over the rows' distinct prompts (one for whole prompts, one for prompts continuing a
        stored prefix); each row samples its first token."""
        self._ensure_capacity(rows)
        groups: list[list[_Row]] = []
        for r in rows:
            if groups and groups[-1][0].request is r.request and groups[-1][0].job is r.job:
                groups[-1].append(r)
            else:
                groups.append([r])
        if not self._prefix.enabled:
            self._prefill_groups(groups, [None] * len(groups))
            return
        hits = []
        for g in groups:
            req = g[0].request
            self._prefix.prompt_tokens += len(req.prompt_ids)
            hits.append(self._prefix.lookup(req.session_id, req.prompt_ids, self._version, req.adapter,
                                            req.images.digests if req.images is not None else ()))
        for reuse in (False, True):
            part = [(g, h) for g, h in zip(groups, hits, strict=True) if (h is not None) == reuse]
            if part:
                self._prefill_groups([g for g, _ in part], [h for _, h in part])

    def _prefill_groups(self, groups: list[list[_Row]], hits: list[PrefixEntry | None]) -> None:
        """One forward over ``groups``' prompts, each from the end of its stored prefix (``hits``) or whole."""
        rows = [r for g in groups for r in g]
        start = [len(h.ids) if h is not None else 0 for h in hits]
        lens = [len(g[0].request.prompt_ids) - s for g, s in zip(groups, start, strict=True)]  # tokens to compute
        u, t = len(groups), max(lens)
        ids = torch.full((u, t), self.pad_id, dtype=torch.long)
        for i, g in enumerate(groups):
            ids[i, : lens[i]] = torch.tensor(g[0].request.prompt_ids[start[i]:], dtype=torch.long)
        src = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=self.device)
        lens_t = torch.tensor(lens, device=self.device)
        start_t = torch.tensor(start, device=self.device)
        lo, hi = self._n, self._n + len(rows)
        self._set_rows(lo, rows, (start_t + lens_t)[src])
        for r in rows:
            r.prefill_version = self._version
        positions = self._positions[:t]
        if any(h is not None for h in hits):
            query_pos = start_t[:, None] + positions[None]  # [u, t]
            kv_len = min(int(query_pos.max()) + 1, self._cache.capacity)
            mask = (self._positions[None, None, :kv_len] <= query_pos[:, :, None])[:, None]  # [u, 1, t, kv_len]
            self._cache.extend(self._arange[lo:hi], src, start_t,
                               [(h.k, h.v) for h in hits if h is not None], kv_len)
            position_ids = query_pos
        else:
            mask = ((positions[None, :] <= positions[:, None])[None]
                    & (positions[None, None, :] < lens_t[:, None, None]))[:, None]
            self._cache.prefill(self._arange[lo:hi], src)
            position_ids = positions.expand(u, t)
        embeds = None
        if self.vision:
            embeds, position_ids, deltas = self._vision_inputs(groups, start, lens, ids.to(self.device))
            self._st["delta"][lo:hi] = deltas[src]
        hidden = self._forward(ids.to(self.device), mask, position_ids, [g[0] for g in groups], embeds)
        last = lens_t - 1
        hidden_last = hidden[torch.arange(u, device=self.device), last]
        logits = self._head(hidden_last, [g[0] for g in groups])[src]
        if self.draft is not None:
            self._draft_prefill([tuple(g[0].request.prompt_ids) for g in groups], lo, hi, src, hidden_last)
        routing = None
        if self._routers:  # per layer [u * t, k] -> [u, t, layers, k]
            routes = torch.stack([r.view(u, t, -1) for r in self._step_routing], 2)
            routing = routes[torch.arange(u, device=self.device), last][src]  # each prompt's last position
            for i, g in enumerate(groups):  # positions 0 .. P-2: the prompt tokens before the last
                prompt_route = routes[i, : lens[i] - 1].to(torch.int16).cpu()
                for r in g:
                    r.prompt_route = prompt_route
        stopped = self._emit(lo, hi, logits, routing)
        now = time.perf_counter()  # the rows' first tokens are sampled (their time to first token)
        for r in rows:
            r.ttft_s = now - r.received
        self._finish_rows(stopped)

    def _set_rows(self, lo: int, rows: list[_Row], prompt_lens: Tensor) -> None:
        """Write the rows' options into slots ``[lo, lo + len(rows))`` and mark them occupied."""
        hi = lo + len(rows)
        st, dev = self._st, self.device
        sps = [r.sampling for r in rows]
        st["temp"][lo:hi] = torch.tensor([1.0 if r.greedy else r.sampling.temperature for r in rows], device=dev)
        st["greedy"][lo:hi] = torch.tensor([r.greedy for r in rows], device=dev)
        st["top_k"][lo:hi] = torch.tensor([0 if r.greedy else r.sampling.top_k for r in rows], device=dev)
        st["top_p"][lo:hi] = torch.tensor([1.0 if r.greedy else r.sampling.top_p for r in rows], device=dev)
        st["max_new"][lo:hi] = torch.tensor([sp.max_new_tokens for sp in sps], device=dev)
        st["stop"][lo:hi] = -1
        for i, sp in enumerate(sps):
            if sp.stop_token_ids:
                st["stop"][lo + i, : len(sp.stop_token_ids)] = torch.tensor(sp.stop_token_ids, device=dev)
        st["pos"][lo:hi] = prompt_lens
        st["ngen"][lo:hi] = 0
        st["delta"][lo:hi] = 0
        st["nidx"][lo:hi] = 0
        st["sidx"][lo:hi] = self.spec_noise_rounds  # spent: a speculating row draws at its first round
        drawing = [i for i, r in enumerate(rows) if r.generator is not None]
        if drawing:
            self._draw_noise([lo + i for i in drawing], [rows[i].generator for i in drawing],  # type: ignore[misc]
                             [0] * len(drawing), [sps[i].max_new_tokens for i in drawing])
        for i, r in enumerate(rows):
            self._rows[lo + i] = r
            self._count.update(r.features)
        self._n = hi
