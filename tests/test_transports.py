"""Weight-sync transports: bit-identical delivery into real engines, versions, failures, file formats."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import ray
import torch

from miles.bench.state_dicts import qwen_like_state_dict
from miles.bench.sync import WeightSource
from miles.config.schema import PrecisionConfig, WeightSyncConfig
from miles.rollout.torch_engine import TorchEngine
from miles.weights.layout import FlatLayout
from miles.weights.sync import CPU_TRANSPORTS, make_transport, sync_weights

ACTOR = dict(num_cpus=0.25, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
# 50 KiB buckets: the tiny model (~370 KiB) crosses several, with both staging buffers in use
CFG = {t: WeightSyncConfig(transport=t, bucket_mb=0.05, timeout_s=3.0) for t in CPU_TRANSPORTS}


# --- layout (no Ray) ------------------------------------------------------------------------------

def test_layout_packs_any_bucket_split_bit_identically() -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
          "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5), "ids": torch.arange(9),
          "mask": torch.tensor([True, False, True])}
    layout = FlatLayout.of(sd)
    assert all(off % 64 == 0 for off in layout.offsets)
    assert FlatLayout.from_json(layout.to_json()) == layout and FlatLayout.from_json(layout.to_json()).key == layout.key
    for bucket in (1, 7, 64, 100, layout.total_bytes):
        flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        for s in range(0, layout.total_bytes, bucket):
            e = min(s + bucket, layout.total_bytes)
            out = torch.empty(e - s, dtype=torch.uint8)
            layout.pack(sd, out, s, e)
            flat[s:e] = out
        got = layout.views(flat)
        assert list(got) == list(sd)
        for k, v in sd.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), (bucket, k)


def test_disk_round_trips_tied_views_and_empty_tensors(tmp_path: Path) -> None:
    from miles.weights.disk import DiskReceiver, DiskSender

    w = torch.randn(6, 4)
    sd = {"embed": w, "lm_head": w, "q": w[:3], "k": w[3:], "t": w.t(), "empty": torch.zeros(0)}
    sent = DiskSender(str(tmp_path)).send(sd, 3)
    got = DiskReceiver(sent.handle, 3).receive(None)
    assert set(got) == set(sd) and all(torch.equal(got[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match="holds version 3, expected 4"):
        DiskReceiver(sent.handle, 4).receive(None)


# --- transports into real engines -----------------------------------------------------------------

def _partial_source():
    class PartialSource(WeightSource):
        """Sends a state dict without lm_head: the engines must refuse it."""

        def send_weights(self, sender, version):
            return sender.send({k: v for k, v in self.sd.items() if k != "lm_head.weight"}, version)

    return ray.remote(PartialSource).options(**ACTOR).remote("tiny", seed=2)


@pytest.fixture(scope="module")
def actors(ray_cluster, tiny_qwen3_dir):
    """Two TorchEngines of the tiny Qwen3, a sender holding a same-architecture state dict, and a bad sender."""
    source = ray.remote(WeightSource).options(**ACTOR).remote("tiny", seed=1)
    bad = _partial_source()
    engines = [ray.remote(TorchEngine).options(**ACTOR).remote(str(tiny_qwen3_dir), PrecisionConfig(),
                                                                 num_threads=1, engine_id=i) for i in range(2)]
    ray.get([e.health.remote() for e in engines] + [bad.shapes.remote()], timeout=120)
    yield source, engines, bad
    for a in [source, bad, *engines]:
        ray.kill(a)


_version = iter(range(1, 10_000))


def _assert_engines_hold(engines, expected: dict[str, torch.Tensor], version: int) -> None:
    for e in engines:
        got = ray.get(e.state_dict.remote())
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected), "weights must arrive bit-identical"
        assert ray.get(e.weight_version.remote()) == version and ray.get(e.health.remote())["version"] == version


@pytest.mark.parametrize("name", CPU_TRANSPORTS)
def test_transport_delivers_bit_identical_weights_and_version(actors, name: str) -> None:
    source, engines, _ = actors
    transport = make_transport(CFG[name], [source], engines)
    try:
        for _ in range(2):  # a second version through the same transport (cached groups, segments)
            version = next(_version)
            ray.get(source.perturb.remote(version))
            m = sync_weights([source], engines, version, transport)
            _assert_engines_hold(engines, ray.get(source.state_dict.remote()), version)
            assert m["weight_sync/version"] == version and m["weight_sync/seconds"] > 0
            numel = sum(v.numel() for v in qwen_like_state_dict("tiny").values())
            assert m["weight_sync/bytes"] >= 4 * numel
    finally:
        transport.close()


@pytest.mark.parametrize("name", CPU_TRANSPORTS)
def test_failed_sync_leaves_engines_at_their_old_version(actors, name: str) -> None:
    source, engines, bad = actors
    transport = make_transport(CFG[name], [source], engines)
    try:
        good = next(_version)
        sync_weights([source], engines, good, transport)
        before = ray.get(source.state_dict.remote())
        with pytest.raises(RuntimeError, match=f"(?s)version {good + 1} over '{name}' failed.*lm_head"):
            sync_weights([bad], engines, good + 1, transport)
        _assert_engines_hold(engines, before, good)
        # the transport still works after a failure
        version = next(_version) + 1
        ray.get(source.perturb.remote(version))
        sync_weights([source], engines, version, transport)
        _assert_engines_hold(engines, ray.get(source.state_dict.remote()), version)
    finally:
        transport.close()


def test_broadcast_sender_that_died_times_out_and_next_sync_uses_a_fresh_group(actors) -> None:
    source, engines, _ = actors
    transport = make_transport(dataclasses.replace(CFG["broadcast"], timeout_s=2.0), [source], engines)
    dead = ray.remote(WeightSource).options(**ACTOR).remote("tiny")
    ray.get(dead.shapes.remote(), timeout=120)
    ray.kill(dead)
    try:
        first = next(_version)
        sync_weights([source], engines, first, transport)
        expected = ray.get(source.state_dict.remote())
        with pytest.raises(RuntimeError, match="over 'broadcast' failed"):
            sync_weights([dead], engines, first + 1, transport)
        _assert_engines_hold(engines, expected, first)
        assert transport.generation == 1
        version = next(_version) + 1
        ray.get(source.perturb.remote(version))
        sync_weights([source], engines, version, transport)
        _assert_engines_hold(engines, ray.get(source.state_dict.remote()), version)
    finally:
        transport.close()


def test_disk_writes_only_safetensors_in_one_current_version_dir(actors, tmp_path: Path) -> None:
    source, engines, _ = actors
    transport = make_transport(dataclasses.replace(CFG["disk"], disk_dir=str(tmp_path / "w")), [source], engines)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "venv").mkdir()  # not ours: must survive cleanup
    try:
        for _ in range(3):
            version = next(_version)
            sync_weights([source], engines, version, transport)
        dirs = sorted(p.name for p in (tmp_path / "w").iterdir())
        assert dirs == [f"v{version:08d}", "venv"], "older versions must be removed"
        files = [p for p in (tmp_path / "w").rglob("*") if p.is_file()]
        assert [p.name for p in files] == ["model.safetensors"]
        raw = files[0].read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])  # the safetensors format: a JSON header, then raw tensor bytes
        assert header["__metadata__"]["miles_weight_version"] == str(version)
        assert set(header) - {"__metadata__"} == set(ray.get(source.state_dict.remote()))
        assert raw[8 + n:8 + n + 2] != b"\x80\x04" and b"pickle" not in raw[:8 + n]
    finally:
        transport.close()
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["venv"]


def test_disk_version_dir_missing_on_the_engine_side_is_a_clear_error(actors, tmp_path: Path) -> None:
    import shutil

    from miles.weights.disk import DiskReceiver

    source, engines, _ = actors
    transport = make_transport(dataclasses.replace(CFG["disk"], disk_dir=str(tmp_path)), [source], engines)
    try:
        version = next(_version)
        sync_weights([source], engines, version, transport)
        expected = ray.get(source.state_dict.remote())
        sent = ray.get(source.send_weights.remote(transport.sender(version + 1), version + 1))
        shutil.rmtree(sent.handle)  # as if engines were on a node that does not share disk_dir
        with pytest.raises(ray.exceptions.RayTaskError, match="shared filesystem"):
            ray.get(engines[0].update_weights_from.remote(DiskReceiver(sent.handle, version + 1), version + 1))
        _assert_engines_hold(engines[:1], expected, version)
    finally:
        transport.close()


def test_shm_refuses_a_stale_segment_and_another_node(actors) -> None:
    from miles.weights.shm import ShmReceiver

    source, engines, _ = actors
    transport = make_transport(CFG["shm"], [source], engines)
    try:
        version = next(_version)
        m = sync_weights([source], engines, version, transport)
        assert m["weight_sync/bytes"] > 0
        expected = ray.get(source.state_dict.remote())
        sent = ray.get(source.send_weights.remote(transport.sender(version), version))
        stale = ShmReceiver(transport.prefix, sent.handle, version + 1)
        with pytest.raises(ray.exceptions.RayTaskError, match=f"holds version {version} \\(ready\\), expected {version + 1}"):
            ray.get(engines[0].update_weights_from.remote(stale, version + 1))
        elsewhere = ShmReceiver(transport.prefix, {**sent.handle, "node_id": "another-node"}, version)
        with pytest.raises(ray.exceptions.RayTaskError, match="weight_sync=broadcast"):
            ray.get(engines[0].update_weights_from.remote(elsewhere, version))
        _assert_engines_hold(engines[:1], expected, version)
    finally:
        transport.close()
    assert not list(Path("/dev/shm").glob(Path(transport.prefix).name + "*")), "close() must unlink the segment"


def test_bad_transport_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="weight_sync.bucket_mb"):
        make_transport(dataclasses.replace(CFG["broadcast"], bucket_mb=0), [], [object()])
    with pytest.raises(ValueError, match="weight_sync.shm_dir"):
        make_transport(dataclasses.replace(CFG["shm"], shm_dir="/no/such/dir"), [], [object()])
    with pytest.raises(ValueError, match="no engines"):
        make_transport(CFG["disk"], [], [])


@pytest.mark.parametrize("placement,device", [("colocate", "cpu"), ("disaggregated", "cuda")])
def test_ipc_needs_colocated_engines_on_one_gpu(placement: str, device: str) -> None:
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match=f"weight_sync=ipc: .* this run has placement={placement} on {device}"):
        make_transport(WeightSyncConfig(transport="ipc"), [], [object()], placement=placement, device=device)


def _adapter_source(sd: dict[str, torch.Tensor]):
    class AdapterSource:
        """Sends LoRA adapter tensors only (adapter=lora), as the trainer does."""

        def __init__(self, sd):
            self.sd = sd

        def send_weights(self, sender, version):
            return sender.send(self.sd, version)

        def ready(self):
            return True

    return ray.remote(AdapterSource).options(**ACTOR).remote(sd)


def test_every_transport_delivers_adapter_only_updates(ray_cluster, tiny_qwen3_dir) -> None:
    """adapter=lora: the sync carries the adapters' tensors alone, bit-identical, over every CPU transport."""
    from miles.adapters import lora
    from miles.config.schema import AdapterConfig

    adapter = AdapterConfig(kind="lora", rank=4, alpha=8.0)
    engines = [ray.remote(TorchEngine).options(**ACTOR).remote(str(tiny_qwen3_dir), PrecisionConfig(), num_threads=1,
                                                                engine_id=i, adapter=adapter, adapter_names=("x", "y"))
               for i in range(2)]
    try:
        held = {n: ray.get(engines[0].adapter_state.remote(n)) for n in ("x", "y")}
        for name in CPU_TRANSPORTS:
            version = next(_version)
            g = torch.Generator().manual_seed(version)
            sd = {f"{lora.SYNC_PREFIX}{n}:{k}": torch.randn(v.shape, generator=g) for n in held for k, v in held[n].items()}
            source = _adapter_source(sd)
            ray.get([source.ready.remote()] + [e.health.remote() for e in engines])
            cfg = dataclasses.replace(CFG[name], timeout_s=60.0)  # a fresh sender process on a loaded machine
            transport = make_transport(cfg, [source], engines)
            try:
                m = sync_weights([source], engines, version, transport)
            finally:
                transport.close()
                ray.kill(source)
            assert 4 * sum(v.numel() for v in sd.values()) <= m["weight_sync/bytes"] < 8 * sum(v.numel() for v in sd.values())
            for e in engines:
                assert ray.get(e.weight_version.remote()) == version
                for n in held:
                    got = ray.get(e.adapter_state.remote(n))
                    assert all(torch.equal(got[k], sd[f"{lora.SYNC_PREFIX}{n}:{k}"]) for k in got), (name, n)
    finally:
        for e in engines:
            ray.kill(e)


