"""Sharded trainer state (every FSDP rank writes its own part, :mod:`miles.train.shards`) and crash-safe saves."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ray import cloudpickle
from safetensors.torch import load_file

from miles.config import checkpoints, validate
from miles.core import resume
from miles.train.optim import load_train_state, read_train_tensors, save_train_state

CHILD = Path(__file__).with_name("ckpt_kill_child.py")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save_full(trainer, directory: str) -> None:
    """Inside a rank: the format 1 state (full tensors gathered on rank 0), for comparison."""
    save_train_state(
        directory,
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        rank=trainer.rank,
        world_size=trainer.world_size,
        sharded=False,
    )


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import tests/


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b) and len(a) > 10, what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)


@pytest.fixture(scope="module")
def two_ranks(ray_cluster, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """After one train step, 2 FSDP ranks save their state (``sharded``: format 2) and, for comparison, the
    same state gathered on rank 0 (``full``: format 1)."""
    from fsdp_ranks import Group, hf_model_from, rl_batch

    tmp_path = tmp_path_factory.mktemp("two_ranks")
    group = Group(ray_cluster, 2, tiny_qwen3_dir, _run())
    try:
        group.call("train_step", rl_batch(hf_model_from(tiny_qwen3_dir)))
        group.call("save_state", str(tmp_path / "sharded"))
        ray_cluster.get([a.__ray_call__.remote(_save_full, str(tmp_path / "full")) for a in group.actors])
    finally:
        group.close()
    return tmp_path


def _run():
    return validate({"trainer": {"lr": 1e-3, "lr_warmup_steps": 2}})


def test_two_ranks_write_their_own_shards_and_one_rank_loads_them(
    two_ranks: Path, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    """Saved by 2 FSDP ranks (each its own file), loaded by 1: weights and AdamW state bit for bit those the 2 ranks
    held (their gathered format 1 state), and the schedule's counters too."""
    from fsdp_ranks import local_trainer

    run = _run()
    sharded = two_ranks / "sharded"
    meta = json.loads((sharded / "trainer_state.json").read_text())
    assert (meta["format"], meta["world_size"]) == (2, 2)
    assert not (sharded / "model.safetensors").exists()
    parts = sorted(p.name for p in (sharded / "shards").glob("*.distcp"))
    assert parts == ["__0_0.distcp", "__1_0.distcp"]
    full_bytes = sum(p.stat().st_size for p in (two_ranks / "full").glob("*.safetensors"))
    for p in parts:  # no rank wrote the whole state
        assert (sharded / "shards" / p).stat().st_size < 0.75 * full_bytes, p

    want_model, want_optim = read_train_tensors(two_ranks / "full")
    got_model, got_optim = read_train_tensors(sharded)  # full tensors from the shards, in this process
    _assert_same(want_model, got_model, "model, read from the shards")
    _assert_same(want_optim, got_optim, "optimizer, read from the shards")

    with local_trainer(tiny_qwen3_dir, run) as one:  # world size 1: resharded on load
        one.load_state(str(sharded))
        assert one.scheduler.state_dict()["last_epoch"] == 1
        one.save_state(str(tmp_path / "one"))  # one rank: format 1, full tensors
    model, optim = (
        load_file(tmp_path / "one" / "model.safetensors"),
        load_file(tmp_path / "one" / "optimizer.safetensors"),
    )
    _assert_same(want_model, model, "model, loaded by one rank")
    _assert_same(want_optim, optim, "optimizer, loaded by one rank")
    saved = [
        json.loads((d / "trainer_state.json").read_text()) for d in (two_ranks / "full", tmp_path / "one")
    ]
    assert saved[0]["param_groups"] == saved[1]["param_groups"] == meta["param_groups"]
    assert saved[0]["scheduler"] == saved[1]["scheduler"] == meta["scheduler"]


