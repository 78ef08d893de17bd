"""miles: reinforcement-learning post-training for LLMs, declared in Hydra configs."""

import logging

__version__ = "0.1.0"


def _quiet_torchao_import() -> None:
    """torchao (the precision tests' reference; transformers and peft import it when installed) logs, in
    every process that imports it on CPU, that its CUDA kernels do not load, that there is no Triton, and
    that torch deprecates its Enum registrations. None says anything about a run, so those messages are
    dropped; the rest of these loggers is untouched."""
    logging.getLogger("torchao").addFilter(lambda r: not r.getMessage().startswith("Failed to load "))
    logging.getLogger("torchao.kernel.intmm").addFilter(
        lambda r: not r.getMessage().startswith("Warning: Detected no triton"))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda r: "is an Enum subclass and is now natively supported" not in r.getMessage())


_quiet_torchao_import()
