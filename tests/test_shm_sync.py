"""Shared-memory weight sync: segments reused across syncs, sending and loading overlapped, a sender that
fails part-way leaves the engines at their old version."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray
import torch

from miles.bench.sync import WeightSource
from miles.config.schema import PrecisionConfig, WeightSyncConfig
from miles.rollout.torch_engine import TorchEngine
from miles.weights.sync import make_transport, sync_weights

ACTOR = dict(num_cpus=0.25, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
CFG = WeightSyncConfig(transport="shm", timeout_s=20.0)


def _failing_source():
    class SlowDict(dict):
        """A state dict whose ``lm_head`` is handed out late and cannot be read (a trainer that fails mid-send)."""

        def __getitem__(self, name):
            if name == "lm_head.weight":
                time.sleep(1.0)  # the engines are copying what came before meanwhile
            return super().__getitem__(name)

    class FailingSource(WeightSource):
        def send_weights(self, sender, version):
            sd = SlowDict(self.sd)
            sd["lm_head.weight"] = torch.empty_like(
                self.sd["lm_head.weight"], device="meta"
            )  # copying it raises
            return sender.send(sd, version)

    return ray.remote(FailingSource).options(**ACTOR).remote("tiny", seed=5)


@pytest.fixture(scope="module")
def actors(ray_cluster, tiny_qwen3_dir):
    source = ray.remote(WeightSource).options(**ACTOR).remote("tiny", seed=1)
    failing = _failing_source()
    engines = [
        ray.remote(TorchEngine)
        .options(**ACTOR)
        .remote(str(tiny_qwen3_dir), PrecisionConfig(), num_threads=1, engine_id=i)
        for i in range(2)
    ]
    ray.get([e.health.remote() for e in engines] + [failing.shapes.remote()], timeout=120)
    yield source, failing, engines
    for a in [source, failing, *engines]:
        ray.kill(a)


def _assert_hold(engines, expected: dict[str, torch.Tensor], version: int) -> None:
    for e in engines:
        got = ray.get(e.state_dict.remote())
        assert all(torch.equal(got[k], expected[k]) for k in expected), "weights must be bit-identical"
        assert ray.get(e.weight_version.remote()) == version


def _files(transport) -> dict[str, int]:
    parent, stem = os.path.split(transport.prefix)
    return {p.name: p.stat().st_ino for p in Path(parent).glob(f"{stem}-*")}


def test_segments_are_reused_and_later_syncs_overlap_send_and_load(actors) -> None:
    source, _, engines = actors
    transport = make_transport(CFG, [source], engines)
    try:
        assert not transport.concurrent
        sync_weights([source], engines, 1, transport)
        files = _files(transport)
        assert len(files) == 2, f"one control page and one segment, found {sorted(files)}"
        assert transport.concurrent, "after a sync through the segment, sender and engines run together"
        for version in range(2, 6):
            ray.get(source.perturb.remote(version))
            sync_weights([source], engines, version, transport)
            _assert_hold(engines, ray.get(source.state_dict.remote()), version)
            assert _files(transport) == files, "the same files (same inodes) serve every version"
    finally:
        transport.close()
    assert not _files(transport), "close() must unlink every file"


def test_sender_failing_part_way_leaves_engines_at_their_old_version(actors) -> None:
    source, failing, engines = actors
    transport = make_transport(CFG, [source], engines)
    try:
        sync_weights([source], engines, 10, transport)
        ray.get(source.perturb.remote(11))
        sync_weights([source], engines, 11, transport)  # both slots hold a version now
        before = ray.get(source.state_dict.remote())
        assert transport.concurrent
        with pytest.raises(RuntimeError, match="version 12 over 'shm' failed"):
            sync_weights([failing], engines, 12, transport)
        _assert_hold(engines, before, 11)
        assert not transport.concurrent, "after a failure the next sync runs one side after the other"
        # the same failure seen from an engine that had copied part of version 13 when the sender failed
        transport.handle = ray.get(source.send_weights.remote(transport.sender(11), 11)).handle
        send = failing.send_weights.remote(transport.sender(13), 13)
        recv = engines[0].update_weights_from.remote(transport.receiver(0, 13, None), 13)
        with pytest.raises(ray.exceptions.RayTaskError, match="Cannot copy out of meta"):
            ray.get(send)
        with pytest.raises(
            ray.exceptions.RayTaskError, match="version 13 did not arrive.*put back to version 11"
        ):
            ray.get(recv)
        _assert_hold(engines, before, 11)
        transport.failed()
        ray.get(source.perturb.remote(13))
        sync_weights([source], engines, 13, transport)
        ray.get(source.perturb.remote(14))
        sync_weights([source], engines, 14, transport)
        _assert_hold(engines, ray.get(source.state_dict.remote()), 14)
    finally:
        transport.close()
