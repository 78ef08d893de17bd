"""Placement on Ray: the plan's pools reserved (or refused in time), actors on their bundles, several nodes."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.config import ConfigError, validate
from miles.core.plan import Plan, make_plan
from miles.machine import Machine


def _run(placement: dict, **cluster) -> object:
    return validate({"placement": placement, "cluster": cluster})


def _plan(placement: dict, **cluster) -> Plan:
    """The plan on a joined cluster (the session's): its pools are placed by Ray, not checked against this machine."""
    return make_plan(_run(placement, address="auto", **cluster), Machine(cpus=4))


# ---- the plan's bundle math is tests/test_plan.py; here what Ray does with it ------------------

def test_unknown_placement_name_lists_the_options() -> None:
    with pytest.raises(ConfigError, match=r"placement.name: invalid value 'disagregated' \(did you mean "
                                          r"'disaggregated'\?\)\. Valid options: colocate, disaggregated"):
        _run({"name": "disagregated"})


# ---- on the session's Ray cluster (4 CPUs, no custom resources) --------------------------------

@pytest.mark.parametrize("huge_pages", [True, False])
def test_actor_env_switches_torch_onto_huge_pages(ray_cluster, huge_pages: bool) -> None:
    env = dict(_plan({"huge_pages": huge_pages, "torch_threads_per_actor": 1}).engines[0].env)
    assert env["OMP_NUM_THREADS"] == "1" and ("THP_MEM_ALLOC_ENABLE" in env) == huge_pages

    @ray_cluster.remote(num_cpus=0.25, runtime_env={"env_vars": env})
    def big_tensor() -> tuple[str | None, int]:
        import os

        import torch

        x = torch.empty(64 << 20, dtype=torch.uint8)  # above glibc's largest mmap threshold (32 MiB)
        return os.environ.get("THP_MEM_ALLOC_ENABLE"), x.data_ptr() % 4096

    switch, offset = ray_cluster.get(big_tensor.remote(), timeout=60)
    assert switch == ("1" if huge_pages else None)
    # switched on, torch page-aligns a large tensor and advises huge pages for it (madvise); whether the
    # kernel then backs it with them depends on /sys/kernel/mm/transparent_hugepage and free memory
    assert (offset == 0) == huge_pages


def test_too_big_placement_fails_within_its_timeout_naming_each_pool(ray_cluster) -> None:
    from miles.core.cluster import reserve

    before = ray_cluster.util.placement_group_table()
    colocate = _plan({"trainer_world_size": 4, "cpus_per_bundle": 2.0, "ready_timeout_s": 1.0})
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"placement 'colocate' asks for 4 bundle\(s\) x 2 CPU = 8 CPU, but the "
                                          r"cluster has \d+ of 4 CPU available \(waited 1 s\)"):
        reserve(colocate)
    disagg = _plan({"name": "disaggregated", "trainer_world_size": 4, "cpus_per_trainer_rank": 2.0,
                    "ready_timeout_s": 1.0})
    with pytest.raises(ConfigError) as e:
        reserve(disagg)
    msg = str(e.value)
    assert ("asks for engine pool 1 bundle(s) x 1 CPU = 1 CPU + trainer pool 4 bundle(s) x 2 CPU = 8 CPU = 9 CPU in "
            "all, but the cluster has") in msg
    assert "not placed: trainer pool)" in msg, msg  # the engine pool fitted; only the trainer pool did not
    pinned = _plan({"name": "disaggregated", "engine_resources": {"node2": 1}, "ready_timeout_s": 1.0})
    with pytest.raises(ConfigError, match=r"\(\+ node2: 1 per bundle\).*, 0 of 0 node2 available .*not placed: "
                                          r"engine pool\)\. .*add nodes that offer the custom resources"):
        reserve(pinned)
    assert time.perf_counter() - t0 < 20
    removed = {k for k, v in ray_cluster.util.placement_group_table().items() if v["state"] == "REMOVED"}
    assert set(ray_cluster.util.placement_group_table()) - set(before) <= removed, "every group was released"


