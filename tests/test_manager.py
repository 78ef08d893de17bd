"""RolloutManager over real engine actors: load balancing, retries, deadlines, dead engines,
filters with over-sampling, user generate / reward / filter functions, failed samples.

The engines load a checkpoint built like a run's (task tokenizer, tiny Qwen3, no warm start):
responses are decoded to text for rewards, so the model's vocabulary must be the tokenizer's
(``tiny_qwen3_dir`` has no tokenizer). Slow engines are real engines whose ``generate`` sleeps first.
"""

from __future__ import annotations

import random
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles.config import ConfigError, TargetConfig, validate
from miles.config.schema import PrecisionConfig, RolloutConfig
from miles.core.actors import ENGINE_MAX_CONCURRENCY
from miles.core.groups import assign_advantages
from miles.rewards import RewardRunner
from miles.rollout.dispatch import AllEnginesDeadError
from miles.rollout.filters import nonzero_reward_std
from miles.rollout.generate import single_turn
from miles.rollout.manager import RolloutManager, check_config
from miles.rollout.protocols import ContractError, check_filter, check_generate_fn, check_reward_fn
from miles.tasks.procedural import exact_answer_reward
from miles.train.batching import pad_batch
from miles.types import SamplingParams, Status, TrainBatch

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)
EXACT = TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True)

PLUGIN = '''
import asyncio

from miles.types import GenerateRequest, Sample


async def two_turn(ctx, problem, sampling):
    """Answer, then an environment turn (loss mask 0), then answer again; one sample per response."""
    prompt = list(ctx.encode(problem.prompt))
    first = await ctx.engine_generate(
        GenerateRequest(request_id=f"{ctx.group_id}-t1", prompt_ids=tuple(prompt), n=ctx.n, seed=ctx.seed), sampling)
    env = ctx.tokenizer.encode("\\nsure?\\n", add_special_tokens=False)

    async def second(r):
        ids = prompt + list(r.response_ids) + env
        (out,) = await ctx.engine_generate(GenerateRequest(
            request_id=f"{ctx.group_id}-t2-{r.index}", prompt_ids=tuple(ids), n=1, seed=ctx.seed + 1 + r.index),
            sampling)
        response = list(r.response_ids) + env + list(out.response_ids)
        return Sample(
            group_id=ctx.group_id, index=r.index, prompt_ids=prompt, response_ids=response,
            rollout_logprobs=list(r.logprobs) + [0.0] * len(env) + list(out.logprobs),
            loss_mask=[1] * len(r.response_ids) + [0] * len(env) + [1] * len(out.response_ids),
            status=out.status, weight_version=out.weight_version, label=problem.label,
            response_text=ctx.decode(response), metadata={"env_tokens": len(env)})

    return list(await asyncio.gather(*(second(r) for r in first)))


def length_parity(response_text, label):
    return float(len(response_text) % 2)


def odd_fails(response_text, label):
    if len(response_text) % 2:
        raise ValueError("odd length")
    return 1.0


def keep_odd_groups(group):
    return (True, "") if group[0].group_id % 2 else (False, "even group id")
'''


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A run's checkpoint (task tokenizer + tiny Qwen3, random init) and its task."""
    from transformers import AutoTokenizer

    from miles.core.run import build_components
    from miles.models.checkpoint import ensure_checkpoint

    run = validate({"warm_start": {"steps": 0, "cache_dir": str(tmp_path_factory.mktemp("ckpt"))}})
    parts = build_components(run)
    path = ensure_checkpoint(run, parts["spec"], parts["task"])
    return SimpleNamespace(path=str(path), tokenizer=AutoTokenizer.from_pretrained(path), task=parts["task"])


