"""Scripted model replies in the exact OpenAI `chat.completion.chunk` format.

Shared by `ScriptedBackend` (in-process) and `FakeEndpoint` (real HTTP), so tests and
demos replay the same chunks with the same delays either way. A script is a list of
replies consumed in order, or a function of the request body that returns one.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

Step = tuple[float, Union[dict, str]]  # (delay before sending, chunk or "[DONE]" or DROP)
DROP = "[DROP]"  # not OpenAI: tells the replayer to cut the connection here


@dataclass
class Reply:
    steps: list[Step] = field(default_factory=list)
    status: int = 200  # != 200: answer with this HTTP error instead of a stream
    error: str = ""
    has_usage: bool = False  # True: the steps carry their own usage chunk


_ids = itertools.count(1)
Script = Union[Sequence[Reply], Callable[[dict], Reply]]


def _chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> dict:
    return {
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
        "model": "fake-model",
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **({"usage": usage} if usage is not None else {}),
    }


def _pieces(text: str, n: int) -> list[str]:
    if n <= 1 or len(text) <= 1:
        return [text]
    size = -(-len(text) // n)
    return [text[i : i + size] for i in range(0, len(text), size)]


def reply(
    content: str = "",
    reasoning: str = "",
    tool_calls: Sequence[tuple[str, dict | str]] = (),
    *,
    delay_s: float = 0.005,
    arg_pieces: int = 3,
    call_delay_s: float | None = None,
    usage: dict | None = None,
    ids: Sequence[str] | None = None,
) -> Reply:
    """A reply streamed word by word: role, reasoning, content, then each tool call
    (id+type+name once, then its arguments in `arg_pieces` fragments), finish, [DONE]."""
    cd = delay_s if call_delay_s is None else call_delay_s
    steps: list[Step] = [(delay_s, _chunk({"role": "assistant", "content": ""}))]
    steps += [(delay_s, _chunk({"reasoning_content": w})) for w in re.findall(r"\S+\s*", reasoning)]
    steps += [(delay_s, _chunk({"content": w})) for w in re.findall(r"\s*\S+\s*", content)]
    for i, (name, args) in enumerate(tool_calls):
        cid = ids[i] if ids else f"call_{next(_ids)}"
        text = args if isinstance(args, str) else json.dumps(args)
        steps.append((cd, _chunk({"tool_calls": [
            {"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}]})))
        steps += [(cd, _chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]}))
                  for p in _pieces(text, arg_pieces)]
    steps.append((delay_s, _chunk({}, finish="tool_calls" if tool_calls else "stop")))
    if usage is not None:
        steps.append((0.0, _chunk(None, usage=usage)))
    steps.append((0.0, "[DONE]"))
    return Reply(steps, has_usage=usage is not None)


def dropped(reply_: Reply, after: int) -> Reply:
    """The same reply, but the connection drops after `after` steps."""
    return Reply(reply_.steps[:after] + [(0.0, DROP)], has_usage=True)


def http_error(status: int, message: str = "scripted failure") -> Reply:
    return Reply(status=status, error=message)


_TOKEN = re.compile(r"\w+|[^\w\s]|\s+")


def _render_message(m: dict) -> str:
    calls = json.dumps(m.get("tool_calls")) if m.get("tool_calls") else ""
    return f"<|im_start|>{m.get('role')}\n{m.get('content') or ''}{calls}<|im_end|>\n"


def render_for_cache(body: dict) -> str:
    """A ChatML-like rendering that stands in for the chat template when simulating a cache:
    like Qwen's, the tool list sits inside the system turn, after the system prompt."""
    messages = list(body.get("messages", []))
    tools = json.dumps(body.get("tools") or [], sort_keys=True)
    if messages and messages[0].get("role") == "system":
        messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n<tools>{tools}</tools>"}
    else:
        messages.insert(0, {"role": "system", "content": f"<tools>{tools}</tools>"})
    return "".join(_render_message(m) for m in messages)


def assistant_message(steps: list[Step]) -> dict:
    """The assistant message an agent will send back for this reply (ids, arguments as streamed)."""
    content, calls = "", {}
    for _, c in steps:
        for choice in c.get("choices", []) if isinstance(c, dict) else []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                call["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                call["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    msg: dict = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def _common_prefix(a: list[str], b: list[str]) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search: slice comparison runs in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCacheSim:
    """Cached tokens = longest common token prefix with any earlier sequence, in whole
    blocks, like a block-based prefix cache; never the whole prompt (one token is fed).
    A request's sequence includes the reply it generated, as a real server's cache does."""

    def __init__(self, block: int = 16):
        self.block = block
        self._seen: list[list[str]] = []

    def usage(self, body: dict, completion_tokens: int = 0, generated: dict | None = None) -> dict:
        toks = _TOKEN.findall(render_for_cache(body))
        best = max((_common_prefix(prev, toks) for prev in self._seen), default=0)
        self._seen.append(toks + (_TOKEN.findall(_render_message(generated)) if generated else []))
        cached = min(best, len(toks) - 1) // self.block * self.block
        return {"prompt_tokens": len(toks), "completion_tokens": completion_tokens,
                "total_tokens": len(toks) + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": max(0, cached)}}


class ScriptPlayer:
    """Picks the reply for each request and adds the usage chunk a server would send."""

    def __init__(self, script: Script, cache: PrefixCacheSim | None = None):
        self.script = script
        self.cache = cache or PrefixCacheSim()
        self.requests: list[dict] = []
        self._next = 0

    def next_reply(self, body: dict) -> Reply:
        self.requests.append(body)
        if callable(self.script):
            return self.script(body)
        if self._next >= len(self.script):
            return http_error(500, f"script exhausted: no reply scripted for request {self._next + 1}")
        self._next += 1
        return self.script[self._next - 1]

    def steps(self, reply_: Reply, body: dict, include_usage: bool = True) -> list[Step]:
        steps = list(reply_.steps)
        if include_usage and not reply_.has_usage:
            n_out = sum(1 for _, c in steps if isinstance(c, dict) and c.get("choices"))
            usage = self.cache.usage(body, n_out, assistant_message(steps))
            steps.insert(len(steps) - 1 if steps and steps[-1][1] == "[DONE]" else len(steps),
                         (0.0, _chunk(None, usage=usage)))
        return steps


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()
