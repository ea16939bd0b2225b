"""Background jobs: a long tool returns a task id at once; its result arrives as an event.

`job_status` and `cancel_job` let the model act on the id while it keeps working.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from kvtool.agent.clock import Clock
from kvtool.agent.events import Event, EventQueue
from kvtool.agent.retry import ToolInputError
from kvtool.agent.tools import Tool

Progress = Callable[[float, str], None]
JobRunner = Callable[[Progress], Awaitable[tuple[bool, str]]]  # -> (ok, content for the model)


@dataclass
class Job:
    id: str
    tool: str
    args: dict[str, Any]
    started: float
    state: str = "running"  # running | completed | failed | cancelled
    progress: float | None = None
    note: str = ""
    finished: float | None = None
    result: str | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    def summary(self, now: float) -> str:
        elapsed = (self.finished or now) - self.started
        pct = "" if self.progress is None else f" {self.progress:.0%}"
        note = f" ({self.note})" if self.note else ""
        return f"{self.id} {self.tool}: {self.state}{pct} after {elapsed:.1f} s{note}"


class JobManager:
    def __init__(self, events: EventQueue, clock: Clock):
        self.events = events
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)

    def start(self, tool: str, args: dict[str, Any], run: JobRunner) -> Job:
        job = Job(id=f"job-{next(self._ids)}", tool=tool, args=args, started=self.clock.monotonic())

        def progress(fraction: float, note: str = "") -> None:
            job.progress, job.note = max(0.0, min(1.0, fraction)), note

        async def body() -> None:
            ok, content = await run(progress)
            job.state = "completed" if ok else "failed"
            job.finished, job.result = self.clock.monotonic(), content
            if ok:
                job.progress = 1.0
            self.events.put(Event("job_done", f"{job.summary(job.finished)}. Result:\n{content}", source=job.id))

        job.task = asyncio.create_task(body())
        self.jobs[job.id] = job
        return job

    def running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state == "running"]

    def _get(self, task_id: str) -> Job:
        job = self.jobs.get(task_id)
        if job is None:
            known = ", ".join(self.jobs) or "none started yet"
            raise ToolInputError(f"no background job {task_id!r} (known: {known})")
        return job

    def status(self, task_id: str) -> str:
        job = self._get(task_id)
        text = job.summary(self.clock.monotonic())
        return text + (f". Result:\n{job.result}" if job.result is not None else "")

    def cancel(self, task_id: str) -> str:
        job = self._get(task_id)
        if job.state != "running":
            return f"{job.id} is already {job.state}; nothing to cancel"
        job.task.cancel()
        job.state, job.finished = "cancelled", self.clock.monotonic()
        return f"cancelled {job.summary(job.finished)}"

    def cancel_all(self) -> None:
        for job in self.running():
            self.cancel(job.id)

    def tools(self) -> list[Tool]:
        schema = {
            "type": "object",
            "properties": {"task_id": {"type": "string", "description": "id like job-1"}},
            "required": ["task_id"],
        }

        async def job_status(task_id: str) -> str:
            return self.status(task_id)

        async def cancel_job(task_id: str) -> str:  # async: cancels tasks on this loop
            return self.cancel(task_id)

        return [
            Tool("job_status", "State, progress and (when done) result of a background job.", schema, job_status),
            Tool("cancel_job", "Cancel a running background job.", schema, cancel_job),
        ]
