"""Rollout manager: prompts in, scored samples out.

Splits requests across the engine actors, turns engine results into
:class:`~miles.core.types.Sample` groups, decodes text and applies the reward.
Every request comes back exactly once: a missing or duplicated completion is
an error, never a silently smaller batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from miles.core.types import GenerateRequest, GenerateResult, Problem, Sample, SamplingParams, Status
from miles.models.tokenizer import encode_prompt


class RolloutManager:
    """Owns the engine handles; ``rollout(problems, n, sampling)`` returns groups of scored samples."""

    def __init__(self, engines: Sequence[Any], tokenizer: Any, reward_fn: Callable[[str, Any], float]):
        self.engines = list(engines)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self._prompt_cache: dict[str, tuple[int, ...]] = {}

    def encode(self, prompt: str) -> tuple[int, ...]:
        """Chat-templated prompt ids (cached: the same prompt text always gives the same ids)."""
        ids = self._prompt_cache.get(prompt)
        if ids is None:
            ids = tuple(encode_prompt(self.tokenizer, prompt))
            self._prompt_cache[prompt] = ids
        return ids

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        """Contiguous chunks of requests to each engine, in parallel; checks every completion came back."""
        per = math.ceil(len(requests) / len(self.engines))
        chunks = [requests[i * per:(i + 1) * per] for i in range(len(self.engines))]
        futures = [e.generate.remote(c, sampling) for e, c in zip(self.engines, chunks, strict=True) if c]
        results = [r for rs in ray.get(futures) for r in rs]
        want = {(q.request_id, i) for q in requests for i in range(q.n)}
        got = [(r.request_id, r.index) for r in results]
        if len(got) != len(want) or set(got) != want:
            raise RuntimeError(f"rollout lost or duplicated completions: asked {len(want)}, got {len(got)}")
        return results

    def rollout(
        self, problems: Sequence[Problem], n: int, sampling: SamplingParams, *, seed: int, first_group_id: int = 0
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """Generate ``n`` samples per problem and score them. Returns (groups, metrics)."""
        t0 = time.perf_counter()
        requests = [
            GenerateRequest(request_id=str(first_group_id + g), prompt_ids=self.encode(p.prompt), n=n, seed=seed + g)
            for g, p in enumerate(problems)
        ]
        results = self.generate(requests, sampling)
        t_gen = time.perf_counter() - t0
        groups: list[list[Sample | None]] = [[None] * n for _ in problems]
        texts = self.tokenizer.batch_decode([list(r.response_ids) for r in results], skip_special_tokens=True)
        for r, text in zip(results, texts, strict=True):
            g = int(r.request_id) - first_group_id
            groups[g][r.index] = Sample(
                group_id=int(r.request_id), index=r.index, prompt_ids=list(requests[g].prompt_ids),
                response_ids=list(r.response_ids), rollout_logprobs=list(r.logprobs),
                loss_mask=[1] * len(r.response_ids), status=r.status, weight_version=r.weight_version,
                label=problems[g].label, response_text=text,
            )
        t1 = time.perf_counter()
        out = [[s for s in grp if s is not None] for grp in groups]
        for grp in out:
            for s in grp:
                s.reward = float(self.reward_fn(s.response_text, s.label))
        flat = [s for grp in out for s in grp]
        num_tokens = sum(len(s.response_ids) for s in flat)
        metrics = {
            "perf/generate_s": t_gen,
            "perf/reward_s": time.perf_counter() - t1,
            "perf/rollout_tokens_per_s": num_tokens / max(t_gen, 1e-9),
            "rollout/response_len_mean": num_tokens / max(len(flat), 1),
            "rollout/truncated_frac": sum(s.status is Status.TRUNCATED for s in flat) / max(len(flat), 1),
        }
        return out, metrics
