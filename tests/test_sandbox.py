"""The Python sandbox's escape battery: each test makes a real escape attempt and checks it fails.

Every attempt runs in ``PythonSandbox`` (bubblewrap) exactly as a tool call would; the code prints
what it got (an errno name, a listing) so a failure shows how far the attempt went.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import miles
from miles.agent.sandbox import PythonSandbox, SandboxUnavailable
from miles.agent.tools import ToolCall, run_call

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install -y bubblewrap)"
)

# Prints the outcome of each attempt as "label: ok" or "label: ErrorName".
_TRY = """
def attempt(label, fn):
    try:
        result = fn()
        print(label + ': ok', repr(result)[:200])
    except BaseException as e:
        print(label + ': ' + type(e).__name__)
"""


def run(code: str, **limits) -> str:
    return PythonSandbox(**{"wall_s": 20, **limits})({"code": _TRY + code})


def outcomes(text: str) -> dict[str, str]:
    return {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in text.splitlines() if ": " in line}


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


# --- the file system ------------------------------------------------------------------------


def test_host_files_are_not_visible(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    repo = Path(miles.__file__).resolve().parent
    paths = {
        "shadow": "/etc/shadow",
        "passwd": "/etc/passwd",
        "secret": str(secret),
        "repo": str(repo / "__init__.py"),
        "root": "/root",
        "home": "/home",
        "ray": "/tmp/ray",
        "shm": "/dev/shm/.",
        "sys": "/sys/kernel",
    }
    code = "import os\n" + "".join(
        f"attempt({k!r}, lambda: os.listdir({v!r}) if os.path.isdir({v!r}) else open({v!r}).read())\n"
        for k, v in paths.items()
    )
    code += "attempt('root_listing', lambda: sorted(os.listdir('/')))\n"
    got = outcomes(run(code))
    for key in paths:
        if key == "shm":
            assert got[key] == "ok []", got  # an empty directory of the sandbox's own /dev
        else:
            assert got[key] == "FileNotFoundError", (key, got)
    listing = set(eval(got["root_listing"][3:]))
    assert listing <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "tmp",
        "usr",
        "work",
    }


def test_writes_outside_the_work_directory_fail(tmp_path: Path) -> None:
    package = Path(miles.__file__).resolve().parent
    targets = {
        "usr": "/usr/lib/pwn.py",
        "etc": "/etc/pwn",
        "root": "/pwn",
        "dev": "/dev/pwn",
        "shm": "/dev/shm/pwn",
        "proc": "/proc/sys/kernel/hostname",
        "package": str(package / "pwn.py"),
        "host_tmp": str(tmp_path / "pwn"),
    }
    code = "".join(f"attempt({k!r}, lambda: open({v!r}, 'w').write('x'))\n" for k, v in targets.items())
    code += "attempt('work', lambda: open('/work/f', 'w').write('x'))\nattempt('tmp', lambda: open('/tmp/g', 'w').write('y'))\n"
    got = outcomes(run(code))
    assert got.pop("work") == "ok 1" and got.pop("tmp") == "ok 1"
    for key, why in got.items():
        assert why in ("OSError", "PermissionError", "FileNotFoundError"), (key, why)
    assert not (package / "pwn.py").exists() and not (tmp_path / "pwn").exists()


def test_the_work_directory_is_fresh_for_each_call() -> None:
    box = PythonSandbox(wall_s=20)
    first = box({"code": "import os\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')"})
    second = box({"code": "import os\nprint(os.getcwd(), os.listdir('.'))"})
    assert first.strip() == "[]" and second.strip() == "/work []"


def test_symlink_tricks_stay_inside(tmp_path: Path) -> None:
    (tmp_path / "target.txt").write_text("host file")
    code = f"""import os
