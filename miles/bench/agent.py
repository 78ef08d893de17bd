"""``python -m miles.bench agent``: multi-turn sessions with growing context, with session reuse
(engine affinity + the engines' per-session prefix cache) against without, alternating, in one command.

Model: the ``tiny`` Qwen3 of ``bench rollout`` (:func:`miles.bench.rollout.build_model`, random init,
4096 positions) with an EOS probability of 1e-9 per token, so every turn generates exactly
``--new-tokens`` tokens. Engines: ``--engines`` real :class:`~miles.rollout.torch_engine.TorchEngine`
Ray actors (``--threads`` torch threads each, dashboard off) behind a real
:class:`~miles.rollout.dispatch.EnginePool`.

Workload: ``--sessions`` sessions of ``--turns`` turns, all running at once. Turn 1's prompt is
``--prompt-tokens`` random token ids; turn ``t + 1``'s prompt is turn ``t``'s prompt, its generated
ids and an observation of ``--obs-tokens`` random ids (the same observations on both sides). Every
request carries its session's ``session_id``. Sides, in alternating order over ``--repeats``:

- ``reuse``: ``rollout.session_affinity=true`` and ``prefix_cache_tokens`` large enough for every
  session's context, so a later turn goes to the engine of the one before and prefills only its new
  tokens;
- ``none``: affinity off and ``prefix_cache_tokens=0``: every turn prefills its whole prompt on the
  least-loaded engine.

Per side: total tokens/s = (prompt tokens of every turn, whether prefilled or reused from the cache,
+ generated tokens) / wall time of the whole workload, so both sides count the same work; generated
tokens/s; per-turn latency p50/p90/p99 (from a session's turn request to its result, over every turn
of every repeat); the prefix hit share (prompt tokens reused / prompt tokens, from the engines'
``health()["prefix_cache"]``, 0 on the ``none`` side) and the pool's affinity hits. Tokens/s are
medians over repeats. The last line printed is JSON with ``ratio_tokens_per_s_reuse_over_none``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIDES = ("reuse", "none")
MAX_POSITIONS = 4096


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _engines(path: Path, k: int, threads: int, prefix_cache_tokens: int, seed: int) -> list:
    import ray

    from miles.config.schema import PrecisionConfig
    from miles.core.actors import ENGINE_MAX_CONCURRENCY
    from miles.rollout.torch_engine import TorchEngine

    actor = ray.remote(TorchEngine).options(num_cpus=0.1, max_concurrency=ENGINE_MAX_CONCURRENCY)
    engines = [actor.remote(str(path), PrecisionConfig(), seed=seed + i, num_threads=threads, engine_id=i,
                            prefix_cache_tokens=prefix_cache_tokens) for i in range(k)]
    ray.get([e.health.remote() for e in engines])
    return engines


def _prefix_counts(engines: list) -> tuple[int, int]:
    """(hit_tokens, prompt_tokens) summed over the engines (0, 0 without the engine's prefix cache)."""
    import ray

    stats = [h.get("prefix_cache", {}) for h in ray.get([e.health.remote() for e in engines])]
    return sum(s.get("hit_tokens", 0) for s in stats), sum(s.get("prompt_tokens", 0) for s in stats)


def run_side(engines: list, affinity: bool, w: dict[str, int], vocab: int, rep: int) -> dict[str, Any]:
    """One pass of the workload over ``engines``: wall seconds, token counts, turn latencies, pool counts."""
    from miles.config.schema import RolloutConfig
    from miles.rollout.dispatch import EnginePool
    from miles.types import GenerateRequest, SamplingParams

    pool = EnginePool(engines, RolloutConfig(session_affinity=affinity, request_timeout_s=3600.0))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=w["new_tokens"])
    g = torch.Generator().manual_seed(rep)  # the same prompts and observations on both sides
    starts = [tuple(torch.randint(3, vocab, (w["prompt_tokens"],), generator=g).tolist())
              for _ in range(w["sessions"])]
    obs = [[tuple(torch.randint(3, vocab, (w["obs_tokens"],), generator=g).tolist()) for _ in range(w["turns"])]
           for _ in range(w["sessions"])]
    latencies: list[float] = []
    counts = {"prompt_tokens": 0, "generated_tokens": 0}

    async def session(s: int, queue: Any) -> None:
        prompt, sid = starts[s], f"bench-r{rep}-s{s}"
        for t in range(w["turns"]):
            t0 = time.perf_counter()
            seed = rep * 1_000_003 + 7919 * s + t
            (r,) = await queue.generate(GenerateRequest(request_id=f"{sid}-t{t}", prompt_ids=prompt, seed=seed,
                                                        session_id=sid), sampling)
            latencies.append(time.perf_counter() - t0)
            counts["prompt_tokens"] += len(prompt)
            counts["generated_tokens"] += len(r.response_ids)
            prompt = prompt + tuple(r.response_ids) + obs[s][t]

    async def main() -> float:
        queue = pool.session()
        t0 = time.perf_counter()
        await asyncio.gather(*(session(s, queue) for s in range(w["sessions"])))
        return time.perf_counter() - t0

    hits0, prompts0 = _prefix_counts(engines)
    seconds = asyncio.run(main())
    hits1, prompts1 = _prefix_counts(engines)
    return {"seconds": seconds, **counts, "latencies": latencies, "hit_tokens": hits1 - hits0,
            "engine_prompt_tokens": prompts1 - prompts0, "affinity_hits": pool.counts["affinity_hits"]}