def _engines(ray, path: str, k: int) -> list:
    """``k`` engine actors; ``set_delay(s)`` makes one sleep ``s`` seconds before each generate call."""
    from miles.rollout.torch_engine import TorchEngine

    class SlowableEngine(TorchEngine):
        delay_s = 0.0

        def set_delay(self, seconds: float) -> None:
            self.delay_s = seconds

        def generate(self, requests, sampling=None):
            time.sleep(self.delay_s)
            return super().generate(requests, sampling)

    actor = ray.remote(SlowableEngine)
    options = dict(num_cpus=0.1, max_concurrency=ENGINE_MAX_CONCURRENCY)  # as miles.core.actors creates them
    engines = [actor.options(**options).remote(path, PrecisionConfig(), seed=i, num_threads=1, engine_id=i)
               for i in range(k)]
    ray.get([e.health.remote() for e in engines])
    return engines


@pytest.fixture(scope="module")
def engines(ray_cluster, built):
    """Two engines for the whole module (actor start dominates these tests): some tests slow one
    down (reset after the test); the last test kills both."""
    engines = _engines(ray_cluster, built.path, 2)
    yield engines
    for e in engines:
        ray_cluster.kill(e)


@pytest.fixture
def pair(engines):
    return engines


@pytest.fixture
def slow_fast(ray_cluster, engines):
    """[an engine the test may slow down (reset afterwards), a healthy one]."""
    yield [engines[1], engines[0]]
    ray_cluster.get(engines[1].set_delay.remote(0.0), timeout=120)


