"""`kvtool edit eval|plot`: edit a field of a cached context four ways and score each against full recompute."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtool.cli.common import add_model_args, check_writable, load_from_args


def register(subparsers) -> None:
    from kvtool.bench.edit import DEFAULT_BUDGETS, MODES
    from kvtool.bench.edit_cases import CASES

    p = subparsers.add_parser("edit", help="edit a field of a cached context (full, field_only, erratum, repair) "
                                           "and measure whether the model follows the change")
    sub = p.add_subparsers(dest="edit_command", metavar="<action>")
    e = sub.add_parser("eval", help="run the field-edit cases on a real model: decision agreement, fidelity, cost")
    e.add_argument("--case", action="append", default=None,
                   help=f"a case by name (repeatable; default: all {len(CASES)}: {', '.join(c.name for c in CASES)})")
    e.add_argument("--limit", type=int, default=None, help="only the first N cases")
    e.add_argument("--mode", action="append", choices=list(MODES), default=None,
                   help="direct (answer only), reasoning (think step by step first) and/or cached_reasoning (reasoning generated before the edit, cached with the context); default: direct and reasoning")
    e.add_argument("--budgets", default=",".join(f"{b:g}" for b in DEFAULT_BUDGETS),
                   help="shares of the context the repairs recompute, comma-separated (default: %(default)s)")
    e.add_argument("--answer-tokens", type=int, default=12, help="greedy tokens of the answer")
    e.add_argument("--reasoning-tokens", type=int, default=48, help="greedy tokens of reasoning before 'Answer:'")
    e.add_argument("--repeats", type=int, default=1, help="timed runs per way after the warm-up (0: warm-up only)")
    e.add_argument("--out", default=None, help="write the JSON record here")
    e.add_argument("--plot", default=None, help="write the agreement plot (PNG) here")
    add_model_args(e)
    e.set_defaults(func=run_eval)
    pl = sub.add_parser("plot", help="one plot from several eval records (a panel per model)")
    pl.add_argument("records", nargs="+", help="JSON records written by `kvtool edit eval --out`")
    pl.add_argument("-o", "--out", required=True, help="PNG to write")
    pl.set_defaults(func=run_plot)
    mg = sub.add_parser("merge", help="one record from runs of one model over different cases (summary recomputed)")
    mg.add_argument("records", nargs="+", help="JSON records written by `kvtool edit eval --out`")
    mg.add_argument("-o", "--out", required=True, help="JSON to write")
    mg.set_defaults(func=run_merge)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_eval(args) -> int:
    from kvtool.bench.edit import plot_records, run_edit_eval
    from kvtool.bench.edit_cases import CASES, by_name
    from kvtool.bench.protocol import emit
    from kvtool.errors import InvalidParameterError

    try:
        budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        raise InvalidParameterError(f"--budgets takes shares such as 0.01,0.05 separated by commas, got "
                                    f"{args.budgets!r}") from None
    for flag, value, least in (("--answer-tokens", args.answer_tokens, 1), ("--reasoning-tokens",
                               args.reasoning_tokens, 1), ("--repeats", args.repeats, 0)):
        if value < least:
            raise InvalidParameterError(f"{flag} must be >= {least}, got {value}")
    cases = by_name(args.case) if args.case else list(CASES)
    if args.limit is not None:
        if args.limit < 1:
            raise InvalidParameterError(f"--limit must be >= 1, got {args.limit}")
        cases = cases[: args.limit]
    check_writable(args.out, "--out")
    check_writable(args.plot, "--plot")
    model = load_from_args(args)
    record = run_edit_eval(model, cases, modes=args.mode or ("direct", "reasoning"), budgets=budgets,
                           answer_tokens=args.answer_tokens, reasoning_tokens=args.reasoning_tokens,
                           repeats=args.repeats, log=_log, on_case=lambda rec: _partial(rec, args.out))
    if args.plot:
        _log(f"wrote {plot_records([record], args.plot)}")
    for mode, v in record["verdict"].items():
        _log(f"{mode}: the edit changes the answer in {v['edit_changes_answer']}/{v['cases']} cases; field_only "
             f"recovers {_pct(v['field_only_recovers'])}, erratum {_pct(v['erratum_recovers'])}; field_only closes "
             f"{_pct(v['field_only_gap_closed_median'])} of the KL gap (median)")
    emit(record, args.out)
    return 0


def _partial(record: dict, out) -> None:
    """The record so far, written to --out after each case (the finished run overwrites it)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({**record, "partial": True}, indent=1) + "\n")


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def run_plot(args) -> int:
    from kvtool.bench.edit import plot_records

    records = [json.loads(Path(p).read_text()) for p in args.records]
    _log(f"wrote {plot_records(records, args.out)}")
    return 0


def run_merge(args) -> int:
    from kvtool.bench.edit import merge_records
    from kvtool.bench.protocol import emit

    emit(merge_records([json.loads(Path(p).read_text()) for p in args.records]), args.out)
    return 0