def bench(w: dict[str, int], engines: int, repeats: int, threads: int, out=None) -> dict[str, Any]:
    """Both sides ``repeats`` times, alternating (a line each to ``out``); returns the JSON summary."""
    import ray

    from miles.bench.rollout import build_model
    out = out or sys.stdout  # looked up per call: a test may have swapped it since import

    longest = w["prompt_tokens"] + w["turns"] * (w["new_tokens"] + w["obs_tokens"])
    if longest > MAX_POSITIONS:
        raise ValueError(f"a session reaches {longest} tokens; the bench model has {MAX_POSITIONS} positions")
    cache_tokens = 2 * w["sessions"] * longest  # every session's context, with room to spare
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(2, engines), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
    try:
        with tempfile.TemporaryDirectory(prefix="miles-bench-agent-") as tmp:
            path = build_model(Path(tmp) / "tiny", 1e-9, max_positions=MAX_POSITIONS)
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(path).vocab_size
            pools = {side: _engines(path, engines, threads, cache_tokens if side == "reuse" else 0, seed=0)
                     for side in SIDES}
            warm = dict(w, sessions=engines, turns=2, new_tokens=2)
            for side in SIDES:  # first calls are slow (allocation): not timed
                run_side(pools[side], side == "reuse", warm, vocab, rep=10_000)
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
            for rep in range(repeats):
                for side in SIDES[rep % 2:] + SIDES[:rep % 2]:  # each side first in turn
                    r = run_side(pools[side], side == "reuse", w, vocab, rep)
                    runs[side].append(r)
                    tps = (r["prompt_tokens"] + r["generated_tokens"]) / r["seconds"]
                    share = r["hit_tokens"] / max(r["engine_prompt_tokens"], 1)
                    print(f"repeat {rep} {side:5s}: {r['seconds']:.2f} s, {tps:8.0f} tok/s, prefix hit share "
                          f"{share:.2f}, affinity hits {r['affinity_hits']}", file=out, flush=True)
            for handles in pools.values():
                for e in handles:
                    ray.kill(e)
    finally:
        if started:
            ray.shutdown()
    result: dict[str, Any] = {}
    for side, rs in runs.items():
        lat = [x for r in rs for x in r["latencies"]]
        hit_share = sum(r["hit_tokens"] for r in rs) / max(sum(r["engine_prompt_tokens"] for r in rs), 1)
        result |= {
            f"tokens_per_s_{side}": statistics.median((r["prompt_tokens"] + r["generated_tokens"]) / r["seconds"]
                                                      for r in rs),
            f"generated_tokens_per_s_{side}": statistics.median(r["generated_tokens"] / r["seconds"] for r in rs),
            f"turn_latency_s_p50_{side}": _percentile(lat, 0.5), f"turn_latency_s_p90_{side}": _percentile(lat, 0.9),
            f"turn_latency_s_p99_{side}": _percentile(lat, 0.99),
            f"prefix_hit_share_{side}": hit_share,
            f"affinity_hits_{side}": sum(r["affinity_hits"] for r in rs),
        }
    result["ratio_tokens_per_s_reuse_over_none"] = result["tokens_per_s_reuse"] / result["tokens_per_s_none"]
    result["workload"] = dict(w, engines=engines, repeats=repeats, threads=threads,
                              prefix_cache_tokens=cache_tokens, model="qwen3 tiny (random init, EOS never sampled)",
                              tokens_per_repeat=runs["none"][0]["prompt_tokens"] + runs["none"][0]["generated_tokens"])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles.bench agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, help="sessions running at once (default 16)")
    p.add_argument("--turns", type=int, help="turns per session (default 4)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per turn (default 32)")
    p.add_argument("--obs-tokens", type=int, help="observation tokens appended after each turn (default 128)")
    p.add_argument("--prompt-tokens", type=int, help="tokens of a session's first prompt (default 64)")
    p.add_argument("--engines", type=int, default=2, help="engine actors (default 2)")
    p.add_argument("--repeats", type=int, help="runs per side, sides alternating; tokens/s are medians (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--quick", action="store_true",
                   help="seconds, for tests: 4 sessions x 2 turns, 4 new tokens, 16-token observations, 1 repeat")
    args = p.parse_args(argv)
    defaults = (4, 2, 4, 16, 16, 1) if args.quick else (16, 4, 32, 128, 64, 5)
    names = ("sessions", "turns", "new_tokens", "obs_tokens", "prompt_tokens", "repeats")
    for name, value in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < (0 if name == "obs_tokens" else 1):
            p.error(f"--{name.replace('_', '-')}: must be >= {0 if name == 'obs_tokens' else 1}, "
                    f"got {getattr(args, name)}")
    if args.engines < 1 or args.threads < 1:
        p.error("--engines and --threads must be >= 1")
    w = {name: getattr(args, name) for name in names if name != "repeats"}
    try:
        result = bench(w, args.engines, args.repeats, args.threads)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
