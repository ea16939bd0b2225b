"""Every fenced block of README.md and docs/*.md is run or parsed here, so no page can go stale
(the rules are in tests/docs/doc_blocks.py). Python blocks and short `kvtool` commands run for real on SmolLM2,
curl commands against one server on SmolLM2 started for the session; long commands are parsed by the real
CLI parser and name the test that runs them."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from doc_blocks import (ROOT, Block, Stale, Step, Unclassified, blocks, check_parse, check_run_by, commands,
                               pages, plan)

PAGES = {str(p.relative_to(ROOT)): p for p in pages()}
DOC_PORT = ("localhost:8000", "127.0.0.1:8000")


# ---- the rules themselves, without a model --------------------------------------------------------------


def test_every_block_of_every_page_is_covered_by_a_rule():
    problems = []
    for page in PAGES.values():
        for block in blocks(page):
            try:
                for step in plan(block):
                    if step.kind == "kvtool-parse":
                        check_parse(step.argv)
                    if step.block.run_by:
                        check_run_by(step)
                    if step.kind == "script":
                        subprocess.run(["bash", "-n", str(ROOT / step.argv[1])], check=True, capture_output=True)
            except (Unclassified, Stale, subprocess.CalledProcessError) as exc:
                problems.append(str(exc))
    assert problems == []


def _block(text: str, lang: str = "bash", run_by: str | None = None) -> Block:
    return Block(ROOT / "docs" / "x.md", 1, lang, text, run_by)


def test_a_stale_flag_or_subcommand_fails():
    with pytest.raises(Stale, match="--no-such-flag"):
        check_parse(["kvtool", "serve", "--no-such-flag"])
    with pytest.raises(Stale, match="invalid choice"):
        check_parse(["kvtool", "bench", "nonesuch"])
    check_parse(["kvtool", "serve", "--skills", "examples/skills", "--port", "8001"])


def test_unclassified_blocks_and_missing_run_by_fail():
    with pytest.raises(Unclassified, match="json"):
        plan(_block('{"a": 1}\n', lang="json"))
    with pytest.raises(Unclassified, match="no rule"):
        plan(_block("rm -rf build\n"))
    with pytest.raises(Unclassified, match="run-by"):
        plan(_block("kvtool serve --port 8001\nbash scripts/serve.sh\n"))
    with pytest.raises(Unclassified, match="never closed"):
        blocks(ROOT / "x.md", "text\n```bash\nkvtool info\n")


def test_run_by_must_name_an_existing_test_that_runs_the_command():
    step = plan(_block("kvtool bench peers --model smollm2\n", run_by="tests/bench/test_bench_peers.py"))[0]
    check_run_by(step)
    with pytest.raises(Stale, match="does not exist"):
        check_run_by(Step("kvtool-parse", _block("", run_by="tests/nope.py"), step.argv))
    with pytest.raises(Stale, match="does not mention 'edit eval'"):
        check_run_by(Step("kvtool-parse", _block("", run_by="tests/test_sampling.py"), ["kvtool", "edit", "eval"]))


def test_commands_span_quotes_and_backslashes():
    text = ("kvtool info   # the model\n\n# a comment\ncurl -s x -d '{\n  \"a\": 1}'\n"
            "kvtool viz sink --prompt hi \\\n    --first 4\n")
    assert [c.split()[0] for c in commands(text)] == ["kvtool", "curl", "kvtool"]
    with pytest.raises(Unclassified, match="unfinished"):
        commands("curl -d '{\n")


def test_the_two_commands_are_what_ci_and_this_test_run():
    """README's two commands: CI runs scripts/test.sh (which sets up with scripts/setup.sh --test); scripts/serve.sh
    sets up with the same script and ends in `kvtool serve`, which doc_server runs for real below."""
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh --test" in (ROOT / "scripts" / "test.sh").read_text()
    serve = (ROOT / "scripts" / "serve.sh").read_text().splitlines()
    assert "bash scripts/setup.sh" in serve and serve[-1] == 'exec .venv/bin/kvtool serve "$@"'


def test_blocks_read_run_by_from_the_line_before():
    text = "x\n<!-- run-by: tests/a.py -->\n\n```bash\nkvtool serve\n```\n```python\nprint(1)\n```\n"
    got = blocks(ROOT / "x.md", text)
    assert [(b.lang, b.run_by, b.line) for b in got] == [("bash", "tests/a.py", 4), ("python", None, 7)]


# ---- running the pages on SmolLM2 -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def doc_server(tmp_path_factory):
    """`kvtool serve` on SmolLM2 in a child process, for every curl and openai example, with the example `pdf`
    skill mounted: the command scripts/serve.sh ends in, run for real."""
    from kvtool.testing.models import smollm2_gguf
    from kvtool.testing.server_process import ServerProcess

    skills = tmp_path_factory.mktemp("doc-skills")
    (skills / "pdf").symlink_to(ROOT / "examples" / "skills" / "pdf")  # the one skill the pages ask for
    srv = ServerProcess(["--model", str(smollm2_gguf()), "--skills", str(skills), "--skill-preamble", "conversation",
                         "--skill-repair", "none", "--default-max-tokens", "16", "--log-level", "warning"],
                        tmp_path_factory.mktemp("doc-serve") / "serve.log").start(timeout=300)
    yield srv
    code, alive = srv.stop()  # SIGINT: drained, then the CLI exits 128 + SIGINT
    assert code in (0, 130) and alive == [], f"kvtool serve exited {code}, children left {alive}:\n{srv.log[-2000:]}"


@pytest.fixture
def on_smollm2(smollm2, monkeypatch, tmp_path):
    """kvtool.load returns the session's SmolLM2 for SmolLM2 on the CPU (other loads happen once per session),
    the default model is SmolLM2, and the commands run in a scratch folder that sees the repo's examples."""
    import kvtool
    import kvtool.models.loading as loading
    import kvtool.models.resolve as resolve
    from kvtool.testing.models import smollm2_gguf

    gguf = str(smollm2_gguf())
    real = loading.load

    def load(model, device=None, dtype=None, weights=None, **kw):
        name = str(model)
        if (name == gguf or name.lower() == "smollm2") and device in (None, "auto", "cpu") \
                and dtype in (None, "auto", "float32") and weights in (None, "dense") and not kw.get("progress"):
            return smollm2
        key = (name, device, dtype, weights)
        if key not in _LOADS:
            _LOADS[key] = real(model, device=device, dtype=dtype, weights=weights, **kw)
        return _LOADS[key]

    monkeypatch.setattr(loading, "load", load)
    monkeypatch.setattr(kvtool, "load", load)
    monkeypatch.setattr(resolve, "default_model", lambda: (gguf, "using the embedded SmolLM2 (docs test)"))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


