"""The request-body size limit: a pure ASGI middleware that answers 413 before the app parses anything.

The body is read here (refused from Content-Length at once, or as soon as a chunked body passes the
limit) and handed to the app in one piece; later receive() calls (a disconnect) pass straight through.
A refused body is still read, and dropped, up to DRAIN_BYTES: a client that sends its whole body before
reading the answer (most do) would otherwise get a connection reset instead of the 413.
"""

from __future__ import annotations

import asyncio
import json
import sys

from kvtool.serving.errors import error_body


DRAIN_BYTES, DRAIN_SECONDS = 256 << 20, 10.0


def too_deep_message() -> str:
    return (f"the request body is nested too deeply to parse (JSON arrays and objects may nest about "
            f"{sys.getrecursionlimit()} levels at most); send a flatter body")


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            if b"100-continue" not in headers.get(b"expect", b"").lower():  # else the client waits: nothing sent
                await drain(receive, int(declared))
            return await self.refuse(send, f"is {int(declared)} bytes, over this server's limit of "
                                           f"{self.max_bytes} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await drain(receive, DRAIN_BYTES)
                return await self.refuse(send, f"passed this server's limit of {self.max_bytes} bytes "
                                               "(counted as it arrived)")
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks = None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return whole

        await self.app(scope, replay, send)

    async def refuse(self, send, how: str) -> None:
        message = (f"the request body {how}; send a smaller "
                   "request (a prompt must fit the context window anyway), or start kvtool serve with a larger "
                   "--max-body-bytes (ServerConfig.max_body_bytes)")
        payload = json.dumps(error_body(413, message, code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


async def drain(receive, size: int) -> None:
    """Read and drop the rest of a refused body, when it is not too big to bother (memory stays flat)."""
    if size > DRAIN_BYTES:
        return

    async def read():
        left = size
        while left > 0:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            left -= len(message.get("body", b""))

    try:
        await asyncio.wait_for(read(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        pass
