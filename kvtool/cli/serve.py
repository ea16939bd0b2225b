"""`kvtool serve`: the OpenAI-compatible server (plus raw tokens and the rendered template)."""

from __future__ import annotations

import os
import sys

from kvtool.cli.common import ENGINE, add_kv_dtype_arg, add_model_args, check_writable, describe_load, load_from_args
from kvtool.integrations import ENGINES
from kvtool.serving.config import ServerConfig

SERVER = ServerConfig()


def register(subparsers) -> None:
    from kvtool.serving.toolparse import TOOL_FORMATS

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    add_kv_dtype_arg(p)
    p.add_argument("--host", default=SERVER.host, help="address to bind (use 0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=int, default=SERVER.port)
    p.add_argument("--api-key", default=os.environ.get("KVTOOL_API_KEY", SERVER.api_key),
                   help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics with "
                        "--metrics-open), the API docs included (default: $KVTOOL_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=SERVER.served_model_name,
                   help="the model id clients see (default: the model's name)")
    p.add_argument("--max-active", type=int, default=SERVER.max_active,
                   help="requests batched together in each decode step")
    p.add_argument("--max-queue", type=int, default=SERVER.max_queue,
                   help="requests waiting beyond --max-active; more get HTTP 429")
    p.add_argument("--default-max-tokens", type=int, default=SERVER.default_max_tokens,
                   help="max_tokens for requests that name none (default: up to the context window)")
    p.add_argument("--max-body-bytes", type=int, default=SERVER.max_body_bytes,
                   help="largest request body accepted; a larger one gets HTTP 413 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=SERVER.shutdown_timeout, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, running requests get this long to finish; then each ends with "
                        "finish_reason 'abort', the cache file is saved and the server exits; a second signal exits "
                        "at once (default: %(default)s)")
    p.add_argument("--metrics-open", action="store_true",
                   help="with --api-key: /metrics answers without the key (for a Prometheus scraper)")
    p.add_argument("--responses-store", type=int, default=SERVER.responses_store, metavar="N",
                   help="responses kept for previous_response_id; the oldest is dropped (default: %(default)s)")
    p.add_argument("--tool-parser", default=SERVER.tool_parser, choices=sorted(TOOL_FORMATS),
                   help="tool-call format of the model's output")
    p.add_argument("--cache-bytes", type=int, default=ENGINE.cache_bytes,
                   help="prefix-cache byte budget (default: half the KV memory budget: a quarter of available "
                        "memory, at most 16 GiB)")
    p.add_argument("--kv-bytes", type=int, default=SERVER.kv_bytes,
                   help="KV budget of the running requests; beyond it the newest is preempted and recomputed later "
                        "(default: the other half of the KV memory budget, a quarter of available memory)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn cross-request KV reuse off")
    p.add_argument("--cache-file", default=ENGINE.cache_file, metavar="PATH",
                   help="load the prefix cache from PATH at start (if it exists) and save it there at shutdown and on "
                        "POST /v1/cache/save, so a restart keeps the cached prefixes (a .kvc file)")
    p.add_argument("--cache-save-every", type=float, default=SERVER.cache_save_every, metavar="SECONDS",
                   help="also save the prefix cache to --cache-file every SECONDS when it changed, so a crash loses "
                        "at most that much (default: only at shutdown and on POST /v1/cache/save)")
    p.add_argument("--kv-store", default=ENGINE.kv_store, metavar="LOCATION",
                   help="a block store other servers share (a folder, or redis://host:port/db): the prefix cache "
                        "adopts the blocks another server stored and stores its own (docs/cache.md)")
    p.add_argument("--kv-store-bytes", type=int, default=ENGINE.kv_store_bytes, metavar="N",
                   help="a folder store's size limit, for every server on it (default: the folder's own, else 16 GiB)")
    p.add_argument("--skills", default=ENGINE.skills_dir, metavar="DIR",
                   help="a skills folder (NAME/SKILL.md, *.md): compile (or load cached) KV blocks at start and "
                        "splice them into prompts that contain a skill; requests may ask for skills by name")
    p.add_argument("--skill-repair", default=ENGINE.skill_repair, metavar="SPEC",
                   help="repair of spliced blocks: none | recompute_first_k:k=N | recompute_deviation:ratio=R | "
                        "recompute_attended:ratio=R (default: %(default)s)")
    p.add_argument("--skill-min-tokens", type=int, default=ENGINE.skill_min_tokens, metavar="N",
                   help="prefill, rather than splice, skill blocks shorter than N tokens (splicing a short block "
                        "costs more than its prefill; default: %(default)s)")
    p.add_argument("--skill-preamble", default=ENGINE.skill_preamble, metavar="SPEC",
                   help="what skill blocks are compiled after: deep[:tokens=N] | conversation | none "
                        "(default: %(default)s; see kvtool skill compile --help)")
    p.add_argument("--engine", default="kvtool", choices=ENGINES,
                   help="what computes: kvtool's own engine, or vLLM (the [vllm] extra; docs/vllm.md)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="with --engine vllm: one of vLLM's engine arguments, e.g. tensor_parallel_size=2 or "
                        "max_model_len=4096 (repeatable)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def config_from_args(args) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                        served_model_name=args.served_model_name, max_active=args.max_active,
                        max_queue=args.max_queue, default_max_tokens=args.default_max_tokens,
                        tool_parser=args.tool_parser, cache_save_every=getattr(args, "cache_save_every", None),
                        kv_bytes=getattr(args, "kv_bytes", None),
                        max_body_bytes=getattr(args, "max_body_bytes", SERVER.max_body_bytes),
                        shutdown_timeout=getattr(args, "shutdown_timeout", SERVER.shutdown_timeout),
                        metrics_open=getattr(args, "metrics_open", SERVER.metrics_open),
                        responses_store=getattr(args, "responses_store", SERVER.responses_store)).validate()


def run(args) -> int:
    from kvtool.config import EngineConfig
    from kvtool.errors import InvalidParameterError
    from kvtool.serving.server import check_listen, serve
    from kvtool.skill_settings import canonical_preamble

    cfg = config_from_args(args)
    if args.engine == "vllm":
        from kvtool.cli.serve_vllm import run_vllm

        return run_vllm(args, cfg)
    if args.engine_arg:
        raise InvalidParameterError("--engine-arg passes settings to vLLM; it needs --engine vllm")
    if args.skills is not None and not os.path.isdir(args.skills):
        raise InvalidParameterError(f"--skills {args.skills!r} is not a folder of skills (NAME/SKILL.md or *.md)")
    if cfg.cache_save_every is not None and args.cache_file is None:
        raise InvalidParameterError("--cache-save-every saves the prefix cache to --cache-file; give --cache-file PATH")
    # bad preamble or repair specs, and a --cache-file without the prefix cache, fail before the model loads
    canonical_preamble(args.skill_preamble)
    engine_config = EngineConfig(cache_bytes=args.cache_bytes, enable_prefix_cache=not args.no_prefix_cache,
                                 cache_file=args.cache_file, kv_store=args.kv_store,
                                 kv_store_bytes=args.kv_store_bytes, skills_dir=args.skills,
                                 skill_repair=args.skill_repair,
                                 skill_preamble=args.skill_preamble,
                                 skill_min_tokens=args.skill_min_tokens, forward=args.forward, kv_dtype=args.kv_dtype,
                                 generation_config=args.generation_config).validate()
    check_writable(args.cache_file, "--cache-file")
    if args.kv_store is not None:  # a store that cannot open (a file, no Redis server there) fails before the load
        from kvtool.cache.kvstore import open_store

        open_store(args.kv_store, args.kv_store_bytes).close()
    check_listen(cfg.host, cfg.port)  # so does a port in use
    model = load_from_args(args)
    auth = "API key required" if cfg.api_key else "no API key"
    weights = model.info.get("weights", "dense")

    def announce(app=None):  # once the engine (prefix cache, skills) is built from valid options
        print(f"kvtool: serving {cfg.served_model_name or model.name} on http://{cfg.host}:{cfg.port}/v1 "
              f"({model.info.get('device')}, {model.info.get('dtype')}"
              f"{'' if weights == 'dense' else f', {weights} weights'}"
              f"{', reference forward' if model.info.get('forward') == 'reference' else ''}, {auth})", file=sys.stderr)
        print(f"kvtool: sampling defaults (requests that name none): {model.sampling_defaults.describe()}",
              file=sys.stderr)
        if args.cache_file is not None:
            cache = getattr(app.state, "prefix_cache", None) if app is not None else None
            print(f"kvtool: prefix cache file {args.cache_file}: {describe_load(cache and cache.loaded)}",
                  file=sys.stderr)

    serve(model, cfg, engine_config=engine_config, log_level=args.log_level, on_ready=announce)
    return 0
