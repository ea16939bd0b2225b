"""A peer server as a child process: started on a free loopback port, ready once its health route answers 200,
stopped with its whole process group (no orphans), its output kept in a log file for the report."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtool.errors import KvtoolError


class PeerError(KvtoolError):
    """A peer server could not be started, or is not installed (``missing``: what to do about it)."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, so a benchmark that is
    killed leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerProcess:
    """``with ServerProcess(argv, port, log) as url:`` runs argv (which listens on 127.0.0.1:port) until the
    block ends; ``url`` is its base URL. Raises PeerError with the log's tail when it exits or is not ready
    within ``startup_s``."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict | None = None,
                 startup_s: float = 300.0, health: str = "/health", log_fn=None):
        self.name, self.argv, self.port, self.log, self.env = name, argv, port, Path(log), env
        self.startup_s, self.health = startup_s, health
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.startup_ms: float | None = None
        self._log = log_fn or (lambda s: print(s, file=sys.stderr, flush=True))

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        self._log(f"{self.name}: starting on {self.url} (log {self.log})")
        t0 = time.perf_counter()
        with open(self.log, "wb") as out:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        deadline, last = t0 + self.startup_s, time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise PeerError(f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                                f"the end of its log ({self.log}):\n{log_tail(self.log)}")
            try:
                if httpx.get(self.url + self.health, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise PeerError(f"{self.name} was not ready within {self.startup_s:.0f} s; the end of its log "
                                f"({self.log}):\n{log_tail(self.log)}")
            if time.perf_counter() - last > 15:
                last = time.perf_counter()
                self._log(f"{self.name}: waiting for {self.health} ({last - t0:.0f} s)")
            time.sleep(0.25)
        self.startup_ms = (time.perf_counter() - t0) * 1000.0
        self._log(f"{self.name}: ready after {self.startup_ms / 1000:.1f} s")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL after grace_s: no child (a worker, a compiler) outlives it."""
        if self.proc is None or self.proc.poll() is not None and not self._group_alive():
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if not self._group_alive():
                break
            time.sleep(0.5)
        self._log(f"{self.name}: stopped")

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
