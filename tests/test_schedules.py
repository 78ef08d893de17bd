"""Schedules (sync, one_step_off, fully_async): the sample ledger is exact, the staleness bound holds,
and ``sync`` computes what it computed before the schedules existed."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("schedule,extra", [
    ("sync", {"algo": {"dynamic_sampling": True}}),
    ("one_step_off", {}),
    ("fully_async", {"algo": {"dynamic_sampling": True}, "schedule": {"max_staleness": 1, "buffer_batches": 2}}),
])
def test_every_prompt_is_trained_once_or_accounted_for_within_the_staleness_bound(
        ray_cluster, probe, schedule: str, extra: dict) -> None:
    from miles.core.run import run_job

    probe.TRAINED.clear()
    cfg = json.loads(json.dumps(SHORT))
    cfg["algo"] |= extra.get("algo", {})
    cfg["schedule"] = {"name": schedule, **({"max_staleness": 1} if schedule != "sync" else {}),
                       **extra.get("schedule", {})}
    cfg |= {"hooks": [{"_target_": "schedule_probe.Probe"}], "plugins": {"allow": ["schedule_probe."]}}
    if schedule != "sync":
        cfg["placement"] = {"name": "disaggregated"}
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
        ages = [version - min(v) for _, group in batch for v in group if v]
        assert max(ages) <= bound, (step, ages)  # no trained sample older than max_staleness
        assert seen[step]["train/staleness_max"] == max(ages) if schedule != "sync" else max(ages) == 0
    for step in range(1, steps + 1):  # the engines' own counters: generating for part of every step
        assert 0 < seen[step]["perf/engine_busy_frac"] <= 1, (step, seen[step]["perf/engine_busy_frac"])
        if schedule == "sync":  # the engine generates only in the rollout phase
            assert seen[step]["perf/engine_busy_s"] <= seen[step]["perf/rollout_s"] + 0.05, step
    if schedule == "one_step_off":  # every batch after the first was generated while the step before trained
        assert all(seen[s]["train/staleness_max"] == 1 for s in range(2, steps + 1))
    if schedule == "fully_async" and counts["filtered"]:
        assert all(seen[s]["train/reward_std"] > 0 for s in range(1, steps + 1))  # DAPO: no all-equal groups


GOLDEN = Path(__file__).parent / "data" / "sync_before_schedules.json"


def test_sync_schedule_computes_what_the_loop_did_before_schedules(ray_cluster) -> None:
    """The metrics of a short seeded run (timings left out), recorded with the loop as it was before
    ``schedule=`` existed (commit 64a08b6): every train, rollout and eval metric is the same."""
    from miles.core.run import run_job

    seen: dict[str, dict] = {}
    run_job(validate(SHORT | {"trainer": {"num_steps": 3, "eval_every": 0}}), resolved_yaml="", overrides=[],
            on_metrics=lambda m, s: seen.__setitem__(str(s), dict(m)))
    before = json.loads(GOLDEN.read_text())
    assert sorted(before) == sorted(seen)
    for step, metrics in before.items():
        for k, v in metrics.items():
            assert seen[step][k] == pytest.approx(v, rel=1e-6, abs=1e-9), (step, k)
