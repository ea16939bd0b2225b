"""ChatSession on a scripted token stream (no model): chunk shapes for tool calls, reasoning, logprobs."""

from __future__ import annotations

import asyncio
import json

from kvtool.config import SamplingParams
from kvtool.engine import Generation, TokenEvent
from kvtool.serving.chat import PreparedChat, ends_in_reasoning
from kvtool.serving.session import ChatSession
from kvtool.serving.toolparse import TOOL_FORMATS

EOS = 2


class Served:
    name = "scripted"
    special_ids = {EOS}

    def piece(self, token_id: int) -> str:
        return f"<{token_id}>"


class ScriptedHandle:
    """Yields one TokenEvent per text piece, then EOS; records cancel()."""

    def __init__(self, pieces: list[str], logprobs: bool = False):
        self.gen = Generation(prompt_ids=[1, 1, 1], params=SamplingParams())
        self.pieces, self.logprobs, self.cancelled = pieces, logprobs, False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        for i, piece in enumerate([*self.pieces, "<|im_end|>"]):
            if self.cancelled:
                self.gen.finish_reason = "abort"
                return
            token = EOS if piece == "<|im_end|>" else 100 + i
            self.gen.token_ids.append(token)
            lp = (-0.5, [(token, -0.5)]) if self.logprobs else (None, None)
            yield TokenEvent(i, token, piece, "" if token == EOS else piece, float(i), *lp)
        self.gen.finish_reason = "stop"


def run(pieces, tools=("get_weather",), logprobs=False, **kw):
    """(streamed chunks, non-streaming response, handle of the streamed run) for one script."""
    def session():
        handle = ScriptedHandle(pieces, logprobs)
        prepared = PreparedChat("p", [1, 1, 1], tools=list(tools))
        return ChatSession(Served(), prepared, handle, TOOL_FORMATS["qwen"], **kw), handle

    async def collect(s):
        return [c async for c in s.chunks()]

    streamed, handle = session()
    return asyncio.run(collect(streamed)), asyncio.run(session()[0].response()), handle


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TWO_CALLS = ["<tool_call>", "\n", CALL, "\n", "</tool_call>", "\n", "<tool_call>", "\n",
             CALL.replace("Paris", "Rome"), "\n", "</tool_call>"]


def test_parallel_tool_call_deltas():
    chunks, response, _ = run(TWO_CALLS)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert calls[2]["index"] == 1 and calls[2]["function"]["name"] == "get_weather" and calls[2]["id"] != calls[0]["id"]
    assert calls[3] == {"index": 1, "function": {"arguments": '{"city": "Rome"}'}}
    assert not any(d.get("content") for d in deltas), "whitespace between calls is not content"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    message = response["choices"][0]["message"]
    assert message["content"] is None and [json.loads(c["function"]["arguments"])["city"]
                                           for c in message["tool_calls"]] == ["Paris", "Rome"]
    assert response["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_stops_at_the_first_call():
    chunks, response, handle = run(TWO_CALLS, parallel_tool_calls=False)
    assert handle.cancelled
    assert len(response["choices"][0]["message"]["tool_calls"]) == 1
    assert response["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_content_and_raw_tokens():
    pieces = ["<think>", "\n", "Paris is", " the capital", "\n", "</think>", "\n\n", "Paris", "."]
    chunks, response, _ = run(pieces, tools=(), raw_tokens=True)
    message = response["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": "Paris is the capital"}
    raw = response["raw_tokens"]
    assert [t["channel"] for t in raw] == ["reasoning"] * 6 + ["content"] * 3 + ["special"]
    assert "".join(t["piece"] for t in raw) == "".join(pieces) + "<|im_end|>"
    assert response["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    keys = {"content", "reasoning_content", "role"}
    assert all(set(c["choices"][0]["delta"]) <= keys for c in chunks if c["choices"])


def test_logprobs_ride_on_the_chunks():
    chunks, response, _ = run(["Hel", "lo"], tools=(), logprobs=True)
    streamed = [lp for c in chunks if c["choices"] for lp in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [lp["token"] for lp in streamed] == ["Hel", "lo", "<|im_end|>"]
    assert response["choices"][0]["logprobs"]["content"] == streamed
    assert streamed[0]["top_logprobs"] == [{"token": "<100>", "logprob": -0.5, "bytes": list(b"<100>")}]


def test_invalid_call_is_content_and_finish_is_stop():
    bad = ['<tool_call>{"name": "rm", "arguments": {}}</tool_call>']
    _, response, _ = run(bad)
    assert response["choices"][0]["message"]["content"] == bad[0]
    assert response["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in response["choices"][0]["message"]


def test_prompt_ends_in_reasoning_only_when_the_last_turn_opens_think():
    assert ends_in_reasoning("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not ends_in_reasoning("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")
    assert not ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 enable_thinking=False
    assert ends_in_reasoning("a raw prompt <think> with no turns")
