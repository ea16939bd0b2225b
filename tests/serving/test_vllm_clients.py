"""kvtool's own clients, unchanged, against `kvtool serve --engine vllm` on Qwen2.5-Coder: the agent completes a
tool-calling task, `kvtool bench batching --endpoint` load-tests it, and `kvtool bench ttft --endpoint` runs the
context-layout scenarios with cached-token shares that are vLLM's own prefix-cache hits (checked against vLLM's
`vllm:prefix_cache_hits_total` counter). One vLLM server for the module: the session's (tests/serving/conftest.py).
Skips where vLLM is not installed."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from kvtool.cli import main

pytestmark = pytest.mark.real_model

VLLM_BLOCK = 128  # vLLM's KV block size on CPU: its prefix cache reuses whole blocks


def vllm_cache_hits(base_url: str) -> float:
    """vLLM's own count of prompt tokens served from its prefix cache, from the server's /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    found = re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert len(found) == 1, f"expected one vllm:prefix_cache_hits_total line in /metrics, got {found}"
    return float(found[0])


def test_agent_completes_a_tool_task_on_vllm(vllm_qwen_server, tmp_path):
    from kvtool.agent import OpenAIHTTPBackend
    from kvtool.testing.agent import check_answered, run_weather_task

    before = vllm_cache_hits(vllm_qwen_server.base_url)
    backend = OpenAIHTTPBackend(vllm_qwen_server.base_url + "/v1")
    result, _ = run_weather_task(backend, tmp_path, status_bar="append", answer_on_last_iteration=True)
    check_answered(result)
    cached = [t.usage.cached_tokens for t in result.turns]
    # turn 2 repeats turn 1's system prompt, tools and question: vLLM reuses it in whole blocks
    assert len(result.turns) >= 2 and cached[1] > 0 and all(c % VLLM_BLOCK == 0 for c in cached), cached
    assert vllm_cache_hits(vllm_qwen_server.base_url) - before == sum(cached)


def test_bench_batching_endpoint_load_tests_vllm(vllm_qwen_server, tmp_path, capsys):
    out = tmp_path / "batching.json"
    code = main(["bench", "batching", "--model", "qwen25", "--endpoint", vllm_qwen_server.base_url + "/v1",
                 "--streams", "3", "--new-tokens", "5", "--prompt-tokens", "16", "--repeats", "1", "--no-baseline",
                 "--sequential-streams", "0", "--out", str(out)])
    record = json.loads(out.read_text())
    assert code == 0 and record["errors"] == {}
    assert record["endpoint"]["model"] == "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"
    served = record["results"]["endpoint"]
    assert (served["streams"], served["tokens"]) == (3, 15)  # ignore_eos reached vLLM: every stream ran to length
    assert served["tok_s"]["median"] > 0 and served["ttft_ms_p50"] > 0
    assert "endpoint" in capsys.readouterr().out


def test_bench_ttft_scenarios_report_vllm_prefix_cache_hits(vllm_qwen_server, tmp_path):
    out = tmp_path / "ttft.json"
    before = vllm_cache_hits(vllm_qwen_server.base_url)
    # ~400-token prompts: three 128-token blocks, so what a layout keeps shows up in vLLM's whole-block hits
    code = main(["bench", "ttft", "--endpoint", vllm_qwen_server.base_url, "--requests", "2",
                 "--policy-paragraphs", "1", "--tools", "2", "--window-turns", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    hits = vllm_cache_hits(vllm_qwen_server.base_url) - before
    assert code == 0 and record["isolation"] == "reset"  # POST /v1/cache/reset emptied vLLM's cache per scenario
    rows = {row["name"]: row for row in record["scenarios"]}
    results = [r for row in rows.values() for rep in row["results"] for r in rep]
    assert len(results) == 2 * len(rows) and all(r["cached_tokens"] % VLLM_BLOCK == 0 for r in results)
    # the warm-up prompt is shorter than one block, so every hit vLLM counted is in the scenarios' results
    assert sum(r["cached_tokens"] for r in results) == hits
    for row in rows.values():
        flat = [r for rep in row["results"] for r in rep]
        assert row["hit_rate"] == sum(r["cached_tokens"] for r in flat) / sum(r["prompt_tokens"] for r in flat)
        assert flat[0]["cached_tokens"] == 0  # each scenario starts from an empty cache
    shared = rows["shared-prefix"]
    assert shared["prompt_tokens_mean"] > 2 * VLLM_BLOCK and shared["hit_rate_after_first"] > 0.5
    assert rows["changed-prefix"]["hit_rate"] == 0.0  # a change at the start leaves nothing to reuse
