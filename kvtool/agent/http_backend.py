"""`ChatBackend` over an OpenAI-compatible `/v1/chat/completions` SSE stream.

Works with kvtool serve, vLLM and llama.cpp. Cancelling the consumer closes the HTTP
response, which is how the server learns to stop generating.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterable, AsyncIterator

import httpx

from kvtool.agent.backend import BackendError, BackendUnavailable, StreamDelta, ToolCallFragment, Usage
from kvtool.agent.inprocess import SAMPLING_KEYS
from kvtool.config import SamplingParams
from kvtool.errors import InvalidParameterError

# body fields the backend writes itself; a sampling dict holding one would replace it
OWN_FIELDS = ("model", "messages", "stream", "stream_options", "tools")


async def iter_sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """Yield the data of each SSE event; multi-line data is joined with newlines."""
    data: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # comments (":") and other fields (event:, id:, retry:) carry nothing we use
    if data:
        yield "\n".join(data)


def usage_from_json(usage: dict[str, Any] | None) -> Usage | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=None if cached is None else int(cached),
    )


def chunk_to_delta(chunk: dict[str, Any]) -> StreamDelta:
    """Map one `chat.completion.chunk` object to a StreamDelta."""
    out = StreamDelta(usage=usage_from_json(chunk.get("usage")))
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        # vLLM and kvtool say reasoning_content; some servers say reasoning
        out.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
        out.content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            out.tool_calls.append(
                ToolCallFragment(
                    index=int(tc.get("index", 0)),
                    id=tc.get("id"),
                    name=fn.get("name"),
                    arguments=fn.get("arguments") or "",
                )
            )
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return out


class ThinkSplitter:
    """Moves a leading `<think>…</think>` block from content to reasoning, for servers that
    run without a reasoning parser. Tags may arrive split across chunks."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self) -> None:
        self.inside = False
        self.done = False  # only a block at the very start counts; later "<think>" is just text
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning, content) safe to emit now."""
        text, self.pending = self.pending + text, ""
        if self.done:
            return "", text
        reasoning = content = ""
        if not self.inside:
            stripped = text.lstrip()
            if stripped.startswith(self.OPEN):
                self.inside, text = True, stripped[len(self.OPEN):]
            elif stripped and self.OPEN.startswith(stripped):
                self.pending = text  # could still become "<think>"
                return "", ""
            else:
                self.done = True
                return "", text
        end = text.find(self.CLOSE)
        if end >= 0:
            self.inside, self.done = False, True
            return text[:end], text[end + len(self.CLOSE):].lstrip("\n")
        keep = next((k for k in range(len(self.CLOSE) - 1, 0, -1) if text.endswith(self.CLOSE[:k])), 0)
        reasoning, self.pending = text[: len(text) - keep], text[len(text) - keep:]
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        text, self.pending = self.pending, ""
        return (text, "") if self.inside else ("", text)


class OpenAIHTTPBackend:
    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        client: httpx.AsyncClient | None = None,
        split_think: bool = True,
    ):
        self.split_think = split_think
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self._client = client
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        # an AsyncClient belongs to one event loop; keep one per loop (building one costs ~40 ms)
        self._own: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    def check_sampling(self, sampling: dict[str, Any]) -> None:
        """InvalidParameterError for AgentConfig.sampling this backend can't send. Fields other servers take
        (vLLM's best_of, llama.cpp's mirostat) pass through; the ones kvtool also knows are range-checked."""
        def bad(why: str) -> None:
            raise InvalidParameterError(f"AgentConfig.sampling for {self.base_url}: {why}")

        own = sorted(set(sampling) & set(OWN_FIELDS))
        if own:
            bad(f"{own} are set by the HTTP backend itself ({', '.join(OWN_FIELDS)}); leave them out")
        if sampling.get("n", 1) != 1:
            bad(f"n={sampling['n']!r}: the agent reads one choice per call; leave n out or set it to 1")
        try:
            json.dumps(sampling, allow_nan=False)
        except (TypeError, ValueError) as exc:
            bad(f"values must be JSON numbers, strings, lists or objects ({exc})")
        try:  # the fields kvtool knows, by its own checks (a single stop string included)
            SamplingParams(**{k: v for k, v in sampling.items() if k in SAMPLING_KEYS and v is not None}).validate()
        except InvalidParameterError as exc:
            bad(str(exc))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _http(self) -> httpx.AsyncClient:
        if self._client is not None:
            return self._client
        loop = asyncio.get_running_loop()
        if self._own is None or self._own[0] is not loop or self._own[1].is_closed:
            self._own = (loop, httpx.AsyncClient(timeout=self._timeout))
        return self._own[1]

    async def aclose(self) -> None:
        if self._own is not None and self._own[0] is asyncio.get_running_loop():
            await self._own[1].aclose()
        self._own = None

    async def list_models(self) -> list[str]:
        """Ids from GET /models; raises BackendUnavailable with a hint if unreachable."""
        try:
            resp = await self._http().get(f"{self.base_url}/models", headers=self._headers())
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if resp.status_code >= 400:
            raise BackendError(f"GET {self.base_url}/models returned {resp.status_code}: {resp.text[:200]}",
                               status=resp.status_code)
        return [m.get("id", "") for m in resp.json().get("data", [])]

    def _unreachable(self, exc: Exception) -> BackendUnavailable:
        return BackendUnavailable(
            f"cannot reach the model endpoint {self.base_url} ({type(exc).__name__}: {exc}); "
            "start one (e.g. `kvtool serve`) or pass --endpoint URL"
        )

    async def stream(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **sampling: Any
    ) -> AsyncIterator[StreamDelta]:
        body: dict[str, Any] = {
            "model": self.model or "default",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }
        if tools:
            body["tools"] = tools
        try:
            async with self._http().stream(
                "POST", f"{self.base_url}/chat/completions", json=body, headers=self._headers()
            ) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode("utf-8", "replace")[:500]
                    raise BackendError(
                        f"model endpoint returned HTTP {resp.status_code}: {text}",
                        status=resp.status_code,
                        retryable=resp.status_code == 429 or resp.status_code >= 500,
                    )
                think = ThinkSplitter() if self.split_think else None
                async for data in iter_sse_data(resp.aiter_lines()):
                    if data.strip() == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendError(f"model endpoint error: {chunk['error']}")
                    delta = chunk_to_delta(chunk)
                    if think and delta.content:
                        reasoning, delta.content = think.feed(delta.content)
                        delta.reasoning += reasoning
                    yield delta
                if think and (rest := think.flush()) != ("", ""):
                    yield StreamDelta(reasoning=rest[0], content=rest[1])
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise self._unreachable(exc) from exc
        except httpx.HTTPError as exc:
            raise BackendError(f"model stream failed: {type(exc).__name__}: {exc}", retryable=True) from exc
