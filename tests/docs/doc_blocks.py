"""The fenced blocks of the docs and how each is checked.

Every block of README.md and docs/*.md falls under one rule, or `plan` raises Unclassified:
- ```python: executed (the blocks of one page share a namespace, in page order);
- ```bash, one command after another (a command may span lines through quotes or a trailing backslash):
  `curl ...` runs against the test session's server; `kvtool ...` runs in-process, unless the block is
  preceded by `<!-- run-by: tests/FILE.py -->`: then it is parsed by the real CLI parser and FILE must exist
  and mention its subcommand; `bash scripts/X.sh` is checked by `bash -n` and needs a run-by file that
  mentions it; `pip install`, `python -m venv` and `python benchmarks/X.py` need a run-by file that mentions
  the package or script;
- ```mermaid (a diagram): needs a run-by file that mentions "mermaid", the test that checks the diagram
  against what it draws.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_BY = re.compile(r"<!--\s*run-by:\s*(\S+)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")


class Unclassified(ValueError):
    """A block, or a command in one, that no rule covers."""


class Stale(ValueError):
    """A command the real CLI parser refuses, or a run-by test that does not run it."""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    run_by: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page}:{self.line}"


@dataclass
class Step:
    kind: str  # python | curl | kvtool-run | kvtool-parse | script | setup | diagram
    block: Block
    argv: list[str] = field(default_factory=list)
    source: str = ""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path, text: str | None = None) -> list[Block]:
    lines = (page.read_text() if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise Unclassified(f"{page}:{start + 1}: a block that is never closed")
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        run_by = RUN_BY.search(prev)
        out.append(Block(page, start + 1, m.group(1), "\n".join(body) + "\n", run_by and run_by.group(1)))
        i += 1
    return out


def commands(text: str) -> list[str]:
    """The shell commands of a block: lines joined while a quote is open or a line ends in a backslash."""
    out, current = [], ""
    for line in text.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(current, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if current.strip() and not current.strip().startswith("#"):
            out.append(current)
        current = ""
    if current.strip():
        raise Unclassified(f"an unfinished command: {current[:80]!r}")
    return out


SETUP = {"pip", "pip3"}
VLLM_SERVER = "vllm.entrypoints.openai.api_server"  # a plain vLLM server (kvtool's connector in it)


def plan(block: Block) -> list[Step]:
    """How each part of a block is checked; Unclassified when no rule covers it."""
    if block.lang == "python":
        return [Step("python", block, source=block.text)]
    if block.lang == "mermaid":
        if not block.run_by:
            raise Unclassified(f"{block.where}: a diagram needs <!-- run-by: tests/FILE.py --> naming the test "
                               "that checks it")
        return [Step("diagram", block)]
    if block.lang not in ("bash", "sh", "shell"):
        raise Unclassified(f"{block.where}: a ```{block.lang or '(no language)'} block; only python and bash "
                           "blocks (and mermaid diagrams) are allowed, each run, parsed or checked by a test")
    steps = []
    for cmd in commands(block.text):
        argv = shlex.split(cmd.replace("\\\n", " "), comments=True)
        head = Path(argv[0]).name
        if head == "curl":
            steps.append(Step("curl", block, argv))
        elif head == "kvtool":
            steps.append(Step("kvtool-parse" if block.run_by else "kvtool-run", block, argv))
        elif head == "bash" and len(argv) > 1 and argv[1].startswith("scripts/"):
            steps.append(Step("script", block, argv))
        elif head in SETUP or (head.startswith("python") and len(argv) > 1
                               and (argv[1:3] in (["-m", "venv"], ["-m", VLLM_SERVER])
                                    or argv[1].startswith("benchmarks/"))):
            steps.append(Step("setup", block, argv))
        else:
            raise Unclassified(f"{block.where}: no rule runs or parses {cmd.strip()[:80]!r}")
    if not steps:
        raise Unclassified(f"{block.where}: a shell block with no command")
    if any(s.kind in ("script", "setup", "kvtool-parse") for s in steps) and not block.run_by:
        raise Unclassified(f"{block.where}: a long command needs <!-- run-by: tests/FILE.py --> before its block")
    return steps


def subject(step: Step) -> str:
    """What the run-by file must mention: the subcommand, script or package the command runs."""
    argv = step.argv
    if step.kind == "diagram":
        return "mermaid"
    if step.kind == "kvtool-parse":
        words = [a for a in argv[1:3] if not a.startswith("-")]
        return " ".join(words[:2]) if len(words) > 1 and words[0] in _NESTED else words[0]
    if step.kind == "script":
        return argv[1]
    if argv[1:3] == ["-m", "venv"]:
        return "venv"
    if argv[1:3] == ["-m", VLLM_SERVER]:  # and the connector's module, when the command mounts it
        return VLLM_SERVER + (" kvtool.integrations.vllm.connector" if "KvtoolConnector" in " ".join(argv) else "")
    if argv[1].startswith("benchmarks/"):
        return Path(argv[1]).name
    # pip install/uninstall: the first package named (the extra of `.[extra]`), not an option's value
    args = iter(argv[2:])
    for a in args:
        if a in ("-c", "-r", "--index-url", "--constraint", "--requirement"):
            next(args, None)
        elif not a.startswith("-"):
            return a.split("[", 1)[1].rstrip("]") if a.startswith(".[") else re.split(r"[=<>\[]", a)[0]
    raise Unclassified(f"{step.block.where}: {' '.join(argv)[:80]!r} names no package")


_NESTED = {"bench", "skill", "viz", "cache", "edit"}


def check_run_by(step: Step) -> None:
    """The named test file exists and mentions what the command runs."""
    path = ROOT / step.block.run_by
    if not path.is_file():
        raise Stale(f"{step.block.where}: run-by names {step.block.run_by}, which does not exist")
    text, want = path.read_text(), subject(step)
    if step.kind == "setup" and step.argv[1].startswith("benchmarks/"):
        check_script_flags(step.argv)
    # `kvtool bench peers` is run as run_peers / ["bench", "peers"]: the subcommand's words must appear
    if not all(word in text for word in want.split()):
        raise Stale(f"{step.block.where}: {step.block.run_by} does not mention {want!r}, so it does not run "
                    f"{' '.join(step.argv)[:80]!r}")


def check_parse(argv: list[str]) -> None:
    """The real CLI parser accepts the command (an unknown subcommand, flag or choice fails)."""
    import contextlib
    import io

    from kvtool.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        if exc.code:
            raise Stale(f"kvtool's parser refuses {' '.join(argv)!r}: {err.getvalue().strip().splitlines()[-1]}")


def check_script_flags(argv: list[str]) -> None:
    """A benchmark script's command: the script exists and declares every --flag the command gives."""
    script = ROOT / argv[1]
    if not script.is_file():
        raise Stale(f"{argv[1]} does not exist")
    source = script.read_text()
    for flag in (a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")):
        if f'"{flag}"' not in source:
            raise Stale(f"{argv[1]} has no option {flag}")
