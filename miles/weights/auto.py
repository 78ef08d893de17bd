"""``weight_sync.transport=auto`` (the default): the Ray object store, or shared memory where it can work.

The first version goes through the object store, which works on any cluster; it tells the size of a
version (:attr:`~miles.weights.transport.Sent.bytes`). From the second version on, the run uses
:mod:`miles.weights.shm` when all of these hold, else it stays on the object store:

- the run is on CPU (GPU runs: the object store, their paths are untested);
- the Ray cluster is one node, so every engine is on trainer rank 0's node;
- the engines are torch engines (:class:`miles.rollout.torch_engine.TorchEngine`): a CPU torch engine
  computes from the shared slot in place, and it is the engine the shm transport is tested with;
- two versions fill at most half of the free space of ``weight_sync.shm_dir``.

On the tiny model this saves about a third of a sync (``python -m miles.bench e2e``, docs/benchmarks.md).
The choice is logged once, and ``weight_sync/shm`` (1 or 0) says which transport each sync took.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from miles.config.schema import WeightSyncConfig
from miles.weights.object_store import ObjectStoreTransport
from miles.weights.transport import Sent, Transport

log = logging.getLogger(__name__)

SHM_ENGINES = ("miles.rollout.torch_engine.TorchEngine",)
"""Engine classes (``rollout.engine._target_``) that ``auto`` moves to shared memory."""


def one_node() -> bool:
    """Whether the Ray cluster this process is connected to has exactly one live node."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


class AutoTransport(Transport):
    """The object store for the first version, then shared memory where :func:`shm_reason` finds no
    reason against it; every other call goes to the transport in use."""

    def __init__(self, cfg: WeightSyncConfig, *, device: str = "cpu", engine_class: str = "", **_: Any) -> None:
        self.cfg = cfg
        self.current: Transport = ObjectStoreTransport(cfg)
        self.device, self.engine_class = device, engine_class
        self.decided = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"auto ({self.current.name})"

    @property
    def concurrent(self) -> bool:  # type: ignore[override]
        return self.current.concurrent

    @property
    def pipelined(self) -> bool:  # type: ignore[override]
        return getattr(self.current, "pipelined", False)

    def begin(self, trainers: Sequence[Any], engines: Sequence[Any]) -> None:
        self.current.begin(trainers, engines)

    def sender(self, version: int) -> Any:
        return self.current.sender(version)

    def receiver(self, engine_index: int, version: int, sent: Any) -> Any:
        return self.current.receiver(engine_index, version, sent)

    def failed(self) -> None:
        self.current.failed()

    def close(self) -> None:
        self.current.close()

    def synced(self, sent: Sent) -> dict[str, float]:
        """After each sync that succeeded: ``weight_sync/shm``, whether it went through shared memory; the
        first one decides the transport of the rest."""
        took = {"weight_sync/shm": float(self.current.name == "shm")}
        if not self.decided:
            self.decided = True
            why_not = shm_reason(self.cfg, sent.bytes, device=self.device, engine_class=self.engine_class)
            if why_not is None:
                from miles.weights.shm import ShmTransport

                self.current.close()
                self.current = ShmTransport(self.cfg)
                log.info("weight_sync auto: shared memory in %s from the next version on (%.1f MiB a version)",
                         self.cfg.shm_dir, sent.bytes / 2**20)
            else:
                log.info("weight_sync auto: the Ray object store (%s)", why_not)
        return took


def shm_reason(cfg: WeightSyncConfig, nbytes: int, *, device: str, engine_class: str) -> str | None:
    """Why ``auto`` keeps the object store for versions of ``nbytes`` bytes, or None: shared memory."""
    if device != "cpu":
        return f"device {device}: only CPU runs use shared memory"
    if engine_class not in SHM_ENGINES:
        return f"engines {engine_class or '?'}: shared memory is used with {', '.join(SHM_ENGINES)}"
    if not one_node():
        return "the Ray cluster has several nodes"
    try:
        st = os.statvfs(cfg.shm_dir)
    except OSError as e:
        return f"weight_sync.shm_dir {cfg.shm_dir}: {e}"
    free = st.f_bavail * st.f_frsize
    if 2 * nbytes > free / 2:
        return (f"two versions ({2 * nbytes / 2**20:.0f} MiB) would take more than half of the "
                f"{free / 2**20:.0f} MiB free in {cfg.shm_dir}")
    return None
