"""Request intake of :class:`miles.rollout.torch_engine.TorchEngine`, run on the caller's thread.

:class:`EngineIntake` declares the engine's :class:`~miles.rollout.requests.EngineLimits`, checks
requests against them (``ValueError`` says what is wrong), expands each into its ``n`` rows with their
seeded generators, and loads the tokenizer that stop strings need.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import torch

from miles.rollout.engine_rows import _Job, _Row
from miles.rollout.requests import EngineLimits, check_request, request_seed, row_seed
from miles.types import GenerateRequest, SamplingParams


class EngineIntake:
    """Request checks and row construction; a base of :class:`~miles.rollout.torch_engine.TorchEngine`,
    whose constructor sets the attributes below and calls :meth:`_init_intake`."""

    checkpoint_dir: str
    engine_id: int
    vocab_size: int
    max_positions: int | None
    limits: EngineLimits
    """What requests are checked against (:func:`miles.rollout.requests.check_request`)."""

    def _init_intake(self, seed: int, adapters: tuple[str, ...]) -> None:
        """Set :attr:`limits` (stop strings need a tokenizer file in the checkpoint), the tokenizer slot, and
        the generator that seeds requests without a seed (from ``(seed, engine_id)``)."""
        files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        no_tokenizer = not any(os.path.isfile(os.path.join(self.checkpoint_dir, f)) for f in files)
        self.limits = EngineLimits(
            vocab_size=self.vocab_size, context_length=self.max_positions, adapters=adapters,
            no_stop_strings=f"stop strings need a tokenizer, and {self.checkpoint_dir} has none of "
                            f"{', '.join(files)}; use stop_token_ids" if no_tokenizer else None)
        self._tokenizer: Any = None
        digest = hashlib.sha256(f"miles-engine:{seed}:{self.engine_id}".encode()).digest()
        self._generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        self._seed_lock = threading.Lock()

    def _intake(self, requests: list[GenerateRequest], default: SamplingParams | None) -> tuple[_Job, list[_Row]]:
        """A job for the requests and its rows, after every request is checked (before any seed is drawn)
        and the tokenizer their stop strings need is loaded."""
        params = [check_request(r, default, self.limits) for r in requests]
        if any(sp.stop for sp in params):
            self._get_tokenizer()
        job = _Job(results=[[None] * r.n for r in requests], remaining=sum(r.n for r in requests))
        received = time.perf_counter()
        rows = [row for i, (r, sp) in enumerate(zip(requests, params, strict=True))
                for row in self._rows_for(job, i, r, sp)]
        for row in rows:
            row.received = received
        return job, rows

    def _rows_for(self, job: _Job, i: int, r: GenerateRequest, sp: SamplingParams) -> list[_Row]:
        """The request's ``n`` rows, each with its generator (seeded from the request's seed and index)."""
        greedy = sp.greedy or sp.temperature == 0
        seed = request_seed(r, sp, self._generator, self._seed_lock)
        features = [name for name, on in (
            ("greedy", greedy), ("sampled", not greedy), ("temp", not greedy and sp.temperature != 1.0),
            ("filter", not greedy and (sp.top_k > 0 or sp.top_p < 1.0)), ("stop_ids", bool(sp.stop_token_ids)),
            ("stop_text", bool(sp.stop)), ("top_logprobs", sp.logprobs_top_k > 0)) if on]
        return [_Row(job=job, request_pos=i, request=r, index=j, sampling=sp, greedy=greedy,
                     generator=None if greedy else torch.Generator().manual_seed(row_seed(seed, j)),
                     features=tuple(features)) for j in range(r.n)]

    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.checkpoint_dir)
            except (OSError, ValueError) as e:
                raise ValueError(f"stop strings need a tokenizer, and none loads from {self.checkpoint_dir} "
                                 f"({type(e).__name__}: {e}); use stop_token_ids instead") from e
        return self._tokenizer
