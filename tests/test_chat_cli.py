"""`kvtool chat` on the real SmolLM2: turns reuse the conversation's KV, commands, errors that keep the
chat going, and --cache-file across sessions."""

from __future__ import annotations

import io
import re

import pytest

from kvtool.cli import main
from kvtool.testing.models import smollm2_gguf

pytestmark = pytest.mark.real_model


def chat(monkeypatch, capsys, lines, *extra):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    argv = ["chat", "--model", str(smollm2_gguf()), "--temperature", "0", "--max-tokens", "12", *extra]
    assert main(argv) == 0
    out = capsys.readouterr()
    turns = [(int(a), int(b)) for a, b in re.findall(r"cached (\d+) of (\d+) prompt tokens", out.err)]
    return out, turns


def test_each_turn_reuses_the_conversation_so_far(monkeypatch, capsys):
    out, turns = chat(monkeypatch, capsys, ["What is the capital of France?", "/stats", "Tell me more about it.",
                                            "/bogus", "/reset", "What is the capital of France?", "/exit",
                                            "never read"])
    assert "Paris" in out.out and len(turns) == 3
    (c1, p1), (c2, p2), (c3, p3) = turns
    assert c1 == 0 and p2 > p1 + 12  # the second prompt holds the first turn, its answer and the new question
    assert c2 >= (p1 + 12) // 16 * 16 - 16  # all of that but the answer's last block came from the cache
    assert p3 == p1 and c3 == p1 - 1  # after /reset: the first question again, from the cache to the token
    assert "queries 1, hit_tokens 0" in out.err and "unknown command /bogus" in out.err


def test_a_message_beyond_the_context_window_is_refused_and_the_chat_goes_on(monkeypatch, capsys):
    out, turns = chat(monkeypatch, capsys, ["word " * 9000, "What is the capital of France?"])
    assert "context window" in out.err and "the message was not added" in out.err
    assert len(turns) == 1 and turns[0][0] == 0 and "Paris" in out.out


def test_cache_file_carries_the_kv_to_the_next_session(monkeypatch, capsys, tmp_path):
    path = str(tmp_path / "chat.kvc")
    out, first = chat(monkeypatch, capsys, ["What is the capital of France?"], "--cache-file", path)
    assert "not there yet; it is written when the chat ends" in out.err and f"to {path}" in out.err
    out, second = chat(monkeypatch, capsys, ["What is the capital of France?"], "--cache-file", path)
    assert "loaded" in out.err and second[0][0] == (first[0][1] - 1) // 16 * 16 > 0