@pytest.fixture(scope="module")
def exact_reward():
    with RewardRunner(EXACT, timeout_s=0) as runner:  # inline: no worker processes
        yield runner


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user module outside the package (``my_rollout_plugin``), importable here and in reward workers."""
    (tmp_path / "my_rollout_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rollout_plugin"
    sys.modules.pop("my_rollout_plugin", None)


def _problems(built, k: int, seed: int = 0):
    return built.task.sample(k, random.Random(seed))


def _check_accounting(groups, metrics, num_groups: int, n: int, first_group_id: int = 0) -> None:
    """Exactly one group of exactly n samples per prompt, in order; every outcome counted once."""
    assert [g[0].group_id for g in groups] == list(range(first_group_id, first_group_id + num_groups))
    assert all([s.index for s in g] == list(range(n)) and {s.group_id for s in g} == {g[0].group_id}
               for g in groups)
    counted = sum(metrics[f"rollout/{st.value}"] for st in Status)
    assert counted == metrics["rollout/samples"] == num_groups * n


# --- contracts ------------------------------------------------------------------------------


def test_builtins_meet_their_contracts(pair, built, exact_reward) -> None:
    manager = RolloutManager(pair, built.tokenizer, exact_reward)
    samples = check_generate_fn(single_turn, manager, _problems(built, 1)[0], n=3)
    assert len(samples) == 3 and all(s.loss_mask == [1] * len(s.response_ids) for s in samples)
    assert all(s.token_versions == [s.weight_version] * len(s.response_ids) for s in samples)  # one version each
    assert check_reward_fn(exact_answer_reward, [("82", "82"), (" 82 ", "82"), ("8", "82")]) == [1.0, 1.0, 0.0]
    groups = manager.rollout(_problems(built, 2), 3, SAMPLING, seed=0)[0]
    groups[0][0].reward = 1.0  # spread in group 0; group 1 is all zeros (a random model never answers)
    assert check_filter(nonzero_reward_std, groups) == [(True, ""), (False, "reward std 0 <= 0")]


def test_evaluation_rollouts_score_with_the_eval_reward(pair, built, exact_reward) -> None:
    parity = TargetConfig(target="plugin_rewards.length_parity", partial=True)
    with RewardRunner(parity, allow=("plugin_rewards.",), timeout_s=0) as eval_reward:
        manager = RolloutManager(pair, built.tokenizer, exact_reward, eval_reward=eval_reward)
        problems = _problems(built, 3)
        for evaluation in (False, True):
            groups, _ = manager.rollout(problems, 4, SAMPLING, seed=0, evaluation=evaluation)
            texts = [s.response_text for g in groups for s in g]
            want = ([float(len(t) % 2) for t in texts] if evaluation
                    else [exact_answer_reward(t, s.label) for t, s in zip(texts, (s for g in groups for s in g), strict=True)])
            assert [s.reward for g in groups for s in g] == want
        assert {len(t) % 2 for t in texts} == {0, 1}  # the two scores differ on these responses
        with pytest.raises(TypeError, match="eval_reward must be a miles.rewards.RewardRunner"):
            RolloutManager(pair, built.tokenizer, exact_reward, eval_reward=exact_answer_reward)


def test_contract_checks_catch_broken_plugins(pair, built, exact_reward) -> None:
    manager = RolloutManager(pair, built.tokenizer, exact_reward)
    problem = _problems(built, 1)[0]

    async def one_short(ctx, problem, sampling):
        return (await single_turn(ctx, problem, sampling))[:-1]

    def not_async(ctx, problem, sampling):
        return []

    async def bad_mask(ctx, problem, sampling):
        samples = await single_turn(ctx, problem, sampling)
        samples[0].loss_mask = samples[0].loss_mask[:-1]
        return samples

    with pytest.raises(ContractError, match="returned 1 samples, expected ctx.n = 2"):
        check_generate_fn(one_short, manager, problem)
    with pytest.raises(ContractError, match="async def"):
        check_generate_fn(not_async, manager, problem)
    with pytest.raises(ContractError, match="loss-mask entries; all must match"):
        check_generate_fn(bad_mask, manager, problem)
    async def versions_short(ctx, problem, sampling):
        samples = await single_turn(ctx, problem, sampling)
        samples[0].token_versions = samples[0].token_versions[:-1]
        return samples

    with pytest.raises(ContractError, match="token versions for .* response tokens"):
        check_generate_fn(versions_short, manager, problem)
    with pytest.raises(ContractError, match="not deterministic"):
        check_reward_fn(lambda text, label: random.random(), [("a", "b")])
    with pytest.raises(ContractError, match="finite"):
        check_reward_fn(lambda text, label: float("nan"), [("a", "b")])

    def mutating(group):
        group[0].reward = 5.0
        return True, ""

    groups = manager.rollout([problem], 2, SAMPLING, seed=0)[0]
    with pytest.raises(ContractError, match="modified the samples"):
        check_filter(mutating, groups)
    with pytest.raises(ContractError, match="needs a reason"):
        check_filter(lambda group: (False, ""), groups)


# --- load balancing, retries, deadlines, dead engines -------------------------------------------


def test_requests_spread_over_engines_within_the_inflight_cap(pair, built, exact_reward) -> None:
    cfg = RolloutConfig(max_inflight_samples_per_engine=8)
    manager = RolloutManager(pair, built.tokenizer, exact_reward, config=cfg)
    groups, metrics = manager.rollout(_problems(built, 8), 4, SAMPLING, seed=1, first_group_id=100)
    _check_accounting(groups, metrics, 8, 4, first_group_id=100)
    assert all(s.trainable for g in groups for s in g)
    assert sum(manager.pool.dispatched) == 8 and min(manager.pool.dispatched) >= 2, manager.pool.dispatched
    assert metrics["rollout/retried"] == 0 and metrics["rollout/engines_alive"] == 2
    # the same seeds give the same samples, however the requests were spread
    again = RolloutManager(pair[:1], built.tokenizer, exact_reward).rollout(
        _problems(built, 8), 4, SAMPLING, seed=1, first_group_id=100)[0]
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in groups]


def test_a_slow_engine_gets_less_work(ray_cluster, slow_fast, built, exact_reward) -> None:
    """Completion-driven dispatch: the fast engine takes the queue while the slow one is busy."""
    ray_cluster.get(slow_fast[0].set_delay.remote(1.0))
    cfg = RolloutConfig(max_inflight_samples_per_engine=4, max_requests_per_call=1)
    manager = RolloutManager(slow_fast, built.tokenizer, exact_reward, config=cfg)
    groups, metrics = manager.rollout(_problems(built, 12), 4, SAMPLING, seed=0)
    _check_accounting(groups, metrics, 12, 4)
    slow, fast = manager.pool.dispatched
    assert slow + fast == 12 and fast >= 2 * slow, manager.pool.dispatched  # contiguous chunks: 6 / 6


def test_request_deadline_retries_elsewhere_then_fails_the_group(ray_cluster, slow_fast, built, exact_reward) -> None:
    ray_cluster.get(slow_fast[0].set_delay.remote(1.5))
    cfg = RolloutConfig(request_timeout_s=0.3, max_inflight_samples_per_engine=4, max_requests_per_call=1)
    manager = RolloutManager(slow_fast, built.tokenizer, exact_reward, config=cfg)
    groups, metrics = manager.rollout(_problems(built, 4), 4, SAMPLING, seed=0)
    _check_accounting(groups, metrics, 4, 4)
    assert all(s.trainable for g in groups for s in g)
    assert metrics["rollout/timeouts"] >= 1 and metrics["rollout/retried"] >= 1
    assert metrics["rollout/engines_lost"] == 0, "a slow engine is not a dead one"

    only_slow = RolloutManager(slow_fast[:1], built.tokenizer, exact_reward,
                               config=RolloutConfig(request_timeout_s=0.3, max_retries=1))
    t0 = time.perf_counter()
    groups, metrics = only_slow.rollout(_problems(built, 1), 3, SAMPLING, seed=0)
    assert time.perf_counter() - t0 < 1.4, "two attempts of 0.3 s, not the engine's 1.5 s"
    _check_accounting(groups, metrics, 1, 3)
    assert metrics["rollout/failed"] == metrics["rollout/failed_generation"] == 3
    assert metrics["rollout/timeouts"] == 2 and metrics["rollout/retried"] == 1
    failure = groups[0][0].failure
    assert "failed 2 time(s)" in failure and "rollout.request_timeout_s=0.3s" in failure
    assert not any(s.trainable for s in groups[0])


# --- filters and over-sampling --------------------------------------------------------------


def test_filter_oversamples_to_a_full_batch(pair, built, exact_reward, plugin) -> None:
    from my_rollout_plugin import keep_odd_groups

    draw_rng = random.Random(0)
    manager = RolloutManager(pair, built.tokenizer, exact_reward, filters=[keep_odd_groups])
    groups, metrics = manager.collect(lambda k: built.task.sample(k, draw_rng), 4, 2, SAMPLING, seed=0,
                                      first_group_id=10)
    # round 0: ids 10..13 keep 11, 13 (rate 1/2) -> round 1 draws ceil(2 / 0.5) = 4: ids 14..17 keep 15, 17
    assert [g[0].group_id for g in groups] == [11, 13, 15, 17]
    assert all(s.trainable for g in groups for s in g)
    assert metrics["rollout/groups"] == 8 and metrics["rollout/samples"] == 16
    assert metrics["rollout/filtered_groups"] == 4 and metrics["rollout/filtered_by/keep_odd_groups"] == 4
    assert metrics["rollout/oversample_rounds"] == 1 and metrics["rollout/oversampled_groups"] == 4
    assert metrics["rollout/padded_groups"] == 0 and metrics["rollout/surplus_groups"] == 0


def test_dynamic_sampling_pads_with_filtered_groups_when_rounds_run_out(pair, built, exact_reward) -> None:
    """A random model never answers exactly: every group's rewards are all 0, DAPO drops them all."""
    draw_rng = random.Random(0)
    cfg = RolloutConfig(max_oversample_rounds=2)
    manager = RolloutManager(pair, built.tokenizer, exact_reward, config=cfg, filters=[nonzero_reward_std])
    groups, metrics = manager.collect(lambda k: built.task.sample(k, draw_rng), 3, 2, SAMPLING, seed=0)
    assert metrics["rollout/oversample_rounds"] == 2 and metrics["rollout/groups"] == 9
    assert metrics["rollout/filtered_by/nonzero_reward_std"] == 9 and metrics["rollout/padded_groups"] == 3
    assert len(groups) == 3 and all(s.filtered.startswith("nonzero_reward_std: reward std 0")
                                    for g in groups for s in g)
    out = assign_advantages(groups, lambda r: r - r.mean(dim=1, keepdim=True))
    assert out["train/trainable_samples"] == 0 and out["train/excluded_samples"] == 6
    assert all(s.advantage == 0 and not any(s.loss_mask) for g in groups for s in g)


