"""One model turn: stream the reply and dispatch each tool call the moment it is sealed.

Calls run concurrently unless a tool is marked not concurrent-safe: such a call waits
for every earlier call of the turn, and later calls wait for it. Results are returned in
call order whatever order they finish in. If the turn is cancelled (urgent event), the
partial state stays on the Turn so the agent can write placeholder results.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from kvtool.agent.backend import ChatBackend
from kvtool.agent.dispatch import ToolExecutor, ToolResult
from kvtool.agent.observer import Observer
from kvtool.agent.sealing import CallAssembler, SealedCall
from kvtool.agent.turn_record import CallRecord, Turn


async def run_turn(
    turn: Turn,
    backend: ChatBackend,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    sampling: dict[str, Any],
    executor: ToolExecutor,
    observer: Observer,
    taken_ids: set[str] | None = None,
) -> Turn:
    assembler = CallAssembler(id_prefix=f"call_{turn.index}", taken=taken_ids)
    barrier: asyncio.Task | None = None  # the latest non-concurrent call

    async def execute_after(deps: list[asyncio.Task], record: CallRecord) -> ToolResult:
        if deps:
            await asyncio.wait(deps)
        record.result = await executor.execute(record.call)
        observer.tool_finished(record.call, record.result)
        return record.result

    def dispatch(call: SealedCall) -> None:
        nonlocal barrier
        observer.tool_sealed(call)
        tool = executor.registry.get(call.name)
        exclusive = tool is not None and not tool.concurrent_safe
        deps = [r.task for r in turn.calls if not r.task.done()] if exclusive else [barrier] if barrier else []
        record = CallRecord(call, task=None)  # type: ignore[arg-type]  # set just below
        record.task = asyncio.create_task(execute_after([d for d in deps if not d.done()], record))
        turn.calls.append(record)
        if exclusive:
            barrier = record.task

    stream = backend.stream(messages, tools, **sampling)
    try:
        async with contextlib.aclosing(stream):
            async for delta in stream:
                turn.t_first_delta = turn.t_first_delta or time.perf_counter()
                if delta.reasoning:
                    turn.reasoning += delta.reasoning
                    observer.reasoning(delta.reasoning)
                if delta.content:
                    turn.content += delta.content
                    observer.content(delta.content)
                turn.finish_reason = delta.finish_reason or turn.finish_reason
                turn.usage = delta.usage or turn.usage
                for call in assembler.feed(delta):
                    dispatch(call)
        for call in assembler.finish():
            dispatch(call)
        for index, text in assembler.late_fragments.items():
            turn.warnings.append(f"call {index}: {len(text)} characters arrived after its arguments were complete "
                                 f"and were not used: {text[:80]!r}")
        turn.t_stream_end = time.perf_counter()
        if turn.calls:
            await asyncio.wait([r.task for r in turn.calls])
    except BaseException:
        # cancelled (urgent event) or the stream failed: stop every tool of this turn
        for r in turn.calls:
            r.task.cancel()
        if turn.calls:
            await asyncio.gather(*(r.task for r in turn.calls), return_exceptions=True)
        raise
    finally:
        turn.t_end = time.perf_counter()
    return turn
