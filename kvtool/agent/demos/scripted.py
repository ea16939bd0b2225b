"""`ChatBackend` that replays a script in-process (no HTTP); same chunks as FakeEndpoint."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from kvtool.agent.backend import BackendError, StreamDelta
from kvtool.agent.http_backend import chunk_to_delta
from kvtool.agent.demos.script import DROP, Script, ScriptPlayer


class ScriptedBackend:
    def __init__(self, script: Script, model: str = "fake-model"):
        self.player = ScriptPlayer(script)
        self.model = model

    @property
    def requests(self) -> list[dict]:
        return self.player.requests

    async def stream(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **sampling: Any
    ) -> AsyncIterator[StreamDelta]:
        body = {"model": self.model, "messages": messages, "tools": tools, "stream": True, **sampling}
        reply = self.player.next_reply(body)
        if reply.status != 200:
            raise BackendError(f"model endpoint returned HTTP {reply.status}: {reply.error}", status=reply.status,
                               retryable=reply.status == 429 or reply.status >= 500)
        for delay, payload in self.player.steps(reply, body):
            if delay:
                await asyncio.sleep(delay)
            if payload == "[DONE]":
                return
            if payload == DROP:
                raise BackendError("model stream failed: connection dropped (scripted)", retryable=True)
            yield chunk_to_delta(payload)
