"""``profile.steps``: torch profiler traces of the trainer ranks and engines during chosen steps.

At the start of a chosen step the driver starts a profile on every trainer rank, critic rank and engine
in rotation that can record one (:class:`miles.tracking.profiler.Profiled`: the FSDP and Megatron ranks,
the torch engine); after the step's weight sync it stops them and writes each actor's trace to
``<profile.dir>/<run name>/step_<n>/<actor>.json.gz`` (Chrome trace format, gzipped; Perfetto and
``chrome://tracing`` open it), logged as MLflow artifacts under ``profile/step_<n>/``. An SGLang engine
is not recorded (its server is another process); the log says which actors were left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

log = logging.getLogger(__name__)


def _profiled(handle: Any) -> bool:
    try:
        handle.start_profile  # noqa: B018 - an actor handle has an attribute per remote method
    except AttributeError:
        return False
    return True


class StepProfiler:
    """Starts and stops the profiles of ``profile.steps`` (see the module docstring)."""

    def __init__(
        self, steps: Sequence[int], directory: Path, log_artifacts: Callable[[Path, str], None] | None = None
    ) -> None:
        self.steps, self.directory, self.log_artifacts = set(steps), directory, log_artifacts
        self._recording: dict[str, Any] = {}  # actor name -> handle

    def begin(self, step: int, actors: dict[str, Any]) -> None:
        """At the start of ``step``: if it is a chosen one, start recording ``actors`` (name -> handle)."""
        if step not in self.steps:
            return
        chosen = {name: h for name, h in actors.items() if _profiled(h)}
        if skipped := sorted(actors.keys() - chosen.keys()):
            log.info(
                "step %d: profiling %s; not %s (no start_profile)",
                step,
                ", ".join(chosen),
                ", ".join(skipped),
            )
        ray.get([h.start_profile.remote() for h in chosen.values()])
        self._recording = chosen

    def end(self, step: int) -> Path | None:
        """After ``step``: stop the profiles it started; returns the directory of its traces."""
        if not self._recording:
            return None
        recording, self._recording = self._recording, {}
        out = self.directory / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        refs = {name: h.stop_profile.remote() for name, h in recording.items()}
        for name, ref in refs.items():
            try:
                (out / f"{name}.json.gz").write_bytes(ray.get(ref, timeout=300))
            except Exception as e:  # noqa: BLE001 - a dead actor's trace is lost; the step is not
                log.warning("step %d: no profile from %s: %s: %s", step, name, type(e).__name__, e)
        log.info("step %d: profiler traces in %s", step, out)
        if self.log_artifacts is not None:
            self.log_artifacts(out, f"profile/step_{step}")
        return out


def step_actors(trainers: Sequence[Any], critics: Sequence[Any], engines: dict[int, Any]) -> dict[str, Any]:
    """The actors a step runs on, by the names their traces get: ``trainer<rank>``, ``critic<rank>``,
    ``engine<id>``."""
    return (
        {f"trainer{r}": t for r, t in enumerate(trainers)}
        | {f"critic{r}": c for r, c in enumerate(critics)}
        | {f"engine{e}": h for e, h in engines.items()}
    )
