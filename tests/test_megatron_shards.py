"""Sharded megatron trainer state: two ranks each write their own regions of the HF tensors (DCP, format 2),
and the state reshards on load: saved at TP=2, the next step at PP=2 and at one rank is the uninterrupted one.

Tolerances: the same step at another layout sums in another order (test_megatron.py): metrics rel 1e-5 /
abs 1e-6, weights after the AdamW step atol 3e-5.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from fsdp_ranks import hf_model_from, rl_batch  # noqa: E402
from megatron_ranks import MegatronPair, local_megatron  # noqa: E402
from ray import cloudpickle  # noqa: E402

from miles.config.validate import validate  # noqa: E402
from miles.train.optim import read_train_tensors  # noqa: E402

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP in one process
]


def _run(**trainer: int) -> Any:
    return validate(
        {
            "trainer": {"lr": 1e-3, "lr_warmup_steps": 0, "shared_prompt_forward": False, **trainer},
            "placement": {"trainer_world_size": 2 if trainer else 1},
        }
    )


def _save_gathered(trainer: Any, directory: str) -> None:
    """Inside a rank: the format 1 state (gathered on rank 0), for comparison."""
    from miles.train.megatron import state

    state.save_state(trainer, directory, sharded=False)


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import tests/


def _train(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("train/") and k != "train/num_microbatches"}


def _same_step(got: tuple[dict, dict], want: tuple[dict, dict], what: str) -> None:
    (metrics, weights), (want_metrics, want_weights) = got, want
    assert set(_train(metrics)) == set(_train(want_metrics)), what
    for k, v in _train(want_metrics).items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (what, k)
    assert list(weights) == list(want_weights), what
    for k, v in want_weights.items():
        torch.testing.assert_close(weights[k], v, atol=3e-5, rtol=0, msg=f"{what}: {k}")


@pytest.fixture(scope="module")
def saved(
    megatron_pair: MegatronPair, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """TP=2 after one step saves sharded (and, for comparison, gathered), then takes a second step; PP=2 loads
    the sharded state and takes the same second step."""
    root = tmp_path_factory.mktemp("megatron_shards")
    batch = rl_batch(hf_model_from(tiny_qwen3_dir))
    group = megatron_pair.load(tiny_qwen3_dir, _run(tensor_parallel=2))
    group.call("train_step", batch)
    group.call("save_state", str(root / "tp2"))
    group.probe(_save_gathered, str(root / "gathered"))
    continued = group.call("train_step", batch)[0], group.call("full_state_dict")[0]
    group = megatron_pair.load(tiny_qwen3_dir, _run(pipeline_parallel=2))
    group.call("load_state", str(root / "tp2"))
    pp2 = group.call("train_step", batch)[0], group.call("full_state_dict")[0]
    return {"root": root, "batch": batch, "continued": continued, "pp2": pp2}


def test_two_ranks_each_write_their_own_shard(saved: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    state, gathered = saved["root"] / "tp2", saved["root"] / "gathered"
    meta = json.loads((state / "trainer_state.json").read_text())
    assert (meta["format"], meta["world_size"]) == (2, 2)
    assert not (state / "model.safetensors").exists() and not (state / "optimizer.safetensors").exists()
    parts = sorted(p.name for p in (state / "shards").glob("*.distcp"))
    assert parts == ["__0_0.distcp", "__1_0.distcp"]
    listed = json.loads((state / "shards" / "manifest.json").read_text())["files"]
    assert sorted(listed) == [".metadata", *parts]
    full_bytes = sum(p.stat().st_size for p in gathered.glob("*.safetensors"))
    for p in parts:  # each rank wrote about half: its TP halves, and one copy of the replicated norms
        assert (state / "shards" / p).stat().st_size < 0.7 * full_bytes, p
    stored = dcp.FileSystemReader(str(state / "shards")).read_metadata().state_dict_metadata
    q = stored["model.model.layers.0.self_attn.q_proj.weight"]  # [heads * d, H] = [64, 64], rows cut over TP
    assert sorted(tuple(c.offsets) for c in q.chunks) == [(0, 0), (32, 0)]
    assert [tuple(c.sizes) for c in q.chunks] == [(32, 64), (32, 64)]
    # the shards hold what the ranks held: bit for bit the state gathered on rank 0
    want_model, want_optim = read_train_tensors(gathered)
    got_model, got_optim = read_train_tensors(state)
    for want, got in ((want_model, got_model), (want_optim, got_optim)):
        assert sorted(want) == sorted(got) and len(want) > 20
        for k in want:
            assert torch.equal(want[k], got[k]), k


def test_another_layout_takes_the_uninterrupted_next_step(
    saved: dict[str, Any], tiny_qwen3_dir: Path
) -> None:
    """Saved at TP=2: PP=2 (two ranks) and one rank resume and compute the step TP=2 took after the save."""

    _same_step(saved["pp2"], saved["continued"], "PP=2")
    with local_megatron(tiny_qwen3_dir, _run()) as one:
        one.load_state(str(saved["root"] / "tp2"))
        assert one.scheduler.state_dict()["last_epoch"] == 1
        _same_step((one.train_step(saved["batch"]), one.full_state_dict()), saved["continued"], "one rank")


class _Payload:
    """Unpickling this creates ``marker``: the proof that a pickle was read."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


