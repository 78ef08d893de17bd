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
- The weight load (``_load_weights``) checks names and shapes against the checkpoint (SGLang's loader silently
  skips unknown names and keeps missing ones), writes the state dict as safetensors into a fresh
  version directory and calls ``POST /update_weights_from_disk`` with ``weight_version``; no row
  is in flight then (next item), and every result
  carries the version SGLang reports. A refused load (``ValueError``) still interrupts the rows in
  flight; they continue on the unchanged weights. The disk path works on CPU and on every node (the directory
  is local to the engine's node). On a GPU, ``/update_weights_from_tensor`` (CUDA IPC) or
  ``/update_weights_from_distributed`` (an NCCL group) would avoid the file; neither is wired up
  here, and the disk path has not been run on a GPU.
- Weight updates while rows generate (partial rollouts, :mod:`miles.rollout.sglang_calls`):
  ``update_weights`` aborts the rows in flight on the server, loads the weights on the idle server,
  and continues each interrupted row as a new row on the new weights (prompt + its tokens so far,
  the tokens left, the same sampling params); the result joins the pieces, its tokens before the
  update tagged with the old version and the rest with the new one, each log-prob the one its token
  was sampled with. Calls that arrive during an update wait for it. A user's ``abort`` still ends
  a row ``ABORTED``, also while an update interrupts it. So the async schedules run on this engine
  (``reports_token_versions``).
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
- MoE models run on CPU (checked by hand, not by a test: on a tiny Qwen3-MoE greedy tokens and
  log-probs equaled transformers').
  Routing capture (``capture_routing: true``: ``--enable-return-routed-experts`` and
  ``return_routed_experts`` per request, decoded to ``GenerateResult.routing`` ``[T, moe_layers,
  top_k]`` int16) is refused on CPU: SGLang 0.5.23 registers its capture buffer with CUDA and the
  server dies at start. The GPU path is untested, including the layout of SGLang's
  ``routed_experts`` (taken as one int32 row of ``[layers, top_k]`` per scored position).

Memory release: ``/release_memory_occupation`` calls a CUDA synchronize that kills the server on
CPU, so :class:`SGLangEngine` offers no ``release_memory``: with ``placement.offload_engines=null``
(the default) its engines keep their memory while the trainer trains, and ``true`` is refused at start-up. :class:`SGLangOffloadingEngine` adds it for GPUs (untested: no GPU here).

Jobs one after another (``cluster.reuse_actors``, :mod:`miles.backends.reuse`): a parked engine keeps
its idle server, and the next engine built in the same actor with the same launch flags (model
path, dtype, seed, server knobs, threads) takes it instead of starting one (35-60 s on 2 CPU cores)
and loads its checkpoint into it as version 0, caches flushed. Its sampling generator is not
reset (SGLang has no call for that): on CPU, where requests are not seeded, a job on a kept server
samples differently from one on a new server.

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
from miles.config.schema import PrecisionConfig
from miles.rollout.dispatch import EngineDeadError
from miles.rollout.sglang_calls import SGLangCalls
from miles.rollout.sglang_server import (
    ServerHTTPError,
    ServerStartError,
    SGLangServer,
    find_python,
    server_env,
)
from miles.rollout.sglang_wire import Checkpoint, row_seed

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CONTROL_TIMEOUT_S = 30.0  # pause / continue / abort / weight-update calls that should answer at once

_KEPT: tuple[str, SGLangServer] | None = None
"""The server of the engine parked last in this process, and its launch (:meth:`SGLangEngine._end_job`)."""


class SGLangEngine(SGLangCalls, Reusable):
    """Generates through an SGLang server process it owns; see the module docstring.

    Server knobs: ``python`` (the SGLang venv's interpreter), ``max_total_tokens`` (KV-cache tokens),
    ``max_batch_size`` (rows decoded together, as the torch engine's; ``--max-running-requests``),
    ``context_length`` (default: the model's), ``mem_fraction_static`` (GPU), ``attention_backend`` (default ``torch_native`` on CPU, SGLang's choice on GPU),
    ``deterministic`` (per-request seeds; GPU attention backends only), ``radix_cache`` (prefix
    caching; default off on CPU, see the module docstring), ``capture_routing``,
    ``server_args`` (more ``--flag: value`` pairs), ``log_dir``. Liveness: ``start_timeout_s``,
    ``request_timeout_s`` (one generate call), ``health_interval_s``, ``health_timeout_s``,
    ``max_health_failures``.
    """

    reports_token_versions = True
    """Every result carries the weight version of each token (``token_versions``): async schedules need it."""

    @staticmethod
    def check_config(run: Any) -> None:
        """Refuse, before any actor starts, what this engine cannot serve: quantized weight formats, and
        routing replay (which needs the routes of prompt positions too)."""
        from miles.config.validate import ConfigError

        if run.precision.rollout_quant != "none":
            raise ConfigError(f"precision.rollout_quant={run.precision.rollout_quant}: the SGLang engine serves "
                              "unquantized weights only here; use rollout=torch for it, or a recipe with "
                              "rollout_quant: none (precision=fp32 or bf16)")
        if run.precision.true_on_policy:
            raise ConfigError("precision.true_on_policy=true: the SGLang engine's kernels are not the trainer's; "
                              "use rollout=torch for it")
        if run.algo.routing_replay != "off":
            raise ConfigError("algo.routing_replay=rollout: the SGLang engine returns no routes of the prompt "
                              "tokens, which replay needs; routing replay runs with the torch engine and the FSDP "
                              "trainer: use rollout=torch trainer=fsdp, or algo.routing_replay=off")

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
        if precision.rollout_quant != "none":
            raise ValueError(f"precision.rollout_quant={precision.rollout_quant!r}: the SGLang engine serves "
                             "unquantized weights only here; use rollout=torch for it, or set rollout_quant: none")
        if device == "cpu" and deterministic:
            raise ValueError("rollout.engine.deterministic=true needs a GPU attention backend (fa3, flashinfer, "
                             "triton); SGLang refuses it with torch_native, the only one on CPU")
        if device == "cpu" and capture_routing:
            raise ValueError("rollout.engine.capture_routing=true does not work on CPU: SGLang 0.5.23's routed-experts "
                             "capture registers host memory with CUDA and the server dies at start; use rollout=torch "
                             "(capture_routing) on CPU")
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
        self.ckpt = Checkpoint.read(Path(self.checkpoint_dir))
        self.vocab_size, self.eos_ids = self.ckpt.vocab_size, self.ckpt.eos_ids
        self.context_length = context_length or self.ckpt.max_positions
        self._seeds = torch.Generator().manual_seed(row_seed(seed, engine_id))
        self._init_calls()
        self._update_lock = threading.Lock()
        self._closed = False
        self._dead: str | None = None
        self._version = 0
        self._weights_dir = _weights_dir(engine_id)

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

    def _load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Check names and shapes, write a safetensors version directory, ``/update_weights_from_disk``.

        On a ``ValueError`` (wrong names, shapes or dtypes) nothing was sent to the server. Returns
        ``{"update_s", "write_s", "load_s", "bytes", "bytes_per_s"}``.
        """
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        self._check_usable("update_weights")
        shapes = self.ckpt.shapes
        missing = [k for k in shapes if k not in state_dict and k not in self.ckpt.optional]
        unexpected = [k for k in state_dict if k not in shapes]
        if missing or unexpected:
            raise ValueError(f"update_weights(version={version}): names must match the checkpoint's exactly; "
                             f"missing {_listing(missing)}, unexpected {_listing(unexpected)}. Send the full HF "
                             "state dict of the same architecture.")
        bad = [f"{k}: sent {tuple(v.shape)}, expected {shapes[k]}" for k, v in state_dict.items()
               if tuple(v.shape) != shapes[k]]
        bad += [f"{k}: sent {v.dtype}, expected a floating dtype" for k, v in state_dict.items()
                if not v.is_floating_point()]
        if bad:
            raise ValueError(f"update_weights(version={version}): wrong shapes or dtypes: {bad}")
        with self._update_lock:
            final = self._weights_dir / f"v{int(version):08d}"
            tmp = self._weights_dir / f".v{int(version):08d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            tensors, seen = {}, set()
            for k, v in state_dict.items():  # safetensors refuses tensors that share memory (tied weights)
                t = v.detach().to("cpu", self.dtype).contiguous()
                ptr = t.untyped_storage().data_ptr()
                tensors[k] = t.clone() if t.numel() and ptr in seen else t
                seen.add(ptr)
            save_file(tensors, str(tmp / "model.safetensors"))
            nbytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
            del tensors
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            t_written = time.perf_counter()
            try:
                out = self._control("/update_weights_from_disk", {
                    "model_path": str(final), "weight_version": str(int(version)), "flush_cache": True,
                }, timeout_s=self.request_timeout_s)
                if not (isinstance(out, dict) and out.get("success")):
                    raise RuntimeError(f"engine {self.engine_id}: SGLang refused the weights of version {version} "
                                       f"(it keeps version {self._version}): {out}")
                self._version = int(version)
            finally:
                for old in self._weights_dir.iterdir():
                    if old != final or self._version != int(version):
                        shutil.rmtree(old, ignore_errors=True)
        t1 = time.perf_counter()
        return {"update_s": t1 - t0, "write_s": t_written - t0, "load_s": t1 - t_written, "bytes": nbytes,
                "bytes_per_s": nbytes / max(t1 - t0, 1e-9)}

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
                "dead": self._dead, "closed": self._closed, "log": str(self.server.log_path)}

    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        """Kill the server (its whole process group) and remove the weight directories; calls in flight fail."""
        with self._cv:
            self._closed = True
            self._stop_watch.set()
            self._cv.notify_all()
        self.server.kill()
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    def _end_job(self) -> None:
        """Parking (:mod:`miles.backends.reuse`): an idle, healthy server is kept (unpaused) for the next
        engine constructed in this process (:meth:`_take_kept`); otherwise it goes with the job. A kept
        server dies with the actor, as any server does."""
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
        except (OSError, ServerHTTPError, ValueError):
            keep = False
        if keep:
            if _KEPT is not None:
                _KEPT[1].kill()
            _KEPT = (self._launch, self.server)
        else:
            self.server.kill()
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


def _weights_dir(engine_id: int) -> Path:
    """A fresh directory for this engine's weight versions, under ``<tmp>/miles-sglang-weights``.

    Its name starts with this process's pid. An actor killed by Ray never runs :meth:`SGLangEngine.close`,
    so every new engine first removes the directories of processes that no longer run.
    """
    root = Path(tempfile.gettempdir()) / "miles-sglang-weights"
    root.mkdir(exist_ok=True)
    for old in root.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-engine{engine_id}-", dir=root))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listing(names: list[str], limit: int = 10) -> str:
    more = " ..." if len(names) > limit else ""
    return f"{names[:limit]}{more} ({len(names)})"
