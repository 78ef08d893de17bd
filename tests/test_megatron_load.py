"""Megatron ranks read their slices of an HF checkpoint from its safetensors files (:mod:`miles.train.megatron.load`).

Every layout's shards equal, bit for bit, what the trainer cut before from transformers' full fp32 load
(:func:`_full_load_shard`, that code as it was), for single-file and sharded (index) checkpoints, stored
fp32 / bf16 / fp16, tied embeddings, and MoE experts stored per expert or fused; and a rank reads
nothing but what it keeps. No process groups: the layouts are coordinates (:class:`~.mapping.Coords`).
The real ranks (Ray actors, gloo) load through the same code in ``tests/test_megatron.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import _save_tiny

from miles.train.megatron.arch import Arch
from miles.train.megatron.load import CheckpointShards, SafetensorsReader, hf_layout, read_config
from miles.train.megatron.mapping import (
    Coords,
    Entry,
    entries,
    interleave_qkv,
    padded_vocab,
    piece_shapes,
    split_experts,
)

pytestmark = pytest.mark.megatron


def _full_load_shard(entry: Entry, pieces: dict[str, torch.Tensor], arch: Arch, tp: int, tp_rank: int
                     ) -> torch.Tensor:
    """The shard as the trainer cut it from a full state dict before sliced reads: whole tensors, then chunks."""
    src = [pieces[n] for n in entry.hf]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[tp_rank]

    if entry.kind == "copy":
        return src[0]
    if entry.kind == "vocab":
        pad = padded_vocab(arch, tp) - src[0].shape[0]
        return rows(torch.cat([src[0], src[0].new_zeros(pad, src[0].shape[1])]) if pad else src[0])
    if entry.kind == "row":
        return src[0].chunk(tp, dim=1)[tp_rank]
    if entry.kind == "qkv":
        return rows(interleave_qkv(*src, arch.num_kv_heads))
    gate, up = src if len(src) == 2 else src[0].chunk(2, dim=0)
    return torch.cat([rows(gate), rows(up)])


def _write(directory: Path, tensors: dict[str, torch.Tensor], config_from: Path, *, files: int) -> Path:
    """``tensors`` as ``files`` safetensors files (with an index when more than one) beside a copied config."""
    from safetensors.torch import save_file

    directory.mkdir()
    shutil.copy(config_from / "config.json", directory / "config.json")
    names = list(tensors)
    weight_map = {}
    for i in range(files):
        fname = "model.safetensors" if files == 1 else f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = names[i::files]
        save_file({n: tensors[n].contiguous() for n in part}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    if files > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.fixture(scope="module")
def stored(tiny_qwen3_dir: Path, tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """Checkpoints in every stored form the reader handles."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("stored")
    dense = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    dense.to(torch.bfloat16).save_pretrained(root / "dense_bf16_sharded", max_shard_size="20KB")
    # an odd vocabulary: TP=2 pads it with a zero row
    tied = _save_tiny(root / "tied_src", moe=False, seed=1, tie_word_embeddings=True, vocab_size=95)
    AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float16).save_pretrained(root / "tied_fp16")
    moe = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32)
    fused = {k: v.to(torch.bfloat16) for k, v in moe.state_dict().items()}  # transformers 5's names
    _write(root / "moe_fused_bf16_sharded", fused, tiny_qwen3_moe_dir, files=3)
    out = {"dense": tiny_qwen3_dir, "dense_bf16_sharded": root / "dense_bf16_sharded", "tied_fp16": root / "tied_fp16",
           "moe": tiny_qwen3_moe_dir, "moe_fused_bf16_sharded": root / "moe_fused_bf16_sharded"}
    assert (out["dense_bf16_sharded"] / "model.safetensors.index.json").is_file()
    return out


def _stored_names(directory: Path) -> dict[str, int]:
    """Every stored tensor's element count."""
    from safetensors import safe_open

    out = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for n in f.keys():
                out[n] = int(torch.Size(f.get_slice(n).get_shape()).numel())
    return out


