"""The embedded rollout engine: a transformers causal LM behind generate / update_weights.

A plain class; the driver wraps it with ``ray.remote(TorchEngine)`` into an actor.

Generation is a static batch (continuous batching is a later step). Each
request is expanded into ``n`` rows, prompts are left-padded to the longest
one, and a single prefill fills a ``DynamicCache``; each decode step feeds
one token per row. With left padding the attention mask hides the pads and
the position ids count only real tokens (``cumsum(mask) - 1``), so a row's
numbers do not depend on how much padding its batch needed. A row stops at
its first EOS (kept, with its log-prob: ``COMPLETED``) or after
``max_new_tokens`` (``TRUNCATED``); the loop ends when every row has stopped.

The log-prob of a sampled token is ``token_logprobs(logits, token, T)`` from
the very logits it was sampled from: the full temperature-scaled
distribution, before top-k/top-p (greedy reports ``T = 1``), exactly what the
trainer recomputes. Each request samples from its own generator, seeded by
``request.seed`` or else by a seed drawn from the engine's generator (seeded
from ``(seed, engine_id)``), so runs are reproducible.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from typing import Any

import torch
from torch import Tensor

from miles.algos.logprobs import token_logprobs
from miles.config.schema import PrecisionConfig
from miles.core.types import GenerateRequest, GenerateResult, SamplingParams, Status
from miles.precision.fp8 import apply_rollout_quant
from miles.rollout.sampling import check_sampling, sample_tokens

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ids(value: Any) -> list[int]:
    """An int, a list of ints, or None -> list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


