"""The placement plan, without Ray: every shipped config gives one, layouts have the expected bundles,
threads and ranks, and layouts that cannot be fail with their message (also through ``--plan``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir, initialize_config_module
from omegaconf import OmegaConf

from miles.config import ConfigError, validate
from miles.config.schema import GROUP_SCHEMAS
from miles.config.validate import group_options
from miles.core.plan import Plan, Pool, make_plan
from miles.machine import Machine

EXAMPLES = Path(__file__).parents[1] / "examples"
CONF = Path(__file__).parents[1] / "miles" / "conf"
TWO_CORES = Machine(cpus=2)
"""The CPU machine miles is tested on."""


def _compose(overrides: list[str], name: str = "config", config_dir: Path | None = None):
    init = (initialize_config_dir(str(config_dir), version_base="1.3") if config_dir
            else initialize_config_module("miles.conf", version_base="1.3"))
    with init:
        return validate(compose(name, overrides=overrides))


@pytest.fixture(scope="module")
def defaults() -> dict[str, Any]:
    """The default config, composed once (each Hydra compose takes about half a second here)."""
    with initialize_config_module("miles.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("config"), resolve=True)


def _option(group: str, option: str) -> dict[str, Any]:
    return yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` over ``base``, mappings merged key by key (OmegaConf.merge's rule, on plain dicts)."""
    return base | {k: _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                   for k, v in changes.items()}


def _with(defaults: dict[str, Any], *options: tuple[str, str], **changes: Any) -> Plan:
    """The plan of the defaults with group options swapped in (Hydra replaces a group's node with the
    option's YAML the same way) and ``changes`` merged over them. An option of package ``_global_``
    (``task=openenv`` also sets ``rollout.generate_fn``) is composed by Hydra instead."""
    if any((CONF / g / f"{o}.yaml").read_text().startswith("# @package _global_") for g, o in options):
        return make_plan(_compose([f"{g}={o}" for g, o in options]), TWO_CORES)
    cfg = defaults | {group: _option(group, option) for group, option in options}
    return make_plan(validate(_merge(cfg, changes)), TWO_CORES)


def _plan(machine: Machine = TWO_CORES, **sections: dict) -> Plan:
    return make_plan(validate(sections), machine)


def _threads(plan: Plan) -> tuple[list[int], list[int], list[int]]:
    return [s.threads for s in plan.engines], [s.threads for s in plan.trainers], [s.threads for s in plan.critics]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUP_SCHEMAS for o in group_options(g)])
def test_every_shipped_option_gives_a_plan(defaults: dict[str, Any], group: str, option: str) -> None:
    async_needs = [("placement", "disaggregated")] if group == "schedule" and option != "sync" else []
    teacher = {"_target_": "miles.models.qwen3.qwen3_spec", "flavor": "tiny", "path": None}
    changes = {"teacher": {"model": teacher}} if (group, option) == ("algo", "opd") else {}  # opd needs its teacher
    plan = _with(defaults, (group, option), *async_needs, **changes)
    assert plan.engines and plan.trainers and plan.pools
    # on 2 cores the defaults never ask for more than one thread per actor
    assert {s.threads for s in plan.engines + plan.trainers + plan.critics} == {1}
    assert plan.describe().startswith(f"placement {plan.placement} on cpu")


@pytest.mark.parametrize("preset", group_options("experiment"))
def test_every_experiment_preset_gives_a_plan(preset: str) -> None:
    plan = make_plan(_compose([f"experiment={preset}"]), TWO_CORES)
    assert {s.threads for s in plan.engines + plan.trainers} == {1}


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_every_example_gives_a_plan(name: str) -> None:
    plan = make_plan(_compose([], name, EXAMPLES), TWO_CORES)
    assert plan.trainer_class and plan.engine_class


