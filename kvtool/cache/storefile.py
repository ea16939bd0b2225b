"""Between a block store (kvtool.cache.kvstore) and a prefix-cache file (.kvc, kvtool.cache.persist): the file is
how one model's blocks leave a store and enter another.

export_store writes the chains of one model and layout that a store holds whole (a block whose parent was evicted
is left out) to a .kvc, through a PrefixCache of their shape; import_file loads a .kvc into such a cache and
publishes its chains to a store. Neither needs the model: the layout comes from the records or the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvtool.cache.blockrecord import Layout, decode
from kvtool.cache.kvfile import SETUP_FIELDS
from kvtool.cache.kvstore import KVStore
from kvtool.cache.manager import PrefixCache
from kvtool.cache.persist import load_cache, open_file, save_cache
from kvtool.cache.shared import MAX_QUEUED_BLOCKS, SharedBlocks
from kvtool.errors import InvalidParameterError


def cache_for(layout: Layout, blocks: int) -> PrefixCache:
    """An empty PrefixCache of ``layout``'s shape with room for ``blocks`` blocks."""
    _, layers, heads, size, dim = layout.shape
    bytes_per_block = 2 * layers * heads * size * dim * getattr(torch, layout.dtype).itemsize
    return PrefixCache(layers, heads, dim, budget_bytes=max(blocks, 1) * bytes_per_block, block_size=size,
                       dtype=getattr(torch, layout.dtype))


def export_store(store: KVStore, path: str | Path, model: str | None = None) -> dict:
    """Write the whole chains of one layout in ``store`` to the .kvc ``path``; ``model`` picks the layout by model
    name where the store holds several. Returns what was saved (kvtool.cache.persist.save_cache)."""
    records: dict[str, dict[str, tuple]] = {}  # layout root -> key -> (parent, tokens, payload)
    layouts: dict[str, Layout] = {}
    for key in list(store.keys()):
        if (found := decode(store.get(key), key)) is None:
            continue
        header, payload = found
        d = header["layout"]
        layout = Layout.from_dict(d)
        if len(header["tokens"]) != layout.block_size:  # a partial tail (Layout.tail_key): no block of a .kvc
            continue
        if model is None or d["setup"].get("model") == model:
            layouts[layout.root.hex()] = layout
            records.setdefault(layout.root.hex(), {})[key] = (header["parent"], header["tokens"], payload)
    if len(layouts) != 1:
        names = sorted({f"{x.setup.get('model')} ({x.dtype})" for x in layouts.values()})
        raise InvalidParameterError(f"kv store {store.location}: " + (
            f"holds blocks of {len(layouts)} models or layouts ({', '.join(names)}); name one with --model"
            if layouts else f"holds no blocks{f' of {model}' if model else ''} to export"))
    (root, layout), = layouts.items()
    if layout.shape[2] != layout.num_kv_heads:
        raise InvalidParameterError(f"kv store {store.location}: its blocks hold KV heads {list(layout.heads)} of "
                                    f"{layout.num_kv_heads}; a .kvc file holds every head")
    blocks = records[root]
    cache = cache_for(layout, len(blocks))
    parents = {parent for parent, _, _ in blocks.values()}
    for leaf in (key for key in blocks if key not in parents):
        chain = [leaf]
        while blocks[chain[-1]][0] is not None and blocks[chain[-1]][0] in blocks:
            chain.append(blocks[chain[-1]][0])
        if blocks[chain[-1]][0] is not None:  # an ancestor was evicted: the chain cannot be spelled from a root
            continue
        chain.reverse()
        tokens = [t for key in chain for t in blocks[key][1]]
        kv = [torch.frombuffer(bytearray(blocks[key][2]), dtype=cache.store.dtype).reshape(layout.shape)
              for key in chain]
        cache.import_chain(tokens, lambda i: tuple(kv[i]))
    return save_cache(cache, path, {k: layout.setup[k] for k in SETUP_FIELDS})


def import_file(path: str | Path, store: KVStore) -> dict:
    """Publish every chain of the .kvc ``path`` to ``store``; {"blocks", "tokens", "written_blocks"}."""
    with open_file(path) as f:
        meta = dict(f.meta)
    _, layers, heads, size, dim = json.loads(meta["kv_shape"])
    layout = Layout({k: meta[k] for k in SETUP_FIELDS}, layers, heads, dim, meta["kv_dtype"], size)
    cache = cache_for(layout, int(meta.get("n_blocks", 0)))
    load_cache(cache, path, layout.setup)
    shared = SharedBlocks(store, layout)
    rows, _, _ = cache.export_blocks()
    parents = {parent for _, parent, _, _ in rows}
    by_id = {block_id: (parent, tokens) for block_id, parent, tokens, _ in rows}
    for leaf in (block_id for block_id, *_ in rows if block_id not in parents):
        chain = [leaf]
        while by_id[chain[-1]][0] is not None:
            chain.append(by_id[chain[-1]][0])
        chain.reverse()
        tokens, new = [t for block_id in chain for t in by_id[block_id][1]], list(enumerate(chain))
        for start in range(0, len(new), MAX_QUEUED_BLOCKS):  # what the writer's queue takes at once
            shared.save(tokens, new[start : start + MAX_QUEUED_BLOCKS], cache.store)
            shared.flush()
    return {"blocks": len(rows), "tokens": len(rows) * size, "written_blocks": shared.stats["store_written_blocks"]}
