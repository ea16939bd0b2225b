"""`kvtool viz …` end to end on SmolLM2 (the session model is handed to the CLI, not reloaded),
and bad input: one line on stderr, exit code 2, no traceback."""

import json
from pathlib import Path

import pytest

import kvtool.cli.viz as cli_viz
from kvtool.cli import main

pytestmark = pytest.mark.real_model
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "status_bar"


@pytest.fixture
def viz(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(cli_viz, "load_from_args", lambda args: smollm2)

    def run(*argv):
        code = main(["viz", *map(str, argv)])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def test_sink_cli_table_plot_json(viz, tmp_path):
    code, out, err = viz("sink", "--prompt", "The history of the city begins with a small fishing village.", "--chat",
                         "-o", tmp_path / "sink.svg", "--json", tmp_path / "sink.json")
    assert code == 0, err
    record = json.loads((tmp_path / "sink.json").read_text())
    assert record["kind"] == "sink" and len(record["layers"]) == 30 and record["rows"] == record["n_tokens"] - 4
    assert out.splitlines()[1].split()[:3] == ["layer", "token0", "first4"]
    assert (tmp_path / "sink.svg").read_text().lstrip().startswith("<?xml")


def test_heatmap_cli_with_generation(viz, tmp_path):
    code, out, err = viz("heatmap", "--prompt", "What is the capital of France?", "--chat", "--generate", 6,
                         "--layers", "20,-1", "--heads", "0,1", "--rows", "generated", "--highlight", "text:France",
                         "--scale", "log", "-o", tmp_path / "h.png", "--json", "-")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    first, last, count = record["rows"]
    assert last == record["n_tokens"] - 1 and count == record["n_tokens"] - first and 0 < count <= 6
    assert record["shape"] == [4, count, record["n_tokens"]]
    assert [p["title"] for p in record["panels"]] == ["layer 20 · head 0", "layer 20 · head 1",
                                                      "layer 29 · head 0", "layer 29 · head 1"]
    assert record["highlight"] and (tmp_path / "h.png").stat().st_size > 10_000


@pytest.mark.slow
def test_focus_cli_compare_status_bar(viz, tmp_path):
    code, out, err = viz("focus", "--messages", EXAMPLES / "treatment.json", "--compare", EXAMPLES / "control.json",
                         "--labels", "treatment,control", "--span", "status=tag:agent_status",
                         "--vs", "calls=channel:tool_call+channel:tool_response", "-o", tmp_path / "focus.png",
                         "--json", tmp_path / "focus.json")
    assert code == 0, err
    treatment, control = json.loads((tmp_path / "focus.json").read_text())["contexts"]
    status, calls = treatment["spans"]["status"], treatment["spans"]["calls"]
    assert status["per_token"] > calls["per_token"], (status, calls)  # the summary beats the raw records
    assert control["spans"]["status"]["tokens"] == 0 and control["spans"]["calls"]["tokens"] == calls["tokens"]
    assert len(calls["ranges"]) == 10  # five calls, five results
    assert (tmp_path / "focus.png").stat().st_size > 20_000
    assert "treatment: status:" in out and "control: status: absent" in out


@pytest.mark.slow
def test_position_cli_needle(viz, tmp_path):
    code, out, err = viz("position", "--needle", "--context-tokens", 120, "--depths", "0,1",
                         "-o", tmp_path / "needle.png", "--json", tmp_path / "needle.json")
    assert code == 0, err
    record = json.loads((tmp_path / "needle.json").read_text())
    assert [d["depth"] for d in record["per_depth"]] == [0.0, 1.0]
    assert all(0 < d["attention_on_needle"] < 1 for d in record["per_depth"])
    assert (tmp_path / "needle.png").is_file()


@pytest.mark.parametrize("argv, words", [
    (["heatmap", "--prompt", "hi there", "--layers", "30"], "layer 30 is out of range"),
    (["heatmap", "--prompt", "hi there", "--heads", "9"], "head 9 is out of range"),
    (["sink", "--prompt", ""], "the prompt is empty"),
    (["sink"], "the prompt is empty"),
    (["sink", "--prompt", "hello " * 8300], "context window is 8192"),
    (["sink", "--prompt", "hello " * 8185, "--generate", 20], "exceeds the context window"),
    (["heatmap", "--prompt", "hi", "-o", "x.jpg"], "must end in .png or .svg"),
    (["focus", "--prompt", "hi there", "--span", "tag:agent_status"], "matches no tokens"),
    (["focus", "--messages", "/no/such.json", "--span", "tag:x"], "does not exist"),
    (["heatmap", "--prompt", "hi there", "--rows", "last:99"], "N must be in"),
    (["position", "--needle", "--depths", "0,2"], "depths must be in [0, 1]"),
    # the filler for 10^8 tokens was built and tokenized first: the process ran out of memory
    (["position", "--needle", "--context-tokens", 10**8], "--context-tokens 100000000 does not fit: the model's "
                                                          "context window is 8192 tokens"),
    (["focus", "--prompt", "hi there", "--span", ""], "bad span '': use NAME=SPEC[+SPEC] or SPEC"),
    (["focus", "--prompt", "hi there", "--span", "name="], "bad span 'name='"),
    (["focus", "--prompt", "hi there", "--span", "text:hi", "--labels", "a,b"], "--labels names each context, 1 "
                                                                               "here (the input; --compare adds one)"),
])
def test_bad_input_is_one_clear_line(viz, argv, words):
    code, out, err = viz(*argv)
    assert code == 2
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
