"""Weight-sync benchmark: every transport, end to end, against a memory copy of the same size.

``python -m miles.bench.sync [--sizes 20M,100M] [--transports ...] [--repeats 5]``

``--engine sglang`` runs :mod:`miles.bench.sync_sglang` instead: the SGLang engine's weight-load
paths (shared-memory tensors, a gloo group) against its disk path, into a real SGLang server.

For each size, a sender actor (:class:`WeightSource`, playing trainer rank 0: it holds a state
dict of random fp32 tensors with the shapes and HF names of a Qwen3-style decoder) and a receiver
actor (:class:`BufferEngine`, a light engine that applies a version into pre-allocated tensors
exactly as ``TorchEngine.update_weights`` does: all checks, then one ``copy_`` per tensor) are
synced through each transport with :func:`miles.weights.sync.sync_weights`, the driver's wall
time from start to every engine having applied the version. The reference, measured in the same
run and alternated with the transports, is ``dst.copy_(src)`` of one pre-allocated flat tensor of
the same byte size inside the receiver process. One warm-up sync per transport first (group
rendezvous, segment allocation, first touch); then the median of ``--repeats``.
The last printed line is JSON: per size, memcpy bytes_per_s and per transport bytes_per_s and
ratio_vs_memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import Tensor

from miles.bench import names_from
from miles.bench.state_dicts import SIZES, qwen_like_state_dict


class WeightSource:
    """A sender that plays trainer rank 0: ``send_weights`` has the contract of ``FSDPTrainer.send_weights``."""

    def __init__(self, size: str, seed: int = 0, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        self.sd = qwen_like_state_dict(size, seed)

    def send_weights(self, sender: Any, version: int) -> Any:
        return sender.send(self.sd, version)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in self.sd.items()}

    def perturb(self, seed: int) -> None:
        """New weights (same layout), so that a sync has something different to deliver."""
        g = torch.Generator().manual_seed(seed)
        for v in self.sd.values():
            v.add_(torch.randn(v.shape, generator=g) * 1e-3)

    def state_dict(self) -> dict[str, Tensor]:
        return self.sd


class BufferEngine:
    """A receiver that applies versions like ``TorchEngine``: checks first, then one ``copy_`` per tensor;
    from shared memory (a receiver with ``receive_shared``) it computes from the slot's pages in place, as a
    CPU ``TorchEngine`` without adapters or rollout quantization does (nothing copied, the slot pinned)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], str]], num_threads: int = 1,
                 device: str = "cpu") -> None:
        torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.weights = {k: torch.zeros(s, dtype=getattr(torch, d), device=self.device) for k, (s, d) in shapes.items()}
        self.version = 0
        self._copy: tuple[Tensor, Tensor] | None = None
        self._pin: Any = None  # while self.weights are a shared slot's views
        self._own = self.weights  # its own tensors, back in use (overwritten whole) once it copies again

    def _check(self, state_dict: dict[str, Tensor]) -> None:
        if set(state_dict) != set(self.weights):
            raise ValueError(f"update_weights: names differ: missing {sorted(set(self.weights) - set(state_dict))}, "
                             f"unexpected {sorted(set(state_dict) - set(self.weights))}")
        bad = [k for k, v in state_dict.items() if v.shape != self.weights[k].shape]
        if bad:
            raise ValueError(f"update_weights: wrong shapes for {bad}")

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, Tensor], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self._check(state_dict)
        if self._pin is not None:  # never write into a shared slot: its own tensors again
            self.weights = self._own
            self._pin.unpin()
            self._pin = None
        for k, v in state_dict.items():
            self.weights[k].copy_(v)
        self.version = int(version)
        nbytes = float(sum(v.numel() * v.element_size() for v in state_dict.values()))
        return {"update_s": time.perf_counter() - t0, "bytes": nbytes, "in_place": 0.0}

    def update_weights_from(self, receiver: Any, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if hasattr(receiver, "receive_shared") and self.device.type == "cpu":
            shared = receiver.receive_shared(self)
            receive_s = time.perf_counter() - t0
            self._check(shared.views)
            if all(v.dtype == self.weights[k].dtype for k, v in shared.views.items()):
                self._pin = shared.pin.take_over(self._pin)
                self.weights, self.version = dict(shared.views), int(version)
                nbytes = float(sum(v.numel() * v.element_size() for v in shared.views.values()))
                return {"update_s": time.perf_counter() - t0 - receive_s, "bytes": nbytes, "receive_s": receive_s,
                        "in_place": 1.0}
            return self.update_weights(shared.views, version) | {"receive_s": receive_s}
        sd = receiver.receive(self)
        receive_s = time.perf_counter() - t0
        return self.update_weights(sd, version) | {"receive_s": receive_s}

    def weight_version(self) -> int:
        return self.version

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.weights.items()}

    def memcpy_s(self, nbytes: int) -> float:
        """Seconds of ``dst.copy_(src)`` for one pre-allocated flat tensor of ``nbytes`` (both touched before)."""
        if self._copy is None or self._copy[0].numel() != nbytes:
            src = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
            self._copy = (src, torch.zeros_like(src))
            self._copy[1].copy_(src)
        src, dst = self._copy
        t0 = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def bench_size(size: str, transports: list[str], repeats: int, bucket_mb: float, threads: int) -> dict[str, Any]:
    import ray

    from miles.config.schema import WeightSyncConfig
    from miles.weights.sync import make_transport, sync_weights

    opts = dict(num_cpus=0.5, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
    source = ray.remote(WeightSource).options(**opts).remote(size, num_threads=threads)
    shapes = ray.get(source.shapes.remote())
    engine = ray.remote(BufferEngine).options(**opts).remote(shapes, num_threads=threads)
    numel = sum(torch.Size(s).numel() for s, _ in shapes.values())
    nbytes = numel * 4
    made = {t: make_transport(WeightSyncConfig(transport=t, bucket_mb=bucket_mb), [source], [engine])
            for t in transports}
    version = 0
    try:
        for tr in made.values():  # warm-up
            version += 1
            sync_weights([source], [engine], version, tr)
        memcpy: list[float] = []
        seconds: dict[str, list[float]] = {t: [] for t in transports}
        for _ in range(repeats):
            memcpy.append(ray.get(engine.memcpy_s.remote(nbytes)))
            for name, tr in made.items():
                version += 1
                seconds[name].append(sync_weights([source], [engine], version, tr)["weight_sync/seconds"])
        assert ray.get(engine.weight_version.remote()) == version
    finally:
        for tr in made.values():
            tr.close()
        ray.kill(source)
        ray.kill(engine)
    memcpy_bps = nbytes / statistics.median(memcpy)
    out: dict[str, Any] = {"params": numel, "bytes": nbytes, "memcpy": {"bytes_per_s": memcpy_bps}}
    for name, s in seconds.items():
        bps = nbytes / statistics.median(s)
        out[name] = {"bytes_per_s": bps, "ratio_vs_memcpy": bps / memcpy_bps, "seconds": statistics.median(s)}
    return out


def main(argv: list[str] | None = None) -> int:
    from miles.weights.sync import CPU_TRANSPORTS, TRANSPORTS

    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "python -m miles.bench sync"
    engine = argparse.ArgumentParser(prog=prog, add_help=False)
    engine.add_argument("--engine", choices=["buffer", "sglang"], default="buffer",
                        help="buffer: a receiver like the torch engine's; sglang: miles.bench.sync_sglang")
    if engine.parse_known_args(argv)[0].engine == "sglang":
        from miles.bench.sync_sglang import main as sglang_main

        return sglang_main(argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], parents=[engine])
    ap.add_argument("--sizes", type=names_from(SIZES), default="20M,100M", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--transports", type=names_from(TRANSPORTS), default=",".join(CPU_TRANSPORTS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=128.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the sender and receiver actors")
    args = ap.parse_args(argv)
    sizes, transports = args.sizes, args.transports
    if args.repeats < 1:
        ap.error("--repeats: must be at least 1")

    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        result = {s: bench_size(s, transports, args.repeats, args.bucket_mb, args.threads) for s in sizes}
    finally:
        if started:
            ray.shutdown()
    for s, r in result.items():
        print(f"{s} ({r['params'] / 1e6:.1f}M params, {r['bytes'] / 2**20:.0f} MiB): "
              f"memcpy {r['memcpy']['bytes_per_s'] / 1e9:.2f} GB/s")
        for t in transports:
            print(f"  {t:<13} {r[t]['bytes_per_s'] / 1e9:6.2f} GB/s  {r[t]['seconds'] * 1e3:8.1f} ms  "
                  f"ratio_vs_memcpy {r[t]['ratio_vs_memcpy']:.3f}")
    print(json.dumps({s: {"memcpy_bytes_per_s": r["memcpy"]["bytes_per_s"],
                          **{t: {"bytes_per_s": r[t]["bytes_per_s"], "ratio_vs_memcpy": r[t]["ratio_vs_memcpy"]}
                             for t in transports}} for s, r in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
