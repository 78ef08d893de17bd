"""Megatron-core on a process without CUDA: the call sites of 0.16.1 that reach for a GPU, redirected.

megatron-core trains on CPU over gloo with the local (non-Transformer-Engine) layer spec, but 0.16.1
calls CUDA in a few places that no config flag avoids (measured; ``/work/shared/FACTS.md``). This
module redirects exactly those, and only in a process that sees no CUDA device (:func:`install` is a
no-op otherwise, so on a GPU megatron runs its own CUDA paths). Each redirect is narrow:

* **module proxies.** The megatron modules below see a stand-in for the name ``torch`` in their own
  globals (:class:`_TorchOnCpu`). It forwards every attribute to the real ``torch`` except
  ``torch.cuda.current_device`` (-> the CPU device), ``torch.cuda.synchronize`` (-> nothing: CPU ops
  are synchronous), ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` (-> one null stream and
  a null context), factory calls with ``device="cuda"`` (-> ``"cpu"``), ``torch.autocast("cuda")``
  (-> CPU autocast: megatron's ``enable_autocast`` for ``precision.train_dtype=bfloat16``) and, in
  ``mappings.py``, ``torch.distributed.all_to_all_single`` with split sizes given as tensors (-> lists
  of ints: torch 2.13's gloo binding refuses tensors there). Nothing outside these modules is touched.
* **Tensor.cuda() during one method.** ``LanguageModule.setup_embeddings_and_output_layer`` moves the
  tied output weight with ``weight.data.cuda()`` (tied embeddings + PP); while that method runs,
  ``Tensor.cuda`` returns the tensor itself.
* **no CUDA generator.** megatron's activation checkpoint (``tensor_parallel.random.CheckpointFunction``)
  saves the CPU and the CUDA generator states before a layer's forward and restores them around its
  recompute. A process without CUDA has no CUDA generator: in ``random.py``
  ``torch.cuda.random.get_rng_state`` returns an empty tensor and ``_lazy_call`` (through which
  ``_set_cuda_rng_state`` sets the state) does nothing (torch would queue each call until a CUDA init
  that never comes). The CPU generator, the one CPU ops draw from, is still saved and restored by megatron.
* **autocast of the linear layers' autograd functions.** ``tensor_parallel/layers.py`` decorates the
  ``forward`` / ``backward`` of its linear autograd functions for CUDA autocast only; under CPU
  autocast their backward then multiplies a bf16 gradient with an fp32 weight (``RuntimeError: expected
  m1 and m2 to have the same dtype``). They are re-decorated for CPU autocast
  (:func:`_autocast_linear_on_cpu`).
* **a missing name.** ``moe_utils`` names ``te_general_gemm`` only when Transformer Engine imports;
  without it the router's gating GEMM hits a NameError. It is set to ``None`` (megatron's own
  fallback then runs ``torch.mm``).

Every redirect that happens is logged once per call site (``file:line`` under ``megatron/core``) and
kept in :func:`redirected_sites`; ``tests/test_megatron.py`` runs real layouts (TP, PP, PP with tied
embeddings, DP, MoE EP, PP with activation recompute) and compares the sites seen with its frozen copy of
this table, so an upgrade that moves, adds or removes a site fails, naming it; the bf16, QAT and replay
layouts of ``tests/test_megatron_replay_precision.py`` see those sites and the autocast one
(``schedules.py:418``), nothing else. The sites (0.16.1):

=====================================================  ================================================
call site (under ``megatron/core/``)                   what it does on a GPU
=====================================================  ================================================
models/common/embeddings/rotary_pos_embedding.py:162   ``inv_freq`` moved to the current device
utils.py:631                                           global memory buffer (attention scores) on the
                                                       current device
distributed/param_and_grad_buffer.py:806               DDP gradient buffer on the current device
pipeline_parallel/schedules.py:418                     ``torch.autocast("cuda")`` around each forward step
                                                       (``enable_autocast``: bf16 compute)
pipeline_parallel/schedules.py:596, :2138              token counter ``torch.zeros(device="cuda")`` (no
                                                       pipelining, 1F1B)
pipeline_parallel/p2p_communication.py:190-202         shape exchange buffers (variable lengths)
pipeline_parallel/p2p_communication.py:313, :321       receive buffers on the current device
pipeline_parallel/p2p_communication.py:242, :398       ``torch.cuda.synchronize()`` after batched p2p
models/common/language_module/language_module.py:244   tied output weight ``.cuda()`` (tied + PP)
transformer/moe/router.py:90                           router weight moved to the current device
transformer/moe/token_dispatcher.py:445, :871, :874    side stream for device-to-host copies
tensor_parallel/mappings.py:141, :442                  all-gather / all-to-all outputs on the current
                                                       device
tensor_parallel/mappings.py:444                        ``all_to_all_single`` with tensor split sizes
tensor_parallel/random.py:55                           CUDA generator state saved (activation checkpoint)
tensor_parallel/random.py:111                          CUDA generator state set (``_lazy_call``)
transformer/moe/moe_utils.py:1192                      ``te_general_gemm`` (undefined without TE)
=====================================================  ================================================

Not proxied, because this backend does not call them: megatron's optimizers (``optimizer.py``:
``torch.tensor(device='cuda')``) and gradient clipping (``clip_grads.py``); sequence parallel and the
Transformer Engine spec are not used on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

PINNED_VERSION = "0.16.1"
"""The megatron-core version whose CUDA call sites this module knows."""

PROXIED_MODULES = (
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
)
"""Modules whose global ``torch`` becomes a :class:`_TorchOnCpu`."""

_FACTORIES = ("zeros", "empty", "ones", "full", "tensor")
"""torch factory functions whose ``device="cuda"`` is rewritten in the proxied modules."""

_sites: dict[str, str] = {}
_patched_names: dict[str, str] = {}
_installed: list[tuple[Any, str, Any]] = []  # (object, attribute, original) to undo


def _site(depth: int = 2) -> str:
    """``path:line`` of the megatron frame ``depth`` levels up, relative to ``megatron/core``."""
    f = sys._getframe(depth)
    path = f.f_code.co_filename.replace("\\", "/")
    return f"{path.split('megatron/core/', 1)[-1]}:{f.f_lineno}"


def _record(what: str, depth: int = 3) -> None:
    site = _site(depth)
    if site not in _sites:
        _sites[site] = what
        log.info("megatron compat: %s at megatron/core/%s redirected to the CPU", what, site)


def redirected_sites() -> dict[str, str]:
    """Every call site redirected so far in this process: ``{"path:line": what}``."""
    return dict(_sites)


def patched_names() -> dict[str, str]:
    """Module-level names set at :func:`install` (``{"module.name": why}``)."""
    return dict(_patched_names)


def reset() -> None:
    """Forget the record and megatron's class-level null stream (a reused process starts clean)."""
    _sites.clear()
    dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    if dispatcher is not None and isinstance(getattr(dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream",
                                                     None), _NullStream):
        dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


