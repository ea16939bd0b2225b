"""Time as an injectable dependency, so backoff and breaker tests need no real sleeps."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(timezone.utc).astimezone()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FakeClock:
    """Virtual time: sleep() advances it instantly and records the requested delay."""

    def __init__(self, start: float = 0.0, wall: datetime | None = None):
        self.t = start
        self.sleeps: list[float] = []
        self._wall0 = wall or datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
        self._t0 = start

    def monotonic(self) -> float:
        return self.t

    def now(self) -> datetime:
        return self._wall0 + timedelta(seconds=self.t - self._t0)

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)  # still yield, as a real sleep would
