"""The SGLang rollout engine: a real SGLang server process behind the :class:`RolloutEngine` Protocol.

Each engine actor owns one server (:mod:`miles.rollout.sglang_server`: SGLang's own venv, 127.0.0.1,
a free port, killed with the actor) and maps the Protocol onto its HTTP API, token ids in and out
(``--skip-tokenizer-init``):

- ``generate`` -> one ``POST /generate`` per call with every completion as its own row (``rid``
  ``<request_id>#<index>.<call>``), ``return_logprob``; results in request then index order.
  SGLang's reported log-probs are ``log(softmax(logits / T))`` of the unfiltered distribution for
  sampled rows and ``log_softmax(logits)`` for greedy ones (``sglang/srt/layers/sampler.py``, the
  ``pytorch`` sampling backend used on CPU): the quantity the torch engine reports. On CPU in fp32
  they match ``log_softmax(logits / T)`` of a transformers forward to ~5e-7
  (``tests/test_sglang.py``).
- Finish reasons: SGLang's ``stop`` on an EOS id -> ``eos``, on a ``stop_token_ids`` id ->
  ``stop_token`` (both ``COMPLETED``, the token kept); ``length`` -> ``TRUNCATED``; ``abort`` ->
  ``ABORTED`` with the tokens so far. Stop *strings* need SGLang's tokenizer, which the server does
  not load: they are refused (use ``stop_token_ids``).
- Seeds: each row gets ``sampling_seed`` from ``(request seed, index)``, but SGLang honours it only
  with ``--enable-deterministic-inference`` (``deterministic: true``), which needs a GPU attention
  backend (fa3 / flashinfer / triton); SGLang refuses it with ``torch_native``. On CPU sampling
  draws from the server's generator (``--random-seed`` = the engine seed): reproducible only for
  the same sequence of batches, not per request.
- Prefix caching (SGLang's radix cache) is off on CPU by default (``radix_cache``): a prompt
  whose prefix is cached is prefilled in a different shape, and its log-probs then differ from an
  uncached run's by ~5e-7 in fp32 (measured), so greedy decoding would not repeat bit for bit.
- ``update_weights`` checks names, shapes and dtypes against the checkpoint first (SGLang's loader
  silently skips unknown names and keeps missing ones): a refused update sends nothing, and weights
  and version stay. :meth:`SGLangEngine._load_weights` then casts to the engine's dtype, applies the
  recipe's rollout quantization, and loads through ``weight_load``
  (:mod:`miles.rollout.sglang_weights`): ``tensor`` (default; ``/update_weights_from_tensor``, each
  bucket through one shared-memory buffer), ``distributed`` (``/update_weights_from_distributed``
  over a gloo group between the engine actor and its server) or ``disk`` (safetensors, then
  ``/update_weights_from_disk``). The server runs on the engine actor's node, so all three work on
  every node; ``python -m miles.bench sync --engine sglang`` compares them. Requests in flight
  finish on the old weights first (SGLang's update takes a lock that waits for them); a model that
  needs more than one bucket (``weight_bucket_mb``) is loaded while the engine holds new calls and
  after its calls in flight returned (unless paused), so no request sees half of a version. Every
  result carries the version SGLang reports. GPU: untested (SGLang's tensor path takes CUDA IPC
  handles there, and the group would be NCCL; neither is wired up).
- Quantized recipes (fp8, mxfp8, nvfp4, int4, int4_qat): the server gets the fake-quantized weights
  the torch engine serves (:func:`miles.rollout.sglang_weights.served_weights`), pushed once the
  server is up (before the first request) and at every update; in fp32 its greedy log-probs equal
  the torch engine's under the recipe and differ from the unquantized ones (``tests/test_sglang.py``).
  SGLang's own ``--quantization`` does not run on CPU (``tests/test_sglang_limits.py``: ``fp8``
  needs sgl-kernel's AMX CPU kernels, ``Fp8LinearMethod on CPU requires that CPU has AMX support``,
  and bf16 / fp16; ``mxfp8`` needs Triton's GPU driver): the dequantized weights are the fallback.
  ``precision.true_on_policy`` is refused (SGLang's kernels are not the trainer's).
- LoRA (``adapter``, ``adapter_names``): SGLang's own LoRA serving (:mod:`miles.rollout.sglang_lora`),
  adapter-only updates through ``/load_lora_adapter_from_tensors``, each request naming its adapter
  (``lora_path``); in fp32 the log-probs equal the torch engine's (``tests/test_sglang_lora_moe.py``).
  With an ``lm_head`` adapter on the ``torch_native`` backend (CPU) one adapter and no base-model
  requests (that backend mixes rows prefilled together). GPU LoRA backends: untested.
- ``pause`` -> ``POST /pause_generation`` (``in_place``: running rows keep their KV cache) and new
  calls wait in the engine; ``resume`` -> ``POST /continue_generation``. ``abort`` -> ``POST
  /abort_request`` per row in flight; a call still waiting on a pause is answered ``ABORTED`` here.
- ``health`` -> the process is alive and ``GET /health`` answers within ``health_timeout_s``. A
  watchdog thread probes every ``health_interval_s``; after ``max_health_failures`` misses in a row
  (a hung or stopped server), or as soon as the process exits, the engine is dead: the server is
  killed, every call in flight and every later call raises
  :class:`~miles.rollout.dispatch.EngineDeadError`, and the rollout manager's pool takes the engine
  out of rotation and retries its requests on the others.
- MoE models run on CPU. Routing capture (``capture_routing: true``, which ``algo.routing_replay=rollout``
  turns on): ``--enable-return-routed-experts`` and ``return_routed_experts`` per request; SGLang
  returns the experts of every position it ran, decoded to ``GenerateResult.prompt_routing`` ``[P -
  1, moe_layers, top_k]`` and ``routing`` ``[T, moe_layers, top_k]`` int16
  (:func:`~miles.rollout.sglang_wire.decode_routing`), the torch engine's layout; on CPU both equal
  the routers' top-k of the reference model's forward and the torch engine's capture
  (``tests/test_sglang_lora_moe.py``). On CPU it needs miles' compatibility layer: SGLang registers the
  capture buffer with ``cudaHostRegister``, and without a driver the server dies at start
  (``RuntimeError: Found no NVIDIA driver on your system``, ``tests/test_sglang_limits.py``). GPU:
  untested (with the radix cache on, a cached prefix's routes are SGLang's to report).

Memory release: ``/release_memory_occupation`` calls a CUDA synchronize that kills the server on
CPU, so :class:`SGLangEngine` offers no ``release_memory``: with ``placement.offload_engines=null``
(the default) its engines keep their memory while the trainer trains, and ``true`` is refused at start-up. :class:`SGLangOffloadingEngine` adds it for GPUs (untested: no GPU here).

Several engines: one server per engine actor, spread by miles' own dispatcher
(:mod:`miles.rollout.dispatch`), not by ``sglang-router``. The router works on CPU (0.3.2 installs
in seconds without torch; in front of two of these servers it routed ``/generate``, retried on the
live one when the other was killed, and its health check marked the dead one unhealthy within
~4 s). But the loop needs, per engine, the weight version it serves, pause / resume and weight
updates around each sync, abort of a given request on the engine that runs it, and a retry on
another engine with a deadline when one dies or hangs: the dispatcher already does all of these
for every engine backend over the engine actors, while a router in front would hide which server
serves a request and which version it holds, and each per-engine call would bypass it anyway.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles.adapters import lora
from miles.backends.reuse import Reusable
from miles.config.schema import AdapterConfig, PrecisionConfig
from miles.rollout.dispatch import EngineDeadError
from miles.rollout.sglang_engine_weights import SGLangEngineWeights
from miles.rollout.sglang_lora import SGLangAdapters, check_adapter, resolve_backend
from miles.rollout.sglang_lora import server_args as lora_server_args
from miles.rollout.sglang_server import (
    ServerHTTPError,
    ServerStartError,
    SGLangServer,
    find_python,
    server_env,
)
from miles.rollout.sglang_weights import WEIGHT_LOADS, weights_dir
from miles.rollout.sglang_wire import Checkpoint, aborted, check_request, row_seed, sampling_params, to_result
from miles.types import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CONTROL_TIMEOUT_S = 30.0  # pause / continue / abort / weight-update calls that should answer at once


@dataclass(eq=False)
class _Call:
    """One ``generate`` call while it waits on a pause; ``aborted`` fills as ``abort`` hits its requests."""

    request_ids: set[str]
    aborted: set[str] = field(default_factory=set)


class SGLangEngine(SGLangEngineWeights, Reusable):
    """Generates through an SGLang server process it owns; see the module docstring.

    Server knobs: ``python`` (the SGLang venv's interpreter), ``max_total_tokens`` (KV-cache tokens),
    ``max_batch_size`` (rows decoded together, as the torch engine's; ``--max-running-requests``),
    ``context_length`` (default: the model's), ``mem_fraction_static`` (GPU), ``attention_backend`` (default ``torch_native`` on CPU, SGLang's choice on GPU),
    ``deterministic`` (per-request seeds; GPU attention backends only), ``radix_cache`` (prefix
    caching; default off on CPU, see the module docstring), ``capture_routing``,
    ``server_args`` (more ``--flag: value`` pairs), ``log_dir``. Weights: ``weight_load``
    (``tensor``, ``distributed`` or ``disk``: :mod:`miles.rollout.sglang_weights`; a plain attribute
    that may be changed between updates), ``weight_bucket_mb`` (most bytes per load call). LoRA:
    ``adapter`` and ``adapter_names`` (as the torch engine's), ``lora_backend`` (default
    ``torch_native`` on CPU, SGLang's choice on GPU). Liveness: ``start_timeout_s``,
    ``request_timeout_s`` (one generate call, and one weight-load call), ``health_interval_s``,
    ``health_timeout_s``, ``max_health_failures``.
    """

    @staticmethod
    def check_config(run: Any) -> None:
        """Refuse, before any actor starts, what this engine cannot serve: true on-policy numerics, a weight-load
        path it does not know, and adapters it cannot hold."""
        from miles.config.validate import ConfigError
        from miles.core.cluster import device

        kwargs = run.rollout.engine.kwargs
        if kwargs.get("weight_load", "tensor") not in WEIGHT_LOADS:
            raise ConfigError(f"rollout.engine.weight_load={kwargs.get('weight_load')!r}; valid: "
                              f"{', '.join(WEIGHT_LOADS)}")
        if run.adapter.kind == "lora":
            names = tuple(t.name for t in run.tenants) or ("default",)
            try:
                check_adapter(run.adapter, names, resolve_backend(kwargs.get("lora_backend"), device(run)))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if run.precision.true_on_policy:
            raise ConfigError("precision.true_on_policy=true: the SGLang engine's kernels are not the trainer's; "
                              "use rollout=torch for it")

    offload_hint = ("SGLang cannot release memory on CPU (its release kills the server); on a GPU, "
                    "rollout.engine._target_=miles.rollout.sglang_engine.SGLangOffloadingEngine offloads (untested).")

    def __init__(
        self,
        checkpoint_dir: str,
        precision: PrecisionConfig,
        *,
        seed: int = 0,
        num_threads: int = 0,
        engine_id: int = 0,
        device: str = "cpu",
        python: str | None = None,
        max_total_tokens: int | None = 32768,
        max_batch_size: int | None = None,
        context_length: int | None = None,
        mem_fraction_static: float | None = None,
        attention_backend: str | None = None,
        deterministic: bool = False,
        radix_cache: bool | None = None,
        capture_routing: bool = False,
        weight_load: str = "tensor",
        weight_bucket_mb: float = 512.0,
        adapter: AdapterConfig | None = None,
        adapter_names: tuple[str, ...] = ("default",),
        lora_backend: str | None = None,
        server_args: dict[str, Any] | None = None,
        log_dir: str | None = None,
        start_timeout_s: float = 900.0,
        request_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 10.0,
        max_health_failures: int = 3,
    ) -> None:
        if precision.rollout_dtype not in _DTYPES:
            raise ValueError(f"precision.rollout_dtype={precision.rollout_dtype!r}; valid: {sorted(_DTYPES)}")
        if weight_load not in WEIGHT_LOADS:
            raise ValueError(f"rollout.engine.weight_load={weight_load!r}; valid: {', '.join(WEIGHT_LOADS)}")
        if not weight_bucket_mb > 0:
            raise ValueError(f"rollout.engine.weight_bucket_mb must be > 0, got {weight_bucket_mb}")
        adapters = adapter is not None and adapter.kind == "lora"
        lora_backend = resolve_backend(lora_backend, device)
        if adapters:
            lora.check_adapter_config(adapter)
            check_adapter(adapter, tuple(adapter_names), lora_backend)
        if device == "cpu" and deterministic:
            raise ValueError("rollout.engine.deterministic=true needs a GPU attention backend (fa3, flashinfer, "
                             "triton); SGLang refuses it with torch_native, the only one on CPU")
        for key, value in (("request_timeout_s", request_timeout_s), ("start_timeout_s", start_timeout_s),
                           ("health_interval_s", health_interval_s), ("health_timeout_s", health_timeout_s)):
            if not value > 0:
                raise ValueError(f"rollout.engine.{key} must be > 0, got {value}")
        if max_health_failures < 1:
            raise ValueError(f"rollout.engine.max_health_failures must be >= 1, got {max_health_failures}")
        self.checkpoint_dir, self.precision, self.engine_id = str(checkpoint_dir), precision, engine_id
        self.device, self.dtype = device, _DTYPES[precision.rollout_dtype]
        self.request_timeout_s, self.health_timeout_s = request_timeout_s, health_timeout_s
        self.health_interval_s, self.max_health_failures = health_interval_s, max_health_failures
        self.capture_routing = capture_routing
        self.weight_load, self.bucket_bytes = weight_load, int(weight_bucket_mb * 2**20)
        self.ckpt = Checkpoint.read(Path(self.checkpoint_dir))
        self.vocab_size, self.eos_ids = self.ckpt.vocab_size, self.ckpt.eos_ids
        self.context_length = context_length or self.ckpt.max_positions
        self._seeds = torch.Generator().manual_seed(row_seed(seed, engine_id))
        self._cv = threading.Condition()
        self._held: set[_Call] = set()
        self._inflight: dict[str, set[str]] = {}  # request id -> SGLang rids in flight
        self._calls = itertools.count()
        self._update_lock = threading.Lock()
        self._paused = self._closed = self._holding = False
        self._dead: str | None = None
        self._version = 0
        self._weights_dir = weights_dir(engine_id)
        self._loaders: dict[str, Any] = {}
        self.adapters = (SGLangAdapters(adapter, tuple(adapter_names), self.ckpt.shapes, self._control,
                                        request_timeout_s, self.dtype, lora_backend) if adapters else None)

        py = find_python(python)
        args = ["--model-path", self.checkpoint_dir, "--device", device, "--dtype", precision.rollout_dtype,
                "--skip-tokenizer-init", "--random-seed", str(seed), "--sleep-on-idle", "--weight-version", "0"]
        backend = attention_backend or ("torch_native" if device == "cpu" else None)
        for flag, value in (("--attention-backend", backend), ("--max-total-tokens", max_total_tokens),
                            ("--max-running-requests", max_batch_size),
                            ("--context-length", context_length), ("--mem-fraction-static", mem_fraction_static)):
            if value is not None:
                args += [flag, str(value)]
        if deterministic:
            args.append("--enable-deterministic-inference")
        if not (radix_cache if radix_cache is not None else device != "cpu"):
            args.append("--disable-radix-cache")
        if capture_routing:
            args.append("--enable-return-routed-experts")
        if adapters:
            args += lora_server_args(adapter, tuple(adapter_names), lora_backend)
        for key, value in (server_args or {}).items():
            flag = "--" + str(key).lstrip("-").replace("_", "-")
            if value is True:
                args.append(flag)
            elif value not in (None, False):
                args += [flag, str(value)]
        logs = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "miles-sglang-logs"
        log_path = logs / f"engine{engine_id}-{os.getpid()}-{int(time.time())}.log"
        t0 = time.perf_counter()
        try:
            for attempt in range(3):  # a port taken by another process between the pick and the bind: another port
                try:
                    self.server = SGLangServer(py, args, server_env(py, device, num_threads), log_path,
                                               start_timeout_s=start_timeout_s)
                    break
                except ServerStartError as e:
                    taken = getattr(e, "server", None)
                    if attempt == 2 or taken is None or not taken.port_taken():
                        raise
                    log.warning("engine %d: port %d was taken before the SGLang server bound it; another port",
                                engine_id, taken.port)
        except BaseException:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            raise
        self.start_s = time.perf_counter() - t0
        log.info("engine %d: SGLang server pid %d on %s up in %.1f s (log %s)", engine_id, self.server.pid,
                 self.server.url, self.start_s, log_path)
        self._watchdog = threading.Thread(target=self._watch, name=f"sglang-watchdog-{engine_id}", daemon=True)
        self._watchdog.start()
        try:
            self._push_initial()
        except BaseException:
            self.close()
            raise

    # ---- Protocol -------------------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        """Complete each request ``n`` times; results ordered by request then index (see the module docstring)."""
        self._check_usable("generate")
        params = [check_request(r, sampling, self.ckpt, self.context_length) for r in requests]
        for r in requests:
            if self.adapters is not None:
                self.adapters.check_request(r.request_id, r.adapter)
            elif r.adapter is not None and r.adapter != lora.BASE:
                raise ValueError(f"request {r.request_id!r} asks for adapter {r.adapter!r}; this engine holds none")
        seeds = [self._request_seed(r, sp) for r, sp in zip(requests, params, strict=True)]
        call = _Call(request_ids={r.request_id for r in requests})
        tag = next(self._calls)
        rows: list[tuple[int, GenerateRequest, SamplingParams, int, int]] = []  # (pos, request, sampling, index, seed)
        with self._cv:
            self._held.add(call)
            try:
                while (self._paused or self._holding) and not self._stopped() and not call.request_ids <= call.aborted:
                    self._cv.wait()
            finally:
                self._held.discard(call)
            self._check_usable("generate")
            for pos, (r, sp, seed) in enumerate(zip(requests, params, seeds, strict=True)):
                if r.request_id not in call.aborted:
                    rows += [(pos, r, sp, j, seed) for j in range(r.n)]
            rids = [f"{r.request_id}#{j}.{tag}" for _, r, _, j, _ in rows]
            for (_, r, _, _, _), rid in zip(rows, rids, strict=True):
                self._inflight.setdefault(r.request_id, set()).add(rid)
        results: dict[tuple[int, int], GenerateResult] = {}
        for pos, r in enumerate(requests):
            if r.request_id in call.aborted:
                for j in range(r.n):
                    results[pos, j] = aborted(r.request_id, j, self._version)
        if rows:
            try:
                outs = self._post_generate(rows, rids)
            finally:
                with self._cv:
                    for (_, r, _, _, _), rid in zip(rows, rids, strict=True):
                        left = self._inflight.get(r.request_id)
                        if left is not None:
                            left.discard(rid)
                            if not left:
                                del self._inflight[r.request_id]
            for (pos, r, sp, j, _), out in zip(rows, outs, strict=True):
                results[pos, j] = to_result(r.request_id, j, sp, out, self.ckpt, version=self._version,
                                            routing=self.capture_routing, prompt_len=len(r.prompt_ids))
        return [results[pos, j] for pos, r in enumerate(requests) for j in range(r.n)]

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Check the update, then :meth:`_load_weights` it: the server serves ``version`` on return.

        A full update sends every weight of the checkpoint (HF names; ``lm_head.weight`` may be left out
        of tied embeddings); an engine with adapters takes adapter tensors only
        (:func:`miles.adapters.lora.sync_state` names). On a ``ValueError`` (wrong names, shapes or
        dtypes) nothing was sent to the server. Returns ``{"update_s", "copy_s", "load_s", "quant_s",
        "bytes", "bytes_per_s"}``.
        """
        t0 = time.perf_counter()
        self._check_usable("update_weights")
        if self.adapters is not None:
            self.adapters.check(state_dict, version)
        else:
            self._check_full(state_dict, version)
        metrics = self._load_weights(state_dict, version)
        update_s = time.perf_counter() - t0
        return {**metrics, "update_s": update_s, "bytes_per_s": metrics["bytes"] / max(update_s, 1e-9)}

    def update_weights_from(self, receiver: Any, version: int) -> dict[str, float]:
        """``sd = receiver.receive(self)`` (a transport's receiving end), then :meth:`update_weights`."""
        t0 = time.perf_counter()
        state_dict = receiver.receive(self)
        receive_s = time.perf_counter() - t0
        return {**self.update_weights(state_dict, version), "receive_s": receive_s}

    def pause(self) -> None:
        """Running rows stop stepping (they keep their KV cache); new calls wait in the engine."""
        self._check_usable("pause")
        with self._cv:
            self._paused = True
        self._control("/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        """Undo :meth:`pause`: the server continues and the waiting calls are sent."""
        self._check_usable("resume")
        self._control("/continue_generation", {})
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def abort(self, request_ids: list[str]) -> int:
        """End these requests ``ABORTED``: those in flight on the server, and calls waiting on a pause."""
        wanted, hit, rids = set(request_ids), set(), []
        with self._cv:
            for call in self._held:
                found = (call.request_ids & wanted) - call.aborted
                call.aborted |= found
                hit |= found
            for rid in wanted:
                if rid in self._inflight:
                    hit.add(rid)
                    rids += sorted(self._inflight[rid])
            self._cv.notify_all()
        if rids and not self._stopped():
            self._abort_rids(rids)
            # a row whose HTTP call has not reached the server yet misses the first abort; once more
            threading.Timer(0.25, self._abort_rids, args=(rids, True)).start()
        return len(hit)

    def health(self) -> dict[str, Any]:
        """``ok``: the process runs, the engine is not dead, and ``/health`` answered within ``health_timeout_s``."""
        ok = not self._stopped() and self.server.healthy(self.health_timeout_s)
        with self._cv:
            inflight, waiting = sum(len(v) for v in self._inflight.values()), len(self._held)
        return {"ok": ok, "version": self._version, "engine_id": self.engine_id, "pid": self.server.pid,
                "url": self.server.url, "paused": self._paused, "running": inflight, "waiting": waiting,
                "dead": self._dead, "closed": self._closed, "log": str(self.server.log_path)}

    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        """Kill the server (its whole process group) and remove the weight directories; calls in flight fail."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self.server.kill()
        for loader in self._loaders.values():
            loader.close()
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    def _end_job(self) -> None:
        """Parking (:mod:`miles.backends.reuse`): the server goes with the job."""
        self.close()

    # ---- HTTP calls -----------------------------------------------------------------------------

    def _post_generate(self, rows: list[tuple[int, GenerateRequest, SamplingParams, int, int]],
                       rids: list[str]) -> list[dict[str, Any]]:
        body: dict[str, Any] = {
            "input_ids": [list(r.prompt_ids) for _, r, _, _, _ in rows],
            "sampling_params": [sampling_params(sp, seed, j) for _, _, sp, j, seed in rows],
            "rid": rids,
            "return_logprob": True,
        }
        if any(sp.logprobs_top_k for _, _, sp, _, _ in rows):
            body["top_logprobs_num"] = [sp.logprobs_top_k for _, _, sp, _, _ in rows]
        if self.capture_routing:
            body["return_routed_experts"] = True
        if self.adapters is not None:
            body["lora_path"] = [self.adapters.lora_path(r.adapter) for _, r, _, _, _ in rows]
        try:
            outs = self.server.post("/generate", body, timeout_s=self.request_timeout_s)
        except (OSError, ServerHTTPError, ValueError) as e:
            self._raise_if_dead("generate")
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                self._abort_rids(rids, quiet=True)
                raise RuntimeError(f"engine {self.engine_id}: SGLang did not answer a generate call of {len(rows)} "
                                   f"row(s) within rollout.engine.request_timeout_s={self.request_timeout_s:g}s; "
                                   "its rows were aborted") from e
            raise RuntimeError(f"engine {self.engine_id}: SGLang generate failed: {e}") from e
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != len(rows):
            raise RuntimeError(f"engine {self.engine_id}: SGLang answered {type(outs).__name__} "
                               f"{len(outs) if isinstance(outs, list) else ''} for {len(rows)} rows")
        return outs

    def _control(self, path: str, body: dict[str, Any], timeout_s: float = _CONTROL_TIMEOUT_S) -> Any:
        try:
            return self.server.post(path, body, timeout_s=timeout_s)
        except (OSError, ServerHTTPError, ValueError) as e:
            self._raise_if_dead(path.lstrip("/"))
            raise RuntimeError(f"engine {self.engine_id}: SGLang {path} failed: {e}") from e

    def _abort_rids(self, rids: list[str], quiet: bool = False) -> None:
        for rid in rids:
            if self._stopped():
                return
            try:
                self.server.post("/abort_request", {"rid": rid}, timeout_s=min(5.0, self.health_timeout_s))
            except (OSError, ServerHTTPError, ValueError) as e:
                if not quiet:
                    log.warning("engine %d: abort of %s failed: %s", self.engine_id, rid, e)
                return

    # ---- requests and results -------------------------------------------------------------------

    def _request_seed(self, r: GenerateRequest, sp: SamplingParams) -> int:
        seed = r.seed if r.seed is not None else sp.seed
        if seed is None:
            with self._cv:
                seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        return seed

    # ---- liveness -------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Every ``health_interval_s``: the process runs and answers ``/health``; else the engine is dead."""
        misses = 0
        while not self._closed and self._dead is None:
            if self.server.exited.wait(self.health_interval_s):
                self._die_exited()
                return
            if self._closed:
                return
            misses = 0 if self.server.healthy(self.health_timeout_s) else misses + 1
            if misses >= self.max_health_failures:
                self._die(f"the SGLang server (pid {self.server.pid}) did not answer /health within "
                          f"{self.health_timeout_s:g} s {misses} times in a row (hung or stopped); it was killed "
                          f"(log: {self.server.log_path})")
                return

    def _die_exited(self) -> None:
        self._die(f"the SGLang server process exited with code {self.server.exit_code} (log: {self.server.log_path})")

    def _die(self, reason: str) -> None:
        """Mark the engine dead (``reason``: one line, it ends up in the pool's error messages) and kill the server."""
        with self._cv:
            if self._dead is not None or self._closed:
                return
            self._dead = reason
            self._cv.notify_all()
        self.server.kill()
        log.error("engine %d is dead: %s; last lines of its log:\n%s", self.engine_id, reason,
                  self.server.log_tail(15))

    def _raise_if_dead(self, what: str) -> None:
        """After a failed HTTP call: if the server is gone (or goes within a second), the engine is dead."""
        if self._dead is None and not self._closed and self.server.exited.wait(1.0):
            self._die_exited()
        if self._dead is not None:
            raise EngineDeadError(f"engine {self.engine_id}: {what} failed: {self._dead}")

    def _stopped(self) -> bool:
        return self._closed or self._dead is not None

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id}: {what} after close()")
        if self._dead is not None:
            raise EngineDeadError(f"engine {self.engine_id}: {what} on a dead engine: {self._dead}")


class SGLangOffloadingEngine(SGLangEngine):
    """:class:`SGLangEngine` plus ``release_memory`` / ``resume_memory`` through SGLang's
    ``/release_memory_occupation`` and ``/resume_memory_occupation`` (``placement=colocate`` with
    ``placement.offload_engines=true``). GPU only, and untested: no GPU has run it. On CPU the
    release kills the server, so the constructor refuses ``device="cpu"``.
    """

    def __init__(self, checkpoint_dir: str, precision: PrecisionConfig, *, device: str = "cpu", **kwargs: Any) -> None:
        if device == "cpu":
            raise ValueError("SGLangOffloadingEngine needs a GPU: on CPU SGLang's /release_memory_occupation kills the "
                             "server. Use rollout.engine._target_=miles.rollout.sglang_engine.SGLangEngine with "
                             "placement.offload_engines=false")
        server_args = {"enable_memory_saver": True, **(kwargs.pop("server_args", None) or {})}
        super().__init__(checkpoint_dir, precision, device=device, server_args=server_args, **kwargs)
        self._released = False

    def release_memory(self) -> None:
        """Free the KV cache and the weights on the GPU; ``generate`` raises until they are back."""
        self._control("/release_memory_occupation", {})
        self._released = True

    def resume_memory(self) -> None:
        """Restore what :meth:`release_memory` freed."""
        self._control("/resume_memory_occupation", {})
        self._released = False

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """A released engine takes its memory back first, then loads the new weights."""
        if self._released:
            self.resume_memory()
        return super().update_weights(state_dict, version)

    def _check_usable(self, what: str) -> None:
        super()._check_usable(what)
        if getattr(self, "_released", False) and what == "generate":
            raise RuntimeError(f"engine {self.engine_id}: generate while memory is released; call resume_memory() first")