_LOADS: dict = {}


def _at(text: str, url: str) -> str:
    for old in DOC_PORT:
        text = text.replace(old, url.split("//", 1)[1])
    return text


def _run(step: Step, server_url: str, namespace: dict, capsys) -> None:
    if step.kind == "python":
        code = compile(_at(step.source, server_url), step.block.where, "exec")
        exec(code, namespace)  # noqa: S102 - the docs' own examples
    elif step.kind == "curl":
        argv = [_at(a, server_url) for a in step.argv]
        out = subprocess.run([argv[0], "--fail-with-body", "--max-time", "120", *argv[1:]], capture_output=True,
                             text=True)
        assert out.returncode == 0, f"{step.block.where}: {' '.join(argv)[:120]}\n{out.stdout[-800:]}{out.stderr}"
        assert out.stdout.strip(), f"{step.block.where}: {' '.join(argv)[:120]} printed nothing"
    elif step.kind == "kvtool-run":
        from kvtool.cli import main

        code = main(step.argv[1:])
        captured = capsys.readouterr()
        assert code == 0, f"{step.block.where}: {' '.join(step.argv)} exited {code}\n{captured.out[-800:]}" \
                          f"{captured.err[-1500:]}"
    else:
        if step.kind == "kvtool-parse":
            check_parse(step.argv)
        check_run_by(step)


@pytest.mark.real_model
@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_runs(page, doc_server, on_smollm2, capsys, monkeypatch):
    steps = [step for block in blocks(PAGES[page]) for step in plan(block)]
    if any(s.kind == "curl" for s in steps) and shutil.which("curl") is None:
        pytest.skip("curl is not installed (.ci/run installs it)")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": f"docs:{page}"}
    for step in steps:
        _run(step, doc_server.base_url, namespace, capsys)
