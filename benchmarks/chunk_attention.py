"""One layer's causal attention for a chunk of new tokens (a cold prefill with --prefix 0, a prefix hit's suffix, a
later prefill chunk), in a model's shape: the C++ prefill path's kernel (torch.ops.kvtool_cpu.prefill_attention,
kvtool/kernels/cpu_attention.cpp: each KV head's group of query heads scored in one pass, no mask; at its widest
vectors and at eight lanes, the AVX2 width, which must give the same bits) beside ATen's flash attention as the
reference forward calls it (its causal path for a cold chunk, else an explicit causal mask over the whole cache, K/V
repeated per query head). All three alternate run by run on the same inputs; each timed run is every layer of the
model once. JSON record as the last line.

    python benchmarks/chunk_attention.py --model smollm2 --prefix 0 2048 --tokens 64 512 2048
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kvtool.bench.loading import load_bench_model
from kvtool.bench.protocol import device_name, emit, measure_side_by_side, paired_speedup, versions
from kvtool.kernels.cpu_decode import unavailable
from kvtool.models.layers import causal_mask


def cases(spec, prefix: int, tokens: int, gen: torch.Generator):
    """Per layer: q [t, hq, d] and keys/values [1, hkv, prefix + t, d], random, as the prefill pass holds them."""
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    return [(torch.randn(tokens, hq, d, generator=gen), torch.randn(1, hkv, prefix + tokens, d, generator=gen),
             torch.randn(1, hkv, prefix + tokens, d, generator=gen)) for _ in range(spec.num_layers)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="whose shape (heads, KV heads, head size, layers)")
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048], help="cached tokens")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 512], help="the chunk's new tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if min(args.prefix) < 0 or min(args.tokens) < 2 or args.repeats < 1:
        p.error("--prefix must be at least 0, --tokens at least 2, --repeats at least 1")
    if (why := unavailable()) is not None:
        p.error(f"the C++ ops did not load: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    bm = load_bench_model(args.model, device="cpu", dtype="float32", announce=lambda s: print(s, file=sys.stderr))
    spec, gen, rows = bm.runner.spec, torch.Generator().manual_seed(0), []
    for prefix in args.prefix:
        for tokens in args.tokens:
            layers = cases(spec, prefix, tokens, gen)
            mask = causal_mask(tokens, prefix + tokens, "cpu") if prefix else None
            kernel = torch.ops.kvtool_cpu.prefill_attention
            print(f"{prefix} cached + {tokens} new tokens, {len(layers)} layers", file=sys.stderr)

            def aten(q, keys, values):
                return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                                      is_causal=mask is None, enable_gqa=True)[0].transpose(0, 1)

            def theirs():
                with torch.inference_mode():
                    for q, keys, values in layers:
                        aten(q, keys, values)

            def ours(width=0):
                with torch.inference_mode():
                    for q, keys, values in layers:
                        kernel(q, [], 0, keys, values, 0, prefix, width)

            q, keys, values = layers[0]
            out = kernel(q, [], 0, keys, values, 0, prefix)
            error = (out - aten(q, keys, values)).abs().max().item()
            same = torch.equal(out, kernel(q, [], 0, keys, values, 0, prefix, 8))
            ms = measure_side_by_side({"aten": theirs, "kvtool": ours, "kvtool_8_lanes": lambda: ours(8)},
                                      args.repeats, 1)
            rows.append({"prefix": prefix, "tokens": tokens, "ms": ms, "max_abs_error": error,
                         "speedup": paired_speedup(ms["kvtool"], ms["aten"], rate=False),
                         "over_8_lanes": paired_speedup(ms["kvtool"], ms["kvtool_8_lanes"], rate=False),
                         "same_bits_as_8_lanes": same})
    record = {"benchmark": "chunk_attention", "compares": "kvtool's kernel over ATen's flash", "model": bm.name,
              "device": device_name(bm.device),
              "threads": torch.get_num_threads(), "load_avg": round(os.getloadavg()[0], 2),
              "shape": {"layers": spec.num_layers, "heads": spec.num_heads, "kv_heads": spec.num_kv_heads,
                        "head_dim": spec.head_dim}, "rows": rows, "versions": versions()}
    print("\ncached  new    aten ms  kvtool ms  speedup (min-max)  8 lanes ms  over 8 lanes  same bits")
    for r in rows:
        s, w = r["speedup"], r["over_8_lanes"]
        print(f"{r['prefix']:>6}{r['tokens']:>5}{r['ms']['aten']['median']:>11.1f}{r['ms']['kvtool']['median']:>11.1f}"
              f"{s['median']:>8.2f}x ({s['min']:.2f}-{s['max']:.2f}){r['ms']['kvtool_8_lanes']['median']:>12.1f}"
              f"{w['median']:>9.2f}x{str(r['same_bits_as_8_lanes']):>11}")
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
