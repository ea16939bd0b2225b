"""`kvtool serve` in a child process, for tests and benchmarks that need a whole server (e.g. --engine vllm,
whose engine changes process-wide state: thread settings, environment): start, wait until it answers
/health, stop it with a signal and check that it and its children are gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    """The pids of pid's descendants (from /proc; empty where /proc is absent)."""
    kids, out = {}, []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    stack = [pid]
    while stack:
        for kid in kids.get(stack.pop(), []):
            out.append(kid)
            stack.append(kid)
    return out


class ServerProcess:
    """kvtool serve ARGS on a free loopback port; .base_url, .startup_s, .log (stderr+stdout so far)."""

    def __init__(self, args: list[str], log_path: str | os.PathLike, env: dict | None = None):
        self.port = free_port()
        self.args = [sys.executable, "-m", "kvtool.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     *args]
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = 600.0) -> "ServerProcess":
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtool serve exited with {self.proc.returncode}:\n{self.log[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"kvtool serve did not answer within {timeout:.0f} s:\n{self.log[-3000:]}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> tuple[int | None, list[int]]:
        """Send sig; (exit code or None if it had to be killed, descendants still alive after it exited)."""
        if self.proc is None or self.proc.poll() is not None:
            return (self.proc.returncode if self.proc else None), []
        kids = children(self.proc.pid)
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [*kids, self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(10)
            return None, []
        time.sleep(0.5)
        alive = [pid for pid in kids if Path(f"/proc/{pid}").exists()]
        return code, alive
