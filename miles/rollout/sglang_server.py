"""One SGLang server process: found, launched, watched, spoken to over HTTP, killed.

The server runs from SGLang's own virtual environment (``scripts/setup_sglang.sh``), never from
miles' (sglang pins its own torch and transformers). :func:`find_python` says which interpreter:
the ``python`` argument, else ``$MILES_SGLANG_PYTHON``, else ``<repo>/.venv-sglang/bin/python``.

:class:`SGLangServer` starts ``python -m sglang.launch_server`` bound to 127.0.0.1 on a free port, in
a process group of its own, and waits for ``/health`` with a deadline; a server that exits or does
not come up raises :class:`ServerStartError` with the tail of its log. No process of the server
outlives the process that started it: :mod:`miles.rollout.sglang_supervisor` leads the server's
process group, gets a signal when its parent dies (``PR_SET_PDEATHSIG``) and then kills the whole
group, SGLang's scheduler and detokenizer included, even while they are still starting. The
supervisor is started from a thread that lives exactly as long as the server (the death signal
follows the thread that forked, not the process), which also notices the moment it exits.
:meth:`SGLangServer.kill` kills the whole process group.

On CPU (``device="cpu"``) the server gets ``SGLANG_USE_CPU_ENGINE=1`` and the stand-in
``libcuda.so.1`` that the setup script builds (``<venv>/lib/miles-libcuda``) on
``LD_LIBRARY_PATH``: SGLang's CUDA ``sgl_kernel`` wheel does not load without one. Its processes also
import miles' CPU compatibility layer (:mod:`miles.rollout.sglang_cpu.sitecustomize`: ``pin_memory``
is a no-op without CUDA, which SGLang's LoRA code needs) from ``PYTHONPATH``. Its ``/health``
is made a plain liveness answer (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``); by default it
runs a one-token generation, which waits while generation is paused.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from miles.machine import free_port

PORT_RANGE = (10000, 22000)
"""Where the server's HTTP port is picked: below the kernel's ephemeral range (32768+ here), where no
outgoing connection or ``bind(0)`` takes it during the server's minute of start-up, and below the
range SGLang picks its own internal ports from (22000-29999)."""
PYTHON_ENV = "MILES_SGLANG_PYTHON"
"""Environment variable naming the SGLang venv's interpreter (when ``rollout.engine.python`` is unset)."""
STUB_DIR = "lib/miles-libcuda"
"""Where, inside the SGLang venv, the setup script puts the stand-in ``libcuda.so.1``."""
CPU_COMPAT_DIR = Path(__file__).with_name("sglang_cpu")
"""Holds only ``sitecustomize.py``: put on a CPU server's ``PYTHONPATH`` (see the module docstring)."""

SUPERVISOR = Path(__file__).with_name("sglang_supervisor.py")
"""Started by the SGLang interpreter in front of ``sglang.launch_server``: see :mod:`miles.rollout.sglang_supervisor`."""


class ServerStartError(RuntimeError):
    """The SGLang server did not come up; the message carries the tail of its log, ``server`` the
    :class:`SGLangServer` that failed (None when the process did not start)."""

    server: SGLangServer | None = None