def test_a_changed_shard_or_metadata_is_refused_before_unpickling(
    saved: dict[str, Any], tiny_qwen3_dir: Path, tmp_path: Path
) -> None:

    shard, metadata = tmp_path / "shard", tmp_path / "metadata"
    for d in (shard, metadata):
        shutil.copytree(saved["root"] / "tp2", d)
    part = shard / "shards" / "__1_0.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    marker = tmp_path / "unpickled"
    (metadata / "shards" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with local_megatron(tiny_qwen3_dir, _run()) as one:
        before = one.full_state_dict()
        with pytest.raises(ValueError, match=r"refusing the sharded trainer state .*__1_0\.distcp: SHA-256 "):
            one.load_state(str(shard))
        with pytest.raises(
            ValueError,
            match=r"refusing the sharded trainer state .*\.metadata: .*changed or "
            r"damaged.* Nothing of it was read",
        ):
            one.load_state(str(metadata))
        after = one.full_state_dict()
    assert not marker.exists()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    pickle.loads(
        (metadata / "shards" / ".metadata").read_bytes()
    )  # the payload is live: reading it would show
    assert marker.exists()


@pytest.mark.parametrize(
    "sizes",
    [
        {"tp": 2},
        {"tp": 2, "vocab_size": 95},  # the last TP rank's vocabulary rows are partly padding
        {"pp": 2, "tie_word_embeddings": True},
        {"ep": 2, "moe": True},
        {"pp": 2, "ep": 2, "moe": True},
    ],
    ids=["tp2", "tp2_padded_vocab", "pp2_tied", "ep2", "pp2_ep2"],
)
def test_every_ranks_regions_tile_the_hf_tensors(sizes: dict[str, Any]) -> None:
    """The regions every rank writes hold the HF tensors' values, together cover every element once (the last
    stage's copy of tied embeddings aside), and read back into a rank's shard give that shard."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from miles.train.megatron.arch import Arch
    from miles.train.megatron.load import hf_layout
    from miles.train.megatron.mapping import Coords, entries, piece_shapes, shard, split_experts
    from miles.train.megatron.sharded_state import layout

    sizes = dict(sizes)
    tp, pp, ep, moe = sizes.pop("tp", 1), sizes.pop("pp", 1), sizes.pop("ep", 1), sizes.pop("moe", False)
    common = (
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=False,
        )
        | sizes
    )
    config = (
        Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        if moe
        else Qwen3Config(**common)
    )
    arch = Arch.from_hf(config)
    hf_shapes, _ = hf_layout(config)
    torch.manual_seed(0)
    hf = {n: torch.randn(s) for n, s in hf_shapes.items()}
    pieces, shapes = split_experts(hf), piece_shapes(hf_shapes)
    covered = {n: torch.zeros(s, dtype=torch.int64) for n, s in hf_shapes.items()}
    padding = 0
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            for ep_rank in range(ep):
                c = Coords(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
                for e in entries(arch, c):
                    local = shard(e, pieces, arch, tp, tp_rank)
                    lay = layout(e, shapes, hf_shapes, arch, tp, tp_rank, torch.device("cpu"))
                    regions = lay.scatter(local)
                    for r, t in zip(lay.regions, regions, strict=True):
                        where = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.sizes, strict=True))
                        assert torch.equal(hf[r.key][where], t), (e.local, r)
                        if not e.tied_copy and (e.expert or ep_rank == 0):  # EP ranks share the dense layers
                            covered[r.key][where] += 1
                    back = torch.full_like(local, float("nan"))
                    lay.gather(regions, back)
                    padded = lay.index == 0  # vocabulary padding only: no HF element, left as it was
                    padding += int(padded.sum())
                    assert torch.equal(back[~padded], local[~padded]) and bool(
                        torch.isnan(back[padded]).all()
                    ), e
    assert (padding > 0) == (common["vocab_size"] % tp != 0)
    for n, count in covered.items():
        if n == "lm_head.weight" and arch.tied_embeddings:
            continue  # written as a copy of embed_tokens
        copies = (
            tp if n.endswith(("norm.weight", "mlp.gate.weight")) else 1
        )  # whole on every TP rank: DCP keeps one
        assert bool((count == copies).all()), (n, count.unique().tolist())
