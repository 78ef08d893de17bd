"""The SHA-256 manifest of a run checkpoint: what makes a checkpoint complete, and what is checked before reading it.

``manifest.json`` lists every other file under the checkpoint directory (paths relative to it, with
their size and SHA-256) and is written last, atomically (``manifest.json.tmp``, fsync, ``os.replace``),
after the files it lists were flushed to disk. A checkpoint without it is incomplete: a save that was
killed part way. A file that is missing, added, or does not match its digest is refused before
anything in the checkpoint is read (:func:`verify`), so no damaged or foreign file ever reaches a parser.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

NAME = "manifest.json"
FORMAT = 1


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != NAME)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root: str | Path) -> Path:
    """Flush every file under ``root`` to disk, then write ``root/manifest.json`` listing them (atomically)."""
    root = Path(root)
    files = {}
    for p in _files(root):
        fsync(p)
        files[p.relative_to(root).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    tmp = root / (NAME + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))
    fsync(tmp)
    os.replace(tmp, root / NAME)
    fsync(root)
    return root / NAME


def has_manifest(root: str | Path) -> bool:
    return (Path(root) / NAME).is_file()


def verify(root: str | Path, only: Iterable[str] | None = None) -> None:
    """ValueError unless the files under ``root`` are exactly those of its manifest, with their sizes; and
    the digests of ``only`` (relative paths; None: every file) match. Nothing else in ``root`` is read."""
    root = Path(root)
    if not has_manifest(root):
        raise ValueError(f"{root}: no {NAME}, so the checkpoint is incomplete (a save that did not finish; the "
                         f"manifest is written last); resume from an earlier step_<k> next to it")
    try:
        listed = json.loads((root / NAME).read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{root / NAME}: not a checkpoint manifest ({e})") from None
    present = {p.relative_to(root).as_posix(): p for p in _files(root)}
    missing, extra = sorted(set(listed) - set(present)), sorted(set(present) - set(listed))
    if missing or extra:
        raise ValueError(f"{root}: the files differ from {NAME}: missing {missing or 'none'}, not listed "
                         f"{extra or 'none'}; the checkpoint was changed after it was written")
    check = sorted(listed) if only is None else [f for f in only if f in listed]
    for rel in sorted(listed):
        found = present[rel].stat().st_size
        if found != listed[rel]["bytes"]:
            raise ValueError(f"{root / rel}: {found} bytes, the manifest says {listed[rel]['bytes']}; the file was "
                             "changed or damaged after the checkpoint was written (refused before reading it)")
    for rel in check:
        digest = sha256(present[rel])
        if digest != listed[rel]["sha256"]:
            raise ValueError(f"{root / rel}: SHA-256 {digest[:16]}..., the manifest says "
                             f"{listed[rel]['sha256'][:16]}...; the file was changed or damaged after the checkpoint "
                             "was written (refused before reading it)")
