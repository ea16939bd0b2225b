"""What an agent needs from a model: a stream of deltas for a list of chat messages.

`ChatBackend` is deliberately tiny so any source can implement it: an OpenAI-compatible
HTTP endpoint (`OpenAIHTTPBackend`), a scripted replay (`ScriptedBackend`), or the
in-process engine. An in-process backend knows exactly when a call is complete -- the
`</tool_call>` token -- and says so with `StreamDelta.sealed`; HTTP backends cannot, so
`CallAssembler` seals their calls heuristically (next index, finish, complete JSON).
Cancelling the consumer must close the stream (async generators do this on aclose()).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from kvtool.errors import KvtoolError


@dataclass
class ToolCallFragment:
    """One streamed piece of a tool call; id and name usually come once, first."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report prefix-cache hits

    @property
    def cache_hit_rate(self) -> float | None:
        if self.cached_tokens is None or self.prompt_tokens <= 0:
            return None
        return self.cached_tokens / self.prompt_tokens


@dataclass
class StreamDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallFragment] = field(default_factory=list)
    sealed: tuple[int, ...] = ()  # call indices the backend knows are complete
    finish_reason: str | None = None
    usage: Usage | None = None


class ChatBackend(Protocol):
    """`stream` is an async generator; extra keyword arguments are sampling options. A backend that knows
    which options it takes may also have `check_sampling(sampling: dict)`, which Agent() calls to refuse bad
    AgentConfig.sampling before the first model call (InProcessBackend and OpenAIHTTPBackend do)."""

    def stream(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **sampling: Any
    ) -> AsyncIterator[StreamDelta]: ...


class BackendError(KvtoolError):
    """The model endpoint answered with an error or could not be reached."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class BackendUnavailable(BackendError):
    def __init__(self, message: str):
        super().__init__(message, status=None, retryable=True)
