"""The driver's side of per-step timelines (``tracking.timeline_steps``, :mod:`miles.tracking.timeline`).

:meth:`StepTimeline.begin` before a chosen step starts recording the driver's phases; :meth:`StepTimeline.end`
after it gathers the spans of every engine, trainer and critic rank (one ``timeline_drain`` call each, only
in the chosen steps), of the reward workers and of the driver, and hands the Chrome trace to ``sink``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from miles.tracking import timeline

log = logging.getLogger(__name__)


class StepTimeline:
    """Records the steps in ``steps``; ``actors()`` returns the engines, trainer and critic ranks to ask,
    ``rewards`` the reward runners whose workers' chunks count, ``sink`` gets each step's trace."""

    def __init__(
        self,
        steps: Sequence[int],
        actors: Callable[[], Sequence[Any]],
        rewards: Sequence[Any],
        sink: Callable[[dict[str, Any]], None],
    ) -> None:
        self.steps = frozenset(steps)
        self.actors, self.rewards, self.sink = actors, [r for r in rewards if r is not None], sink
        self._start: float | None = None
        self._warned = False

    def wants(self, step: int) -> bool:
        return step in self.steps

    def begin(self, step: int) -> None:
        """Start recording ``step`` (a step not in ``steps``: nothing)."""
        if not self.wants(step):
            return
        timeline.drain(0.0)  # the driver's spans of earlier steps
        timeline.record(True)
        self._start = time.time()

    def end(self, step: int) -> dict[str, Any] | None:
        """Stop recording ``step``; its trace went to ``sink`` and is returned (None: not recorded).
        A failure here is logged, never raised: a timeline must not fail the run."""
        if self._start is None:
            return None
        start, self._start = self._start, None
        stop = time.time()
        timeline.record(False)
        try:
            spans = timeline.drain(start)
            handles = list(self.actors())
            timed = [a for a in handles if hasattr(a, "timeline_drain")]
            if len(timed) < len(handles) and not self._warned:
                self._warned = True
                log.warning(
                    "timeline: %d actor(s) were started without tracking.timeline_steps (kept from an "
                    "earlier job) and are left out",
                    len(handles) - len(timed),
                )
            for rows in ray.get([a.timeline_drain.remote(start) for a in timed], timeout=60):
                spans += [timeline.Span(*row) for row in rows]
            for runner in self.rewards:
                spans += [
                    timeline.Span(
                        "driver" if w == "inline" else f"reward worker {w}", "score", t0, t1, {"calls": n}
                    )
                    for w, t0, t1, n in list(runner.spans)
                    if t1 >= start
                ]
            trace = timeline.chrome_trace(spans, start, stop, step=step)
            log.info(timeline.summary(trace))
            self.sink(trace)
            return trace
        except Exception as e:  # noqa: BLE001
            log.warning("timeline of step %d not written: %s: %s", step, type(e).__name__, e)
            return None