class _NullEvent:
    def synchronize(self) -> None: ...

    def wait(self, stream: Any = None) -> None: ...


class _NullStream:
    """What CUDA streams become on the CPU: everything already ran when a call returns."""

    def wait_stream(self, stream: Any) -> None: ...

    def record_event(self, event: Any = None) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None: ...


_STREAM = _NullStream()


class _CudaRandomOnCpu:
    """``torch.cuda.random`` as the proxied modules see it: no CUDA generator, an empty state."""

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        _record("torch.cuda.random.get_rng_state()")
        return torch.empty(0, dtype=torch.uint8)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda.random, name)


def _no_cuda_lazy_call(callable: Any, **kwargs: Any) -> None:
    """``torch.cuda._lazy_call`` in ``tensor_parallel/random.py`` (sets the CUDA generator's state): nothing."""
    _record("torch.cuda._lazy_call() (CUDA generator state)")


class _CudaOnCpu:
    """``torch.cuda`` as the proxied modules see it."""

    random = _CudaRandomOnCpu()

    def current_device(self) -> torch.device:
        _record("torch.cuda.current_device()")
        return torch.device("cpu")

    def synchronize(self, device: Any = None) -> None:
        _record("torch.cuda.synchronize()")

    def Stream(self, *args: Any, **kwargs: Any) -> _NullStream:  # noqa: N802 - torch's name
        _record("torch.cuda.Stream()")
        return _STREAM

    def current_stream(self, device: Any = None) -> _NullStream:
        _record("torch.cuda.current_stream()")
        return _STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        _record("torch.cuda.stream()")
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _splits(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


class _DistributedOnCpu:
    """``torch.distributed`` as ``mappings.py`` sees it: all-to-all split sizes as lists of ints."""

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, **kwargs: Any) -> Any:
        if not isinstance(output_split_sizes, list | None) or not isinstance(input_split_sizes, list | None):
            _record("all_to_all_single split sizes as tensors")
            output_split_sizes, input_split_sizes = _splits(output_split_sizes), _splits(input_split_sizes)
        return torch.distributed.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                                   input_split_sizes=input_split_sizes, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def _on_cpu_factory(fn: Any) -> Any:
    def factory(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            _record(f"torch.{fn.__name__}(device='cuda')")
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return factory


class _TorchOnCpu:
    """``torch`` as the proxied modules see it (the redirects in the module docstring)."""

    def __init__(self, *, distributed: bool) -> None:
        self.cuda = _CudaOnCpu()
        if distributed:
            self.distributed = _DistributedOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu_factory(getattr(torch, name)))

    def autocast(self, device_type: str, *args: Any, **kwargs: Any) -> torch.autocast:
        if device_type == "cuda":
            _record("torch.autocast('cuda')")
            device_type = "cpu"
        return torch.autocast(device_type, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        _record("Tensor.cuda()")
        return self

    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def _wrap_setup_embeddings(cls: type) -> None:
    original = cls.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    setup_embeddings_and_output_layer.__doc__ = original.__doc__
    _installed.append((cls, "setup_embeddings_and_output_layer", original))
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


AUTOCAST_FUNCTIONS = ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight")
"""megatron's linear autograd functions (``tensor_parallel/layers.py``), decorated for CUDA autocast."""


def _autocast_linear_on_cpu() -> None:
    """Re-decorate the linear autograd functions for CPU autocast (``precision.train_dtype=bfloat16``).

    0.16.1 decorates their ``forward`` / ``backward`` with ``torch.amp.custom_fwd`` / ``custom_bwd`` for
    ``device_type="cuda"``: under CPU autocast the forward's matmuls run in bf16, but the backward then
    runs without autocast and multiplies a bf16 gradient with the fp32 weight (``RuntimeError: expected
    m1 and m2 to have the same dtype``). The same functions, decorated for ``"cpu"``, replay the forward's
    autocast state in the backward, as CUDA autocast does on a GPU.
    """
    from megatron.core.tensor_parallel import layers

    for cls_name in AUTOCAST_FUNCTIONS:
        cls = getattr(layers, cls_name)
        for name, decorate in (("forward", torch.amp.custom_fwd), ("backward", torch.amp.custom_bwd)):
            original = cls.__dict__[name]
            plain = original.__func__.__wrapped__  # under torch.amp's functools.wraps
            setattr(cls, name, staticmethod(decorate(plain, device_type="cpu")))
            _installed.append((cls, name, original))
        _patched_names[f"megatron.core.tensor_parallel.layers.{cls_name}"] = (
            "forward/backward decorated for CUDA autocast; re-decorated for CPU autocast (bf16)")


def needed() -> bool:
    """True when this process sees no CUDA device (the layer applies)."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Apply the redirects when this process has no CUDA device; idempotent. Returns whether applied."""
    if not needed():
        return False
    if _installed:
        return True
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version != PINNED_VERSION:
        log.warning("megatron-core %s: the CPU compatibility layer (miles/train/megatron/compat.py) was written "
                    "against %s; the list of CUDA call sites must be re-checked (tests/test_megatron.py "
                    "compares the sites seen with the frozen list)", version, PINNED_VERSION)
    for name in PROXIED_MODULES:
        module = importlib.import_module(name)
        _installed.append((module, "torch", module.torch))
        module.torch = _TorchOnCpu(distributed=name.endswith(".mappings"))
    from megatron.core.tensor_parallel import random as megatron_random

    _installed.append((megatron_random, "_lazy_call", megatron_random._lazy_call))
    megatron_random._lazy_call = _no_cuda_lazy_call
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _wrap_setup_embeddings(LanguageModule)
    _autocast_linear_on_cpu()
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None
        _installed.append((moe_utils, "te_general_gemm", None))
        _patched_names["megatron.core.transformer.moe.moe_utils.te_general_gemm"] = (
            "undefined without Transformer Engine; None selects megatron's torch.mm router GEMM")
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests; a process that goes on to use megatron on a GPU)."""
    while _installed:
        obj, attr, original = _installed.pop()
        if attr == "te_general_gemm":
            delattr(obj, attr)
        else:
            setattr(obj, attr, original)
    _patched_names.clear()
    reset()