# --- user code by _target_ --------------------------------------------------------------------


def test_user_generate_fn_reward_and_filter_by_target(pair, built, plugin) -> None:
    from miles.core.run import build_components

    run = validate({
        "rollout": {"generate_fn": {"_target_": f"{plugin}.two_turn", "_partial_": True},
                    "filters": [{"_target_": f"{plugin}.keep_odd_groups", "_partial_": True}]},
        "task": {"reward": {"_target_": f"{plugin}.length_parity", "_partial_": True}},
        "plugins": {"allow": [f"{plugin}."]},
    })
    parts = build_components(run)
    assert check_reward_fn(parts["reward_fn"], [("ab", None), ("abc", None)]) == [0.0, 1.0]
    with RewardRunner(run.task.reward, allow=run.plugins.allow, timeout_s=5.0) as reward:  # worker process
        manager = RolloutManager(pair, built.tokenizer, reward, config=run.rollout,
                                 generate_fn=parts["generate_fn"], filters=parts["filters"])
        check_generate_fn(parts["generate_fn"], manager, _problems(built, 1)[0], n=2)
        groups, metrics = manager.rollout(_problems(built, 3), 2, SAMPLING, seed=0)
        _check_accounting(groups, metrics, 3, 2)
    for s in (s for g in groups for s in g):
        env = s.metadata["env_tokens"]
        assert 0 in s.loss_mask and s.loss_mask.count(0) == env, "environment tokens are masked out"
        assert s.reward == len(s.response_text) % 2 and s.trainable
    assert sum(manager.pool.dispatched) >= 3 * (1 + 2), "per group: one first-turn + n second-turn requests"
    check_filter(parts["filters"][0], groups)

    not_allowed = validate({"rollout": {"generate_fn": {"_target_": f"{plugin}.two_turn", "_partial_": True}}})
    with pytest.raises(ConfigError, match="plugins.allow"):
        build_components(not_allowed)


