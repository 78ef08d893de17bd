"""Precision recipes side by side: rollout-vs-train log-prob mismatch, MoE routes, TIS, step time, and
eval accuracy before and after a short GRPO run of the tiny MoE.

    python -m miles.bench precision [--steps 3] [--prompts 8] [--samples 4] [--max-new-tokens 16]
                                    [--recipes fp32,bf16,...] [--models dense,moe] [--trainers fsdp,megatron]
                                    [--quick] [--train-steps 10] [--seed 0] [--train-overrides "key=value ..."]

For each model (a random-init tiny Qwen3 and Qwen3-MoE, 4 experts top-2, built in this process) and
each recipe (``conf/precision/*.yaml``; MoE rows with ``algo.routing_replay`` off and on; dense rows
also with ``precision.true_on_policy=true``) it runs, in this process, ``--steps`` RL steps of

    generate (TorchEngine, the recipe's rollout numerics) -> recompute log-probs and train_step
    (rank 0 of a 1-rank gloo group of each ``--trainers`` backend: FSDPTrainer, MegatronTrainer; the
    recipe's training numerics) -> weight sync

on the same prompts and seeds, and reports per row: ``mismatch`` (mean |trainer logp - rollout logp|
over the response tokens, from ``compute_logprobs`` before the update), ``max_mismatch``,
``bitwise`` (whether every token's log-probs are equal), ``route_agreement`` (``moe/route_agreement``:
the trainer's own top-k against the engine's), ``replayed_share`` (``moe/replayed_route_share``: the
experts the trainer's MoE layers were called with against the engine's, per token and layer) and
``tis_clip_frac`` (the train step's metrics, mean over steps; ``-`` where the row has none), and the
medians of the generate and train seconds per step; ``step_ratio`` divides the row's generate + train
time by the fp32 row of the same model and trainer (replay off), measured in the same run. The MoE engine
records routing in every MoE row, so both route metrics are measured with replay off too. True on-policy
rows run with the FSDP trainer only (the megatron trainer refuses it).

Learning. Every MoE row (recipe x replay off/on) then also runs the real job,

    python -m miles model=qwen3_moe algo=grpo precision=<recipe> algo.routing_replay=<off|rollout>
                    trainer.num_steps=<--train-steps> trainer.eval_every=0 seed=<--seed> tracking=none

through :func:`miles.core.run.run_job` (Ray, the torch engine, one FSDP rank, weight sync; one Ray
cluster for all rows, actors reused between them), all rows from the same warm-started checkpoint
(built once, or taken from the checkpoint cache), and reports ``eval_before`` (``eval/accuracy`` at step
0, under the recipe's rollout numerics), ``eval_after`` (after the last step) and ``eval_se`` (the
latter's standard error over the eval prompts). ``--train-overrides`` adds Hydra overrides to those
jobs (a cheaper workload, another task); ``--train-steps 0`` skips them (``--quick`` does unless
``--train-steps`` is given). The last line printed is JSON with every row.

Random-init models have flat output distributions, so absolute mismatches are small; the comparison
between rows is the point.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
import time
from typing import Any

import torch

RECIPES = ("fp32", "bf16", "fp8", "mxfp8", "nvfp4", "int4", "int4_qat")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m miles.bench precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="RL steps per row (medians of their timings)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated conf/precision options")
    ap.add_argument("--models", default="dense,moe", help="dense, moe or both")
    ap.add_argument("--trainers", default="fsdp", help="fsdp, megatron or both: each row runs with each")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true",
                    help="1 step, 2 prompts x 2 samples, 4 tokens (a smoke run); no GRPO runs unless --train-steps")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="GRPO steps of each MoE row's run for eval_before/eval_after (default 10; 0: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of those runs (the same for every row)")
    ap.add_argument("--train-overrides", default="", help="extra Hydra overrides for those runs, space-separated")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.samples, args.max_new_tokens = 1, 2, 2, 4
    if args.train_steps is None:
        args.train_steps = 0 if args.quick else 10
    return args


def _checkpoint(directory: str, moe: bool) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    cfg = (Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          decoder_sparse_step=1, norm_topk_prob=True) if moe else Qwen3Config(**common))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(directory)
    return directory


def _run_config(recipe: str, args: argparse.Namespace, *, replay: bool, true_on_policy: bool) -> Any:
    from hydra import compose, initialize_config_module

    from miles.config import validate

    overrides = [f"precision={recipe}", f"algo.routing_replay={'rollout' if replay else 'off'}",
                 f"precision.true_on_policy={str(true_on_policy).lower()}",
                 f"algo.num_prompts_per_step={args.prompts}", f"algo.num_samples_per_prompt={args.samples}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", "trainer.lr=1e-3", "trainer.lr_warmup_steps=0"]
    with initialize_config_module("miles.conf", version_base="1.3"):
        return validate(compose("config", overrides=overrides))


def _trainer_class(name: str) -> type:
    if name == "megatron":
        from miles.train.megatron import MegatronTrainer

        return MegatronTrainer
    from miles.train.fsdp import FSDPTrainer

    return FSDPTrainer


def _row(ckpt: str, run: Any, args: argparse.Namespace, moe: bool, trainer_name: str = "fsdp") -> dict[str, Any]:
    """``args.steps`` RL steps of one configuration; the row's numbers."""
    from miles.config import RankConfig
    from miles.machine import free_port
    from miles.rollout.generate import routes_of
    from miles.rollout.torch_engine import TorchEngine
    from miles.types import GenerateRequest, SamplingParams, TrainBatch

    engine = TorchEngine(ckpt, run.precision, capture_routing=moe and not run.precision.true_on_policy,
                         max_batch_size=args.prompts * args.samples, num_threads=args.threads)
    trainer = _trainer_class(trainer_name)(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                                           checkpoint_dir=ckpt, config=RankConfig.of(run),
                                           num_threads=args.threads)
    sampling = SamplingParams(temperature=run.rollout.temperature, max_new_tokens=args.max_new_tokens)
    diffs: list[torch.Tensor] = []
    gen_s, train_s, agree, replayed, clip, bitwise = [], [], [], [], [], True
    try:
        engine.update_weights(trainer.full_state_dict(), version=0)
        for step in range(args.steps):
            reqs = [GenerateRequest(request_id=f"{step}-{i}", prompt_ids=tuple(3 + (7 * i + 5 * t + step) % 90
                                                                           for t in range(4 + i % 5)),
                                    n=args.samples, seed=1000 * step + i) for i in range(args.prompts)]
            t0 = time.perf_counter()
            results = engine.generate(reqs, sampling)
            gen_s.append(time.perf_counter() - t0)
            prompts = {q.request_id: list(q.prompt_ids) for q in reqs}
            g = torch.Generator().manual_seed(step)
            batch = TrainBatch(
                prompt_ids=[prompts[r.request_id] for r in results], response_ids=[list(r.response_ids) for r in results],
                rollout_logprobs=[list(r.logprobs) for r in results],
                loss_mask=[[1] * len(r.response_ids) for r in results],
                advantages=torch.randn(len(results), generator=g).tolist(),
                routing=[routes_of(r) for r in results] if moe and results[0].routing is not None else None)
            recomputed = trainer.compute_logprobs(batch)
            got, want = torch.tensor(sum(recomputed, [])), torch.tensor(sum(batch.rollout_logprobs, []))
            diffs.append((got - want).abs())
            bitwise = bitwise and torch.equal(got, want)
            t0 = time.perf_counter()
            metrics = trainer.train_step(batch)
            train_s.append(time.perf_counter() - t0)
            agree += [metrics["moe/route_agreement"]] if "moe/route_agreement" in metrics else []
            replayed += [metrics["moe/replayed_route_share"]] if "moe/replayed_route_share" in metrics else []
            clip += [metrics["train/tis_clip_frac"]] if "train/tis_clip_frac" in metrics else []
            engine.update_weights(trainer.full_state_dict(), version=step + 1)
    finally:
        engine.close()
        trainer.shutdown()
    d = torch.cat(diffs)
    return {"mismatch": float(d.mean()), "max_mismatch": float(d.max()), "bitwise": bitwise,
            "route_agreement": statistics.mean(agree) if agree else None,
            "replayed_share": statistics.mean(replayed) if replayed else None,
            "tis_clip_frac": statistics.mean(clip) if clip else None,
            "generate_s": statistics.median(gen_s), "train_s": statistics.median(train_s)}