os.symlink({str(tmp_path / "target.txt")!r}, 'link')
attempt('host_link', lambda: open('link').read())
attempt('proc1_root', lambda: sorted(os.listdir('/proc/1/root')) == sorted(os.listdir('/')))
attempt('proc1_root_home', lambda: os.listdir('/proc/1/root/root'))
attempt('self_root_up', lambda: os.listdir('/proc/self/root/../../root'))
attempt('cwd_up', lambda: os.listdir('/proc/self/cwd/../../../../root'))
"""
    got = outcomes(run(code))
    assert got["host_link"] == "FileNotFoundError" and got["proc1_root"] == "ok True", got
    assert got["proc1_root_home"] == got["self_root_up"] == got["cwd_up"] == "FileNotFoundError", got


def test_devices_are_the_minimal_set() -> None:
    code = """import os
attempt('listing', lambda: sorted(os.listdir('/dev')))
for name in ('sda', 'vda', 'mem', 'kmsg', 'kvm', 'fuse', 'nvidia0'):
    attempt(name, lambda: open('/dev/' + name, 'rb').read(1))
attempt('mknod', lambda: os.mknod('/work/mem', 0o600 | 0o020000, os.makedev(1, 1)))
attempt('null', lambda: open('/dev/null', 'w').write('x'))
"""
    got = outcomes(run(code))
    assert set(eval(got.pop("listing")[3:])) <= {
        "console",
        "core",
        "fd",
        "full",
        "null",
        "ptmx",
        "pts",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "tty",
        "urandom",
        "zero",
    }
    assert got.pop("null") == "ok 1" and got.pop("mknod") == "PermissionError", got
    assert set(got.values()) == {"FileNotFoundError"}, got


# --- processes, privileges, the kernel ------------------------------------------------------


def test_host_processes_are_not_visible() -> None:
    me = os.getpid()
    code = f"""import os, signal
attempt('pids', lambda: sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
attempt('kill_test', lambda: os.kill({me}, signal.SIGTERM))
attempt('kill_parent', lambda: os.kill(os.getppid(), 0) if os.getppid() != 1 else 'parent is pid 1')
attempt('cmdline', lambda: open('/proc/{me}/cmdline').read())
attempt('uid', lambda: (os.getuid(), os.getgid(), os.getgroups()))
"""
    got = outcomes(run(code))
    assert got["kill_test"] == "ProcessLookupError" and got["cmdline"] == "FileNotFoundError", got
    assert max(eval(got["pids"][3:])) < 100, got  # its own namespace: bwrap's init and the code
    assert got["uid"] == "ok (65534, 65534, [])", got


def test_privileged_operations_fail() -> None:
    me = os.getpid()
    code = f"""import ctypes, os, resource
libc = ctypes.CDLL(None, use_errno=True)
def check(rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt('caps', lambda: [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])
attempt('ptrace_test', lambda: check(libc.ptrace(16, {me}, None, None)))
attempt('mount', lambda: check(libc.mount(b'none', b'/work', b'tmpfs', 0, None)))
attempt('remount_usr', lambda: check(libc.mount(b'none', b'/usr', None, 32 | 4096, None)))
attempt('unshare_user', lambda: check(libc.unshare(0x10000000)))
attempt('unshare_mount', lambda: check(libc.unshare(0x00020000)))
attempt('chroot', lambda: os.chroot('/work'))
attempt('setuid', lambda: os.setuid(0))
attempt('hostname', lambda: check(libc.sethostname(b'pwned', 5)))
for name in ('RLIMIT_NPROC', 'RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE'):
    kind = getattr(resource, name)
    attempt(name, lambda: resource.setrlimit(kind, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)))
"""
    got = outcomes(run(code))
    assert got.pop("caps") == "ok '0000000000000000'", got
    assert got.pop("ptrace_test") == "PermissionError", got  # the seccomp filter refuses ptrace itself
    assert got.pop("setuid") in ("PermissionError", "OSError"), got  # EINVAL: uid 0 is not even mapped
    assert all(why == "ValueError" for k, why in got.items() if k.startswith("RLIMIT")), got
    assert all(
        why in ("PermissionError", "OSError") for k, why in got.items() if not k.startswith("RLIMIT")
    ), got


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the system call numbers below are x86-64's")
def test_the_seccomp_filter_refuses_kernel_interfaces() -> None:
    """System calls an unprivileged process may make fail with EPERM inside: the filter answers them before
    the kernel looks at their arguments. Without the filter (the same sandbox, an empty deny list) ptrace,
    keyctl, add_key, personality, io_uring_setup and unshare(0) succeed, process_vm_readv, perf_event_open
    and bpf fail on their arguments (EINVAL, EFAULT), and userfaultfd fails with EPERM by the kernel's
    vm.unprivileged_userfaultfd."""
    code = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)
iov = (ctypes.c_void_p * 2)(ctypes.cast(params, ctypes.c_void_p), 8)
calls = {'ptrace_traceme': (101, 0, 0, 0, 0), 'keyctl_session_keyring': (250, 0, -3, 0, 0),
         'add_key': (248, b'user', b'miles', b'x', 1, -3), 'personality_query': (135, 0xffffffff),
         'io_uring_setup': (425, 1, params), 'userfaultfd': (323, 0),
         'process_vm_readv_self': (310, os.getpid(), iov, 1, iov, 1, 0), 'unshare_nothing': (272, 0),
         'perf_event_open_bad': (298, 0, 0, -1, -1, 0), 'bpf_bad': (321, 999, 0, 0)}
for label, (nr, *args) in calls.items():
    rc = libc.syscall(nr, *args)
    print(label + ': ' + ('ok' if rc >= 0 else os.strerror(ctypes.get_errno())))
"""
    got = outcomes(run(code))
    assert len(got) == 10 and all(why == os.strerror(1) for why in got.values()), got


def test_without_libseccomps_bindings_the_code_does_not_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from miles.agent import sandbox

    monkeypatch.setattr(sandbox, "_COMPILE_FILTER", "import miles_no_such_seccomp_module")
    sandbox.seccomp_program.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="cannot build the seccomp filter.*python3-seccomp"):
            PythonSandbox()({"code": f"open({str(tmp_path / 'ran')!r}, 'w').write('x')"})
    finally:
        sandbox.seccomp_program.cache_clear()
    assert not (tmp_path / "ran").exists()


