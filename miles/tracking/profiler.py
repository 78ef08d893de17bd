"""Torch profiler traces of an actor, started and stopped by the driver (:mod:`miles.core.profiling`).

:class:`Profiled` gives an actor class ``start_profile()`` and ``stop_profile() -> bytes``: the trace of
what ran in between, in Chrome trace format, gzipped (Perfetto and ``chrome://tracing`` open
``.json.gz``). It crosses to the driver as bytes, so the driver needs no file system in common with
the actor. The trainer ranks (FSDP, Megatron) and the torch engine are :class:`Profiled`.

Torch's profiler records the ops of the thread that started it: an actor whose work runs on a thread of
its own (the torch engine's scheduler) overrides :meth:`Profiled._on_work_thread` to start and stop it
there. On CUDA the trace also has the kernels (``ProfilerActivity.CUDA``); untested, no GPU has run it.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from collections.abc import Callable
from typing import Any


class TraceRecorder:
    """One torch profiler session at a time."""

    def __init__(self) -> None:
        self._prof: Any = None

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:  # left by a job that failed between start and stop: dropped
            self._prof.stop()
            self._prof = None
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        self._prof = prof

    def stop(self) -> bytes:
        """End the session; its Chrome trace, gzipped."""
        if self._prof is None:
            raise RuntimeError("no profile is being recorded: start one first")
        prof, self._prof = self._prof, None
        prof.stop()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                return gzip.compress(f.read(), compresslevel=3)
        finally:
            os.unlink(path)


class Profiled:
    """Mixin for actor classes: the driver records a torch profiler trace between two calls."""

    _trace_recorder: TraceRecorder | None = None

    def _on_work_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the thread that does this actor's work (here: the calling thread)."""
        return fn()

    def start_profile(self) -> None:
        if self._trace_recorder is None:
            self._trace_recorder = TraceRecorder()
        self._on_work_thread(self._trace_recorder.start)

    def stop_profile(self) -> bytes:
        if self._trace_recorder is None:
            raise RuntimeError("no profile is being recorded: start_profile() first")
        return self._on_work_thread(self._trace_recorder.stop)
