"""Start a server as a subprocess on a free 127.0.0.1 port, wait for /health, and always stop it.

    with launch(kvserve_command(["--scheduler", "static"]), name="static") as server:
        run_load(..., LoadConfig(url=server.url, ...))

The server's output goes to ``loadtest/out/<name>.log`` so a failed start can be read afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.loadtest.loadgen.report import OUT_DIR

REPO = Path(__file__).resolve().parents[2]
PORT = "{port}"  # placeholder replaced by the chosen port in a command


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log's tail."""


@dataclass(slots=True, frozen=True)
class Server:
    url: str
    pid: int
    log: Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kvserve_command(extra: list[str]) -> list[str]:
    """``kvserve serve`` on 127.0.0.1 with ``extra`` flags, run by this Python (works without an install)."""
    return [sys.executable, "-m", "kvserve.server.cli", "serve", "--host", "127.0.0.1", "--port", PORT, *extra]


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read): what a start-up error quotes."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen, Path]:
    """Start ``argv`` from the repo root (on PYTHONPATH) in a session of its own, so stopping it stops its children
    too; stdout and stderr go to ``log_dir/NAME.log``. Returns the process and the log's path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=full_env,
                                start_new_session=True)
    return proc, log


@contextlib.contextmanager
def launch(command: list[str], name: str, health_path: str = "/health", start_timeout_s: float = 300.0,
           env: dict[str, str] | None = None, log_dir: Path = OUT_DIR):
    """Run ``command`` (with ``{port}`` replaced) and yield a Server once ``health_path`` answers 200.

    Raises:
        ServerStartError: the process exited, or /health did not answer within ``start_timeout_s``.
    """
    port = free_port()
    argv = [part.replace(PORT, str(port)) for part in command]
    proc, log = spawn(name, argv, log_dir, env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url + health_path, start_timeout_s, log)
        yield Server(url=url, pid=proc.pid, log=log)
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, health_url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"server exited with {proc.returncode}; log {log}:\n{log_tail(log)}")
        try:
            if httpx.get(health_url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"no 200 from {health_url} after {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it was started in its own session), then SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