def test_env_leakage(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("MILES_TEST_SECRET", secret)
    monkeypatch.setenv("MILES_ROLLOUT_TOKEN", secret)
    out = run(
        "import os\nprint(sorted(os.environ))\nattempt('init_env', lambda: open('/proc/1/environ').read())\n"
        "print(open('/proc/self/environ').read())"
    )
    assert secret not in out and "['HOME', 'LANG', 'PATH', 'PWD']" in out, out


# --- the network ----------------------------------------------------------------------------


def test_network_is_unreachable(tmp_path: Path) -> None:
    abstract = f"miles-test-{uuid.uuid4().hex}"
    with (
        socket.create_server(("127.0.0.1", 0)) as tcp,
        socket.socket(socket.AF_UNIX) as named,
        socket.socket(socket.AF_UNIX) as hidden,
    ):
        port = tcp.getsockname()[1]
        named.bind(str(tmp_path / "s.sock"))
        named.listen()
        hidden.bind("\0" + abstract)
        hidden.listen()
        code = f"""import socket
attempt('loopback', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2))
attempt('external', lambda: socket.create_connection(('1.1.1.1', 53), timeout=2))
attempt('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53)))
attempt('dns', lambda: socket.getaddrinfo('example.com', 80))
attempt('unix_path', lambda: socket.socket(socket.AF_UNIX).connect({str(tmp_path / "s.sock")!r}))
attempt('unix_abstract', lambda: socket.socket(socket.AF_UNIX).connect('\\0{abstract}'))
"""
        got = outcomes(run(code))
        tcp.settimeout(0.2)
        with pytest.raises(TimeoutError):
            tcp.accept()  # nothing reached the listener
    assert got["loopback"] in ("ConnectionRefusedError", "OSError") and got["external"] == "OSError", got
    assert got["udp"] == "OSError" and got["dns"] == "gaierror", got
    assert got["unix_path"] == "FileNotFoundError" and got["unix_abstract"] == "ConnectionRefusedError", got


# --- resources ------------------------------------------------------------------------------


def test_fork_bomb_stops_at_the_process_limit_and_nothing_survives() -> None:
    marker = f"miles-escape-{uuid.uuid4().hex}"
    code = f"""import os
started = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            os.execv('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(300)', '{marker}'])
        started += 1
except OSError as e:
    print('fork failed:', type(e).__name__)
print('started:', started)
"""
    got = outcomes(run(code, max_processes=16))
    assert got["fork failed"] == "BlockingIOError" and int(got["started"]) < 16, got
    assert _host_processes_with(marker) == []  # the whole PID namespace died with the call


def test_daemon_children_do_not_outlive_the_call() -> None:
    marker = f"miles-escape-{uuid.uuid4().hex}"
    code = f"""import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv('/usr/bin/sh', ['sh', '-c', 'sleep 300; : {marker}'])
    os._exit(0)
os.wait()
print('daemon: started')
"""
    assert outcomes(run(code)) == {"daemon": "started"}
    assert _host_processes_with(marker) == []


def test_memory_and_disk_bombs_fail_inside() -> None:
    code = """import os
attempt('memory', lambda: bytearray(4 << 30))
chunks = []
def grow():
    while True:
        chunks.append(bytearray(16 << 20))
attempt('memory_loop', grow)
chunks.clear()
attempt('big_file', lambda: open('big', 'wb').write(b'x' * (40 << 20)))
def fill():
    i = 0
    while True:
        with open(f'f{i}', 'wb') as f:
            f.write(b'x' * (8 << 20))
        i += 1
attempt('disk_fill', fill)
print('written_mb:', sum(os.path.getsize(f) for f in os.listdir('.')) >> 20)
"""
    got = outcomes(run(code, memory_mb=256, max_file_mb=16, disk_mb=32))
    assert got["memory"] == got["memory_loop"] == "MemoryError", got
    assert got["big_file"] == "OSError" and got["disk_fill"] == "OSError", got  # EFBIG, then ENOSPC
    assert int(got["written_mb"]) <= 32, got


def test_cpu_loop_and_infinite_output_are_stopped() -> None:
    assert run("while True: pass", cpu_s=1).endswith("[killed: CPU time limit of 1 s]")
    out = run("while True: print('x' * 999)", max_output_bytes=1 << 16)
    assert out.endswith("[output truncated]\n[killed: output limit of 65536 bytes]") and len(out) < 2100
    out = run("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)", wall_s=1)
    assert out == "[killed: wall time limit of 1 s]"


def test_concurrent_calls_have_their_own_process_limits() -> None:
    code = "import os, time\nfor _ in range(10):\n    if os.fork() == 0:\n        time.sleep(1)\n        os._exit(0)\nprint('ok')"
    box = PythonSandbox(wall_s=20, max_processes=16)
    with ThreadPoolExecutor(4) as pool:
        assert [o.strip() for o in pool.map(lambda _: box({"code": code}), range(4))] == ["ok"] * 4


# --- no isolation, no run -------------------------------------------------------------------


def test_missing_bwrap_refuses_to_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    code = f"open({str(tmp_path / 'ran')!r}, 'w').write('x')"
    outcome = asyncio.run(
        run_call({"python": PythonSandbox()}, ToolCall(name="python", arguments={"code": code}))
    )
    assert (
        outcome.error == "raised" and "bwrap not found" in outcome.text and "apt-get install" in outcome.text
    )
    assert not (tmp_path / "ran").exists()


class _RefusedMount(PythonSandbox):
    def command(self, ready_fd: int, info_fd: int, seccomp_fd: int) -> list[str]:
        argv = super().command(ready_fd, info_fd, seccomp_fd)
        return [argv[0], "--ro-bind", "/nonexistent-miles-path", "/x", *argv[1:]]


def test_a_sandbox_that_fails_to_start_does_not_run_the_code(tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable, match="did not start.*nonexistent-miles-path"):
        _RefusedMount(wall_s=20)({"code": "print('ran')"})
