"""A Python execution tool: the model's code runs in a fresh, limited subprocess.

Each call starts ``python -I`` (isolated mode: no ``PYTHON*`` environment variables, no user
site-packages, no script directory on ``sys.path``) in a new session (its own process group), with:

- **a temporary working directory**, created for the call and removed after it, also ``HOME``;
- **a minimal environment**: ``PATH=/usr/bin:/bin``, ``HOME``, ``LANG`` and nothing else
  inherited (no tokens, no proxies);
- **CPU time** ``cpu_s`` (``RLIMIT_CPU``, soft and hard: the kernel kills the process);
- **memory** ``memory_mb`` of address space (``RLIMIT_AS``: allocations past it raise
  ``MemoryError``), written files at most ``max_file_mb`` (``RLIMIT_FSIZE``), at most 64 open files;
- **wall time** ``wall_s``: the whole process group is killed (SIGKILL) when it runs past it, and
  after every call, so background children that stay in its process group do not outlive the call
  (a child that calls ``setsid`` leaves the group and is not killed);
- **no network** (``network="deny"``, the default): the process enters a new user and network
  namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``) before running the code, so it has only a
  loopback interface that is down: no connection leaves it, not even to this machine's loopback.
  Where the kernel refuses new namespaces the call fails with an error observation and the code
  does not run. ``network="allow"`` skips this: the code then has this machine's network.

Not isolated: the file system (the code can read every file this user can read, and write
wherever this user can write, by absolute path), the process table (it sees other processes, and
the number of processes it starts is not limited beyond the memory and wall limits), and shared
resources such as ``/tmp`` and System V IPC. The limits are set by the child itself before the
code runs; hard limits cannot be raised back by an unprivileged process. Not a boundary against
an adversary: use a container or VM for untrusted code.

The observation is the code's stdout, then its stderr, truncated to ``max_output_chars``, followed
by ``[exit code N]`` when the code failed or ``[killed: ...]`` when a limit stopped it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

# Runs in the child before the model's code: namespaces first (a new user namespace starts with
# full capabilities inside it), then the limits, then the code read from stdin.
_BOOTSTRAP = r"""
import ctypes, resource, sys
cpu_s, mem, fsize, net = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if net == "deny":
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x40000000) != 0:
        sys.stderr.write("sandbox: cannot create a network namespace (errno %d); code not run" % ctypes.get_errno())
        sys.exit(97)
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
code = sys.stdin.read()
del ctypes, resource, cpu_s, mem, fsize, net
sys.argv = ["<sandbox>"]
exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__"})
"""


class PythonSandbox:
    """Tool ``python(code)``: run a Python program, return what it printed (see the module docstring)."""

    name = "python"
    description = "Run a Python 3 program and return its printed output. No network; files are temporary."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(
        self, *, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, max_file_mb: int = 16,
        max_output_chars: int = 2000, network: str = "deny", timeout_s: float | None = None,
    ) -> None:
        if network not in ("deny", "allow"):
            raise ValueError(f"network: expected 'deny' or 'allow', found {network!r}")
        for key, value in (("wall_s", wall_s), ("cpu_s", cpu_s), ("memory_mb", memory_mb)):
            if value <= 0:
                raise ValueError(f"{key}: must be > 0, found {value}")
        self.wall_s, self.cpu_s, self.memory_mb, self.max_file_mb = wall_s, cpu_s, memory_mb, max_file_mb
        self.max_output_chars, self.network = max_output_chars, network
        # The tool-call deadline leaves the sandbox time to kill and reap the process first.
        self.timeout_s = timeout_s if timeout_s is not None else wall_s + 5.0

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError(f'"code" must be a string, found {type(code).__name__}')
        return self.run(code)

    def run(self, code: str) -> str:
        """Run ``code`` under the limits; returns the observation text."""
        with tempfile.TemporaryDirectory(prefix="miles-sandbox-") as cwd:
            argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(self.cpu_s), str(self.memory_mb << 20),
                    str(self.max_file_mb << 20), self.network]
            env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"}
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            killed = ""
            try:
                out, err = proc.communicate(code.encode(), timeout=self.wall_s)
            except subprocess.TimeoutExpired:
                killed = f"wall time limit of {self.wall_s:g} s"
                _kill_group(proc.pid)
                out, err = proc.communicate()
            finally:
                _kill_group(proc.pid)
        rc = proc.returncode
        if not killed and rc in (-signal.SIGXCPU, -signal.SIGKILL):
            killed = f"CPU time limit of {self.cpu_s} s" if rc == -signal.SIGXCPU else "SIGKILL"
        text = (out + err).decode(errors="replace")
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + "\n[output truncated]"
        if killed:
            return f"{text}\n[killed: {killed}]".lstrip("\n")
        return text if rc == 0 else f"{text}\n[exit code {rc}]".lstrip("\n")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
