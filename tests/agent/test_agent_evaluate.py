"""The evaluation functions the lead runs on a real model, exercised on the fake endpoint."""

import json
import re

from kvtool.agent.demos.eval_cases import EVAL_CASES
from kvtool.agent.demos.evaluate import STATUS_BAR_TURNS, run_status_bar_cache_eval, run_tool_eval
from kvtool.agent.demos.script import reply
from kvtool.agent.status_bar import is_status_message

# the arguments a correct model would send for each case, keyed by prompt
GOOD_ARGS = [
    {"city": "Paris"}, {"city": "london"}, {"city": "Tokyo"}, {"city": "Cairo"}, {"city": "Sydney"},
    {"timezone": "Asia/Tokyo"}, {"timezone": "America/New_York"}, {"timezone": "UTC"},
    {"timezone": "Europe/Berlin"}, {"expression": "17*23"}, {"expression": "2**16"},
    {"expression": "sqrt(1764)"}, {"expression": "(125 + 375) / 4"}, {"expression": "0.15 * 240"},
    {"path": "notes.txt"}, {"path": "./data/config.json"}, {"path": "README.md"},
    {"items": ["buy milk", "call mom", "write report"]}, {"items": ["fix the bug", "write the tests"]},
    {"company": "Comcast", "message": "internet down"}, {"seconds": 5}, {"seconds": 1, "label": "build"},
]


def eval_model(wrong: set[int]):
    """A fake model: for case i, call the expected tool (with bad arguments if i in wrong)."""
    def respond(body):
        msgs = body["messages"]
        if msgs[-1]["role"] == "tool" or (is_status_message(msgs[-1]) and msgs[-2]["role"] == "tool"):
            return reply("Done.", delay_s=0)
        prompt = next(m["content"] for m in msgs if m["role"] == "user" and not is_status_message(m))
        i = next(i for i, c in enumerate(EVAL_CASES) if c.prompt == prompt)
        args = {"nonsense": True} if i in wrong else GOOD_ARGS[i]
        return reply(tool_calls=[(EVAL_CASES[i].tool, args)], delay_s=0)
    return respond


def test_at_least_20_cases_and_a_correct_model_scores_100(endpoint):
    assert len(EVAL_CASES) >= 20 and len(GOOD_ARGS) == len(EVAL_CASES)
    ep = endpoint(eval_model(set()))
    report = run_tool_eval(ep.base_url)
    assert [c.prompt for c in report.cases if not c.passed] == []
    assert report.success_rate == 1.0
    # the tools really ran: the file reader read the eval workspace
    tool_results = [m["content"] for r in ep.requests for m in r["messages"] if m["role"] == "tool"]
    assert any("Meeting moved to Thursday" in t for t in tool_results)


def test_wrong_arguments_lower_the_score(endpoint):
    ep = endpoint(eval_model({0, 9, 14}))
    report = run_tool_eval(ep.base_url, "fake-model")
    failed = [i for i, c in enumerate(report.cases) if not c.passed]
    assert failed == [0, 9, 14]
    assert report.success_rate == (len(EVAL_CASES) - 3) / len(EVAL_CASES)
    assert report.cases[0].calls == [{"name": "get_weather", "arguments": {"nonsense": True}}]


def status_model(body):
    """Answers each user turn with one tool call, then a short text."""
    msgs = [m for m in body["messages"] if not is_status_message(m)]
    if msgs[-1]["role"] == "tool":
        return reply("Done.")
    text = msgs[-1]["content"]
    if "TODO list" in text:
        return reply(tool_calls=[("rewrite_todo_list", {"items": ["weather", "math", "time"]})])
    if m := re.search(r"[Mm]ark item (\d)", text):
        return reply(tool_calls=[("update_todo_status", {"item_id": int(m.group(1)), "status": "completed"})])
    return reply("Summary: all done.")


def test_status_bar_cache_rates_per_placement(endpoint):
    ep = endpoint(status_model)
    rates = run_status_bar_cache_eval(ep.base_url, "fake-model")
    assert set(rates) == {"append", "replace"}
    assert rates["append"]["hit_rate"] > rates["replace"]["hit_rate"] > 0.3, json.dumps(rates)
    assert rates["append"]["messages"] > rates["replace"]["messages"]  # append grows the context
    assert rates["append"]["model_calls"] == rates["replace"]["model_calls"] == 2 * len(STATUS_BAR_TURNS) - 1
