"""Run the app: `serve()` in the foreground (the CLI), `BackgroundServer` in a thread (tests, benchmarks)."""

from __future__ import annotations

import threading
import time

import uvicorn

from kvtool.config import EngineConfig
from kvtool.serving.app import create_app
from kvtool.serving.config import ServerConfig


def serve(model, server_config: ServerConfig | None = None, engine_config: EngineConfig | None = None,
          log_level: str = "info") -> None:
    cfg = server_config or ServerConfig()
    app = create_app(model, engine_config, cfg)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=log_level)


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