_SEND_AND_WAIT = """
import sys, time, torch
from miles.weights.shm import ShmSender
ShmSender(sys.argv[1]).send({"w": torch.arange(1000, dtype=torch.float32)}, 1)
print("sent", flush=True)
time.sleep(120)
"""


def test_a_killed_runs_shm_files_are_removed_by_the_next_run_and_a_live_runs_are_kept(tmp_path: Path) -> None:
    """A run killed before its driver closed the transport leaves its control page and segment in the shm dir
    (a tmpfs holds them in memory); the next run's rank 0 removes them at its first send. A run whose rank 0
    (or an engine) is alive holds its control page, and its files stay."""
    import os
    import signal
    import subprocess
    import sys

    from miles.weights.shm import ShmReceiver, ShmSender, drop_process_state

    killed, live, new = (str(tmp_path / f"miles-weights-{n:012x}") for n in (1, 2, 3))
    proc = subprocess.Popen([sys.executable, "-c", _SEND_AND_WAIT, killed], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "sent\n"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    files = lambda stem: sorted(p.name for p in tmp_path.glob(f"{Path(stem).name}-*"))  # noqa: E731
    assert len(files(killed)) == 3  # its control page, its segment and the file its processes hold
    try:
        sent = ShmSender(live).send({"w": torch.ones(10)}, 1)  # the next run: this process holds its page
        assert files(killed) == [] and len(files(live)) == 3
        ShmSender(new).send({"w": torch.zeros(10)}, 1)
        assert files(killed) == [] and len(files(live)) == 3 and len(files(new)) == 3
        assert ShmReceiver(live, sent.handle, 1).receive(object())["w"].sum() == 10  # still whole
        os.unlink(f"{live}-ctl")  # a page removed under a reader that had not opened it yet: a clear error
        with pytest.raises(FileNotFoundError, match="control page .* is gone"):
            ShmReceiver(live + "x", {**sent.handle, "ctl": f"{live}-ctl"}, 1).receive(object())
    finally:
        drop_process_state()
