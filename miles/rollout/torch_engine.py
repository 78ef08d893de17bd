"""The embedded rollout engine: continuous batching over a transformers causal LM.

A plain class; the driver wraps it with ``ray.remote(TorchEngine)`` into a
threaded actor (``max_concurrency`` > 1), so several ``generate`` calls can be
in flight: they enqueue their rows and wait, and one scheduler thread owns the
model and runs every forward.

Continuous batching. Each request is expanded into ``n`` rows (completions).
The engine has ``max_batch_size`` slots; a row holds a slot from admission to
its stop. Every scheduler step (1) admits waiting rows into free slots with one
batched prefill (prompts right-padded; a request's ``n`` rows share one prefill
row whose K/V is copied into each of their slots; while rows are running, only
once ``admit_batch`` slots are free, so that prefills are batched too), then
(2) runs one decode step over all occupied slots. A finished row leaves at
once: the last occupied slot moves into its place, so the occupied slots stay
``[0, n)`` and a decode step is one dense batch of ``n`` rows with no copies of
the cache.

KV cache and forward (:mod:`miles.rollout.slot_cache`): one static buffer per
layer and slot; token ``t`` of a row lives at index ``t`` (its position), so a
row's numbers equal an unpadded forward over prompt + response, whatever its
neighbours. For Qwen3 / Qwen3-MoE the forward is replayed without module
dispatch, used only when a start-up check finds it equal to the module
forward: bitwise, except that in fp32 on CPU a decode step's attention is two
matmuls around a softmax, equal to sdpa to float rounding (checked to
``DECODE_ATOL``) and faster there.

Sampling and log-probs (:mod:`miles.rollout.sampling`). Each row has its own
temperature / top-k / top-p / greedy / stops / ``max_new_tokens``. The log-prob
of a sampled token is ``log_softmax(logits / T)`` of the very logits it was
sampled from, before top-k/top-p (greedy reports ``T = 1``): what
:func:`miles.algos.logprobs.token_logprobs` and the trainer compute. Sampling
is the exponential race ``argmax(filtered_logits / T - log E)`` with
``E ~ Exp(1)`` drawn from the row's own ``torch.Generator``, seeded from
``(request seed, completion index)``; a row draws its noise in chunks of a few
steps from that stream (the stream is the same however it is cut), so its tokens depend only on
its seed and the weights, never on which rows share its batch or when it was admitted. Requests without a
seed get one from the engine's generator (seeded by ``(seed, engine_id)``), in
submission order. Optionally the top-k log-probs of every step are reported.

Stops. A row stops at the model's EOS (``finish_reason="eos"``), at one of its
``stop_token_ids`` (``"stop_token"``), when its decoded text contains one of
its ``stop`` strings (``"stop_string"``; the tokenizer is loaded from the
checkpoint) -- all three ``COMPLETED``, the stopping token kept with its
log-prob -- or after ``max_new_tokens`` (``"length"``, ``TRUNCATED``).

Time to first token: each result's ``ttft_s`` is the seconds from its ``generate`` call's arrival to the
end of the prefill that sampled its first token (for ``true_on_policy``, to its first sampled token).

Control (all safe to call while ``generate`` calls are in flight; each runs on
the scheduler thread between two steps, never during a forward):

- ``update_weights(sd, version)``: checked first (names, shapes, dtypes; on an
  error nothing changes), then applied between steps. In-flight rows are not
  dropped: they continue with the new weights (their K/V cache from the old
  weights is kept), a partial rollout. A result reports the version current at
  its completion (``weight_version``, the newest weights that produced any of
  its tokens) and, per token, the version of the weights that sampled it
  (``token_versions``). A caller that needs single-version samples updates
  when no ``generate`` is in flight (the synchronous loop does) or ``abort``s
  the in-flight requests first. From ``shm``, ``update_weights_from`` computes from
  the version's slot in place (:meth:`~miles.rollout.engine_weights.EngineWeights._adopt`).
- ``pause()`` / ``resume()``: no further steps while paused; in-flight rows
  keep their slots and cache, new requests queue. ``pause()`` returns once the
  current step has finished.
- ``health()``: liveness and load, answered at once; ``busy_s`` is the seconds the scheduler thread
  has spent generating since the engine started (prefills and decode steps with rows running, or
  the one-row-at-a-time ``true_on_policy`` generation; a step in progress counts up to the reading)
  and ``clock_s`` the engine's ``time.perf_counter()`` at the reading: two readings give the share
  of the time between them the engine worked.
- ``abort(request_ids)``: their rows come back ``ABORTED`` (``"abort"``) with
  the tokens generated so far; returns the number of requests aborted.
- ``release_memory()`` / ``resume_memory()``: for colocation. Drops the KV
  cache and offloads the weights (to a safetensors file on CPU, to host memory
  on an accelerator; weights that are a shared slot's views stay where they are),
  restored bit-exactly on resume; rows still in flight (a
  caller should have none) come back ``ABORTED``.
  ``generate`` and ``state_dict`` raise while released. A full ``update_weights``
  (the weight sync after a train step) brings a released engine back with the
  new weights directly, without reading the offloaded copy: a colocated step
  is release -> train -> sync, with no separate resume call.

MoE routing capture (``capture_routing=True``): each result carries the experts its tokens were routed
to (``GenerateResult.routing``, ``prompt_routing``), recorded by hooks on the router modules
(:mod:`miles.rollout.engine_slots`).

This module holds construction, the public API, the scheduler loop and decode. The class's other parts
are its bases: request checks and row construction in :mod:`miles.rollout.engine_intake`, admission and
prefill in :mod:`miles.rollout.engine_prefill`, sampling, stops and results in :mod:`miles.rollout.engine_emit`,
weight updates and memory release in :mod:`miles.rollout.engine_weights`; speculative decode steps
(with a draft model) in :mod:`miles.rollout.engine_spec`; image prefill (vision-language models) in
:mod:`miles.rollout.engine_vision`; the per-slot tensors, their growth and the router hooks in
:mod:`miles.rollout.engine_slots`; the per-row records in :mod:`miles.rollout.engine_rows`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from miles.adapters import lora
from miles.backends.reuse import Reusable
from miles.config.schema import AdapterConfig, PrecisionConfig
from miles.models.draft_heads import is_heads_dir
from miles.precision.recipe import apply_rollout_quant
from miles.rollout.engine_emit import EngineEmission
from miles.rollout.engine_intake import EngineIntake
from miles.rollout.engine_prefill import EnginePrefill
from miles.rollout.engine_rows import _Row
from miles.rollout.engine_score import EngineScoring
from miles.rollout.engine_slots import EngineSlots
from miles.rollout.engine_spec import EngineSpeculation
from miles.rollout.engine_vision import EngineVision
from miles.rollout.engine_weights import EngineWeights
from miles.rollout.prefix_cache import PrefixStore
from miles.rollout.requests import eos_ids
from miles.rollout.slot_cache import FastQwen3, SlotCache, forward_matches
from miles.rollout.speculative import DraftHeads, DraftModel
from miles.tracking.memory import process_memory
from miles.tracking.profiler import Profiled
from miles.types import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TorchEngine(EngineSlots, EngineIntake, EnginePrefill, EngineEmission, EngineWeights, EngineSpeculation, EngineVision, EngineScoring,
                  Reusable, Profiled):
    """Generates with per-token log-probs by continuous batching; receives weights between steps.

    ``max_batch_size``: slots (rows decoded together); ``max_prefill_tokens``: bound on one prefill's
    padded prompt tokens; ``admit_batch``: free slots that trigger an admission while rows run
    (default ``max_batch_size // 4``); ``capture_routing``: record MoE routing per generated token;
    ``adapter`` (``kind: lora``): hold one LoRA adapter per name of ``adapter_names`` on the base
    weights (:mod:`miles.adapters.lora`), chosen per request (``GenerateRequest.adapter``); ``prefix_cache_tokens``:
    keep the K/V of finished completions of requests with a ``session_id``, up to this many tokens, and
    prefill a later turn of the session from where they end (:mod:`miles.rollout.prefix_cache`; 0: off);
    ``draft_checkpoint_dir``: a draft model (same vocabulary), or the policy's own draft heads
    (:mod:`miles.models.draft_heads`), that proposes ``draft_k`` tokens per row and decode step, verified by the
    policy in one forward (exact speculative sampling, :mod:`miles.rollout.engine_spec`; None: off).
    """

    reports_token_versions = True
    """Every result carries the weight version of each token (``token_versions``): async schedules need it."""
    takes_adapter_updates = True
    """Holds LoRA adapters by name beside the base and takes weight pushes of their tensors alone
    (``adapter=lora``)."""

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
        capture_routing: bool = False,
        max_prefill_tokens: int = 8192,
        admit_batch: int | None = None,
        adapter: AdapterConfig | None = None,
        adapter_names: tuple[str, ...] = ("default",),
        prefix_cache_tokens: int = 0,
        draft_checkpoint_dir: str | None = None,
        draft_k: int = 4,
    ) -> None:
        from miles.models.vision import is_vision_config, load_model

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        if precision.rollout_dtype not in _DTYPES:
            raise ValueError(f"precision.rollout_dtype={precision.rollout_dtype!r}; valid: {sorted(_DTYPES)}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if precision.true_on_policy and capture_routing:
            raise ValueError("precision.true_on_policy=true generates without the batched path that records "
                             "routing; set capture_routing=false")
        if prefix_cache_tokens and (capture_routing or precision.true_on_policy):
            raise ValueError("prefix_cache_tokens > 0 cannot be combined with "
                             + ("capture_routing (a reused prefix has no recorded routes)" if capture_routing
                                else "precision.true_on_policy (it prefills every prompt whole)")
                             + "; set rollout.engine.prefix_cache_tokens=0")
        if draft_checkpoint_dir is not None and (capture_routing or precision.true_on_policy or adapter is not None
                                                 and adapter.kind != "none" or not 1 <= draft_k <= 16):
            raise ValueError("a draft model (speculative rollout) needs capture_routing=false, "
                             "precision.true_on_policy=false, no adapter and 1 <= draft_k <= 16; found "
                             f"capture_routing={capture_routing}, true_on_policy={precision.true_on_policy}, "
                             f"adapter={adapter and adapter.kind}, draft_k={draft_k}")
        if admit_batch is not None and not 1 <= admit_batch <= max_batch_size:
            raise ValueError(f"admit_batch must be in [1, max_batch_size={max_batch_size}], got {admit_batch}")
        # While rows are running, admit only once this many slots are free (or every waiting row fits):
        # a prefill costs about one decode step on CPU, so batching admissions wins more than the few
        # idle slots cost (measured on the tiny model: max_batch_size // 4 > // 8 > 1).
        self.admit_batch = admit_batch if admit_batch is not None else max(1, max_batch_size // 4)
        self.checkpoint_dir, self.precision, self.engine_id = str(checkpoint_dir), precision, engine_id
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.dtype, self.device = _DTYPES[precision.rollout_dtype], torch.device(device)
        model = load_model(self.checkpoint_dir, self.dtype, attn_implementation="sdpa")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.vision = is_vision_config(model.config)
        if self.vision and (capture_routing or precision.true_on_policy or precision.rollout_quant != "none"):
            raise ValueError(f"engine: {checkpoint_dir} is a vision-language model; the torch engine serves it "
                             "without routing capture, true on-policy and rollout quantization")
        apply_rollout_quant(self.model, precision)
        cfg, gen_cfg = self.model.config, self.model.generation_config
        self.eos_ids = eos_ids(checkpoint_dir, getattr(gen_cfg, "eos_token_id", None),
                               getattr(cfg, "eos_token_id", None))
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        text_cfg = cfg.get_text_config()
        self.vocab_size = int(text_cfg.vocab_size)
        self.max_positions = getattr(text_cfg, "max_position_embeddings", None)
        # a VLM never samples its vision tokens (a response is text); they are filtered out like top-k, so
        # the reported log-probs stay those of the whole distribution, as the trainer computes them
        self._never_sample: Tensor | None = None
        if self.vision:  # image tokens, the merge size of mRoPE positions
            self._image_token = int(cfg.image_token_id)
            self._merge = int(cfg.vision_config.spatial_merge_size)
            vision_ids = {getattr(cfg, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                          "vision_end_token_id")}
            self._never_sample = torch.tensor(sorted(i for i in vision_ids if i is not None), device=self.device)
        # Noise chunk: a row draws Exp(1) noise for this many steps at once (fixed per vocabulary, so a
        # row's draws never depend on the batch); about 64k floats per draw.
        self.noise_chunk = max(1, min(16, 65536 // self.vocab_size))
        self._version = 0
        # a vision-language model: the decoder alone (image features are merged into its input embeddings)
        self._base = self.model.model.language_model if self.vision else self.model.base_model
        self._lm_head = self.model.get_output_embeddings()
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns).
        params = inspect.signature(self._base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Weight names a sync must send: the state-dict keys, minus aliases of tied tensors.
        self._weights = self.model.state_dict(keep_vars=True)
        first_name: dict[int, str] = {}
        for k, v in self._weights.items():
            first_name.setdefault(id(v), k)
        self._required = list(first_name.values())
        self._shapes = {k: tuple(v.shape) for k, v in self._weights.items()}  # fixed; checked while released
        # LoRA: the base weights (quantized above, once: they never change) carry unmerged adapters in
        # higher precision; a sync then sends adapter tensors only (update_weights)
        self._peft: Any = None
        self._adapters: dict[str, dict[str, Tensor]] = {}
        if adapter is not None and adapter.kind == "lora":
            self._peft = lora.add_adapters(self.model, adapter, adapter_names, trainable=False)
            self._adapters = {n: lora.adapter_parameters(self._peft, n) for n in adapter_names}
        self.default_adapter = adapter_names[0] if self._peft is not None else None
        self._lm_head = self.model.get_output_embeddings()  # an adapter's own layer when lm_head is a target
        self._init_intake(seed, tuple(self._adapters))
        self._offload: int | dict[str, Tensor] | None = None  # weights while released (int: a file's descriptor)
        self._pin: Any = None  # while the weights are a shared-memory slot's views (engine_weights)
        self.capture_routing = capture_routing
        self._routers = self._hook_routers() if capture_routing else []
        self._step_routing: list[Tensor | None] = [None] * len(self._routers)

        self._prefix = PrefixStore(prefix_cache_tokens)
        self.draft_k = draft_k
        self.draft = None
        self.draft_version = 0  # the policy version the draft's weights were last pushed with (update_draft)
        if draft_checkpoint_dir is not None and is_heads_dir(draft_checkpoint_dir):
            self.draft = DraftHeads(str(draft_checkpoint_dir), self.dtype, self.device, int(text_cfg.hidden_size))
            if self.draft.k != draft_k:
                raise ValueError(f"the draft heads in {draft_checkpoint_dir} are {self.draft.k}; draft_k={draft_k} "
                                 "needs one head per proposed token")
        elif draft_checkpoint_dir is not None:
            self.draft = DraftModel(str(draft_checkpoint_dir), self.dtype, self.device, max_batch_size)
            if self.draft.vocab_size != self.vocab_size:
                raise ValueError(f"the draft's vocabulary ({self.draft.vocab_size} tokens, {draft_checkpoint_dir}) is "
                                 f"not the policy's ({self.vocab_size}, {self.checkpoint_dir}); build the draft "
                                 "with the policy's tokenizer")
        # A speculative round reads 2k + 1 uniforms per slot; a slot draws this many rounds' at once.
        self.spec_noise_rounds = 16 if self.draft is not None else 0
        self._alloc_slots()
        self._fast = FastQwen3(self.model) if FastQwen3.supports(self.model) else None
        with torch.no_grad():
            if self._fast is not None and not forward_matches(self._run_model, self.vocab_size, self.device,
                                                              decode_atol=self._fast.decode_atol):
                log.warning("engine %d: the fast %s forward does not match transformers' on this machine; "
                            "using the module forward", engine_id, self.model.config.model_type)
                self._fast = None
        self.fast_forward = self._fast is not None
        # Scheduler state (touched by the scheduler thread; queues under self._cv).
        self._cv = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._ops: list[tuple[Callable[[], Any], Future]] = []
        self._paused = self._released = self._closed = False
        self._busy_s = 0.0  # seconds the scheduler thread spent generating (health()["busy_s"])
        self._busy_since: float | None = None  # when the step in progress started
        self._busy_lock = threading.Lock()
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name=f"miles-engine-{engine_id}", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        """Complete each request ``n`` times; results are ordered by request, then index.

        A request's own ``sampling`` wins over the argument (the default for the others). Blocks
        until every completion is done (aborted ones come back with status ``ABORTED``).
        """
        self._check_usable("generate")
        for r in requests:
            self._check_images(r)
        job, rows = self._intake(requests, sampling)
        if not rows:
            return []
        if self.precision.true_on_policy:  # between two scheduler steps, one row after the other
            return self._run_op(lambda: self._timed(lambda: [self._exact_result(row) for row in rows]))
        with self._cv:
            self._check_usable("generate")
            self._waiting.extend(rows)
            self._cv.notify_all()
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(f"engine {self.engine_id}: generation failed: {job.error!r}") from job.error
        return [r for per_request in job.results for r in per_request]  # type: ignore[misc]

    def abort(self, request_ids: list[str]) -> int:
        """Stop every row of these requests (running or queued); returns how many requests were hit."""
        return self._run_op(lambda: self._abort(set(request_ids)))

    def pause(self) -> None:
        """Stop stepping after the current step; in-flight rows keep their slots, new requests queue."""
        self._run_op(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        self._run_op(lambda: setattr(self, "_paused", False))

    def health(self) -> dict[str, Any]:
        """Liveness and load, answered without waiting for the scheduler."""
        return {"ok": self._thread.is_alive() and not self._closed, "version": self._version,
                "engine_id": self.engine_id, "running": self._n, "waiting": len(self._waiting),
                "paused": self._paused, "released": self._released, "adapters": sorted(self._adapters),
                "prefix_cache": self._prefix.stats(), "memory": process_memory(), **self._busy_reading()}

    def _busy_reading(self) -> dict[str, float]:
        with self._busy_lock:
            now = time.perf_counter()
            running = now - self._busy_since if self._busy_since is not None else 0.0
            return {"busy_s": self._busy_s + running, "clock_s": now}

    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        """Stop the scheduler thread; queued and running requests fail."""
        if not self._closed and self._thread.is_alive():
            self._run_op(lambda: setattr(self, "_closed", True))
        self._thread.join(timeout=10)

    def _end_job(self) -> None:
        """Parking (:mod:`miles.backends.reuse`): the scheduler stops, and the offloaded weights' file goes."""
        self.close()
        if isinstance(self._offload, int):
            os.close(self._offload)

    # ---- checks and scheduler ops (caller threads) ------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id}: {what} after close()")

    def _check_usable(self, what: str) -> None:
        self._check_open(what)
        if self._released:
            raise RuntimeError(f"engine {self.engine_id}: {what} while memory is released; "
                               "call resume_memory() first")

    def _on_work_thread(self, fn: Callable[[], Any]) -> Any:  # Profiled: the scheduler thread runs the model
        return self._run_op(fn)

    def _run_op(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the scheduler thread between two steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        if not self._thread.is_alive():
            raise RuntimeError(f"engine {self.engine_id}: the scheduler thread is not running")
        fut: Future = Future()
        with self._cv:
            self._ops.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # ---- slot state ---------------------------------------------------------------------------

    # ---- scheduler thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        with torch.no_grad():
            while True:
                with self._cv:
                    while not (self._ops or self._closed or (not self._paused and (self._n or self._waiting))):
                        self._cv.wait()
                    ops, self._ops = self._ops, []
                for fn, fut in ops:
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                if self._closed:
                    self._fail_all(RuntimeError("engine closed"))
                    return
                if self._paused or not (self._n or self._waiting):
                    continue
                try:
                    self._timed(self._step)
                except Exception as e:  # noqa: BLE001 - every waiting caller gets it
                    self._fail_all(e)

    def _step(self) -> None:
        self._admit()
        if self._n and self.draft is not None:
            self._finish_rows(self._spec_decode())
        elif self._n:
            self._decode()

    def _timed(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the scheduler thread, its seconds added to ``busy_s``."""
        with self._busy_lock:
            self._busy_since = time.perf_counter()
        try:
            return fn()
        finally:
            with self._busy_lock:
                self._busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None

    def _forward(self, ids: Tensor, mask: Tensor, position_ids: Tensor, rows: list[_Row],
                 embeds: Tensor | None = None) -> Tensor:
        """Base model forward through the slot cache: final-normed hidden states [B, T, D]; batch row
        ``i`` uses ``rows[i]``'s adapter when the engine holds adapters. ``embeds`` (a vision-language
        model's prefill): input embeddings with the image features in place, used instead of ``ids``."""
        if embeds is not None:
            return self._base(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=True,
                              **{self._cache_kwarg: self._cache}).last_hidden_state
        with self._adapters_of(rows):
            return self._run_model(self._fast is not None, ids, mask, position_ids, self._cache)

    def _head(self, hidden: Tensor, rows: list[_Row]) -> Tensor:
        """fp32 logits of hidden states [B, D], row ``i`` through ``rows[i]``'s adapter (a LoRA ``lm_head``)."""
        with self._adapters_of(rows):
            return self._lm_head(hidden).float()

    def _adapters_of(self, rows: list[_Row]) -> Any:
        """Within it, batch row ``i`` computes with ``rows[i]``'s adapter (nothing to do without adapters,
        or when every row uses the default adapter: peft's active one, its plain LoRA forward)."""
        if self._peft is None:
            return contextlib.nullcontext()
        names = [self.default_adapter if r.request.adapter is None
                 else None if r.request.adapter == lora.BASE else r.request.adapter for r in rows]
        if all(n == self.default_adapter for n in names):
            return contextlib.nullcontext()
        return lora.rows_use(self._peft, names)  # several adapters (or the base) in one batch

    def _run_model(self, fast: bool, ids: Tensor, mask: Tensor, position_ids: Tensor, cache: SlotCache) -> Tensor:
        if fast:
            assert self._fast is not None
            return self._fast(ids, mask, position_ids, cache)
        out = self._base(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         **{self._cache_kwarg: cache})
        return out.last_hidden_state

    def _decode(self) -> None:
        """One token for every occupied slot."""
        b, st = self._n, self._st
        pos = st["pos"][:b]
        kv_len = int(pos.max()) + 1
        arange = self._arange[:b]
        self._cache.decode(arange, pos, kv_len)
        mask = (self._positions[:kv_len][None, :] <= pos[:, None])[:, None, None, :]
        position_ids = pos[:, None] + st["delta"][:b, None] if self.vision else pos[:, None]
        hidden = self._forward(st["tok"][:b, None], mask, position_ids, self._rows[:b])  # type: ignore[arg-type]
        logits = self._head(hidden[:, -1], self._rows[:b])  # type: ignore[arg-type]
        routing = torch.stack(self._step_routing, 1) if self._routers else None  # [b, layers, k]
        pos += 1
        self._finish_rows(self._emit(0, b, logits, routing))

