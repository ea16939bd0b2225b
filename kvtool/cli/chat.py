"""`kvtool chat`: a conversation in the terminal that reuses its own KV from turn to turn.

Each turn renders the whole conversation with the chat template and generates through the prefix
cache, so only what is new since the last turn is prefilled; the line after each answer says how many
prompt tokens came from the cache (a template that rewrites earlier turns, e.g. one that drops past
reasoning, shows up there as a smaller hit). --cache-file keeps the KV across sessions.
"""

from __future__ import annotations

import sys

from kvtool.cli.common import (add_kv_dtype_arg, add_model_args, add_sampling_args, check_writable, describe_load,
                               load_from_args, sampling_from_args)

COMMANDS = {"/reset": "start a new conversation (the KV of the old one stays cached)",
            "/system TEXT": "set the system message and start a new conversation",
            "/stats": "the prefix cache's counters",
            "/exit": "quit (or Ctrl-D); Ctrl-C stops an answer"}


def register(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat in the terminal; each turn reuses the KV of the conversation so far")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--cache-file", default=None, metavar="PATH",
                   help="load the prefix cache from PATH (if it exists) and save it there when the chat ends")
    p.add_argument("--raw", action="store_true", help="show special tokens verbatim")
    add_model_args(p)
    add_kv_dtype_arg(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.config import EngineConfig
    from kvtool.engine import Engine

    params = sampling_from_args(args)
    check_writable(args.cache_file, "--cache-file")
    model = load_from_args(args)
    engine = Engine(model, EngineConfig(cache_file=args.cache_file, kv_dtype=args.kv_dtype))
    cache = attach_prefix_cache(engine)
    if args.cache_file is not None:
        say(f"kvtool: prefix cache file {args.cache_file}: {describe_load(cache.loaded, 'when the chat ends')}")
    say(f"kvtool: chatting with {model.name}; " + "; ".join(f"{c}: {what}" for c, what in COMMANDS.items()))
    system = args.system
    messages = new_conversation(system)
    try:
        while (line := read_line()) is not None:
            if not line.strip():
                continue
            if line.startswith("/"):
                command, _, rest = line.strip().partition(" ")
                if command == "/exit":
                    break
                if command == "/reset":
                    messages = new_conversation(system)
                elif command == "/system":
                    system = rest or None
                    messages = new_conversation(system)
                elif command == "/stats":
                    stats = cache.stats()
                    say(", ".join(f"{k} {stats[k]}" for k in ("queries", "hit_tokens", "hit_rate", "blocks",
                                                             "bytes_in_use", "evictions")))
                else:
                    say(f"kvtool: unknown command {command}; " + ", ".join(COMMANDS))
                continue
            turn(engine, model, messages, line, params, args.raw)
    finally:
        if args.cache_file is not None:
            saved = cache.save(args.cache_file, model)
            say(f"kvtool: saved {saved['tokens']} cached tokens to {args.cache_file}")
    return 0


def turn(engine, model, messages: list[dict], line: str, params, raw: bool) -> None:
    """One user message and the answer, streamed; the answer joins the conversation (cut short by Ctrl-C too)."""
    from kvtool.errors import KvtoolError

    try:
        gen = engine.generate(model.encode_chat(messages + [{"role": "user", "content": line}]), params,
                              skip_special_tokens=not raw)
        for event in gen:
            sys.stdout.write(event.piece if raw else event.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        gen.close()
    except KvtoolError as exc:  # e.g. the conversation outgrew the context window: say so, keep the chat
        say(f"kvtool: error: {exc} (the message was not added; /reset starts over)")
        return
    messages += [{"role": "user", "content": line}, {"role": "assistant", "content": gen.text}]
    t = gen.timings
    say(f"\n[{gen.finish_reason}] cached {t.cached_tokens} of {t.prompt_tokens} prompt tokens | TTFT "
        f"{t.ttft_ms:.0f} ms | decode {t.decode_tokens} tok at {t.decode_tokens_per_s:.1f} tok/s")


def new_conversation(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def read_line() -> str | None:
    """The next line the user types; None at the end of input or on Ctrl-C / Ctrl-D at the prompt."""
    try:
        return input("> " if sys.stdin.isatty() else "")
    except (EOFError, KeyboardInterrupt):
        return None


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
