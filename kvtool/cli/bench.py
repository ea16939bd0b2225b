"""`kvtool bench <benchmark>`: decode, ttft (context layouts), prefix (hit vs cold), skills (composed blocks),
batching (concurrent streams), `all` (every one of them, written as one report) and `peers` (kvtool serve beside
llama.cpp, vLLM and transformers on one model).

Each benchmark registers its own sub-parser; defaults come from the benchmark's config dataclass.
"""

from __future__ import annotations

import os
import sys

from kvtool.cli.common import ENGINE, add_model_args, check_writable


def _add_model(p) -> None:
    from kvtool.bench.loading import MODEL_ALIASES, SHAPES

    add_model_args(p)
    p.add_argument("--shape", choices=list(SHAPES), default=None, help="random weights in this shape instead of "
                   f"--model (--model also takes the offline test models: {', '.join(MODEL_ALIASES)})")
    p.add_argument("--tokenizer", default=None, help="with --shape: a Hugging Face tokenizer folder for the prompts "
                   "and chat template (default: the embedded SmolLM2's, when installed)")


def _add_endpoint(p, what: str) -> None:
    p.add_argument("--endpoint", default=None,
                   help=f"OpenAI-compatible base URL (kvtool serve, vLLM, llama.cpp) {what}")
    p.add_argument("--served-model", default=None, help="model name for --endpoint (default: first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="for --endpoint (or $OPENAI_API_KEY)")


def register(subparsers) -> None:
    from kvtool.bench import batching, decode, skills
    from kvtool.bench.prefix import PrefixBenchConfig
    from kvtool.bench.report import BENCHMARKS
    from kvtool.bench.scenarios import SCENARIOS, ScenarioConfig
    from kvtool.bench.ttft import TTFTBenchConfig

    p = subparsers.add_parser("bench", help="benchmarks (decode, ttft, prefix, skills, batching, all, peers); "
                                            "JSON record as the last line")
    sub = p.add_subparsers(dest="bench_command", metavar="<benchmark>")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    d = sub.add_parser("decode", help="bs=1 decode tok/s and cold TTFT, beside transformers generate")
    _add_model(d)
    decode.add_args(d)
    d.set_defaults(func=run_decode)

    t, tc, sc = sub.add_parser("ttft", help="TTFT and cache hit rate per context layout (anti-patterns)"), \
        TTFTBenchConfig(), ScenarioConfig()
    add_model_args(t)
    _add_endpoint(t, "instead of running the model in-process")
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
                   "default: a quarter of available memory, at most 16 GiB)")
    t.add_argument("--block-size", type=int, default=ENGINE.prefix_block, help="tokens per cache block (in-process)")
    t.add_argument("--out", default=tc.out, help="JSON output path; the PNG chart goes next to it")
    t.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    t.set_defaults(func=run_ttft)

    x, xc = sub.add_parser("prefix", help="TTFT of a prefix-cache hit vs a cold prefill, beside transformers"), \
        PrefixBenchConfig()
    _add_model(x)
    x.add_argument("--prefix-tokens", type=int, default=xc.prefix_tokens)
    x.add_argument("--suffix-tokens", type=int, default=xc.suffix_tokens)
    x.add_argument("--repeats", type=int, default=xc.repeats)
    x.add_argument("--warmup", type=int, default=xc.warmup)
    x.add_argument("--block-size", type=int, default=xc.block_size)
    x.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the transformers baseline")
    x.add_argument("--out", default=xc.out, help="also write the JSON record here")
    x.set_defaults(func=run_prefix)

    s = sub.add_parser("skills", help="composed skill KV blocks vs full prefill: fidelity and TTFT per repair")
    _add_model(s)
    skills.add_args(s)
    s.set_defaults(func=run_skills)

    b = sub.add_parser("batching", help="N concurrent streams: continuous batching vs transformers padded batch")
    _add_model(b)
    _add_endpoint(b, "to load-test with the same streams as well")
    batching.add_args(b)
    b.set_defaults(func=run_batching)

    e = sub.add_parser("engines", help="kvtool's engine beside vLLM (kvtool serve --engine vllm) on one model: "
                                         "decode, cold TTFT 512/2k, 2k prefix hit, 8 and 64 streams")
    e.add_argument("--model", required=True, help="hub id, HF folder or .gguf file, as kvtool serve takes it")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="vLLM engine argument (repeatable; default: max_model_len=4096)")
    e.add_argument("--out", default=None, help="JSON output path (e.g. benchmarks/results/engines-cpu.json)")
    e.set_defaults(func=run_engines)

    a = sub.add_parser("all", help="every benchmark on one model; report.md + report.json + PNG plots")
    _add_model(a)
    _add_endpoint(a, "for the serving scenarios (context layouts, batching)")
    a.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test that finishes in minutes on CPU")
    a.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS), metavar="NAME",
                   help=f"subset to run: {' '.join(BENCHMARKS)}")
    a.add_argument("--out-dir", default=None, help="default: benchmarks/results/report-<device>[-quick]")
    a.set_defaults(func=run_all)

    add_peers_parser(sub)


