"""Evaluation against any OpenAI-compatible endpoint (kvtool serve, vLLM, llama.cpp).

`run_tool_eval`: a fixed list of tool-using prompts; a case passes when the agent calls
the expected tool with arguments that satisfy its check. `run_status_bar_cache_eval`:
one multi-turn conversation per status-bar placement; returns the prefix-cache hit rate
the server reported for each (usage.prompt_tokens_details.cached_tokens / prompt_tokens).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.tools import make_demo_tools
from kvtool.agent.demos.eval_cases import EVAL_CASES, WORKSPACE_FILES, EvalCase
from kvtool.agent.http_backend import OpenAIHTTPBackend
from kvtool.agent.loop import Agent


@dataclass
class CaseResult:
    prompt: str
    expected: str
    passed: bool
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"} the model made
    error: str | None = None


@dataclass
class EvalReport:
    cases: list[CaseResult]

    @property
    def success_rate(self) -> float:
        return sum(c.passed for c in self.cases) / len(self.cases) if self.cases else 0.0


def _write_workspace(root: Path) -> None:
    for rel, text in WORKSPACE_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _made_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        for c in m.get("tool_calls") or []:
            try:
                args = json.loads(c["function"]["arguments"])
            except json.JSONDecodeError:
                args = None
            out.append({"name": c["function"]["name"], "arguments": args})
    return out


async def evaluate_tool_use(
    base_url: str,
    model: str | None = None,
    api_key: str | None = None,
    cases: Sequence[EvalCase] = EVAL_CASES,
    config: AgentConfig | None = None,
) -> EvalReport:
    config = config or AgentConfig(max_iterations=4, wait_for_background=False, tool_timeout_s=10)
    backend = OpenAIHTTPBackend(base_url, model, api_key)
    if backend.model is None:
        backend.model = (await backend.list_models() or ["default"])[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtool-agent-eval-") as tmp:
        _write_workspace(Path(tmp))
        for case in cases:
            agent = Agent(backend, make_demo_tools(tmp, scale=0.01), replace(config, workdir=tmp))
            try:
                result = await agent.run(case.prompt)
                calls, error = _made_calls(result.messages), None
            except Exception as exc:  # one broken case must not hide the others' results
                calls, error = _made_calls(agent.messages), f"{type(exc).__name__}: {exc}"
            finally:
                await agent.aclose()
            passed = any(c["name"] == case.tool and isinstance(c["arguments"], dict) and case.check(c["arguments"])
                         for c in calls)
            results.append(CaseResult(case.prompt, f"{case.tool}({case.expect})", passed, calls, error))
    return EvalReport(results)


STATUS_BAR_TURNS = [
    "Make a TODO list with three items: check the weather in Paris, compute 12*7, check the time in Tokyo.",
    "Mark item 1 as in progress, then check the weather in Paris.",
    "Mark item 1 completed. Now compute 12*7 with the calculator.",
    "Mark item 2 completed and check the time in Tokyo (Asia/Tokyo).",
    "Mark item 3 completed. What is the weather in Tokyo?",
    "Summarise what you did in one sentence.",
]


async def status_bar_cache_rates(
    base_url: str,
    model: str | None = None,
    api_key: str | None = None,
    placements: Sequence[str] = ("append", "replace"),
    turns: Sequence[str] = STATUS_BAR_TURNS,
    config: AgentConfig | None = None,
) -> dict[str, dict[str, Any]]:
    """Per placement: hit_rate, prompt_tokens, cached_tokens, model_calls, final message count.
    Each placement gets its own session line at the top of the system prompt, so neither run
    reuses the other's cache and the comparison is fair."""
    backend = OpenAIHTTPBackend(base_url, model, api_key)
    if backend.model is None:
        backend.model = (await backend.list_models() or ["default"])[0]
    base = config or AgentConfig(max_iterations=6, wait_for_background=False, tool_timeout_s=10)
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtool-agent-cache-") as tmp:
        for placement in placements:
            cfg = replace(base, status_bar=placement, workdir=tmp,
                          system_prompt=f"Session {placement}-{uuid.uuid4().hex[:8]}.\n{base.system_prompt}")
            agent = Agent(backend, make_demo_tools(tmp, scale=0.01), cfg)
            try:
                all_turns = []
                for text in turns:
                    all_turns += (await agent.run(text)).turns
            finally:
                await agent.aclose()
            used = [t.usage for t in all_turns if t.usage and t.usage.cached_tokens is not None]
            prompt = sum(u.prompt_tokens for u in used)
            cached = sum(u.cached_tokens for u in used)
            out[placement] = {"hit_rate": cached / prompt if prompt else None, "prompt_tokens": prompt,
                              "cached_tokens": cached, "model_calls": len(all_turns),
                              "messages": len(agent.messages)}
    return out


def run_tool_eval(base_url: str, model: str | None = None, api_key: str | None = None, **kw: Any) -> EvalReport:
    return asyncio.run(evaluate_tool_use(base_url, model, api_key, **kw))


def run_status_bar_cache_eval(base_url: str, model: str | None = None, api_key: str | None = None,
                              **kw: Any) -> dict[str, dict[str, Any]]:
    return asyncio.run(status_bar_cache_rates(base_url, model, api_key, **kw))
