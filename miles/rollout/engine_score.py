"""Scoring finished sequences in the torch engine: the log-prob of each response token given everything before
it, for a second model beside the policy (on-policy distillation's teacher, docs/distillation.md); a base of
:class:`~miles.rollout.torch_engine.TorchEngine`.

A score is one forward over ``prompt + response`` per row, no cache and no sampling: rows are right-padded
into batches of at most ``max_prefill_tokens`` padded tokens (a causal model's numbers at a position do not
depend on what lies after it), and the log-probs are ``log_softmax(logits / T)`` at each response position,
in fp32, as :func:`miles.algos.logprobs.token_logprobs` computes them in the trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles.types import ScoreRequest, ScoreResult


class EngineScoring:
    """``score``; the engine's constructor sets the attributes below, and runs ``fn`` on its scheduler thread
    between two steps with ``_run_op(fn)``."""

    model: Any
    vision: bool
    device: torch.device
    pad_id: int
    vocab_size: int
    max_prefill_tokens: int
    max_positions: int | None
    checkpoint_dir: str

    def score(self, requests: list[ScoreRequest], temperature: float = 1.0, top_k: int = 0) -> list[ScoreResult]:
        """Each request's response tokens scored by this engine's weights: ``log_softmax(z / temperature)``
        of every response token given the prompt and the response before it, and with ``top_k`` > 0 the
        ``top_k`` most likely tokens at each of those positions. Results are in request order. Runs on the
        scheduler thread between two decode steps (``generate`` calls in flight wait for it)."""
        self._check_usable("score")
        if not temperature > 0:
            raise ValueError(f"score: temperature must be > 0, found {temperature}")
        if not 0 <= top_k <= self.vocab_size:
            raise ValueError(f"score: top_k must be in [0, {self.vocab_size}], found {top_k}")
        if self.vision:
            raise ValueError(f"score: {self.checkpoint_dir} is a vision-language model; scoring reads text only")
        for i, r in enumerate(requests):
            ids = (*r.prompt_ids, *r.response_ids)
            if not r.prompt_ids:
                raise ValueError(f"score: request {i} has an empty prompt (the first response token needs one before it)")
            if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
                raise ValueError(f"score: request {i} holds token ids outside [0, {self.vocab_size})")
            if self.max_positions is not None and len(ids) > self.max_positions:
                raise ValueError(f"score: request {i} is {len(ids)} tokens, over the model's "
                                 f"{self.max_positions} positions")
        if not requests:
            return []
        return self._run_op(lambda: self._score(requests, temperature, top_k))

    def _score(self, requests: list[ScoreRequest], temperature: float, top_k: int) -> list[ScoreResult]:
        out: list[ScoreResult | None] = [None] * len(requests)
        # longest first, so that a batch's rows pad to similar lengths
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids) - len(requests[i].response_ids))
        batch: list[int] = []
        for i in order:
            width = len(requests[batch[0]].prompt_ids) + len(requests[batch[0]].response_ids) if batch else 0
            if batch and (len(batch) + 1) * width > self.max_prefill_tokens:
                self._score_batch(requests, batch, temperature, top_k, out)
                batch = []
            batch.append(i)
        if batch:
            self._score_batch(requests, batch, temperature, top_k, out)
        return out  # type: ignore[return-value]

    def _score_batch(self, requests: list[ScoreRequest], rows: list[int], temperature: float, top_k: int,
                     out: list[ScoreResult | None]) -> None:
        seqs = [(*requests[i].prompt_ids, *requests[i].response_ids) for i in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[j, :len(s)] = 1
        logits: Tensor = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    use_cache=False).logits
        for j, i in enumerate(rows):
            p, t = len(requests[i].prompt_ids), len(requests[i].response_ids)
            if t == 0:
                out[i] = ScoreResult(logprobs=(), top_logprobs=() if top_k else None)
                continue
            logp = torch.log_softmax(logits[j, p - 1:p + t - 1].float() / temperature, dim=-1)
            target = torch.tensor(requests[i].response_ids, device=logp.device)
            top = None
            if top_k:
                vals, idx = logp.topk(top_k, dim=-1)
                top = tuple(tuple(zip(ix, vs, strict=True)) for ix, vs in zip(idx.tolist(), vals.tolist(), strict=True))
            out[i] = ScoreResult(logprobs=tuple(logp.gather(-1, target[:, None])[:, 0].tolist()), top_logprobs=top)
