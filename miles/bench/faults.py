"""``python -m miles.bench faults``: the default task with rollout-engine and trainer-rank faults injected in one run,
against the same run (same seed, same checkpoint) without them.

The faults, each at its own step (``--steps`` split in equal parts), sent after that step's rollout by a
hook in the driver (:class:`FaultInjector`):

- ``engine_kill``: SIGKILL of one engine actor process;
- ``engine_hang``: SIGSTOP of one engine actor process (found by ``rollout.engine_timeout_s``);
- ``server_kill`` (with ``--engine sglang``): SIGKILL of one SGLang server's process group;
- ``trainer_kill``: SIGKILL of one trainer rank's actor process (both runs then write a run checkpoint
  every step, ``trainer.save_every=1``, which the restarted ranks restore);
- ``trainer_hang``: SIGSTOP of one trainer rank's actor process, found by the train step's probes
  (``trainer.hang_timeout_s``) and killed; then as ``trainer_kill``;
- ``nonfinite_step``: the step's batch gets NaN advantages before its train step (the hook's
  ``before_train``), so its loss is not finite: the trainer skips the update and counts it
  (``train/nonfinite_skipped``), and the run goes on.

``--faults`` picks some of them (default: all that apply to the engine).

Per fault: ``recovery_s``, from the signal to the end of the step whose weight push put the
replacement in rotation (``back_at_step``: the fault's own step when the push waits for it, a later one
when it starts in the background, ``placement=disaggregated``); ``out_of_rotation_s``, the part of it the
engine was taken out (``fault/engine_outage_s``); ``detect_s``, the rest (from the signal until the
engine was taken out, plus the push to the other engines); ``blocked_s``, how long the fault's step waited
for the replacement (``fault/engine_blocked_s``); ``restarts``; for ``trainer_kill`` and ``trainer_hang``, ``detect_s`` (from the failed
call to the dead rank named, ``fault/trainer_detect_s``; for a hang, from the last probe answered) and ``restore_s`` (the ranks restarted, restored
from the checkpoint and the engines re-synced, ``fault/trainer_restore_s``) instead, and ``recovery_s`` up
to the end of the retried step; ``steps_lost``, steps whose batch was not trained whole; ``prompts_lost`` (the sample ledger's prompts without an outcome) and ``prompts_duplicated``
(trained more than once: ``ledger/trained`` over the number of training steps' prompts). For
``nonfinite_step``: ``updates_skipped`` (``train/nonfinite_skipped`` of its step), ``detect_s`` (from
the poisoning to the end of its step, whose metrics report the skip) and ``recovery_s`` (to the end of
the next step that updated the weights). Then ``eval/accuracy`` of both runs. JSON last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any

from miles.bench.e2e import compose

log = logging.getLogger("miles.bench.faults")

FAULTS = ("engine_kill", "engine_hang", "server_kill", "trainer_kill", "trainer_hang", "nonfinite_step")
TRAINER_FAULTS = ("trainer_kill", "trainer_hang")
TRAINER_CLASSES = ("FSDPTrainer", "MegatronTrainer")


class FaultInjector:
    """Hook: ``faults`` lists ``[step, fault]``; sends each after that step's rollout (once: a step that
    runs again after a trainer restart gets none) and records when. While a replacement engine is still
    starting (``fault/engines_starting`` of the last step logged, :attr:`latest`), the next fault waits
    for a later step, so that no two faults' recoveries overlap."""

    sent: dict[int, tuple[str, float]] = {}  # step -> (fault, time.monotonic()), read by the benchmark
    latest: dict[str, float] = {}  # the metrics of the last step logged (set by the benchmark's run)

    def __init__(self, faults: list[list], engine_class: str) -> None:
        self.faults, self.engine_class = sorted((int(step), str(name)) for step, name in faults), engine_class
        FaultInjector.sent, FaultInjector.latest = {}, {}

    def _due(self, step: int, in_train: bool) -> str | None:
        """The next fault, taken off the list, when it is due at ``step`` and sent from this point (the
        non-finite step before the train step, the others after the rollout)."""
        if not self.faults or self.faults[0][0] > step or FaultInjector.latest.get("fault/engines_starting"):
            return None
        if (self.faults[0][1] == "nonfinite_step") != in_train:
            return None
        return self.faults.pop(0)[1]

    def before_train(self, ctx: Any, batch: Any) -> None:
        if self._due(ctx.step, in_train=True) is None:
            return
        nan = float("nan")
        batch.advantages = [nan] * len(batch.advantages)
        if batch.token_advantages is not None:
            batch.token_advantages = [[nan] * len(row) for row in batch.token_advantages]
        FaultInjector.sent[ctx.step] = ("nonfinite_step", time.monotonic())

    def after_rollout(self, ctx: Any, groups: Any) -> None:
        fault = self._due(ctx.step, in_train=False)
        if fault is None:
            return
        import psutil

        if fault in TRAINER_FAULTS:  # this driver's trainer ranks, from Ray's actor table
            import ray

            job = ray.get_runtime_context().get_job_id()
            ranks = [(a["StartTime"], a["Pid"]) for a in ray._private.state.actors().values()
                     if a["ActorClassName"] in TRAINER_CLASSES and a["State"] == "ALIVE" and a["JobID"] == job]
            if not ranks:
                raise RuntimeError(f"{fault}: no trainer rank actor found in this job")
            # the rank started last (process ids wrap around, so not the largest pid)
            os.kill(max(ranks)[1], signal.SIGKILL if fault == "trainer_kill" else signal.SIGSTOP)
        elif fault == "server_kill":
            # a server's process group: its supervisor (the leader), sglang.launch_server and its children
            leaders = [p.pid for p in psutil.process_iter(["cmdline"])
                       if "sglang_supervisor" in " ".join(p.info["cmdline"] or []) and os.getpgid(p.pid) == p.pid]
            if not leaders:
                raise RuntimeError("server_kill: no SGLang server process found (rollout=sglang?)")
            os.killpg(min(leaders), signal.SIGKILL)
        else:
            engines = [p.pid for p in psutil.process_iter(["cmdline", "status"])
                       if (p.info["cmdline"] or [""])[0].startswith(f"ray::{self.engine_class}")
                       and p.info["status"] != "zombie"]
            if not engines:
                raise RuntimeError(f"{fault}: no {self.engine_class} actor process found on this node")
            os.kill(min(engines), signal.SIGKILL if fault == "engine_kill" else signal.SIGSTOP)
        FaultInjector.sent[ctx.step] = (fault, time.monotonic())


