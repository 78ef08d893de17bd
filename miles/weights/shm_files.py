"""The lifetime of a run's ``shm`` weight-sync files (:mod:`miles.weights.shm`) in ``weight_sync.shm_dir``.

A run's files share a prefix (``<shm_dir>/miles-weights-<id>``): the control page, a segment per layout,
and an empty ``<prefix>-held``. Every process that maps the files (trainer rank 0, the engines) holds a
shared ``flock`` on ``-held`` for as long as it does (:func:`hold`); the kernel drops the lock of a process
that dies. The driver removes the files when the run ends (:func:`remove_files`). A run killed before that
leaves them, in memory on a tmpfs; :func:`sweep_stale`, which rank 0 runs before its first version, removes
the files of every run whose ``-held`` nobody holds. (``-held`` is a file of its own because the control
page's whole-file lock is the pins' mutex, :mod:`miles.weights.shm_pins`.)
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def held_path(prefix: str) -> str:
    return f"{prefix}-held"


def hold(prefix: str, create: bool = False) -> int:
    """A descriptor of run ``prefix``'s ``-held`` file with a shared lock on it (``create``: make the file if
    it is not there, as rank 0 does). Raises FileNotFoundError when the file is not there, or was removed
    between the open and the lock (rank 0 then makes it again: a sweep of another run can take a file that
    nobody holds yet)."""
    for _ in range(3 if create else 1):
        fd = os.open(held_path(prefix), os.O_RDONLY | (os.O_CREAT if create else 0), 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink > 0:
            return fd
        os.close(fd)
    raise FileNotFoundError(held_path(prefix))


def remove_files(prefix: str) -> None:
    """Unlink every file of run ``prefix`` (processes that map them keep their pages until they let go)."""
    parent, stem = os.path.split(prefix)
    for p in Path(parent).glob(f"{stem}-*"):
        p.unlink(missing_ok=True)


def sweep_stale(directory: str, keep: str) -> list[str]:
    """Remove the files of the other runs in ``directory`` whose ``-held`` file no live process holds (runs
    killed before their driver could remove them). ``keep``: this run's prefix. Returns the prefixes removed;
    files of another user, or that cannot be opened, are left alone, and so are files without a ``-held``."""
    removed = []
    for held in sorted(Path(directory).glob("miles-weights-*-held")):
        prefix = str(held)[: -len("-held")]
        if prefix == keep:
            continue
        try:
            fd = os.open(held, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live process of that run holds it
            remove_files(prefix)
            removed.append(prefix)
        finally:
            os.close(fd)
    return removed
