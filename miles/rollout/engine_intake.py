"""Request intake of :class:`miles.rollout.torch_engine.TorchEngine`, run on the caller's thread.

:class:`EngineIntake` checks a request and its sampling params (``ValueError`` says what is wrong),
expands it into its ``n`` rows with their seeded generators, and loads the tokenizer that stop strings
need.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import Tensor

from miles.adapters import lora
from miles.rollout.engine_rows import _Job, _Row, _row_seed
from miles.rollout.sampling import check_sampling
from miles.types import GenerateRequest, SamplingParams


class EngineIntake:
    """Request checks and row construction; a base of :class:`~miles.rollout.torch_engine.TorchEngine`,
    whose constructor sets the attributes below."""

    checkpoint_dir: str
    vocab_size: int
    max_positions: int | None
    _generator: torch.Generator
    _seed_lock: threading.Lock
    _adapters: dict[str, dict[str, Tensor]]
    _tokenizer: Any

    def _rows_for(self, job: _Job, i: int, r: GenerateRequest, sp: SamplingParams) -> list[_Row]:
        """The request's ``n`` rows, each with its generator (seeded from the request's seed and index)."""
        greedy = sp.greedy or sp.temperature == 0
        seed = r.seed if r.seed is not None else sp.seed
        if seed is None:
            with self._seed_lock:
                seed = int(torch.randint(2**62, (1,), generator=self._generator))
        features = [name for name, on in (
            ("greedy", greedy), ("sampled", not greedy), ("temp", not greedy and sp.temperature != 1.0),
            ("filter", not greedy and (sp.top_k > 0 or sp.top_p < 1.0)), ("stop_ids", bool(sp.stop_token_ids)),
            ("stop_text", bool(sp.stop)), ("top_logprobs", sp.logprobs_top_k > 0)) if on]
        return [_Row(job=job, request_pos=i, request=r, index=j, sampling=sp, greedy=greedy,
                     generator=None if greedy else torch.Generator().manual_seed(_row_seed(seed, j)),
                     features=tuple(features)) for j in range(r.n)]

    def _check_request(self, r: GenerateRequest, default: SamplingParams | None) -> SamplingParams:
        """The request's sampling params, after checking them and the request; ``ValueError`` says what is wrong."""
        rid = r.request_id
        sp = r.sampling if r.sampling is not None else default
        if sp is None:
            raise ValueError(f"request {rid!r} has no sampling params: pass generate(..., sampling) "
                             "or set GenerateRequest.sampling")
        check_sampling(sp.temperature, sp.top_p, sp.top_k)
        if sp.max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be >= 1, got {sp.max_new_tokens}")
        if not 0 <= sp.logprobs_top_k <= self.vocab_size:
            raise ValueError(f"request {rid!r}: logprobs_top_k must be in [0, {self.vocab_size}], "
                             f"got {sp.logprobs_top_k}")
        if any(not 0 <= t < self.vocab_size for t in sp.stop_token_ids):
            raise ValueError(f"request {rid!r}: stop_token_ids must be in [0, {self.vocab_size}); "
                             f"got {list(sp.stop_token_ids)}")
        if sp.stop:
            if isinstance(sp.stop, str) or not all(isinstance(s, str) and s for s in sp.stop):
                raise ValueError(f"request {rid!r}: stop must be a tuple of non-empty strings, got {sp.stop!r}")
            self._get_tokenizer()
        if r.n < 1:
            raise ValueError(f"request {rid!r}: n must be >= 1, got {r.n}")
        if r.adapter is not None and r.adapter != lora.BASE and r.adapter not in self._adapters:
            raise ValueError(f"request {rid!r}: adapter {r.adapter!r} is not one this engine holds "
                             f"({sorted(self._adapters) or 'none: it was built without adapters'})")
        if not r.prompt_ids:
            raise ValueError(f"request {rid!r}: prompt_ids is empty; send at least one token")
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
            raise ValueError(f"request {rid!r}: token ids must be in [0, {self.vocab_size}); "
                             f"got min {min(r.prompt_ids)}, max {max(r.prompt_ids)}")
        if self.max_positions and len(r.prompt_ids) + sp.max_new_tokens > self.max_positions:
            raise ValueError(f"request {rid!r}: prompt ({len(r.prompt_ids)}) + max_new_tokens "
                             f"({sp.max_new_tokens}) exceeds max_position_embeddings={self.max_positions}")
        return sp

    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
            try:
                if not any(os.path.isfile(os.path.join(self.checkpoint_dir, f)) for f in files):
                    raise OSError(f"none of {', '.join(files)} is there")
                self._tokenizer = AutoTokenizer.from_pretrained(self.checkpoint_dir)
            except (OSError, ValueError) as e:
                raise ValueError(f"stop strings need a tokenizer, and none loads from {self.checkpoint_dir} "
                                 f"({type(e).__name__}: {e}); use stop_token_ids instead") from e
        return self._tokenizer
