"""``python -m miles.bench rollout --speculative``: the torch engine with against without a draft model.

Policy: the rollout benchmark's tiny Qwen3 (:func:`miles.bench.rollout.build_model`: hidden 128, random
init, EOS offset for geometric lengths) made ``--layers`` deep (default 8). Draft: the policy's first
``--draft-layers`` decoder layers with its embeddings, final norm and LM head
(:func:`miles.rollout.speculative.truncated_draft`, no training). Note what this measures: in a
random-init model each layer adds a small update to the residual stream, so the shallow draft agrees with
the policy more often than a layer-skipping draft of a trained model would; the acceptance rate is
printed so the speed-up can be read against it.

Workload: ``--requests`` prompts of 8-24 random tokens, one completion each, ``--max-new-tokens``
(default 64), all in one ``generate`` call on one in-process engine with ``max_batch_size`` = each of
``--batch-sizes``. Greedy: both sides must return the same tokens (checked; the command fails
otherwise) and the tokens/s ratio is printed. Sampled (temperature 1): both sides sample the policy's
distribution with different random draws, so lengths differ; tokens/s counts each side's own tokens.
Each number is the median of ``--repeats`` runs, sides alternating. The last line printed is JSON.
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


def _run(engine: Any, prompts: list[tuple[int, ...]], max_new: int, greedy: bool) -> tuple[float, list]:
    from miles.types import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(request_id=str(i), prompt_ids=p, seed=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    results = engine.generate(reqs, SamplingParams(greedy=greedy, temperature=1.0, max_new_tokens=max_new))
    return time.perf_counter() - t0, results


def bench(
    batch_sizes: list[int],
    requests: int,
    max_new: int,
    repeats: int,
    layers: int,
    draft_layers: int,
    k: int,
    threads: int,
) -> dict[str, Any]:
    from miles.bench.rollout import build_model, make_prompts
    from miles.config.schema import PrecisionConfig
    from miles.models.checkpoint import TOKENIZER_VOCAB_SIZE
    from miles.rollout.speculative import truncated_draft
    from miles.rollout.torch_engine import TorchEngine

    torch.set_num_threads(threads)
    out: dict[str, Any] = {
        "layers": layers,
        "draft_layers": draft_layers,
        "k": k,
        "requests": requests,
        "max_new_tokens": max_new,
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_model(Path(tmp) / "policy", eos_prob=0.01, num_layers=layers)
        draft = truncated_draft(policy, Path(tmp) / "draft", draft_layers)
        prompts = make_prompts(requests, TOKENIZER_VOCAB_SIZE, seed=0)
        for bs in batch_sizes:
            plain = TorchEngine(str(policy), PrecisionConfig(), max_batch_size=bs, num_threads=threads)
            spec = TorchEngine(
                str(policy),
                PrecisionConfig(),
                max_batch_size=bs,
                num_threads=threads,
                draft_checkpoint_dir=str(draft),
                draft_k=k,
            )
            for greedy in (True, False):
                times: dict[str, list[float]] = {"plain": [], "spec": []}
                tokens: dict[str, list[int]] = {"plain": [], "spec": []}
                rates = []
                for r in range(repeats):
                    for side in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                        secs, results = _run(plain if side == "plain" else spec, prompts, max_new, greedy)
                        times[side].append(secs)
                        tokens[side].append(sum(len(x.response_ids) for x in results))
                        if side == "spec":
                            spec_results = results
                            prop = sum(x.spec_counts[0] for x in results)
                            rates.append(sum(x.spec_counts[1] for x in results) / max(prop, 1))
                        else:
                            plain_results = results
                    if greedy and [x.response_ids for x in spec_results] != [
                        x.response_ids for x in plain_results
                    ]:
                        raise SystemExit(f"batch size {bs}: greedy outputs differ with and without the draft")
                tps = {
                    s: statistics.median(n / t for n, t in zip(tokens[s], times[s], strict=True))
                    for s in times
                }
                row = {
                    "batch_size": bs,
                    "mode": "greedy" if greedy else "sampled",
                    "plain_tok_s": round(tps["plain"]),
                    "spec_tok_s": round(tps["spec"]),
                    "ratio": round(tps["spec"] / tps["plain"], 2),
                    "accept_rate": round(statistics.median(rates), 3),
                    "greedy_outputs_equal": greedy or None,
                }
                print(
                    f"batch {bs:3d} {row['mode']:7s}: {row['plain_tok_s']:6d} tok/s without, {row['spec_tok_s']:6d} "
                    f"with the draft = {row['ratio']:.2f}x (acceptance {row['accept_rate']:.2f})",
                    flush=True,
                )
                out["rows"].append(row)
            plain.close()
            spec.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m miles.bench rollout --speculative", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated engine slots (default 1,8)")
    p.add_argument("--requests", type=int, default=16, help="prompts, one completion each (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="cap on response tokens (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side, median (default 3)")
    p.add_argument("--layers", type=int, default=8, help="policy decoder layers (default 8)")
    p.add_argument(
        "--draft-layers", type=int, default=1, help="the draft's layers, the policy's first (default 1)"
    )
    p.add_argument("--k", type=int, default=3, help="tokens the draft proposes per step (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--quick",
        action="store_true",
        help="seconds, for tests: batch size 4, 8 requests, 16 tokens, 1 repeat",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.requests, args.max_new_tokens, args.repeats = "4", 8, 16, 1
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        p.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if not batch_sizes or min(batch_sizes) < 1:
        p.error(f"--batch-sizes: each must be >= 1, got {args.batch_sizes!r}")
    if not 1 <= args.max_new_tokens <= 200:
        p.error(
            f"--max-new-tokens: must be in [1, 200] (the model has 256 positions), got {args.max_new_tokens}"
        )
    if not 1 <= args.draft_layers <= args.layers:
        p.error(f"--draft-layers: must be in [1, --layers={args.layers}], got {args.draft_layers}")
    if not 1 <= args.k <= 16 or args.requests < 1 or args.repeats < 1:
        p.error("--k must be in [1, 16]; --requests and --repeats must be >= 1")
    result = bench(
        batch_sizes,
        args.requests,
        args.max_new_tokens,
        args.repeats,
        args.layers,
        args.draft_layers,
        args.k,
        args.threads,
    )
    print(json.dumps(result))
    return 0
