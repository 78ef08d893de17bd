"""Hook chains: the start-up contract check, the chain, the shipped hooks, task difficulty, and real runs."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import sys
import textwrap
from pathlib import Path

import pytest

from miles.config import ConfigError, checkpoints, validate
from miles.hooks import (
    POINTS,
    Curriculum,
    EarlyStop,
    HookChain,
    HookError,
    RewardHackingMonitor,
    build_hooks,
)
from miles.tasks.arithmetic import ArithmeticTask
from miles.tasks.count import CountTask
from miles.tasks.largest import LargestNumberTask

PLUGINS = textwrap.dedent('''
    """Hooks for tests/test_hooks.py: a recorder of every call, and broken hooks for the contract check."""
    from pathlib import Path

    from miles.types import Sample

    CALLS = []  # (hook name, point, step, what it saw), every call of every hook here, in order


    class Recorder:
        def __init__(self, *, name="recorder"):
            self.name = name

        def _rec(self, ctx, point, **seen):
            CALLS.append((self.name, point, ctx.step, seen))

        def on_run_start(self, ctx):
            self._rec(ctx, "on_run_start", config=type(ctx.config).__name__)

        def after_rollout(self, ctx, groups):
            self._rec(ctx, "after_rollout", sizes=[len(g) for g in groups],
                      samples=all(isinstance(s, Sample) for g in groups for s in g),
                      rewards={s.reward for g in groups for s in g} <= {0.0, 1.0}, difficulty=ctx.task.difficulty())

        def after_reward(self, ctx, groups):
            self._rec(ctx, "after_reward", sizes=[len(g) for g in groups])

        def before_train(self, ctx, batch):
            self._rec(ctx, "before_train", type=type(batch).__name__, len=len(batch),
                      advantages=len(batch.advantages))

        def after_train(self, ctx, metrics):
            try:
                metrics["x"] = 1.0
                read_only = False
            except TypeError:
                read_only = True
            self._rec(ctx, "after_train", loss="train/loss" in metrics, reward=metrics["train/reward_mean"],
                      eval=any(k.startswith("eval/") for k in metrics), read_only=read_only)
            ctx.add_metrics({"calls": float(len(CALLS))})

        def after_weight_sync(self, ctx, version):
            self._rec(ctx, "after_weight_sync", version=version)

        def after_eval(self, ctx, metrics):
            self._rec(ctx, "after_eval", only_eval=all(k.startswith("eval/") for k in metrics),
                      accuracy=metrics["eval/accuracy"])

        def on_checkpoint(self, ctx, path):
            self._rec(ctx, "on_checkpoint", path=path, exists=Path(path).is_dir())

        def on_run_end(self, ctx, metrics, status):
            self._rec(ctx, "on_run_end", status=status, wall="perf/wall_time_s" in metrics,
                      stop_reason=ctx.stop_reason)


    class RewardOverride:
        """Sets every trainable sample's reward (what after_reward may change)."""

        def __init__(self, *, value):
            self.value = value

        def after_reward(self, ctx, groups):
            CALLS.append(("reward_override", "after_reward", ctx.step, {}))
            for g in groups:
                for s in g:
                    if s.trainable:
                        s.reward = self.value


    class AdvantageOverride:
        """Sets every advantage of the batch (what before_train may change)."""

        def __init__(self, *, value):
            self.value = value

        def before_train(self, ctx, batch):
            batch.advantages = [self.value] * len(batch)


    class Raiser:
        def after_train(self, ctx, metrics):
            raise ValueError(f"boom at step {ctx.step}")


    class Misspelled:
        def after_train(self, ctx, metrics):
            pass

        def after_trian(self, ctx, metrics):
            pass


    class RunEnd:
        def run_end(self, ctx, metrics, status):
            pass


    class TooFewArgs:
        def after_train(self, ctx):
            pass


    class ExtraArg:
        def after_eval(self, ctx, metrics, threshold):
            pass


    class Async:
        async def after_eval(self, ctx, metrics):
            pass


    class NoPoints:
        def helper(self):
            pass
