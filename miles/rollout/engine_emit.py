"""Sampling, stops and results of :class:`miles.rollout.torch_engine.TorchEngine`, on its scheduler thread.

:class:`EngineEmission` samples each occupied slot's next token from its logits (exponential race over
the row's pre-drawn noise), records it with its log-prob, top-k log-probs and routing, detects stops
(EOS, stop token, stop string, length), builds each stopped row's :class:`~miles.types.GenerateResult`,
stores its K/V in the prefix cache, hands it to the waiting ``generate`` call and compacts the
occupied slots. It also aborts and fails rows, and generates the one-row-at-a-time ``true_on_policy``
results.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

import torch
from torch import Tensor

from miles.precision.on_policy import generate_exact
from miles.rollout.engine_rows import _Row
from miles.rollout.prefix_cache import PrefixEntry, PrefixStore
from miles.rollout.sampling import filter_logits_rows
from miles.rollout.slot_cache import SlotCache
from miles.types import GenerateResult, Status, session_key

_TINY = torch.finfo(torch.float32).tiny

FIRST_NOISE_CHUNK = 4
"""Steps of noise a row draws first: many answers end within a few tokens, and a draw of 16 steps
costs about 4x one of 4 (V = 286, one thread: 85 against 19 us)."""


class EngineEmission:
    """Token emission, stop handling and result delivery; a base of
    :class:`~miles.rollout.torch_engine.TorchEngine`, whose constructor sets the attributes below."""

    model: Any
    eos_ids: list[int]
    pad_id: int
    max_batch_size: int
    noise_chunk: int
    device: torch.device
    _version: int
    _st: dict[str, Tensor]
    _rows: list[_Row | None]
    _n: int
    _count: Counter[str]
    _arange: Tensor
    _eos: Tensor
    _cache: SlotCache
    draft: Any  # miles.rollout.speculative.DraftModel, or None
    _prefix: PrefixStore
    _routers: list[torch.nn.Module]
    _cv: threading.Condition
    _waiting: deque[_Row]


    _never_sample: Tensor | None = None
    """Token ids never sampled (a VLM's vision tokens), or None."""

    def _exact_result(self, row: _Row) -> GenerateResult:
        """One completion through :func:`miles.precision.on_policy.generate_exact` (``true_on_policy``)."""
        sp = row.sampling
        if sp.top_p < 1.0 or sp.top_k > 0 or sp.stop or sp.logprobs_top_k:
            raise ValueError("precision.true_on_policy=true samples from the full temperature-scaled distribution "
                             f"and stops on token ids only; got top_p={sp.top_p}, top_k={sp.top_k}, "
                             f"stop={sp.stop!r}, logprobs_top_k={sp.logprobs_top_k}")
        def first_token() -> None:
            row.ttft_s = time.perf_counter() - row.received

        tokens, logps, reason = generate_exact(
            self.model, list(row.request.prompt_ids), max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature, greedy=row.greedy, generator=row.generator,
            stop_ids=set(self.eos_ids) | set(sp.stop_token_ids), pad_id=self.pad_id, on_first_token=first_token)
        if reason == "eos" and tokens[-1] not in self.eos_ids:
            reason = "stop_token"
        return GenerateResult(request_id=row.request.request_id, index=row.index, response_ids=tuple(tokens),
                              logprobs=tuple(logps), status=Status.TRUNCATED if reason == "length" else Status.COMPLETED,
                              weight_version=self._version, finish_reason=reason, ttft_s=row.ttft_s)

    def _draw_noise(self, slots: list[int], generators: list[torch.Generator], ngen: list[int],
                    max_new: list[int]) -> None:
        """The rows' next steps of noise: ``-log E`` with ``E ~ Exp(1)`` into each slot's first ``n`` rows.

        Slot ``slots[i]`` has sampled ``ngen[i]`` of its ``max_new[i]`` tokens and draws from
        ``generators[i]``. ``n`` is ``FIRST_NOISE_CHUNK`` for a row's first draw and ``noise_chunk`` after
        it, never more than the steps the row has left. The generator's stream is the same however it is
        cut into draws, so a row's noise at step ``t`` is its stream's ``t``-th block of ``V`` draws: only
        the draws a short answer never reads are saved. Each row draws from its own generator; the
        ``-log`` runs once over all the rows' steps (a row never reads its steps past ``n``).
        """
        st, noise = self._st, self._st["noise"]
        first = min(FIRST_NOISE_CHUNK, self.noise_chunk)
        ns = [max(1, min(self.noise_chunk if g else first, m - g)) for g, m in zip(ngen, max_new, strict=True)]
        for slot, gen, n in zip(slots, generators, ns, strict=True):
            buf = noise[slot, :n]
            if buf.device.type == "cpu":
                buf.exponential_(generator=gen)
            else:
                buf.copy_(torch.empty(buf.shape).exponential_(generator=gen))
        width, lo, hi = max(ns), slots[0], slots[0] + len(slots)
        lens = torch.tensor(ns, device=noise.device)
        if slots == list(range(lo, hi)):  # rows admitted together: one block, transformed in place
            noise[lo:hi, :width].clamp_min_(_TINY).log_().neg_()
            st["nlen"][lo:hi] = lens
        else:
            idx = torch.tensor(slots, device=noise.device)
            noise[idx, :width] = noise[idx, :width].clamp_min_(_TINY).log_().neg_()
            st["nlen"][idx] = lens

    def _emit(self, lo: int, hi: int, logits: Tensor, routing: Tensor | None) -> list[tuple[int, str]]:
        """Sample one token for slots ``[lo, hi)`` from ``logits [hi - lo, V]`` (fp32), record it with
        its log-prob (and top-k log-probs, routing), and return the rows that stopped: (slot, reason)."""
        st, count, sl = self._st, self._count, slice(lo, hi)
        rows = self._arange[sl]
        scaled = logits / st["temp"][sl, None] if count["temp"] else logits
        logp = scaled.log_softmax(dim=-1)
        refill: list[int] = []  # rows (from lo) whose noise chunk is spent
        if count["sampled"]:
            z = filter_logits_rows(scaled, st["top_k"][sl], st["top_p"][sl]) if count["filter"] else scaled
            if self._never_sample is not None:  # a VLM's vision tokens: filtered out like top-k, logp unchanged
                z = z.index_fill(1, self._never_sample, float("-inf"))
            nidx = st["nidx"][sl]
            gumbel = st["noise"][rows, nidx]  # -log E: [B, V]
            if count["greedy"]:
                gumbel.masked_fill_(st["greedy"][sl, None], 0.0)
            tok = (z + gumbel).argmax(dim=-1)
            nidx += 1
            spent = nidx == st["nlen"][sl]
            if bool(spent.any()):
                refill = spent.nonzero()[:, 0].tolist()
                nidx.masked_fill_(spent, 0)
        else:
            z = logits if self._never_sample is None else logits.index_fill(1, self._never_sample, float("-inf"))
            tok = z.argmax(dim=-1)
        ngen = st["ngen"][sl]
        st["out_tok"][rows, ngen] = tok
        st["out_lp"][rows, ngen] = logp.gather(1, tok[:, None])[:, 0]
        st["out_ver"][rows, ngen] = self._version
        if count["top_logprobs"]:
            top_v, top_i = logp.topk(st["top_v"].shape[2], dim=-1)
            st["top_v"][rows, ngen], st["top_i"][rows, ngen] = top_v, top_i
        if routing is not None:
            st["route"][rows, ngen] = routing.to(torch.int16)
        ngen += 1
        st["tok"][sl] = tok
        # reason codes: 1 eos, 2 stop token, 3 length (first that applies)
        code = torch.where(ngen >= st["max_new"][sl], 3, 0)
        if count["stop_ids"]:
            code = torch.where((tok[:, None] == st["stop"][sl]).any(dim=1), 2, code)
        code = torch.where(torch.isin(tok, self._eos), 1, code)
        stopped: list[tuple[int, str]] = []
        if bool(code.any()):
            names = ("", "eos", "stop_token", "length")
            stopped = [(lo + b, names[c]) for b, c in enumerate(code.tolist()) if c]
        if count["stop_text"]:
            done = {s for s, _ in stopped}
            stopped += [(s, "stop_string") for s in range(lo, hi) if s not in done and self._hit_stop_text(s)]
        if refill:  # the next chunk, for rows that go on (a stopped row never samples again)
            done = {s for s, _ in stopped}
            slots = [lo + b for b in refill if lo + b not in done and self._rows[lo + b].generator is not None]  # type: ignore[union-attr]
            if slots:
                idx = torch.tensor(slots, device=self.device)
                self._draw_noise(slots, [self._rows[s].generator for s in slots],  # type: ignore[union-attr,misc]
                                 st["ngen"][idx].tolist(), st["max_new"][idx].tolist())
        return stopped

    def _hit_stop_text(self, slot: int) -> bool:
        row = self._rows[slot]
        assert row is not None
        if not row.sampling.stop:
            return False
        n = int(self._st["ngen"][slot])
        window = 4 * max(len(s) for s in row.sampling.stop) + 4  # >= 1 byte per token, <= 4 bytes per char
        text = self._get_tokenizer().decode(self._st["out_tok"][slot, max(0, n - window) : n].tolist(),
                                            skip_special_tokens=False)
        return any(s in text for s in row.sampling.stop)

    def _finish_rows(self, stopped: list[tuple[int, str]]) -> None:
        """Deliver the stopped rows' results and compact the occupied slots to ``[0, n - stopped)``."""
        if not stopped:
            return
        for slot, reason in stopped:
            row = self._rows[slot]
            assert row is not None
            result = self._result(slot, reason)
            if self._prefix.enabled and row.request.session_id is not None and reason != "abort":
                self._keep_prefix(slot, row, result)
            self._deliver(row, result)
            self._count.subtract(row.features)
        n, gone = self._n, {s for s, _ in stopped}
        keep = n - len(gone)
        holes = sorted(s for s in gone if s < keep)
        movers = [s for s in range(keep, n) if s not in gone]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for t in self._st.values():
                t[dst] = t[src]
            self._cache.move(dst, src)
            if self.draft is not None and self.draft.cache is not None:
                self.draft.cache.move(dst, src)
            for d, s in zip(holes, movers, strict=True):
                self._rows[d] = self._rows[s]
        for s in range(keep, n):
            self._rows[s] = None
        self._n = keep

    def _keep_prefix(self, slot: int, row: _Row, result: GenerateResult) -> None:
        """Store the slot's K/V (prompt and response but the last token, never fed back) under the row's
        session key, if no weight update happened while the row ran."""
        if row.prefill_version != self._version or not result.response_ids:
            return
        ids = tuple(row.request.prompt_ids) + result.response_ids[:-1]
        k, v = self._cache.read(slot, len(ids))
        key = session_key(row.request.session_id, row.request.n, row.index)  # type: ignore[arg-type]
        imgs = row.request.images
        self._prefix.put(key, PrefixEntry(ids=ids, k=k, v=v, version=self._version, adapter=row.request.adapter,
                                          images=imgs.digests if imgs is not None else ()))

    def _result(self, slot: int, reason: str) -> GenerateResult:
        row, st = self._rows[slot], self._st
        assert row is not None
        n = int(st["ngen"][slot])
        top = None
        if row.sampling.logprobs_top_k:
            k = row.sampling.logprobs_top_k
            ids, vals = st["top_i"][slot, :n, :k].tolist(), st["top_v"][slot, :n, :k].tolist()
            top = tuple(tuple(zip(i, v, strict=True)) for i, v in zip(ids, vals, strict=True))
        status = {"length": Status.TRUNCATED, "abort": Status.ABORTED}.get(reason, Status.COMPLETED)
        return GenerateResult(
            request_id=row.request.request_id, index=row.index, response_ids=tuple(st["out_tok"][slot, :n].tolist()),
            logprobs=tuple(st["out_lp"][slot, :n].tolist()), status=status, weight_version=self._version,
            token_versions=tuple(st["out_ver"][slot, :n].tolist()), finish_reason=reason, top_logprobs=top,
            routing=st["route"][slot, :n].cpu().clone() if self._routers else None,
            prompt_routing=row.prompt_route if self._routers else None,
            spec_counts=(int(st["spec_prop"][slot]), int(st["spec_acc"][slot])) if self.draft is not None else None,
            ttft_s=row.ttft_s,
        )

    @staticmethod
    def _deliver(row: _Row, result: GenerateResult) -> None:
        job = row.job
        job.results[row.request_pos][row.index] = result
        job.remaining -= 1
        if job.remaining == 0:
            job.done.set()

    def _abort(self, request_ids: set[str]) -> int:
        hit: set[str] = set()
        with self._cv:
            queued = [r for r in self._waiting if r.request.request_id in request_ids]
            self._waiting = deque(r for r in self._waiting if r.request.request_id not in request_ids)
        for r in queued:
            hit.add(r.request.request_id)
            self._deliver(r, GenerateResult(request_id=r.request.request_id, index=r.index, response_ids=(),
                                            logprobs=(), status=Status.ABORTED, weight_version=self._version,
                                            finish_reason="abort", routing=None))
        running = [s for s in range(self._n) if self._rows[s].request.request_id in request_ids]  # type: ignore
        hit.update(self._rows[s].request.request_id for s in running)  # type: ignore[union-attr]
        self._finish_rows([(s, "abort") for s in running])
        return len(hit)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            rows = [r for r in self._rows[: self._n] if r is not None] + list(self._waiting)
            self._waiting.clear()
        for r in rows:
            r.job.error = error
            r.job.done.set()
        self._rows = [None] * self.max_batch_size
        self._n = 0
        self._count.clear()
