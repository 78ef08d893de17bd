"""The SGLang rollout engine: a real SGLang server process behind the :class:`RolloutEngine` Protocol.

Each engine actor owns one server (:mod:`miles.rollout.sglang_server`: SGLang's own venv, 127.0.0.1,
a free port, killed with the actor) and maps the Protocol onto its HTTP API, token ids in and out
(``--skip-tokenizer-init``):

- ``generate`` -> one ``POST /generate`` per call with every completion as its own row (``rid``
  ``<request_id>#<index>.<post>.``), ``return_logprob``; results in request then index order.
  Every result carries the weight version of each token (``token_versions``).
  SGLang's reported log-probs are ``log(softmax(logits / T))`` of the unfiltered distribution for
  sampled rows and ``log_softmax(logits)`` for greedy ones (``sglang/srt/layers/sampler.py``, the
  ``pytorch`` sampling backend used on CPU): the quantity the torch engine reports. On CPU in fp32
  they match ``log_softmax(logits / T)`` of a transformers forward to ~5e-7
  (``tests/test_sglang.py``).
- ``score`` (on-policy distillation's teacher; :mod:`miles.rollout.sglang_score`) -> ``POST /generate``
  prefills of prompt + response (``max_new_tokens: 0``, ``return_logprob``, ``logprob_start_len`` one before
  the response): SGLang's input log-probs of the response tokens, which are of the raw logits; at a
  temperature other than 1 the engine rescales the whole distribution SGLang returns per position.
- Time to first token (``GenerateResult.ttft_s``): the server runs with ``--enable-metrics``, so each answer
  carries ``meta_info.first_token_latency`` (from the server receiving the row to its prefill's end, by
  SGLang's scheduler); the engine adds the row's wait between the call's arrival and its post. A row
  continued after a weight update keeps that of its first piece with tokens.
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
- ``update_weights`` (:mod:`miles.rollout.sglang_calls`) checks names, shapes and dtypes against the
  checkpoint first (SGLang's loader silently skips unknown names and keeps missing ones): a refused
  update interrupts nothing and sends nothing, and weights and version stay. It then interrupts the
  rows in flight, loads the weights on the idle server while new calls wait, and continues each
  interrupted row as a new row on the new weights (partial rollouts): its result joins the pieces,
  each token tagged with the version that sampled it and each log-prob the one it was sampled with.
  So the async schedules run on this engine (``reports_token_versions``). A user's ``abort`` still
  ends a row ``ABORTED``, also while an update interrupts it (``tests/test_sglang.py``, with each
  load path).
- The load (:mod:`miles.rollout.sglang_engine_weights`) casts to the engine's dtype, applies the
  recipe's rollout quantization, and goes through ``weight_load`` (:mod:`miles.rollout.sglang_weights`):
  ``tensor`` (default; ``/update_weights_from_tensor``, each bucket through one shared-memory buffer),
  ``distributed`` (``/update_weights_from_distributed`` over a gloo group between the engine actor and
  its server) or ``disk`` (safetensors, then ``/update_weights_from_disk``), in buckets of at most
  ``weight_bucket_mb``. The server runs on the engine actor's node, so all three work on every node;
  ``python -m miles.bench sync --engine sglang`` compares them. GPU: untested (SGLang's tensor path takes CUDA IPC handles there, and the group
  would be NCCL; neither is wired up).
- Quantized recipes (fp8, mxfp8, nvfp4, int4, int4_qat): the server gets the fake-quantized weights
  the torch engine serves (:func:`miles.rollout.sglang_weights.served_weights`), pushed once the
  server is up (before the first request) and at every update; in fp32 its greedy log-probs equal
  the torch engine's under the recipe and differ from the unquantized ones (``tests/test_sglang.py``).
  SGLang's own ``--quantization`` does not run on CPU (``tests/test_sglang_limits.py``: ``fp8``
  needs sgl-kernel's AMX CPU kernels, ``Fp8LinearMethod on CPU requires that CPU has AMX support``,
  and bf16 / fp16; ``mxfp8`` needs Triton's GPU driver): the dequantized weights are the fallback.
  ``precision.true_on_policy`` is refused (SGLang's kernels are not the trainer's).
- LoRA (``adapter``, ``adapter_names``): SGLang's own LoRA serving (:mod:`miles.rollout.sglang_lora`),
  adapter-only updates through ``/load_lora_adapter_from_tensors`` (interrupting and continuing the
  rows in flight as a full update does), each request naming its adapter (``lora_path``); in fp32
  the log-probs equal the torch engine's (``tests/test_sglang_lora_moe.py``). With an ``lm_head``
  adapter on the ``torch_native`` backend (CPU) one adapter and no base-model requests (that backend
  mixes rows prefilled together). GPU LoRA backends: untested.
- ``pause`` -> ``POST /pause_generation`` (``in_place``: running rows keep their KV cache) and new
  calls wait in the engine; ``resume`` -> ``POST /continue_generation``. ``abort`` -> ``POST
  /abort_request`` per row in flight; a call still waiting on a pause is answered ``ABORTED`` here.
- ``health`` -> the process is alive and ``GET /health`` answers within ``health_timeout_s``; its
  ``busy_s`` counts the seconds with at least one generate request in flight on the server (the
  loop's ``perf/engine_busy_*``; time rows wait in SGLang's queue counts too). A
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
  (``tests/test_sglang_lora_moe.py``; a continued row's routes: :mod:`miles.rollout.sglang_calls`).
  On CPU it needs miles' compatibility layer: SGLang registers the
  capture buffer with ``cudaHostRegister``, and without a driver the server dies at start
  (``RuntimeError: Found no NVIDIA driver on your system``, ``tests/test_sglang_limits.py``). GPU:
  untested (with the radix cache on, a cached prefix's routes are SGLang's to report).

Memory release: ``/release_memory_occupation`` calls a CUDA synchronize that kills the server on
CPU, so :class:`SGLangEngine` offers no ``release_memory``: with ``placement.offload_engines=null``
(the default) its engines keep their memory while the trainer trains, and ``true`` is refused at start-up. :class:`SGLangOffloadingEngine` adds it for GPUs (untested: no GPU here).

Jobs one after another (``cluster.reuse_actors``, :mod:`miles.backends.reuse`): a parked engine keeps
its idle server after undoing what it added to it (its LoRA adapters unloaded, the ``distributed``
path's group destroyed; its staging buffer goes with it), and the next engine built in the same
actor with the same launch flags (model path, dtype, seed, server knobs, LoRA flags, routing
capture, threads) takes it instead of starting one (35-60 s on 2 CPU cores): it loads its
checkpoint into it as version 0, caches flushed, then pushes its own recipe's quantized weights and
zero adapters, as on a new server. An engine with other launch flags kills the kept server and
starts its own. The sampling generator is not reset (SGLang has no call for that): on CPU, where
requests are not seeded, a job on a kept server samples differently from one on a new server.
(``tests/test_sglang.py``: the plain checkpoint after an fp8 job, fp8 again after it, a new gloo group;
``tests/test_sglang_lora_moe.py``: no adapters left.)

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

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from miles.backends.reuse import Reusable
from miles.config.schema import AdapterConfig, PrecisionConfig
from miles.config.validate import check_adapter_config
from miles.rollout.dispatch import EngineDeadError
from miles.rollout.requests import EngineLimits, row_seed
from miles.rollout.sglang_calls import SGLangCalls
from miles.rollout.sglang_engine_weights import SGLangEngineWeights
from miles.rollout.sglang_lora import SGLangAdapters, check_adapter, resolve_backend
from miles.rollout.sglang_lora import server_args as lora_server_args
from miles.rollout.sglang_score import SGLangScoring
from miles.rollout.sglang_server import (
    ServerHTTPError,
    ServerStartError,
    SGLangServer,
    find_python,
    server_env,
)
from miles.rollout.sglang_weights import WEIGHT_LOADS, weights_dir
from miles.rollout.sglang_wire import Checkpoint
from miles.tracking.memory import process_memory

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CONTROL_TIMEOUT_S = 30.0  # pause / continue / abort / weight-update calls that should answer at once

_KEPT: tuple[str, SGLangServer] | None = None
"""The server of the engine parked last in this process, and its launch (:meth:`SGLangEngine._end_job`)."""


class SGLangEngine(SGLangCalls, SGLangScoring, SGLangEngineWeights, Reusable):
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
    ``health_timeout_s``, ``max_health_failures``. Scoring: ``score_logprobs_per_post`` (most log-prob
    values one ``score`` post asks for: :mod:`miles.rollout.sglang_score`).
    """

    reports_token_versions = True
    """Every result carries the weight version of each token (``token_versions``): async schedules need it."""
    takes_adapter_updates = True
    """Holds LoRA adapters by name beside the base and takes weight pushes of their tensors alone
    (``adapter=lora``)."""

    @staticmethod
    def check_config(run: Any) -> None:
        """Refuse, before any actor starts, what this engine cannot serve: true on-policy numerics, a weight-load
        path it does not know, and adapters it cannot hold."""
        from miles.config.validate import ConfigError
        from miles.machine import Machine, resolve_device

        kwargs = run.rollout.engine.kwargs
        if kwargs.get("weight_load", "tensor") not in WEIGHT_LOADS:
            raise ConfigError(f"rollout.engine.weight_load={kwargs.get('weight_load')!r}; valid: "
                              f"{', '.join(WEIGHT_LOADS)}")
        if run.adapter.kind == "lora":
            names = tuple(t.name for t in run.tenants) or ("default",)
            device = resolve_device(run.placement.device, bool(run.cluster.address), Machine.here())
            try:
                check_adapter(run.adapter, names, resolve_backend(kwargs.get("lora_backend"), device))
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
        score_logprobs_per_post: int = 1 << 22,
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
            check_adapter_config(adapter)
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
        if score_logprobs_per_post < 1:
            raise ValueError(f"rollout.engine.score_logprobs_per_post must be >= 1, got {score_logprobs_per_post}")
        self.checkpoint_dir, self.precision, self.engine_id = str(checkpoint_dir), precision, engine_id
        self.device, self.dtype = device, _DTYPES[precision.rollout_dtype]
        self.request_timeout_s, self.health_timeout_s = request_timeout_s, health_timeout_s
        self.health_interval_s, self.max_health_failures = health_interval_s, max_health_failures
        self.capture_routing, self.score_logprobs_per_post = capture_routing, score_logprobs_per_post
        self.weight_load, self.bucket_bytes = weight_load, int(weight_bucket_mb * 2**20)
        self.ckpt = Checkpoint.read(Path(self.checkpoint_dir))
        self.vocab_size, self.eos_ids = self.ckpt.vocab_size, self.ckpt.eos_ids
        self._seeds = torch.Generator().manual_seed(row_seed(seed, engine_id))
        self._init_calls()
        self._closed = False
        self._dead: str | None = None
        self._version = 0
        self._weights_dir = weights_dir(engine_id)
        self._loaders: dict[str, Any] = {}
        self.adapters = (SGLangAdapters(adapter, tuple(adapter_names), self.ckpt.shapes, self._control,
                                        request_timeout_s, self.dtype, lora_backend) if adapters else None)
        self.limits = EngineLimits(
            vocab_size=self.vocab_size, context_length=context_length or self.ckpt.max_positions,
            adapters=tuple(adapter_names) if adapters else (),
            no_stop_strings="stop strings need a tokenizer, which the SGLang engine's server does not load "
                            "(--skip-tokenizer-init); use stop_token_ids",
            no_base_model=self.adapters.no_base_model if self.adapters is not None else None)

        py = find_python(python)
        args = ["--model-path", self.checkpoint_dir, "--device", device, "--dtype", precision.rollout_dtype,
                "--skip-tokenizer-init", "--random-seed", str(seed), "--sleep-on-idle", "--weight-version", "0",
                "--enable-metrics"]  # answers then carry meta_info.first_token_latency (the time to first token)
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
        self._launch = repr((str(py), args, device, num_threads))
        t0 = time.perf_counter()
        kept = self._take_kept(request_timeout_s)
        if kept is not None:
            self.server = kept
        try:
            for attempt in range(3 if kept is None else 0):  # a port taken before the server bound it: another port
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
                 self.server.url, self.start_s, self.server.log_path)
        self._stop_watch = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, args=(self.server, self._stop_watch),
                                          name=f"sglang-watchdog-{engine_id}", daemon=True)
        self._watchdog.start()
        try:
            self._push_initial()
        except BaseException:
            self.close()
            raise

    def _take_kept(self, timeout_s: float) -> SGLangServer | None:
        """The server a parked engine of this process kept, when it was launched as this engine's would be:
        it loads this engine's checkpoint as version 0 (``/update_weights_from_disk``, caches flushed).
        Any other kept server is killed. None: start a new one."""
        global _KEPT
        kept, _KEPT = _KEPT, None
        if kept is None:
            return None
        launch, server = kept
        if launch == self._launch and server.alive():
            try:
                out = server.post("/update_weights_from_disk", {
                    "model_path": self.checkpoint_dir, "weight_version": "0", "flush_cache": True},
                    timeout_s=timeout_s)
                if isinstance(out, dict) and out.get("success"):
                    log.info("engine %d: the SGLang server pid %d of the last job serves this one (checkpoint "
                             "reloaded)", self.engine_id, server.pid)
                    return server
                log.warning("engine %d: the kept SGLang server refused the checkpoint (%s); a new one starts",
                            self.engine_id, out)
            except (OSError, ServerHTTPError, ValueError) as e:
                log.warning("engine %d: the kept SGLang server failed (%s); a new one starts", self.engine_id, e)
        server.kill()
        return None

    # ---- Protocol (generate, abort, pause, resume, update_weights: miles.rollout.sglang_calls) ----

    def update_weights_from(self, receiver: Any, version: int) -> dict[str, float]:
        """``sd = receiver.receive(self)`` (a transport's receiving end), then :meth:`update_weights`."""
        t0 = time.perf_counter()
        state_dict = receiver.receive(self)
        receive_s = time.perf_counter() - t0
        return {**self.update_weights(state_dict, version), "receive_s": receive_s}

    def health(self) -> dict[str, Any]:
        """``ok``: the process runs, the engine is not dead, and ``/health`` answered within ``health_timeout_s``.

        ``running``: rows in flight on the server; ``waiting``: calls held by a pause or a weight update;
        ``busy_s``: seconds with at least one generate request in flight on the server since the engine
        started, ``clock_s``: the engine's ``time.perf_counter()`` (two readings give the busy share).
        """
        ok = not self._stopped() and self.server.healthy(self.health_timeout_s)
        return {"ok": ok, "version": self._version, "engine_id": self.engine_id, "pid": self.server.pid,
                "url": self.server.url, "paused": self._paused, **self._activity(), "updating": self._updating,
                "dead": self._dead, "closed": self._closed, "log": str(self.server.log_path),
                "memory": process_memory()}  # the server's too: it is this actor's child

    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        """Kill the server (its whole process group) and remove the weight directories; calls in flight fail."""
        with self._cv:
            self._closed = True
            self._stop_watch.set()
            self._cv.notify_all()
        self.server.kill()
        self._close_loaders()
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    def _end_job(self) -> None:
        """Parking (:mod:`miles.backends.reuse`): an idle, healthy server is kept (unpaused, without this
        engine's adapters and weight-update group: :meth:`_release_server`) for the next engine
        constructed in this process (:meth:`_take_kept`); otherwise it goes with the job. A kept server
        dies with the actor, as any server does."""
        global _KEPT
        with self._cv:
            keep = not self._stopped() and not self._posts and not getattr(self, "_released", False)
            self._closed = True
            self._stop_watch.set()
            self._cv.notify_all()
        try:
            if keep and self._paused:
                self.server.post("/continue_generation", {}, timeout_s=_CONTROL_TIMEOUT_S)
            keep = keep and self.server.healthy(self.health_timeout_s)
            if keep:
                self._release_server()
        except (OSError, ServerHTTPError, ValueError, RuntimeError) as e:
            log.warning("engine %d: the SGLang server is not kept for the next job: %s", self.engine_id, e)
            keep = False
        if keep:
            if _KEPT is not None:
                _KEPT[1].kill()
            _KEPT = (self._launch, self.server)
        else:
            self.server.kill()
        self._close_loaders()
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    # ---- HTTP calls -----------------------------------------------------------------------------

    def _control(self, path: str, body: dict[str, Any], timeout_s: float = _CONTROL_TIMEOUT_S) -> Any:
        try:
            return self.server.post(path, body, timeout_s=timeout_s)
        except (OSError, ServerHTTPError, ValueError) as e:
            self._raise_if_dead(path.lstrip("/"))
            raise RuntimeError(f"engine {self.engine_id}: SGLang {path} failed: {e}") from e

    # ---- liveness -------------------------------------------------------------------------------

    def _watch(self, server: SGLangServer, stop: threading.Event) -> None:
        """Every ``health_interval_s``: the process runs and answers ``/health``; else the engine is dead.
        Ends when ``stop`` is set (the job ends; a kept server is watched by the next job's engine)."""
        interval, timeout, limit = self.health_interval_s, self.health_timeout_s, self.max_health_failures
        misses = 0
        while True:
            exited = server.exited.wait(interval)
            if stop.is_set() or self._dead is not None:
                return
            if exited:
                self._die_exited()
                return
            misses = 0 if server.healthy(timeout) else misses + 1
            if stop.is_set():
                return
            if misses >= limit:
                self._die(f"the SGLang server (pid {server.pid}) did not answer /health within {timeout:g} s "
                          f"{misses} times in a row (hung or stopped); it was killed (log: {server.log_path})")
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
        """Free the KV cache and the weights on the GPU; ``generate`` and ``score`` raise until they are back."""
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
        if getattr(self, "_released", False) and what in ("generate", "score"):
            raise RuntimeError(f"engine {self.engine_id}: {what} while memory is released; call resume_memory() first")