def test_colocate_shares_bundles_and_counts_engines_and_ranks_together() -> None:
    run = validate({"placement": {"num_engines": 2, "trainer_world_size": 4, "cpus_per_bundle": 1.5}})
    plan = make_plan(run, Machine(cpus=16))
    assert plan.pools == (Pool("shared", 4, 1.5, {}),)
    assert [(s.pool, s.bundle, s.cpus) for s in plan.engines] == [(0, 0, 0.75), (0, 1, 0.75)]
    assert [(s.index, s.bundle) for s in plan.trainers] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # 16 cores - the driver - 1 reward worker, over 2 engines + 4 ranks (engines release while ranks train)
    assert _threads(plan) == ([2] * 2, [2] * 4, [])
    assert plan.reserved == 2 and plan.cores == 16
    assert plan.engines[0].env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "THP_MEM_ALLOC_ENABLE": "1"}
    assert plan.offload and (plan.layout.world_size, plan.layout.dp) == (4, 4)
    # cluster.num_cpus below the machine's cores limits the threads too; more reward workers leave fewer
    assert _threads(make_plan(validate({"cluster": {"num_cpus": 8}}), Machine(cpus=16)))[0] == [3]
    assert _threads(make_plan(validate({"task": {"reward_num_workers": 4}}), Machine(cpus=16)))[0] == [5]
    assert _threads(make_plan(validate({"task": {"reward_timeout_s": 0.0}}), Machine(cpus=16)))[0] == [7]
    # a joined cluster: each actor gets its half of its bundle
    joined = make_plan(validate({"placement": {"cpus_per_bundle": 6.0}, "cluster": {"address": "auto"}}), TWO_CORES)
    assert joined.joined and _threads(joined) == ([3], [3], []) and "store the driver opens on the driver's node" in joined.describe()
    # a shared bundle hosts an engine and a rank: it carries both pools' custom resources (a joined cluster has them)
    pinned = _plan(placement={"engine_resources": {"gpu_node": 1}, "trainer_resources": {"gpu_node": 0.5, "fast": 1}},
                   cluster={"address": "auto"})
    assert pinned.pools[0].bundle() == {"CPU": 1.0, "gpu_node": 1.5, "fast": 1.0}


def test_disaggregated_has_a_pool_each_and_threads_within_their_bundles() -> None:
    plan = _plan(Machine(cpus=64), placement={"name": "disaggregated", "num_engines": 3, "trainer_world_size": 2,
                                              "cpus_per_engine": 2.0, "cpus_per_trainer_rank": 3.5,
                                              "engine_resources": {"node2": 1}}, cluster={"address": "auto"})
    engine, trainer = plan.pools
    assert engine == Pool("engine", 3, 2.0, {"node2": 1.0}) and engine.bundle() == {"CPU": 2.0, "node2": 1.0}
    assert trainer == Pool("trainer", 2, 3.5, {})
    assert [(s.pool, s.bundle, s.cpus) for s in plan.engines] == [(0, 0, 2.0), (0, 1, 2.0), (0, 2, 2.0)]
    assert [(s.pool, s.bundle) for s in plan.trainers] == [(1, 0), (1, 1)]
    assert _threads(plan) == ([2] * 3, [3] * 2, []) and not plan.offload
    # a local cluster: the bundle, or the cores shared out, whichever is less
    local = {"name": "disaggregated", "cpus_per_engine": 8.0, "cpus_per_trainer_rank": 2.0}
    assert _threads(_plan(Machine(cpus=12), placement=local)) == ([5], [2], [])
    assert _threads(_plan(Machine(cpus=12), placement=local | {"torch_threads_per_actor": 3})) == ([3], [3], [])


def test_critic_ranks_share_their_rank_bundles_and_meet_apart() -> None:
    plan = _plan(Machine(cpus=8), algo={"estimator": "gae"}, placement={"trainer_world_size": 2})
    assert [(s.pool, s.bundle, s.cpus) for s in plan.critics] == [(0, 0, 0), (0, 1, 0)]
    assert _threads(plan) == ([2], [2, 2], [2, 2])  # (8 - 2) / (1 engine + 2 ranks); critics take turns
    assert plan.critic_class == "miles.train.critic.FSDPCritic"
    assert "critic: 2 rank(s) x miles.train.critic.FSDPCritic" in plan.describe()


