"""Rollout throughput: the miles engine (continuous batching) against HF ``model.generate``.

Model: the ``tiny`` Qwen3 flavor of :func:`miles.models.qwen3.qwen3_spec` (hidden 128, 2 layers) at the
vocabulary size of built checkpoints (:data:`miles.models.checkpoint.TOKENIZER_VOCAB_SIZE`), random
init, saved with ``save_pretrained`` into a temporary directory. A random model is near-uniform over
its vocabulary, so its EOS would almost never come; the benchmark gives it an EOS probability instead:
embedding channel 0 is set to a constant, so after the final RMSNorm that channel is near-constant, and
the EOS row of ``lm_head`` reads it, adding a near-fixed offset to the EOS logit sized from
``--eos-prob`` (the layers perturb the channel, so the realised rate is lower: about 0.02 per token for
the default 0.03; the JSON reports the measured mean and spread of the lengths). Response lengths are
then roughly geometric, capped at ``--max-new-tokens`` (default 128: mean ~46, standard deviation ~38,
~8% capped): the variable-length workload of RL rollouts, where a static batch runs as long as its
longest row.

Workload: ``rows_per_batch_size x batch size`` requests (one completion each), prompts of 8-24 random
tokens, sampled at temperature 1 (no top-k / top-p), EOS as the stop. Every side gets the same prompts
and the same model; each samples with its own random numbers, so lengths differ run to run (the
reported numbers are medians over ``--repeats``, sides alternating, first side swapped every repeat).
Batch-1 latency is measured on a copy of the model whose EOS offset is -15 (EOS never comes), so every
request is exactly ``--max-new-tokens`` long on every side.

- HF: ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1, eos_token_id=EOS)`` on padded
  static batches of ``batch size`` rows (left padding, attention mask), ``max_new_tokens`` per batch.
- miles: one in-process :class:`~miles.rollout.torch_engine.TorchEngine` with
  ``max_batch_size = batch size`` slots, all requests in one ``generate`` call (not via Ray).
- heads (``--draft-heads K``): the torch engine as above, speculating with ``K`` new draft heads of the model
  (:mod:`miles.models.draft_heads`, ``draft.heads``: each proposes from the model's next-token distribution at
  the row's last token; on a near-uniform random model that accepts about 0.94 of the proposals). Its greedy
  outputs on 16 prompts are compared with the plain engine's (``heads_greedy_outputs_equal``).
- sglang (``--engine sglang``, needs ``scripts/setup_sglang.sh``): one in-process
  :class:`~miles.rollout.sglang_engine.SGLangEngine`, a real SGLang server started anew for each batch
  size with ``max_batch_size = batch size`` (the start is not timed), all requests in one
  ``generate`` call (one HTTP request), same dtype (fp32) and thread count. Its sampling draws from the
  server's generator, not per request, so its lengths follow the same distribution but not the same
  draws.

Tokens/s counts the useful tokens: each row's tokens up to and including its EOS (HF pads finished rows
until the batch's longest row ends; those pads are not counted). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

EOS_ID, PAD_ID = 2, 0


def build_model(path: Path, eos_prob: float, seed: int = 0, max_positions: int | None = None,
                num_layers: int | None = None) -> Path:
    """Save the tiny Qwen3 with the EOS offset (see the module docstring) to ``path``; ``max_positions``
    overrides its ``max_position_embeddings`` (longer multi-turn contexts), ``num_layers`` its depth."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from miles.models.checkpoint import TOKENIZER_VOCAB_SIZE
    from miles.models.qwen3 import qwen3_spec

    config = qwen3_spec("tiny").hf_config
    config.vocab_size = TOKENIZER_VOCAB_SIZE
    config.eos_token_id, config.pad_token_id, config.bos_token_id = EOS_ID, PAD_ID, PAD_ID
    if max_positions is not None:
        config.max_position_embeddings = max_positions
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        config.layer_types = ["full_attention"] * num_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 1.0  # a constant channel through the residual stream
        d = emb.shape[1]
        normed = 1.0 / math.sqrt((1.0 + (d - 1) * emb[:, 1:].var().item()) / d)  # channel 0 after RMSNorm
        offset = math.log(eos_prob / (1 - eos_prob) * (config.vocab_size - 1))
        head[EOS_ID] = 0.0
        head[EOS_ID, 0] = offset / normed
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=PAD_ID)
    model.save_pretrained(path)
    return path


