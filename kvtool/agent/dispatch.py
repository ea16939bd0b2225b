"""Run one sealed tool call and turn every outcome into a tool message for the model.

Order of checks: known tool -> arguments (JSON + schema) -> call limits -> circuit
breaker -> permission tier -> run with timeout and retries. Each refusal or failure is
a clear result the model can act on; nothing raises out of execute() except
cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from kvtool.agent.breaker import CircuitBreaker
from kvtool.agent.clock import Clock
from kvtool.agent.jobs import JobManager, Progress
from kvtool.agent.output import OutputPager, Rendered, to_text
from kvtool.agent.quota import CallCounter
from kvtool.agent.retry import RetryPolicy, ToolError, is_retryable
from kvtool.agent.sealing import SealedCall
from kvtool.agent.tools import Tier, Tool, ToolContext, ToolRegistry
from kvtool.agent.validation import ArgumentError, parse_arguments

log = logging.getLogger("kvtool.agent")

_CANCEL_GRACE_S = 1.0  # a tool that ignores cancellation is abandoned after this


class _TimedOut(Exception):
    pass


Confirm = Callable[[Tool, dict], "bool | Awaitable[bool]"]


@dataclass
class ToolResult:
    call_id: str
    name: str
    content: str
    ok: bool
    error_kind: str | None = None  # unknown_tool|bad_arguments|limit|circuit_open|denied|failed|timeout|cancelled
    attempts: int = 0
    started_at: float | None = None  # perf_counter of the first attempt
    finished_at: float = field(default_factory=time.perf_counter)

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.content}


class ToolExecutor:
    def __init__(
        self,
        registry: ToolRegistry,
        clock: Clock,
        pager: OutputPager,
        breaker: CircuitBreaker,
        counter: CallCounter,
        jobs: JobManager,
        retry: RetryPolicy,
        timeout_s: float,
        rng: random.Random | None = None,
        confirm: Confirm | None = None,
        on_started: Callable[[SealedCall, float], None] | None = None,
    ):
        self.registry, self.clock, self.pager = registry, clock, pager
        self.breaker, self.counter, self.jobs = breaker, counter, jobs
        self.retry, self.timeout_s = retry, timeout_s
        self.rng = rng or random.Random()
        self.confirm = confirm  # None: non-interactive, destructive/external tools are denied
        self.on_started = on_started or (lambda call, t: None)
        self.audit: list[dict[str, Any]] = []  # every write/destructive/external call that ran
        self.last_error: str | None = None

    def _refuse(self, call: SealedCall, kind: str, text: str) -> ToolResult:
        self.last_error = f"{call.name or '?'}: {text}"
        return ToolResult(call.id, call.name, f"error: {text}", ok=False, error_kind=kind)

    async def execute(self, call: SealedCall) -> ToolResult:
        tool = self.registry.get(call.name)
        if tool is None:
            what = f"unknown tool {call.name!r}" if call.name else "the tool call has no function name"
            return self._refuse(call, "unknown_tool", f"{what}. Available tools: {', '.join(self.registry.names())}.")
        try:
            args = parse_arguments(tool, call.arguments)
        except ArgumentError as exc:
            return self._refuse(call, "bad_arguments", str(exc))
        if (why := self.counter.refusal(tool, args)) is not None:
            return self._refuse(call, "limit", why)
        if not self.breaker.allow(tool.name):
            return self._refuse(call, "circuit_open", (
                f"{tool.name} is temporarily disabled after {self.breaker.failures(tool.name)} failures in a row "
                f"(circuit open; retry after {self.breaker.retry_after(tool.name):.0f} s). "
                "Route around it: use another tool or continue without it."))
        if tool.tier.needs_confirmation and not await self._confirmed(tool, args):
            self.breaker.release_trial(tool.name)
            return self._refuse(call, "denied", (
                f"permission denied: {tool.name} is a {tool.tier.value} tool and "
                + ("the user declined it." if self.confirm else "this run is non-interactive (no one to confirm it).")
                + " Do not retry it; tell the user what you wanted to do."))
        if tool.tier.needs_confirmation and (why := self.counter.refusal(tool, args)) is not None:
            return self._refuse(call, "limit", why)  # a parallel call used the quota while we asked
        self.counter.record(tool, args)
        if tool.tier is not Tier.READ_ONLY:
            self.audit.append({"tool": tool.name, "tier": tool.tier.value, "args": args, "call_id": call.id})
            log.info("tool %s (%s) %s", tool.name, tool.tier.value, args)
        if tool.background:
            job = self.jobs.start(tool.name, args, lambda progress: self._run_for_job(call, tool, args, progress))
            self.on_started(call, time.perf_counter())
            return ToolResult(call.id, tool.name, (
                f"started background job {job.id} ({tool.name}). Its result will arrive as an event; "
                f"use job_status or cancel_job with task_id {job.id!r}."), ok=True, attempts=0)
        return await self.run(call, tool, args)

    async def _confirmed(self, tool: Tool, args: dict) -> bool:
        if self.confirm is None:
            return False
        answer = self.confirm(tool, args)
        return bool(await answer) if asyncio.iscoroutine(answer) else bool(answer)

    async def _run_for_job(self, call: SealedCall, tool: Tool, args: dict, progress: Progress) -> tuple[bool, str]:
        result = await self.run(call, tool, args, progress, announce=False)
        return result.ok, result.content

    async def run(
        self, call: SealedCall, tool: Tool, args: dict, progress: Progress | None = None, announce: bool = True
    ) -> ToolResult:
        """Attempts with timeout and backoff; only retryable failures get another try."""
        policy = tool.retry or self.retry
        timeout = tool.timeout_s or self.timeout_s
        ctx = ToolContext(call.id, tool.name, progress or (lambda fraction, note="": None))
        started = time.perf_counter()
        if announce:
            self.on_started(call, started)
        attempt, error, kind = 0, "", "failed"
        try:
            for attempt in range(1, policy.max_attempts + 1):
                try:
                    out = await self._attempt(tool, args, ctx, timeout)
                except _TimedOut:
                    error, kind, retryable = f"timed out after {timeout:g} s", "timeout", True
                except ToolError as exc:
                    error, kind, retryable = str(exc), "failed", exc.retryable
                except Exception as exc:  # a tool bug is the model's problem to route around, not ours to crash on
                    error, kind, retryable = f"{type(exc).__name__}: {exc}", "failed", is_retryable(exc)
                else:
                    self.breaker.record_success(tool.name)
                    text = out if isinstance(out, Rendered) else self.pager.render(call.id, tool.name, to_text(out))
                    return ToolResult(call.id, tool.name, text, ok=True, attempts=attempt, started_at=started)
                if not retryable or attempt == policy.max_attempts:
                    break
                await self.clock.sleep(policy.delay(attempt, self.rng))
        except asyncio.CancelledError:
            self.breaker.release_trial(tool.name)
            raise
        self.breaker.record_failure(tool.name)
        tries = f" after {attempt} attempts" if attempt > 1 else ""
        self.last_error = f"{tool.name}: {error}"
        return ToolResult(call.id, tool.name, f"error: {tool.name} failed{tries}: {error}", ok=False,
                          error_kind=kind, attempts=attempt, started_at=started)

    async def _attempt(self, tool: Tool, args: dict, ctx: ToolContext, timeout: float) -> Any:
        # not wait_for: a TimeoutError raised *by the tool* must stay distinguishable from ours
        task = asyncio.ensure_future(self._invoke(tool, args, ctx))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
            raise
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
            raise _TimedOut
        return task.result()

    @staticmethod
    async def _invoke(tool: Tool, args: dict, ctx: ToolContext) -> Any:
        kwargs = {**args, "ctx": ctx} if tool.takes_context else args
        if tool.is_async:
            return await tool.func(**kwargs)
        # sync tools run in a thread so a slow one neither blocks the stream nor its timeout
        return await asyncio.to_thread(tool.func, **kwargs)