def test_megatron_layout_and_tenants() -> None:
    megatron = {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False,
                "tensor_parallel": 2, "pipeline_parallel": 2}
    plan = _plan(Machine(cpus=16), trainer=megatron, placement={"trainer_world_size": 8})
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp) == (2, 2, 2) and len(plan.trainers) == 8
    assert "TP=2 PP=2 DP=2" in plan.describe()
    run = _compose([], "lora_tenants", EXAMPLES)
    plan = make_plan(run, TWO_CORES)
    names = tuple(t.name for t in run.tenants)
    assert plan.rank_kwargs == {"adapter_names": names} and plan.engine_kwargs["adapter_names"] == names
    assert plan.reserved == 1 + len(names)  # every tenant's reward worker scores while the engines generate


def test_key_is_what_fixes_the_processes(defaults: dict[str, Any]) -> None:
    base = _with(defaults).key()
    same = _with(defaults, ("algo", "gspo"), ("precision", "bf16"), ("weight_sync", "shm"), seed=3,
                 trainer={"lr": 1e-4})
    assert same.key() == base
    for options, changes in (((), {"placement": {"trainer_world_size": 2}}), ((), {"placement": {"num_engines": 2}}),
                             ((("algo", "ppo"),), {}), ((("placement", "disaggregated"),), {}),
                             ((), {"placement": {"torch_threads_per_actor": 2}}),
                             ((), {"placement": {"offload_engines": False}}), ((), {"placement": {"huge_pages": False}})):
        assert _with(defaults, *options, **changes).key() != base, (options, changes)


