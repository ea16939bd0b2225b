"""Position, needle and status-bar focus on Qwen2.5-Coder (real GGUF weights); SmolLM2 runs the
same experiments through the CLI in test_viz_cli.py."""

from pathlib import Path

import numpy as np
import pytest

from kvtool.viz.focus import focus, plot_focus, resolve_spans
from kvtool.viz.inputs import build_tokens, load_messages_file, prompt_ids
from kvtool.viz.needle import needle_experiment, needle_prompt, plot_needle, NEEDLES
from kvtool.viz.position import plot_position, position_stats
from kvtool.viz.select import parse_rows

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "status_bar"
SPANS = {"status": ["tag:agent_status"], "calls": ["channel:tool_call", "channel:tool_response"]}


def test_status_bar_focus_on_qwen25(qwen25, tmp_path):
    """The treatment context only (the control runs on SmolLM2 in the CLI test, to keep the suite short)."""
    messages, tools = load_messages_file(EXAMPLES / "treatment.json")
    tokens = build_tokens(qwen25, prompt_ids(qwen25, messages=messages, tools=tools))
    assert tokens.pieces.count("<tool_call>") == 7  # native tokens: 5 calls + 2 in the template's instructions
    res = focus(qwen25, tokens, resolve_spans(tokens, SPANS), parse_rows("last:1", tokens), label="treatment")
    summary = res.summary()
    status, calls = summary["status"], summary["calls"]
    assert status["per_token"] > calls["per_token"], summary
    assert len(calls["ranges"]) == 10  # five calls, five results; the system turn's example is not a call
    assert 0 < status["share"] < 1 and abs(status["rest"] + status["share"] - 1) < 1e-9
    assert res.strip.shape[0] == qwen25.spec.num_layers
    assert np.allclose(res.strip.sum(1), 1.0, atol=1e-4)  # each layer's row keeps its mass
    assert plot_focus([res], tmp_path / "focus.png").stat().st_size > 20_000


def test_position_buckets_and_needle_on_qwen25(qwen25, tmp_path):
    ids = qwen25.encode_rendered(needle_prompt(qwen25, 150, 0.5, NEEDLES[0], seed=3))
    res = position_stats(qwen25, ids, rows=list(range(4, len(ids))), n_buckets=8)
    record = res.to_json()
    assert abs(sum(record["by_position_mean"]) - 1) < 1e-4 and abs(sum(record["by_distance_mean"]) - 1) < 1e-4
    assert record["position_buckets"][-1][1] == len(ids)
    assert plot_position(res, tmp_path / "position.png").stat().st_size > 10_000
    needle = needle_experiment(qwen25, 150, [0.5], trials=1, progress=False)
    (depth,) = needle.per_depth()
    assert depth["n"] == 1 and 0 < depth["attention_on_needle"] < 1
    trial = needle.trials[0]
    assert len(trial["attention_on_needle_by_layer"]) == qwen25.spec.num_layers and trial["answer"]
    assert plot_needle(needle, tmp_path / "needle.svg").is_file()