def _generate(engine, ray) -> list:
    from miles.types import GenerateRequest, SamplingParams

    req = GenerateRequest(request_id="r", prompt_ids=(5, 6, 7), n=2, seed=1)
    return ray.get(engine.generate.remote([req], SamplingParams(temperature=1.0, max_new_tokens=4)))


def test_colocate_engines_offload_and_restore(ray_cluster, tiny_qwen3_dir: Path) -> None:
    from miles.core.actors import create_actors
    from miles.weights.sync import sync_weights

    run = _run({"cpus_per_bundle": 1.0, "ready_timeout_s": 30.0}, address="auto")
    actors = create_actors(make_plan(run, Machine(cpus=4)), run, str(tiny_qwen3_dir))
    try:
        assert len(actors.placement_groups) == 1 and actors.placement_groups[0].bundle_specs == [{"CPU": 1.0}]
        assert actors.nodes["engine"] == actors.nodes["trainer"]
        before = _generate(actors.engines[0], ray_cluster)
        ray_cluster.get(actors.start_offload())
        with pytest.raises(Exception, match="resume_memory"):  # released: generating is an error
            _generate(actors.engines[0], ray_cluster)
        ray_cluster.get([e.resume_memory.remote() for e in actors.engines])  # bit-exactly, as released
        after = _generate(actors.engines[0], ray_cluster)
        assert [r.response_ids for r in after] == [r.response_ids for r in before], "weights restored exactly"
        sync_weights(actors.trainers, actors.engines, version=1)
        assert ray_cluster.get(actors.engines[0].weight_version.remote()) == 1
        ray_cluster.get(actors.start_offload())  # a weight sync brings a released engine back by itself
        sync_weights(actors.trainers, actors.engines, version=2)
        assert [r.response_ids for r in _generate(actors.engines[0], ray_cluster)] == [r.response_ids for r in before]
    finally:
        actors.shutdown()


def test_disaggregated_actors_get_their_own_pools_and_never_offload(ray_cluster, tiny_qwen3_dir: Path) -> None:
    from miles.core.actors import create_actors

    run = _run({"name": "disaggregated", "cpus_per_engine": 1.0, "cpus_per_trainer_rank": 1.0,
                "ready_timeout_s": 30.0}, address="auto")
    actors = create_actors(make_plan(run, Machine(cpus=4)), run, str(tiny_qwen3_dir))
    try:
        engine_pg, trainer_pg = actors.placement_groups
        assert engine_pg.bundle_specs == [{"CPU": 1.0}] and trainer_pg.bundle_specs == [{"CPU": 1.0}]
        assert [s.threads for s in actors.plan.engines + actors.plan.trainers] == [1, 1]
        assert actors.start_offload() == []
        assert len(_generate(actors.engines[0], ray_cluster)) == 2  # still serving: nothing was released
        # a threaded actor: with the engine paused, a generate call waits inside it while health() answers
        from miles.types import GenerateRequest, SamplingParams

        engine = actors.engines[0]
        ray_cluster.get(engine.pause.remote(), timeout=30)
        call = engine.generate.remote([GenerateRequest(request_id="q", prompt_ids=(5, 6), n=3)],
                                      SamplingParams(temperature=1.0, max_new_tokens=4))
        deadline = time.monotonic() + 30
        while (h := ray_cluster.get(engine.health.remote(), timeout=30))["waiting"] == 0:
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        ray_cluster.get(engine.resume.remote(), timeout=30)
        assert len(ray_cluster.get(call, timeout=60)) == 3
    finally:
        actors.shutdown()


# ---- end to end (slow) --------------------------------------------------------------------------