@pytest.mark.parametrize("sections,machine,message", [
    ({"placement": {"trainer_world_size": 4, "cpus_per_bundle": 2.0}}, TWO_CORES,
     r"placement 'colocate' asks for 4 bundle\(s\) x 2 CPU = 8 CPU, but the local Ray cluster has 2 CPU"),
    ({"placement": {"name": "disaggregated", "num_engines": 2, "cpus_per_trainer_rank": 2.0}, "cluster": {"num_cpus": 3}},
     TWO_CORES, r"engine pool 2 bundle\(s\) x 1 CPU = 2 CPU \+ trainer pool 1 bundle\(s\) x 2 CPU = 2 CPU = 4 CPU "
                r"in all, but the local Ray cluster has 3 CPU"),
    ({"placement": {"device": "cuda", "trainer_world_size": 2}}, Machine(cpus=8, cuda_devices=1),
     r"\(\+ GPU: 1 per bundle\) = 2 CPU, but this machine has 1 CUDA device\(s\)\. Set placement.device=cpu"),
    ({"placement": {"name": "disaggregated", "engine_resources": {"node2": 1}}}, TWO_CORES,
     r"needs custom Ray resource\(s\) node2, but a local Ray cluster started by miles has CPUs only"),
    ({"trainer": {"_target_": "miles.train.megatron.MegatronTrainer", "shared_prompt_forward": False,
                  "tensor_parallel": 4}, "placement": {"trainer_world_size": 4}}, Machine(cpus=8),
     r"trainer.tensor_parallel \(4\) must divide the model's num_key_value_heads"),
    ({"trainer": {"tensor_parallel": 2}, "placement": {"trainer_world_size": 2}}, TWO_CORES,
     r"trainer.tensor_parallel=2: .*FSDPTrainer does not support tensor parallelism"),
    ({"placement": {"cpus_per_engine": 2.0}}, TWO_CORES, r"placement.cpus_per_engine applies to placement=disaggregated"),
    ({"placement": {"name": "disaggregated", "cpus_per_bundle": 2.0}}, TWO_CORES,
     r"placement.cpus_per_bundle applies to placement=colocate only"),
    ({"placement": {"name": "disaggregated", "cpus_per_trainer_rank": 0.0}}, TWO_CORES,
     r"placement.cpus_per_trainer_rank: must be > 0 CPUs"),
    ({"placement": {"engine_resources": {"CPU": 1}}}, TWO_CORES,
     r"placement.engine_resources.CPU: CPUs and memory are sized by the cpus_"),
    ({"placement": {"trainer_resources": {"node2": -1}}}, TWO_CORES,
     r"placement.trainer_resources.node2: expected a positive number"),
    ({"placement": {"ready_timeout_s": 0.0}}, TWO_CORES, r"placement.ready_timeout_s: must be > 0"),
])
def test_layouts_that_cannot_be_fail_with_their_message(sections: dict, machine: Machine, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_plan(validate(sections), machine)


def test_device_auto_follows_the_machine_and_a_joined_cluster() -> None:
    assert _plan(TWO_CORES).device == "cpu"
    gpus = _plan(Machine(cpus=8, cuda_devices=2), placement={"trainer_world_size": 2})
    assert gpus.device == "cuda" and gpus.pools[0].bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert [(s.gpus) for s in gpus.engines + gpus.trainers] == [0.4, 0.3, 0.3]
    joined = {"cluster": {"address": "auto"}}
    assert _plan(Machine(cpus=8, cuda_devices=2), **joined).device == "cpu"  # not known before joining
    assert _plan(Machine(cpus=8, ray_gpus=4.0), **joined).device == "cuda"  # the joined cluster's GPUs


def test_plan_flag_prints_the_plan_or_fails_like_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """``python -m miles --plan ...`` (its ``main()``, in this process): Hydra composes the config as for a run
    (config flags and overrides), and a layout that cannot be exits 2 with its reason; nothing is written,
    no Ray starts."""
    import ray

    from miles.__main__ import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("--plan started Ray"))  # Ray may be up from others
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["miles", "--plan", "--config-dir", str(EXAMPLES), "--config-name",
                                      "agent_calculator", "placement=disaggregated", "algo=ppo"])
    main()
    out = capsys.readouterr().out
    assert "placement disaggregated on cpu" in out and "critic rank 0: trainer bundle 0" in out
    assert not list(tmp_path.iterdir())
    for argv, message in ((["placement.trainer_world_size=4", "placement.cpus_per_bundle=8"], "asks for 4 bundle(s)"),
                          (["placement=colocat"], "did you mean 'colocate'")):
        monkeypatch.setattr(sys, "argv", ["miles", "--plan", *argv])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err + caplog.text  # miles' one line: on stderr, or logged (a run's errors)
        assert e.value.code == 2 and "config error: " in err and message in err, (argv, err)
    assert not list(tmp_path.iterdir())


def test_help_introduces_miles_and_lists_the_groups_a_user_picks_from(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """``miles --help``: Hydra's help with miles' template (``hydra.help`` in miles/conf/config.yaml)."""
    from miles.__main__ import main

    monkeypatch.setattr(sys, "argv", ["miles", "--help"])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("miles: reinforcement-learning post-training of LLMs")
    groups = [line.split(":")[0] for line in out.split("==\n")[1].split("\n==")[0].splitlines()]
    assert groups == sorted([*GROUP_SCHEMAS, "experiment"])
    assert "placement: colocate, disaggregated" in out and "miles --plan" in out
    assert "Hydra" not in out.splitlines()[0] and "schema:" not in out


def test_engine_key_is_the_engine_side_of_a_disaggregated_plan() -> None:
    """Jobs differing only on the trainer side share an engine key (their engines can be kept); colocated
    engines share bundles with the ranks, so they have none."""
    dis = {"name": "disaggregated"}
    base = _plan(placement=dis)
    megatron = _plan(placement=dis, trainer={"_target_": "miles.train.megatron.MegatronTrainer",
                                             "shared_prompt_forward": False})
    ppo = _plan(placement=dis, algo={"name": "ppo", "estimator": "gae"})
    assert base.key() != megatron.key() and base.key() != ppo.key()
    assert base.engine_key() == megatron.engine_key() == ppo.engine_key() is not None
    assert _plan(placement=dis | {"num_engines": 2, "cpus_per_engine": 0.5}).engine_key() != base.engine_key()
    assert _plan().engine_key() is None
