"""Concurrent streaming clients against a live server: TTFT percentiles and corruption checks.

Each client loops for `seconds`, sending greedy streaming chat requests with one of a few
prompts. Every stream is checked chunk by chunk (one id, role first, one finish, usage,
[DONE]) and its text compared with a solo run of the same prompt: interleaved requests
must not see each other's tokens. A 429/503 counts as a clean rejection; any other
failure is an error.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = ["Name three colours.", "What is the capital of Italy?", "Say hello to a friend.", "Count from 1 to 5."]


@dataclass
class Result:
    prompt: int
    status: int = 0  # HTTP status; 0 = transport failure
    text: str = ""
    ttft_ms: float | None = None
    total_ms: float = 0.0
    tokens: int = 0
    problem: str = ""  # what was wrong with the stream, if anything


@dataclass
class LoadReport:
    clients: int
    seconds: float
    max_tokens: int
    requests: int = 0
    completed: int = 0
    rejected: int = 0  # 429 / 503
    server_errors: int = 0  # 5xx other than 503
    other_errors: int = 0  # 4xx other than 429, transport failures
    corrupted: int = 0  # malformed stream or text differs from the solo run
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_max_ms: float | None = None
    total_p50_ms: float | None = None
    tokens_per_s: float = 0.0  # completion tokens of all clients per wall second
    solo_ttft_ms: float | None = None  # baseline: median TTFT of lone requests
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return round(ordered[k], 1)


async def stream_once(client: httpx.AsyncClient, prompt: int, max_tokens: int, model: str | None = None) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[prompt]}], "stream": True,
            "temperature": 0, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    res, t0 = Result(prompt), time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.problem = (await resp.aread()).decode(errors="replace")[:200]
                return res
            ids, finishes, usage, done, first = set(), 0, None, False, True
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk or chunk.get("object") != "chat.completion.chunk":
                    res.problem = f"bad chunk {line[:120]}"
                    continue
                ids.add(chunk["id"])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    if first and delta.get("role") != "assistant":
                        res.problem = "first chunk has no role"
                    first = False
                    if delta.get("content") and res.ttft_ms is None:
                        res.ttft_ms = (time.perf_counter() - t0) * 1000.0
                    res.text += delta.get("content") or ""
                    finishes += choice["finish_reason"] is not None
            if not done or finishes != 1 or len(ids) != 1 or usage is None:
                shape = f"stream shape: done={done} finishes={finishes} ids={len(ids)} usage={usage}"
                res.problem = res.problem or shape
            res.tokens = (usage or {}).get("completion_tokens", 0)
    except httpx.HTTPError as exc:
        res.status, res.problem = 0, f"{type(exc).__name__}: {exc}"
    res.total_ms = (time.perf_counter() - t0) * 1000.0
    return res


async def run_load(base_url: str, clients: int = 16, seconds: float = 60.0, max_tokens: int = 16,
                   model: str | None = None, solo_runs: int = 1, api_key: str | None = None) -> LoadReport:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits,
                                 headers=headers) as client:
        reference, solo_ttft = {}, []
        for _ in range(solo_runs):  # the first pass is also the warm-up
            for p in range(min(clients, len(PROMPTS))):
                solo = await stream_once(client, p, max_tokens, model)
                if solo.status != 200 or solo.problem:
                    raise RuntimeError(f"solo request failed: {solo.status} {solo.problem}")
                reference[p] = solo.text
                solo_ttft.append(solo.ttft_ms or solo.total_ms)
        results: list[Result] = []
        deadline = time.perf_counter() + seconds

        async def one_client(k: int) -> None:
            while time.perf_counter() < deadline:
                res = await stream_once(client, k % len(reference), max_tokens, model)
                results.append(res)
                if res.status in (429, 503):
                    await asyncio.sleep(0.25)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(k) for k in range(clients)))
        wall = time.perf_counter() - t0
    return summarize(results, reference, clients, seconds, max_tokens, wall, solo_ttft)


def summarize(results: list[Result], reference: dict[int, str], clients: int, seconds: float, max_tokens: int,
              wall: float, solo_ttft: list[float]) -> LoadReport:
    rep = LoadReport(clients=clients, seconds=seconds, max_tokens=max_tokens, requests=len(results))
    ok = [r for r in results if r.status == 200]
    for r in results:
        if r.status in (429, 503):
            rep.rejected += 1
        elif r.status >= 500:
            rep.server_errors += 1
            rep.problems.append(f"{r.status}: {r.problem}")
        elif r.status != 200:
            rep.other_errors += 1
            rep.problems.append(f"{r.status}: {r.problem}")
        elif r.problem or r.text != reference[r.prompt]:
            rep.corrupted += 1
            rep.problems.append(r.problem or f"prompt {r.prompt}: {r.text!r} != solo {reference[r.prompt]!r}")
    rep.completed = len(ok) - rep.corrupted
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    rep.ttft_p50_ms, rep.ttft_p99_ms = percentile(ttfts, 50), percentile(ttfts, 99)
    rep.ttft_max_ms = round(max(ttfts), 1) if ttfts else None
    rep.total_p50_ms = percentile([r.total_ms for r in ok], 50)
    rep.tokens_per_s = round(sum(r.tokens for r in ok) / wall, 2) if wall else 0.0
    rep.solo_ttft_ms = round(statistics.median(solo_ttft), 1) if solo_ttft else None
    rep.problems = rep.problems[:10]
    return rep
