"""Where `kvtool bench ttft` sends its chat requests: the in-process Engine or any
OpenAI-compatible endpoint (kvtool serve, vLLM, llama.cpp server), measured the same way."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Iterator

from kvtool.bench.scenarios import ChatRequest
from kvtool.errors import KvtoolError


class EndpointError(KvtoolError):
    """The endpoint refused a request (``status``: its HTTP status) or answered something that is not an
    OpenAI stream (status None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class RequestResult:
    label: str
    ttft_ms: float  # request start (before templating) -> first generated token / content delta
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the endpoint does not report it
    output_tokens: int | None = None
    engine_ttft_ms: float | None = None  # in-process: Timings.ttft_ms (prefix lookup -> first token)
    ttft_source: str = "token"

    def to_dict(self) -> dict:
        return asdict(self)


def tools_as_system_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For chat templates that ignore ``tools``: declare them in the system turn, Qwen-style."""
    block = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{block}\n</tools>")
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def open_client(endpoint: str, api_key: str | None = None, timeout_s: float = 600.0, client=None,
                connections: int = 10):
    """(base URL without /v1, httpx.Client) for an OpenAI-compatible server."""
    import httpx

    base = endpoint.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return base, client or httpx.Client(base_url=base, timeout=timeout_s, headers=headers, limits=limits)


def first_model(client, base: str) -> str:
    try:
        r = client.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as exc:
        raise EndpointError(f"could not list models at {base}/v1/models ({type(exc).__name__}: {exc}); "
                            "check --endpoint or name the model with --served-model") from None


def sse_chunks(response, url: str) -> Iterator[dict]:
    """The JSON chunks of an OpenAI event stream up to [DONE]; EndpointError on a refusal or a broken stream."""
    if response.status_code != 200:
        response.read()
        raise EndpointError(f"{url} answered {response.status_code}: {response.text[:500]}", response.status_code)
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(f"the endpoint streamed a line that is not JSON: {data[:200]!r}") from None
        if chunk.get("error"):
            raise EndpointError(f"the endpoint streamed an error: {chunk['error']}")
        yield chunk


class InProcessBackend:
    """An Engine with a PrefixCache in this process; TTFT includes templating and tokenization."""

    kind = "in-process"

    def __init__(self, model, engine, max_tokens: int = 1):
        from kvtool.config import SamplingParams

        if engine.prefix_cache is None:
            raise KvtoolError("the in-process TTFT benchmark needs an Engine with a prefix cache "
                              "(attach_prefix_cache(engine))")
        self.model, self.engine, self.cache = model, engine, engine.prefix_cache
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        tool = [{"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}]
        # A template that ignores `tools` would silently drop them; declare them in the system turn instead.
        self.tools_rendering = "template" if "probe_tool" in model.render(probe, tools=tool) else "system-text"

    @classmethod
    def load(cls, model_arg: str | None, device: str = "auto", dtype: str = "auto", cache_bytes: int | None = None,
             block_size: int | None = None, max_tokens: int = 1, announce=print,
             weights: str = "dense") -> "InProcessBackend":
        from kvtool.bench.loading import model_path
        from kvtool.models.loading import load

        model = load(model_path(model_arg, announce), device=device, dtype=dtype, weights=weights)
        return cls.for_model(model, cache_bytes, block_size, max_tokens)

    @classmethod
    def for_model(cls, model, cache_bytes: int | None = None, block_size: int | None = None,
                  max_tokens: int = 1) -> "InProcessBackend":
        """A fresh Engine with its own PrefixCache over an already loaded model."""
        from kvtool.cache.manager import attach_prefix_cache
        from kvtool.config import EngineConfig
        from kvtool.engine import Engine

        engine = Engine(model, EngineConfig(enable_prefix_cache=True))
        attach_prefix_cache(engine, budget_bytes=cache_bytes, block_size=block_size)
        return cls(model, engine, max_tokens)

    def describe(self) -> dict:
        s = self.cache.stats()
        return {"backend": self.kind, "model": self.model.name, "device": str(self.model.runner.device),
                "dtype": str(self.model.runner.dtype).replace("torch.", ""), "block_size": s["block_size"],
                "cache_budget_bytes": s["budget_bytes"], "tools_rendering": self.tools_rendering}

    def reset(self) -> bool:
        self.cache.reset()
        return True

    def fork(self) -> dict:
        """Where the requests since the last reset parted in the prefix cache (kvtool.cache.tree.fork_of), e.g.
        the seconds of a timestamp."""
        from kvtool.cache.tree import fork_of

        return fork_of(self.cache.tree(), lambda segment: self.model.decode(segment["token_ids"]))

    def send(self, request: ChatRequest) -> RequestResult:
        t0 = time.perf_counter()
        messages, tools = request.messages, request.tools
        if tools and self.tools_rendering == "system-text":
            messages, tools = tools_as_system_text(messages, tools), None
        ids = self.model.encode_chat(messages, tools=tools)
        gen = self.engine.generate(ids, self.params)
        ttft = None
        for _ in gen:
            ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1000.0
        t = gen.timings
        return RequestResult(request.label, ttft, t.prompt_tokens, t.cached_tokens, len(gen.token_ids), t.ttft_ms)


class EndpointBackend:
    """POST /v1/chat/completions with stream=true; TTFT = first content/reasoning/tool-call delta.

    Tools go in the body's ``tools``; a server that refuses them with a 400 (its chat template renders
    none, as SmolLM2's) gets them declared in the system turn instead, for that request and the rest of
    the run, as InProcessBackend does for such a template (describe() says which)."""

    kind = "endpoint"
    RESET_PATHS = ("/v1/cache/reset", "/reset_prefix_cache")  # kvtool serve, vLLM

    def __init__(self, endpoint: str, model: str | None = None, api_key: str | None = None,
                 max_tokens: int = 1, timeout_s: float = 600.0, client=None, reset_cache: bool = True):
        self.base, self.client = open_client(endpoint, api_key, timeout_s, client)
        self.max_tokens = max_tokens
        self.reset_cache = reset_cache  # False: isolate by nonce even where a reset route exists
        self.model = model or first_model(self.client, self.base)
        self.tools_rendering = "server"  # "system-text" once the server refused `tools`
        self.tools_refused: str | None = None  # what it said

    def describe(self) -> dict:
        out = {"backend": self.kind, "endpoint": self.base, "model": self.model, "tools_rendering": self.tools_rendering}
        return out if self.tools_refused is None else {**out, "tools_refused": self.tools_refused}

    def reset(self) -> bool:
        """Try the cache-reset routes engines offer; False if none worked or reset_cache is off (the caller
        isolates by nonce)."""
        for path in self.RESET_PATHS if self.reset_cache else ():
            try:
                if self.client.post(path).status_code < 300:
                    return True
            except Exception:
                pass
        return False

    def fork(self) -> dict | None:
        """As InProcessBackend.fork, from kvtool serve's GET /v1/cache/tree; None where the engine has no such
        route (vLLM, llama.cpp)."""
        from kvtool.cache.tree import fork_of

        try:
            r = self.client.get("/v1/cache/tree", params={"max_chars": 4000})
            tree = r.json()["tree"] if r.status_code == 200 else None
        except Exception:
            return None
        return fork_of(tree, lambda segment: segment.get("text", "")) if isinstance(tree, list) else None

    def send(self, request: ChatRequest) -> RequestResult:
        in_system = tools_as_system_text(request.messages, request.tools) if request.tools else request.messages
        if not request.tools or self.tools_rendering == "system-text":
            return self._send(request.label, in_system, None)
        try:
            return self._send(request.label, request.messages, request.tools)
        except EndpointError as exc:
            if exc.status != 400:
                raise
            refusal = exc
        try:  # a template that renders no tools, most likely: declare them in the system turn
            result = self._send(request.label, in_system, None)
        except EndpointError:
            raise refusal from None
        self.tools_rendering, self.tools_refused = "system-text", str(refusal)[:300]
        return result

    def _send(self, label: str, messages: list[dict], tools: list[dict] | None) -> RequestResult:
        body = {"model": self.model, "messages": messages, "stream": True, "temperature": 0.0,
                "max_tokens": self.max_tokens, "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
        t0 = time.perf_counter()
        first = finished = None
        usage, timings, n_out = {}, {}, 0
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            for chunk in sse_chunks(r, f"{self.base}/v1/chat/completions"):
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
                        n_out += 1
                        first = first if first is not None else time.perf_counter()
                    if choice.get("finish_reason") and finished is None:
                        finished = time.perf_counter()
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings  # llama.cpp server
        end = time.perf_counter()
        t_first, source = (first, "delta") if first is not None else (finished or end, "finish")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if cached is None and "cache_n" in timings:
            cached = timings["cache_n"]
        return RequestResult(label, (t_first - t0) * 1000.0, usage.get("prompt_tokens"), cached,
                             usage.get("completion_tokens", n_out or None), None, source)