def _samples(m: dict[str, float]) -> float:
    """A step's rolled-out samples: ``rollout/samples``, or with tenants the sum of each one's."""
    per_tenant = [v for k, v in m.items() if k.startswith("tenant/") and k.endswith("/rollout/samples")]
    return sum(per_tenant) if per_tenant else m.get("rollout/samples", 0.0)


def _run(overrides: list[str]) -> tuple[list[tuple[int, dict[str, float], float]], dict[str, float]]:
    from miles.core.run import run_job

    run, resolved = compose(overrides)
    seen: list[tuple[int, dict[str, float], float]] = []

    def on_metrics(m: dict[str, float], s: int) -> None:
        seen.append((s, dict(m), time.monotonic()))
        FaultInjector.latest = dict(m)

    final = run_job(run, resolved_yaml=resolved, overrides=overrides, on_metrics=on_metrics)
    return seen, final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("torch", "sglang"), default="torch")
    p.add_argument("--steps", type=int, default=12, help="training steps of each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default=None,
                   help=f"comma-separated faults to inject, of {', '.join(FAULTS)} (default: all that apply)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    applies = [f for f in FAULTS if args.engine == "sglang" or f != "server_kill"]
    names = applies if args.faults is None else [f.strip() for f in args.faults.split(",") if f.strip()]
    wrong = [f for f in names if f not in applies]
    if wrong or not names:
        p.error(f"--faults {args.faults}: choose from {', '.join(applies)} (with --engine {args.engine})")
    every = args.steps // (len(names) + 1)
    if every < 1:
        p.error(f"--steps {args.steps}: at least {len(names) + 1} steps for {len(names)} faults")
    faults = {every * (i + 1): name for i, name in enumerate(names)}
    engine_class = "SGLangEngine" if args.engine == "sglang" else "TorchEngine"
    common = [f"seed={args.seed}", f"trainer.num_steps={args.steps}", "trainer.eval_every=0", "tracking=none",
              "placement.num_engines=2", "cluster.reuse_actors=false", "rollout.engine_timeout_s=10",
              *([f"rollout={args.engine}"] if args.engine == "sglang" else []), *args.overrides]
    trainer_faults = any(n in TRAINER_FAULTS for n in names)
    if trainer_faults:  # the restarted ranks restore the last run checkpoint: one every step
        save_dir = tempfile.mkdtemp(prefix="miles-bench-faults-")
        common += ["trainer.save_every=1", f"trainer.save_dir={save_dir}"]
    hook = ("hooks=[{_target_: miles.bench.faults.FaultInjector, engine_class: " + engine_class + ", faults: ["
            + ", ".join(f"[{k}, {v}]" for k, v in faults.items()) + "]}]")
    log.info("uninterrupted run, then the run with %s", ", ".join(f"{v} at step {k}" for k, v in faults.items()))
    _, clean = _run(common)
    if trainer_faults:  # the faulted run writes its own checkpoints
        shutil.rmtree(save_dir)
    seen, faulted = _run(common + [hook])
    by_step = {s: (m, t) for s, m, t in seen}
    composed = compose(common)[0]
    algo, tenants = composed.algo, max(len(composed.tenants), 1)  # a run with tenants rolls out each's batch
    full = algo.num_prompts_per_step * algo.num_samples_per_prompt * tenants
    report: dict[str, Any] = {"engine": args.engine, "steps": args.steps, "faults": {}}
    steps = sorted(by_step)

    def before(key: str, step: int) -> float:  # a run-long metric as of the end of the step before ``step``
        return next((by_step[s][0][key] for s in reversed(steps) if s < step and key in by_step[s][0]), 0.0)

    for step, (name, sent_at) in sorted(FaultInjector.sent.items()):
        m, t = by_step[step]
        if name == "nonfinite_step":
            after = next((s for s in steps if s > step and by_step[s][0].get("train/nonfinite_skipped", 0.0) == 0), None)
            report["faults"][name] = {
                "step": step, "updates_skipped": m.get("train/nonfinite_skipped", 0.0), "detect_s": round(t - sent_at, 3),
                "recovery_s": None if after is None else round(by_step[after][1] - sent_at, 2)}
            continue
        if name in TRAINER_FAULTS:
            report["faults"][name] = {
                "step": step, "recovery_s": round(t - sent_at, 2), "detect_s": round(m["fault/trainer_detect_s"], 3),
                "restore_s": round(m["fault/trainer_restore_s"], 2), "restarts": m["fault/trainer_restarts"]}
            continue
        # back in rotation: at the end of the first step from the fault's whose push added outage seconds (the
        # same step when the push waits for the replacement, a later one when it starts in the background)
        outage0 = before("fault/engine_outage_s", step)
        back = next((s for s in steps if s >= step and by_step[s][0].get("fault/engine_outage_s", 0.0) > outage0), None)
        if back is None:
            report["faults"][name] = {"step": step, "recovery_s": None, "restarts": m.get("fault/engine_restarts")}
            continue
        mb, tb = by_step[back]
        recovery, out = tb - sent_at, mb["fault/engine_outage_s"] - outage0
        report["faults"][name] = {
            "step": step, "back_at_step": back, "recovery_s": round(recovery, 2), "out_of_rotation_s": round(out, 2),
            "detect_s": round(recovery - out, 2),
            "blocked_s": round(m.get("fault/engine_blocked_s", 0.0) - before("fault/engine_blocked_s", step), 2),
            "restarts": mb.get("fault/engine_restarts")}
    ledger = {k: v for k, v in faulted.items() if k.startswith("ledger/")}
    trained_steps = [m for s, (m, _) in by_step.items() if s > 0]
    report |= {
        "steps_lost": sum(1 for m in trained_steps if _samples(m) < full),
        "prompts_lost": ledger.get("ledger/open", 0.0),
        "prompts_duplicated": max(ledger.get("ledger/trained", 0.0)
                                  - len(trained_steps) * algo.num_prompts_per_step * tenants,
                                  0.0),
        "restarts": faulted.get("fault/engine_restarts"), "trainer_restarts": faulted.get("fault/trainer_restarts"),
        "eval_accuracy_faulted": faulted.get("eval/accuracy"), "eval_accuracy_uninterrupted": clean.get("eval/accuracy"),
        "ledger": ledger,
        "not_sent": sorted(set(faults.values()) - {name for name, _ in FaultInjector.sent.values()}),
    }
    for name, f in report["faults"].items():
        if name == "nonfinite_step":
            print(f"{name:12s} step {f['step']:3d}: {f['updates_skipped']:.0f} update(s) skipped, reported {f['detect_s']:.3f} s "
                  f"after the poisoning; the next update {f['recovery_s']} s after it")
            continue
        if name in TRAINER_FAULTS:
            print(f"{name:12s} step {f['step']:3d}: recovery {f['recovery_s']:6.1f} s (detect {f['detect_s']:5.3f} s, "
                  f"restore {f['restore_s']:5.1f} s), restarts {f['restarts']:.0f}")
            continue
        if f["recovery_s"] is None:
            print(f"{name:12s} step {f['step']:3d}: not back in rotation by the end of the run")
            continue
        print(f"{name:12s} step {f['step']:3d}: recovery {f['recovery_s']:6.1f} s (detect {f['detect_s']:5.1f} s, "
              f"out of rotation {f['out_of_rotation_s']:5.1f} s; back at step {f['back_at_step']}, the step waited "
              f"{f['blocked_s']:.1f} s for it), restarts {f['restarts']:.0f}")
    if report["not_sent"]:
        print(f"not sent (a replacement was still starting until the end; raise --steps): {', '.join(report['not_sent'])}")
    print(f"steps lost {report['steps_lost']}, prompts lost {report['prompts_lost']:.0f}, duplicated "
          f"{report['prompts_duplicated']:.0f}; eval/accuracy {report['eval_accuracy_faulted']:.3f} with the faults, "
          f"{report['eval_accuracy_uninterrupted']:.3f} without")
    print(json.dumps(report))
    return 0 if report["prompts_lost"] == 0 and report["steps_lost"] == 0 else 1
