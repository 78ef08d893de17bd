"""Weight sync through files: safetensors in one directory per version, published by a rename.

Trainer rank 0 writes ``<dir>/.v<version>.tmp-<id>/model.safetensors`` (the version in the file's
metadata), renames the directory to ``<dir>/v<version>`` (atomic on one filesystem: a reader sees
a whole version or none) and removes every older version directory. Engines load the file with
``safetensors`` (never pickle) onto their device. With several nodes ``weight_sync.disk_dir`` must
be a filesystem they all mount; the default is a temp directory of the run on the driver's node.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from torch import Tensor

from miles.config.schema import WeightSyncConfig
from miles.weights.transport import Sent, Transport

log = logging.getLogger(__name__)

FILENAME = "model.safetensors"
VERSION_KEY = "miles_weight_version"


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def _is_version_dir(p: Path) -> bool:
    """``v00000012`` or an unfinished ``.v00000012.tmp-<id>``: the only names this transport touches."""
    return p.is_dir() and re.fullmatch(r"v\d{8}|\.v\d{8}\.tmp-[0-9a-f]{8}", p.name) is not None


def _unshared(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share a storage (tied weights, views) and non-contiguous ones: copy those."""
    seen: set[int] = set()
    out = {}
    for k, t in state_dict.items():
        ptr = t.untyped_storage().data_ptr()
        if (t.numel() and ptr in seen) or not t.is_contiguous():
            t = t.contiguous().clone()
        seen.add(ptr)
        out[k] = t
    return out


class DiskSender:
    """Runs on trainer rank 0: write, rename into place, drop older versions."""

    def __init__(self, root: str) -> None:
        self.root = root

    def send(self, state_dict: dict[str, Tensor], version: int) -> Sent:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        root = Path(self.root)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".v{version:08d}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            save_file(_unshared(state_dict), str(tmp / FILENAME), metadata={VERSION_KEY: str(version)})
            final = version_dir(root, version)
            if final.exists():  # the same version sent again (a retried sync)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in root.iterdir():
            if old != final and _is_version_dir(old):
                shutil.rmtree(old, ignore_errors=True)
        return Sent(handle=str(final), bytes=(final / FILENAME).stat().st_size, send_s=time.perf_counter() - t0)


class DiskReceiver:
    """Runs in an engine: load the version's safetensors file onto the engine's device."""

    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version

    def receive(self, engine: Any) -> dict[str, Tensor]:
        from safetensors import safe_open

        file = Path(self.path) / FILENAME
        if not file.is_file():
            raise FileNotFoundError(
                f"weight_sync disk: {file} does not exist on this engine's node. The directory must be visible "
                "to trainer rank 0 and every engine: set weight_sync.disk_dir to a shared filesystem, or use "
                "weight_sync=broadcast or weight_sync=object_store across nodes.")
        device = str(getattr(engine, "device", "cpu"))
        with safe_open(str(file), framework="pt", device=device) as f:
            found = (f.metadata() or {}).get(VERSION_KEY)
            if found != str(self.version):
                raise ValueError(f"weight_sync disk: {file} holds version {found}, expected {self.version}")
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


class DiskTransport(Transport):
    """``weight_sync.transport=disk``."""

    name = "disk"
    concurrent = False

    def __init__(self, cfg: WeightSyncConfig, **_: Any) -> None:
        self.owned = cfg.disk_dir is None
        self.root = (tempfile.mkdtemp(prefix="miles-weights-") if self.owned
                     else str(Path(cfg.disk_dir).expanduser().resolve()))

    def sender(self, version: int) -> DiskSender:
        return DiskSender(self.root)

    def receiver(self, engine_index: int, version: int, sent: Sent | None) -> DiskReceiver:
        assert sent is not None
        return DiskReceiver(sent.handle, version)

    def close(self) -> None:
        """Remove the version directories (and the directory itself when the transport made it)."""
        root = Path(self.root)
        if self.owned:
            shutil.rmtree(root, ignore_errors=True)
        elif root.is_dir():
            for d in root.iterdir():
                if _is_version_dir(d):
                    shutil.rmtree(d, ignore_errors=True)