class ServerHTTPError(RuntimeError):
    """The server answered an HTTP call with an error status; ``status`` and the body are kept."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status, self.body = status, body


def repo_root() -> Path:
    """The directory above the ``miles`` package (the clone's root in a development install)."""
    return Path(__file__).resolve().parents[2]


def find_python(python: str | None = None) -> Path:
    """The SGLang venv's interpreter: ``python``, else ``$MILES_SGLANG_PYTHON``, else ``<repo>/.venv-sglang``."""
    candidates = [(python, "rollout.engine.python")] if python else []
    if os.environ.get(PYTHON_ENV):
        candidates.append((os.environ[PYTHON_ENV], f"${PYTHON_ENV}"))
    candidates.append((str(repo_root() / ".venv-sglang" / "bin" / "python"), "the default location"))
    path, source = candidates[0]
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(
            f"no SGLang interpreter at {path} ({source}). Run scripts/setup_sglang.sh in the miles clone "
            f"(it creates {repo_root() / '.venv-sglang'}), or point rollout.engine.python or ${PYTHON_ENV} "
            "at the python of a venv with sglang 0.5.23 installed.")
    return Path(path)


def server_env(python: Path, device: str, num_threads: int) -> dict[str, str]:
    """The environment the server runs in: this process's, minus its Python paths, plus SGLang's switches."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
    if num_threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(num_threads)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        stub = python.parent.parent / STUB_DIR
        if not (stub / "libcuda.so.1").is_file():
            raise FileNotFoundError(
                f"{stub / 'libcuda.so.1'} is missing: SGLang's sgl_kernel wheel does not load on a machine "
                "without an NVIDIA driver unless it finds one. Run scripts/setup_sglang.sh (it builds it).")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(stub), env.get("LD_LIBRARY_PATH")) if p)
        env["PYTHONPATH"] = str(CPU_COMPAT_DIR)
        env["MILES_SGLANG_CPU_COMPAT"] = "1"
    return env


class SGLangServer:
    """A running ``sglang.launch_server`` on ``127.0.0.1:port``; ``args`` are its command-line flags."""

    def __init__(self, python: Path, args: list[str], env: dict[str, str], log_path: Path, *,
                 start_timeout_s: float, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, free_port(host, ports=PORT_RANGE)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.exit_code: int | None = None
        self.exited = threading.Event()
        cmd = [str(python), str(SUPERVISOR), str(os.getpid()), *args, "--host", host, "--port", str(self.port)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it until it exits
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        started: dict[str, Any] = {}
        ready = threading.Event()

        def run() -> None:  # the server's parent thread: it lives until the server exits
            try:
                started["proc"] = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True)
            except BaseException as e:  # reported by the constructor
                started["error"] = e
                ready.set()
                return
            ready.set()
            self.exit_code = started["proc"].wait()
            self.exited.set()

        self._thread = threading.Thread(target=run, name=f"sglang-server-{self.port}", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in started:
            self._log.close()
            raise ServerStartError(f"could not start {python}: {started['error']}") from started["error"]
        self.proc: subprocess.Popen = started["proc"]
        self.pid = self.proc.pid
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException as e:
            self.kill()
            if isinstance(e, ServerStartError):
                e.server = self  # the caller may read its log (port_taken) and start another
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited.is_set():
                raise ServerStartError(f"the SGLang server exited with code {self.exit_code} while starting; "
                                       f"last lines of {self.log_path}:\n{self.log_tail()}")
            if self.healthy(timeout_s=2.0) and self._is_ours():
                return
            self.exited.wait(0.5)
        raise ServerStartError(f"the SGLang server did not answer /health within {timeout_s:g} s "
                               f"(rollout.engine.start_timeout_s); last lines of {self.log_path}:\n{self.log_tail()}")

    def _is_ours(self) -> bool:
        """``/model_info`` names the model this server was started with (not another process on the port)."""
        try:
            info = self.request("GET", "/model_info", timeout_s=5.0)
        except (OSError, ServerHTTPError, ValueError):
            return False
        return isinstance(info, dict) and "model_path" in info

    # ---- HTTP ---------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, timeout_s: float) -> Any:
        """``method path`` with a JSON body; the decoded JSON answer (None for an empty one).

        Raises :class:`ServerHTTPError` on an error status, ``OSError`` (``TimeoutError``,
        ``ConnectionError``, ``urllib.error.URLError``) when the server cannot be reached in time.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")[:2000]
            raise ServerHTTPError(f"{method} {path} answered {e.code}: {text}", e.code, text) from None
        except http.client.HTTPException as e:  # something that is not an HTTP server answered
            raise ConnectionError(f"{method} {path}: not an HTTP answer from {self.url} ({e!r:.200})") from e
        return json.loads(raw) if raw.strip() else None

    def post(self, path: str, body: Any = None, *, timeout_s: float) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout_s=timeout_s)

    def healthy(self, timeout_s: float) -> bool:
        """The process runs and ``GET /health`` answers 200 within ``timeout_s``."""
        if self.exited.is_set():
            return False
        try:
            self.request("GET", "/health", timeout_s=timeout_s)
        except (OSError, ServerHTTPError, ValueError):
            return False
        return True

    # ---- lifetime -----------------------------------------------------------------------------

    def alive(self) -> bool:
        return not self.exited.is_set()

    def kill(self) -> None:
        """SIGKILL the server's process group (launcher, scheduler, detokenizer) and reap it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.exited.wait(30)
        self._thread.join(timeout=5)
        if not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError as e:
            return f"(log unreadable: {e})"
        keep = [line[:400] for line in text.splitlines() if "Ignore import error when loading" not in line]
        return "\n".join(keep[-lines:])

    def port_taken(self) -> bool:
        """Whether the log says the server could not bind its port (another process took it meanwhile)."""
        tail = self.log_tail(80).lower()
        return "address already in use" in tail or "errno 98" in tail
