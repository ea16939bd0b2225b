"""Which tool failures are worth retrying, and how long to wait between attempts."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtool.config import is_whole
from kvtool.errors import KvtoolError


class ToolError(Exception):
    """Raised by a tool; the message goes back to the model verbatim."""

    retryable = False


class ToolInputError(ToolError):
    """The arguments made sense to the schema but not to the tool (no such file, ...)."""


class RetryableToolError(ToolError):
    """Transient: worth another attempt (timeout, rate limit, upstream 5xx)."""

    retryable = True


class RateLimited(RetryableToolError):
    pass


class ToolTimeout(RetryableToolError):
    pass


class PermissionDenied(KvtoolError):
    pass


def is_retryable(exc: BaseException) -> bool:
    """Timeouts, rate limits and 5xx-like failures; never validation or auth errors."""
    if isinstance(exc, ToolError):
        return exc.retryable
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    if isinstance(status, int):
        return status == 429 or status >= 500
    return bool(getattr(exc, "retryable", False))


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # attempts in total, the first one included
    base_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 60.0

    def __post_init__(self) -> None:
        if not is_whole(self.max_attempts, 1):
            raise KvtoolError(f"RetryPolicy max_attempts must be an integer >= 1 (the first attempt counts), got "
                              f"{self.max_attempts!r}")
        for name, low in (("base_s", 0.0), ("factor", 1.0), ("cap_s", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < float("inf"):
                raise KvtoolError(f"RetryPolicy {name} must be a finite number >= {low:g}, got {value!r}")

    def ceiling(self, retry: int) -> float:
        """Upper bound of the wait before retry number `retry` (1-based)."""
        return min(self.cap_s, self.base_s * self.factor ** (retry - 1))

    def delay(self, retry: int, rng: random.Random) -> float:
        # full jitter: uniform in [0, ceiling] de-synchronises clients that failed together
        return rng.uniform(0.0, self.ceiling(retry))


NO_RETRY = RetryPolicy(max_attempts=1)
