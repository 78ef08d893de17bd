"""miles' CPU compatibility layer for SGLang, imported at start-up by every process of a CPU server.

The engine puts this directory on the server's ``PYTHONPATH`` when ``device="cpu"``
(:func:`miles.rollout.sglang_server.server_env`; Python imports ``sitecustomize`` by itself, also in
the processes SGLang spawns). It imports nothing from miles and runs in SGLang's own venv.

Pinned host memory: SGLang 0.5.23's LoRA code asks for page-locked buffers (``torch.tensor(...,
pin_memory=True)``, ``Tensor.pin_memory()``, in ``sglang/srt/lora/layers.py``, ``lora.py`` and
``backend/torch_backend.py``); pinning needs a CUDA driver, so without one the scheduler dies at
start with ``RuntimeError: Found no NVIDIA driver on your system``. Pinning only speeds up copies to
a GPU; on a machine without one, the same unpinned CPU tensor is what the computation needs. So when
CUDA is unavailable, ``pin_memory`` becomes a no-op: the factory functions drop the argument and
``Tensor.pin_memory()`` returns the tensor itself.
"""

import functools
import os

if os.environ.get("MILES_SGLANG_CPU_COMPAT") == "1":
    import torch

    if not torch.cuda.is_available():

        def _unpinned(fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return fn(*args, **kwargs)

            return call

        for _name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
                      "ones_like", "full_like", "empty_strided"):
            setattr(torch, _name, _unpinned(getattr(torch, _name)))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
