"""Every demo replays its script to a valid trajectory; the CLI runs them and fails clearly."""

import argparse
import asyncio
import socket
import time

import pytest

from kvtool.agent import cli
from kvtool.agent.demos.runner import run_demo, scripted_backend
from kvtool.agent.demos.scenarios import DEMOS
from kvtool.agent.http_backend import OpenAIHTTPBackend
from kvtool.agent.trajectory import message_problems
from kvtool.errors import KvtoolError


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_demo_against_its_script(name):
    result = asyncio.run(run_demo(name, scripted_backend(name), scale=0.05))
    assert message_problems(result.messages) == []
    assert DEMOS[name].check(result) == []
    assert result.stop_reason == "done"


def test_demo_over_real_http(endpoint):
    ep = endpoint(DEMOS["interrupt"].script())
    result = asyncio.run(run_demo("interrupt", OpenAIHTTPBackend(ep.base_url, "fake-model"), scale=0.05))
    assert message_problems(result.messages) == [] and DEMOS["interrupt"].check(result) == []


def test_demo_checks_can_fail():
    # the limits demo, but the model never hits the limit: its check must complain
    from kvtool.agent.demos.script import reply
    from kvtool.agent.demos.scripted import ScriptedBackend

    backend = ScriptedBackend([reply(tool_calls=[("phone_call", {"company": "Xfinity"})]), reply("gave up")])
    result = asyncio.run(run_demo("limits", backend, scale=0.05))
    assert DEMOS["limits"].check(result) == ["expected 3 phone calls to run, 1 did"]


def parse(argv):
    parser = argparse.ArgumentParser(prog="kvtool")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["agent", *argv])


def test_cli_help_lists_every_demo(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in DEMOS) and "--status-bar {append,replace,off}" in out


def test_cli_defaults_come_from_agent_config():
    args = parse([])
    assert (args.endpoint, args.status_bar, args.max_iterations) == ("http://127.0.0.1:8000/v1", "append", 20)
    with pytest.raises(SystemExit):
        parse(["--demo", "no-such-demo"])


def test_cli_runs_a_scripted_demo(capsys):
    assert parse(["--demo", "parallel", "--scripted", "--scale", "0.05"]).func(
        parse(["--demo", "parallel", "--scripted", "--scale", "0.05"])) == 0
    out = capsys.readouterr().out
    assert "get_weather started" in out and "prefix-cache hit rate" in out


def test_cli_demo_against_the_fake_endpoint(endpoint, capsys):
    ep = endpoint(DEMOS["limits"].script())
    args = parse(["--demo", "limits", "--endpoint", ep.base_url, "--status-bar", "replace", "--scale", "0.05"])
    assert args.func(args) == 0
    assert ep.requests[0]["model"] == "fake-model"  # taken from GET /models
    assert "limit reached: phone_call to Xfinity 3/3 max" in capsys.readouterr().out


def test_cli_unreachable_endpoint_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = parse(["--demo", "parallel", "--endpoint", f"http://127.0.0.1:{port}/v1"])
    with pytest.raises(KvtoolError, match="cannot reach the model endpoint .* pass --endpoint"):
        args.func(args)


def test_interactive_session_queues_lines_and_exits(endpoint, capsys):
    from kvtool.agent.config import AgentConfig
    from kvtool.agent.interactive import interactive_session
    from kvtool.agent.observer import Observer
    from kvtool.agent.demos.script import reply

    ep = endpoint([reply("Hello!"), reply("Bye!")])
    lines = iter(["hi\n", "/status\n", "thanks\n", "/exit\n"])

    def feed():
        time.sleep(0.15)  # a human types slower than a scripted turn takes
        return next(lines, "")

    backend = OpenAIHTTPBackend(ep.base_url, "fake-model")
    assert asyncio.run(interactive_session(backend, AgentConfig(), Observer(), readline=feed)) == 0
    out = capsys.readouterr().out
    assert "<agent_status>" in out
    users = [m["content"] for m in ep.requests[-1]["messages"] if m["role"] == "user"]
    assert "hi" in users and "thanks" in users and len(ep.requests) == 2
    assert "[done; 1 model calls" in out


def test_skills_flag_is_for_interactive_sessions(tmp_path, capsys):
    from kvtool.cli import main

    (tmp_path / "haiku.md").write_text("---\nname: haiku\ndescription: Write haiku.\n---\nThree lines.\n")
    assert main(["agent", "--skills", str(tmp_path), "--demo", "parallel", "--scripted"]) == 2
    assert "demos bring their own tools" in capsys.readouterr().err
    assert main(["agent", "--skills", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
