"""A Python execution tool: the model's code runs inside a bubblewrap (``bwrap``) sandbox.

Each call starts ``bwrap`` (the Debian package ``bubblewrap``), which runs the system interpreter
``/usr/bin/python3 -I -u`` in new namespaces of every kind bubblewrap supports:

- **mount**: the root is a fresh, empty file system holding only ``/usr`` (read-only), the
  ``/bin``, ``/lib*`` links or directories that point into it, ``/etc/ld.so.cache`` (read-only),
  a new ``/proc`` for the sandbox's own processes, a minimal ``/dev`` (``null``, ``zero``,
  ``full``, ``random``, ``urandom``, ``tty``; read-only, so ``/dev/shm`` takes no writes) and
  ``/work``, a private tmpfs of ``disk_mb`` that is the working directory, ``HOME`` and ``/tmp``,
  created empty for the call and gone with it. Nothing of ``/home``, ``/root``, the project, caches,
  ``/dev/shm``, ``/sys`` or the rest of ``/etc`` is visible;
- **user**: the code runs as uid/gid 65534 with no capabilities, and cannot create further user
  namespaces (``--disable-userns``), so ``mount``, ``chroot`` and raising a hard limit fail (the
  seccomp filter below refuses ``ptrace`` altogether). When miles runs as root, ``bwrap`` itself is started as uid 65534
  too, so the process-count limit applies (Linux does not apply ``RLIMIT_NPROC`` to root);
- **pid**: the code sees only its own processes; when the program ends, or at the wall limit,
  the namespace's first process dies and the kernel kills every process left in it, including
  children that called ``setsid`` or daemonized;
- **network** (``network="deny"``, the default): only a loopback interface of its own, so no TCP
  or UDP connection leaves the sandbox, not even to this machine's loopback, and no path-name UNIX
  socket outside is reachable (their files are not mounted). ``network="allow"`` shares this
  machine's network namespace (the file system stays isolated);
- **IPC, UTS, cgroup**: System V IPC and POSIX message queues of its own, hostname ``sandbox``.

A **seccomp filter** (``bwrap --seccomp``), compiled once per process with libseccomp's own Python
bindings (the Debian package ``python3-seccomp``, run by the system interpreter), makes the system calls
in :data:`DENIED_SYSCALLS` fail with ``EPERM``: kernel interfaces a Python program has no use for and that
kernel exploits reach for (``ptrace``, ``process_vm_*``, ``bpf``, ``perf_event_open``, ``userfaultfd``,
``io_uring_*``, the key ring, ``unshare``/``setns``, mounts, module loading, ``kexec``, clocks and
more).

The environment is empty apart from ``PATH``, ``HOME`` and ``LANG``; ``bwrap --new-session`` puts
the code in a new session (no terminal injection), and ``--die-with-parent`` kills the sandbox if
the calling process dies. Inside, before the code runs, hard resource limits are set: **CPU time**
``cpu_s`` (``RLIMIT_CPU``), **address space** ``memory_mb`` (``RLIMIT_AS``: allocations past it raise
``MemoryError``), **file size** ``max_file_mb`` (``RLIMIT_FSIZE``), **open files** 64
(``RLIMIT_NOFILE``) and **processes** ``max_processes`` (``RLIMIT_NPROC``, counted in the
sandbox's own user namespace).

Output (stdout and stderr, one stream, unbuffered) is read as it comes; past ``max_output_bytes``
the sandbox is killed and the observation says so, so the caller never holds more than that.

If ``bwrap`` or ``/usr/bin/python3`` is missing, or the kernel refuses the namespaces, the call
raises :class:`SandboxUnavailable` (the tool loop turns it into an error observation): the code
never runs unisolated; so does a missing ``python3-seccomp``. The isolation is the kernel's namespaces,
limits and the filter above: a kernel vulnerability reachable through the system calls left allowed
would still cross it. ``tests/test_sandbox.py`` is the escape battery.

The observation is the program's output, truncated to ``max_output_chars``, followed by
``[exit code N]`` when the code failed or ``[killed: ...]`` when a limit stopped it.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from typing import Any

PYTHON = "/usr/bin/python3"
INSTALL_HINT = "install bubblewrap and libseccomp's bindings (Debian/Ubuntu: apt-get install -y bubblewrap python3 " \
               "python3-seccomp)"
_NOBODY = 65534

DENIED_SYSCALLS = (
    # other processes' memory and execution
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel attack surface a Python program does not need
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "add_key", "request_key", "keyctl", "lookup_dcookie", "fanotify_init", "open_by_handle_at",
    "name_to_handle_at", "mbind", "set_mempolicy", "migrate_pages", "move_pages", "vm86", "vm86old",
    "uselib", "ustat", "sysfs", "_sysctl", "personality", "syslog",
    # namespaces, mounts and the file-system root
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # the machine itself: modules, reboot, swap, clocks, accounting, I/O ports, quotas
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "settimeofday", "stime",
    "clock_settime", "clock_adjtime", "adjtimex", "acct", "iopl", "ioperm", "quotactl", "nfsservctl",
)
"""System calls the sandbox's seccomp filter answers with ``EPERM`` (those unknown on this
architecture are left out)."""

# Run by the system interpreter (libseccomp's bindings are a Debian package): the filter, as the
# compiled BPF program bwrap's --seccomp reads, to stdout.
_COMPILE_FILTER = r"""
import errno, sys, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
arch = seccomp.Arch()
for name in sys.argv[1:]:
    if seccomp.resolve_syscall(arch, name) >= 0:
        f.add_rule(seccomp.ERRNO(errno.EPERM), name)
