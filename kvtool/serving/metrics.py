"""Prometheus text exposition for `GET /metrics`, without a client library.

Counters and histograms are updated from the worker thread and the event loop, so every
update takes one lock. `extra` is a hook: a callable returning more exposition lines
(the prefix cache adds its queries/hits there).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from typing import Callable, Iterable

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        total = 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


def _gauge(name: str, help_: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]


def _counter(name: str, help_: str, values: dict[tuple, float], labels: tuple[str, ...]) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
    for key, value in sorted(values.items()):
        label = ",".join(f'{k}="{v}"' for k, v in zip(labels, key))
        out.append(f"{name}{{{label}}} {value}" if label else f"{name} {value}")
    return out


class ServerMetrics:
    def __init__(self, extra: Callable[[], Iterable[str]] | None = None):
        self.extra = extra
        self._lock = threading.Lock()
        self.http = Counter()  # (route, status) -> responses
        self.finish = Counter()  # (finish_reason,) -> generations
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.rejections = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def http_response(self, route: str, status: int) -> None:
        with self._lock:
            self.http[(route, status)] += 1

    def rejected(self) -> None:
        with self._lock:
            self.rejections += 1

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def finished(self, gen) -> None:
        with self._lock:
            self.finish[(gen.finish_reason or "abort",)] += 1
            self.prompt_tokens += len(gen.prompt_ids)
            self.cached_tokens += gen.timings.cached_tokens
            self.generation_tokens += len(gen.token_ids)

    def render(self, running: int, waiting: int, scheduler=None) -> str:
        """Exposition text; the scheduler's counters and KV gauges come from a BatchScheduler, when given."""
        with self._lock:
            lines = _counter("kvtool_http_responses_total", "HTTP responses by route and status.", dict(self.http),
                             ("route", "status"))
            lines += _counter("kvtool_requests_finished_total", "Generations finished, by finish reason.",
                              dict(self.finish), ("finish_reason",))
            lines += _counter("kvtool_prompt_tokens_total", "Prompt tokens of finished generations.",
                              {(): self.prompt_tokens}, ())
            lines += _counter("kvtool_prompt_cached_tokens_total", "Prompt tokens served from the prefix cache.",
                              {(): self.cached_tokens}, ())
            lines += _counter("kvtool_generation_tokens_total", "Generated tokens.", {(): self.generation_tokens}, ())
            lines += _counter("kvtool_requests_rejected_total", "Requests refused with 429 (queue full).",
                              {(): self.rejections}, ())
            lines += self.ttft.lines("kvtool_time_to_first_token_seconds",
                                     "Request arrival to first token, queue time included.")
            lines += self.itl.lines("kvtool_inter_token_latency_seconds", "Time between consecutive tokens.")
        lines += _gauge("kvtool_requests_running", "Generations being stepped now.", running)
        lines += _gauge("kvtool_requests_waiting", "Requests queued for a slot.", waiting)
        if scheduler is not None:
            lines += _counter("kvtool_scheduler_steps_total", "Batched forward steps.", {(): scheduler.steps}, ())
            lines += _counter("kvtool_scheduler_host_seconds_total", "Time steps spent outside the forward and the "
                              "token read (scheduling, detokenizing, handing tokens out).", {(): scheduler.host_s}, ())
            lines += _counter("kvtool_scheduler_preemptions_total", "Running requests whose KV was dropped to stay "
                              "inside the KV budget (recomputed when readmitted).", {(): scheduler.preemptions}, ())
            lines += _gauge("kvtool_kv_tokens_in_use", "Tokens of KV held by running requests (and copies for "
                            "sibling choices).", scheduler.kv_in_use)
            if scheduler.kv_budget_tokens is not None:
                lines += _gauge("kvtool_kv_budget_tokens", "The KV budget of running requests, in tokens.",
                                scheduler.kv_budget_tokens)
        if self.extra is not None:
            lines += [str(line) for line in self.extra()]
        return "\n".join(lines) + "\n"
