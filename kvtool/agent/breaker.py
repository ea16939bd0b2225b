"""Per-tool circuit breaker: stop calling a tool that keeps failing, try again later.

closed --(threshold consecutive failed calls)--> open --(cooldown)--> half_open
half_open lets one call through: success closes the breaker, failure re-opens it.
A failed call counts once, after its retries; bad arguments are the model's fault
and do not count.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.agent.clock import Clock


@dataclass
class _State:
    failures: int = 0
    opened_at: float | None = None
    trial_running: bool = False


class CircuitBreaker:
    def __init__(self, clock: Clock, threshold: int = 3, cooldown_s: float = 30.0):
        self.clock = clock
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._tools: dict[str, _State] = {}

    def state(self, tool: str) -> str:
        st = self._tools.get(tool)
        if st is None or st.opened_at is None:
            return "closed"
        if self.clock.monotonic() - st.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allow(self, tool: str) -> bool:
        """True if a call may run now; in half_open only one trial at a time."""
        state = self.state(tool)
        if state == "closed":
            return True
        st = self._tools[tool]
        if state == "half_open" and not st.trial_running:
            st.trial_running = True
            return True
        return False

    def retry_after(self, tool: str) -> float:
        st = self._tools.get(tool)
        if st is None or st.opened_at is None:
            return 0.0
        return max(0.0, st.opened_at + self.cooldown_s - self.clock.monotonic())

    def record_success(self, tool: str) -> None:
        self._tools[tool] = _State()

    def record_failure(self, tool: str) -> None:
        st = self._tools.setdefault(tool, _State())
        st.failures += 1
        st.trial_running = False
        if st.opened_at is not None or st.failures >= self.threshold:
            st.opened_at = self.clock.monotonic()

    def release_trial(self, tool: str) -> None:
        """A half-open trial that ended without a verdict (cancelled) frees the slot."""
        st = self._tools.get(tool)
        if st is not None:
            st.trial_running = False

    def failures(self, tool: str) -> int:
        st = self._tools.get(tool)
        return st.failures if st else 0
