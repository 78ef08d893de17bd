"""miles' CPU compatibility layer for SGLang, imported at start-up by every process of a CPU server.

The engine puts this directory on the server's ``PYTHONPATH`` with ``MILES_SGLANG_CPU_COMPAT=1``
when ``device="cpu"`` (:func:`miles.rollout.sglang_server.server_env`); Python imports
``sitecustomize`` by itself, also in the processes SGLang spawns. It imports nothing from miles and
runs in SGLang's own venv.

Page-locked host memory needs a CUDA driver. SGLang 0.5.23 asks for it where a GPU would copy from
the host, and without a driver each request kills the server at start with ``RuntimeError: Found
no NVIDIA driver on your system``:

- its LoRA code pins buffers (``torch.tensor(..., pin_memory=True)``, ``Tensor.pin_memory()`` in
  ``sglang/srt/lora/layers.py``, ``lora.py``, ``backend/torch_backend.py``);
- its routed-experts capture (``--enable-return-routed-experts``) registers its host buffer with
  ``torch.cuda.cudart().cudaHostRegister`` (``sglang/srt/mem_cache/pool_host/common.py``).

Pinning only speeds up copies to a GPU; without one the same unpinned CPU memory is what the
computation needs. So when CUDA is unavailable, :func:`install` makes pinning a no-op: the tensor
factories drop ``pin_memory``, ``Tensor.pin_memory()`` returns the tensor itself, and
``torch.cuda.cudart()`` answers host (un)registration with success.

The SGLang wheel also installs FlashInfer and CUTLASS's Python DSL, kernel libraries for NVIDIA GPUs
that a CPU server never calls; importing them costs each server start about 10 s (a tiny model's
server was ready in 47-50 s instead of 57-61 s here). :func:`install` makes their import fail as if
they were not installed, which SGLang handles as it does on its own CPU builds.
"""

import functools
import importlib.machinery
import os
import sys

_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
              "full_like", "empty_strided")


_GPU_ONLY = ("flashinfer", "cutlass")
"""Top-level packages a CPU server does not import (see the module docstring)."""


class _NotOnCpu:
    """A ``sys.meta_path`` finder and loader: importing a package of :data:`_GPU_ONLY` raises
    ``ModuleNotFoundError``. (``importlib.util.find_spec`` still finds it: SGLang asks that before
    it asks whether CUDA is there.)"""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in _GPU_ONLY:
            return importlib.machinery.ModuleSpec(name, cls)
        return None

    @staticmethod
    def create_module(spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (not imported by a CPU server)", name=spec.name)

    @staticmethod
    def exec_module(module):
        pass


class _HostRegistration:
    """The part of ``torch.cuda.cudart()`` SGLang calls for host buffers: every call succeeds."""

    @staticmethod
    def cudaHostRegister(ptr, size, flags):  # noqa: N802 (CUDA's names)
        return 0

    @staticmethod
    def cudaHostUnregister(ptr):  # noqa: N802
        return 0

    @staticmethod
    def cudaGetErrorString(code):  # noqa: N802
        return "cudaSuccess"


def install():
    """Make pinning a no-op and the GPU kernel libraries unimportable in this process when CUDA is
    unavailable (see the module docstring)."""
    import torch

    if torch.cuda.is_available() or getattr(torch, "_miles_cpu_compat", False):
        return

    def unpinned(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return call

    for name in _FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch.cuda.cudart = _HostRegistration
    sys.meta_path.insert(0, _NotOnCpu)
    torch._miles_cpu_compat = True


if os.environ.get("MILES_SGLANG_CPU_COMPAT") == "1":
    install()
