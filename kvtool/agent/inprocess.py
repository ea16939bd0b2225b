"""ChatBackend over the in-process engine: a tool call is sealed at its `</tool_call>`.

No HTTP in between: the agent sees each token's text as the engine samples it, and the
output parser turns `<tool_call>{json}</tool_call>` into a sealed call the moment the
closing tag is parsed, while the model keeps generating the next call.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from kvtool.agent.backend import BackendError, StreamDelta, ToolCallFragment, Usage
from kvtool.config import SamplingParams
from kvtool.errors import InvalidParameterError

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what chat templates expect (tool-call arguments as objects)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except ValueError:
                        fn["arguments"] = {"_raw": fn["arguments"]}
                calls.append({**call, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


class InProcessBackend:
    """Streams from an Engine in this process; one stream at a time per engine.

    The model runs on one thread of its own, never on the event loop: a pool of threads would give
    each its own OpenMP team, and the loading thread's team is handed back first (see
    kvtool.models.host.release_openmp_threads), so one team runs every op at full speed."""

    def __init__(self, engine, tool_format: str = "qwen"):
        from kvtool.models.host import release_openmp_threads
        from kvtool.serving.toolparse import TOOL_FORMATS

        self.engine = engine
        self.model = engine.model
        self.fmt = TOOL_FORMATS[tool_format]
        self._lock = asyncio.Lock()
        release_openmp_threads()
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-model")

    def check_sampling(self, sampling: dict[str, Any]) -> None:
        """InvalidParameterError for a key this backend does not take, or a value SamplingParams refuses."""
        unknown = sorted(set(sampling) - SAMPLING_KEYS)
        if unknown:
            raise InvalidParameterError(f"AgentConfig.sampling: the in-process backend does not take {unknown}; "
                                        f"it takes {', '.join(sorted(SAMPLING_KEYS))}")
        SamplingParams(**{k: v for k, v in sampling.items() if v is not None}).validate()

    async def stream(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     **sampling: Any) -> AsyncIterator[StreamDelta]:
        from kvtool.serving.toolparse import OutputParser

        params = SamplingParams(**{k: v for k, v in sampling.items() if k in SAMPLING_KEYS and v is not None})
        names = [t["function"]["name"] for t in tools or []]
        try:
            prompt = self.model.render(template_messages(messages), tools=tools or None)
        except InvalidParameterError as exc:
            raise BackendError(str(exc)) from None
        async with self._lock:
            gen = self.engine.generate(self.model.encode_rendered(prompt), params)
            parser = OutputParser(tools=names, fmt=self.fmt)
            it, calls = iter(gen), 0
            try:
                while True:
                    event = await asyncio.get_running_loop().run_in_executor(self._model_thread, next, it, None)
                    events = parser.feed(event.text) if event is not None else parser.finish()
                    delta = StreamDelta()
                    for ev in events:
                        if ev.call is not None:
                            delta.tool_calls.append(ToolCallFragment(calls, ev.call.id, ev.call.name,
                                                                     ev.call.arguments))
                            delta.sealed += (calls,)
                            calls += 1
                        elif ev.channel == "reasoning":
                            delta.reasoning += ev.text
                        else:
                            delta.content += ev.text
                    if event is None:
                        t = gen.timings
                        delta.finish_reason = "tool_calls" if calls else gen.finish_reason
                        delta.usage = Usage(t.prompt_tokens, len(gen.token_ids), t.cached_tokens)
                        yield delta
                        return
                    if delta.content or delta.reasoning or delta.tool_calls:
                        yield delta
            finally:
                self._model_thread.submit(gen.close)  # on the model's thread too, before the next stream starts there
