"""A user's own engine and trainer classes, outside the miles package (``plugins.allow=[plugin_backends.]``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from miles.config import RankConfig
from miles.rollout.torch_engine import TorchEngine
from miles.train.fsdp import FSDPTrainer
from miles.types import GenerateRequest, GenerateResult, SamplingParams, TrainBatch


class LoggingEngine(TorchEngine):
    """The torch engine, appending one line per ``generate`` call to ``calls_file`` (a config kwarg)."""

    def __init__(self, checkpoint_dir: str, precision: Any, *, calls_file: str, **kwargs: Any) -> None:
        super().__init__(checkpoint_dir, precision, **kwargs)
        self.calls_file = calls_file

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        out = super().generate(requests, sampling)
        with Path(self.calls_file).open("a") as f:
            f.write(f"{self.engine_id} {len(requests)}\n")
        return out


class DiesAtVersion(TorchEngine):
    """The torch engine, whose process exits (as an out-of-memory kill would end it) at the first
    ``generate`` call once it holds weights of version ``die_at_version``, if its id is in ``die_engines``:
    the calls it is serving die with it. With ``once_marker`` (a file path) only the first engine to get
    there dies, creating the file first: the engine that replaces it lives. ``{engine}`` in the path is
    the engine's id: each engine dies once."""

    def __init__(self, checkpoint_dir: str, precision: Any, *, die_at_version: int, die_engines: list[int],
                 once_marker: str | None = None, **kwargs: Any) -> None:
        super().__init__(checkpoint_dir, precision, **kwargs)
        self.die_at_version, self.die_engines, self.once_marker = die_at_version, list(die_engines), once_marker

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams | None = None
                 ) -> list[GenerateResult]:
        if self.engine_id in self.die_engines and self.weight_version() >= self.die_at_version:
            if self.once_marker is None:
                os._exit(1)
            try:
                Path(self.once_marker.format(engine=self.engine_id)).touch(exist_ok=False)
            except FileExistsError:
                pass  # a replacement: the engine it replaces died already
            else:
                os._exit(1)
        return super().generate(requests, sampling)


class CountingTrainer(FSDPTrainer):
    """The FSDP trainer, adding ``train/plugin_steps`` to its metrics; its ``config`` is the rank's part of
    the run (:class:`miles.config.RankConfig`), the other arguments its place in the group."""

    def __init__(self, *, config: RankConfig, **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)
        self.steps = 0

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.steps += 1
        return {**super().train_step(batch), "train/plugin_steps": float(self.steps)}


class StopsInPush(FSDPTrainer):
    """The FSDP trainer, whose rank 1 stops itself (SIGSTOP: a hung rank) when asked to send the weights of
    version 2, while rank 0 waits on it in the gather; once per run: it first creates ``stopped-in-push`` in
    ``trainer.save_dir``, so the ranks that replace it send as usual."""

    def __init__(self, *, config: RankConfig, **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)
        self.marker = Path(config.trainer.save_dir) / "stopped-in-push" if config.trainer.save_dir else None

    def send_weights(self, sender: Any, version: int) -> Any:
        if self.rank == 1 and version == 2 and self.marker is not None:
            try:
                self.marker.touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return super().send_weights(sender, version)


class NoPause(TorchEngine):
    """Broken: ``pause`` does nothing."""

    def pause(self) -> None:
        pass


class IgnoresWeights(TorchEngine):
    """Broken: ``update_weights`` sets the version and keeps the old weights."""

    def update_weights(self, state_dict: Any, version: int) -> dict[str, float]:
        self._version = int(version)
        return {"update_s": 0.0}


class ForgetfulTrainer(FSDPTrainer):
    """Broken: ``load_state`` reads nothing."""

    def load_state(self, directory: str) -> None:
        pass


class NoGenerate:
    """Broken: not an engine at all."""

    def __init__(self, checkpoint_dir: str, precision: Any, **kwargs: Any) -> None:
        pass