def add_peers_parser(sub) -> None:
    from kvtool.bench.peers.config import ENGINE_NAMES, WORKLOAD_NAMES, PeersConfig

    c = PeersConfig()
    p = sub.add_parser("peers", help="kvtool serve beside llama.cpp (llama-server), vLLM and transformers on one "
                                     "model: report.md + report.json (ratios, targets) + PNG plots")
    p.add_argument("--model", default=c.model, help="a GGUF file, or smollm2 / qwen25 (the offline test models); "
                   "llama.cpp serves the GGUF, the others the HF folder kvtool converts it to")
    p.add_argument("--engines", nargs="+", default=c.engines, choices=ENGINE_NAMES, metavar="NAME",
                   help=f"engines to run: {' '.join(ENGINE_NAMES)}")
    p.add_argument("--workloads", nargs="+", default=c.workloads, choices=WORKLOAD_NAMES, metavar="NAME",
                   help=f"workloads to run: {' '.join(WORKLOAD_NAMES)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--repeats", type=int, default=c.repeats, help="timed runs per measurement after the warm-up")
    p.add_argument("--decode-tokens", type=int, default=c.decode_tokens, help="tokens of the bs=1 decode")
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=c.ttft_lengths, help="cold TTFT prompt lengths")
    p.add_argument("--streams", type=int, nargs="+", default=c.streams, help="concurrent stream counts")
    p.add_argument("--stream-tokens", type=int, default=c.stream_tokens, help="tokens each stream generates")
    p.add_argument("--scenarios", nargs="+", default=c.scenarios, metavar="NAME",
                   help=f"context-layout scenarios (default: all: {' '.join(c.scenarios)})")
    p.add_argument("--scenario-requests", type=int, default=c.scenario_requests,
                   help="requests per context-layout scenario")
    p.add_argument("--warmup", type=int, default=c.warmup, help="untimed runs before each measurement")
    p.add_argument("--rounds", type=int, default=c.rounds,
                   help="runs of every engine, in alternating order (A B C C B A ...); figures are their median")
    p.add_argument("--settle-max-s", type=float, default=c.settle_max_s,
                   help="before each engine, wait up to this long for the machine's load to decay (0: no wait)")
    p.add_argument("--client-prompts", type=int, default=c.client_prompts, help="vllm-bench: requests")
    p.add_argument("--client-prefix-tokens", type=int, default=c.client_prefix_tokens,
                   help="vllm-bench: tokens of the prefix every prompt shares")
    p.add_argument("--client-input-tokens", type=int, default=c.client_input_tokens,
                   help="vllm-bench: random tokens after the shared prefix")
    p.add_argument("--client-output-tokens", type=int, default=c.client_output_tokens,
                   help="vllm-bench: tokens each request generates")
    p.add_argument("--client-concurrency", type=int, default=c.client_concurrency,
                   help="vllm-bench: requests in flight at once")
    p.add_argument("--kv-mib", type=int, default=c.kv_mib, help="KV budget of every server (MiB)")
    p.add_argument("--prefix-cache-mib", type=int, default=c.prefix_cache_mib,
                   help="kvtool's prefix-cache budget (MiB)")
    p.add_argument("--threads", nargs="+", default=c.threads, metavar="N",
                   help="thread counts: one pass of every engine per count, each given the same count; 'all' is "
                        "every core (default: 1 all)")
    p.add_argument("--vllm-python", default=c.vllm_python,
                   help="python of the environment vLLM is installed in (default: $KVTOOL_VLLM_PYTHON, else this one)")
    p.add_argument("--vllm-dtype", default=c.vllm_dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out-dir", default=c.out_dir, help="default: benchmarks/results/peers-<model>[-quick]")
    p.set_defaults(func=run_peers)


def check_endpoint(url: str | None) -> None:
    """An --endpoint is a base URL: say so before the in-process half of a benchmark runs."""
    from urllib.parse import urlparse

    from kvtool.errors import InvalidParameterError

    if url is not None and (urlparse(url).scheme not in ("http", "https") or not urlparse(url).netloc):
        raise InvalidParameterError(f"--endpoint {url!r} is not a base URL; give one like http://127.0.0.1:8000")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _bench_model(args):
    from kvtool.bench.loading import load_bench_model

    return load_bench_model(args.model, args.shape, args.device, args.dtype, announce=_log, weights=args.weights,
                            tokenizer=args.tokenizer)


def run_decode(args) -> int:
    from kvtool.bench.decode import config_from_args, report, run_decode_bench

    cfg = config_from_args(args).validate()
    check_writable(args.out, "--out")
    with _bench_model(args) as bm:
        report(run_decode_bench(bm, cfg, log=_log), args.out)
    return 0


def run_ttft(args) -> int:
    from kvtool.bench.backends import EndpointBackend, InProcessBackend
    from kvtool.bench.scenarios import ScenarioConfig
    from kvtool.bench.ttft import TTFTBenchConfig, report, run_ttft_bench

    cfg = TTFTBenchConfig(scenarios=args.scenarios, repeats=args.repeats, max_tokens=args.max_tokens,
                          warmup=args.warmup, out=args.out)
    scenario_cfg = ScenarioConfig(requests=args.requests, policy_paragraphs=args.policy_paragraphs, tools=args.tools,
                                  window_turns=args.window_turns)
    cfg.validate(), scenario_cfg.validate()  # all of it before the model loads
    if args.block_size < 1:
        from kvtool.errors import InvalidParameterError

        raise InvalidParameterError(f"--block-size must be an integer >= 1, got {args.block_size}")
    check_writable(args.out, "--out")
    check_writable(args.png, "--png")
    check_endpoint(args.endpoint)
    if args.endpoint:
        backend = EndpointBackend(args.endpoint, args.served_model, args.api_key, args.max_tokens)
    else:
        backend = InProcessBackend.load(args.model, args.device, args.dtype, args.cache_bytes, args.block_size,
                                        args.max_tokens, announce=_log, weights=args.weights)
    report(run_ttft_bench(backend, cfg, scenario_cfg, log=_log), args.out, args.png)
    return 0


def run_prefix(args) -> int:
    from kvtool.bench.prefix import PrefixBenchConfig, report, run_prefix_bench

    cfg = PrefixBenchConfig(prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, repeats=args.repeats,
                            warmup=args.warmup, block_size=args.block_size, baseline=args.baseline,
                            out=args.out).validate()
    check_writable(args.out, "--out")
    with _bench_model(args) as bm:
        report(run_prefix_bench(bm, cfg, log=_log), args.out)
    return 0


def run_skills(args) -> int:
    from kvtool.bench.skills import config_from_args, report, run_skills_bench

    cfg = config_from_args(args).validate()
    check_writable(cfg.out, "--out")
    check_writable(cfg.plot, "--plot")
    with _bench_model(args) as bm:
        report(run_skills_bench(bm, cfg, log=_log), cfg.out, cfg.plot)
    return 0


def run_engines(args) -> int:
    import tempfile
    from pathlib import Path

    from kvtool.bench.engines import EnginesBenchConfig, run_engines_bench
    from kvtool.integrations.vllm import available
    from kvtool.errors import InvalidParameterError

    if not available():
        raise InvalidParameterError("kvtool bench engines needs vLLM: pip install -e '.[vllm]'")
    check_writable(args.out, "--out")
    cfg = EnginesBenchConfig(repeats=args.repeats, out=args.out)
    if args.engine_arg is not None:
        cfg.engine_args = list(args.engine_arg)
    with tempfile.TemporaryDirectory(prefix="kvtool-bench-engines-") as workdir:
        run_engines_bench(args.model, cfg, Path(workdir))
    return 0


def run_batching(args) -> int:
    from kvtool.bench.batching import config_from_args, report, run_batching_bench

    cfg = config_from_args(args).validate()
    check_writable(cfg.out, "--out")
    check_writable(cfg.png, "--png")
    check_endpoint(args.endpoint)
    endpoint = {"url": args.endpoint, "model": args.served_model, "api_key": args.api_key} if args.endpoint else None
    with _bench_model(args) as bm:
        record = run_batching_bench(bm, cfg, endpoint, log=_log)
    report(record, cfg.out, cfg.png)
    return 1 if record["errors"] else 0


def run_all(args) -> int:
    from kvtool.bench.report import ReportConfig, run_report

    rc = ReportConfig(model=args.model, shape=args.shape, device=args.device, dtype=args.dtype, weights=args.weights,
                      tokenizer=args.tokenizer, endpoint=args.endpoint, served_model=args.served_model,
                      api_key=args.api_key, quick=args.quick, only=args.only, out_dir=args.out_dir)
    check_writable(args.out_dir, "--out-dir", folder=True)
    check_endpoint(args.endpoint)
    record = run_report(rc, log=_log)
    return 1 if record["errors"] else 0


def run_peers(args) -> int:
    from kvtool.bench.peers import PeersConfig, run_peers as run
    from kvtool.bench.peers.config import parse_threads

    cfg = PeersConfig(model=args.model, engines=args.engines, workloads=args.workloads, quick=args.quick,
                      repeats=args.repeats, warmup=args.warmup, scenarios=args.scenarios,
                      scenario_requests=args.scenario_requests,
                      decode_tokens=args.decode_tokens, ttft_lengths=args.ttft_lengths,
                      streams=args.streams, stream_tokens=args.stream_tokens, threads=parse_threads(args.threads),
                      rounds=args.rounds, settle_max_s=args.settle_max_s, client_prompts=args.client_prompts,
                      client_prefix_tokens=args.client_prefix_tokens, client_input_tokens=args.client_input_tokens,
                      client_output_tokens=args.client_output_tokens, client_concurrency=args.client_concurrency,
                      kv_mib=args.kv_mib, prefix_cache_mib=args.prefix_cache_mib,
                      vllm_python=args.vllm_python, vllm_dtype=args.vllm_dtype, out_dir=args.out_dir).validate()
    check_writable(args.out_dir, "--out-dir", folder=True)
    import signal

    # a SIGTERM (a time limit, say) unwinds like Ctrl-C, so the running peer server is stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    records = run(cfg, log=_log, command=" ".join(["kvtool", *sys.argv[1:]]))
    return 1 if any(e["status"] == "failed" for r in records for e in r["engines"].values()) else 0
