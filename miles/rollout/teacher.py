"""The teacher's engines, seen from the driver: each step's samples scored token by token (on-policy
distillation, docs/distillation.md).

:class:`TeacherPool` splits the samples that can train over the teacher engines it has, calls each engine's
``score`` (:meth:`miles.rollout.engine_score.EngineScoring.score`, or the SGLang engine's) once, and writes
every sample's teacher log-probs into ``Sample.metadata["teacher_logprobs"]`` (and, with ``teacher.top_k``,
``["teacher_top_logprobs"]``). An engine that dies, or does not answer within ``teacher.timeout_s``, is
killed, and its share goes to the others at once. With ``replace`` (the run's: a new actor in the lost one's
placement bundle, :func:`miles.core.actors.replace_teacher`), a new engine is started in its place and joins
the pool once its ``health`` answers within ``teacher.timeout_s``, before the next round of the step; one that
does not stays out. When no engine is left the step fails, naming what happened to each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from miles.types import Sample, ScoreRequest

log = logging.getLogger(__name__)


class TeacherLostError(RuntimeError):
    """Every teacher engine died or hung, and no replacement came up."""


class TeacherPool:
    """Scores samples on the teacher engines (``engines``: Ray actor handles with ``score``); ``replace(i)``
    starts a new engine in the place of engine ``i`` and returns its handle at once."""

    def __init__(self, engines: Sequence[Any], *, temperature: float, top_k: int = 0, timeout_s: float = 600.0,
                 replace: Callable[[int], Any] | None = None) -> None:
        if not engines:
            raise ValueError("TeacherPool: no teacher engines")
        self.engines = list(engines)
        self.alive = list(range(len(self.engines)))
        self.lost: dict[int, str] = {}
        """Why each engine out of the pool left it (and what became of its replacement)."""
        self.starting: dict[int, tuple[Any, float]] = {}
        """Replacements on their way: engine -> (its ``health`` ref, when it was started)."""
        self.restarts = 0
        self.temperature, self.top_k, self.timeout_s = temperature, top_k, timeout_s
        self.replace = replace

    @property
    def live_engines(self) -> list[Any]:
        """The handles of the engines in the pool."""
        return [self.engines[i] for i in self.alive]

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Score every trainable sample with a response; returns ``perf/teacher_s``, ``distill/teacher_engines``
        (engines in the pool) and ``distill/teacher_restarts`` (replacements that joined it, in the run).
        Raises :class:`TeacherLostError` when no engine is left and no replacement comes up."""
        t0 = time.perf_counter()
        self._join(0.0)  # replacements started in an earlier step that are up by now
        todo = [s for s in samples if s.trainable and s.response_ids]
        for s in samples:
            s.metadata.pop("teacher_logprobs", None)
            s.metadata.pop("teacher_top_logprobs", None)
        while todo:
            if not self.alive and self.starting:  # nothing else can score: wait for the replacements
                self._join(self.timeout_s)
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
                self._lose(engine, f"did not answer a scoring call within teacher.timeout_s={self.timeout_s:g}s")
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
        return {"perf/teacher_s": time.perf_counter() - t0, "distill/teacher_engines": float(len(self.alive)),
                "distill/teacher_restarts": float(self.restarts)}

    def _lose(self, engine: int, why: str) -> None:
        """Take ``engine`` out of the pool and kill it; with ``replace``, start a new one in its place (it joins
        once it answers, :meth:`_join`)."""
        self.alive.remove(engine)
        self.lost[engine] = why
        ray.kill(self.engines[engine], no_restart=True)
        log.warning("teacher engine %d %s; it leaves the pool (%d left)", engine, why, len(self.alive))
        if self.replace is None:
            return
        try:
            self.engines[engine] = self.replace(engine)
        except Exception as e:  # e.g. its bundle is gone: it stays out
            self.lost[engine] += f"; no replacement ({type(e).__name__}: {e})"
            return
        self.starting[engine] = (self.engines[engine].health.remote(), time.monotonic())

    def _join(self, wait_s: float) -> None:
        """Replacements whose ``health`` answered join the pool (waiting up to ``wait_s`` for them); one that
        failed, or has not answered ``timeout_s`` after its start, is killed and stays out."""
        if not self.starting:
            return
        refs = {ref: i for i, (ref, _) in self.starting.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            i = refs[ref]
            del self.starting[i]
            try:
                ray.get(ref)
            except Exception as e:
                self.lost[i] += f"; its replacement failed to start ({type(e).__name__})"
                continue
            self.alive.append(i)
            self.restarts += 1
            log.info("teacher engine %d replaced (it %s); %d in the pool", i, self.lost.pop(i), len(self.alive))
        for i, (_, started) in list(self.starting.items()):
            if time.monotonic() - started > self.timeout_s:
                del self.starting[i]
                self.lost[i] += f"; its replacement did not answer within teacher.timeout_s={self.timeout_s:g}s"
                ray.kill(self.engines[i], no_restart=True)
        self.alive.sort()


class TenantTeachers:
    """The teachers of a multi-LoRA run (``tenants[i].teacher``, else ``teacher.model``): one :class:`TeacherPool`
    per tenant, by name; each sample is scored by the pool of the tenant that generated it (``Sample.adapter``)."""

    def __init__(self, pools: dict[str, TeacherPool]) -> None:
        if not pools:
            raise ValueError("TenantTeachers: no teacher pools")
        self.pools = pools

    @property
    def live_engines(self) -> list[Any]:
        return [e for p in self.pools.values() for e in p.live_engines]

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """:meth:`TeacherPool.score` of each tenant's samples on its pool, one tenant after the other; the
        metrics are summed over the pools. ValueError for a sample of a tenant without a teacher."""
        by: dict[str | None, list[Sample]] = {}
        for s in samples:
            by.setdefault(s.adapter, []).append(s)
        unknown = sorted(str(a) for a in by if a not in self.pools)
        if unknown:
            raise ValueError(f"samples of tenant(s) {', '.join(unknown)}, which have no teacher "
                             f"(teachers: {', '.join(self.pools)})")
        out: dict[str, float] = {}
        for name, group in by.items():
            for k, v in self.pools[name].score(group).items():  # type: ignore[index]
                out[k] = out.get(k, 0.0) + v
        return out
