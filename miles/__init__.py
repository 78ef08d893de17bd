"""miles: reinforcement-learning post-training for LLMs, declared in Hydra configs."""

import logging

__version__ = "0.1.0"


def _quiet_torchao_import() -> None:
    """torchao (the precision tests' reference; transformers imports it when installed) logs, in every
    process that imports it on CPU, that its CUDA kernels do not load and that torch deprecates its Enum
    registrations. Neither says anything about a run, so those two messages are dropped; the rest of
    both loggers is untouched."""
    logging.getLogger("torchao").addFilter(lambda r: not r.getMessage().startswith("Failed to load "))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda r: "is an Enum subclass and is now natively supported" not in r.getMessage())


_quiet_torchao_import()