class TorchEngine:
    """Generates with per-token log-probs and receives weights, on CPU (or one device)."""

    def __init__(
        self,
        checkpoint_dir: str,
        precision: PrecisionConfig,
        *,
        seed: int = 0,
        num_threads: int = 0,
        engine_id: int = 0,
        max_batch_size: int = 256,
        device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        if precision.rollout_dtype not in _DTYPES:
            raise ValueError(f"precision.rollout_dtype={precision.rollout_dtype!r}; valid: {sorted(_DTYPES)}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.precision, self.engine_id, self.max_batch_size = precision, engine_id, max_batch_size
        self.dtype, self.device = _DTYPES[precision.rollout_dtype], torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        apply_rollout_quant(self.model, precision)
        cfg, gen_cfg = self.model.config, self.model.generation_config
        eos = _ids(getattr(gen_cfg, "eos_token_id", None)) + _ids(getattr(cfg, "eos_token_id", None))
        self.eos_ids = sorted(set(eos))
        if not self.eos_ids:
            raise ValueError(
                f"{checkpoint_dir}: neither config.json nor generation_config.json sets eos_token_id"
            )
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        digest = hashlib.sha256(f"miles-engine:{seed}:{engine_id}".encode()).digest()
        self._generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        self._version = 0
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns).
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        # Weight names a sync must send: the state-dict keys, minus aliases of tied tensors.
        self._weights = self.model.state_dict(keep_vars=True)
        first_name: dict[int, str] = {}
        for k, v in self._weights.items():
            first_name.setdefault(id(v), k)
        self._required = list(first_name.values())

    # ---- generation -------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        """Complete each request ``n`` times; results are ordered by request, then index."""
        check_sampling(sampling.temperature, sampling.top_p, sampling.top_k)
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        for r in requests:
            self._check_request(r, sampling.max_new_tokens)
        greedy = sampling.greedy or sampling.temperature == 0
        gens = [self._request_generator(r) for r in requests]
        rows = [(i, j) for i, r in enumerate(requests) for j in range(r.n)]  # (request, index)
        results: list[GenerateResult] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            prompts = [requests[i].prompt_ids for i, _ in chunk]
            groups = _row_groups([gens[i] for i, _ in chunk])
            tokens, logps, lengths, done = self._generate_batch(prompts, sampling, greedy, groups)
            for b, (i, j) in enumerate(chunk):
                n_b = int(lengths[b])
                results.append(GenerateResult(
                    request_id=requests[i].request_id, index=j,
                    response_ids=tuple(tokens[b, :n_b].tolist()), logprobs=tuple(logps[b, :n_b].tolist()),
                    status=Status.COMPLETED if done[b] else Status.TRUNCATED, weight_version=self._version,
                ))
        return results

    def _generate_batch(
        self, prompts: list[tuple[int, ...]], sampling: SamplingParams, greedy: bool,
        groups: list[tuple[torch.Generator, int, int]],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Prefill + decode one static batch of B rows.

        Returns tokens [B, S] int64, logprobs [B, S] fp32, lengths [B] (tokens up to and
        including the stop), finished-on-EOS [B] bool, with S <= max_new_tokens.
        """
        from transformers import DynamicCache

        B, L = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):
            input_ids[b, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, L - len(p) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        eos = torch.tensor(self.eos_ids, device=self.device)
        temperature = 1.0 if greedy else sampling.temperature
        cache = DynamicCache(config=self.model.config)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        hit_eos = torch.zeros_like(finished)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        out_tokens, out_logps = [], []
        for _ in range(sampling.max_new_tokens):
            logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache}).logits[:, -1]
            noise = None if greedy else self._noise(groups, logits.shape)
            tok = sample_tokens(logits, noise, temperature=sampling.temperature,
                                top_k=sampling.top_k, top_p=sampling.top_p)
            out_tokens.append(tok)
            out_logps.append(token_logprobs(logits, tok, temperature))
            lengths += (~finished).long()
            stop = torch.isin(tok, eos) & ~finished
            hit_eos |= stop
            finished |= stop
            if bool(finished.all()):
                break
            input_ids = torch.where(finished, self.pad_id, tok)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
        return (torch.stack(out_tokens, 1).cpu(), torch.stack(out_logps, 1).cpu(),
                lengths.cpu(), hit_eos.cpu())

    def _noise(self, groups: list[tuple[torch.Generator, int, int]], shape: torch.Size) -> Tensor:
        """Exp(1) noise [B, V]; rows [start, end) of a group come from that group's generator."""
        noise = torch.empty(shape, dtype=torch.float32)
        for gen, start, end in groups:
            noise[start:end].exponential_(generator=gen)
        return noise.to(self.device)

    def _request_generator(self, r: GenerateRequest) -> torch.Generator:
        seed = r.seed if r.seed is not None else int(torch.randint(2**62, (1,), generator=self._generator))
        return torch.Generator().manual_seed(seed)

    def _check_request(self, r: GenerateRequest, max_new_tokens: int) -> None:
        if r.n < 1:
            raise ValueError(f"request {r.request_id!r}: n must be >= 1, got {r.n}")
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id!r}: prompt_ids is empty; send at least one token")
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
            raise ValueError(f"request {r.request_id!r}: token ids must be in [0, {self.vocab_size}); "
                             f"got min {min(r.prompt_ids)}, max {max(r.prompt_ids)}")
        if self.max_positions and len(r.prompt_ids) + max_new_tokens > self.max_positions:
            raise ValueError(f"request {r.request_id!r}: prompt ({len(r.prompt_ids)}) + max_new_tokens "
                             f"({max_new_tokens}) exceeds max_position_embeddings={self.max_positions}")

    # ---- weights ----------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, Tensor], version: int) -> dict[str, float]:
        """Replace every weight (HF names), re-apply rollout quantization, set ``version``.

        All checks happen before any copy: on a ``ValueError`` the engine is unchanged.
        Returns ``{"update_s", "quant_s", "bytes", "bytes_per_s"}`` (bytes as received).
        """
        t0 = time.perf_counter()
        missing = [k for k in self._required if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._weights]
        if missing or unexpected:
            raise ValueError(f"update_weights(version={version}): names must match the engine's model "
                             f"exactly; missing {_listing(missing)}, unexpected {_listing(unexpected)}. "
                             "Send the full HF state dict of the same architecture.")
        bad = [f"{k}: sent {tuple(v.shape)}, expected {tuple(self._weights[k].shape)}"
               for k, v in state_dict.items() if v.shape != self._weights[k].shape]
        bad += [f"{k}: sent {v.dtype}, expected a floating dtype" for k, v in state_dict.items()
                if self._weights[k].is_floating_point() and not v.is_floating_point()]
        if bad:
            raise ValueError(f"update_weights(version={version}): wrong shapes or dtypes: {bad}")
        for k, v in state_dict.items():
            self._weights[k].copy_(v)  # casts to the engine dtype and device
        t1 = time.perf_counter()
        apply_rollout_quant(self.model, self.precision)
        t2 = time.perf_counter()
        self._version = int(version)
        nbytes = float(sum(v.numel() * v.element_size() for v in state_dict.values()))
        return {"update_s": t2 - t0, "quant_s": t2 - t1, "bytes": nbytes,
                "bytes_per_s": nbytes / max(t1 - t0, 1e-9)}

    def weight_version(self) -> int:
        return self._version

    def health(self) -> dict[str, Any]:
        return {"ok": True, "version": self._version, "engine_id": self.engine_id}

    def state_dict(self) -> dict[str, Tensor]:
        """CPU copies of the engine's weights as it computes with them (after quantization)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._weights.items()}


def _row_groups(gens: list[torch.Generator]) -> list[tuple[torch.Generator, int, int]]:
    """Runs of consecutive rows sharing a generator: [(generator, start, end), ...]."""
    groups: list[tuple[torch.Generator, int, int]] = []
    for b, g in enumerate(gens):
        if groups and groups[-1][0] is g:
            groups[-1] = (g, groups[-1][1], b + 1)
        else:
            groups.append((g, b, b + 1))
    return groups


def _listing(names: list[str], limit: int = 10) -> str:
    """``[a, b, ...] (N)``: the first ``limit`` names and the count, for error messages."""
    more = " ..." if len(names) > limit else ""
    return f"{names[:limit]}{more} ({len(names)})"
