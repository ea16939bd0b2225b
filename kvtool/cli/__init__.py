"""`kvtool <subcommand>`: one module per capability registers its subcommands.

Each module in SUBCOMMAND_MODULES exposes `register(subparsers)`; heavy imports
happen inside the handlers so `kvtool --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtool.errors import KvtoolError

SUBCOMMAND_MODULES = [
    "kvtool.cli.generate",
    "kvtool.cli.chat",
    "kvtool.cli.bench",
    "kvtool.cli.info",
    "kvtool.cli.serve",
    "kvtool.cli.cache",
    "kvtool.agent.cli",
    "kvtool.cli.viz",
    "kvtool.cli.skill",
    "kvtool.cli.edit",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtool",
        description="Inference-level toolkit for small local models and their KV cache.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KvtoolError as exc:
        print(f"kvtool: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the command cannot read or write (a folder, a file in the way, no permission)
        where = f": {exc.filename}" if exc.filename else ""
        where += f" -> {exc.filename2}" if getattr(exc, "filename2", None) else ""
        print(f"kvtool: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:  # a file given as text (messages, a schema) that is not UTF-8
        print(f"kvtool: error: an input file is not UTF-8 text ({exc.reason} at byte {exc.start}); "
              "save it as UTF-8", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
