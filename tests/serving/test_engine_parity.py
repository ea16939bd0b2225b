"""Greedy parity between kvtool's engine and --engine vllm on the same prompts (SmolLM2 and Qwen2.5, fp32).

Where the two first differ, the position must be an fp32 near-tie (the top two tokens within NEAR_TIE nats
on one engine): that is reported as a warning with the figures, never hidden; any other difference fails."""

from __future__ import annotations

import warnings

import httpx
import pytest

pytestmark = pytest.mark.real_model

NEAR_TIE = 0.02  # nats between the top two tokens: below it, float summation order can pick either
PROMPTS = [[{"role": "user", "content": "Name three colors."}],
           [{"role": "user", "content": "Write a haiku about the sea."}],
           [{"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"}],
           [{"role": "user", "content": "def fibonacci(n):"}]]


def greedy(base_url: str, messages, max_tokens: int = 24) -> list[tuple[str, float, float | None]]:
    """(token, its logprob, the gap to the runner-up) per generated token, greedy."""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 2}
    out = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=600).json()
    rows = []
    for entry in out["choices"][0]["logprobs"]["content"]:
        top = entry["top_logprobs"]
        rows.append((entry["token"], entry["logprob"], top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else None))
    return rows


@pytest.mark.parametrize("model", ["smol", "qwen"])
def test_greedy_tokens_match_between_engines(model, request):
    ours = request.getfixturevalue({"smol": "smol_server", "qwen": "qwen_server"}[model])
    theirs = request.getfixturevalue({"smol": "vllm_smol_server", "qwen": "vllm_qwen_server"}[model])
    ties, exact = [], 0
    for messages in PROMPTS:
        a, b = greedy(ours.base_url, messages), greedy(theirs.base_url, messages)
        tokens_a, tokens_b = [t for t, _, _ in a], [t for t, _, _ in b]
        if tokens_a == tokens_b:
            exact += 1
            worst = max(abs(x[1] - y[1]) for x, y in zip(a, b))
            assert worst < 0.05, f"same tokens, but a logprob differs by {worst:.4f} nats"
            continue
        i = next(i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y)
        gap = min(g for g in (a[i][2], b[i][2]) if g is not None)
        detail = (f"{model} {messages[-1]['content']!r}: first difference at token {i}: kvtool {tokens_a[i]!r} "
                  f"vs vLLM {tokens_b[i]!r}, top-2 gap {a[i][2]:.5f} / {b[i][2]:.5f} nats")
        assert gap < NEAR_TIE, "not a near-tie: " + detail
        ties.append(detail)
    for detail in ties:
        warnings.warn("fp32 near-tie between engines: " + detail)
    print(f"\n{model}: {exact}/{len(PROMPTS)} prompts token-identical; near-ties: {ties or 'none'}")
    assert exact >= len(PROMPTS) // 2, "most prompts should match token for token"
