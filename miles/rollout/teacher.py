"""The teacher's engines, seen from the driver: each step's samples scored token by token (on-policy
distillation, docs/distillation.md).

:class:`TeacherPool` splits the samples that can train over the teacher engines it has, calls each engine's
``score`` (:meth:`miles.rollout.engine_score.EngineScoring.score`, or the SGLang engine's) once, and writes
every sample's teacher log-probs into ``Sample.metadata["teacher_logprobs"]`` (and, with ``teacher.top_k``,
``["teacher_top_logprobs"]``). An engine that dies, or does not answer within ``teacher.timeout_s``, is
killed and left out for the rest of the run, and its share goes to the others at once; when none is left
the step fails, naming what each engine did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from miles.types import Sample, ScoreRequest

log = logging.getLogger(__name__)


class TeacherLostError(RuntimeError):
    """Every teacher engine died or hung."""


class TeacherPool:
    """Scores samples on the teacher engines (``engines``: Ray actor handles with ``score``)."""

    def __init__(self, engines: Sequence[Any], *, temperature: float, top_k: int = 0, timeout_s: float = 600.0) -> None:
        if not engines:
            raise ValueError("TeacherPool: no teacher engines")
        self.engines = list(engines)
        self.alive = list(range(len(self.engines)))
        self.lost: dict[int, str] = {}
        self.temperature, self.top_k, self.timeout_s = temperature, top_k, timeout_s

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Score every trainable sample with a response; returns ``perf/teacher_s`` and
        ``distill/teacher_engines`` (engines left). Raises :class:`TeacherLostError` when none is left."""
        t0 = time.perf_counter()
        todo = [s for s in samples if s.trainable and s.response_ids]
        for s in samples:
            s.metadata.pop("teacher_logprobs", None)
            s.metadata.pop("teacher_top_logprobs", None)
        while todo:
            if not self.alive:
                raise TeacherLostError("every teacher engine is lost (" + "; ".join(
                    f"engine {i}: {why}" for i, why in sorted(self.lost.items())) + "); no sample can be scored")
            shares = [todo[k::len(self.alive)] for k in range(len(self.alive))]
            calls = {}
            for engine, share in zip(list(self.alive), shares, strict=True):
                if share:
                    reqs = [ScoreRequest(prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids)) for s in share]
                    calls[self.engines[engine].score.remote(reqs, self.temperature, self.top_k)] = (engine, share)
            ready, pending = ray.wait(list(calls), num_returns=len(calls), timeout=self.timeout_s)
            todo = []
            for ref in pending:
                engine, share = calls[ref]
                self._lose(engine, f"no answer to a scoring call within teacher.timeout_s={self.timeout_s:g}s")
                todo += share
            for ref in ready:
                engine, share = calls[ref]
                try:
                    results = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    self._lose(engine, f"died ({type(e).__name__})")
                    todo += share
                    continue
                for s, r in zip(share, results, strict=True):
                    s.metadata["teacher_logprobs"] = list(r.logprobs)
                    if r.top_logprobs is not None:
                        s.metadata["teacher_top_logprobs"] = r.top_logprobs
        return {"perf/teacher_s": time.perf_counter() - t0, "distill/teacher_engines": float(len(self.alive))}

    def _lose(self, engine: int, why: str) -> None:
        self.alive.remove(engine)
        self.lost[engine] = why
        ray.kill(self.engines[engine], no_restart=True)
        log.warning("teacher engine %d %s; it leaves the pool (%d left)", engine, why, len(self.alive))
