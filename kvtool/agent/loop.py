"""The agent loop: model turn -> tools -> safe point (events, status bar) -> model turn.

Every committed assistant message with tool calls is followed by exactly one tool
message per call, in call order, even when the turn was interrupted: that is the
invariant `trajectory.check_messages` tests after every scenario.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
from dataclasses import dataclass
from typing import Any

from kvtool.agent.backend import BackendError, ChatBackend
from kvtool.agent.breaker import CircuitBreaker
from kvtool.agent.clock import Clock, RealClock
from kvtool.agent.config import AgentConfig
from kvtool.agent.dispatch import Confirm, ToolExecutor
from kvtool.agent.events import Event, EventQueue, format_batch, user_message
from kvtool.agent.jobs import JobManager
from kvtool.agent.observer import Observer
from kvtool.agent.output import PAGE_TOOL, OutputPager
from kvtool.agent.quota import CallCounter
from kvtool.agent.sealing import SealedCall
from kvtool.agent.status_bar import PLACEMENTS, StatusSnapshot, render_status
from kvtool.agent.timers import Timers
from kvtool.agent.todo import TodoList
from kvtool.agent.tools import Tool, ToolRegistry
from kvtool.agent.turn import Turn, run_turn
from kvtool.errors import InvalidParameterError


@dataclass
class AgentResult:
    messages: list[dict[str, Any]]
    final_text: str
    stop_reason: str  # done | max_iterations
    turns: list[Turn]

    @property
    def cache_hit_rate(self) -> float | None:
        """cached / prompt tokens over the model calls whose server reported cache hits."""
        used = [t.usage for t in self.turns if t.usage and t.usage.cached_tokens is not None]
        prompt = sum(u.prompt_tokens for u in used)
        return sum(u.cached_tokens for u in used) / prompt if prompt else None


class Agent:
    def __init__(
        self,
        backend: ChatBackend,
        tools: ToolRegistry | list[Tool] | None = None,
        config: AgentConfig | None = None,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        confirm: Confirm | None = None,
        observer: Observer | None = None,
    ):
        self.config = (config or AgentConfig()).validate()
        if tools is not None and not isinstance(tools, (ToolRegistry, list, tuple)):
            raise InvalidParameterError(f"tools must be a list of Tool objects or a ToolRegistry; got "
                                        f"{type(tools).__name__}")
        self.backend = backend
        if hasattr(backend, "check_sampling"):  # a backend that knows its sampling fields checks them now
            backend.check_sampling(self.config.sampling)
        self.clock = clock or RealClock()
        self.rng = rng or random.Random()
        self.observer = observer or Observer()
        self.events = EventQueue()
        self.jobs = JobManager(self.events, self.clock)
        self.timers = Timers(self.events, self.clock)
        self.todo = TodoList()
        self.pager = OutputPager(self.config.tool_output_chars)
        self.counter = CallCounter()
        self.registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(list(tools or []))
        if self.config.builtin_tools:
            self._add_builtins()
        self.executor = ToolExecutor(
            self.registry, self.clock, self.pager,
            CircuitBreaker(self.clock, self.config.breaker_threshold, self.config.breaker_cooldown_s),
            self.counter, self.jobs, self.config.retry, self.config.tool_timeout_s,
            rng=self.rng, confirm=confirm, on_started=self._started,
        )
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": self.config.system_prompt}]
        self.turns: list[Turn] = []
        self.started_at = self.clock.monotonic()
        self._turn: Turn | None = None
        self._call_ids: set[str] = set()

    def _add_builtins(self) -> None:
        async def read_output_page(ref: str, page: int) -> str:
            return self.pager.read_page(ref, page)

        builtins = [*self.todo.tools(), *self.timers.tools(), *self.jobs.tools(), Tool(
            PAGE_TOOL, "Read another page of a tool output that was truncated.",
            {"type": "object", "properties": {"ref": {"type": "string"}, "page": {"type": "integer", "minimum": 1}},
             "required": ["ref", "page"]},
            read_output_page)]
        for tool in builtins:
            if tool.name not in self.registry:  # a caller's own version wins
                self.registry.add(tool)

    # -- events ---------------------------------------------------------------------------
    def submit(self, event: Event) -> None:
        self.events.put(event)

    def interrupt(self, text: str) -> None:
        """An urgent user message: cancels the current stream and tools."""
        self.events.put(user_message(text, urgent=True))

    def _absorb_events(self, interrupted: bool = False) -> bool:
        events = self.events.drain()
        if not events:
            return False
        self.observer.events_absorbed(events, interrupted)
        if len(events) == 1 and events[0].kind == "user" and not interrupted:
            text = events[0].text  # a plain user turn stays a plain user turn
        else:
            text = format_batch(events, interrupted)
        self.messages.append({"role": "user", "content": text})
        return True

    # -- status bar -----------------------------------------------------------------------
    def status_snapshot(self) -> StatusSnapshot:
        now = self.clock.monotonic()
        return StatusSnapshot(
            now=self.clock.now(), elapsed_s=now - self.started_at, call_lines=self.counter.lines(),
            todo_lines=self.todo.lines(), job_lines=[j.summary(now) for j in self.jobs.running()],
            cwd=self.config.workdir or os.getcwd(), os=f"{platform.system()} {platform.release()}",
            last_error=self.executor.last_error,
        )

    def _apply_status(self) -> None:
        if self.config.status_bar != "off":
            text = render_status(self.status_snapshot(), self.config.status_fields)
            PLACEMENTS[self.config.status_bar](self.messages, text)

    # -- turns ----------------------------------------------------------------------------
    def _started(self, call: SealedCall, t: float) -> None:
        record = self._turn.record(call.id) if self._turn else None
        if record is not None:
            record.started_at = t
        self.observer.tool_started(call, t)

    def _commit(self, turn: Turn) -> None:
        if turn.content or turn.calls:
            self.messages.append(turn.assistant_message())
            self.messages.extend(turn.tool_messages())
        self.turns.append(turn)
        self.observer.turn_finished(turn)

    async def _model_turn(self, offer_tools: bool = True) -> Turn:
        self._apply_status()
        policy = self.config.retry
        for attempt in range(1, policy.max_attempts + 1):
            turn = self._turn = Turn(index=len(self.turns))
            self.observer.turn_started(turn)
            work = asyncio.create_task(run_turn(
                turn, self.backend, list(self.messages), self.registry.openai_schemas() if offer_tools else [],
                self.config.sampling, self.executor, self.observer, self._call_ids))
            urgent = asyncio.create_task(self.events.wait_urgent())
            try:
                await asyncio.wait({work, urgent}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # our caller was cancelled: take the stream and tools down too
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise
            finally:
                urgent.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                turn.interrupted = True
                self._commit(turn)
                self._absorb_events(interrupted=True)
                return turn
            exc = work.exception()
            if exc is None:
                self._commit(turn)
                return turn
            if not (isinstance(exc, BackendError) and exc.retryable) or attempt == policy.max_attempts:
                raise exc
            delay = policy.delay(attempt, self.rng)
            self.observer.retrying_model(exc, delay)
            await self.clock.sleep(delay)
            if turn.content or turn.calls:
                # tools may already have acted: keep what happened (placeholders for the rest),
                # like an interrupt, and let the model continue from there
                turn.interrupted = True
                turn.warnings.append(f"the stream failed part-way ({exc}); kept the partial reply")
                self._commit(turn)
                return turn
        raise AssertionError("unreachable")

    async def run(self, user_text: str | None = None) -> AgentResult:
        """Run until the model answers without tool calls and nothing is pending."""
        if user_text is not None:
            if not isinstance(user_text, str):
                raise InvalidParameterError(f"run() takes the user's text (a str) or None; got "
                                            f"{type(user_text).__name__}")
            self.events.put(user_message(user_text))
        stop_reason, turns_before = "max_iterations", len(self.turns)
        for i in range(self.config.max_iterations):
            self._absorb_events()
            last = i == self.config.max_iterations - 1 and i > 0 and self.config.answer_on_last_iteration
            turn = await self._model_turn(offer_tools=not last)
            if turn.interrupted or turn.calls:
                continue
            pending = self.jobs.running() or self.timers.pending()
            if len(self.events) or (self.config.wait_for_background and pending):
                await self.events.wait()
                continue
            stop_reason = "done"
            break
        turns = self.turns[turns_before:]
        final = next((t.content for t in reversed(turns) if t.content and not t.calls), "")
        return AgentResult(self.messages, final, stop_reason, turns)

    async def aclose(self) -> None:
        """Cancel background jobs and timers (a run may end while they still go)."""
        self.jobs.cancel_all()
        self.timers.cancel_all()
        await asyncio.sleep(0)
