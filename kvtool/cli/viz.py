"""`kvtool viz heatmap|sink|position|focus`: attention pictures and their numbers as JSON.

Input: --prompt TEXT (raw, or --chat to wrap it as a user turn), --messages FILE.json (chat
template, tools included) or --from-url URL (a server's conversation JSON); --generate N first
appends N generated tokens (greedy by default) so reasoning and output rows appear.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtool.cli.common import add_model_args, load_from_args
from kvtool.viz.config import VizConfig

D = VizConfig()


def register(subparsers) -> None:
    p = subparsers.add_parser("viz", help="attention heatmaps: sinks, position bias, status-bar focus")
    sub = p.add_subparsers(dest="viz_command", metavar="<what>", required=True)

    h = sub.add_parser("heatmap", help="query x key attention heatmap for layers/heads (PNG or SVG)")
    add_input_args(h)
    h.add_argument("--layers", default=D.layers, help="all | N | N,M | A:B (HF indices, negative from the end)")
    h.add_argument("--heads", default=D.heads, help="mean | max (aggregate) | all | N | N,M | A:B")
    h.add_argument("--layer-agg", choices=["mean", "max"], default=None, help="aggregate the layers into one panel")
    h.add_argument("--rows", default=D.rows, help="query rows: all | last:N | A:B | generated | reasoning")
    h.add_argument("--max-cells", type=int, default=D.max_cells, help="cells per axis before block pooling")
    h.add_argument("--pool", choices=["mass", "max"], default=D.pool, help="block pooling for long inputs")
    h.add_argument("--scale", choices=["linear", "log"], default=D.scale)
    h.add_argument("--highlight", action="append", default=[], metavar="SPAN",
                   help="outline a span: A:B, tag:NAME, text:LITERAL, channel:NAME, role:NAME (repeatable)")
    add_output_args(h, "viz_heatmap.png")
    h.set_defaults(func=run_heatmap)

    s = sub.add_parser("sink", help="attention mass on token 0 and the first k tokens per layer and head")
    add_input_args(s)
    s.add_argument("--first", type=int, default=D.sink_first, help="k for 'first k tokens'")
    s.add_argument("--skip", type=int, default=D.skip_rows, help="ignore the first N query rows")
    s.add_argument("--layers", default=D.layers)
    add_output_args(s, "viz_sink.png")
    s.set_defaults(func=run_sink)

    q = sub.add_parser("position", help="attention by position bucket and distance; --needle: lost-in-the-middle")
    add_input_args(q)
    q.add_argument("--rows", default=None, help=f"query rows (default: rows past --skip {D.skip_rows})")
    q.add_argument("--buckets", type=int, default=D.buckets, help="absolute-position buckets")
    q.add_argument("--layers", default=D.layers)
    q.add_argument("--needle", action="store_true", help="run the needle experiment instead (no input needed)")
    q.add_argument("--context-tokens", type=int, default=D.needle_context, help="needle: filler tokens")
    q.add_argument("--depths", default=D.needle_depths, help="needle: depths in [0, 1], comma separated")
    q.add_argument("--trials", type=int, default=D.needle_trials, help="needle: different facts per depth")
    add_output_args(q, "viz_position.png")
    q.set_defaults(func=run_position)

    f = sub.add_parser("focus", help="share of attention the chosen rows pay to a span (e.g. <agent_status>)")
    add_input_args(f)
    f.add_argument("--span", required=True, help="NAME=SPEC[+SPEC] or SPEC, e.g. tag:agent_status")
    f.add_argument("--vs", action="append", default=[], help="more spans to compare, e.g. "
                   "calls=channel:tool_call+channel:tool_response (repeatable)")
    f.add_argument("--rows", default=D.focus_rows, help="last:N | generated | reasoning | A:B")
    f.add_argument("--layers", default=D.layers)
    f.add_argument("--compare", default=None, metavar="FILE.json", help="a second conversation, same colour scale")
    f.add_argument("--labels", default=None, help="labels for the two contexts, e.g. treatment,control")
    f.add_argument("--scale", choices=["linear", "log"], default=D.focus_scale)
    add_output_args(f, "viz_focus.png")
    f.set_defaults(func=run_focus)


def add_input_args(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="raw prompt text (add --chat for the chat template)")
    src.add_argument("--messages", default=None, metavar="FILE.json", help='[messages] or {"messages", "tools"}')
    src.add_argument("--from-url", default=None, metavar="URL", help="GET a conversation JSON from a server")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="generate N tokens first")
    p.add_argument("--temperature", type=float, default=D.temperature, help="for --generate (0 = greedy)")
    p.add_argument("--seed", type=int, default=None)
    add_model_args(p)


def add_output_args(p, default: str) -> None:
    p.add_argument("-o", "--output", default=default, help="plot file, .png or .svg")
    p.add_argument("--json", default=None, metavar="PATH", help="write the numbers as JSON (- for stdout)")


def read_input(args, model, messages_file: str | None = None):
    from kvtool.config import SamplingParams
    from kvtool.errors import InvalidParameterError
    from kvtool.viz.inputs import build_tokens, fetch_conversation, load_messages_file, prompt_ids

    if args.generate < 0:
        raise InvalidParameterError("--generate must be >= 0")
    messages = tools = None
    if messages_file or args.messages:
        messages, tools = load_messages_file(messages_file or args.messages)
    elif args.from_url:
        messages, tools = fetch_conversation(args.from_url)
    ids = prompt_ids(model, args.prompt, messages, tools, chat=args.chat)
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    return build_tokens(model, ids, args.generate, params)


def checked(args):
    """Validate the output path before the (slow) model load."""
    from kvtool.cli.common import check_writable
    from kvtool.viz.plots import check_output

    check_output(args.output)
    check_writable(args.output, "-o")
    check_writable(args.json, "--json")
    return load_from_args(args)


def write_json(record: dict, where: str | None) -> None:
    if where == "-":
        print(json.dumps(record))
    elif where:
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        Path(where).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {where}", file=sys.stderr)


def run_heatmap(args) -> int:
    from kvtool.viz.heatmap import compute_heatmap, plot_heatmap
    from kvtool.viz.select import parse_heads, parse_indices, parse_rows
    from kvtool.viz.tokens import find_spans

    model = checked(args)
    tokens = read_input(args, model)
    layers = parse_indices(args.layers, model.spec.num_layers, "layer")
    heads, agg = parse_heads(args.heads, model.spec.num_heads)
    rows = parse_rows(args.rows, tokens)
    spans = [s for spec in args.highlight for s in find_spans(tokens, spec)]
    if (1 if args.layer_agg else len(layers)) * (1 if agg else len(heads)) > 64:
        from kvtool.errors import InvalidParameterError

        raise InvalidParameterError("more than 64 panels; select fewer layers/heads or aggregate (--heads mean, "
                                    "--layer-agg mean)")
    data = compute_heatmap(model, tokens, layers, heads, agg, args.layer_agg, rows, args.max_cells, args.pool)
    path = plot_heatmap(data, args.output, args.scale, spans, floor=D.log_floor)
    small = data.values.size <= 100_000  # cell values in the JSON only when they stay readable
    record = {"kind": "heatmap", **data.to_json(with_values=small), "highlight": [list(s) for s in spans],
              "output": str(path)}
    write_json(record, args.json)
    print(f"wrote {path} ({len(tokens)} tokens, {len(data.titles)} panel(s), block {data.block})", file=sys.stderr)
    return 0


def run_sink(args) -> int:
    from kvtool.viz.select import parse_indices
    from kvtool.viz.sink import plot_sink, sink_stats, sink_table

    model = checked(args)
    tokens = read_input(args, model)
    layers = parse_indices(args.layers, model.spec.num_layers, "layer")
    res = sink_stats(model, tokens, args.first, args.skip, layers)
    path = plot_sink(res, args.output)
    print(sink_table(res))
    write_json({**res.to_json(), "output": str(path)}, args.json)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def run_position(args) -> int:
    from kvtool.errors import InvalidParameterError
    from kvtool.viz.select import parse_indices, parse_rows

    model = checked(args)
    if args.needle:
        from kvtool.viz.needle import needle_experiment, plot_needle

        try:
            depths = [float(x) for x in args.depths.split(",")]
        except ValueError:
            raise InvalidParameterError(f"--depths {args.depths!r}: use numbers in [0, 1], comma separated") from None
        res = needle_experiment(model, args.context_tokens, depths, args.trials)
        path = plot_needle(res, args.output)
        record = {**res.to_json(), "output": str(path)}
        for r in res.per_depth():
            print(f"depth {r['depth']:.2f}: accuracy {r['accuracy']:.2f}  attention on needle "
                  f"{r['attention_on_needle']:.4f}")
    else:
        from kvtool.viz.position import plot_position, position_stats

        tokens = read_input(args, model)
        rows = parse_rows(args.rows, tokens) if args.rows else list(range(min(D.skip_rows, len(tokens) - 1),
                                                                             len(tokens)))
        layers = parse_indices(args.layers, model.spec.num_layers, "layer")
        res = position_stats(model, tokens.ids, rows, args.buckets, layers)
        path = plot_position(res, args.output)
        record = {**res.to_json(), "output": str(path)}
        print("attention per key by position bucket:", " ".join(f"{v:.4f}" for v in res.position_density.mean(0)))
    write_json(record, args.json)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def parse_span_arg(text: str) -> tuple[str, list[str]]:
    from kvtool.errors import InvalidParameterError

    name, eq, specs = text.partition("=")
    if not eq:
        name, specs = text, text
    parts = [s for s in specs.split("+") if s]
    if not name.strip() or not parts:
        raise InvalidParameterError(f"bad span {text!r}: use NAME=SPEC[+SPEC] or SPEC, e.g. status=tag:agent_status")
    return name, parts


def run_focus(args) -> int:
    from kvtool.errors import InvalidParameterError
    from kvtool.viz.focus import focus, plot_focus, resolve_spans
    from kvtool.viz.select import parse_indices, parse_rows

    sources = [None] + ([args.compare] if args.compare else [])
    labels = (args.labels or ",".join(["context", "compare"][: len(sources)])).split(",")
    if len(labels) != len(sources):  # checked before the model loads
        raise InvalidParameterError(f"--labels names each context, {len(sources)} here ("
                                    f"{'the input and --compare' if args.compare else 'the input; --compare adds one'}"
                                    f"); got {len(labels)}: {args.labels!r}")
    specs = dict(parse_span_arg(s) for s in [args.span, *args.vs])
    model = checked(args)
    layers = parse_indices(args.layers, model.spec.num_layers, "layer")
    results = []
    for src, lab in zip(sources, labels):
        tokens = read_input(args, model, messages_file=src)
        spans = resolve_spans(tokens, specs, required=not args.compare)
        results.append(focus(model, tokens, spans, parse_rows(args.rows, tokens), layers, lab, D.strip_cells))
    for name in specs:
        if not any(r.spans[name] for r in results):
            raise InvalidParameterError(f"span {name!r} matches no tokens in any context")
    path = plot_focus(results, args.output, args.scale, D.log_floor)
    for r in results:
        for name, s in r.summary().items():
            if s["tokens"]:
                print(f"{r.label}: {name}: {s['tokens']} tokens, share {s['share']:.4f}, "
                      f"per token {s['per_token']:.5f}")
            else:
                print(f"{r.label}: {name}: absent")
    write_json({"kind": "focus", "contexts": [r.to_json() for r in results], "output": str(path)}, args.json)
    print(f"wrote {path}", file=sys.stderr)
    return 0
