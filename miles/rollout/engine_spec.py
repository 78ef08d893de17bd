"""Speculative decode steps of :class:`miles.rollout.torch_engine.TorchEngine` (``draft_checkpoint_dir``).

With a draft (:class:`miles.rollout.speculative.DraftModel`), a decode step over the ``b`` occupied slots
is one speculative round instead of one token:

1. The draft proposes ``k`` tokens per row, sampling each from its own filtered, temperature-scaled
   distribution ``q``: a first forward over the row's last two tokens (positions ``pos - 1, pos``: it
   refills the one position the draft skipped when the round before accepted everything), then
   ``k - 1`` one-token forwards through its own slot cache.
2. The policy scores the current token and the ``k`` proposals in one forward (``k + 1`` positions per
   row, written into its cache at ``pos .. pos + k``, each attending to the indices up to its own).
3. :func:`miles.rollout.speculative.speculative_accept` keeps ``a`` proposals and one more token
   (resampled or bonus): ``a + 1`` tokens per row, cut at the first EOS / stop token / stop string and at
   ``max_new_tokens``. Each gets its log-prob under the policy (``log_softmax(z / T)``, unfiltered), as
   without a draft.
4. Rewinding is implicit: a row's position moves only past the tokens it kept. K/V written for rejected
   proposals (in both caches) lie past it, are never attended to (attention reads indices up to each
   query's position) and are overwritten by the next round before anything reads them.

Random numbers come from each row's own generator (its seed): per round ``2k + 1`` uniforms, drawn 16
rounds at a time, give the draft's ``k`` proposals and the final token by inverse-CDF sampling
(:func:`miles.rollout.speculative.sample_inverse_cdf`: one uniform per token, where Gumbel-max needs one
exponential per vocabulary entry) and the ``k`` acceptance tests. A row's tokens therefore depend on its
seed and the weights, not on its neighbours; they differ from a run without the draft (other draws), while
their distribution is the same. Per completion the engine counts proposed and accepted tokens
(``GenerateResult.spec_counts``), from which the rollout reports ``rollout/spec_accept_rate``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from miles.rollout.engine_rows import _Row
from miles.rollout.sampling import filter_logits_rows
from miles.rollout.slot_cache import SlotCache
from miles.rollout.speculative import DraftHeads, DraftModel, sample_inverse_cdf, speculative_accept


class EngineSpeculation:
    """Speculative decode rounds; a base of :class:`~miles.rollout.torch_engine.TorchEngine`, whose
    constructor sets the attributes below."""

    draft: DraftModel | DraftHeads | None
    draft_k: int
    draft_version: int
    spec_noise_rounds: int
    vocab_size: int
    device: torch.device
    _version: int
    _st: dict[str, Tensor]
    _rows: list[_Row | None]
    _n: int
    _count: Counter[str]
    _arange: Tensor
    _positions: Tensor
    _eos: Tensor
    _cache: SlotCache
    _lm_head: Any
    _forward: Callable[[Tensor, Tensor, Tensor, list[_Row]], Tensor]  # TorchEngine's
    _hit_stop_text: Callable[[int], bool]  # EngineEmission's

    @torch.no_grad()
    def update_draft(self, state_dict: dict[str, Tensor], version: int) -> dict[str, float]:
        """Replace every weight of the draft (HF names, as :class:`miles.train.draft.DraftTrainer` sends them)
        between two scheduler steps; ``version`` is the policy version it was pushed with.

        All checks happen before any copy: on a ``ValueError`` the draft is unchanged. Rows in flight keep
        the K/V the old draft wrote; the tokens they emit stay exact (the accept rule uses the ``q`` each
        proposal was sampled from), only their acceptance can differ. Returns ``{"draft_update_s"}``.
        """
        t0 = time.perf_counter()
        if self.draft is None:
            raise ValueError(f"update_draft(version={version}): this engine has no draft model (draft.model)")
        own = self.draft.model.state_dict()
        missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
        bad = [f"{k}: sent {tuple(v.shape)}, expected {tuple(own[k].shape)}"
               for k, v in state_dict.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
        if missing or unexpected or bad:
            raise ValueError(f"update_draft(version={version}): send the draft's full HF state dict; missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}, wrong shapes {bad[:5]}")

        def apply() -> None:
            for k, v in state_dict.items():
                own[k].copy_(v)  # shares the version counter with the parameter: fused decode weights refresh
            self.draft_version = int(version)

        self._run_op(apply)  # type: ignore[attr-defined]
        return {"draft_update_s": time.perf_counter() - t0}

    def _draft_prefill(self, prompts: list[tuple[int, ...]], lo: int, hi: int, src: Tensor, hidden: Tensor) -> None:
        """Slots ``[lo, hi)`` take prompt ``prompts[src[i]]``: a draft model's K/V of the whole prompts, or (draft
        heads) the policy's hidden state of each prompt's last token (``hidden`` [prompts, D])."""
        assert self.draft is not None
        self._st["spec_prop"][lo:hi] = 0
        self._st["spec_acc"][lo:hi] = 0
        if self.draft.cache is None:
            self._st["hid"][lo:hi] = hidden[src]
            return
        lens = [len(p) for p in prompts]
        u, t = len(prompts), max(lens)
        ids = torch.zeros((u, t), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : lens[i]] = torch.tensor(p, dtype=torch.long)
        lens_t = torch.tensor(lens, device=self.device)
        positions = self._positions[:t]
        mask = (
            (positions[None, :] <= positions[:, None])[None]
            & (positions[None, None, :] < lens_t[:, None, None])
        )[:, None]
        self.draft.cache.prefill(self._arange[lo:hi], src)
        self.draft.forward(ids.to(self.device), mask, positions.expand(u, t))
        self._st["prev"][lo:hi] = ids.to(self.device)[src, (lens_t - 1)[src]]

    def _round_noise(self, b: int, k: int) -> Tensor:
        """Each row's ``2k + 1`` U[0, 1) draws for one round [b, 2k + 1]: the draft's ``k`` proposals, the ``k``
        acceptance tests, the final token. A row draws ``spec_noise_rounds`` rounds at once from its own generator
        (one call instead of one per round) and reads one per round; greedy rows use none of them."""
        st = self._st
        sidx = st["sidx"][:b]
        spent = (sidx >= self.spec_noise_rounds).nonzero().flatten().tolist()
        for i in spent:
            gen, buf = self._rows[i].generator, st["snoise"][i]  # type: ignore[union-attr]
            if gen is None:
                buf.fill_(0.5)
            elif buf.device.type == "cpu":
                buf.uniform_(generator=gen)
            else:
                buf.copy_(torch.rand(buf.shape, generator=gen))
        if spent:
            sidx[spent] = 0
        u = st["snoise"][self._arange[:b], sidx]
        sidx += 1
        return u

    def _filtered(self, logits: Tensor) -> Tensor:
        """``filter(z / T)`` with each slot's settings, as plain sampling races on: logits [b, V] or [b, m, V] (slot
        ``i``'s ``m`` positions), the first ``b`` slots'."""
        b, v, st = logits.shape[0], logits.shape[-1], self._st
        flat = logits.reshape(-1, v)
        m = flat.shape[0] // b

        def per_row(t: Tensor) -> Tensor:
            return t[:b].repeat_interleave(m) if m > 1 else t[:b]

        scaled = flat / per_row(st["temp"])[:, None] if self._count["temp"] else flat
        if self._count["filter"]:
            scaled = filter_logits_rows(scaled, per_row(st["top_k"]), per_row(st["top_p"]))
        return scaled.view(logits.shape)

    def _propose(self, z: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """Proposals from filtered draft logits ``z`` [b, ..., V] with the uniforms ``u`` [b, ...] (inverse CDF; the
        argmax for greedy rows) -> (proposals [b, ...], q [b, ..., V])."""
        q = z.softmax(dim=-1)
        if not self._count["sampled"]:
            return z.argmax(dim=-1), q
        d = sample_inverse_cdf(q, u)
        if self._count["greedy"]:
            greedy = self._st["greedy"][: z.shape[0]].view(-1, *([1] * (d.dim() - 1)))
            d = torch.where(greedy, z.argmax(dim=-1), d)
        return d, q

    def _spec_decode(self) -> list[tuple[int, str]]:
        """One speculative round for every occupied slot; returns the rows that stopped."""
        assert self.draft is not None
        b, st, k = self._n, self._st, self.draft_k
        arange = self._arange[:b]
        pos, tok = st["pos"][:b], st["tok"][:b]
        temp, greedy = st["temp"][:b], st["greedy"][:b]
        u = self._round_noise(b, k)
        # 1. draft proposals
        heads = self.draft.cache is None
        draft, q = self._head_proposals(b, u[:, :k]) if heads else self._model_proposals(b, u[:, :k])
        # 2. the policy over the current token and the proposals
        ids = torch.cat([tok[:, None], draft], 1)
        vpos = pos[:, None] + torch.arange(k + 1, device=self.device)[None]
        kv_len = int(pos.max()) + k + 1
        self._cache.decode(arange, pos, kv_len)
        mask = (self._positions[:kv_len][None, None, :] <= vpos[:, :, None])[:, None]
        hidden = self._forward(ids, mask, vpos, self._rows[:b])  # type: ignore[arg-type]
        logits = self._lm_head(hidden).float()  # [b, k + 1, V]
        scaled = logits / temp[:, None, None] if self._count["temp"] else logits
        logp = scaled.log_softmax(dim=-1)
        p = self._filtered(logits).softmax(dim=-1)
        # 3. accept / reject, then the rows' tokens
        accepted, tokens = speculative_accept(
            p,
            q,
            draft,
            u[:, k:2 * k],
            u[:, 2 * k],
            greedy if self._count["greedy"] else None,
            logits.argmax(dim=-1) if self._count["greedy"] else None,
        )
        st["spec_prop"][:b] += k
        st["spec_acc"][:b] += accepted
        before = pos.clone()
        stopped = self._emit_many(b, tokens, accepted + 1, logp)
        if heads:  # the hidden state of each row's new last fed token: its input at the new position - 1
            st["hid"][:b] = hidden[arange, st["pos"][:b] - before - 1]
        return stopped

    def _head_proposals(self, b: int, u: Tensor) -> tuple[Tensor, Tensor]:
        """The draft heads' ``k`` proposals per row from the row's last hidden state: one batched matmul and one
        LM head over ``k`` positions -> (proposals [b, k], q [b, k, V])."""
        assert self.draft is not None
        return self._propose(self._filtered(self._lm_head(self.draft.model(self._st["hid"][:b])).float()), u)

    def _model_proposals(self, b: int, u: Tensor) -> tuple[Tensor, Tensor]:
        """A draft model's ``k`` proposals per row: a forward over the row's last two tokens, then ``k - 1``
        one-token forwards through its own cache -> (proposals [b, k], q [b, k, V])."""
        assert self.draft is not None and self.draft.cache is not None
        st, k = self._st, self.draft_k
        arange = self._arange[:b]
        pos, tok, prev = st["pos"][:b], st["tok"][:b], st["prev"][:b]
        top = int(pos.max())
        dc = self.draft.cache
        qpos = pos[:, None] + torch.tensor([-1, 0], device=self.device)[None]
        dc.decode(arange, pos - 1, top + 1)
        mask = (self._positions[: top + 1][None, None, :] <= qpos[:, :, None])[:, None]
        hidden = self.draft.forward(torch.stack([prev, tok], 1), mask, qpos)[:, -1]
        proposals, q = [], []
        for j in range(k):
            d, q_j = self._propose(self._filtered(self.draft.logits(hidden)), u[:, j])
            proposals.append(d)
            q.append(q_j)
            if j < k - 1:
                p_j = pos + 1 + j
                dc.decode(arange, p_j, top + 2 + j)
                mask = (self._positions[: top + 2 + j][None, :] <= p_j[:, None])[:, None, None, :]
                hidden = self.draft.forward(d[:, None], mask, p_j[:, None])[:, -1]
        return torch.stack(proposals, 1), torch.stack(q, 1)

    def _emit_many(self, b: int, tokens: Tensor, count: Tensor, logp: Tensor) -> list[tuple[int, str]]:
        """Record up to ``count[i]`` tokens ``tokens[i]`` of slot ``i < b`` (cut at a stop and at
        ``max_new_tokens``) with their log-probs from ``logp`` [b, k + 1, V]; returns the stopped rows."""
        st, width = self._st, tokens.shape[1]
        arange, cols = self._arange[:b], torch.arange(width, device=self.device)
        ngen = st["ngen"][:b]
        stop_at = torch.isin(tokens, self._eos)
        if self._count["stop_ids"]:
            stop_at |= (tokens[:, :, None] == st["stop"][:b, None, :]).any(dim=2)
        stop_at &= cols[None] < count[:, None]
        first = torch.where(stop_at.any(dim=1), stop_at.int().argmax(dim=1) + 1, width)
        n = torch.minimum(torch.minimum(count, first), st["max_new"][:b] - ngen)
        if self._count["stop_text"]:
            n = self._cut_at_stop_text(b, tokens, n)
        keep = cols[None] < n[:, None]
        rows, idx = arange[:, None].expand(b, width)[keep], (ngen[:, None] + cols[None])[keep]
        st["out_tok"][rows, idx] = tokens[keep]
        st["out_lp"][rows, idx] = logp.gather(-1, tokens[..., None])[..., 0][keep]
        st["out_ver"][rows, idx] = self._version
        if self._count["top_logprobs"]:
            top_v, top_i = logp.topk(st["top_v"].shape[2], dim=-1)
            st["top_v"][rows, idx], st["top_i"][rows, idx] = top_v[keep], top_i[keep]
        last = tokens[arange, n - 1]
        before = torch.where(n >= 2, tokens[arange, (n - 2).clamp_min(0)], st["tok"][:b])
        st["prev"][:b], st["tok"][:b] = before, last
        st["pos"][:b] += n
        ngen += n
        # reason codes as in _emit: 1 eos, 2 stop token, 3 length, 4 stop string (first that applies)
        code = torch.where(ngen >= st["max_new"][:b], 3, 0)
        if self._count["stop_ids"]:
            code = torch.where((last[:, None] == st["stop"][:b]).any(dim=1), 2, code)
        code = torch.where(torch.isin(last, self._eos), 1, code)
        names = ("", "eos", "stop_token", "length")
        stopped = [(i, names[c]) for i, c in enumerate(code.tolist()) if c]
        if self._count["stop_text"]:
            done = {s for s, _ in stopped}
            stopped += [(s, "stop_string") for s in range(b) if s not in done and self._hit_stop_text(s)]
        return stopped

    def _cut_at_stop_text(self, b: int, tokens: Tensor, n: Tensor) -> Tensor:
        """``n`` cut after the first token whose text completes a stop string (rows with stop strings)."""
        st = self._st
        n = n.clone()
        for i in range(b):
            row = self._rows[i]
            if row is None or not row.sampling.stop:
                continue
            base = int(st["ngen"][i])
            for j in range(int(n[i])):
                st["out_tok"][i, base + j] = tokens[i, j]
                st["ngen"][i] = base + j + 1
                if self._hit_stop_text(i):
                    n[i] = j + 1
                    break
            st["ngen"][i] = base
        return n
