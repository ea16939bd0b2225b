"""The streaming output parser: same result at every chunk boundary; bad calls stay content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.serving.toolparse import TOOL_FORMATS, OutputParser, json_end, parse_json_calls

QWEN = TOOL_FORMATS["qwen"]
TOOLS = ("get_weather", "search")
CALL_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'


def parse(chunks, tools=TOOLS, **kw):
    """Feed chunks; return (channel, text-or-call) with adjacent texts of one channel merged."""
    p = OutputParser(tools, QWEN, **kw)
    events = [e for c in chunks for e in p.feed(c)] + p.finish()
    out = []
    for e in events:
        if e.call is not None:
            out.append(("tool_call", (e.call.name, json.loads(e.call.arguments))))
        elif out and out[-1][0] == e.channel:
            out[-1] = (e.channel, out[-1][1] + e.text)
        else:
            out.append((e.channel, e.text))
    return out


CASES = [
    ("plain text", "Hello there, friend.", [("content", "Hello there, friend.")]),
    ("one call", f"<tool_call>\n{CALL_PARIS}\n</tool_call>", [("tool_call", ("get_weather", {"city": "Paris"}))]),
    ("two calls", f"<tool_call>\n{CALL_PARIS}\n</tool_call>\n<tool_call>\n{CALL_ROME}\n</tool_call>",
     [("tool_call", ("get_weather", {"city": "Paris"})), ("tool_call", ("get_weather", {"city": "Rome"}))]),
    ("text around a call", f"Let me check.\n<tool_call>\n{CALL_PARIS}\n</tool_call>\nDone.",
     [("content", "Let me check."), ("tool_call", ("get_weather", {"city": "Paris"})), ("content", "\n\nDone.")]),
    ("reasoning then call", f"<think>\nI need the weather.\n</think>\n\n<tool_call>\n{CALL_PARIS}\n</tool_call>",
     [("reasoning", "I need the weather."), ("tool_call", ("get_weather", {"city": "Paris"}))]),
    ("reasoning then answer", "<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.",
     [("reasoning", "2+2 is 4."), ("content", "The answer is 4.")]),
    ("fenced json call", f"Sure:\n```json\n{CALL_PARIS}\n```",
     [("content", "Sure:"), ("tool_call", ("get_weather", {"city": "Paris"}))]),
    ("bare json call opening the answer", CALL_PARIS, [("tool_call", ("get_weather", {"city": "Paris"}))]),
    ("arguments as a JSON string", '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"kv\\"}"}</tool_call>',
     [("tool_call", ("search", {"q": "kv"}))]),
    ("list of calls", f"<tool_call>[{CALL_PARIS}, {CALL_ROME}]</tool_call>",
     [("tool_call", ("get_weather", {"city": "Paris"})), ("tool_call", ("get_weather", {"city": "Rome"}))]),
    ("unclosed call at the end", f"<tool_call>\n{CALL_PARIS}\n", [("tool_call", ("get_weather", {"city": "Paris"}))]),
    ("a python code block stays content", "Here:\n```python\nprint('{}')\n```\nok",
     [("content", "Here:\n```python\nprint('{}')\n```\nok")]),
    ("inline fence stays content", "use ```x``` here", [("content", "use ```x``` here")]),
]

BAD_CALLS = [
    ("undeclared tool", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
    ("invalid json", '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'),
    ("arguments not an object", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),
    ("no name", '<tool_call>{"arguments": {}}</tool_call>'),
    ("json that is no call", '{"answer": 4}'),
    ("fenced json that is no call", '```json\n{"answer": 4}\n```'),
    ("truncated call", '<tool_call>\n{"name": "get_weather", "argu'),
    ("stray close tag", "</tool_call> and </think> are just text"),
]


@pytest.mark.parametrize("name,text,expected", CASES, ids=[c[0] for c in CASES])
def test_cases_whole_and_split_at_every_boundary(name, text, expected):
    assert parse([text]) == expected
    assert parse(list(text)) == expected, "one character per chunk"
    for i in range(len(text) + 1):
        assert parse([text[:i], text[i:]]) == expected, f"split at {i}: {text[:i]!r} | {text[i:]!r}"


@pytest.mark.parametrize("name,text", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_stay_content_verbatim(name, text):
    for chunks in ([text], list(text)):
        out = parse(chunks)
        assert all(channel == "content" for channel, _ in out)
        assert "".join(t for _, t in out) == text


def test_no_declared_tools_means_no_calls():
    text = f"<tool_call>\n{CALL_PARIS}\n</tool_call>"
    assert parse([text], tools=()) == [("content", text)]


def test_generation_that_starts_inside_a_think_block():
    text = "The user wants 2+2.\n</think>\n\n4"
    for i in range(len(text) + 1):
        expected = [("reasoning", "The user wants 2+2."), ("content", "4")]
        assert parse([text[:i], text[i:]], in_reasoning=True) == expected
    assert parse(["still thinking"], in_reasoning=True) == [("reasoning", "still thinking")]


def test_prefill_for_a_named_tool_completes_to_a_call():
    prefix = QWEN.prefill("get_weather")
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    out = parse([prefix, '{"city": ', '"Oslo"}}\n', "</tool_call>"])
    assert out == [("tool_call", ("get_weather", {"city": "Oslo"}))]
    assert QWEN.prefill() == '<tool_call>\n{"name": "'


def test_last_channel_labels_each_token():
    p = OutputParser(TOOLS, QWEN)
    labels = []
    for piece in ["<think>", "hmm", "</think>", "\n\n", "Hi", "<tool_call>", CALL_PARIS, "</tool_call>"]:
        p.feed(piece)
        labels.append(p.last)
    assert labels == ["reasoning", "reasoning", "reasoning", "content", "content", "tool_call", "tool_call",
                      "tool_call"]


def test_registry_and_helpers():
    assert TOOL_FORMATS["hermes"] is QWEN
    assert parse_json_calls(f"{CALL_PARIS}, {CALL_ROME}", TOOLS)[1].name == "get_weather"
    assert parse_json_calls(CALL_PARIS, ("search",)) is None
    calls = parse_json_calls(f"{CALL_PARIS}\n{CALL_PARIS}", TOOLS)
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert json_end('{"a": "}\\"", "b": [1]} tail') == len('{"a": "}\\"", "b": [1]}')
    assert json_end('{"a": [') == -1


FRAGMENTS = st.sampled_from([
    "Hello", " world", "\n", "\n\n", " ", "<think>", "</think>", "<tool_call>", "</tool_call>", "```", "```json\n",
    CALL_PARIS, CALL_ROME, '{"name": "nope", "arguments": {}}', "{", "}", '"', "<", "</", "<tool", "json", ",",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(FRAGMENTS, max_size=12), st.data(), st.booleans())
def test_any_output_any_chunking_same_result(fragments, data, in_reasoning):
    text = "".join(fragments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(chunks, in_reasoning=in_reasoning) == parse([text], in_reasoning=in_reasoning)
