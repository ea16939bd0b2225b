"""Saving the prefix cache: time and bytes written per save against cached tokens, the incremental writer
(format version 2: new blocks appended, manifest replaced) side by side with a full rewrite (format
version 1, what every save did before), in the same run on the same cache states.

The cache has SmolLM2-135M's KV shape as served on CPU (30 layers, 3 KV heads, head_dim 64, float32:
46 KB per token). For each size, each repeat adds one new 256-token prompt's KV (what a finished request
adds) and saves it both ways; one more save after nothing but hits shows what that costs.

    python benchmarks/cache_save.py --sizes 1024 2048 4096 6144 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, summary, versions  # noqa: E402

from kvtool.cache.manager import PrefixCache  # noqa: E402
from kvtool.cache.persist import save_cache, save_cache_full  # noqa: E402

SETUP = {"model": "SmolLM2-135M-shape", "config_hash": "0", "tokenizer_hash": "0", "dtype": "float32", "rope": "{}"}
SHAPE = (30, 3, 64)  # layers, KV heads, head_dim
BLOCK = 16


def add_prompt(cache: PrefixCache, rng: random.Random, tokens: int) -> None:
    ids = [rng.randrange(1, 49152) for _ in range(tokens)]
    layers, heads, dim = SHAPE
    cache.import_chain(ids, lambda i: (torch.randn(layers, heads, BLOCK, dim), torch.randn(layers, heads, BLOCK, dim)))


def run_size(cached: int, repeats: int, folder: Path, seed: int) -> dict:
    rng = random.Random(seed)
    cache = PrefixCache(*SHAPE, budget_bytes=1 << 34, block_size=BLOCK)
    while cache.stats()["blocks"] * BLOCK < cached:
        add_prompt(cache, rng, 512)
    full_path, inc_path = folder / f"full-{cached}.kvc", folder / f"inc-{cached}.kvc"
    save_cache(cache, inc_path, SETUP)  # the file as a server that has saved before has it
    rows = {"full": {"ms": [], "written_bytes": []}, "incremental": {"ms": [], "written_bytes": []}}
    for _ in range(repeats):
        add_prompt(cache, rng, 256)
        for label, writer, path in (("full", save_cache_full, full_path), ("incremental", save_cache, inc_path)):
            t0 = time.perf_counter()
            info = writer(cache, path, SETUP)
            rows[label]["ms"].append((time.perf_counter() - t0) * 1000)
            rows[label]["written_bytes"].append(info["written_bytes"])
    t0 = time.perf_counter()
    hits = save_cache(cache, inc_path, SETUP)  # nothing new since the last save
    hits_ms = (time.perf_counter() - t0) * 1000
    out = {"cached_tokens": cache.stats()["blocks"] * BLOCK, "new_tokens_per_save": 256}
    for label, row in rows.items():
        out[label] = {"ms": summary(row["ms"]), "written_bytes": summary(row["written_bytes"])}
    out["speedup_median"] = round(out["full"]["ms"]["median"] / out["incremental"]["ms"]["median"], 2)
    out["after_hits_only"] = {"ms": round(hits_ms, 2), "written_bytes": hits["written_bytes"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 6144], help="cached tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cache_save-cpu.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvtool-cache-save-") as tmp:
        results = [run_size(size, args.repeats, Path(tmp), seed=size) for size in args.sizes]
    for r in results:
        print(f"{r['cached_tokens']:>6} cached tokens: full rewrite {r['full']['ms']['median']:8.1f} ms "
              f"{r['full']['written_bytes']['median'] / 1e6:7.1f} MB | incremental "
              f"{r['incremental']['ms']['median']:7.1f} ms {r['incremental']['written_bytes']['median'] / 1e6:6.1f} MB"
              f" | after hits only: {r['after_hits_only']['written_bytes']} bytes", file=sys.stderr)
    emit({"benchmark": "cache_save", "kv_shape": {"layers": SHAPE[0], "kv_heads": SHAPE[1], "head_dim": SHAPE[2],
                                                  "dtype": "float32", "block_size": BLOCK},
          "repeats": args.repeats, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
          "versions": versions(), "results": results}, args.out)


if __name__ == "__main__":
    main()