# --- failed samples -------------------------------------------------------------------------


def test_failed_samples_stay_in_their_group_and_out_of_the_loss(pair, built, plugin) -> None:
    node = TargetConfig(target=f"{plugin}.odd_fails", partial=True)
    with RewardRunner(node, allow=(f"{plugin}.",), timeout_s=0) as reward:
        manager = RolloutManager(pair, built.tokenizer, reward)
        groups, metrics = manager.rollout(_problems(built, 6), 4, SamplingParams(max_new_tokens=5), seed=3)
    _check_accounting(groups, metrics, 6, 4)
    failed = [s for g in groups for s in g if s.status is Status.FAILED]
    assert failed and len(failed) == metrics["rollout/failed"] == metrics["rollout/failed_reward"]
    assert all(s.failure == "reward: raised ValueError: odd length" and len(s.response_text) % 2 for s in failed)

    # advantages over the valid samples only; the failed ones get 0 and an all-zero loss mask
    calls = []

    def centred(r: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(r.shape))
        if r.shape[1] < 2:
            raise ValueError("needs 2 samples per group")
        return r - r.mean(dim=1, keepdim=True) + 0.5  # + 0.5: a valid sample's advantage is never 0

    for g in groups:  # make rewards distinct so the group statistics show which samples entered
        for s in g:
            s.reward = s.reward + 0.1 * s.index if s.trainable else s.reward
    metrics = assign_advantages(groups, centred)
    sizes = {sum(s.trainable for s in g) for g in groups}
    assert sorted(k for _, k in calls) == sorted(sizes - {0}), "one call per number of valid samples"
    for g in groups:
        valid = [s for s in g if s.trainable]
        for s in g:
            if s not in valid or len(valid) < 2:
                assert s.advantage == 0 and not any(s.loss_mask)
            else:
                mean = sum(v.reward for v in valid) / len(valid)
                assert s.advantage == pytest.approx(s.reward - mean + 0.5) and all(s.loss_mask)
    assert metrics["train/trainable_samples"] + metrics["train/excluded_samples"] == 24
    padded = pad_batch(TrainBatch.from_samples([s for g in groups for s in g]))
    rows = [i for i, s in enumerate(s for g in groups for s in g) if s.status is Status.FAILED]
    assert padded.loss_mask[rows].sum() == 0 and padded.advantages[rows].abs().sum() == 0