@pytest.mark.megatron
def test_the_megatron_trainer_resumes_from_fsdp_shards(
    two_ranks: Path, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    """The megatron trainer (one rank; DCP reads the regions of its parameters) loads the 2 FSDP ranks' shards
    and writes back the same weights and AdamW state."""
    pytest.importorskip("megatron.core")
    from megatron_ranks import local_megatron

    with local_megatron(tiny_qwen3_dir, _run()) as trainer:
        trainer.load_state(str(two_ranks / "sharded"))
        trainer.save_state(str(tmp_path / "megatron"))
    want_model, want_optim = read_train_tensors(two_ranks / "full")
    _assert_same(want_model, load_file(tmp_path / "megatron" / "model.safetensors"), "model")
    _assert_same(want_optim, load_file(tmp_path / "megatron" / "optimizer.safetensors"), "optimizer")


class _Payload:
    """Unpickling this creates ``marker``: the proof that a pickle was read."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _small_state(
    directory: Path,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    from ckpt_kill_child import model_and_optimizer, train_step

    model, optimizer, scheduler = model_and_optimizer()
    train_step(model, optimizer, scheduler, 1)
    save_train_state(
        directory, model=model, optimizer=optimizer, scheduler=scheduler, rank=0, world_size=1, sharded=True
    )
    return model_and_optimizer()


def test_a_changed_metadata_file_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    state = tmp_path / "trainer"
    model, optimizer, scheduler = _small_state(state)
    marker = tmp_path / "unpickled"
    (state / "shards" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    refused = (
        r"refusing the sharded trainer state in .*trainer: .*shards/\.metadata: .*changed or damaged.* Nothing "
        r"of it was read"
    )
    with pytest.raises(ValueError, match=refused):
        load_train_state(state, model=model, optimizer=optimizer, scheduler=scheduler, rank=0, world_size=1)
    with pytest.raises(ValueError, match=refused):
        read_train_tensors(state)  # the megatron trainer's way in
    assert not marker.exists()
    # the payload is live: reading it would have shown
    pickle.loads((state / "shards" / ".metadata").read_bytes())
    assert marker.exists()


def test_a_changed_shard_is_refused_and_an_intact_state_loads(tmp_path: Path) -> None:
    state = tmp_path / "trainer"
    model, optimizer, scheduler = _small_state(state)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    load_train_state(state, model=model, optimizer=optimizer, scheduler=scheduler, rank=0, world_size=1)
    want, moments = read_train_tensors(state)
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    assert not all(torch.equal(fresh[k], v) for k, v in model.state_dict().items())
    for p, entry in optimizer.state.items():  # the trained moments, not a fresh optimizer's zeros
        name = next(n for n, q in model.named_parameters() if q is p)
        assert (
            torch.equal(entry["exp_avg"], moments[f"state.{name}.exp_avg"])
            and entry["exp_avg"].abs().sum() > 0
        )
    shard = state / "shards" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"__0_0\.distcp: SHA-256 .*refused before reading it"):
        load_train_state(state, model=model, optimizer=optimizer, scheduler=scheduler, rank=0, world_size=1)


def test_a_save_killed_at_any_point_leaves_the_last_complete_checkpoint(tmp_path: Path) -> None:
    """A real save in a child process, SIGKILLed at each point; the newest complete checkpoint is taken (never the
    partial one), it loads with the weights of its step, and the next save goes through."""
    from ckpt_kill_child import POINTS, model_and_optimizer, save

    env = dict(os.environ, PYTHONPATH=str(CHILD.parent.parent), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), *POINTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ended = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert ended == {p: str(int(signal.SIGKILL)) for p in POINTS}, done.stderr[-3000:]

    for point in POINTS:
        save_dir, ref = tmp_path / point / "ck", tmp_path / point / "ref"
        tmp = save_dir / "step_000002.tmp"
        left = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*")) if tmp.exists() else None
        expected = {"before_shards": [], "after": None}.get(point)
        if point == "mid_shards":
            expected = ["trainer.tmp", "trainer.tmp/shards", "trainer.tmp/shards/__0_0.distcp"]
        if point in ("before_manifest", "before_rename"):
            assert "loop_state.json" in left and "trainer/shards/.metadata" in left
            assert ("manifest.json" in left) == (point == "before_rename")
        else:
            assert left == expected, point
        newest = 2 if point == "after" else 1
        assert [s for s, _ in checkpoints.checkpoints(save_dir)] == list(range(1, newest + 1)), point
        auto = validate({"trainer": {"resume_from": "auto", "save_dir": str(save_dir), "num_steps": 3}})
        path = resume.resolve_auto(auto).trainer.resume_from
        assert path == str(checkpoints.step_dir(save_dir, newest)), point
        state = checkpoints.load(path)
        checkpoints.verify(state)
        assert state.step == newest
        model, optimizer, scheduler = model_and_optimizer()
        load_train_state(
            state.path / "trainer",
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            rank=0,
            world_size=1,
        )
        want = load_file(ref / f"step_{newest}.safetensors")
        assert all(torch.equal(want[k], v) for k, v in model.state_dict().items()), point
        assert scheduler.state_dict()["last_epoch"] == newest

        # the next save completes and removes what was left
        save(save_dir, 3, model, optimizer, scheduler, None)
        assert [s for s, _ in checkpoints.checkpoints(save_dir)] == list(range(1, newest + 1)) + [3]
        assert sorted(p.name for p in save_dir.iterdir()) == [
            f"step_00000{s}" for s in range(1, newest + 1)
        ] + ["step_000003"], point