def make_prompts(n: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    """``n`` prompts of 8-24 token ids in ``[3, vocab)`` (never pad, bos or EOS), reproducible by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (n,), generator=g).tolist()
    return [tuple(torch.randint(3, vocab, (k,), generator=g).tolist()) for k in lengths]


def run_hf(model: Any, prompts: list[tuple[int, ...]], batch_size: int, max_new: int) -> tuple[float, list[int]]:
    """Seconds and per-row useful lengths for HF generate on padded static batches."""
    lengths: list[int] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(chunk):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_new, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        for row in out[:, width:].tolist():
            lengths.append(row.index(EOS_ID) + 1 if EOS_ID in row else len(row))
    return time.perf_counter() - t0, lengths


def run_miles(engine: Any, prompts: list[tuple[int, ...]], max_new: int, seed: int,
              spec: list[tuple[int, int]] | None = None) -> tuple[float, list[int]]:
    """Seconds and per-row lengths for one engine generate call over all prompts; ``spec`` (a speculative
    engine's) gets each row's (proposed, accepted) draft tokens."""
    from miles.types import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(request_id=str(i), prompt_ids=p, seed=seed * 100_003 + i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    results = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=max_new))
    seconds = time.perf_counter() - t0
    if spec is not None:
        spec += [r.spec_counts for r in results if r.spec_counts is not None]
    return seconds, [len(r.response_ids) for r in results]


def greedy_outputs(engine: Any, prompts: list[tuple[int, ...]], max_new: int) -> list[tuple[int, ...]]:
    """The engine's greedy responses to ``prompts``."""
    from miles.types import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(request_id=str(i), prompt_ids=p) for i, p in enumerate(prompts)]
    return [tuple(r.response_ids) for r in engine.generate(reqs, SamplingParams(greedy=True, max_new_tokens=max_new))]


def _engine(kind: str, path: Path, batch_size: int, threads: int, heads: Path | None = None) -> Any:
    """The side ``kind``'s engine: ``torch``, ``sglang``, or ``heads`` (the torch engine with the draft heads in
    ``heads``)."""
    from miles.config.schema import PrecisionConfig

    if kind == "sglang":
        from miles.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(str(path), PrecisionConfig(), num_threads=threads, max_batch_size=batch_size,
                            max_total_tokens=max(8192, batch_size * 256))
    from miles.rollout.torch_engine import TorchEngine

    if kind == "heads":
        from miles.models.draft_heads import load_heads

        return TorchEngine(str(path), PrecisionConfig(), max_batch_size=batch_size, num_threads=threads,
                           draft_checkpoint_dir=str(heads), draft_k=load_heads(heads).k)
    return TorchEngine(str(path), PrecisionConfig(), max_batch_size=batch_size, num_threads=threads)


def bench(batch_sizes: list[int], rows_per_batch: int, max_new: int, repeats: int, eos_prob: float,
          threads: int, out=None, engine: str = "torch", draft_heads: int = 0) -> dict[str, Any]:
    """Every side on every batch size (a line each to ``out``), then batch-1 latency: the JSON summary.

    Sides: HF generate and the miles torch engine; with ``engine="sglang"`` also the SGLang engine; with
    ``draft_heads=k`` also the torch engine speculating with ``k`` new draft heads of the policy
    (:mod:`miles.models.draft_heads`: each proposes from the policy's next-token distribution at the row's last
    token), whose greedy outputs are compared with the plain engine's."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    out = out or sys.stdout  # looked up per call: a test may have swapped it since import
    sides: tuple[str, ...] = ("hf", "miles", "sglang") if engine == "sglang" else ("hf", "miles")
    sides += ("heads",) * bool(draft_heads)
    with tempfile.TemporaryDirectory(prefix="miles-bench-rollout-") as tmp:
        path = build_model(Path(tmp) / "tiny", eos_prob)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        heads = None
        if draft_heads:
            from miles.models.draft_heads import PolicyHeads, save_heads

            heads = save_heads(PolicyHeads(draft_heads, int(hf.config.hidden_size)), Path(tmp) / "heads")
        table = []
        for bs in batch_sizes:
            engines = {side: _engine("torch" if side == "miles" else side, path, bs, threads, heads)
                       for side in sides if side != "hf"}
            n_rows = max(rows_per_batch * bs, 4)
            spec: list[tuple[int, int]] = []
            run_hf(hf, make_prompts(bs, vocab, 999), bs, 8)  # warm-up every side
            for e in engines.values():
                run_miles(e, make_prompts(bs, vocab, 999), 8, 999)
            times: dict[str, list[float]] = {side: [] for side in sides}
            tps: dict[str, list[float]] = {side: [] for side in sides}
            lens: dict[str, list[int]] = {side: [] for side in sides}
            for rep in range(repeats):
                prompts = make_prompts(n_rows, vocab, rep)
                order = sides[rep % len(sides):] + sides[:rep % len(sides)]  # each side first in turn
                for side in order:
                    if side == "hf":
                        seconds, lengths = run_hf(hf, prompts, bs, max_new)
                    else:
                        seconds, lengths = run_miles(engines[side], prompts, max_new, rep,
                                                     spec if side == "heads" else None)
                    times[side].append(seconds)
                    tps[side].append(sum(lengths) / seconds)
                    lens[side] += lengths
            greedy_equal = None
            if "heads" in sides:
                greedy_prompts = make_prompts(16, vocab, 555)
                greedy_equal = (greedy_outputs(engines["heads"], greedy_prompts, max_new)
                                == greedy_outputs(engines["miles"], greedy_prompts, max_new))
            for e in engines.values():
                e.close()
            row = {
                "batch_size": bs, "rows": n_rows,
                "tokens_per_s_miles": statistics.median(tps["miles"]),
                "tokens_per_s_hf_generate": statistics.median(tps["hf"]),
                "seconds_miles": statistics.median(times["miles"]),
                "seconds_hf_generate": statistics.median(times["hf"]),
                "mean_len_miles": statistics.mean(lens["miles"]), "mean_len_hf": statistics.mean(lens["hf"]),
                "stdev_len_miles": statistics.pstdev(lens["miles"]),
            }
            row["ratio_vs_hf_generate"] = row["tokens_per_s_miles"] / row["tokens_per_s_hf_generate"]
            extra = ""
            if "heads" in sides:
                row |= {"tokens_per_s_heads": statistics.median(tps["heads"]),
                        "seconds_heads": statistics.median(times["heads"]),
                        "mean_len_heads": statistics.mean(lens["heads"]),
                        "heads_accept_rate": sum(a for _, a in spec) / max(1, sum(p for p, _ in spec)),
                        "heads_greedy_outputs_equal": greedy_equal}
                row["heads_ratio_vs_hf_generate"] = row["tokens_per_s_heads"] / row["tokens_per_s_hf_generate"]
                row["heads_ratio_vs_miles"] = row["tokens_per_s_heads"] / row["tokens_per_s_miles"]
                extra += (f", with {draft_heads} draft heads {row['tokens_per_s_heads']:8.0f} tok/s "
                          f"({row['heads_ratio_vs_hf_generate']:.2f}x HF, {row['heads_ratio_vs_miles']:.2f}x miles, "
                          f"acceptance {row['heads_accept_rate']:.3f}, greedy outputs equal: {greedy_equal})")
            if "sglang" in sides:
                row |= {"tokens_per_s_sglang": statistics.median(tps["sglang"]),
                        "seconds_sglang": statistics.median(times["sglang"]),
                        "mean_len_sglang": statistics.mean(lens["sglang"])}
                row["sglang_ratio_vs_hf_generate"] = row["tokens_per_s_sglang"] / row["tokens_per_s_hf_generate"]
                row["sglang_ratio_vs_miles"] = row["tokens_per_s_sglang"] / row["tokens_per_s_miles"]
                extra += (f", SGLang {row['tokens_per_s_sglang']:8.0f} tok/s ({row['sglang_ratio_vs_miles']:.2f}x miles, "
                         f"mean length {row['mean_len_sglang']:.1f})")
            table.append(row)
            print(f"batch {bs:3d}: miles {row['tokens_per_s_miles']:8.0f} tok/s, HF generate "
                  f"{row['tokens_per_s_hf_generate']:8.0f} tok/s, ratio {row['ratio_vs_hf_generate']:.2f}x "
                  f"(mean length {row['mean_len_miles']:.1f} / {row['mean_len_hf']:.1f}, {n_rows} rows){extra}",
                  file=out, flush=True)
        latency = {}
        if 1 in batch_sizes:  # one request at a time, always max_new tokens: the same model without EOS
            path1 = build_model(Path(tmp) / "no_eos", 1e-9)
            hf1 = AutoModelForCausalLM.from_pretrained(str(path1), dtype=torch.float32).eval()
            engines = {side: _engine("torch" if side == "miles" else side, path1, 1, threads, heads)
                       for side in sides if side != "hf"}
            prompt = make_prompts(1, vocab, 7)
            lat: dict[str, list[float]] = {side: [] for side in sides}
            for rep in range(max(repeats, 3) * 2):
                for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                    seconds, lengths = (run_hf(hf1, prompt, 1, max_new) if side == "hf"
                                        else run_miles(engines[side], prompt, max_new, rep))
                    assert lengths == [max_new], (side, lengths)
                    lat[side].append(seconds)
            for e in engines.values():
                e.close()
            latency = {"batch1_latency_s_miles": statistics.median(lat["miles"]),
                       "batch1_latency_s_hf_generate": statistics.median(lat["hf"]),
                       "batch1_ms_per_token_miles": 1e3 * statistics.median(lat["miles"]) / max_new,
                       "batch1_ms_per_token_hf_generate": 1e3 * statistics.median(lat["hf"]) / max_new}
            if "heads" in sides:
                latency |= {"batch1_latency_s_heads": statistics.median(lat["heads"])}
            if "sglang" in sides:
                latency |= {"batch1_latency_s_sglang": statistics.median(lat["sglang"]),
                            "batch1_ms_per_token_sglang": 1e3 * statistics.median(lat["sglang"]) / max_new}
            print(f"batch-1 latency ({max_new} tokens): miles {latency['batch1_latency_s_miles']:.3f} s, "
                  f"HF generate {latency['batch1_latency_s_hf_generate']:.3f} s"
                  + (f", SGLang {latency['batch1_latency_s_sglang']:.3f} s" if "sglang" in sides else ""),
                  file=out, flush=True)
    main_bs = 32 if 32 in batch_sizes else max(batch_sizes)
    main = next(r for r in table if r["batch_size"] == main_bs)
    sglang = {k: main[k] for k in ("tokens_per_s_sglang", "sglang_ratio_vs_hf_generate", "sglang_ratio_vs_miles",
                                   "tokens_per_s_heads", "heads_ratio_vs_hf_generate", "heads_ratio_vs_miles",
                                   "heads_accept_rate", "heads_greedy_outputs_equal") if k in main}
    return {
        "tokens_per_s_miles": main["tokens_per_s_miles"],
        "tokens_per_s_hf_generate": main["tokens_per_s_hf_generate"],
        "ratio_vs_hf_generate": main["ratio_vs_hf_generate"], **sglang, "engines": list(sides),
        "main_batch_size": main_bs, "batch_sizes": batch_sizes, **latency,
        "per_batch_size": table,
        "workload": {"model": "qwen3 tiny (random init, EOS offset)", "vocab": vocab, "eos_prob": eos_prob,
                     "max_new_tokens": max_new, "prompt_len": [8, 24], "temperature": 1.0,
                     "rows_per_batch_size": rows_per_batch, "repeats": repeats, "threads": threads},
    }


def parse_batch_sizes(p: argparse.ArgumentParser, text: str) -> list[int]:
    """``--batch-sizes`` (comma-separated, each >= 1), or the parser's error naming the flag."""
    try:
        batch_sizes = [int(b) for b in text.split(",") if b]
    except ValueError:
        p.error(f"--batch-sizes: expected comma-separated integers, got {text!r}")
    if not batch_sizes or min(batch_sizes) < 1:
        p.error(f"--batch-sizes: each must be >= 1, got {text!r}")
    return batch_sizes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m miles.bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--speculative", action="store_true",
                   help="speculative rollout with against without a draft model (its own flags: "
                        "python -m miles.bench rollout --speculative --help; miles.bench.speculative)")
    p.add_argument("--batch-sizes", help="comma-separated rows per batch / engine slots (default 1,8,32,64)")
    p.add_argument("--max-new-tokens", type=int, help="cap on response tokens (default 128)")
    p.add_argument("--repeats", type=int, help="runs per side and batch size, median (default 3)")
    p.add_argument("--rows-per-batch", type=int, help="requests = this x batch size, at least 4 (default 4)")
    p.add_argument("--eos-prob", type=float, default=0.03, help="per-token EOS probability of the model")
    p.add_argument("--threads", type=int, default=1, help="torch threads (every side)")
    p.add_argument("--engine", choices=("torch", "sglang"), default="torch",
                   help="sglang: also a real SGLang server (needs scripts/setup_sglang.sh), next to torch and HF")
    p.add_argument("--draft-heads", type=int, default=0, metavar="K",
                   help="also the torch engine speculating with K new draft heads of the model (draft.heads), "
                        "its greedy outputs compared with the plain engine's (0: off)")
    p.add_argument("--quick", action="store_true",
                   help="seconds, for tests: defaults become batch sizes 1,4, 16 new tokens, 1 repeat, 2 rows/batch")
    args = p.parse_args(argv)
    if args.speculative:  # dispatched by miles.bench.__main__ before this parser sees it
        p.error("--speculative runs miles.bench.speculative: python -m miles.bench rollout --speculative")
    defaults = (("1,4", 16, 1, 2) if args.quick else ("1,8,32,64", 128, 3, 4))
    for name, value in zip(("batch_sizes", "max_new_tokens", "repeats", "rows_per_batch"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    batch_sizes = parse_batch_sizes(p, args.batch_sizes)
    if not 1 <= args.max_new_tokens <= 200:
        p.error(f"--max-new-tokens: must be in [1, 200] (the tiny model has 256 positions), got {args.max_new_tokens}")
    if args.repeats < 1 or args.rows_per_batch < 1:
        p.error("--repeats and --rows-per-batch must be >= 1")
    if not 0 <= args.draft_heads <= 16:
        p.error(f"--draft-heads: must be in [0, 16], got {args.draft_heads}")
    if not 0.0 < args.eos_prob < 1.0:
        p.error(f"--eos-prob: must be in (0, 1), got {args.eos_prob}")
    result = bench(batch_sizes, args.rows_per_batch, args.max_new_tokens, args.repeats, args.eos_prob, args.threads,
                   engine=args.engine, draft_heads=args.draft_heads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
