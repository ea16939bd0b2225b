"""Peak memory and time of an ~8k-token attention heatmap of one layer (all query rows).

Baseline in the same run: the plain fused prefill of the same tokens. The heatmap recomputes
the probabilities inside the forward, one row block at a time, and pools them into blocks, so
its peak RSS should stay near the baseline's (materialising every layer's probabilities, as
`output_attentions=True` does, would take layers x heads x n^2 x 4 bytes).

    python benchmarks/viz_8k.py                                  # embedded SmolLM2, 8000 tokens, layer 20
    python benchmarks/viz_8k.py --tokens 2000 --out benchmarks/results/viz_2k-cpu.json
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, emit, summary, versions  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def long_ids(model, n: int) -> list[int]:
    """A chat-rendered filler document cut to exactly n tokens."""
    from kvtool.viz.needle import filler_sentences

    per = len(model.encode_rendered(" ".join(filler_sentences(random.Random(0), 50)))) / 50
    doc = " ".join(filler_sentences(random.Random(1), int(n / per) + 20))
    ids = model.encode_chat([{"role": "user", "content": "Summarise this:\n\n" + doc}])
    if len(ids) < n:
        raise SystemExit(f"built only {len(ids)} tokens")
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--layer", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1, help="CPU runs take minutes at 8k; raise on a GPU")
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plot", default="artifacts/viz_8k.png")
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    args = ap.parse_args()

    import numpy as np
    import torch

    import kvtool
    from kvtool.models.resolve import resolve_model_arg
    from kvtool.testing.models import smollm2_gguf
    from kvtool.viz.heatmap import compute_heatmap, plot_heatmap
    from kvtool.viz.tokens import make_tokens

    model = kvtool.load(args.model and resolve_model_arg(args.model) or str(smollm2_gguf()),
                        device=args.device, dtype="float32")
    ids = long_ids(model, args.tokens)
    tokens = make_tokens(model, ids)
    rss = {"after_load_mb": peak_rss_mb()}
    heads = list(range(model.spec.num_heads))
    print(f"{model.name}: {len(ids)} tokens, layer {args.layer}, {len(heads)} heads (mean)", file=sys.stderr)

    def timed(fn, label):
        values = []
        for i in range(args.warmup + args.repeats):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            print(f"  {label} run {i + 1}/{args.warmup + args.repeats}: {dt:.1f} s, peak RSS {peak_rss_mb():.0f} MB",
                  file=sys.stderr, flush=True)
            if i >= args.warmup:
                values.append(dt)
        return summary(values)

    with torch.inference_mode():
        model.runner.prefill(ids[:64], model.runner.new_cache())  # first-call kernel set-up, not timed
        base = timed(lambda: model.runner.prefill(ids, model.runner.new_cache(len(ids) + 1)), "baseline prefill")
    rss["after_baseline_mb"] = peak_rss_mb()
    holder = {}
    viz = timed(lambda: holder.update(data=compute_heatmap(model, tokens, [args.layer], heads, "mean")), "heatmap")
    rss["after_heatmap_mb"] = peak_rss_mb()
    data = holder["data"]
    plot_heatmap(data, args.plot, scale="log")
    rss["after_plot_mb"] = peak_rss_mb()
    n, s = len(ids), model.spec
    record = {"bench": "viz_8k", "model": model.name, "device": device_name(model.runner.device),
              "tokens": n, "layer": args.layer, "heads": "mean", "block": data.block,
              "cells": list(data.values.shape[1:]), "baseline_prefill_s": base, "heatmap_s": viz,
              "peak_rss_mb": rss, "peak_rss_gb": round(rss["after_plot_mb"] / 1024, 3),
              "fits_24gb": rss["after_plot_mb"] < 24 * 1024,
              "materialised_all_layers_gb": round(s.num_layers * s.num_heads * n * n * 4 / 2**30, 1),
              "materialised_one_layer_gb": round(s.num_heads * n * n * 4 / 2**30, 2),
              "row_sums_min": float(np.nansum(data.values[0], -1).min()),  # mass pooling keeps rows at 1
              "plot": args.plot, "versions": versions()}
    emit(record, args.out)


if __name__ == "__main__":
    main()
