"""Selections, spans, roles/channels and the tool fallback: pure Python, no model."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.errors import InvalidParameterError
from kvtool.viz.inputs import chatml_tools_fallback, parse_conversation
from kvtool.viz.select import parse_heads, parse_indices, parse_rows
from kvtool.viz.tokens import ChannelTracker, Tokens, find_spans, tag_blocks

CHAT = ["<|im_start|>", "system", "\n", "Be brief.", "<|im_end|>", "\n", "<|im_start|>", "user", "\n",
        "Hi", " <", "agent_status", ">", "x: 1", "</", "agent_status", ">", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "<think>", "hmm", "</think>", "\n", "<tool_call>", '{"name": "f"}',
        "</tool_call>", "<|im_end|>", "\n", "<|im_start|>", "user", "\n", "<tool_response>", "ok",
        "</tool_response>", "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n", "Done", "."]


def chat_tokens(n_prompt=None):
    return Tokens(list(range(len(CHAT))), CHAT, len(CHAT) if n_prompt is None else n_prompt)


def test_parse_indices_forms():
    assert parse_indices("all", 5, "layer") == [0, 1, 2, 3, 4]
    assert parse_indices("0,-1", 5, "layer") == [0, 4]
    assert parse_indices("1:3", 5, "layer") == [1, 2]
    assert parse_indices("-2:", 5, "layer") == [3, 4]
    for bad in ("5", "-6", "x", "3:9", "4:2"):
        with pytest.raises(InvalidParameterError, match="layer|out of range|bad"):
            parse_indices(bad, 5, "layer")


@given(st.integers(1, 64), st.data())
def test_parse_indices_in_range_or_clear_error(n, data):
    i = data.draw(st.integers(-100, 100))
    try:
        out = parse_indices(str(i), n, "head")
    except InvalidParameterError as exc:
        assert not -n <= i < n and "out of range" in str(exc) and str(n) in str(exc)
    else:
        assert out == [i % n] and -n <= i < n


def test_parse_heads_and_rows():
    assert parse_heads("mean", 3) == ([0, 1, 2], "mean")
    assert parse_heads("1", 3) == ([1], None)
    t = chat_tokens(n_prompt=len(CHAT) - 2)
    assert parse_rows("last:2", t) == [len(CHAT) - 2, len(CHAT) - 1]
    assert parse_rows("generated", t) == [len(CHAT) - 2, len(CHAT) - 1]
    assert parse_rows("prompt-end", t) == [len(CHAT) - 3]
    with pytest.raises(InvalidParameterError, match="no reasoning tokens"):
        parse_rows("reasoning", t)
    with pytest.raises(InvalidParameterError, match="N must be"):
        parse_rows("last:0", t)


def test_roles_and_channels_follow_chatml():
    t = chat_tokens()
    by_piece = {p: (r, c) for p, r, c in zip(t.pieces, t.roles, t.channels)}
    assert by_piece["<|im_start|>"][1] == "special" and by_piece["<|im_end|>"][1] == "special"
    assert by_piece["Be brief."] == ("system", "content")
    assert by_piece["hmm"] == ("assistant", "reasoning")
    assert by_piece['{"name": "f"}'] == ("assistant", "tool_call")
    assert by_piece["ok"] == ("user", "tool_response")
    assert by_piece["Done"] == ("assistant", "content")
    assert t.channels[t.pieces.index("\n", 5)] == "special"  # newline between turns is template


def test_spans():
    t = chat_tokens()
    (a, b), = find_spans(t, "tag:agent_status")
    assert "".join(t.pieces[a:b]) == " <agent_status>x: 1</agent_status>"  # tags spread over several tokens
    assert find_spans(t, "<agent_status>") == [(a, b)]
    assert find_spans(t, "2:4") == [(2, 4)]
    assert find_spans(t, "channel:tool_call") == [(26, 29)]
    assert find_spans(t, "text:Done") == [(42, 43)]
    with pytest.raises(InvalidParameterError, match="matches no tokens"):
        find_spans(t, "tag:nothing")
    with pytest.raises(InvalidParameterError, match="unknown channel"):
        find_spans(t, "channel:bogus")


def test_tag_blocks_unclosed_runs_to_end():
    assert tag_blocks("a<think>b", "think") == [(1, 9)]


def test_channel_tracker_streams_reasoning_then_content():
    tr = ChannelTracker("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    pieces = ["<think>", "let", " me", "</think>", "\n", "Paris", "<tool_call>", "{}", "</tool_call>"]
    chans = [tr.feed(p) for p in pieces]
    assert chans[:4] == ["reasoning"] * 4 and chans[5] == "content" and chans[6:] == ["tool_call"] * 3


def test_tool_fallback_writes_qwen_style_blocks():
    msgs = [{"role": "user", "content": "call"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "content": "done"}]
    out = chatml_tools_fallback(msgs, [{"type": "function", "function": {"name": "f"}}])
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\ndone\n</tool_response>"}


def test_parse_conversation_errors():
    with pytest.raises(InvalidParameterError, match="non-empty list"):
        parse_conversation({"messages": []})
    with pytest.raises(InvalidParameterError, match="role"):
        parse_conversation([{"content": "x"}])
    msgs, tools = parse_conversation(json.loads('{"messages": [{"role": "user", "content": "x"}], "tools": []}'))
    assert msgs[0]["role"] == "user" and tools is None


def test_conversation_from_a_server_url(tmp_path):
    import http.server
    import threading

    from kvtool.viz.inputs import fetch_conversation

    (tmp_path / "conv.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [{"type": "function", "function": {"name": "f"}}]}))
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        messages, tools = fetch_conversation(f"{base}/conv.json")
        assert messages[0]["content"] == "hi" and tools[0]["function"]["name"] == "f"
        with pytest.raises(InvalidParameterError, match="could not fetch a conversation"):
            fetch_conversation(f"{base}/missing.json")
    finally:
        srv.shutdown()


def test_native_message_parses_openai_string_arguments():
    from kvtool.viz.inputs import native_message

    m = native_message({"role": "assistant", "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    assert m["content"] == "" and m["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        native_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]})