f.export_bpf(sys.stdout.buffer)
"""


@functools.cache
def seccomp_program() -> bytes:
    """The compiled seccomp filter (see the module docstring); raises :class:`SandboxUnavailable` when it
    cannot be built."""
    try:
        done = subprocess.run([PYTHON, "-I", "-c", _COMPILE_FILTER, *DENIED_SYSCALLS], capture_output=True,
                              timeout=60, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"python tool: cannot build the seccomp filter ({e}); the code was not run "
                                 f"({INSTALL_HINT})") from e
    if done.returncode != 0 or not done.stdout:
        raise SandboxUnavailable(f"python tool: cannot build the seccomp filter: "
                                 f"{done.stderr.decode(errors='replace').strip()[-500:]!r}; the code was not run "
                                 f"({INSTALL_HINT})")
    return done.stdout

# Runs inside the sandbox before the model's code: the limits (hard = soft, so they cannot be
# raised; the CPU limit's hard limit is 1 s later, so SIGXCPU ends the code and SIGKILL follows if it
# is ignored), then a byte on the ready pipe (the caller then knows the sandbox started), then the code.
_BOOTSTRAP = r"""
import os, resource, sys
cpu, mem, fsize, nproc, ready = (int(a) for a in sys.argv[1:6])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
for kind, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(kind, (value, value))
code = sys.stdin.read()
os.write(ready, b"R")
os.close(ready)
del os, resource, cpu, mem, fsize, nproc, ready, kind, value
sys.argv = ["<sandbox>"]
exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class SandboxUnavailable(RuntimeError):
    """The isolation layer is missing or the kernel refused it; the code was not run."""


