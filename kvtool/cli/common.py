"""Arguments shared by subcommands; defaults come from EngineConfig/SamplingParams."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtool.config import FORWARDS, KV_DTYPES, EngineConfig, SamplingParams
from kvtool.models.loading import WEIGHTS

ENGINE = EngineConfig()
SAMPLING = SamplingParams()


def check_writable(path, what: str = "output", folder: bool = False) -> None:
    """Refuse an output path that cannot be written, before the model loads and the work is done: a file path
    that is a folder (or a folder path that is a file), or one under a file. Missing folders are created later."""
    from kvtool.errors import InvalidParameterError

    if path is None or str(path) in ("", "-"):
        return
    p = Path(path)
    if p.exists() and p.is_dir() != folder:
        raise InvalidParameterError(f"{what} {path} is {'a file' if folder else 'a folder'}; give a "
                                    f"{'folder' if folder else 'file'} path")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InvalidParameterError(f"{what} {path} cannot be written: {parent} is a file, not a folder")
            break


def describe_load(loaded: dict | None, when: str = "at shutdown") -> str:
    """What a prefix cache file gave at start (PrefixCache.loaded), as a phrase for the CLI's start line."""
    if not loaded:
        return f"not there yet; it is written {when}"
    pins = f", {loaded['pins']} pinned prefixes" if loaded["pins"] else ""
    return f"loaded {loaded['loaded_tokens']} of {loaded['tokens']} cached tokens{pins} in {loaded['ms']:.0f} ms"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"hub id, HF folder or .gguf file (default: {ENGINE.model} if available, "
                        "else the embedded SmolLM2)")
    p.add_argument("--device", default=ENGINE.device, help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default=ENGINE.dtype, help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16")
    p.add_argument("--weights", default=ENGINE.weights, choices=WEIGHTS,
                   help="int4: 4-bit projections and a bf16 output head for about 2x CPU decode (prefill unchanged); "
                        "bf16: projections and head rounded to bf16 for bf16 GEMMs (AMX: several x prefill and "
                        "batches). CPU only")
    p.add_argument("--forward", default=ENGINE.forward, choices=FORWARDS,
                   help="the path of each step: auto (the C++ CPU ops where they build), reference (the reference "
                        "PyTorch forward only, as the parity tests hold the ops to), cpu-ops (an error where they "
                        "cannot run)")
    p.add_argument("--generation-config", default=ENGINE.generation_config, metavar="auto|none|FOLDER",
                   help="sampling defaults of requests that name no temperature, top_p, top_k, min_p or "
                        "penalties: auto (the model's generation_config.json or GGUF metadata, else its card, else "
                        "llama-server's), none (temperature 1, no top-p/top-k), or FOLDER's generation_config.json "
                        "(default: %(default)s)")


def add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default=ENGINE.kv_dtype, choices=KV_DTYPES,
                   help="the KV cache's elements where steps run the C++ CPU ops: bfloat16 halves the KV memory and "
                        "the bytes attention reads (keys and values rounded as written, widened to fp32 as read); "
                        "auto: bfloat16 with --weights bf16 (and no --skills), else the model's dtype "
                        "(default: %(default)s)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate")
    model = "default: the model's (--generation-config)"
    p.add_argument("--temperature", type=float, default=SAMPLING.temperature, help=f"0 = greedy ({model})")
    p.add_argument("--top-p", type=float, default=SAMPLING.top_p, help=model)
    p.add_argument("--top-k", type=int, default=SAMPLING.top_k, help=f"0 = off ({model})")
    p.add_argument("--min-p", type=float, default=SAMPLING.min_p, help=model)
    p.add_argument("--repetition-penalty", type=float, default=SAMPLING.repetition_penalty, help=model)
    p.add_argument("--presence-penalty", type=float, default=SAMPLING.presence_penalty, help=model)
    p.add_argument("--frequency-penalty", type=float, default=SAMPLING.frequency_penalty, help=model)
    p.add_argument("--seed", type=int, default=SAMPLING.seed)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--min-tokens", type=int, default=SAMPLING.min_tokens,
                   help="no end of turn or stop string before this many tokens")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")
    p.add_argument("--json", action="store_true", help="answer with one JSON object (JSON mode)")
    p.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="answer with exactly one of these strings (repeatable)")
    p.add_argument("--regex", default=None, metavar="PATTERN", help="answer with text the whole of which matches "
                                                                    "this regular expression")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="answer with one JSON value that follows this JSON schema (a file, or the schema inline)")
    p.add_argument("--strict", action="store_true", default=SAMPLING.strict,
                   help="refuse a --json-schema with a keyword the grammar cannot enforce (else: enforce the rest)")


def json_schema_arg(value: str) -> dict:
    """--json-schema: a path to a JSON file, or the JSON text itself."""
    import json
    from pathlib import Path

    from kvtool.errors import InvalidParameterError

    text, where = value, "the --json-schema text"
    if not value.lstrip().startswith("{"):
        if not Path(value).is_file():
            raise InvalidParameterError(f"--json-schema {value!r} is neither a file nor a JSON object")
        text, where = Path(value).read_text(), value
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"{where} is not valid JSON: {exc}") from None


def logit_bias_arg(items: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS, repeated -> {id: bias}."""
    from kvtool.errors import InvalidParameterError

    bias = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise InvalidParameterError(f"--logit-bias {item!r}: write it as TOKEN_ID=BIAS, e.g. 2=-100") from None
    return bias


def sampling_from_args(args) -> SamplingParams:
    schema = json_schema_arg(args.json_schema) if getattr(args, "json_schema", None) else None
    fmt = "json_schema" if schema is not None else "json_object" if getattr(args, "json", False) else "text"
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=list(args.stop), response_format=fmt,
        json_schema=schema, min_tokens=getattr(args, "min_tokens", 0), choice=getattr(args, "choice", None),
        regex=getattr(args, "regex", None), logit_bias=logit_bias_arg(getattr(args, "logit_bias", [])),
        strict=getattr(args, "strict", SAMPLING.strict),
    ).validate()


def load_from_args(args):
    from kvtool.models.loading import load
    from kvtool.models.resolve import resolve_model_arg

    model = resolve_model_arg(args.model, announce=lambda s: print(s, file=sys.stderr))
    return load(model, device=args.device, dtype=args.dtype, weights=args.weights, forward=args.forward,
                generation_config=args.generation_config)
