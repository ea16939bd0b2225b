"""`kvtool skill compile|list|info|eval`: skill KV blocks from SKILL.md files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtool.cli.common import add_model_args, check_writable, load_from_args


def register(subparsers) -> None:
    from kvtool.skill_settings import DEEP_TOKENS, NAMES
    from kvtool.skills.cases import EVAL_PREAMBLES
    from kvtool.skills.catalog import DEFAULT_PREAMBLE
    from kvtool.skills.evaluate import DEFAULT_SWEEP
    from kvtool.skills.render import RENDER_MODES
    from kvtool.skills.repair import REPAIRS

    p = subparsers.add_parser("skill", help="compile skills into reusable KV blocks; list, inspect, evaluate them")
    sub = p.add_subparsers(dest="skill_command", metavar="<action>")

    c = sub.add_parser("compile", help="prefill a SKILL.md (or a directory of skills) once and save its KV")
    c.add_argument("path", help="SKILL.md, a skill folder, or a directory of skills (a catalog)")
    c.add_argument("-o", "--out", default=None,
                   help="output .kvb (one skill) or folder (catalog); default: NAME.kvb here / the skill cache")
    c.add_argument("--render", choices=sorted(RENDER_MODES), default="tool",
                   help="how the skill appears in context: as the Skill tool's result, or a user turn")
    c.add_argument("--preamble", type=_preamble, default=DEFAULT_PREAMBLE,
                   help=f"what is prefilled before the skill: {' | '.join(NAMES)} | deep:tokens=N (deep: ~"
                        f"{DEEP_TOKENS} tokens of generic agent instructions, then the turn's conversation head; "
                        "conversation: the head only; none: the block starts at position 0). Default: %(default)s")
    c.add_argument("--cache-dir", default=None,
                   help="where a folder of skills is cached when no -o is given (default ~/.cache/kvtool/skills)")
    add_model_args(c)
    c.set_defaults(func=run_compile)

    ls = sub.add_parser("list", help="list the skills of a directory (name: description)")
    ls.add_argument("path")
    ls.set_defaults(func=run_list)

    i = sub.add_parser("info", help="verify a .kvb file and print its metadata")
    i.add_argument("path")
    i.add_argument("--check-model", action="store_true", help="also check it against --model (loads the model)")
    add_model_args(i)
    i.set_defaults(func=run_info)

    e = sub.add_parser("eval", help="composed vs full recompute on a real model: fidelity and TTFT per repair")
    e.add_argument("path", help="directory of skills (the first --blocks, by name, are used)")
    e.add_argument("--blocks", type=int, default=4)
    e.add_argument("--prefix-tokens", type=int, default=256)
    e.add_argument("--repair", action="append", default=None,
                   help=f"repair to evaluate, e.g. recompute_first_k:k=16 (repeatable; strategies: "
                        f"{', '.join(REPAIRS)}; default sweep: {' '.join(DEFAULT_SWEEP)})")
    e.add_argument("--greedy-tokens", type=int, default=32)
    e.add_argument("--queries", type=int, default=4, help="queries scored after the same blocks (1-4)")
    e.add_argument("--repeats", type=int, default=1,
                   help="timed runs per measurement after a warm-up (0: the warm-up run only)")
    e.add_argument("--scaling", default="1,2,4", help="block counts for TTFT vs block tokens ('' to skip)")
    e.add_argument("--preamble", action="append", type=_preamble, default=None,
                   help=f"compile the skills with this preamble and score each (repeatable; default: "
                        f"{' '.join(EVAL_PREAMBLES)})")
    e.add_argument("--cache-dir", default=None)
    e.add_argument("--out", default=None, help="write the JSON record here")
    e.add_argument("--plot", default=None, help="write the plot (PNG) here")
    add_model_args(e)
    e.set_defaults(func=run_eval)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _preamble(spec: str) -> str:
    import argparse

    from kvtool.errors import InvalidParameterError
    from kvtool.skill_settings import canonical_preamble

    try:
        return canonical_preamble(spec)
    except InvalidParameterError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_compile(args) -> int:
    from kvtool.skills.block import save_block
    from kvtool.skills.catalog import compile_skill, load_catalog
    from kvtool.skills.skillfile import read_skill, read_skills

    path = Path(args.path)
    single = path.is_file() or (path / "SKILL.md").is_file()
    skills = [read_skill(path)] if single else read_skills(path)  # parse errors before loading the model
    if args.cache_dir is not None and (single or args.out is not None):
        from kvtool.errors import InvalidParameterError

        raise InvalidParameterError("--cache-dir is where a folder of skills is cached when no -o is given; "
                                    + ("a single skill is written to -o (default: NAME.kvb here)" if single else
                                       "with -o the blocks go to that folder"))
    check_writable(args.out, "-o", folder=not single)
    model = load_from_args(args)
    if not single and args.out is None:
        catalog = load_catalog(path, model, cache_dir=args.cache_dir, render=args.render, preamble=args.preamble,
                               log=_log)
        for row in catalog.summary():
            print(f"{row['name']}\t{row['tokens']} tokens\t{row['file']}")
        return 0
    shared_kv: dict = {}  # the deep preamble's system turn, prefilled once for all skills
    for skill in skills:
        block = compile_skill(model, skill, args.render, args.preamble, shared_kv=shared_kv)
        out = Path(args.out) if single and args.out else Path(args.out or ".") / f"{skill.name}.kvb"
        save_block(block, out)
        if block.meta.get("boundary_safe") != "true":
            _log(f"kvtool: warning: {skill.name!r} tokenizes differently inside a conversation; it may not splice")
        print(f"{skill.name}\t{len(block)} tokens\tcanonical start {block.canonical_start}\t{out}")
    return 0


def run_list(args) -> int:
    from kvtool.skills.skillfile import read_skills

    for skill in read_skills(args.path):
        print(f"{skill.name}\t{skill.description}")
    return 0


def run_info(args) -> int:
    from kvtool.skills.block import load_block, setup_of

    block = load_block(args.path)
    info = {"name": block.name, "tokens": len(block), "canonical_start": block.canonical_start,
            "kv_shape": list(block.keys.shape), "dtype": str(block.keys.dtype).replace("torch.", ""),
            "bytes": block.nbytes, **block.setup, **{k: v for k, v in block.meta.items() if k != "text"}}
    if args.check_model:
        block.check_setup(setup_of(load_from_args(args)), args.path)
        info["compatible_with_model"] = True
    print(json.dumps(info, indent=1))
    return 0


def run_eval(args) -> int:
    from kvtool.errors import InvalidParameterError
    from kvtool.skills.cases import EVAL_PREAMBLES, MORE_QUERIES, run_skill_eval
    from kvtool.skills.plot import plot_eval
    from kvtool.skills.repair import make_repair

    for spec in args.repair or []:  # a bad spec is refused before the model loads and the reference runs
        make_repair(spec)
    for flag, value, least in (("--blocks", args.blocks, 1), ("--greedy-tokens", args.greedy_tokens, 1),
                               ("--repeats", args.repeats, 0), ("--prefix-tokens", args.prefix_tokens, 0)):
        if value < least:
            raise InvalidParameterError(f"{flag} must be >= {least}, got {value}")
    if not 1 <= args.queries <= len(MORE_QUERIES) + 1:
        raise InvalidParameterError(f"--queries must be in 1..{len(MORE_QUERIES) + 1}, got {args.queries}")
    try:
        counts = [int(c) for c in args.scaling.split(",") if c.strip()]
    except ValueError:
        raise InvalidParameterError(f"--scaling takes block counts separated by commas, got {args.scaling!r}") from None
    check_writable(args.out, "--out")
    check_writable(args.plot, "--plot")
    model = load_from_args(args)
    record = run_skill_eval(model, args.path, blocks=args.blocks, prefix_tokens=args.prefix_tokens,
                            repairs=args.repair, n_greedy=args.greedy_tokens, queries=args.queries,
                            repeats=args.repeats, scaling=counts, preambles=args.preamble or EVAL_PREAMBLES,
                            cache_dir=args.cache_dir, log=_log)
    if args.plot:
        _log(f"wrote {plot_eval(record, args.plot, title=model.name)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        _log(f"wrote {args.out}")
    print(json.dumps(record))
    return 0
