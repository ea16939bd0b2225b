"""`kvtool generate "prompt"`: stream text, then one line of TTFT and speeds."""

from __future__ import annotations

import sys

from kvtool.cli.common import (add_kv_dtype_arg, add_model_args, add_sampling_args, check_writable, describe_load,
                               load_from_args, sampling_from_args)


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt, streaming")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--raw", action="store_true", help="show special tokens verbatim")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="tokenize the raw prompt without the special tokens its tokenizer adds (Gemma's <bos>)")
    p.add_argument("--suffix", default=None, help="fill in the middle: the prompt is the text before, this the text "
                                                  "after (a code model with FIM tokens, e.g. Qwen2.5-Coder)")
    p.add_argument("--cache-file", default=None, metavar="PATH",
                   help="reuse the KV of earlier prompts: load the prefix cache from PATH (if it exists), save it "
                        "there afterwards (a .kvc file, as kvtool serve --cache-file writes)")
    add_model_args(p)
    add_kv_dtype_arg(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.config import EngineConfig
    from kvtool.engine import Engine
    from kvtool.errors import InvalidParameterError
    from kvtool.models.fim import fim_format, plain_ids

    params = sampling_from_args(args)
    if args.suffix is not None and args.chat:
        raise InvalidParameterError("--suffix (fill in the middle) takes a raw prompt; drop --chat")
    if args.no_special_tokens and (args.chat or args.suffix is not None):
        raise InvalidParameterError("--no-special-tokens applies to a raw prompt; a chat prompt takes what its "
                                    "template writes and a --suffix prompt its FIM tokens: drop one of them")
    if args.system is not None and not args.chat:
        raise InvalidParameterError("--system is the system message of a chat; add --chat (a raw prompt has none)")
    check_writable(args.cache_file, "--cache-file")
    model = load_from_args(args)
    if args.suffix is not None:
        fim = fim_format(model.tokenizer, f"model {model.name}")
        ids = fim.prompt(plain_ids(model.tokenizer, args.prompt), plain_ids(model.tokenizer, args.suffix))
        params = fim.sampling(params)
    elif args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = model.encode_chat(messages)  # what the template writes, its <bos> included
    else:
        ids = model.encode(args.prompt, add_special_tokens=not args.no_special_tokens)  # as /v1/completions does
    engine = Engine(model, EngineConfig(cache_file=args.cache_file, kv_dtype=args.kv_dtype))
    if args.cache_file is not None:
        cache = attach_prefix_cache(engine)
        print(f"kvtool: prefix cache file {args.cache_file}: {describe_load(cache.loaded, 'after this run')}",
              file=sys.stderr)
    gen = engine.generate(ids, params, skip_special_tokens=not args.raw)
    for event in gen:
        sys.stdout.write(event.piece if args.raw else event.text)
        sys.stdout.flush()
    t = gen.timings
    why = gen.finish_reason + (f" {gen.stop_reason!r}" if gen.stop_reason is not None else "")
    print(f"\n[{why}] TTFT {t.ttft_ms:.1f} ms | prefill {t.prefill_tokens} tok at "
          f"{t.prefill_tokens_per_s:.1f} tok/s | decode {t.decode_tokens} tok at {t.decode_tokens_per_s:.1f} tok/s"
          + (f" | cached {t.cached_tokens} tok" if args.cache_file is not None else ""), file=sys.stderr)
    if args.cache_file is not None:
        saved = engine.prefix_cache.save(args.cache_file, model)
        print(f"kvtool: saved {saved['tokens']} cached tokens to {args.cache_file} ({saved['bytes'] / 1e6:.1f} MB)",
              file=sys.stderr)
    return 0
