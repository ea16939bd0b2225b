"""Several choices in one response (n > 1, or a completion with several prompts), as OpenAI returns them.

Each choice is its own session (ChatSession / CompletionSession) with its index. Streaming merges
their chunks in the order they are made, holds back each choice's usage chunk and ends with one
usage chunk for the whole request; the non-streaming response lists every choice. Usage counts
each prompt once and the completion tokens of every choice, as vLLM does. `sse` frames any stream of events
(these chunks, the raw token stream, the inspector's) for the wire.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator


def merge_usage(usages: list[dict], n: int) -> dict:
    """One usage for choices p * n + i (choice i of prompt p): prompt tokens once per prompt."""
    prompts = usages[::n]
    prompt_tokens = sum(u["prompt_tokens"] for u in prompts)
    completion = sum(u["completion_tokens"] for u in usages)
    details: dict = {}
    for u in prompts:
        for key, value in u.get("prompt_tokens_details", {}).items():
            details[key] = details.get(key, 0) + value
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": details}
    reasoning = [u["completion_tokens_details"]["reasoning_tokens"] for u in usages if "completion_tokens_details" in u]
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return out


async def merged_chunks(sessions: list, n: int) -> AsyncIterator[dict]:
    """Every session's chunks as they come; an error chunk from any ends the stream; one usage chunk last."""
    if len(sessions) == 1:
        async for chunk in sessions[0].chunks():
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, session) -> None:
        try:
            async for chunk in session.chunks():
                queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))
        except Exception as exc:  # not a stream error chunk (those the sessions make themselves): re-raised below
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sessions)]
    usage_chunks: list = [None] * len(sessions)
    try:
        open_streams = len(sessions)
        while open_streams:
            i, chunk = await queue.get()
            if chunk is None:
                open_streams -= 1
            elif isinstance(chunk, Exception):
                raise chunk
            elif "error" in chunk:
                yield chunk
                return
            elif not chunk["choices"] and "usage" in chunk:
                usage_chunks[i] = chunk
            else:
                yield chunk
        yield {**usage_chunks[0], "usage": merge_usage([c["usage"] for c in usage_chunks], n)}
    finally:
        for task in tasks:
            task.cancel()


async def merged_response(sessions: list, n: int) -> dict:
    """The non-streaming response with every choice; each keeps its own timings (and raw tokens)."""
    results = await asyncio.gather(*(s.response() for s in sessions))
    if len(results) == 1:
        return results[0]
    out = dict(results[0])
    out["choices"] = []
    for result in results:
        choice = dict(result["choices"][0], timings=result["timings"])
        if "raw_tokens" in result:
            choice["raw_tokens"] = result["raw_tokens"]
        out["choices"].append(choice)
    out.pop("raw_tokens", None)
    out["usage"] = merge_usage([r["usage"] for r in results], n)
    return out


def sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse(chunks, handle, include_usage: bool):
    """SSE framing; the usage chunk only when asked; closing early (client gone) cancels generation."""
    try:
        async for chunk in chunks:
            if "choices" in chunk:  # an OpenAI chunk (the raw token stream sends plain events)
                if not chunk["choices"] and "usage" in chunk and not include_usage:
                    continue
                if include_usage:
                    chunk.setdefault("usage", None)
            yield sse_line(chunk)
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()
