"""Backends: the rollout engine, trainer and critic Protocols, their contract checks, actor reuse.

See :mod:`miles.backends.protocols` for what each backend promises and
:mod:`miles.backends.contract` for the checks.
"""

from miles.backends.protocols import (
    ENGINE_INIT_ARGS,
    RANK_INIT_ARGS,
    Critic,
    OffloadingEngine,
    RolloutEngine,
    Trainer,
)
from miles.backends.reuse import Reusable

__all__ = ["ENGINE_INIT_ARGS", "RANK_INIT_ARGS", "Critic", "OffloadingEngine", "Reusable", "RolloutEngine",
           "Trainer"]
