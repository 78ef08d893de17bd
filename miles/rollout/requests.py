"""What a generate request may ask of the engine that serves it, checked in one place.

Both engines and the rollout HTTP server check each :class:`~miles.types.GenerateRequest` with
:func:`check_request` against the engine's :class:`EngineLimits` before anything is queued: a ``ValueError``
names the request, the field, the valid range, what was found and what to try. Completion ``index`` of a
request seeded ``seed`` samples from :func:`row_seed` ``(seed, index)`` on either engine; :func:`eos_ids`
reads the EOS ids both engines stop at from a checkpoint's configs.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import torch

from miles.adapters import lora
from miles.types import GenerateRequest, SamplingParams


@dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """What an engine serves; :func:`check_request` checks requests against it."""

    vocab_size: int
    """Token ids (prompt, stop ids) lie in ``[0, vocab_size)``; ``logprobs_top_k`` is at most this."""
    context_length: int | None = None
    """Bound on prompt tokens + ``max_new_tokens``; None: no bound."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters held (the first is the default); empty: the engine was built without adapters."""
    no_stop_strings: str | None = None
    """Why ``stop`` strings are refused, with what to use instead; None: served."""
    no_base_model: str | None = None
    """Why ``adapter="__base__"`` (the base model alone) is refused; None: served."""


def eos_ids(checkpoint: str, *values: Any) -> list[int]:
    """The EOS ids that ``eos_token_id`` values of a checkpoint's configs name (each an int, a list or None)."""
    ids = sorted({int(v) for value in values if value is not None
                  for v in (value if isinstance(value, list | tuple) else [value])})
    if not ids:
        raise ValueError(f"{checkpoint}: neither config.json nor generation_config.json sets eos_token_id")
    return ids


def check_request(r: GenerateRequest, default: SamplingParams | None, limits: EngineLimits) -> SamplingParams:
    """The request's sampling params (its own, else ``default``) after checking them and the request
    against ``limits``; ``ValueError`` says which field is wrong and what to try."""
    rid, vocab = r.request_id, limits.vocab_size
    sp = r.sampling if r.sampling is not None else default
    if sp is None:
        raise ValueError(f"request {rid!r} has no sampling params: pass generate(..., sampling) "
                         "or set GenerateRequest.sampling")
    bad = ((sp.temperature < 0, f"temperature must be >= 0 (0 means greedy), got {sp.temperature}"),
           (not 0.0 < sp.top_p <= 1.0, f"top_p must be in (0, 1] (1 disables nucleus sampling), got {sp.top_p}"),
           (sp.top_k < 0, f"top_k must be >= 0 (0 disables top-k), got {sp.top_k}"),
           (sp.max_new_tokens < 1, f"max_new_tokens must be >= 1, got {sp.max_new_tokens}"),
           (not 0 <= sp.logprobs_top_k <= vocab,
            f"logprobs_top_k must be in [0, {vocab}] (0: off), got {sp.logprobs_top_k}"),
           (any(not 0 <= t < vocab for t in sp.stop_token_ids),
            f"stop_token_ids must be in [0, {vocab}), got {list(sp.stop_token_ids)}"),
           (bool(sp.stop) and (isinstance(sp.stop, str) or not all(isinstance(s, str) and s for s in sp.stop)),
            f"stop must be a tuple of non-empty strings, got {sp.stop!r}"),
           (bool(sp.stop) and limits.no_stop_strings is not None, f"stop={list(sp.stop)}: {limits.no_stop_strings}"),
           (r.n < 1, f"n must be >= 1, got {r.n}"),
           (r.adapter not in (None, lora.BASE, *limits.adapters),
            f"adapter {r.adapter!r} is not one this engine holds ({list(limits.adapters) or 'it holds none'}); "
            f"send one of those, None (the default) or {lora.BASE!r} (the base model)"),
           (r.adapter == lora.BASE and limits.no_base_model is not None,
            f"adapter={lora.BASE!r} (the base model) is refused: {limits.no_base_model}"),
           (not r.prompt_ids, "prompt_ids is empty; send at least one token"),
           (min(r.prompt_ids, default=0) < 0 or max(r.prompt_ids, default=0) >= vocab,
            f"prompt_ids: token ids must be in [0, {vocab}), got min {min(r.prompt_ids, default=None)}, "
            f"max {max(r.prompt_ids, default=None)}"),
           (bool(limits.context_length) and len(r.prompt_ids) + sp.max_new_tokens > (limits.context_length or 0),
            f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds the context "
            f"length {limits.context_length}; lower max_new_tokens"))
    for wrong, message in bad:
        if wrong:
            raise ValueError(f"request {rid!r}: {message}")
    return sp


def row_seed(seed: int, index: int) -> int:
    """The sampling seed of completion ``index`` of a request seeded with ``seed`` (63 bits)."""
    digest = hashlib.sha256(f"miles-row:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def request_seed(r: GenerateRequest, sp: SamplingParams, generator: torch.Generator,
                 lock: threading.Lock | threading.Condition) -> int:
    """The request's seed, else its sampling params', else the next draw of the engine's ``generator``."""
    seed = r.seed if r.seed is not None else sp.seed
    if seed is None:
        with lock:
            seed = int(torch.randint(2**62, (1,), generator=generator))
    return seed