def _learning(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Adds ``eval_before``, ``eval_after`` and ``eval_se`` to every MoE row: one real GRPO job each."""
    from miles.bench.e2e import compose
    from miles.core.cluster import stop_ray
    from miles.core.run import build_components, run_job
    from miles.models.checkpoint import ensure_checkpoint

    base = ["model=qwen3_moe", "algo=grpo", f"trainer.num_steps={args.train_steps}", "trainer.eval_every=0",
            "tracking=none", f"seed={args.seed}", f"placement.torch_threads_per_actor={args.threads}",
            *shlex.split(args.train_overrides)]
    run, _ = compose(base)
    parts = build_components(run)
    checkpoint = ensure_checkpoint(run, parts["spec"], parts["task"])  # once, for every row
    try:
        for row in rows:
            if row["model"] != "moe":
                continue
            overrides = [*base, f"model.path={checkpoint}", f"precision={row['recipe']}", f"trainer={row['trainer']}",
                         f"algo.routing_replay={'rollout' if row['replay'] == 'on' else 'off'}"]
            run, resolved = compose(overrides)
            first: dict[str, float] = {}
            final = run_job(run, resolved_yaml=resolved, overrides=overrides, keep_ray=True,
                            on_metrics=lambda m, step, first=first: first.update(m) if step == 0 else None)
            row |= {"eval_before": first["eval/accuracy"], "eval_after": final["eval/accuracy"],
                    "eval_se": final["eval/accuracy_se"]}
            print(json.dumps({k: row[k] for k in ("model", "trainer", "recipe", "replay", "eval_before", "eval_after",
                                                  "eval_se")}), flush=True)
    finally:
        stop_ray()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not set(models) <= {"dense", "moe"}:
        raise SystemExit(f"--models: dense and/or moe, got {args.models!r}")
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    if not trainers or not set(trainers) <= {"fsdp", "megatron"}:
        raise SystemExit(f"--trainers: fsdp and/or megatron, got {args.trainers!r}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            moe = model == "moe"
            ckpt = _checkpoint(f"{tmp}/{model}", moe)
            configs = [(r, rep, False) for r in recipes for rep in ((False, True) if moe else (False,))]
            if not moe:
                configs += [(r, False, True) for r in ("fp32", "bf16") if r in recipes]
            for trainer in trainers:
                for recipe, replay, exact in configs:
                    if exact and trainer != "fsdp":
                        continue
                    row = {"model": model, "trainer": trainer, "recipe": recipe + (" true_on_policy" if exact else ""),
                           "replay": "on" if replay else ("off" if moe else "-")}
                    run = _run_config(recipe, args, replay=replay, true_on_policy=exact)
                    row |= _row(ckpt, run, args, moe, trainer)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.train_steps > 0 and "moe" in models:
        _learning(rows, args)
    for model in models:
        for trainer in trainers:
            base = next((r for r in rows if r["model"] == model and r["trainer"] == trainer and r["recipe"] == "fp32"
                         and r["replay"] != "on"), None)
            for r in rows:
                if r["model"] == model and r["trainer"] == trainer and base is not None:
                    r["step_ratio"] = (r["generate_s"] + r["train_s"]) / (base["generate_s"] + base["train_s"])
    cols = ("model", "trainer", "recipe", "replay", "mismatch", "max_mismatch", "bitwise", "route_agreement", "replayed_share",
            "tis_clip_frac", "generate_s", "train_s", "step_ratio", "eval_before", "eval_after")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)) for c in cols))
    print(json.dumps({"rows": rows, "steps": args.steps, "prompts": args.prompts, "samples": args.samples,
                      "max_new_tokens": args.max_new_tokens, "threads": args.threads, "train_steps": args.train_steps,
                      "seed": args.seed, "train_overrides": args.train_overrides, "trainers": trainers}))
    return 0
