"""Retries, backoff, circuit breaker and timeouts, on a fake clock (no real waiting)."""

import asyncio
import random

import pytest

from kvtool.agent.breaker import CircuitBreaker
from kvtool.agent.clock import FakeClock
from kvtool.agent.dispatch import ToolExecutor
from kvtool.agent.events import EventQueue
from kvtool.agent.jobs import JobManager
from kvtool.agent.output import OutputPager
from kvtool.agent.quota import CallCounter
from kvtool.agent.retry import RateLimited, RetryableToolError, RetryPolicy, is_retryable
from kvtool.agent.sealing import SealedCall
from kvtool.agent.tools import Tool, ToolRegistry

OBJ = {"type": "object", "properties": {}}


class Flaky:
    """Fails with `errors` in turn, then succeeds."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def executor(tools, clock, rng=None, **kw):
    return ToolExecutor(ToolRegistry(tools), clock, OutputPager(1000), CircuitBreaker(clock, **kw),
                        CallCounter(), JobManager(EventQueue(), clock), RetryPolicy(), timeout_s=5.0,
                        rng=rng or random.Random(0))


def call(name="t", i=0):
    return SealedCall(index=i, id=f"c{i}", name=name, arguments="{}")


def run(ex, c):
    return asyncio.run(ex.execute(c))


def test_backoff_is_full_jitter_from_1s_doubling_capped_at_60s():
    p = RetryPolicy()
    assert [p.ceiling(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    rng = random.Random(1)
    samples = [p.delay(3, rng) for _ in range(2000)]
    assert 0 <= min(samples) < 0.1 and 3.9 < max(samples) <= 4.0  # uniform over [0, 4]


def test_retryable_failure_retried_with_backoff_up_to_3_attempts():
    clock = FakeClock()
    flaky = Flaky([RateLimited("429 slow down"), RetryableToolError("upstream 503")])
    ex = executor([Tool("t", "", OBJ, flaky)], clock, rng=random.Random(7))
    result = run(ex, call())
    assert result.ok and result.attempts == 3 and flaky.calls == 3
    expected = random.Random(7)
    assert clock.sleeps == [expected.uniform(0, 1), expected.uniform(0, 2)]


def test_gives_up_after_3_attempts_with_a_clear_message():
    clock = FakeClock()
    flaky = Flaky([TimeoutError("read timed out")] * 5)
    result = run(executor([Tool("t", "", OBJ, flaky)], clock), call())
    assert not result.ok and flaky.calls == 3 and len(clock.sleeps) == 2
    assert result.content == "error: t failed after 3 attempts: TimeoutError: read timed out"


def test_non_retryable_failures_are_not_retried():
    clock = FakeClock()
    flaky = Flaky([PermissionError("401 unauthorized")])
    result = run(executor([Tool("t", "", OBJ, flaky)], clock), call())
    assert not result.ok and flaky.calls == 1 and clock.sleeps == []


@pytest.mark.parametrize("exc,retry", [
    (TimeoutError(), True), (ConnectionResetError(), True), (RateLimited("x"), True),
    (type("HTTP", (Exception,), {"status_code": 503})(), True), (type("HTTP", (Exception,), {"status_code": 429})(), True),
    (type("HTTP", (Exception,), {"status_code": 401})(), False), (ValueError("bad"), False), (KeyError("k"), False),
])
def test_retryable_classification(exc, retry):
    assert is_retryable(exc) is retry


def test_timeout_per_attempt_is_retryable():
    clock = FakeClock()
    attempts = []

    async def hang():
        attempts.append(1)
        await asyncio.sleep(3600)

    ex = executor([Tool("t", "", OBJ, hang, timeout_s=0.02)], clock)
    result = run(ex, call())
    assert result.error_kind == "timeout" and len(attempts) == 3 and len(clock.sleeps) == 2


def test_breaker_opens_after_3_failed_calls_then_half_opens_after_cooldown():
    clock = FakeClock()
    flaky = Flaky([ValueError("boom")] * 3)
    ex = executor([Tool("t", "", OBJ, flaky)], clock, threshold=3, cooldown_s=30)
    for i in range(3):
        assert run(ex, call(i=i)).error_kind == "failed"
    refused = run(ex, call(i=3))
    assert refused.error_kind == "circuit_open" and flaky.calls == 3
    assert "Route around it" in refused.content and "3 failures in a row" in refused.content
    clock.advance(29)
    assert run(ex, call(i=4)).error_kind == "circuit_open"
    clock.advance(1)  # cooldown over: one trial call goes through and succeeds
    assert run(ex, call(i=5)).ok and flaky.calls == 4
    assert ex.breaker.state("t") == "closed"


def test_failed_half_open_trial_reopens_the_breaker():
    clock = FakeClock()
    b = CircuitBreaker(clock, threshold=2, cooldown_s=10)
    b.record_failure("t")
    b.record_failure("t")
    assert b.state("t") == "open" and not b.allow("t")
    clock.advance(10)
    assert b.allow("t") and not b.allow("t")  # only one trial at a time
    b.record_failure("t")
    assert b.state("t") == "open" and b.retry_after("t") == 10


def test_validation_errors_do_not_count_against_the_breaker():
    clock = FakeClock()
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    ex = executor([Tool("t", "", schema, lambda x: x)], clock, threshold=2)
    for i in range(4):
        assert run(ex, call(i=i)).error_kind == "bad_arguments"
    assert ex.breaker.state("t") == "closed" and ex.breaker.failures("t") == 0
