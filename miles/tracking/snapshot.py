"""What a run records about itself so that it can be understood and run again.

A snapshot is the exact command line, the Hydra overrides, the composed and the
resolved config, the code version (miles version, git commit, dirty flag and the
diff), every installed package with its version, the machine (CPU, memory,
GPUs) and the seed. Secrets never leave the process: values under keys that
contain ``token``, ``password``, ``secret`` or ``api_key`` are replaced by
``***`` in params, tags and every artifact, and so are ``key=value`` /
``--key value`` pairs of the command line and such assignments in the diff.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

REDACTED = "***"
# a key names a secret when one of its words is one of these, or its last word is "token"
# (``hf_token``, ``access_token``; not ``max_new_tokens`` or ``tokenizer_path``)
SECRET_WORDS = ("password", "passwd", "secret", "apikey", "credential", "credentials")
SECRET_PHRASES = ("api_key", "api-key", "secret_key", "private_key")
# ``name = value`` / ``name: value`` / ``"name": "value"`` in free text; redacted when the name is a secret's
_ASSIGN = re.compile(r"(?P<key>[A-Za-z_][\w.\-]*)(?P<sep>[\"']?\s*[=:]\s*)(?P<val>\"[^\"]*\"|'[^']*'|[^\s,;&}\]]+)")
# the small set of packages worth a tag each (all others are in env/packages.txt)
KEY_PACKAGES = ("torch", "transformers", "ray", "mlflow", "hydra-core", "omegaconf", "sglang", "megatron-core")


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How this job was started, as the driver knows it (everything optional)."""

    argv: tuple[str, ...] = ()
    """The command line (``sys.argv`` of the driver)."""
    composed_yaml: str | None = None
    """The composed config before interpolations were resolved."""
    parent_run_id: str | None = None
    """MLflow run id of the sweep this job belongs to (set by :mod:`miles.tracking.sweep`)."""
    sweep_job: int | None = None
    """The job's number within its sweep."""
    source_run_id: str | None = None
    """The run this one reproduces (``miles reproduce``)."""
    tags: Mapping[str, str] = field(default_factory=dict)
    """Extra MLflow tags."""


def is_secret_key(key: str) -> bool:
    """True when a config key (its last dotted part) names a secret: ``hf_token``, ``db.password``, ``api_key``."""
    leaf = str(key).rsplit(".", 1)[-1].lower().lstrip("-+~")
    words = [w for w in re.split(r"[^a-z0-9]+", leaf) if w]
    return (any(p in leaf for p in SECRET_PHRASES) or any(w in SECRET_WORDS for w in words)
            or (bool(words) and words[-1] == "token"))


def redact_tree(d: Any, *, strings: bool = False) -> Any:
    """A copy of nested dicts/lists with the values under secret-looking keys replaced by ``***``; with
    ``strings``, every string leaf also goes through :func:`redact_text` (``key=value`` overrides in lists)."""
    if isinstance(d, Mapping):
        return {k: (REDACTED if is_secret_key(k) and v is not None else redact_tree(v, strings=strings))
                for k, v in d.items()}
    if isinstance(d, list | tuple):
        return [redact_tree(v, strings=strings) for v in d]
    return redact_text(d) if strings and isinstance(d, str) else d


def redact_text(text: str) -> str:
    """``api_key=sk-1`` / ``token: abc`` / ``"password": "x"`` in free text -> the value replaced by ``***``."""
    def one(m: re.Match) -> str:
        if is_secret_key(m["key"]):
            return f"{m['key']}{m['sep']}{REDACTED}"
        return f"{m['key']}{m['sep']}{redact_text(m['val'])}"  # e.g. url=http://h?token=x

    return _ASSIGN.sub(one, text)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with secret values replaced: ``k.api_key=v``, ``--token=v`` and ``--token v``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif arg.startswith("-") and "=" not in arg and is_secret_key(arg.lstrip("-")):
            out.append(arg)
            hide_next = True
        elif "=" in arg:
            key, _ = arg.split("=", 1)
            out.append(f"{key}={REDACTED}" if is_secret_key(key.lstrip("-+~")) else redact_text(arg))
        else:
            out.append(arg)
    return out


def redact_yaml(text: str) -> str:
    """A YAML document with secret values replaced (key order kept; floats round-trip exactly)."""
    return yaml.safe_dump(redact_tree(yaml.safe_load(text)), sort_keys=False)


def redact_hydra_outputs(directory: str | Path) -> list[Path]:
    """Rewrite the YAML files Hydra saved for a job (``config.yaml``, ``hydra.yaml``, ``overrides.yaml``
    in ``directory``) with secret values replaced; returns the files rewritten."""
    done = []
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        path = Path(directory) / name
        if not path.is_file():
            continue
        text = path.read_text()
        clean = yaml.safe_dump(redact_tree(yaml.safe_load(text), strings=True), sort_keys=False)
        if clean != text:
            path.write_text(clean)
            done.append(path)
    return done


