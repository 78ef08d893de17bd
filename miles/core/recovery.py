"""Rollout engines that die or hang are replaced by new ones, between steps.

The engine pool takes an engine out of rotation when its actor dies or its backend is gone (an SGLang
server that exited or stopped answering), in generation and in every other call to it, and when it
stops answering its health checks (``rollout.health_interval_s``: the rollout's watchdog while it has
calls in flight, the idle watch between rollouts; :mod:`miles.rollout.dispatch`). At each weight push (:func:`miles.core.step.push_weights`) the driver
then:

1. asks the engines in rotation for their health: one that does not answer within
   ``rollout.engine_timeout_s`` is taken out as hung (as is one that does not finish the memory offload
   of the train step within it);
2. kills each engine out of rotation and starts a new actor in its placement bundle, constructed as at
   the start of the run (:func:`miles.core.actors.replace_engine`), and waits until it answers; with
   engines of their own bundles (``placement=disaggregated``) and others still in rotation it does not
   wait, and a later push finds it up (:class:`EngineRecovery`);
3. pushes the weights of the current version to the new engines alone, and only then puts them in
   rotation: no request reaches an engine before it holds the version the others hold.

This happens at most ``rollout.max_engine_restarts`` times over the run; after that an engine that
dies stays out, as it did before. With no engine in rotation (every engine died in one rollout) the
synchronous loop waits for replacements, up to ``rollout.max_outage_s``, and repeats the rollout; the
prompts of the failed rollout were never counted as drawn. Under the async schedules the rollout
stream stops, the engines are replaced the same way, and the groups they were generating are generated
again (:mod:`miles.core.schedules`).

Metrics: ``fault/engine_restarts`` (over the run), ``fault/engine_outage_s`` (seconds the replaced
engines were out of rotation, over the run), ``fault/engine_start_s`` (the last replacement's start),
``fault/engine_blocked_s`` (seconds pushes waited for replacements, over the run),
``fault/engines_starting`` (replacements not yet in rotation).

Trainer ranks (:class:`TrainerRecovery`, every schedule, runs with tenants too): while a step waits
on the trainer and critic ranks, it probes them (:func:`get_ranks`, in a thread of each rank's own, so a
rank busy computing or waiting in a collective answers); a rank that does not answer within
``trainer.hang_timeout_s`` is hung and is killed. When a step fails, the driver asks every trainer and
critic rank whether it is alive (:meth:`TrainerRecovery.find_dead`; a dead actor, a killed hung one
among them, answers with its death at once). With a dead rank the step is abandoned
(:class:`TrainerRankDiedError`); then, at most ``trainer.max_failures`` times over the run,
:func:`miles.core.step.recover_trainers` restarts both groups in their bundles
(:func:`miles.core.actors.restart_trainers`), restores them from the run's last checkpoint with its
ledger and loop state, gives the engines its weights, and the loop runs again from the step after it
(under the async schedules the rollout stream is stopped first and the prompts open at the checkpoint
are generated again: :mod:`miles.core.schedules`). Metrics: ``fault/trainer_restarts`` (over the run),
``fault/trainer_detect_s`` (the last failure: from the failed call to the dead ranks named),
``fault/trainer_restore_s`` (the last restore: restart, checkpoint load and weight push).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from miles.config import MilesConfig
from miles.core.actors import Actors, probe, replace_engine, restart_trainers
from miles.rollout.dispatch import AllEnginesDeadError, first_line
from miles.rollout.manager import RolloutManager
from miles.weights.sync import Transport, sync_weights

log = logging.getLogger(__name__)


class EngineRecovery:
    """Replaces the engines of ``rollout`` that are out of rotation (see the module docstring).

    ``background`` (default: engines with bundles of their own, ``placement=disaggregated``): while other
    engines are in rotation, a push starts the replacements and returns without waiting for them; a later
    push gives each one that is up the weights and puts it in rotation. Otherwise (and always when no
    engine is left) the push waits for them. Colocated engines share their bundles with trainer ranks,
    whose memory a starting engine must not compete with during a train step, so they are waited for.
    """

    def __init__(self, actors: Actors, rollout: RolloutManager, run: MilesConfig, checkpoint_dir: str,
                 background: bool | None = None) -> None:
        self.actors, self.rollout, self.run, self.checkpoint_dir = actors, rollout, run, checkpoint_dir
        self.cfg = run.rollout
        self.background = actors.plan.placement == "disaggregated" if background is None else background
        self.restarts, self.outage_s, self.start_s, self.blocked_s = 0, 0.0, 0.0, 0.0
        self.starting: dict[int, tuple[Any, Any, float]] = {}  # engine -> (new actor, its health ref, started at)

    def metrics(self) -> dict[str, float]:
        return {"fault/engine_restarts": float(self.restarts), "fault/engine_outage_s": self.outage_s,
                "fault/engine_start_s": self.start_s, "fault/engine_blocked_s": self.blocked_s,
                "fault/engines_starting": float(len(self.starting))}

    def restore(self, trainers: Sequence[Any], version: int, transport: Transport | None) -> dict[str, float]:
        """Start replacements for the engines out of rotation (while restarts are left); give those that are
        up ``version`` (the trainers' current weights) and put them in rotation. With engines left in
        rotation and ``background``, returns without waiting for the others; else waits for them, up to
        ``rollout.max_outage_s``. The caller checked the engines in rotation
        (:func:`miles.core.step.push_weights`).

        Raises :class:`~miles.rollout.dispatch.AllEnginesDeadError` when no engine is in rotation and none
        could be brought back within ``rollout.max_outage_s``.
        """
        pool = self.rollout.pool
        t0 = time.monotonic()
        deadline, waited = t0 + self.cfg.max_outage_s, False
        while True:
            self._launch([e for e in range(len(pool.engines)) if e not in pool.alive and e not in self.starting])
            wait = not (self.background and pool.alive)
            if not self.starting:
                break
            waited |= wait
            fresh = self._ready(max(deadline - time.monotonic(), 0.0) if wait else 0.0)
            if fresh:
                self._join(fresh, trainers, version, transport)
            if not wait or not self.starting and self.restarts >= self.cfg.max_engine_restarts:
                break
            if time.monotonic() >= deadline:
                break
        if waited:
            self.blocked_s += time.monotonic() - t0
        if not pool.alive:
            why = "no restarts left" if self.restarts >= self.cfg.max_engine_restarts else (
                f"none came up within rollout.max_outage_s ({self.cfg.max_outage_s:g} s)")
            raise AllEnginesDeadError(f"{pool.all_dead_error()} Replacements: {self.restarts} started of "
                                      f"rollout.max_engine_restarts={self.cfg.max_engine_restarts}; {why}.")
        return self.metrics()

    def _launch(self, down: list[int]) -> None:
        """Start new actors for engines ``down``, as many as restarts are left (each counts as one)."""
        for e in down[: max(self.cfg.max_engine_restarts - self.restarts, 0)]:
            self.restarts += 1
            actor = replace_engine(self.actors, e, self.run, self.checkpoint_dir)
            self.starting[e] = (actor, actor.health.remote(), time.monotonic())
            log.warning("rollout engine %d: starting a replacement (%d of rollout.max_engine_restarts=%d)%s", e,
                        self.restarts, self.cfg.max_engine_restarts,
                        "; the run goes on with the engines in rotation meanwhile"
                        if self.background and self.rollout.pool.alive else "")

    def _ready(self, timeout: float) -> dict[int, Any]:
        """The starting replacements whose health check answered within ``timeout`` (0: those done now), by
        engine index. One that failed, or took longer than ``rollout.max_outage_s`` since it started, is
        killed and dropped (its engine is started again while restarts are left)."""
        refs = {ref: e for e, (_, ref, _) in self.starting.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        up = {}
        for ref in done:
            e = refs[ref]
            actor, _, started = self.starting.pop(e)
            try:
                health = ray.get(ref)
                if not health.get("ok", True):
                    raise RuntimeError(f"health check: {health}")
                up[e] = actor
                self.start_s = time.monotonic() - started
            except Exception as err:  # noqa: BLE001 - a failed start is counted and logged, then tried again
                log.warning("rollout engine %d: the replacement did not start (%s)", e, first_line(err))
                ray.kill(actor, no_restart=True)
        now = time.monotonic()
        for e in [e for e, (_, _, started) in self.starting.items() if now - started > self.cfg.max_outage_s]:
            actor, _, _ = self.starting.pop(e)
            log.warning("rollout engine %d: the replacement did not answer within rollout.max_outage_s (%g s); "
                        "killed", e, self.cfg.max_outage_s)
            ray.kill(actor, no_restart=True)
        return up

    def _join(self, fresh: dict[int, Any], trainers: Sequence[Any], version: int,
              transport: Transport | None) -> None:
        """Give the replacements ``fresh`` the weights of ``version``, then put them in rotation: no request
        reaches one before it holds the version the others hold."""
        try:
            sync_weights(trainers, list(fresh.values()), version=version, transport=transport)
        except Exception as err:  # noqa: BLE001 - the new engines failed; they are started again while restarts are left
            log.warning("rollout engine(s) %s: the replacements did not take version %d (%s)", sorted(fresh),
                        version, first_line(err))
            for actor in fresh.values():
                ray.kill(actor, no_restart=True)
            return
        for e, engine in fresh.items():
            out = self.rollout.pool.revive(e, engine)
            self.outage_s += out
            log.warning("rollout engine %d replaced: a new actor holds version %d and is in rotation again "
                        "(out for %.1f s, %d of %d restart(s) used)", e, version, out, self.restarts,
                        self.cfg.max_engine_restarts)


class TrainerRankDiedError(RuntimeError):
    """A step failed and these trainer (or critic) ranks are dead; the step was abandoned."""

    def __init__(self, step: int, dead: dict[str, list[int]], cause: BaseException, hint: str = "") -> None:
        self.step, self.dead, self.cause = step, dead, cause
        names = "; ".join(f"{kind} rank(s) {', '.join(map(str, ranks))}" for kind, ranks in dead.items() if ranks)
        super().__init__(f"step {step}: {names} died ({first_line(cause)}); the step was abandoned"
                         + (f". {hint}" if hint else ""))

    def stop(self, hint: str) -> TrainerRankDiedError:
        """The same error, saying why the run stops (``hint``)."""
        return TrainerRankDiedError(self.step, self.dead, self.cause, hint)


class TrainerRankHungError(RuntimeError):
    """Trainer (or critic) ranks did not answer their liveness probe within ``trainer.hang_timeout_s``
    while a step waited on them (:func:`get_ranks`); they were killed."""

    def __init__(self, message: str, detect_s: float) -> None:
        super().__init__(message)
        self.detect_s = detect_s
        """Seconds from the last probe every rank answered (or the call's start) to the kill."""


PROBE_EVERY_S = 10.0
"""How often :func:`get_ranks` probes the ranks of a call that has not finished (at most)."""


def get_ranks(refs: Sequence[Any], ranks: Sequence[Any], kind: str, timeout_s: float) -> list[Any]:
    """``ray.get(refs)``, the results of one call on each of the ``kind`` ranks ``ranks`` (in order),
    while finding ranks that hang. Until every call has returned, each rank is probed every
    :data:`PROBE_EVERY_S` (or ``timeout_s`` when shorter; :func:`miles.core.actors.probe`, answered in a
    thread of its own even while the rank computes or waits in a collective on a peer). Ranks that do not
    answer within ``timeout_s`` are stopped or hung: they are killed, which also ends their peers' waits in
    the group's collectives, and :class:`TrainerRankHungError` is raised; the recovery then finds them dead
    (:meth:`TrainerRecovery.find_dead`). An error of a call (a rank's death) is raised as soon as it
    returns. ``timeout_s`` 0: no probes, as ``ray.get``."""
    if timeout_s <= 0:
        return ray.get(list(refs))
    every = min(PROBE_EVERY_S, timeout_s)
    started = answered_at = time.monotonic()
    pending, next_probe = list(refs), started + every
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(next_probe - time.monotonic(), 0.0))
        if ready:
            ray.get(ready)  # raises a rank's error (its death) now, not after its peers' collectives time out
            continue
        pings = [probe(r) for r in ranks]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        hung = [i for i, ref in enumerate(pings) if ref not in answered]
        if hung:
            for i in hung:
                ray.kill(ranks[i], no_restart=True)
            raise TrainerRankHungError(
                f"{kind} rank(s) {', '.join(map(str, hung))} did not answer a liveness probe within "
                f"trainer.hang_timeout_s={timeout_s:g} s ({time.monotonic() - started:.1f} s into the call): "
                "stopped or hung; killed", detect_s=time.monotonic() - answered_at)
        answered_at = time.monotonic()
        next_probe = answered_at + every
    return ray.get(list(refs))


class TrainerRecovery:
    """Finds the dead trainer and critic ranks of a failed step and restarts both groups (see the module
    docstring); the restore from the checkpoint is :func:`miles.core.step.recover_trainers`."""

    def __init__(self, actors: Actors, run: MilesConfig, checkpoint_dir: str, ping_timeout_s: float = 5.0) -> None:
        self.actors, self.run, self.checkpoint_dir, self.ping_timeout_s = actors, run, checkpoint_dir, ping_timeout_s
        self.max_failures = run.trainer.max_failures
        self.restarts, self.detect_s, self.restore_s = 0, 0.0, 0.0

    def metrics(self) -> dict[str, float]:
        return {"fault/trainer_restarts": float(self.restarts), "fault/trainer_detect_s": self.detect_s,
                "fault/trainer_restore_s": self.restore_s}

    def find_dead(self, step: int, cause: BaseException) -> TrainerRankDiedError | None:
        """The ranks that are dead after ``cause`` failed ``step``, as an error to raise; None when every
        rank is alive (``cause`` was no rank's death). Each rank gets ``ping_timeout_s`` to answer."""
        t0 = time.perf_counter()
        groups = {"trainer": self.actors.trainers, "critic": self.actors.critics}
        pings = {kind: [probe(a) for a in ranks] for kind, ranks in groups.items()}
        deadline = time.monotonic() + self.ping_timeout_s
        dead: dict[str, list[int]] = {kind: [] for kind in groups}
        for kind, refs in pings.items():
            for rank, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01))
                except ray.exceptions.GetTimeoutError:
                    pass  # alive but slow to answer (a loaded machine); restarted with the group
                except ray.exceptions.RayActorError:
                    dead[kind].append(rank)
        hang = next((e for e in (cause, cause.__cause__) if hasattr(e, "detect_s")), None)  # e.g. in a weight push
        self.detect_s = time.perf_counter() - t0 + (hang.detect_s if hang is not None else 0.0)  # with a hang's own
        if not any(dead.values()):
            return None
        return TrainerRankDiedError(step, dead, cause)

    def restart(self) -> None:
        """Count a restart and start both rank groups anew (:func:`miles.core.actors.restart_trainers`)."""
        self.restarts += 1
        restart_trainers(self.actors, self.run, self.checkpoint_dir)