@pytest.mark.parametrize("name", ["dense", "dense_bf16_sharded", "tied_fp16", "moe", "moe_fused_bf16_sharded"])
def test_sliced_reads_equal_the_full_load(stored: dict[str, Path], name: str):
    from transformers import AutoModelForCausalLM

    directory = stored[name]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    full = hf.state_dict()
    config = read_config(directory)
    arch = Arch.from_hf(config)
    shapes, param_names = hf_layout(config)
    assert list(shapes) == list(full) and all(shapes[k] == tuple(v.shape) for k, v in full.items())
    assert param_names == [n for n, _ in hf.named_parameters()]
    pieces = split_experts(full)
    stored_numel = _stored_names(directory)
    if "fused" in name:
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in stored_numel)
    elif arch.is_moe:
        assert any(n.endswith("mlp.experts.3.up_proj.weight") for n in stored_numel)
    if arch.tied_embeddings:
        assert "lm_head.weight" not in stored_numel
    layouts = [(1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 1, 2)] if arch.is_moe else [(1, 1, 1), (2, 1, 1), (1, 2, 1),
                                                                                   (2, 2, 1)]
    for tp, pp, ep in layouts:
        for pp_rank in range(pp):
            for ep_rank in range(ep):
                for tp_rank in range(tp):
                    ents = entries(arch, Coords(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank))
                    where = (tp, pp, ep, tp_rank, pp_rank, ep_rank)
                    with SafetensorsReader(directory, release_bytes=4096) as reader:
                        shards = CheckpointShards(reader, ents, piece_shapes(shapes), arch, tp=tp, tp_rank=tp_rank)
                        assert list(shards) == [e.local for e in ents]
                        kept = 0
                        for e in ents:
                            got, want = shards[e.local], _full_load_shard(e, pieces, arch, tp, tp_rank)
                            assert got.dtype == torch.float32 and got.is_contiguous(), (where, e.local)
                            assert torch.equal(got, want), (where, e.local)
                            kept += got.numel()
                            if e.kind == "vocab":  # rows past the vocabulary are zeros, not read
                                rows = got.shape[0]
                                padding = (tp_rank + 1) * rows - max(arch.vocab_size, tp_rank * rows)
                                kept -= max(0, padding) * got.shape[1]
                    # every element kept was read once (vocabulary padding is zeros), and nothing else
                    assert sum(reader.read_elements.values()) == kept, where
                    layers = {int(n.split(".")[2]) for n in reader.read_elements if n.startswith("model.layers.")}
                    per_stage = arch.num_layers // pp
                    assert layers == set(range(pp_rank * per_stage, (pp_rank + 1) * per_stage)), where
                    assert ("model.norm.weight" in reader.read_elements) == (pp_rank == pp - 1), where


def test_reader_errors_name_the_tensor_and_what_to_try(stored: dict[str, Path], tmp_path: Path):
    from safetensors.torch import load_file

    tensors = load_file(str(stored["dense"] / "model.safetensors"))
    arch = Arch.from_hf(read_config(stored["dense"]))
    shapes = piece_shapes(hf_layout(read_config(stored["dense"]))[0])

    def first_shard(directory: Path) -> None:
        with SafetensorsReader(directory) as reader:
            shards = CheckpointShards(reader, entries(arch, Coords(tp=1, tp_rank=0, pp=1, pp_rank=0)), shapes, arch,
                                      tp=1, tp_rank=0)
            for k in shards:
                shards[k]

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match=r"has no tensor 'model.layers.1.mlp.up_proj.weight' \(the megatron mapping"):
        first_shard(_write(tmp_path / "missing", missing, stored["dense"], files=1))
    ints = {**tensors, "model.norm.weight": tensors["model.norm.weight"].to(torch.int8)}
    with pytest.raises(ValueError, match=r"model.norm.weight is stored as I8; the megatron trainer reads F32, BF16, "
                                         r"F16 \(dequantize"):
        first_shard(_write(tmp_path / "int8", ints, stored["dense"], files=1))
    wrong = {**tensors, "model.norm.weight": tensors["model.norm.weight"][:8]}
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \[8\]; the config \(config.json\) makes it "
                                         r"\[64\]"):
        first_shard(_write(tmp_path / "shape", wrong, stored["dense"], files=1))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json and no"):
        SafetensorsReader(tmp_path / "empty")
    quant = json.loads((stored["dense"] / "config.json").read_text())
    quant["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "empty" / "config.json").write_text(json.dumps(quant))
    with pytest.raises(ValueError, match=r"a quantized checkpoint \(quantization_config, quant_method='fp8'\)"):
        read_config(tmp_path / "empty")
