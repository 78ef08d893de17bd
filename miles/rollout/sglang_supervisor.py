"""Runs ``sglang.launch_server`` so that no process of it outlives the process that started it.

Run by the SGLang venv's interpreter as a script (it imports nothing from miles):
``python sglang_supervisor.py PARENT_PID [launch_server flags...]``. Linux only.

This process leads the server's process group. It asks for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``) and forks SGLang's launcher, which then starts its scheduler and
detokenizer in the same group. On that SIGTERM it SIGKILLs the whole group, itself included;
when the launcher exits it SIGKILLs whatever the launcher left in the group and exits with the
launcher's code. SGLang's own children die with the launcher only once they have set their own
death signal, so a launcher killed while they start would otherwise leave them running.
"""

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1

# Python put this file's directory (miles/rollout) first on sys.path; its modules must not shadow
# the names SGLang imports.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def kill_group(include_self: bool) -> None:
    if include_self:
        os.killpg(0, signal.SIGKILL)
    me, group = os.getpid(), os.getpgid(0)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                if os.getpgid(int(entry)) == group:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def main() -> int:
    parent = int(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: kill_group(include_self=True))
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the death signal was set
        kill_group(include_self=True)
    launcher = os.fork()
    if launcher == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        sys.argv = ["sglang.launch_server", *sys.argv[2:]]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        return 0
    _, status = os.waitpid(launcher, 0)
    code = os.waitstatus_to_exitcode(status)
    print(f"miles supervisor: sglang.launch_server exited with code {code}", file=sys.stderr, flush=True)
    kill_group(include_self=False)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
