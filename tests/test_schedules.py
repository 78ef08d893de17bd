"""Schedules (sync, one_step_off, fully_async): the sample ledger is exact, the staleness bound holds,
and ``sync`` computes what it computed before the schedules existed.

The async runs go on both engines: ``torch``, and ``sglang`` (real SGLang servers, ``-m sglang``; its
jobs run one after another on the same parked engine actor, whose server is kept between them, so
the module starts one server). The sync recording is not replayed on SGLang: on CPU SGLang cannot
seed requests (``--enable-deterministic-inference`` needs a GPU attention backend), so its samples
are not reproducible per request."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from miles.config import validate
from miles.core.ledger import Ledger, LedgerError
from miles.core.schedules import staleness
from miles.types import Sample, Status

PROBE = textwrap.dedent('''
    TRAINED = []  # per step: [(group_id, [token versions of each sample])]

    class Probe:
        def after_rollout(self, ctx, groups):
            TRAINED.append([(g[0].group_id, [list(s.token_versions) for s in g]) for g in groups])
''')


def _sample(group_id: int, versions: list[int]) -> Sample:
    return Sample(group_id=group_id, index=0, prompt_ids=[1], response_ids=[5] * len(versions),
                  rollout_logprobs=[-1.0] * len(versions), loss_mask=[1] * len(versions), status=Status.COMPLETED,
                  weight_version=max(versions, default=0), token_versions=versions)


def test_ledger_refuses_a_prompt_drawn_or_settled_twice_and_names_lost_ones() -> None:
    ledger = Ledger()
    ledger.draw([0, 1, 2])
    with pytest.raises(LedgerError, match="group 1 drawn twice"):
        ledger.draw([1])
    ledger.settle(0, "trained")
    with pytest.raises(LedgerError, match="settled twice: trained, then stale"):
        ledger.settle(0, "stale")
    with pytest.raises(LedgerError, match="never drawn"):
        ledger.settle(7, "trained")
    ledger.settle_batch([[_sample(2, [0])]])
    with pytest.raises(LedgerError, match=r"never trained nor accounted for: groups \[1\]"):
        ledger.check_closed()
    ledger.settle(1, "stale")
    ledger.check_closed()
    assert ledger.counts() == {"drawn": 3, "trained": 2, "failed": 0, "filtered": 0, "surplus": 0, "stale": 1,
                               "unused": 0, "open": 0}


def test_ledger_state_round_trips_into_a_fresh_ledger_only() -> None:
    ledger = Ledger()
    ledger.draw([0, 1, 2, 3])
    ledger.settle(0, "trained")
    ledger.settle(2, "stale")
    state = ledger.state()
    assert state["trained"] == [0] and state["stale"] == [2] and state["open"] == [1, 3]
    again = Ledger()
    again.restore(json.loads(json.dumps(state)))  # as a checkpoint's loop_state.json holds it
    assert again.counts() == ledger.counts() and again.open() == [1, 3]
    again.settle(1, "trained")  # an open group is still settled once, by the resumed run
    with pytest.raises(LedgerError, match="group 2 settled twice"):
        again.settle(2, "trained")
    with pytest.raises(LedgerError, match="group 0 drawn twice"):
        again.draw([0])
    with pytest.raises(LedgerError, match="has drawn 4 group"):
        again.restore(state)


def test_open_prompts_come_back_from_the_sampler_state_of_the_oldest(tmp_path: Path) -> None:
    """A stream draws one prompt per group id in order; replaying from the state before the oldest open
    one gives back exactly the open prompts, and a replay that does not end at the checkpoint's state
    (another task) is refused."""
    import random

    from miles.config.checkpoints import LoopState
    from miles.core.schedules import reopen
    from miles.tasks.largest import LargestNumberTask

    task, rng = LargestNumberTask(), random.Random(5)
    drawn = []
    for _ in range(7):  # groups 0..6; 2, 3 and 5 are still open at the checkpoint
        drawn.append((rng.getstate(), task.sample(1, rng)[0]))
    state = LoopState(step=3, rng_state=rng.getstate(), next_group_id=7, config={}, path=tmp_path,
                      stream={"open": [2, 3, 5], "first_open": 2, "rng_state": drawn[2][0]})
    back = reopen(task, state)
    assert [(g, p) for g, p, _ in back] == [(g, drawn[g][1]) for g in (2, 3, 5)]
    assert [st for _, _, st in back] == [drawn[g][0] for g in (2, 3, 5)]
    with pytest.raises(RuntimeError, match="did not end at the checkpoint's sampler state"):
        reopen(LargestNumberTask(list_len=3), state)
    assert reopen(task, LoopState(step=3, rng_state=rng.getstate(), next_group_id=7, config={}, path=tmp_path)) == []


def test_staleness_is_counted_from_the_oldest_token_of_a_partial_rollout() -> None:
    group = [_sample(0, [3, 3, 4, 5]), _sample(0, [5, 5])]
    assert staleness(group, 5) == 2 and staleness(group, 3) == 0
    assert staleness([_sample(0, [])], 9) == 0  # no tokens (a failed sample): nothing to be stale


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("schedule_probe")
    (d / "schedule_probe.py").write_text(PROBE)
    sys.path.insert(0, str(d))
    import schedule_probe

    yield schedule_probe
    sys.path.remove(str(d))


SHORT = {"seed": 1, "tracking": {"backend": "none"}, "trainer": {"num_steps": 4, "eval_every": 0},
         "algo": {"num_prompts_per_step": 8, "num_samples_per_prompt": 4}, "task": {"num_eval_prompts": 16}}

SGLANG = {"rollout": {"engine": {"_target_": "miles.rollout.sglang_engine.SGLangEngine", "max_total_tokens": 8192}},
          "cluster": {"reuse_actors": True}}
"""The config sections of an SGLang run (the parked actor and its server serve the next job)."""

SGLANG_ACTORS = pytest.mark.actors("sglang-disaggregated")
"""The SGLang jobs, disaggregated: one engine side, so one server serves them all (the megatron jobs
keep the engine and start their own trainer ranks)."""

ENGINES = [pytest.param("torch"), pytest.param("sglang", marks=[pytest.mark.sglang, SGLANG_ACTORS])]

SCHEDULES = [
    ("sync", {"algo": {"dynamic_sampling": True}}),
    ("one_step_off", {}),
    ("fully_async", {"algo": {"dynamic_sampling": True}, "schedule": {"max_staleness": 1, "buffer_batches": 2}}),
]


MEGATRON = {"trainer": {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False}}
"""The config section of a run on the megatron trainer (``trainer=megatron``)."""


DRAFT_ONLINE = {"draft": {"model": {"_target_": "miles.models.qwen3.qwen3_spec", "flavor": "tiny", "path": None},
                          "online": True, "k": 2}}
"""Speculative rollout with the draft trained online: the torch engine's async runs have it (under fully_async,
weights and draft are pushed while rows are in flight)."""

DRAFT_HEADS_ONLINE = {"draft": {"heads": True, "online": True, "k": 2}}
"""The policy's own draft heads, trained online: the megatron trainer's async runs have them (the draft trains in
an actor of its own, beside either trainer)."""


@pytest.mark.parametrize("engine,schedule,extra", [
    *(pytest.param("torch", schedule, extra | (DRAFT_ONLINE if schedule != "sync" else {}),
                   id=f"torch-{schedule}") for schedule, extra in SCHEDULES),
    *(pytest.param("sglang", schedule, extra, id=f"sglang-{schedule}", marks=[pytest.mark.sglang, SGLANG_ACTORS])
      for schedule, extra in SCHEDULES),
    # the product stack: the megatron trainer under both async schedules, on either engine (the jobs of
    # one engine share its actors: the second costs a few seconds)
    *(pytest.param("torch+megatron", schedule, extra | DRAFT_HEADS_ONLINE, id=f"torch-megatron-{schedule}",
                   marks=pytest.mark.megatron) for schedule, extra in SCHEDULES[1:]),
    *(pytest.param("sglang+megatron", schedule, extra, id=f"sglang-megatron-{schedule}",
                   marks=[pytest.mark.megatron, pytest.mark.sglang, SGLANG_ACTORS])
      for schedule, extra in SCHEDULES[1:]),
])
def test_every_prompt_is_trained_once_or_accounted_for_within_the_staleness_bound(
        ray_cluster, probe, engine: str, schedule: str, extra: dict) -> None:
    """Every drawn prompt is trained once or settled (ledger); no trained sample is older than
    ``max_staleness``; the decoupled PPO metrics (staleness, partial rollouts, behaviour IS clip,
    behaviour-vs-proximal mismatch) are those of the samples trained."""
    from miles.core.run import run_job

    engine, _, trainer = engine.partition("+")
    if trainer:
        pytest.importorskip("megatron.core")

    probe.TRAINED.clear()
    cfg = json.loads(json.dumps(SHORT))
    cfg["algo"] |= extra.get("algo", {})
    cfg |= {k: v for k, v in extra.items() if k == "draft"}
    cfg["schedule"] = {"name": schedule, **({"max_staleness": 1} if schedule != "sync" else {}),
                       **extra.get("schedule", {})}
    cfg |= {"hooks": [{"_target_": "schedule_probe.Probe"}], "plugins": {"allow": ["schedule_probe."]}}
    if schedule != "sync" or engine == "sglang":  # SGLang: every schedule on one placement shares a server
        cfg["placement"] = {"name": "disaggregated"}
    if engine == "sglang":
        cfg |= SGLANG
    if trainer == "megatron":
        cfg["trainer"] |= MEGATRON["trainer"]
    run = validate(cfg)
    seen: dict[int, dict] = {}
    final = run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.__setitem__(s, dict(m)))

    steps, per_step = run.trainer.num_steps, run.algo.num_prompts_per_step
    trained = [gid for batch in probe.TRAINED for gid, _ in batch]
    assert len(probe.TRAINED) == steps and len(trained) == steps * per_step
    assert len(set(trained)) == len(trained)  # no prompt trained twice
    counts = {k.removeprefix("ledger/"): int(v) for k, v in final.items() if k.startswith("ledger/")}
    outcomes = counts["trained"] + counts["failed"] + counts["filtered"] + counts["surplus"] + counts["stale"] \
        + counts["unused"]
    assert counts["open"] == 0 and outcomes == counts["drawn"]  # none lost
    # the batches hold trained (or, padded under sync, filtered) groups; ids are drawn contiguously
    assert max(trained) < counts["drawn"]
    assert counts["trained"] + counts["failed"] + (counts["filtered"] if schedule == "sync" else 0) >= len(trained)
    if schedule == "sync":
        assert counts["stale"] == counts["unused"] == 0
    else:
        assert counts["unused"] == final["ledger/unused_at_end"] and counts["filtered"] + counts["trained"] > 0
    bound = run.schedule.max_staleness
    for step, batch in enumerate(probe.TRAINED, start=1):
        version = step - 1  # the trainer's weights when it takes the batch
        versions = [v for _, group in batch for v in group if v]
        ages = [version - min(v) for v in versions]
        assert max(ages) <= bound, (step, ages)  # no trained sample older than max_staleness
        assert all(v == sorted(v) and max(v) <= version for v in versions), step  # each token's version, in order
        if schedule == "sync":
            assert max(ages) == 0 and all(len(set(v)) == 1 for v in versions)
            continue
        m = seen[step]
        assert m["train/staleness_max"] == max(ages) and m["train/staleness_mean"] == pytest.approx(
            sum(ages) / len(ages))
        assert m["train/partial_rollout_frac"] == pytest.approx(
            sum(len(set(v)) > 1 for v in versions) / len(versions))
        assert 0 <= m["train/tis_clip_frac"] <= 1 and m["train/logp_mismatch_abs_mean"] >= 0  # decoupled PPO
        if max(ages) == 0:  # every sample on the trainer's weights: behaviour = proximal policy
            assert m["train/logp_mismatch_abs_mean"] < 1e-3
    for step in range(1, steps + 1):  # the engines' own counters: generating for part of every step
        assert 0 < seen[step]["perf/engine_busy_frac"] <= 1, (step, seen[step]["perf/engine_busy_frac"])
        if schedule == "sync":  # the engine generates only in the rollout phase
            assert seen[step]["perf/engine_busy_s"] <= seen[step]["perf/rollout_s"] + 0.05, step
    if schedule == "one_step_off":  # every batch after the first was generated while the step before trained
        one_old = [seen[s]["train/staleness_max"] == 1 for s in range(2, steps + 1)]
        # SGLang admits a row over HTTP: under load the push after a short train step can land before a
        # batch has its first token, and a row interrupted then continues wholly on the new weights
        assert all(one_old) if engine == "torch" else any(one_old), one_old
    if "draft" in extra:  # draft.online under an async schedule: trained every step, pushed, proposing
        for step in range(1, steps + 1):
            assert seen[step]["draft/steps"] == step and seen[step]["draft/tokens"] > 0, step
            assert 0 < seen[step]["rollout/spec_accept_rate"] <= 1, step
    if schedule == "fully_async" and counts["filtered"]:
        assert all(seen[s]["train/reward_std"] > 0 for s in range(1, steps + 1))  # DAPO: no all-equal groups


GOLDEN = Path(__file__).parent / "data" / "sync_before_schedules.json"


PER_TOKEN_MEANS = ("train/entropy", "train/clip_frac_low", "train/clip_frac_high", "train/logp_mismatch_abs_mean")
"""Metrics that are means over the samples the train step computes: with ``trainer.skip_zero_advantage``
they leave out the samples with no advantage."""


@pytest.mark.parametrize("skip", [False, True], ids=["every_sample", "skip_zero_advantage"])
def test_sync_schedule_computes_what_the_loop_did_before_schedules(ray_cluster, skip: bool) -> None:
    """The metrics of a short seeded run (timings left out), recorded with the loop as it was before
    ``schedule=`` existed (commit 64a08b6): every train, rollout and eval metric is the same (the
    engine-vs-trainer log-prob mismatch to within its fp32 rounding). With the samples of no advantage
    left out of the passes (``skip``) the update is the same, so every metric but the per-token means is.

    Float results depend on the CPU's kernels, so the recording is per torch CPU capability (the file
    says which commit recorded each); a machine of another capability has nothing to compare with."""
    from miles.core.run import run_job

    capability = torch.backends.cpu.get_cpu_capability()
    recorded = json.loads(GOLDEN.read_text())
    if capability not in recorded:
        pytest.skip(f"no recording for CPU capability {capability} in {GOLDEN.name} "
                    f"(recorded: {', '.join(k for k in recorded if not k.startswith('_'))})")
    seen: dict[str, dict] = {}
    trainer = {"num_steps": 3, "eval_every": 0, "skip_zero_advantage": skip}
    run_job(validate(SHORT | {"trainer": trainer}), resolved_yaml="", overrides=[],
            on_metrics=lambda m, s: seen.__setitem__(str(s), dict(m)))
    before = recorded[capability]
    assert sorted(before) == sorted(seen)
    if skip:  # the run has groups of equal rewards: the path under test ran
        assert sum(seen[s]["train/skipped_samples"] for s in ("1", "2", "3")) > 0
    for step, metrics in before.items():
        for k, v in metrics.items():
            if skip and k in PER_TOKEN_MEANS:
                continue
            # the engine-vs-trainer log-prob mismatch is fp32 rounding (~1e-7) and follows the engine's
            # decode kernels (joined projections round differently): equal to within that rounding
            # (with skip: the first step's loss is 0 in exact arithmetic, at ratio 1 the advantages of a group
            # sum to 0, and fewer samples sum to another rounding residue, recorded -1.2e-9)
            tolerance = {"abs": 1e-7} if "logp_mismatch" in k else {"rel": 1e-6, "abs": 1e-8 if skip else 1e-9}
            assert seen[step][k] == pytest.approx(v, **tolerance), (step, k)


def _async_job(schedule: str, extra: dict) -> dict:
    """SHORT under an async schedule, disaggregated, with the probe hook; ``extra`` merged per section
    (its keys win)."""
    cfg = json.loads(json.dumps(SHORT)) | {"schedule": {"name": schedule, "max_staleness": 1},
                                           "placement": {"name": "disaggregated"},
                                           "cluster": {"reuse_actors": False},
                                           "hooks": [{"_target_": "schedule_probe.Probe"}],
                                           "plugins": {"allow": ["schedule_probe.", "plugin_backends."]}}
    for key, value in extra.items():
        cfg[key] = (cfg.get(key) or {}) | value
    return cfg


def _dies(engines: list[int], num_engines: int) -> dict:
    return {"rollout": {"engine": {"_target_": "plugin_backends.DiesAtVersion", "die_at_version": 2,
                                   "die_engines": engines}},
            "placement": {"name": "disaggregated", "num_engines": num_engines, "cpus_per_engine": 0.5,
                          "cpus_per_trainer_rank": 0.5}}  # fits a 2-CPU machine


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
def test_engine_dying_mid_rollout_loses_no_prompt(ray_cluster, probe, plugin_engines, schedule: str,
                                                   tmp_path: Path) -> None:
    """Engine 0 of 2 dies (its process exits inside a generate call) once it has the weights of step 2:
    its requests go to engine 1, a weight push replaces it while the stream goes on, the run finishes,
    and the ledger accounts for every prompt drawn."""
    from miles.core.run import run_job

    probe.TRAINED.clear()
    dies = _dies([0], num_engines=2)
    dies["rollout"]["engine"]["once_marker"] = str(tmp_path / "died")
    run = validate(_async_job(schedule, dies))
    seen: dict[int, dict] = {}
    final = run_job(run, resolved_yaml="", overrides=[], on_metrics=lambda m, s: seen.__setitem__(s, dict(m)))

    trained = [gid for batch in probe.TRAINED for gid, _ in batch]
    assert len(probe.TRAINED) == run.trainer.num_steps and len(set(trained)) == len(trained) == 4 * 8
    assert (tmp_path / "died").exists() and seen[1]["rollout/engines_alive"] == 2
    assert final["fault/engine_restarts"] == 1
    counts = {k.removeprefix("ledger/"): int(v) for k, v in final.items() if k.startswith("ledger/")}
    settled = sum(counts[o] for o in ("trained", "failed", "filtered", "surplus", "stale", "unused"))
    assert counts["open"] == 0 and settled == counts["drawn"] and counts["trained"] + counts["failed"] >= 32


@pytest.mark.faults
def test_every_engine_dead_is_replaced_and_the_stream_goes_on(ray_cluster, probe, plugin_engines,
                                                             tmp_path: Path) -> None:
    """The only engine dies once it has the weights of step 2, with groups in flight and finished ones
    waiting: a replacement gets the trainer's weights, the groups the death ended are generated again
    under their ids, the finished ones are kept, and every prompt is trained once; none fails."""
    from miles.core.run import run_job

    probe.TRAINED.clear()
    dies = _dies([0], num_engines=1)
    dies["rollout"]["engine"]["once_marker"] = str(tmp_path / "died")
    run = validate(_async_job("fully_async", dies | {"schedule": {"buffer_batches": 2}}))
    final = run_job(run, resolved_yaml="", overrides=[])

    trained = [gid for batch in probe.TRAINED for gid, _ in batch]
    assert (tmp_path / "died").exists() and final["fault/engine_restarts"] == 1
    assert len(probe.TRAINED) == run.trainer.num_steps and len(set(trained)) == len(trained) == 4 * 8
    counts = {k.removeprefix("ledger/"): int(v) for k, v in final.items() if k.startswith("ledger/")}
    assert counts["open"] == 0 and counts["failed"] == 0
    assert counts["drawn"] == sum(counts[o] for o in ("trained", "failed", "filtered", "surplus", "stale", "unused"))


def test_every_engine_dead_fails_the_run_with_the_ledger_accounting(ray_cluster, probe, plugin_engines) -> None:
    """The only engine dies and no replacement is left (rollout.max_engine_restarts=0): the run raises, and
    its error's notes account for every prompt drawn."""
    import re

    from miles.core.run import run_job

    probe.TRAINED.clear()
    dies = _dies([0], num_engines=1)
    dies["rollout"]["max_engine_restarts"] = 0
    run = validate(_async_job("fully_async", dies | {"schedule": {"buffer_batches": 2}}))
    with pytest.raises(Exception, match="rollout engine") as failure:
        run_job(run, resolved_yaml="", overrides=[])
    note = next(n for n in getattr(failure.value, "__notes__", []) if n.startswith("sample ledger"))
    m = re.search(r"(\d+) prompt\(s\) drawn = (\d+) trained \+ (\d+) failed \+ (\d+) filtered \+ (\d+) surplus "
                  r"\+ (\d+) stale \+ (\d+) unused, (\d+) not accounted for", note)
    assert m, note
    drawn, trained, failed, filtered, surplus, stale, unused, lost = map(int, m.groups())
    assert lost == 0 and trained + failed + filtered + surplus + stale + unused == drawn
    assert trained == len([gid for batch in probe.TRAINED for gid, _ in batch]) >= 8  # steps 1-2 trained
    assert failed + unused > 0  # the groups the dead engine held


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
@pytest.mark.parametrize("engine", ENGINES)  # the engine varies slowest: its jobs run one after another
def test_async_run_resumed_mid_stream_trains_every_prompt_once(ray_cluster, probe, tmp_path: Path,
                                                               schedule: str, engine: str) -> None:
    """A 4-step run checkpoints at step 2 with prompts still in flight; the run resumed from there
    generates those again and, with the first run's steps 1-2, trains every drawn prompt exactly once."""
    from miles.config import checkpoints
    from miles.core.run import run_job

    def job(trainer: dict) -> list[list[int]]:
        probe.TRAINED.clear()
        run = validate(_async_job(schedule, {"trainer": trainer, **(SGLANG if engine == "sglang" else {})}))
        run_job(run, resolved_yaml="", overrides=[])
        return [[gid for gid, _ in batch] for batch in probe.TRAINED]

    first = job({"save_every": 2, "save_dir": str(tmp_path / "a")})
    ckpt = checkpoints.load(checkpoints.step_dir(tmp_path / "a", 2))
    assert ckpt.stream is not None and ckpt.stream["open"] == ckpt.ledger["open"] != []  # prompts in flight
    resumed = job({"save_every": 2, "save_dir": str(tmp_path / "b"), "resume_from": str(ckpt.path)})
    assert len(resumed) == 2  # steps 3 and 4

    end = checkpoints.load(checkpoints.step_dir(tmp_path / "b", 4))
    ledger = end.ledger
    ids = [g for ids in ledger.values() for g in ids]
    assert ledger["open"] == [] and sorted(ids) == list(range(end.next_group_id))  # each drawn id settled once
    trained = first[0] + first[1] + resumed[0] + resumed[1]
    assert len(trained) == len(set(trained)) == 4 * 8  # none trained twice across the two parts
    assert sorted(trained) == sorted(ledger["trained"] + ledger["failed"])
    for outcome, settled in ckpt.ledger.items():  # what the checkpoint had settled stays settled so
        if outcome != "open":
            assert set(settled) <= set(ledger[outcome]), outcome
    assert set(ckpt.stream["open"]) <= set(ids) - set(ckpt.ledger["trained"])
