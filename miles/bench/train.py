"""Trainer throughput: miles' FSDPTrainer and MegatronTrainer at world size 1 vs a plain PyTorch loop.

    python -m miles.bench train [--flavor tiny|20m] [--batch-size 16] [--prompt-len 32] [--response-len 96]
                                [--megatron auto|on|off]

Every side trains the same Qwen3 checkpoint (random init, fp32) on the same fixed batch with the same
objective (PPO-clip at ratio 1, token mean over the response tokens, the GRPO default), the same AdamW
settings and grad-norm clipping:

* miles (FSDP): :class:`miles.train.fsdp.FSDPTrainer` built *in this process* as rank 0 of a 1-rank
  gloo group, timed around ``train_step(batch)`` (padding, micro-batch planning, FSDP2 hooks, metrics
  and all);
* megatron: :class:`miles.train.megatron.MegatronTrainer` as rank 0 of a 1-rank gloo group (megatron's
  GPTModel, DDP wrapper and schedule; the CPU compatibility layer), timed around ``train_step(batch)``
  in a child process (each trainer owns its process's default process group); the child waits on a
  pipe between steps, so the sides still alternate. With ``--megatron auto`` (the default) this side
  runs when megatron-core is installed;
* plain torch: the HF model, ``forward (LM head on the response positions only) -> log_softmax/gather
  -> loss -> backward -> clip -> AdamW``.

At world size 1 in fp32 the FSDP trainer does not ``fully_shard`` (sharding over one rank is the
identity; measured: FSDP2 at W=1 cost ~19% on the tiny model, mostly per-parameter DTensor dispatch in
AdamW and the all-gather/reduce-scatter copies), so this measures everything else the trainer does per
step. The batch's prompts are all distinct, so neither trainer shares prompt passes
(``shared_prompt_forward`` is off on both).

Steps alternate (miles, megatron, plain, miles, ...) after a warmup, and each side's tokens/s is the
median over repeats (tokens = prompt + response tokens of the batch); the process CPU time per step
is reported too (``cpu_ratio_vs_plain_torch``: steadier than wall time when other work shares the
cores). The last line printed is JSON with ``tokens_per_s_miles``, ``tokens_per_s_plain_torch`` and
``ratio_vs_plain_torch`` (FSDP, wall time), and the same with a ``_megatron`` suffix.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m miles.bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="tiny", help="Qwen3 flavor from miles.models.qwen3 (tiny, 20m, ...)")
    ap.add_argument("--vocab-size", type=int, default=512, help="vocabulary of the random-init model")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=15, help="timed steps per side (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=0, help="trainer sides only (0: one pass)")
    ap.add_argument("--megatron", choices=("auto", "on", "off"), default="auto",
                    help="time MegatronTrainer too (auto: when megatron-core is installed)")
    return ap.parse_args(argv)


def _checkpoint(flavor: str, vocab_size: int, directory: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.models.qwen3 import QWEN3_FLAVORS

    if flavor not in QWEN3_FLAVORS:
        raise SystemExit(f"--flavor: unknown Qwen3 flavor {flavor!r}; valid: {', '.join(QWEN3_FLAVORS)}")
    dims = {**QWEN3_FLAVORS[flavor], "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**dims), dtype=torch.float32).save_pretrained(directory)
    return directory


def _plain_step_fn(ckpt: str, batch, run) -> Callable[[], None]:
    """A minimal single-process RL step on the HF model, with the trainer's loss and optimizer settings."""
    from transformers import AutoModelForCausalLM

    from miles.algos.logprobs import token_logprobs
    from miles.algos.losses import ppo_clip_loss

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    t, algo = run.trainer, run.algo
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    plen = len(batch.prompt_ids[0])

    def step() -> None:
        ids = torch.tensor([p + r for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)])
        targets = ids[:, plen:]
        # only the positions that predict response tokens go through the LM head (as in the trainer)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - plen + 1).logits[:, :-1]
        logp = token_logprobs(logits, targets, temperature=run.rollout.temperature)
        adv = torch.tensor(batch.advantages)
        loss, _ = ppo_clip_loss(logp, logp.detach(), adv, clip_low=algo.clip_low, clip_high=algo.clip_high)
        loss.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _megatron_child(conn: Any, ckpt: str, run: Any, batch: Any, threads: int) -> None:
    """A MegatronTrainer rank in a child process: ``train_step`` on each "step" message, timed here."""
    from miles.config import RankConfig
    from miles.machine import free_port
    from miles.train.megatron import MegatronTrainer

    torch.set_num_threads(threads)
    trainer = MegatronTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                              checkpoint_dir=ckpt, config=RankConfig.of(run), num_threads=threads)
    conn.send("ready")
    try:
        while conn.recv() == "step":
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.train_step(batch)
            conn.send((time.perf_counter() - start, time.process_time() - start_cpu))
    finally:
        trainer.shutdown()


