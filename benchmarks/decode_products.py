"""The matmuls of a decode step on the CPU at one to a few rows, over the model's own weights (every layer's, so
they stream from memory as in a step), alternating run by run: fp32, the ops' own `gemv` beside oneDNN's packed
GEMM (the runner's product); int4 (--weights int4), the ops' `gemv_q4` beside oneDNN's packed GEMM over the dense
values the grid stands for, and the head's first pass, `gemv_q8` over its 8-bit copy beside `gemv` over a bf16 one.
Each row says which one the decode path takes there (fp32:
kvtool.kernels.cpu_decode.gemv_takes; int4: up to kvtool.kernels.quant.MAX_ROWS rows) and how it compares with
the other. JSON record as the last line.

    python benchmarks/decode_products.py --model qwen25 --threads 1 --rows 1 2 3 4
    python benchmarks/decode_products.py --model qwen25 --threads 1 --weights int4 --rows 1 4 5 6 8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from kvtool.bench.loading import load_bench_model
from kvtool.bench.protocol import device_name, emit, measure_side_by_side, paired_speedup, versions
from kvtool.kernels import cpu_decode, cpu_gemm, quant


def products(model) -> dict[str, list]:
    """name -> every layer's weight of that projection (the fused qkv and gate_up as the runner holds them): a
    PackedWeight (fp32), or an Int4Weight with its `wide` oneDNN copy (int4); only the projections so held."""
    named = {"qkv": lambda layer: layer.self_attn._wqkv,
             "o": lambda layer: getattr(layer.self_attn.o_proj, "packed", None),
             "gate_up": lambda layer: layer.mlp._wgu,
             "down": lambda layer: getattr(layer.mlp.down_proj, "packed", None)}
    out = {name: [get(layer) for layer in model.layers] for name, get in named.items()}
    return {name: ws for name, ws in out.items() if all(
        isinstance(w, cpu_gemm.PackedWeight) or isinstance(w, quant.Int4Weight) and w.wide is not None for w in ws)}


def head_rows(runner, counts: list[int], repeats: int, gen: torch.Generator) -> list[dict]:
    """The int4 head's first pass (kvtool.kernels.quant.head_logits) at each row count up to GEMV_MAX_ROWS: gemv_q8
    over its 8-bit copy (taken) beside gemv over a bf16 copy of the dense head, alternating."""
    ops, small, out = torch.ops.kvtool_cpu, runner._head_q8, []
    half = runner.output_weight.detach().bfloat16().contiguous()
    for count in [c for c in counts if c <= cpu_decode.GEMV_MAX_ROWS] if small is not None else []:
        x = torch.randn(count, half.shape[1], generator=gen)

        def q8():
            ops.gemv_q8(x, small.codes, small.scale)

        def bf16():
            ops.gemv(x, half, None, None)

        with torch.inference_mode():
            ms = measure_side_by_side({"q8": q8, "bf16": bf16}, repeats, 1)
        out.append({"product": "head", "n": half.shape[0], "k": half.shape[1], "rows": count, "ms": ms,
                    "taken": "q8", "taken_over_other": paired_speedup(ms["q8"], ms["bf16"], rate=False)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4], help="x rows (sequences in the step)")
    p.add_argument("--weights", choices=["dense", "int4"], default="dense")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    most = cpu_decode.GEMV_MAX_ROWS if args.weights == "dense" else 16
    if min(args.rows) < 1 or max(args.rows) > most or args.repeats < 1:
        p.error(f"--rows must be in 1..{most} (where the ops' kernel may run), --repeats at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    bm = load_bench_model(args.model, device="cpu", dtype="float32", announce=lambda s: print(s, file=sys.stderr),
                          weights=args.weights)
    why = cpu_decode.unavailable()
    found = products(bm.runner.model)
    if why is not None or not found:
        raise SystemExit(f"no fp32 decode ops to time here: {why or 'the weights are not oneDNN-packed'}")
    ops, gen, rows, int4 = torch.ops.kvtool_cpu, torch.Generator().manual_seed(0), [], args.weights == "int4"
    for name, weights in found.items():
        n, k = weights[0].dense.shape
        for count in args.rows:
            x = torch.randn(count, k, generator=gen)

            def gemv():
                for w in weights:
                    ops.gemv_q4(x, w.codes, w.scale_zero, None, None) if int4 else ops.gemv(x, w.dense, None, None)

            def onednn():
                for w in weights:
                    cpu_gemm.packed_linear(x, w.wide if int4 else w)

            print(f"{name} {n} x {k}, {count} rows, {len(weights)} weights", file=sys.stderr)
            with torch.inference_mode():
                ms = measure_side_by_side({"gemv": gemv, "onednn": onednn}, args.repeats, 1)
            ours = count <= quant.MAX_ROWS if int4 else cpu_decode.gemv_takes(count, k)
            taken, other = ("gemv", "onednn") if ours else ("onednn", "gemv")
            rows.append({"product": name, "n": n, "k": k, "rows": count, "ms": ms, "taken": taken,
                         "taken_over_other": paired_speedup(ms[taken], ms[other], rate=False)})
    heads = head_rows(bm.runner, args.rows, args.repeats, gen) if int4 else []
    record = {"benchmark": "decode_products", "model": bm.name, "weights": args.weights,
              "device": device_name(bm.device), "threads": torch.get_num_threads(),
              "load_avg": round(os.getloadavg()[0], 2),
              "many_x_bytes": cpu_decode.MANY_X_BYTES, "int4_max_rows": quant.MAX_ROWS, "rows": rows, "head": heads,
              "versions": versions()}
    print(f"\n{args.weights}: 'gemv' is {'gemv_q4' if int4 else 'gemv'}")
    print("product      N x K        rows  gemv ms  oneDNN ms  taken   taken over the other (min-max)")
    for r in rows:
        s = r["taken_over_other"]
        print(f"{r['product']:<9}{r['n']:>6} x {r['k']:<6}{r['rows']:>5}{r['ms']['gemv']['median']:>9.2f}"
              f"{r['ms']['onednn']['median']:>11.2f}  {r['taken']:<7}{s['median']:>6.2f}x "
              f"({s['min']:.2f}-{s['max']:.2f})")
    for r in heads:
        s = r["taken_over_other"]
        print(f"head {r['n']:>9} x {r['k']:<6}{r['rows']:>5}  gemv_q8 {r['ms']['q8']['median']:.2f} ms, bf16 gemv "
              f"{r['ms']['bf16']['median']:.2f} ms: {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})")
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