class PythonSandbox:
    """Tool ``python(code)``: run a Python program, return what it printed (see the module docstring)."""

    name = "python"
    description = "Run a Python 3 program and return its printed output. No network; files are temporary."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(
        self,
        *,
        wall_s: float = 10.0,
        cpu_s: int = 5,
        memory_mb: int = 512,
        max_file_mb: int = 16,
        disk_mb: int = 64,
        max_processes: int = 32,
        max_output_chars: int = 2000,
        max_output_bytes: int = 1 << 16,
        network: str = "deny",
        timeout_s: float | None = None,
    ) -> None:
        if network not in ("deny", "allow"):
            raise ValueError(f"network: expected 'deny' or 'allow', found {network!r}")
        for key, value in (
            ("wall_s", wall_s),
            ("cpu_s", cpu_s),
            ("memory_mb", memory_mb),
            ("disk_mb", disk_mb),
            ("max_file_mb", max_file_mb),
            ("max_processes", max_processes),
            ("max_output_chars", max_output_chars),
            ("max_output_bytes", max_output_bytes),
        ):
            if value <= 0:
                raise ValueError(f"{key}: must be > 0, found {value}")
        self.wall_s, self.cpu_s, self.memory_mb, self.max_file_mb = wall_s, cpu_s, memory_mb, max_file_mb
        self.disk_mb, self.max_processes, self.network = disk_mb, max_processes, network
        self.max_output_chars, self.max_output_bytes = max_output_chars, max_output_bytes
        # The tool-call deadline leaves the sandbox time to kill and reap the process first.
        self.timeout_s = timeout_s if timeout_s is not None else wall_s + 5.0

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError(f'"code" must be a string, found {type(code).__name__}')
        return self.run(code)

    def command(self, ready_fd: int, info_fd: int, seccomp_fd: int) -> list[str]:
        """The ``bwrap`` command line (raises :class:`SandboxUnavailable` if it cannot be built)."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(
                f"python tool: bwrap not found on PATH; the code was not run ({INSTALL_HINT})"
            )
        if not os.access(PYTHON, os.X_OK):
            raise SandboxUnavailable(
                f"python tool: {PYTHON} not found; the code was not run ({INSTALL_HINT})"
            )
        argv = [
            bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--uid",
            str(_NOBODY),
            "--gid",
            str(_NOBODY),
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        if self.network == "allow":
            argv.append("--share-net")
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += [
            "--ro-bind-try",
            "/etc/ld.so.cache",
            "/etc/ld.so.cache",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--remount-ro",
            "/dev",
            "--size",
            str(self.disk_mb << 20),
            "--tmpfs",
            "/work",
            "--symlink",
            "/work",
            "/tmp",
            "--remount-ro",
            "/",
            "--chdir",
            "/work",
            "--clearenv",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--info-fd",
            str(info_fd),
            "--seccomp",
            str(seccomp_fd),
            PYTHON,
            "-I",
            "-u",
            "-c",
            _BOOTSTRAP,
            str(self.cpu_s),
            str(self.memory_mb << 20),
            str(self.max_file_mb << 20),
            str(self.max_processes),
            str(ready_fd),
        ]
        return argv

    def run(self, code: str) -> str:
        """Run ``code`` in the sandbox; returns the observation text."""
        program = seccomp_program()
        ready_r, ready_w = os.pipe()
        info_r, info_w = os.pipe()
        rules = os.memfd_create("miles-sandbox-seccomp")
        try:
            os.write(rules, program)
            os.lseek(rules, 0, os.SEEK_SET)
            argv = self.command(ready_w, info_w, rules)
            # As root, bwrap runs as nobody: RLIMIT_NPROC then holds, and nothing is owned by root.
            user = {"user": _NOBODY, "group": _NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env={"PATH": "/usr/bin:/bin"},
                    cwd="/",
                    pass_fds=(ready_w, info_w, rules),
                    start_new_session=True,
                    **user,
                )
            except OSError as e:
                raise SandboxUnavailable(
                    f"python tool: cannot start bwrap ({e}); the code was not run"
                ) from e
        finally:
            os.close(ready_w)
            os.close(info_w)
            os.close(rules)
        try:
            return self._supervise(proc, code, ready_r, info_r)
        finally:
            if proc.returncode is None:  # not reaped yet, so its pid and group are still its own
                _kill_sandbox(proc.pid, 0)
                proc.wait()
            os.close(ready_r)
            os.close(info_r)

    def _supervise(self, proc: subprocess.Popen, code: str, ready_r: int, info_r: int) -> str:
        deadline = time.monotonic() + self.wall_s
        out, info, ready, killed, child = bytearray(), bytearray(), False, "", 0
        sel = selectors.DefaultSelector()
        assert proc.stdin is not None and proc.stdout is not None
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(info_r, selectors.EVENT_READ, "info")
        sel.register(ready_r, selectors.EVENT_READ, "ready")
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
        pending = memoryview(code.encode())
        open_streams = 4
        while open_streams and not killed:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = f"wall time limit of {self.wall_s:g} s"
                break
            for key, _ in sel.select(timeout=left):
                if key.data == "in":
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending[: 1 << 16]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                        open_streams -= 1
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                elif key.data == "out":
                    out += chunk
                    if len(out) > self.max_output_bytes:
                        killed = f"output limit of {self.max_output_bytes} bytes"
                        break
                elif key.data == "info":
                    info += chunk
                    child = child or _child_pid(info)
                else:
                    ready = True
        sel.close()
        if not proc.stdin.closed:
            proc.stdin.close()
        if killed:
            _kill_sandbox(proc.pid, child or _child_pid(info))
        try:
            status = _status(proc.wait(max(deadline - time.monotonic(), 0.0) if not killed else 5.0))
        except subprocess.TimeoutExpired:  # the output closed but the sandbox lingers past the deadline
            killed = killed or f"wall time limit of {self.wall_s:g} s"
            _kill_sandbox(proc.pid, child or _child_pid(info))
            status = _status(proc.wait())
        text = out.decode(errors="replace")
        if not ready and not killed:
            raise SandboxUnavailable(
                f"python tool: the sandbox did not start (bwrap exit status {status}); the "
                f"code was not run. bwrap said: {text.strip()[:500]!r} ({INSTALL_HINT}; the "
                "kernel must allow unprivileged user namespaces)"
            )
        if not killed and status == 128 + signal.SIGXCPU:
            killed = f"CPU time limit of {self.cpu_s} s"
        elif not killed and status is not None and status > 128:
            killed = f"signal {status - 128}"
        if len(text) > self.max_output_chars or len(out) > self.max_output_bytes:
            text = text[: self.max_output_chars] + "\n[output truncated]"
        if killed:
            return f"{text}\n[killed: {killed}]".lstrip("\n")
        return text if status == 0 else f"{text}\n[exit code {status}]".lstrip("\n")


def _child_pid(info: bytes | bytearray) -> int:
    """The sandbox's first process (pid 1 of its namespace), from bwrap's ``--info-fd`` JSON."""
    try:
        return int(json.loads(bytes(info))["child-pid"])
    except (ValueError, KeyError, TypeError):
        return 0


def _status(returncode: int) -> int:
    """bwrap's exit status, with a signal that killed bwrap itself written as 128 + its number."""
    return returncode if returncode >= 0 else 128 - returncode


def _kill_sandbox(bwrap_pid: int, child_pid: int) -> None:
    """SIGKILL the sandbox's first process (the kernel then kills its whole PID namespace) and bwrap.

    Called only while bwrap is not yet reaped, so ``bwrap_pid`` is still bwrap's; the child is
    killed only while bwrap is still its parent (its pid cannot have been reused).
    """
    if child_pid > 0:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == bwrap_pid:
                os.kill(child_pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
    try:
        os.killpg(bwrap_pid, signal.SIGKILL)  # bwrap started a new session: its group is its pid
    except (ProcessLookupError, PermissionError):
        pass
