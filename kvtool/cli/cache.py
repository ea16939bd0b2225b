"""`kvtool cache info FILE|STORE`: what a saved prefix cache (.kvc) or a shared block store holds, without a server."""

from __future__ import annotations

import json
import os

from kvtool.cli.common import add_model_args, load_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("cache", help="inspect a saved prefix cache (.kvc, from --cache-file)")
    sub = p.add_subparsers(dest="cache_command", metavar="<action>", required=True)
    i = sub.add_parser("info", help="verify a .kvc file; print its setup, sizes and the tree of its prefixes; or "
                                    "what a block store (--kv-store: a folder or redis://host:port/db) holds")
    i.add_argument("path", help="the .kvc file, or a block store")
    i.add_argument("--text", action="store_true", help="decode each segment with the model (--model) it was saved for")
    i.add_argument("--max-chars", type=int, default=120, help="characters of text per segment (default: %(default)s)")
    i.add_argument("--json", action="store_true", help="print the description as JSON")
    add_model_args(i)
    i.set_defaults(func=info)
    e = sub.add_parser("export", help="write one model's chains in a block store to a .kvc file")
    e.add_argument("store", help="the block store: a folder or redis://host:port/db")
    e.add_argument("path", help="the .kvc file to write")
    e.add_argument("--model-name", default=None, help="the model whose blocks to export, where the store holds several")
    e.set_defaults(func=export)
    m = sub.add_parser("import", help="publish the prefixes of a .kvc file to a block store")
    m.add_argument("path", help="the .kvc file")
    m.add_argument("store", help="the block store: a folder (made if missing) or redis://host:port/db")
    m.set_defaults(func=import_)


def info(args) -> int:
    from kvtool.cache.kvfile import setup_of, setup_mismatches
    from kvtool.cache.persist import describe_file
    from kvtool.cache.tree import add_text, walk
    from kvtool.errors import InvalidParameterError

    if args.max_chars < 1:
        raise InvalidParameterError(f"--max-chars must be >= 1, got {args.max_chars}")
    if os.path.isdir(args.path) or "://" in args.path:
        return store_info(args)
    described = describe_file(args.path)
    if args.text:
        model = load_from_args(args)
        diffs = setup_mismatches(described["setup"], setup_of(model), what="file")
        if diffs:
            raise InvalidParameterError(f"--text: {args.path} was saved for another setup ({'; '.join(diffs)}); "
                                        "give the model it was saved for with --model")
        add_text(described["tree"], model.decode, args.max_chars)
    for segment in walk(described["tree"]):
        del segment["token_ids"]
    if args.json:
        print(json.dumps(described, indent=1))
        return 0
    s = described["setup"]
    print(f"{described['path']}: prefix cache of {s['model']} ({s['dtype']}), {described['tokens']} tokens in "
          f"{described['blocks']} blocks of {described['block_size']}, {described['pins']} pins, "
          f"{described['bytes'] / 1e6:.1f} MB")
    todo = [(segment, 1) for segment in reversed(described["tree"])]
    while todo:
        segment, depth = todo.pop()
        pinned = f", {segment['pinned_tokens']} pinned" if segment["pinned_tokens"] else ""
        text = f": {json.dumps(segment['text'], ensure_ascii=False)}" if "text" in segment else ""
        print(f"{'  ' * depth}[{segment['start']}, {segment['start'] + segment['tokens']}) {segment['tokens']} tokens"
              f"{pinned}{text}")
        todo += [(child, depth + 1) for child in reversed(segment["children"])]
    return 0


def check_store(location: str) -> None:
    """Refuse a folder that is not a block store (opening one would make it one)."""
    from kvtool.errors import InvalidParameterError

    if "://" not in location and not os.path.isfile(os.path.join(location, "store.json")):
        raise InvalidParameterError(f"{location} is not a kvtool block store (a folder with store.json, as an "
                                    "engine's --kv-store writes it, or redis://host:port/db)")


def store_info(args) -> int:
    """What a block store holds: its usage and limit, and its blocks per model and layout."""
    from kvtool.cache.kvstore import open_store
    from kvtool.cache.shared import describe_store

    check_store(args.path)
    store = open_store(args.path)
    try:
        described = describe_store(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps(described, indent=1))
        return 0
    limit = f"{described['limit_bytes'] / 1e6:.1f} MB" if described["limit_bytes"] else "no limit"
    damaged = f", {described['damaged']} damaged records" if described["damaged"] else ""
    print(f"{described['location']}: block store ({described['backend']}), {described['blocks']} blocks, "
          f"{described['bytes'] / 1e6:.1f} MB of {limit}{damaged}")
    for row in described["layouts"]:
        start, stop = row["heads"]
        heads = "" if (start, stop) == (0, row["kv_heads"]) else f", KV heads {start}..{stop - 1}"
        print(f"  {row['model']} ({row['dtype']}, {row['layers']} layers x {row['kv_heads']} KV heads x "
              f"{row['head_dim']}{heads}): {row['tokens']} tokens in {row['blocks']} blocks of {row['block_size']}, "
              f"{row['bytes'] / 1e6:.1f} MB, {row['roots']} chains, {row['orphans']} blocks whose parent was evicted")
    return 0


def export(args) -> int:
    from kvtool.cache.kvstore import open_store
    from kvtool.cache.storefile import export_store

    check_store(args.store)
    store = open_store(args.store)
    try:
        saved = export_store(store, args.path, args.model_name)
    finally:
        store.close()
    print(f"kvtool: exported {saved['tokens']} tokens in {saved['blocks']} blocks from {args.store} to {args.path}")
    return 0


def import_(args) -> int:
    from kvtool.cache.kvstore import open_store
    from kvtool.cache.storefile import import_file

    store = open_store(args.store)
    try:
        done = import_file(args.path, store)
    finally:
        store.close()
    print(f"kvtool: imported {done['tokens']} tokens in {done['blocks']} blocks from {args.path} to {args.store} "
          f"({done['written_blocks']} blocks new there)")
    return 0
