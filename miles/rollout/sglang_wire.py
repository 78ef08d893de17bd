"""SGLang's ``/generate`` JSON and checkpoint facts <-> miles' types, as plain functions.

What :class:`~miles.rollout.sglang_engine.SGLangEngine` sends and reads, kept apart from the process
and liveness handling: a checked request's sampling params as SGLang's, an answer turned
into a :class:`~miles.types.GenerateResult` (with its routes), the facts of a checkpoint the engine
checks against (vocabulary, EOS ids, positions, weight names and shapes), and the mapping between a
trainer's fused MoE expert tensors and the checkpoint's per-expert names.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.rollout.requests import eos_ids, row_seed
from miles.types import GenerateResult, SamplingParams, Status


@dataclass(frozen=True)
class Checkpoint:
    """What the engine checks requests and weight updates against, read from an HF checkpoint directory."""

    eos_ids: list[int]
    vocab_size: int
    max_positions: int | None
    shapes: dict[str, tuple[int, ...]]
    """Every weight a full update sends, with its shape."""
    optional: set[str]
    """Names an update may leave out (``lm_head.weight`` of tied embeddings)."""
    moe_shape: tuple[int, int] | None
    """(MoE layers, experts per token), None for a dense model."""

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        from safetensors import safe_open

        config = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        eos = eos_ids(str(path), config.get("eos_token_id"), gen.get("eos_token_id"))
        text = config.get("text_config", config)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors weights (the SGLang engine loads safetensors only)")
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        optional: set[str] = set()
        tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
            shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
            optional.add("lm_head.weight")
        moe = None
        if text.get("num_experts_per_tok"):
            step = int(text.get("decoder_sparse_step", 1) or 1)
            dense = set(text.get("mlp_only_layers") or ())
            layers = sum(1 for i in range(int(text["num_hidden_layers"])) if (i + 1) % step == 0 and i not in dense)
            moe = (layers, int(text["num_experts_per_tok"]))
        return cls(eos_ids=eos, vocab_size=int(text["vocab_size"]),
                   max_positions=text.get("max_position_embeddings"), shapes=shapes, optional=optional, moe_shape=moe)


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused MoE expert tensors -> the per-expert names of HF checkpoints (what SGLang
    loads), as views: ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` -> ``<p>.experts.<e>.gate_proj.weight``
    (rows ``:I``) and ``up_proj.weight`` (rows ``I:``); ``<p>.experts.down_proj`` ``[E, H, I]`` ->
    ``<p>.experts.<e>.down_proj.weight``. Other names pass through."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        m = _FUSED.match(k)
        if m is None or v.ndim != 3:
            out[k] = v
            continue
        prefix, kind = m.groups()
        for e in range(v.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = v[e]
            else:
                half = v.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = v[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = v[e, half:]
    return out


def fuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_experts`: per-expert checkpoint tensors -> transformers 5's fused ones
    (what a transformers model holds, and what rollout quantization quantizes expert by expert)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in state_dict.items():
        m = _PER_EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
    for prefix, by_index in experts.items():
        order = [by_index[e] for e in sorted(by_index)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in order])
        out[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in order])
    return out


def sampling_params(sp: SamplingParams, seed: int, index: int) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for completion ``index`` (greedy: temperature 0; top-k 0 -> -1)."""
    greedy = sp.greedy or sp.temperature == 0
    out: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": 0.0 if greedy else sp.temperature,
        "top_p": 1.0 if greedy else sp.top_p,
        "top_k": -1 if greedy or sp.top_k == 0 else sp.top_k,
        "sampling_seed": row_seed(seed, index) % (2**31),
    }
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    return out


def to_result(request_id: str, index: int, sp: SamplingParams, out: dict[str, Any], ckpt: Checkpoint, *,
              version: int, routing: bool = False, prompt_len: int = 0) -> GenerateResult:
    """One row of SGLang's answer -> a result. ``version``: reported when SGLang names none; ``ttft_s``:
    SGLang's ``meta_info.first_token_latency`` (seconds from the server receiving the row to its first token,
    reported with ``--enable-metrics``), None without it or without tokens."""
    meta = out.get("meta_info") or {}
    ids = tuple(int(t) for t in out.get("output_ids") or ())
    logprobs = tuple(float(x[0]) for x in meta.get("output_token_logprobs") or ())
    if len(logprobs) != len(ids):
        raise RuntimeError(f"SGLang returned {len(ids)} tokens and {len(logprobs)} log-probs for {request_id!r}[{index}]")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "stop":
        matched = finish.get("matched")
        reason = "stop_token" if matched in sp.stop_token_ids and matched not in ckpt.eos_ids else "eos"
        status = Status.COMPLETED
    elif kind == "length":
        reason, status = "length", Status.TRUNCATED
    elif kind == "abort":
        reason, status = "abort", Status.ABORTED
    else:
        raise RuntimeError(f"SGLang finished {request_id!r}[{index}] with {finish!r}: "
                           f"{str(meta.get('error') or '')[:500]}")
    top = None
    if sp.logprobs_top_k:
        top = tuple(tuple((int(t[1]), float(t[0])) for t in step[: sp.logprobs_top_k])
                    for step in meta.get("output_top_logprobs") or ())
    try:
        version = int(meta.get("weight_version"))
    except (TypeError, ValueError):
        pass
    prompt_routes, routes = (decode_routing(meta.get("routed_experts"), prompt_len, len(ids), ckpt)
                             if routing and status is not Status.ABORTED else (None, None))
    first = meta.get("first_token_latency")  # the server's, from its receipt of the row (--enable-metrics)
    return GenerateResult(request_id=request_id, index=index, response_ids=ids, logprobs=logprobs, status=status,
                          weight_version=version, finish_reason=reason, top_logprobs=top, routing=routes,
                          prompt_routing=prompt_routes,
                          ttft_s=float(first) if isinstance(first, (int, float)) and ids else None)


def decode_routing(raw: str | None, prompt_len: int, num_tokens: int,
                   ckpt: Checkpoint) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """SGLang's routed experts -> ``(prompt_routing [P - 1, layers, top_k], routing [T, layers, top_k])``
    int16, as the torch engine reports them.

    ``raw`` is base64 int32, one ``[layers, top_k]`` row per position the server ran through the
    model: the prompt's ``0 .. P - 1`` and the generated tokens but the last, ``P + T - 1`` rows. Row
    ``P - 1 + t`` is the step that produced response token ``t``; rows ``0 .. P - 2`` are the
    prompt's own. On CPU they equal the routers' top-k of a transformers forward over prompt +
    response (``tests/test_sglang_lora_moe.py``). (None, None) without routes or for a dense model.
    """
    if raw is None or num_tokens == 0 or ckpt.moe_shape is None:
        return None, None
    layers, top_k = ckpt.moe_shape
    flat = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.int32)
    steps = flat.numel() // (layers * top_k)
    if steps != prompt_len + num_tokens - 1:
        raise RuntimeError(f"SGLang returned routes of {steps} positions for a prompt of {prompt_len} and "
                           f"{num_tokens} generated tokens; expected {prompt_len + num_tokens - 1}")
    per_step = flat[: steps * layers * top_k].view(steps, layers, top_k).to(torch.int16)
    return per_step[: prompt_len - 1].clone(), per_step[prompt_len - 1:].clone()


def aborted(request_id: str, index: int, version: int) -> GenerateResult:
    """A completion aborted before it reached the server: no tokens."""
    return GenerateResult(request_id=request_id, index=index, response_ids=(), logprobs=(), status=Status.ABORTED,
                          weight_version=version, finish_reason="abort")
