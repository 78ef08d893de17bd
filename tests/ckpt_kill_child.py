"""A run checkpoint save that SIGKILLs itself part way (``tests/test_checkpoint_shards.py``).

    python tests/ckpt_kill_child.py ROOT POINT [POINT ...]

For each ``POINT`` a forked child (the imports are paid once) writes step 1 of a small model completely into
``ROOT/<POINT>/ck``, trains one more step, then saves step 2 with the steps of :func:`miles.core.resume.save`
(the trainer state sharded, :mod:`miles.train.shards`) and kills itself with SIGKILL at ``POINT``: ``before_shards`` (``step_2.tmp`` empty), ``mid_shards`` (the shard data on disk, DCP's
``.metadata`` not), ``before_manifest``, ``before_rename`` (sealed, not renamed), ``after`` (published). The
weights of each step go to ``ROOT/<POINT>/ref/step_<k>.safetensors`` before its save starts. Prints, per
point, how its child ended: ``<POINT> <signal number>`` (or ``exit <code>``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

POINTS = ("before_shards", "mid_shards", "before_manifest", "before_rename", "after")


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save(save_dir: Path, step: int, model, optimizer, scheduler, point: str | None) -> None:
    from miles.core import resume
    from miles.train.optim import save_train_state

    tmp = resume.begin(save_dir, step)
    if point == "before_shards":
        die()
    if point == "mid_shards":  # DCP writes .metadata in finish(), after every rank's data files
        import torch.distributed.checkpoint as dcp

        dcp.FileSystemWriter.finish = lambda *_a, **_k: die()
    save_train_state(
        tmp / "trainer",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        rank=0,
        world_size=1,
        sharded=True,
    )
    resume.write_loop(tmp, step, (3, (1, 2), None), 4 * step, {"seed": 0})
    if point == "before_manifest":
        die()
    resume.seal(tmp)
    if point == "before_rename":
        die()
    resume.publish(tmp, keep=3)
    if point == "after":
        die()


def run(save_dir: Path, reference: Path, point: str) -> None:
    from safetensors.torch import save_file

    reference.mkdir(parents=True)
    model, optimizer, scheduler = model_and_optimizer()
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
        save_file(
            {k: v.clone() for k, v in model.state_dict().items()}, str(reference / f"step_{step}.safetensors")
        )
        save(save_dir, step, model, optimizer, scheduler, point if step == 2 else None)


def main(root: Path, points: list[str]) -> None:
    import miles.core.resume  # noqa: F401  (imported once, before the forks)
    import miles.train.optim  # noqa: F401

    unknown = [p for p in points if p not in POINTS]
    if unknown or not points:
        raise SystemExit(f"POINT: one or more of {', '.join(POINTS)}, found {unknown or 'none'}")
    torch.set_num_threads(1)
    for point in points:
        pid = os.fork()
        if pid == 0:
            try:
                run(root / point / "ck", root / point / "ref", point)
            finally:
                os._exit(3)  # not killed
        _, status = os.waitpid(pid, 0)
        ended = f"{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        print(point, ended, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
