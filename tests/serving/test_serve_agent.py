"""The agent end to end through `kvtool serve` on the real Qwen2.5-Coder GGUF: streamed tool calls over HTTP,
a real tool run, the result sent back, a final answer, and the server's prefix cache reported per turn."""

import pytest

from kvtool.agent import OpenAIHTTPBackend
from kvtool.testing.agent import check_answered, run_weather_task

pytestmark = pytest.mark.real_model


def test_agent_through_kvtool_serve_calls_the_tool_and_answers(qwen_server, tmp_path):
    backend = OpenAIHTTPBackend(qwen_server.base_url + "/v1")
    result, _ = run_weather_task(backend, tmp_path, status_bar="append", answer_on_last_iteration=True)
    check_answered(result)
    assert len(result.turns) >= 2 and result.turns[1].usage.cached_tokens > 0  # turn 2 reuses turn 1's prefix