def _miles(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 420) -> str:
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", **(env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-m", "miles", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """``ray start --block`` in its own session, on free ports, so that we can end exactly what we started."""
    ports = {f"--{k}-port={_free_port()}" for k in ("node-manager", "object-manager", "dashboard-agent-listen",
                                                       "dashboard-agent-grpc", "metrics-export", "runtime-env-agent")}
    cmd = [shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray", "start", "--block",
           "--disable-usage-stats", "--include-log-monitor=false", "--node-ip-address=127.0.0.1",
           "--object-store-memory=200000000", *sorted(ports), *args]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of one ``ray start --block`` (its raylet, GCS, agents), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def two_node_cluster(head_cpus: int, node2_cpus: int) -> Iterator[tuple[str, dict]]:
    """A head and a second node (with the custom resource ``node2``) on this machine; yields (address, env).

    Its own temp dir, ports and auth token: nothing is shared with other Ray instances on the machine,
    and only the processes started here are ended (never ``ray stop``, which ends every Ray on the host).
    The temp dir is short on purpose: Ray's socket paths must stay under 108 bytes.
    """
    tmp = Path(tempfile.mkdtemp(prefix="miles-ray-", dir="/tmp"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    temp_dir = f"--temp-dir={tmp}"
    procs = [_ray_start(["--head", f"--port={port}", f"--num-cpus={head_cpus}", "--include-dashboard=false",
                         temp_dir], tmp / "head.log", env)]
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert procs[0].poll() is None, "ray head died:\n" + (tmp / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "ray head not up after 120 s:\n" + (tmp / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        procs.append(_ray_start([f"--address=127.0.0.1:{port}", f"--num-cpus={node2_cpus}",
                                 '--resources={"node2": 1}', temp_dir], tmp / "node2.log", env))
        yield f"127.0.0.1:{port}", env
    except BaseException:
        for name in ("head.log", "node2.log"):
            if (tmp / name).exists():
                print(f"--- {name}\n" + (tmp / name).read_text()[-3000:])
        raise
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_two_nodes_engines_on_the_second_node(tmp_path: Path) -> None:
    """Join a two-node cluster; the engine pool needs ``node2``, which only the second node has."""
    with two_node_cluster(head_cpus=2, node2_cpus=1) as (address, env):
        out = _miles(["placement=disaggregated", "placement.engine_resources={node2:1}", f"cluster.address={address}",
                      "placement.ready_timeout_s=120", "trainer.num_steps=2", "warm_start.steps=2", "tracking=none",
                      "task.num_eval_prompts=16", f"warm_start.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path, env=env)
    assert "placement 'disaggregated': engine pool 1 bundle(s) x 1 CPU" in out, out[-3000:]
    m = re.search(r"engines on node\(s\) (\w+) with \d+ thread\(s\) each, trainer ranks on node\(s\) (\w+)", out)
    assert m, out[-3000:]
    assert m.group(1) != m.group(2), "the engine (node2's resource) and the trainer (no room on node2) are on two nodes"
    assert "step 2/2" in out and "done in" in out



def test_free_port_is_below_the_ephemeral_range_and_falls_back_when_it_is_taken(monkeypatch) -> None:
    import miles.machine as machine

    port = machine.free_port()
    assert machine.RENDEZVOUS_PORTS[0] <= port < machine.RENDEZVOUS_PORTS[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free when returned
    with socket.socket() as held:  # the whole range taken: the kernel's free port instead
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(machine, "RENDEZVOUS_PORTS", (taken, taken + 1))
        assert machine.free_port(attempts=1) != taken


def test_free_port_does_not_follow_the_runs_seed() -> None:
    """Runs seeded alike (a parallel sweep) must not try the same ports: the draw leaves the global
    generator alone and does not repeat after it is reseeded."""
    import random

    import miles.machine as machine

    random.seed(0)
    expected = random.random()
    random.seed(0)
    ports = [machine.free_port() for _ in range(8)]
    assert random.random() == expected  # the global generator was not drawn from
    random.seed(0)
    assert [machine.free_port() for _ in range(8)] != ports
