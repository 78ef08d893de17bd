"""What a generate function sees (:class:`GenerateContext`) and the built-in single-turn one.

A generate function (``rollout.generate_fn``, protocol
:class:`miles.rollout.protocols.GenerateFn`) produces the ``ctx.n`` responses to one prompt. The
default, :func:`single_turn`, sends one :class:`GenerateRequest` with ``n`` to one engine, so the
``n`` samples share a prefill. A multi-turn or tool-using function calls
``ctx.engine_generate`` once per turn, appends the environment's tokens with loss mask 0 and
returns the samples; it never re-tokenizes what the engine produced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.types import GenerateRequest, GenerateResult, Problem, Sample, SamplingParams


@dataclass
class GenerateContext:
    """One prompt's view of the rollout: its group id, size and seed, the tokenizer, the engines."""

    group_id: int
    """Id of this prompt's group (unique in the run); use it in request ids."""
    n: int
    """Samples to return (``algo.num_samples_per_prompt`` in training)."""
    seed: int
    """Sampling seed of this group: the same seed reproduces the same samples."""
    tokenizer: Any
    """The run's HF tokenizer (decode for rewards and logs; never re-encode engine output)."""
    _generate: Callable[[GenerateRequest, SamplingParams | None], Awaitable[list[GenerateResult]]]
    _encode: Callable[[str], tuple[int, ...]]
    _encode_images: Callable[[str, tuple], tuple[tuple[int, ...], Any]] | None = None
    image_encoder: Any = None
    """A vision-language model's :class:`miles.models.vision.ImageEncoder` (None for a text model): what a
    multi-turn function appends pictures with (:class:`miles.agent.session.Session`)."""

    async def engine_generate(
        self, request: GenerateRequest, sampling: SamplingParams | None = None
    ) -> list[GenerateResult]:
        """The ``request.n`` completions of ``request``, ordered by index.

        Routed by the manager to the least-loaded live engine, bounded by ``rollout.request_timeout_s``
        and retried on another engine up to ``rollout.max_retries`` times; raises
        :class:`miles.rollout.dispatch.EngineRequestError` when every attempt failed.
        """
        return await self._generate(request, sampling)

    def encode(self, prompt: str) -> tuple[int, ...]:
        """Chat-templated ids of one user turn plus the assistant header (cached per prompt text)."""
        return self._encode(prompt)

    def encode_problem(self, problem: Problem) -> tuple[tuple[int, ...], Any]:
        """Prompt ids and images (:class:`miles.models.vision.Images`, None without) of a problem: its
        ``images`` attribute (pictures as bytes, paths or PIL images) becomes placeholder tokens + pixels."""
        images = tuple(getattr(problem, "images", None) or ())
        if not images:
            return self.encode(problem.prompt), None
        if self._encode_images is None:
            raise ValueError("this rollout cannot encode images (no image processor)")
        return self._encode_images(problem.prompt, images)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped (what rewards see)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def samples_from_results(
    ctx: GenerateContext, problem: Problem, prompt_ids: Sequence[int], results: Sequence[GenerateResult],
    images: Any = None,
) -> list[Sample]:
    """One :class:`Sample` per engine result (loss mask all ones: every token came from the policy)."""
    texts = ctx.tokenizer.batch_decode([list(r.response_ids) for r in results], skip_special_tokens=True)
    return [
        Sample(
            group_id=ctx.group_id, index=r.index, prompt_ids=list(prompt_ids), response_ids=list(r.response_ids),
            rollout_logprobs=list(r.logprobs), loss_mask=[1] * len(r.response_ids), status=r.status,
            weight_version=r.weight_version, label=problem.label, response_text=text,
            routing=routes_of(r),
            token_versions=list(r.token_versions) or [r.weight_version] * len(r.response_ids), images=images,
            metadata=spec_metadata(r),
        )
        for r, text in zip(results, texts, strict=True)
    ]


def spec_metadata(r: GenerateResult) -> dict[str, Any]:
    """``{"counts": {"spec_proposed": n, "spec_accepted": m}}`` for a result of a speculative engine (the
    draft tokens it proposed and the policy accepted; summed into ``rollout/spec_*``), else ``{}``."""
    if r.spec_counts is None:
        return {}
    return {"counts": {"spec_proposed": r.spec_counts[0], "spec_accepted": r.spec_counts[1]}}


def routes_of(r: GenerateResult) -> Any:
    """Prompt and response routes of one result as one [P + T - 1, layers, k] tensor, or None."""
    if r.routing is None or r.prompt_routing is None:
        return None
    import torch

    return torch.cat([r.prompt_routing, r.routing])


async def single_turn(ctx: GenerateContext, problem: Problem, sampling: SamplingParams) -> list[Sample]:
    """The prompt as one user turn, ``ctx.n`` completions from one request (one shared prefill)."""
    prompt_ids, images = ctx.encode_problem(problem)
    request = GenerateRequest(request_id=str(ctx.group_id), prompt_ids=prompt_ids, n=ctx.n, seed=ctx.seed,
                              images=images)
    return samples_from_results(ctx, problem, prompt_ids, await ctx.engine_generate(request, sampling), images)
