"""`kvtool bench <benchmark>`: `ttft` (context layouts vs the prefix cache) and `prefix` (hit vs cold).

Each benchmark registers its own sub-parser; defaults come from the benchmark's config dataclass.
"""

from __future__ import annotations

import os
import sys

from kvtool.cli.common import ENGINE, add_model_args


def register(subparsers) -> None:
    from kvtool.bench.prefix import SHAPES, PrefixBenchConfig
    from kvtool.bench.scenarios import SCENARIOS, ScenarioConfig
    from kvtool.bench.ttft import TTFTBenchConfig

    p = subparsers.add_parser("bench", help="benchmarks (ttft, prefix); JSON record as the last line")
    sub = p.add_subparsers(dest="bench_command", metavar="<benchmark>")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    t, tc, sc = sub.add_parser("ttft", help="TTFT and cache hit rate per context layout (anti-patterns)"), \
        TTFTBenchConfig(), ScenarioConfig()
    add_model_args(t)
    t.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL (kvtool serve, vLLM, llama.cpp) "
                   "instead of running the model in-process")
    t.add_argument("--served-model", default=None, help="model name for --endpoint (default: first of /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="for --endpoint (or $OPENAI_API_KEY)")
    t.add_argument("--scenarios", nargs="+", default=tc.scenarios, choices=list(SCENARIOS), metavar="NAME",
                   help=f"subset to run: {' '.join(SCENARIOS)}")
    t.add_argument("--repeats", type=int, default=tc.repeats, help="runs of each scenario from an empty cache")
    t.add_argument("--max-tokens", type=int, default=tc.max_tokens, help="tokens generated per request")
    t.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed first request")
    t.add_argument("--requests", type=int, default=sc.requests, help="requests per scenario")
    t.add_argument("--policy-paragraphs", type=int, default=sc.policy_paragraphs, help="system prompt size (0-8)")
    t.add_argument("--tools", type=int, default=sc.tools, help="tool definitions (1-8)")
    t.add_argument("--window-turns", type=int, default=sc.window_turns, help="turns the sliding window keeps")
    t.add_argument("--cache-bytes", type=int, default=ENGINE.cache_bytes, help="prefix-cache budget (in-process; "
                   "default: 25%% of available memory, at most 16 GiB)")
    t.add_argument("--block-size", type=int, default=ENGINE.prefix_block, help="tokens per cache block (in-process)")
    t.add_argument("--out", default=tc.out, help="JSON output path; the PNG chart goes next to it")
    t.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    t.set_defaults(func=run_ttft)

    x, xc = sub.add_parser("prefix", help="TTFT of a prefix-cache hit vs a cold prefill, beside transformers"), \
        PrefixBenchConfig()
    add_model_args(x)
    x.add_argument("--shape", choices=SHAPES, default=None, help="random weights in this shape instead of --model")
    x.add_argument("--prefix-tokens", type=int, default=xc.prefix_tokens)
    x.add_argument("--suffix-tokens", type=int, default=xc.suffix_tokens)
    x.add_argument("--repeats", type=int, default=xc.repeats)
    x.add_argument("--warmup", type=int, default=xc.warmup)
    x.add_argument("--block-size", type=int, default=xc.block_size)
    x.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the transformers baseline")
    x.add_argument("--out", default=xc.out, help="also write the JSON record here")
    x.set_defaults(func=run_prefix)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_ttft(args) -> int:
    from kvtool.bench.backends import EndpointBackend, InProcessBackend
    from kvtool.bench.scenarios import ScenarioConfig
    from kvtool.bench.ttft import TTFTBenchConfig, report, run_ttft_bench

    cfg = TTFTBenchConfig(scenarios=args.scenarios, repeats=args.repeats, max_tokens=args.max_tokens,
                          warmup=args.warmup, out=args.out)
    scenario_cfg = ScenarioConfig(requests=args.requests, policy_paragraphs=args.policy_paragraphs, tools=args.tools,
                                  window_turns=args.window_turns)
    if args.endpoint:
        backend = EndpointBackend(args.endpoint, args.served_model, args.api_key, args.max_tokens)
    else:
        backend = InProcessBackend.load(args.model, args.device, args.dtype, args.cache_bytes, args.block_size,
                                        args.max_tokens, announce=_log)
    report(run_ttft_bench(backend, cfg, scenario_cfg, log=_log), args.out, args.png)
    return 0


def run_prefix(args) -> int:
    from kvtool.bench.prefix import PrefixBenchConfig, load_runner, report, run_prefix_bench

    cfg = PrefixBenchConfig(prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, repeats=args.repeats,
                            warmup=args.warmup, block_size=args.block_size, baseline=args.baseline, out=args.out)
    name, runner, folder = load_runner(args.model, args.shape, args.device, args.dtype, announce=_log)
    try:
        report(run_prefix_bench(name, runner, cfg, folder, log=_log), args.out)
    finally:
        if args.shape:  # a random checkpoint written for this run only
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    return 0
