"""The data that crosses process boundaries: token ids in, token ids out.

A :class:`Sample` is one response to one prompt. It carries the weight version
of each of its tokens (a weight update mid-generation gives one response tokens
of two versions: a partial rollout), so async schedules can bound staleness. Nothing here is
re-tokenized: the trainer sees exactly the ids the engine sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Problem(Protocol):
    """A task item: the prompt text and the reference the reward compares against."""

    prompt: str
    label: Any


class Status(StrEnum):
    """How a sample's generation ended."""

    COMPLETED = "completed"  # stopped on EOS / a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cancelled by the engine or the manager
    FAILED = "failed"  # generation or reward failed; see Sample.failure


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling parameters. Log-probs are of the temperature-scaled distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides the model's EOS (kept in the response)
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded response (needs a tokenizer)
    seed: int | None = None  # per-request seed when GenerateRequest.seed is None
    logprobs_top_k: int = 0  # also report the k most likely tokens' log-probs at each step (0: off)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One prompt to complete ``n`` times."""

    request_id: str
    prompt_ids: tuple[int, ...]
    n: int = 1
    seed: int | None = None
    sampling: SamplingParams | None = None  # overrides the generate() call's default sampling
    adapter: str | None = None
    """LoRA adapter to generate with (an engine built with adapters); None: the engine's default adapter
    (its first), ``"__base__"``: the base model alone."""
    session_id: str | None = None
    """The multi-turn session this prompt continues, or None. Completion ``i`` of the request is stored
    under :func:`session_key` ``(session_id, n, i)``: an engine with a prefix cache keeps its KV under
    that key and reuses it for a later prompt of the same key that starts with its tokens, and the
    engine pool sends a later request with that key to the engine that produced it."""
    images: Any = field(default=None, compare=False)
    """:class:`miles.models.vision.Images` of the prompt's image-placeholder runs, in order (a
    vision-language model); None: a text-only prompt."""


def session_key(session_id: str, n: int, index: int) -> str:
    """The key completion ``index`` of a request with ``n`` completions continues as: the session id
    itself when ``n == 1``, else ``"<session_id>#<index>"`` (each completion its own conversation)."""
    return session_id if n == 1 else f"{session_id}#{index}"


@dataclass(frozen=True, kw_only=True)
class GenerateResult:
    """One completion of a request, as the engine produced it."""

    request_id: str
    index: int  # which of the request's n completions
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log-prob of each response token, same length
    status: Status
    weight_version: int  # the version current at completion
    token_versions: tuple[int, ...] = ()  # version that sampled each response token; () if the engine does not say
    finish_reason: str = ""  # "eos", "stop_token", "stop_string", "length" or "abort"
    top_logprobs: tuple | None = None  # per token: ((token_id, logprob), ...) most likely first
    routing: Any = field(default=None, compare=False)  # MoE: int16 tensor [T, moe_layers, top_k]
    prompt_routing: Any = field(default=None, compare=False)  # MoE: int16 [P - 1, moe_layers, top_k]
    spec_counts: tuple[int, int] | None = field(default=None, compare=False)  # speculative: (proposed, accepted)
    ttft_s: float | None = field(default=None, compare=False)
    """Seconds from the engine receiving the call to this completion's first token; None when it has none."""


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """A finished sequence for a second model to score (on-policy distillation's teacher): the log-prob of
    each response token given everything before it."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ScoreResult:
    """What an engine's ``score`` gives for one :class:`ScoreRequest`."""

    logprobs: tuple[float, ...]
    """``log_softmax(z / T)`` of each response token (the row's temperature ``T``), one per response token."""
    top_logprobs: tuple | None = None
    """Per response token: ``((token_id, logprob), ...)`` of the ``top_k`` most likely tokens, most likely
    first; None when ``top_k`` is 0."""


@dataclass(kw_only=True)
class Sample:
    """One response to one prompt, with everything the trainer needs."""

    group_id: int
    index: int  # position within the group
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]  # 1 for tokens the policy generated, 0 for environment tokens
    status: Status
    weight_version: int  # the newest weights that produced any of its tokens (-1: none, a failed group)
    label: Any = None  # the task's reference answer
    response_text: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    failure: str | None = None  # why generation or reward failed (status FAILED)
    metadata: dict[str, Any] = field(default_factory=dict)
    filtered: str | None = None  # why a sample filter dropped this sample's group (kept only to fill the batch)
    routing: Any = None
    """MoE routes the engine chose: int16 tensor [P + T - 1, moe_layers, top_k], one row per input position
    0 .. P + T - 2 of the forward over prompt + response (every position whose output is scored); None
    when the engine did not capture routing."""

    token_versions: list[int] = field(default_factory=list)
    """Weight version that sampled each response token (partial rollouts mix versions); empty: all
    ``weight_version`` (a generate function that does not set them)."""
    adapter: str | None = None
    """The LoRA adapter that generated it and that it trains (a tenant's); None: the policy's only one."""
    images: Any = None
    """:class:`miles.models.vision.Images` of its prompt (a vision-language model), None: text only."""

    @property
    def oldest_version(self) -> int:
        """The oldest weight version behind any of its tokens: what its staleness is measured from."""
        return min(self.token_versions) if self.token_versions else self.weight_version

    @property
    def trainable(self) -> bool:
        """Whether the sample enters the loss and its group's reward statistics.

        Completed or truncated, scored without failure, and not in a filtered-out group.
        """
        return self.status in (Status.COMPLETED, Status.TRUNCATED) and self.failure is None and self.filtered is None


@dataclass(kw_only=True)
class TrainBatch:
    """Samples in the form the trainer consumes (plain lists: cheap to ship between processes)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    loss_mask: list[list[int]]
    advantages: list[float]
    token_advantages: list[list[float]] | None = None
    """Per response token advantages (PPO/GAE); when set they replace ``advantages`` broadcast over tokens."""
    routing: list[Any] | None = None
    """Per sample :attr:`Sample.routing` (MoE routes of the rollout), when every sample has them."""
    adapters: list[str] | None = None
    """Per sample :attr:`Sample.adapter` (multi-LoRA tenants: the adapter each sample trains), when set."""
    images: list[Any] | None = None
    """Per sample :attr:`Sample.images` (None for a text-only row), when any sample has images."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, indices: list[int]) -> TrainBatch:
        """The samples at ``indices`` (in that order); every per-sample field is kept in step."""
        return TrainBatch(**{
            f.name: None if getattr(self, f.name) is None else [getattr(self, f.name)[i] for i in indices]
            for f in fields(self)
        })

    @classmethod
    def from_samples(cls, samples: list[Sample]) -> TrainBatch:
        return cls(
            prompt_ids=[s.prompt_ids for s in samples],
            response_ids=[s.response_ids for s in samples],
            rollout_logprobs=[s.rollout_logprobs for s in samples],
            loss_mask=[s.loss_mask for s in samples],
            advantages=[s.advantage for s in samples],
            routing=[s.routing for s in samples] if samples and all(s.routing is not None for s in samples) else None,
            adapters=[s.adapter for s in samples] if samples and all(s.adapter is not None for s in samples) else None,
            images=[s.images for s in samples] if any(s.images is not None for s in samples) else None,
        )

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Contiguous slice for one data-parallel rank (len must divide evenly)."""
        n = len(self) // world_size
        return self.select(list(range(rank * n, (rank + 1) * n)))