def test_bad_manager_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="rollout.request_timeout_s: must be a finite number > 0"):
        check_config(RolloutConfig(request_timeout_s=0))
    with pytest.raises(ConfigError, match="rollout.max_requests_per_call: must be at least 1"):
        check_config(RolloutConfig(max_requests_per_call=0))
    with pytest.raises(ConfigError, match="rollout.max_retries: must be 0 or more"):
        check_config(RolloutConfig(max_retries=-1))
    with pytest.raises(ConfigError, match="rollout.max_engine_restarts: must be 0 or more"):
        check_config(RolloutConfig(max_engine_restarts=-1))
    with pytest.raises(ConfigError, match="rollout.max_outage_s: must be a finite number > 0"):
        check_config(RolloutConfig(max_outage_s=float("inf")))
    with pytest.raises(ConfigError, match=r"rollout.health_interval_s: must be a finite number >= 0 \(0: no health"):
        check_config(RolloutConfig(health_interval_s=-1))
    with pytest.raises(TypeError, match="RewardRunner"):
        RolloutManager([object()], None, exact_answer_reward)


def _until_dead(ray, actor, timeout_s: float = 30.0) -> None:
    """Wait until calls to ``actor`` fail with RayActorError (a call made right after ``ray.kill`` can still
    be answered)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.weight_version.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the actor still answers {timeout_s:g} s after ray.kill")


def test_engine_killed_mid_rollout_then_all_engines_dead(ray_cluster, engines, built, exact_reward) -> None:
    """Runs last: it kills the module's engines."""
    spare = engines
    killed: list[int] = []

    async def kill_engine0_after_first_group(ctx, problem, sampling):
        samples = await single_turn(ctx, problem, sampling)
        if not killed:
            killed.append(ctx.group_id)
            ray_cluster.kill(spare[0])
        return samples

    cfg = RolloutConfig(max_inflight_samples_per_engine=4, max_requests_per_call=1)
    manager = RolloutManager(spare, built.tokenizer, exact_reward, config=cfg,
                             generate_fn=kill_engine0_after_first_group)
    groups, metrics = manager.rollout(_problems(built, 10), 4, SAMPLING, seed=0)
    _check_accounting(groups, metrics, 10, 4)
    assert all(s.trainable for g in groups for s in g), "every request was retried on engine 1"
    assert metrics["rollout/engines_lost"] == 1 and metrics["rollout/engines_alive"] == 1
    assert metrics["rollout/retried"] >= 1 and manager.pool.alive == [1]
    assert "ActorDiedError" in manager.pool.deaths[0]

    ray_cluster.kill(spare[1])  # dies outside generation: a call to it takes it out as well
    _until_dead(ray_cluster, spare[1])  # ray.kill returns before the actor is gone
    assert manager.settle_calls({1: spare[1].weight_version.remote()}) == {} and manager.pool.alive == []
    assert "ActorDiedError" in manager.pool.deaths[1]
    with pytest.raises(AllEnginesDeadError, match=r"all 2 rollout engine\(s\) died"):
        manager.rollout(_problems(built, 3), 2, SAMPLING, seed=0)

