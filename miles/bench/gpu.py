"""GPU throughput: the torch engine's decode tokens/s against the HBM bound, and the FSDP trainer's tokens/s.

    python -m miles.bench gpu [--flavor 0.6b] [--batch-size 64] [--prompt-len 128] [--new-tokens 128]

Both on one CUDA device, without Ray (the engine and a one-rank NCCL trainer built in this process),
on a random-init Qwen3 of ``--flavor`` in bf16:

* decode: ``--batch-size`` prompts of ``--prompt-len`` random tokens, each completed to
  ``--new-tokens`` tokens (EOS is unlikely on random weights and the run says how many stopped
  early). A decode step must read every weight once, so ``batch * HBM bytes/s / weight bytes`` is an
  upper bound on decode tokens/s; ``decode_fraction_of_hbm_bound`` is the measured share of it (the
  KV cache reads and the prefill are counted against the engine, not the bound).
* train: ``train_step`` on the same number of samples (prompt + response tokens), median over
  repeats, fp32 master weights with bf16 compute.

The last line printed is JSON. Written for ``scripts/gpu_check.sh``; not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time

import torch

HBM_GB_PER_S = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}
"""Peak memory bandwidth by device-name substring (vendor figures), for the bound."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m miles.bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="0.6b", help="Qwen3 flavor from miles.models.qwen3")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hbm-gb-per-s", type=float, default=0.0, help="0: from the device name")
    return ap.parse_args(argv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("miles.bench gpu: no CUDA device in this process")
    from transformers import AutoModelForCausalLM, Qwen3Config

    from miles.config import RankConfig
    from miles.config.schema import PrecisionConfig
    from miles.config.validate import validate
    from miles.models.qwen3 import QWEN3_FLAVORS
    from miles.rollout.torch_engine import TorchEngine
    from miles.train.fsdp import FSDPTrainer
    from miles.types import GenerateRequest, SamplingParams, TrainBatch

    name = torch.cuda.get_device_name()
    hbm = args.hbm_gb_per_s or next((v for k, v in HBM_GB_PER_S.items() if k in name), 0.0)
    out: dict[str, float | str] = {"device": name, "flavor": args.flavor, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory() as d:
        cfg = Qwen3Config(**QWEN3_FLAVORS[args.flavor])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
        g = torch.Generator().manual_seed(0)
        prompts = [tuple(torch.randint(100, cfg.vocab_size - 100, (args.prompt_len,), generator=g).tolist())
                   for _ in range(args.batch_size)]

        engine = TorchEngine(d, PrecisionConfig(rollout_dtype="bfloat16"), device="cuda",
                             max_batch_size=args.batch_size)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
        times, results = [], []
        for rep in range(args.repeats + 1):
            reqs = [GenerateRequest(request_id=f"{rep}-{i}", prompt_ids=p, seed=i) for i, p in enumerate(prompts)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            results = engine.generate(reqs, sampling)
            torch.cuda.synchronize()
            if rep:  # the first call compiles and allocates
                times.append(time.perf_counter() - t0)
        engine.close()
        tokens = sum(len(r.response_ids) for r in results)
        decode = tokens / statistics.median(times)
        out |= {"decode_tokens_per_s": decode, "weight_bytes": float(weight_bytes),
                "stopped_early": float(sum(len(r.response_ids) < args.new_tokens for r in results))}
        if hbm:
            bound = args.batch_size * hbm * 1e9 / weight_bytes
            out |= {"hbm_gb_per_s": hbm, "decode_hbm_bound_tokens_per_s": bound,
                    "decode_fraction_of_hbm_bound": decode / bound}

        run = validate({"precision": {"train_dtype": "bfloat16"}, "trainer": {"lr_warmup_steps": 0}})
        trainer = FSDPTrainer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=_port(), checkpoint_dir=d,
                              config=RankConfig.of(run), device="cuda")
        batch = TrainBatch(prompt_ids=[list(p) for p in prompts],
                           response_ids=[list(r.response_ids) for r in results],
                           rollout_logprobs=[list(r.logprobs) for r in results],
                           loss_mask=[[1] * len(r.response_ids) for r in results],
                           advantages=[(-1.0) ** i for i in range(len(results))])
        train_times = []
        for rep in range(args.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            torch.cuda.synchronize()
            if rep:
                train_times.append(time.perf_counter() - t0)
        trainer.shutdown()
        train_tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True))
        out["train_tokens_per_s"] = train_tokens / statistics.median(train_times)
    print(json.dumps(out))
    return 0
