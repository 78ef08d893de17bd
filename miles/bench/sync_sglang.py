"""Weight sync into a real SGLang server: each ``weight_load`` path against the disk path, in one run.

``python -m miles.bench sync --engine sglang [--sizes tiny,100M] [--paths tensor,distributed,disk]
[--repeats 5] [--bucket-mb 512]``

For each size, a checkpoint of a Qwen3-style decoder with the names and shapes of
:data:`miles.bench.state_dicts.SIZES` (random fp32 weights, untied head) is written, one
:class:`~miles.rollout.sglang_engine.SGLangEngine` (fp32, one thread) is started on it in this
process, and ``engine.update_weights(state_dict, version)`` is timed end to end (checks, the load
through the path, SGLang's copy into its parameters; the engine reports the version on return),
alternating the paths (``engine.weight_load``) round by round after one warm-up update each;
the medians are compared. ``speedup_vs_disk`` is the disk path's median over the path's. After the
last round every path loads the original weights once more and a greedy completion must repeat
the first one exactly. Each path's time is also split into the engine side (``copy_s``: into the
staging buffer, the broadcast buffer, or the safetensors file) and the server calls (``load_s``).
The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles.bench import names_from
from miles.bench.state_dicts import SIZES, qwen_like_state_dict

PATHS = ("tensor", "distributed", "disk")


def write_checkpoint(size: str, directory: Path) -> dict[str, torch.Tensor]:
    """An HF Qwen3 checkpoint of ``size`` in ``directory``; returns its state dict."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    vocab, h, inter, layers, heads, kv, hd = SIZES[size]
    Qwen3Config(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                architectures=["Qwen3ForCausalLM"], torch_dtype="float32").save_pretrained(directory)
    state = qwen_like_state_dict(size)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return state


def bench_size(size: str, paths: list[str], repeats: int, bucket_mb: float) -> dict[str, Any]:
    from miles.config.schema import PrecisionConfig
    from miles.rollout.sglang_engine import SGLangEngine
    from miles.types import GenerateRequest, SamplingParams

    with tempfile.TemporaryDirectory(prefix=f"miles-bench-sglang-{size}-") as tmp:
        state = write_checkpoint(size, Path(tmp))
        g = torch.Generator().manual_seed(1)
        moved = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        t0 = time.perf_counter()
        engine = SGLangEngine(tmp, PrecisionConfig(), num_threads=1, max_total_tokens=2048, weight_bucket_mb=bucket_mb,
                              request_timeout_s=600.0)
        start_s = time.perf_counter() - t0

        def greedy() -> Any:
            return engine.generate([GenerateRequest(request_id="b", prompt_ids=(3, 4, 5, 6))],
                                   SamplingParams(greedy=True, max_new_tokens=8))[0]

        try:
            first = greedy()
            version = 0
            seconds: dict[str, list[float]] = {p: [] for p in paths}
            parts: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}  # (copy_s, load_s)
            for rnd in range(repeats + 1):  # round 0: warm-up (group rendezvous, staging buffer, first touch)
                for p in paths:
                    engine.weight_load = p
                    version += 1
                    t = time.perf_counter()
                    m = engine.update_weights(moved if version % 2 else state, version)
                    if rnd:
                        seconds[p].append(time.perf_counter() - t)
                        parts[p].append((m["copy_s"], m["load_s"]))
            for p in paths:  # every path brings back exactly the original weights
                engine.weight_load = p
                version += 1
                engine.update_weights(state, version)
                again = greedy()
                if (again.response_ids, again.logprobs) != (first.response_ids, first.logprobs):
                    raise AssertionError(f"{size}: after a {p} load of the original weights the greedy "
                                         "completion differs from the first one")
        finally:
            engine.close()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    out: dict[str, Any] = {"params": sum(v.numel() for v in state.values()), "bytes": nbytes, "start_s": start_s}
    disk = statistics.median(seconds["disk"]) if "disk" in seconds else None
    for p, s in seconds.items():
        med = statistics.median(s)
        out[p] = {"seconds": med, "bytes_per_s": nbytes / med, "speedup_vs_disk": disk / med if disk else None,
                  "copy_s": statistics.median(c for c, _ in parts[p]),
                  "load_s": statistics.median(x for _, x in parts[p])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m miles.bench sync --engine sglang",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["sglang"], default="sglang")
    ap.add_argument("--sizes", type=names_from(SIZES), default="tiny,100M", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--paths", type=names_from(PATHS), default=",".join(PATHS),
                    help="weight_load paths; disk is the reference")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=512.0, help="rollout.engine.weight_bucket_mb")
    args = ap.parse_args(argv)
    sizes, paths = args.sizes, args.paths
    if "disk" not in paths:
        ap.error("--paths: include disk, the reference the others are compared with")
    if args.repeats < 1:
        ap.error("--repeats: must be at least 1")
    torch.set_num_threads(1)
    result = {s: bench_size(s, paths, args.repeats, args.bucket_mb) for s in sizes}
    for s, r in result.items():
        print(f"{s} ({r['params'] / 1e6:.1f}M params, {r['bytes'] / 2**20:.0f} MiB fp32; server up in "
              f"{r['start_s']:.0f} s): median of {args.repeats}")
        for p in paths:
            print(f"  {p:<12} {r[p]['seconds'] * 1e3:9.1f} ms  {r[p]['bytes_per_s'] / 1e9:6.2f} GB/s  "
                  f"speedup_vs_disk {r[p]['speedup_vs_disk']:.2f}  (engine side {r[p]['copy_s'] * 1e3:.1f} ms, "
                  f"server calls {r[p]['load_s'] * 1e3:.1f} ms)")
    print(json.dumps({s: {p: {k: r[p][k] for k in ("seconds", "bytes_per_s", "speedup_vs_disk")} for p in paths}
                      for s, r in result.items()}))
    return 0
