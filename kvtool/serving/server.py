"""Run the app: `serve()` in the foreground (the CLI; a signal drains it, kvtool.serving.shutdown),
`BackgroundServer` in a thread (tests, benchmarks)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import uvicorn

from kvtool.config import EngineConfig
from kvtool.serving.app import create_app
from kvtool.serving.config import ServerConfig
from kvtool.serving.errors import ServingError
from kvtool.serving.shutdown import SETTLE_S, DrainingServer


def serve(model, server_config: ServerConfig | None = None, engine_config: EngineConfig | None = None,
          log_level: str = "info", on_ready: Callable[..., None] | None = None, backend=None) -> None:
    """Build the app (engine, prefix cache, skills), call on_ready(app) (the CLI's "serving ..." line), serve."""
    cfg = server_config or ServerConfig()
    logger = logging.getLogger("kvtool")
    if not logger.handlers:  # kvtool's own lines (skills served, cache file saved) beside uvicorn's, alike
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(log_level.upper())
    app = create_app(model, engine_config, cfg, backend=backend)
    if on_ready is not None:
        on_ready(app)
    # uvicorn's own wait for open connections is a backstop: the drain has ended every request by then
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                            timeout_graceful_shutdown=SETTLE_S + 1)
    DrainingServer(config, app.state.drain).run()


def check_listen(host: str, port: int) -> None:
    """ServingError when (host, port) cannot be listened on (in use, or no such address): said before the
    model loads, in one line, instead of uvicorn's log after it."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServingError(f"cannot listen on host {host!r}: {exc.strerror}; give an address of this machine "
                           "(--host 127.0.0.1, or 0.0.0.0 for all)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be listened on ({exc.strerror})"
            raise ServingError(f"port {port} on {host} {why}; pick another with --port") from None


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread; port 0 picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="kvtool-uvicorn", daemon=True)
        self.host, self.port = host, port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
