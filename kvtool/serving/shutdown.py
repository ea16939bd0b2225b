"""Bounded graceful shutdown of `kvtool serve`, the same for every engine.

On the first SIGTERM or SIGINT the server drains: every new request gets 503 with Retry-After (`/health`
says "draining", so a load balancer stops sending), the requests already running go on until they finish
or `--shutdown-timeout` passes. Past it, the worker's abort_all ends the rest: each open stream gets a
final chunk with finish_reason "abort" and an error event, a waiting non-streaming request a 503. Then
uvicorn stops and the app's lifespan ends (the backend stops its worker and saves the cache file). A
second signal exits at once, ending the process's children with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvicorn
from starlette.responses import JSONResponse

from kvtool.serving.errors import Unavailable, error_body

log = logging.getLogger("kvtool.serving")
SETTLE_S = 2.0  # after abort_all: time for the final chunks to reach the clients before uvicorn closes them
OPEN_PATHS = ("/health",)  # answered while draining (it reports the drain itself)


class Drain:
    """The drain state one app shares between its middleware, /health and the server."""

    def __init__(self, worker, timeout: float):
        self.worker, self.timeout = worker, timeout
        self.draining = False
        self.in_flight = 0  # HTTP requests being answered (a stream counts until its last byte)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None

    def begin(self, on_done) -> None:
        """Start draining (from a signal handler on the loop's thread, or any thread); on_done() runs on the
        loop once every request has ended."""
        if self.draining or self.loop is None:
            return
        self.draining = True
        self.loop.call_soon_threadsafe(lambda: setattr(self, "task", self.loop.create_task(self.run(on_done))))

    async def run(self, on_done) -> None:
        loop = self.loop
        log.info("shutting down: %d requests in flight get up to %g s to finish (--shutdown-timeout); new "
                 "requests get 503", self.in_flight, self.timeout)
        deadline = loop.time() + self.timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            ended = self.worker.abort_all(Unavailable(
                f"the server is shutting down and this request did not finish within --shutdown-timeout "
                f"({self.timeout:g} s); retry it on another server", code="shutting_down"))
            log.warning("shutting down: ended %d requests still running after %g s", ended, self.timeout)
            settle = loop.time() + SETTLE_S
            while self.in_flight and loop.time() < settle:
                await asyncio.sleep(0.02)
        on_done()


class DrainMiddleware:
    """Counts the HTTP requests in flight; while draining, refuses new ones with 503 and Retry-After."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] not in OPEN_PATHS:
            body = error_body(503, "the server is shutting down; retry on another server or after it restarts",
                              code="shutting_down")
            return await JSONResponse(body, status_code=503, headers={"Retry-After": "5"})(scope, receive, send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first signal drains (Drain) before the usual shutdown; a second exits at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain.draining or self.drain.loop is None:  # second signal, or one before the app has started
            if self.drain.draining:
                log.warning("second signal: exiting now without waiting or saving")
                kill_children()
                os._exit(128 + sig)
            return super().handle_exit(sig, frame)
        self.drain.begin(lambda: super(DrainingServer, self).handle_exit(sig, frame))


def kill_children() -> None:
    """SIGKILL this process's descendants (e.g. an engine's worker processes), so none outlives it."""
    from kvtool.serving.server_process import children

    for pid in children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