class RedactHydraOutputs(Callback):
    """Hydra callback: a job's saved ``.hydra/*.yaml`` copies of the config lose their secrets before it runs.

    Hydra writes them just before ``on_job_start``; MLflow gets its own redacted snapshot
    (:func:`redact_yaml`), and this keeps the local copies to the same rule.
    """

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        subdir = config.hydra.output_subdir
        if subdir is not None:
            redact_hydra_outputs(Path(config.hydra.runtime.output_dir) / subdir)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process, as a shell line (``python -m miles ...`` for the module form)."""
    argv = list(sys.argv if argv is None else argv)
    prog = argv[0] if argv else "miles"
    head = [Path(sys.executable).name, "-m", "miles"] if prog.endswith(("__main__.py", "-c")) else [prog]
    return shlex.join(head + redact_argv(argv[1:]))


def _git(*args: str, src: Path) -> str:
    return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True, timeout=20,
                          check=True).stdout


def git_info(with_diff: bool = False) -> dict[str, str]:
    """Commit and dirty flag of the checkout miles is imported from ("unknown" outside git).

    With ``with_diff``: also ``git_diff`` (``git diff HEAD``, secrets redacted) when dirty, and
    ``git_untracked`` (names of untracked files, not their content).
    """
    src = Path(__file__).resolve().parents[2]
    try:
        commit = _git("rev-parse", "HEAD", src=src).strip()
        status = _git("status", "--porcelain", "--untracked-files=no", src=src).strip()
        info = {"git_commit": commit, "git_dirty": str(status != "").lower()}
        if with_diff and status:
            info["git_diff"] = redact_text(_git("diff", "HEAD", src=src))
        if with_diff:
            info["git_untracked"] = _git("ls-files", "--others", "--exclude-standard", src=src)
        return info
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": "unknown"}


def package_versions() -> dict[str, str]:
    """Every installed distribution and its version (what ``pip freeze`` lists), by lower-case name."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(name.lower(), dist.version)
    return dict(sorted(out.items()))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
        return None


def _gpus() -> list[dict[str, str]]:
    """GPUs as ``nvidia-smi`` reports them (no CUDA context is created in the driver); [] without one."""
    query = "name,memory.total,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    keys = query.split(",")
    return [dict(zip(keys, (x.strip() for x in line.split(",")), strict=False)) for line in out.splitlines() if line]


def machine_info() -> dict[str, Any]:
    """Host, OS, Python, CPU model and count, memory, GPUs and the CUDA version torch was built with."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import torch

        torch_cuda = torch.version.cuda
    except ImportError:
        torch_cuda = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_count_usable": affinity,
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "torch_cuda": torch_cuda,
    }


def write_snapshot(
    dest: Path,
    *,
    resolved_yaml: str,
    overrides: Sequence[str],
    launch: Launch,
) -> dict[str, str]:
    """Write the snapshot's files under ``dest`` (``config/``, ``env/``); returns the tags that describe it.

    Files: ``config/resolved.yaml``, ``config/composed.yaml`` (when known), ``config/overrides.yaml``,
    ``env/command.txt``, ``env/packages.txt`` (``name==version`` lines), ``env/machine.json``,
    ``env/git.json`` and, when the checkout is dirty, ``env/git_diff.patch``. All redacted.
    """
    import miles

    (dest / "config").mkdir(parents=True, exist_ok=True)
    (dest / "env").mkdir(parents=True, exist_ok=True)
    safe_overrides = redact_argv(list(overrides))
    (dest / "config" / "resolved.yaml").write_text(redact_yaml(resolved_yaml))
    if launch.composed_yaml is not None:
        (dest / "config" / "composed.yaml").write_text(redact_yaml(launch.composed_yaml))
    (dest / "config" / "overrides.yaml").write_text(yaml.safe_dump(safe_overrides) if safe_overrides else "[]\n")
    cmd = command_line(launch.argv or None)
    (dest / "env" / "command.txt").write_text(cmd + "\n")
    packages = package_versions()
    (dest / "env" / "packages.txt").write_text("".join(f"{k}=={v}\n" for k, v in packages.items()))
    machine = machine_info()
    (dest / "env" / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    git = git_info(with_diff=True)
    diff = git.pop("git_diff", None)
    untracked = git.pop("git_untracked", "")
    (dest / "env" / "git.json").write_text(json.dumps({**git, "untracked": untracked.split()}, indent=2) + "\n")
    if diff:
        (dest / "env" / "git_diff.patch").write_text(diff)
    tags = {
        "miles.command": cmd,
        "miles.overrides": " ".join(safe_overrides),
        "miles.version": miles.__version__,
        **{f"miles.{k}": v for k, v in git.items()},
        "miles.hostname": machine["hostname"],
        "miles.cpu": f"{machine['cpu_count_usable']} x {machine['cpu_model']}",
        "miles.gpus": ", ".join(g.get("name", "?") for g in machine["gpus"]) or "none",
        **{f"miles.pkg.{p}": packages[p] for p in KEY_PACKAGES if p in packages},
    }
    if git["git_commit"] != "unknown":
        tags["mlflow.source.git.commit"] = git["git_commit"]
    return tags