''')


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory):
    """The module ``hook_plugins`` (above) importable, and a second one that no test may import."""
    d = tmp_path_factory.mktemp("hook_plugins")
    (d / "hook_plugins.py").write_text(PLUGINS)
    (d / "never_imported_hooks.py").write_text("class Hook:\n    def after_train(self, ctx, metrics):\n        pass\n")
    sys.path.insert(0, str(d))
    import hook_plugins

    yield hook_plugins
    sys.path.remove(str(d))


def _hooks(*entries: dict, allow: tuple[str, ...] = ("hook_plugins.",), task=None):
    run = validate({"hooks": list(entries), "plugins": {"allow": list(allow)}})
    return build_hooks(run, task or LargestNumberTask()), run


def _chain(*hooks: object, task=None) -> HookChain:
    """A chain over already built hook objects (as build_hooks makes them), for driving points by hand."""
    from miles.hooks import HookSpec
    from miles.hooks.protocols import check_hook, hook_name

    config, task = validate({}), task or LargestNumberTask()
    specs = [HookSpec(key=f"hooks[{i}]", target=type(h).__name__, hook=h, name=hook_name(h),
                      points=check_hook(h, key=f"hooks[{i}]", target=type(h).__name__, config=config, task=task))
             for i, h in enumerate(hooks)]
    return HookChain(specs, config=config, task=task)


# ---- the start-up contract check ------------------------------------------------------------------


def test_shipped_hooks_pass_the_check_and_implement_their_points() -> None:
    specs, run = _hooks({"_target_": "miles.hooks.EarlyStop", "target": 0.7},
                      {"_target_": "miles.hooks.Curriculum", "levels": [{"list_len": 6}]},
                      {"_target_": "miles.hooks.RewardHackingMonitor", "_optional_": True})
    assert [(s.key, s.name, s.points, s.optional) for s in specs] == [
        ("hooks[0]", "early_stop", ("after_train", "after_eval"), False),
        ("hooks[1]", "curriculum", ("on_run_start", "after_train"), False),
        ("hooks[2]", "reward_hacking", ("after_train", "after_eval"), True),
    ]
    from miles.config.schema import to_yaml_dict

    assert validate(to_yaml_dict(dataclasses.asdict(run))) == run  # _optional_ and nested levels round-trip
    assert list(POINTS) == ["on_run_start", "after_rollout", "after_reward", "before_train", "after_train",
                            "after_weight_sync", "after_eval", "on_checkpoint", "on_run_end"]


@pytest.mark.parametrize(("cls", "message"), [
    ("Misspelled", r"hooks\[1\]._target_: hook_plugins.Misspelled.after_trian is not a hook point "
                   r"\(did you mean 'after_train'\?\)"),
    ("RunEnd", r"hooks\[1\]._target_: hook_plugins.RunEnd.run_end is not a hook point "
               r"\(did you mean 'on_run_end'\?\)"),
    ("TooFewArgs", r"hooks\[1\]._target_: hook_plugins.TooFewArgs.after_train\(ctx\) cannot be called as "
                   r"after_train\(ctx, metrics\).*too many positional arguments"),
    ("ExtraArg", r"hooks\[1\]._target_: hook_plugins.ExtraArg.after_eval\(ctx, metrics, threshold\) cannot be "
                 r"called as after_eval\(ctx, metrics\).*missing a required argument: 'threshold'"),
    ("Async", r"hooks\[1\]._target_: hook_plugins.Async.after_eval is 'async def'"),
    ("NoPoints", r"hooks\[1\]._target_: hook_plugins.NoPoints built a NoPoints that implements none of the "
                 r"hook points"),
])
def test_broken_hooks_are_refused_naming_the_entry(plugins, cls: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _hooks({"_target_": "hook_plugins.Recorder"}, {"_target_": f"hook_plugins.{cls}"})


def test_a_hook_outside_the_allowlist_is_refused_before_its_module_is_imported(plugins) -> None:
    with pytest.raises(ConfigError, match=r"hooks\[0\]._target_: 'never_imported_hooks.Hook' is not allowed.*"
                                          r"plugins.allow"):
        _hooks({"_target_": "never_imported_hooks.Hook"})
    assert "never_imported_hooks" not in sys.modules
    with pytest.raises(ConfigError, match=r"hooks\[0\]._target_: 'os.system' is not allowed"):
        _hooks({"_target_": "os.system"})


def test_entry_mistakes_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"hooks\[0\].targt: 'miles.hooks.EarlyStop' takes no argument 'targt' "
                                          r"\(did you mean 'target'\?\)"):
        _hooks({"_target_": "miles.hooks.EarlyStop", "targt": 0.7})
    with pytest.raises(ConfigError, match=r"hooks\[0\]: miles.hooks.EarlyStop refused its arguments: .*mode: "
                                          r"expected 'max'"):
        _hooks({"_target_": "miles.hooks.EarlyStop", "target": 0.7, "mode": "maximum"})
    with pytest.raises(ConfigError, match=r"hooks\[0\]._optional_: expected true or false, found 'yes'"):
        validate({"hooks": [{"_target_": "miles.hooks.EarlyStop", "target": 0.7, "_optional_": "yes"}]})
    with pytest.raises(ConfigError, match=r"hooks\[0\]._partial_: a hook is an object"):
        validate({"hooks": [{"_target_": "miles.hooks.EarlyStop", "_partial_": True}]})
    with pytest.raises(ConfigError, match=r"hooks\[1\]: its metrics would go to hooks/early_stop/, as those of "
                                          r"hooks\[0\]"):
        _hooks({"_target_": "miles.hooks.EarlyStop", "target": 0.7},
               {"_target_": "miles.hooks.EarlyStop", "target": 0.2, "metric": "train/reward_mean"})
    specs, _ = _hooks({"_target_": "miles.hooks.EarlyStop", "target": 0.7},
                      {"_target_": "miles.hooks.EarlyStop", "target": 0.2, "name": "reward_stop"})
    assert [s.name for s in specs] == ["early_stop", "reward_stop"]


def test_curriculum_levels_are_checked_against_the_task_at_start_up() -> None:
    with pytest.raises(ConfigError, match=r"hooks\[0\]: miles.hooks.Curriculum: levels\[1\].list_lem: not a "
                                          r"difficulty knob of LargestNumberTask \(did you mean 'list_len'\?\)"):
        _hooks({"_target_": "miles.hooks.Curriculum", "levels": [{"list_len": 6}, {"list_lem": 8}]})
    with pytest.raises(ConfigError, match=r"levels\[0\].list_len: must be at least 2, found 1"):
        _hooks({"_target_": "miles.hooks.Curriculum", "levels": [{"list_len": 1}]})
    with pytest.raises(ConfigError, match=r"levels\[0\].list_len: not a difficulty knob of ArithmeticTask"):
        _hooks({"_target_": "miles.hooks.Curriculum", "levels": [{"list_len": 6}]}, task=ArithmeticTask())
    from miles.tasks.dataset import DatasetTask

    jsonl = DatasetTask(path=str(Path(__file__).parents[1] / "examples/data/fractions.jsonl"))
    with pytest.raises(ConfigError, match=r"hooks\[0\]: miles.hooks.Curriculum: the task DatasetTask has no "
                                          r"difficulty knobs"):
        _hooks({"_target_": "miles.hooks.Curriculum", "levels": [{"list_len": 6}]}, task=jsonl)


def test_build_components_checks_the_hooks(plugins) -> None:
    """The chain is built and checked with every other target, before Ray or a model starts."""
    from miles.core.run import build_components

    run = validate({"hooks": [{"_target_": "hook_plugins.Misspelled"}], "plugins": {"allow": ["hook_plugins."]}})
    with pytest.raises(ConfigError, match=r"hooks\[0\]._target_: hook_plugins.Misspelled.after_trian"):
        build_components(run)


def _documented_overrides() -> list[str]:
    """Every ``python -m miles 'hooks=[...]'`` line of the hooks' docstrings and of conf/config.yaml."""
    import miles.hooks as pkg

    text = "\n".join(p.read_text() for p in sorted(Path(pkg.__file__).parent.glob("*.py")))
    text += (Path(pkg.__file__).parents[1] / "conf" / "config.yaml").read_text()
    found = re.findall(r"'(hooks=\[.*?\])'", text)  # as written: a line break would not parse
    found += re.findall(r"#\s+(hooks=\[.*\])$", text, flags=re.M)
    return found


def test_documented_command_lines_compose_validate_and_build() -> None:
    """What the docs show on a command line works through Hydra's override parser."""
    from miles.bench.e2e import compose
    from miles.config.validate import check_overrides

    overrides = _documented_overrides()
    assert len(overrides) >= 6, overrides
    targets = set()
    for override in overrides:
        check_overrides([override])
        run, resolved = compose([override])
        assert run.hooks and "_target_: miles.hooks." in resolved
        specs = build_hooks(run, LargestNumberTask())
        targets |= {s.target for s in specs}
    assert targets == {"miles.hooks.EarlyStop", "miles.hooks.Curriculum", "miles.hooks.RewardHackingMonitor"}
    run, _ = compose(["hooks=[{_target_: miles.hooks.EarlyStop, target: 0.9, _optional_: true}]"])
    assert build_hooks(run, LargestNumberTask())[0].optional


def test_example_config_composes() -> None:
    from hydra import compose, initialize_config_dir

    examples = Path(__file__).parents[1] / "examples"
    with initialize_config_dir(config_dir=str(examples), version_base="1.3"):
        cfg = compose(config_name="hooks", overrides=["hooks.0.target=0.8"])  # as its header shows
    run = validate(cfg)
    specs = build_hooks(run, LargestNumberTask())
    assert [s.name for s in specs] == ["early_stop", "curriculum", "reward_hacking"]
    assert specs[0].hook.target == 0.8 and [s.optional for s in specs] == [False, False, True]


# ---- the chain -------------------------------------------------------------------------------------


class _Counter:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def after_train(self, ctx, metrics) -> None:
        self.log.append(self.name)
        ctx.add_metrics({"seen": metrics["train/reward_mean"]})


class _Fails:
    def after_train(self, ctx, metrics) -> None:
        raise KeyError("nope")


class _StopsAtCheckpoint:
    def on_checkpoint(self, ctx, path) -> None:
        ctx.request_stop("disk full")


def test_chain_calls_in_list_order_and_namespaces_metrics() -> None:
    order: list[str] = []
    chain = _chain(_Counter("b", order), _Counter("a", order))
    chain.after_train(4, {"train/reward_mean": 0.5})
    assert order == ["b", "a"] and chain.step == 4
    out = chain.pop_metrics()
    assert out["hooks/b/seen"] == out["hooks/a/seen"] == 0.5 and out["hooks/errors"] == 0
    assert set(out) == {"hooks/b/seen", "hooks/a/seen", "hooks/errors", "hooks/time_s"}
    assert set(chain.pop_metrics()) == {"hooks/errors", "hooks/time_s"}  # popped
    assert HookChain().pop_metrics() == {}  # no hooks, no metrics


def test_a_raising_hook_is_named_unless_optional(caplog: pytest.LogCaptureFixture) -> None:
    chain = _chain(_Counter("a", []), _Fails())
    with pytest.raises(HookError, match=r"^hooks\[1\] _Fails.after_train raised KeyError: 'nope'$"):
        chain.after_train(2, {"train/reward_mean": 0.5})
    chain = HookChain([chain.specs[0], dataclasses.replace(chain.specs[1], optional=True)], config=validate({}))
    chain.after_train(2, {"train/reward_mean": 0.5})
    chain.after_train(3, {"train/reward_mean": 0.5})
    assert chain.errors == 2 and chain.pop_metrics()["hooks/errors"] == 2
    assert "hooks[1] _Fails.after_train raised KeyError" in caplog.text and "counted in hooks/errors" in caplog.text


def test_a_stop_cannot_be_asked_for_after_the_steps_evaluation() -> None:
    chain = _chain(_StopsAtCheckpoint())
    with pytest.raises(HookError, match="request_stop: not available at on_checkpoint"):
        chain.on_checkpoint(3, "/tmp/step_3")
    assert chain.stop_reason is None


def test_run_end_is_called_once_and_a_failed_run_only_logs_its_errors() -> None:
    class Ends:
        def __init__(self) -> None:
            self.seen: list[str] = []

        def on_run_end(self, ctx, metrics, status) -> None:
            self.seen.append(status)
            raise RuntimeError("cannot notify")

    hook = Ends()
    chain = _chain(hook)
    chain.on_run_end({}, "FAILED")  # the run already failed: logged, not raised
    chain.on_run_end({}, "FINISHED")
    assert hook.seen == ["FAILED"] and chain.errors == 1
    with pytest.raises(HookError, match=r"hooks\[0\] Ends.on_run_end raised RuntimeError: cannot notify"):
        _chain(Ends()).on_run_end({"eval/accuracy": 0.5}, "FINISHED")


# ---- early stop ------------------------------------------------------------------------------------


def test_early_stop_at_the_target_eval_accuracy(caplog: pytest.LogCaptureFixture) -> None:
    tags: list[dict] = []
    chain = _chain(EarlyStop(metric="eval/accuracy", target=0.7))
    chain._set_tags = tags.append
    chain.after_eval(0, {"eval/accuracy": 0.41})
    chain.after_train(1, {"train/reward_mean": 0.9})
    assert "metric 'eval/accuracy' is not among the metrics logged up to step 1" not in caplog.text
    chain.after_eval(2, {"eval/accuracy": 0.69})
    assert chain.stop_reason is None
    chain.after_eval(4, {"eval/accuracy": 0.72})
    assert chain.stop_reason == "hooks[0] EarlyStop: eval/accuracy 0.72 >= target 0.7 at step 4"
    assert tags == [{"miles.stopped_early": "true", "miles.stop_reason": chain.stop_reason,
                     "miles.stopped_at_step": "4"}]
    low = _chain(EarlyStop(metric="train/kl", target=0.01, mode="min"))
    low.after_train(1, {"train/kl": 0.05})
    low.after_train(2, {"train/kl": float("nan")})
    assert low.stop_reason is None
    low.after_train(3, {"train/kl": 0.008})
    assert low.stop_reason is not None and "train/kl 0.008 <= target 0.01 at step 3" in low.stop_reason


def test_early_stop_warns_of_a_metric_that_never_shows(caplog: pytest.LogCaptureFixture) -> None:
    chain = _chain(EarlyStop(metric="eval/acuracy", target=0.7))
    chain.after_eval(0, {"eval/accuracy": 0.4})
    chain.after_train(1, {"train/reward_mean": 0.5})
    assert "metric 'eval/acuracy' is not among the metrics logged up to step 1 (did you mean " \
           "'eval/accuracy'?)" in caplog.text


# ---- difficulty and the curriculum -----------------------------------------------------------------


def test_largest_difficulty_changes_what_is_sampled() -> None:
    task = LargestNumberTask(list_len=5, max_value=99)
    assert task.difficulty() == {"list_len": 5, "max_value": 99}
    task.set_difficulty(list_len=7)
    assert task.difficulty() == {"list_len": 7, "max_value": 99}
    nums = [[int(x) for x in p.prompt.removeprefix("Which is largest: ").rstrip("?").split()]
            for p in task.sample(200, random.Random(0))]
    assert {len(n) for n in nums} == {7} and max(max(n) for n in nums) <= 99
    task.set_difficulty(max_value=999)
    nums = [[int(x) for x in p.prompt.removeprefix("Which is largest: ").rstrip("?").split()]
            for p in task.sample(200, random.Random(0))]
    assert max(max(n) for n in nums) > 99
    held = {p.prompt for p in task.eval_problems(50)}
    assert held.isdisjoint(p.prompt for p in task.sample(2000, random.Random(1)))  # the split holds


def test_arithmetic_and_count_difficulty() -> None:
    task = ArithmeticTask(max_operand=30)
    assert task.difficulty() == {"max_operand": 30}
    task.set_difficulty(max_operand=300)
    ops = [int(x) for p in task.sample(300, random.Random(0)) for x in re.findall(r"\d+", p.prompt)]
    assert 99 < max(ops) <= 300 and min(ops) < 10  # 3-digit operands join, the easy ones stay
    count = CountTask(max_start=20, max_span=8)
    count.set_difficulty(max_span=30, max_start=500)
    spans = [len(p.label.split()) for p in count.sample(300, random.Random(0))]
    starts = [int(p.label.split()[0]) for p in count.sample(300, random.Random(0))]
    assert max(spans) > 8 and max(starts) > 20 and count.difficulty() == {"max_start": 500, "max_span": 30}


def test_a_refused_difficulty_changes_nothing() -> None:
    task = LargestNumberTask()
    with pytest.raises(ValueError, match=r"list_len: must be at least 2, found 1"):
        task.set_difficulty(list_len=1, max_value=500)
    with pytest.raises(ValueError, match=r"maxvalue: not a difficulty knob of LargestNumberTask \(did you mean "
                                         r"'max_value'\?\); its knobs: list_len, max_value"):
        task.set_difficulty(maxvalue=500)
    with pytest.raises(ValueError, match=r"max_value: expected an integer, found 1.5"):
        task.set_difficulty(max_value=1.5)
    assert task.difficulty() == {"list_len": 5, "max_value": 99}


def test_curriculum_raises_the_difficulty_after_patience_steps_above_the_threshold() -> None:
    task = LargestNumberTask(list_len=5)
    hook = Curriculum(levels=[{"list_len": 6}, {"list_len": 8, "max_value": 999}], threshold=0.8, patience=2)
    chain = _chain(hook, task=task)
    chain.on_run_start(0)
    assert chain.pop_metrics()["hooks/curriculum/level"] == 0
    levels = []
    for step, reward in enumerate([0.9, 0.5, 0.85, float("nan"), 0.9, 0.95, 0.8, 0.81, 0.99, 1.0, 1.0], 1):
        chain.after_train(step, {"train/reward_mean": reward})
        levels.append((hook.level, task.difficulty()["list_len"]))
    # a dip or a step without trainable samples (NaN) restarts the count; past the last level nothing changes
    assert levels == [(0, 5), (0, 5), (0, 5), (0, 5), (0, 5), (1, 6), (1, 6), (2, 8), (2, 8), (2, 8), (2, 8)]
    assert task.difficulty() == {"list_len": 8, "max_value": 999}
    m = chain.pop_metrics()
    assert (m["hooks/curriculum/level"], m["hooks/curriculum/list_len"], m["hooks/curriculum/max_value"]) == (2, 8, 999)
    assert {len(p.prompt.split()) - 3 for p in task.sample(50, random.Random(0))} == {8}


# ---- the reward-hacking monitor --------------------------------------------------------------------


def _drive(hook: RewardHackingMonitor, rewards: list[float], lengths: list[float],
           evals: dict[int, float] | None = None) -> tuple[HookChain, list[dict]]:
    chain, logged = _chain(hook), []
    chain.after_eval(0, {"eval/accuracy": (evals or {}).get(0, 0.5)})
    for step, (r, n) in enumerate(zip(rewards, lengths, strict=True), 1):
        chain.after_train(step, {"train/reward_mean": r, "rollout/response_len_mean": n})
        if evals and step in evals:
            chain.after_eval(step, {"eval/accuracy": evals[step]})
        logged.append(chain.pop_metrics())
    return chain, logged


def test_reward_hacking_fires_when_reward_rises_as_length_collapses(caplog: pytest.LogCaptureFixture) -> None:
    rewards = [0.30, 0.32, 0.31, 0.33, 0.45, 0.55, 0.60, 0.62]
    lengths = [6.0, 6.1, 5.9, 6.0, 3.0, 2.0, 1.5, 1.2]
    hook = RewardHackingMonitor(window=6, min_reward_rise=0.1, min_length_drop=0.3)
    chain, logged = _drive(hook, rewards, lengths)
    alarms = [m.get("hooks/reward_hacking/alarm") for m in logged]
    assert alarms[:5] == [None] * 5  # the window fills first
    assert alarms[5:] == [1.0, 1.0, 1.0] and hook.alarms == 3
    assert logged[-1]["hooks/reward_hacking/length_ratio"] < 0.7 and chain.stop_reason is None
    assert "possible reward hacking: train/reward_mean rose by" in caplog.text


def test_reward_hacking_stays_quiet_on_a_healthy_run() -> None:
    rewards = [0.30 + 0.05 * i for i in range(12)]  # rising reward
    lengths = [6.0, 5.8, 6.2, 5.5, 5.9, 5.4, 5.6, 5.2, 5.5, 5.3, 5.1, 5.4]  # lengths drift a little
    hook = RewardHackingMonitor(window=6, stop=True)
    chain, logged = _drive(hook, rewards, lengths, evals={4: 0.55, 8: 0.6, 12: 0.58})  # eval within noise
    assert hook.alarms == 0 and chain.stop_reason is None
    assert [m["hooks/reward_hacking/alarm"] for m in logged[5:]] == [0.0] * 7
    assert all(m["hooks/reward_hacking/reward_rise"] > 0.1 for m in logged[5:])  # the reward alone is no alarm


def test_reward_hacking_fires_on_a_falling_reference_and_can_stop_the_run() -> None:
    rewards = [0.30, 0.31, 0.32, 0.33, 0.50, 0.60, 0.65, 0.70]
    lengths = [6.0] * 8  # the length holds: only the reference shows it
    hook = RewardHackingMonitor(window=4, min_reward_rise=0.1, min_reference_drop=0.05, stop=True)
    chain, logged = _drive(hook, rewards, lengths, evals={4: 0.60, 8: 0.48})
    assert hook.alarms == 1 and logged[7]["hooks/reward_hacking/alarm"] == 1.0
    assert chain.stop_reason is not None and "eval/accuracy fell by 0.120 (0.600 -> 0.480)" in chain.stop_reason
    assert chain.stop_reason.startswith("hooks[0] RewardHackingMonitor: possible reward hacking")


# ---- real runs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One warm-started tiny checkpoint for every run of this module."""
    return tmp_path_factory.mktemp("hooks_cache")


def _run(hooks: str, tmp_path: Path, cache: Path, *extra: str) -> tuple[dict, object]:
    """One short job through the compose API and run_job, tracked in MLflow on a SQLite file in tmp_path."""
    from miles.bench.e2e import compose
    from miles.core.run import run_job

    overrides = [f"hooks={hooks}", "plugins.allow=[hook_plugins.]", "algo.num_prompts_per_step=4",
                 "algo.num_samples_per_prompt=4", "task.num_eval_prompts=8", "rollout.eval_samples_per_prompt=2",
                 "warm_start.steps=20", f"warm_start.cache_dir={cache}", f"tracking.uri={_uri(tmp_path)}",
                 "tracking.plots=false", *extra]
    run, resolved = compose(overrides)
    return run_job(run, resolved_yaml=resolved, overrides=overrides), run


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlruns.db'}"


def _mlflow_run(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(_uri(tmp_path))
    (r,) = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    return client, r


def _history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


STEP = ["after_rollout", "after_reward", "before_train", "after_train", "after_weight_sync"]


def test_every_point_is_called_in_order_with_its_arguments(ray_cluster, plugins, tmp_path: Path,
                                                           cache: Path) -> None:
    """A 3-step run with evaluations at steps 0, 2 and 3 and checkpoints at 2 and 3: a recorder sees every
    point in order; a hook after it sets the rewards (what after_reward may change), another the batch's
    advantages (what before_train may change); the curriculum raises the task's difficulty each step; an
    optional hook that raises at every step is counted, and the run finishes."""
    plugins.CALLS.clear()
    hooks = ("[{_target_: hook_plugins.Recorder}, {_target_: hook_plugins.RewardOverride, value: 1.0},"
             " {_target_: miles.hooks.Curriculum, threshold: 0.9, patience: 1, levels: [{list_len: 6}, {list_len: 7}]},"
             " {_target_: hook_plugins.Raiser, _optional_: true}, {_target_: hook_plugins.AdvantageOverride, value: 1.0}]")
    final, run = _run(hooks, tmp_path, cache, "trainer.num_steps=3", "trainer.eval_every=2", "trainer.save_every=2",
                      f"trainer.save_dir={tmp_path / 'ck'}")
    calls = [(p, s) for name, p, s, _ in plugins.CALLS if name == "recorder"]
    expected = [("on_run_start", 0), ("after_eval", 0)]
    for step in (1, 2, 3):
        expected += [(p, step) for p in STEP] + ([("after_eval", step), ("on_checkpoint", step)] if step > 1 else [])
    assert calls == expected + [("on_run_end", 3)]
    # list order: the recorder's after_reward comes before the override's at every step
    reward_calls = [(name, s) for name, p, s, _ in plugins.CALLS if p == "after_reward"]
    assert reward_calls == [(n, s) for s in (1, 2, 3) for n in ("recorder", "reward_override")]

    seen = {(p, s): kw for name, p, s, kw in plugins.CALLS if name == "recorder"}
    assert seen[("on_run_start", 0)] == {"config": "MilesConfig"}
    for step in (1, 2, 3):
        rollout = seen[("after_rollout", step)]
        assert rollout["sizes"] == [4] * 4 and rollout["samples"] and rollout["rewards"]
        assert rollout["difficulty"]["list_len"] == 4 + step  # the curriculum moved the task the loop samples
        assert seen[("before_train", step)] == {"type": "TrainBatch", "len": 16, "advantages": 16}
        train = seen[("after_train", step)]
        assert train["loss"] and train["reward"] == 1.0 and not train["eval"] and train["read_only"]
        assert seen[("after_weight_sync", step)] == {"version": step}
    for step in (0, 2, 3):
        assert seen[("after_eval", step)]["only_eval"]
    assert seen[("on_checkpoint", 2)] == {"path": str(checkpoints.step_dir(tmp_path / "ck", 2)), "exists": True}
    assert seen[("on_run_end", 3)] == {"status": "FINISHED", "wall": True, "stop_reason": None}
    assert final["eval/accuracy"] == seen[("after_eval", 3)]["accuracy"]

    client, r = _mlflow_run(tmp_path)
    assert r.info.status == "FINISHED" and "miles.stopped_early" not in r.data.tags
    assert _history(client, r.info.run_id, "hooks/errors") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    assert _history(client, r.info.run_id, "hooks/curriculum/list_len") == {0: 5.0, 1: 6.0, 2: 7.0, 3: 7.0}
    assert _history(client, r.info.run_id, "train/reward_mean") == {1: 1.0, 2: 1.0, 3: 1.0}
    # equal rewards give advantage 0; the trainer got the override's 1.0: -ratio * A at ratio 1 (one mini-batch)
    assert _history(client, r.info.run_id, "train/pg_loss") == pytest.approx({1: -1.0, 2: -1.0, 3: -1.0})
    assert set(_history(client, r.info.run_id, "hooks/recorder/calls")) == {1, 2, 3}
    assert r.data.params["hooks.3._optional_"] == "True"


def test_early_stop_ends_the_run_at_the_step_the_target_is_reached(ray_cluster, plugins, tmp_path: Path,
                                                                   cache: Path) -> None:
    """``train/lr`` rises by lr / lr_warmup_steps each step (2.5e-5): a target of 4e-5 is reached at step 2
    of 6. Step 2 is evaluated and checkpointed as the last step, the run is FINISHED, MLflow has the reason."""
    plugins.CALLS.clear()
    hooks = "[{_target_: miles.hooks.EarlyStop, metric: train/lr, target: 4.0e-5}, {_target_: hook_plugins.Recorder}]"
    final, run = _run(hooks, tmp_path, cache, "trainer.num_steps=6", "trainer.eval_every=0", "trainer.save_every=5",
                      f"trainer.save_dir={tmp_path / 'ck'}")
    assert run.trainer.lr / run.trainer.lr_warmup_steps == pytest.approx(2.5e-5)
    steps = sorted({s for name, p, s, _ in plugins.CALLS if name == "recorder"})
    assert steps == [0, 1, 2]
    assert [(p, s) for _, p, s, _ in plugins.CALLS if p in ("after_eval", "on_checkpoint", "on_run_end")] == [
        ("after_eval", 0), ("after_eval", 2), ("on_checkpoint", 2), ("on_run_end", 2)]
    end = next(kw for _, p, _, kw in plugins.CALLS if p == "on_run_end")
    reason = "hooks[0] miles.hooks.EarlyStop: train/lr 5e-05 >= target 4e-05 at step 2"
    assert end == {"status": "FINISHED", "wall": True, "stop_reason": reason}
    assert math.isfinite(final["eval/accuracy"])

    client, r = _mlflow_run(tmp_path)
    assert r.info.status == "FINISHED"
    assert (r.data.tags["miles.stopped_early"], r.data.tags["miles.stop_reason"],
            r.data.tags["miles.stopped_at_step"]) == ("true", reason, "2")
    assert set(_history(client, r.info.run_id, "eval/accuracy")) == {0, 2}
    assert max(_history(client, r.info.run_id, "train/lr")) == 2
    assert set(_history(client, r.info.run_id, "perf/wall_time_s")) == {2}
    assert [s for s, _ in checkpoints.checkpoints(tmp_path / "ck")] == [2]


def test_a_raising_hook_fails_the_run_naming_it(ray_cluster, plugins, tmp_path: Path, cache: Path) -> None:
    plugins.CALLS.clear()
    with pytest.raises(HookError, match=r"^hooks\[1\] hook_plugins.Raiser.after_train raised ValueError: boom at "
                                        r"step 1$") as err:
        _run("[{_target_: hook_plugins.Recorder}, {_target_: hook_plugins.Raiser}]", tmp_path, cache,
             "trainer.num_steps=3", "trainer.eval_every=0")
    assert isinstance(err.value.__cause__, ValueError)
    points = [(p, s) for _, p, s, _ in plugins.CALLS]
    assert points[-2:] == [("after_train", 1), ("on_run_end", 1)]  # no step after the failure
    assert plugins.CALLS[-1][3]["status"] == "FAILED"
    _, r = _mlflow_run(tmp_path)
    assert r.info.status == "FAILED"
