"""The machine a run starts on: its cores and CUDA devices, ``placement.device`` resolved, a free port,
whether a process of it still runs.

Below every other layer, so the placement plan (:mod:`miles.core.plan`), the rendezvous
(:mod:`miles.core.cluster`) and the SGLang engine and server read the machine the same way.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What a plan needs to know of where it runs; :meth:`here` reads it."""

    cpus: int  # cores this process may run on
    cuda_devices: int = 0
    ray_gpus: float | None = None
    """GPUs of the Ray cluster this process is connected to; None before it connects."""

    @classmethod
    def here(cls) -> Machine:
        """This machine, and the Ray cluster this process is connected to (if any; nothing is started)."""
        import torch

        ray = sys.modules.get("ray")
        gpus = ray.cluster_resources().get("GPU", 0.0) if ray is not None and ray.is_initialized() else None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(cpus=cpus, cuda_devices=torch.cuda.device_count(), ray_gpus=gpus)


def resolve_device(setting: str, joined: bool, machine: Machine) -> str:
    """``placement.device`` with ``auto`` resolved: ``cuda`` when the Ray cluster offers GPUs (before Ray
    starts: when this machine has a CUDA device and no cluster is joined), else ``cpu``."""
    if setting != "auto":
        return setting
    if machine.ray_gpus is not None:
        return "cuda" if machine.ray_gpus > 0 else "cpu"
    return "cuda" if not joined and machine.cuda_devices > 0 else "cpu"


RENDEZVOUS_PORTS = (30000, 32768)
"""Where :func:`free_port` looks first: below the kernel's ephemeral range (32768+ by default), so that
no outgoing connection (Ray opens many) or ``bind(0)`` takes the port between picking it and the
process group's store binding it; above Ray's worker ports (10002-19999) and the ports SGLang picks
(below 30000)."""


_PORT_DRAWS = random.SystemRandom()
"""Ports are drawn from the OS's entropy, never from the global generator a run seeds: runs with the
same seed on one machine (a parallel sweep, two users) would otherwise try the same ports in order."""


def free_port(host: str = "127.0.0.1", attempts: int = 64, ports: tuple[int, int] | None = None) -> int:
    """A port ``host`` can bind now: one of ``attempts`` random ports in ``ports`` (default
    :data:`RENDEZVOUS_PORTS`), else (all tried ones taken) any free port the kernel gives."""
    lo, hi = ports or RENDEZVOUS_PORTS
    for port in _PORT_DRAWS.sample(range(lo, hi), min(attempts, hi - lo)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie counts until reaped; another user's
    process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
