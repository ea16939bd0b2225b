"""A real HTTP server on 127.0.0.1 that replays a script as an OpenAI SSE stream.

Plain asyncio in a background thread, so sync tests, `asyncio.run` and the `openai`
client can all talk to it. It records each request body and each client disconnect
(how a cancelled stream shows up on the server side).
"""

from __future__ import annotations

import asyncio
import json
import threading

from kvtool.agent.demos.script import DROP, Script, ScriptPlayer, sse


class FakeEndpoint:
    def __init__(self, script: Script, models: tuple[str, ...] = ("fake-model",)):
        self.player = ScriptPlayer(script)
        self.models = models
        self.disconnects = 0
        self.base_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def requests(self) -> list[dict]:
        return self.player.requests

    def start(self) -> str:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            port = self._server.sockets[0].getsockname()[1]
            self.base_url = f"http://127.0.0.1:{port}/v1"
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fake-endpoint", daemon=True)
        self._thread.start()
        ready.wait(5)
        return self.base_url

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> "FakeEndpoint":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path.rstrip("/").endswith("/models"):
                data = {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]}
                await self._send_json(writer, 200, data)
            elif method == "POST" and path.rstrip("/").endswith("/chat/completions"):
                await self._chat(reader, writer, json.loads(body or b"{}"))
            else:
                await self._send_json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
        except (ConnectionError, asyncio.IncompleteReadError):
            self.disconnects += 1
        except asyncio.CancelledError:  # server shutdown; the task must not end "cancelled" (asyncio logs it)
            pass
        finally:
            writer.close()

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                     "Connection: close\r\n\r\n".encode() + payload)
        await writer.drain()

    async def _chat(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: dict) -> None:
        reply = self.player.next_reply(body)
        if reply.status != 200:
            await self._send_json(writer, reply.status, {"error": {"message": reply.error, "code": reply.status}})
            return
        if not body.get("stream"):
            await self._send_json(writer, 400, {"error": {"message": "the fake endpoint only streams"}})
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        # the client sends nothing after its request, so a finished read means it hung up
        hangup = asyncio.ensure_future(reader.read())
        try:
            for delay, payload in self.player.steps(reply, body, include_usage):
                if delay:
                    await asyncio.wait({hangup}, timeout=delay)
                if hangup.done():
                    raise ConnectionResetError("client closed the stream")
                if payload == DROP:
                    writer.transport.abort()  # cut mid-body, as a crashed server would
                    return
                data = sse(payload)
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            hangup.cancel()