class _MegatronSide:
    """Drives :func:`_megatron_child`; calling it runs one step and returns the child's (wall, cpu) seconds."""

    def __init__(self, ckpt: str, run: Any, batch: Any, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_megatron_child, args=(child, ckpt, run, batch, threads), daemon=True)
        self.proc.start()
        if not self.conn.poll(600) or self.conn.recv() != "ready":
            raise RuntimeError("the megatron side did not start within 600 s")

    def __call__(self) -> tuple[float, float]:
        self.conn.send("step")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(60)


def _want_megatron(flag: str) -> bool:
    installed = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
    if flag == "on" and not installed:
        raise SystemExit("--megatron on: megatron-core is not installed (pip install -e '.[megatron]')")
    return flag != "off" and bool(installed)


def main(argv: list[str] | None = None) -> int:
    """``python -m miles.bench train [flags]``: prints per-step times and, last, one JSON line."""
    measure(argv)
    return 0


def measure(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark with command-line ``argv``; prints as :func:`main` and returns the JSON dict."""
    from safetensors.torch import load_file

    from miles.config import RankConfig, validate
    from miles.machine import free_port
    from miles.train.fsdp import FSDPTrainer
    from miles.types import TrainBatch

    args = _parse(argv)
    torch.set_num_threads(args.threads)
    b, p, r = args.batch_size, args.prompt_len, args.response_len
    run = validate({"trainer": {"lr": 1e-5, "lr_warmup_steps": 0, "shared_prompt_forward": False,
                                "max_tokens_per_microbatch": args.max_tokens_per_microbatch},
                    "algo": {"num_prompts_per_step": b, "num_samples_per_prompt": 1},
                    "rollout": {"max_new_tokens": r}})
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch(
        prompt_ids=torch.randint(3, args.vocab_size, (b, p), generator=g).tolist(),
        response_ids=torch.randint(3, args.vocab_size, (b, r), generator=g).tolist(),
        rollout_logprobs=[[-1.0] * r for _ in range(b)], loss_mask=[[1] * r for _ in range(b)],
        advantages=torch.randn(b, generator=g).tolist(),
    )
    tokens = b * (p + r)
    megatron = _want_megatron(args.megatron)
    with tempfile.TemporaryDirectory(prefix="miles-bench-train-") as tmp:
        ckpt = _checkpoint(args.flavor, args.vocab_size, tmp)
        n_params = sum(v.numel() for v in load_file(f"{tmp}/model.safetensors").values())
        trainer = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                              checkpoint_dir=ckpt, config=RankConfig.of(run), num_threads=args.threads)
        plain = _plain_step_fn(ckpt, batch, run)
        sides: dict[str, Callable[[], object]] = {"miles": lambda: trainer.train_step(batch)}
        child = _MegatronSide(ckpt, run, batch, args.threads) if megatron else None
        if child is not None:
            sides["megatron"] = child
        sides["plain_torch"] = plain
        times: dict[str, list[float]] = {k: [] for k in sides}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        try:
            for i in range(args.warmup + args.repeats):
                for name, fn in sides.items():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    timed = fn()
                    wall, used = time.perf_counter() - start, time.process_time() - start_cpu
                    if name == "megatron":  # measured in the child, around train_step alone
                        wall, used = timed  # type: ignore[misc]
                    if i >= args.warmup:
                        times[name].append(wall)
                        cpu[name].append(used)
        finally:
            trainer.shutdown()
            if child is not None:
                child.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    result: dict[str, object] = {
        "flavor": args.flavor, "params": n_params, "batch": f"{b}x({p}+{r})", "threads": args.threads,
        "miles_side": "FSDPTrainer in-process, 1-rank gloo group (no fully_shard at W=1 fp32)",
        "step_s_miles": round(med["miles"], 4), "step_s_plain_torch": round(med["plain_torch"], 4),
        "tokens_per_s_miles": round(tokens / med["miles"], 1),
        "tokens_per_s_plain_torch": round(tokens / med["plain_torch"], 1),
        "cpu_s_miles": round(med_cpu["miles"], 4), "cpu_s_plain_torch": round(med_cpu["plain_torch"], 4),
        "cpu_ratio_vs_plain_torch": round(med_cpu["plain_torch"] / med_cpu["miles"], 3),
        "ratio_vs_plain_torch": round(med["plain_torch"] / med["miles"], 3),
    }
    if megatron:
        result.update({
            "megatron_side": "MegatronTrainer (TP=PP=DP=1), 1-rank gloo group in a child process",
            "step_s_megatron": round(med["megatron"], 4),
            "tokens_per_s_megatron": round(tokens / med["megatron"], 1),
            "cpu_s_megatron": round(med_cpu["megatron"], 4),
            "cpu_ratio_vs_plain_torch_megatron": round(med_cpu["plain_torch"] / med_cpu["megatron"], 3),
            "ratio_vs_plain_torch_megatron": round(med["plain_torch"] / med["megatron"], 3),
        })
    else:
        result["megatron_side"] = "skipped (--megatron off, or megatron-core not installed)"
    for k, v in times.items():
        print(f"{k:12s} step s: " + " ".join(f"{x:.4f}" for x in v))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    raise SystemExit(main())
