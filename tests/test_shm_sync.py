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
        assert len(files) == 3, f"one control page, one segment and the file its processes hold, found {sorted(files)}"
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


def _greedy(engine, prompt=(5, 6, 7, 8, 9)) -> tuple[list[int], list[float]]:
    from miles.types import GenerateRequest, SamplingParams

    (r,) = ray.get(engine.generate.remote([GenerateRequest(request_id="g", prompt_ids=tuple(prompt))],
                                          SamplingParams(temperature=0.0, greedy=True, max_new_tokens=12)))
    return list(r.response_ids), list(r.logprobs)


def test_engines_compute_in_place_from_the_slot_exactly_as_from_a_copy(actors, tiny_qwen3_dir) -> None:
    """A CPU engine takes an shm version without copying it (its weights are the slot's pages, pinned) and
    generates exactly what an engine that copied the same weights generates: through a slot it had before
    (versions 1, 2, 3 in slots A, B, A), after a release and resume, and alongside an engine that copies
    another version afterwards (which must not write into the slot the first one computes from)."""
    _, _, engines = actors
    sources = [ray.remote(WeightSource).options(**ACTOR).remote("tiny", seed=s) for s in (21, 22, 23)]
    copying = ray.remote(TorchEngine).options(**ACTOR).remote(str(tiny_qwen3_dir), PrecisionConfig(), num_threads=1,
                                                              engine_id=9)
    transport = make_transport(CFG, [sources[0]], engines)
    store = make_transport(WeightSyncConfig(transport="object_store"), [sources[0]], [copying])
    try:
        for version, source in enumerate(sources, start=1):
            metrics = sync_weights([source], engines, version, transport)
            assert metrics["weight_sync/in_place"] == 1.0
            assert sync_weights([source], [copying], version, store)["weight_sync/in_place"] == 0.0
            want = _greedy(copying)
            assert [_greedy(e) for e in engines] == [want, want], f"version {version}"
        ray.get(engines[0].release_memory.remote())
        ray.get(engines[0].resume_memory.remote())
        assert _greedy(engines[0]) == want
        held = ray.get(sources[2].state_dict.remote())
        sync_weights([sources[0]], [engines[0]], 4, store)  # a copy: engine 0 gets weights of its own again
        assert _greedy(engines[0]) != want
        _assert_hold(engines[1:], held, 3)  # the slot engine 1 computes from was not written
    finally:
        transport.close()
        for a in [*sources, copying]:
            ray.kill(a)


def test_a_slot_an_engine_computes_from_is_never_written(actors) -> None:
    """Rank 0 writes each version into a slot no live engine process computes from; with both slots pinned by
    live processes the send fails with the reason, and a pin of a process that ended no longer counts."""
    import subprocess

    from miles.weights import shm
    from miles.weights.shm_pins import MAX_PINS, PINS_AT, slots_pinned

    source, _, engines = actors
    transport = make_transport(CFG, [source], engines)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        sync_weights([source], engines, 1, transport)  # slot 0, pinned by both engines
        ray.get(source.perturb.remote(2))
        sync_weights([source], engines, 2, transport)  # slot 1: the engines move there, slot 0 is free
        ctl = shm._map(shm._ctl_path(transport.prefix), 0, create=False).view(torch.int64)
        assert set(slots_pinned(ctl)) == {1}
        free = next(i for i in range(MAX_PINS) if int(ctl[PINS_AT + 2 * i]) == 0)
        ctl[PINS_AT + 2 * free], ctl[PINS_AT + 2 * free + 1] = bystander.pid, 1  # another process on slot 0
        assert slots_pinned(ctl) == {0: [bystander.pid], 1: slots_pinned(ctl)[1]}
        with pytest.raises(RuntimeError, match="both slots are in use by engines computing in place"):
            sync_weights([source], engines, 3, transport)
        _assert_hold(engines, ray.get(source.state_dict.remote()), 2)
        bystander.kill()
        bystander.wait()
        transport.failed()
        sync_weights([source], engines, 3, transport)  # the ended process's pin does not count
        assert ray.get(engines[0].weight_version.remote()) == 3
    finally:
        bystander.kill()
        transport.close()


# --- weight_sync.transport=auto ---------------------------------------------------------------------

TORCH_ENGINE = "miles.rollout.torch_engine.TorchEngine"


def test_auto_sends_the_first_version_through_the_object_store_and_the_rest_through_shm(actors) -> None:
    """auto on CPU torch engines of a one-node cluster: version 1 through the object store (copied in),
    then shm (the engines compute from the slot in place); every version arrives bit-identical."""
    source, _, engines = actors
    transport = make_transport(WeightSyncConfig(transport="auto"), [source], engines, engine_class=TORCH_ENGINE)
    try:
        took = []
        for version in range(1, 5):
            ray.get(source.perturb.remote(version))
            m = sync_weights([source], engines, version, transport)
            _assert_hold(engines, ray.get(source.state_dict.remote()), version)
            took.append((m["weight_sync/shm"], m["weight_sync/in_place"]))
        assert took == [(0.0, 0.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]
        assert transport.name == "auto (shm)" and transport.concurrent  # shm's later syncs overlap
    finally:
        transport.close()


@pytest.mark.parametrize("engine_class, device, why", [
    ("miles.rollout.sglang_engine.SGLangEngine", "cpu", "shared memory is used with " + TORCH_ENGINE),
    (TORCH_ENGINE, "cuda", "only CPU runs"),
])
def test_auto_keeps_the_object_store_where_shm_is_not_used(actors, engine_class: str, device: str, why: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    source, _, engines = actors
    transport = make_transport(WeightSyncConfig(transport="auto"), [source], engines, engine_class=engine_class,
                               device=device)
    try:
        with caplog.at_level("INFO", logger="miles.weights.auto"):
            for version in (1, 2):
                ray.get(source.perturb.remote(version))
                assert sync_weights([source], engines, version, transport)["weight_sync/shm"] == 0.0
                _assert_hold(engines, ray.get(source.state_dict.remote()), version)
        assert transport.name == "auto (object_store)"
        assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        transport.close()


def test_auto_refuses_shm_for_versions_too_big_for_the_shm_dir(ray_cluster, tmp_path: Path) -> None:
    from miles.weights.auto import shm_reason

    cfg = WeightSyncConfig(transport="auto", shm_dir=str(tmp_path))
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert "more than half" in shm_reason(cfg, free // 3, device="cpu", engine_class=TORCH_ENGINE)
    missing = WeightSyncConfig(transport="auto", shm_dir=str(tmp_path / "missing"))
    assert "missing" in shm_reason(missing, 1, device="cpu", engine_class=TORCH_ENGINE)
