"""RoPE re-rotation bandwidth: the Triton kernel (CUDA) beside the torch reference, same tensors, same run.

A relocation reads and writes every key once, so the figure of merit is achieved memory bandwidth:
2 * bytes(keys) / time, as a share of the GPU's spec HBM bandwidth and of a plain device copy.

    python benchmarks/rope_kernel.py                                # Qwen3-0.6B shape: 28 x 8 x 2048 x 128 bf16
    python benchmarks/rope_kernel.py --tokens 512 --out benchmarks/results/rope-kernel-cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, emit, versions  # noqa: E402

# Spec HBM bandwidth, bytes/s, by device-name substring (first match wins).
PEAK_BW = [("H200", 4.8e12), ("H100 SXM", 3.35e12), ("H100 NVL", 3.9e12), ("H100", 2.0e12),
           ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("RTX 4090", 1.008e12)]


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BW if key in name), None)


def time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> list[float]:
    """Per-iteration times: CUDA events on GPU, perf_counter elsewhere."""
    import time

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1000.0)
    return out


def stats(times: list[float], nbytes: int, peak: float | None, copy_bw: float | None) -> dict:
    import statistics

    med = statistics.median(times)
    bw = 2 * nbytes / (med / 1000.0)
    return {"ms_median": med, "ms_min": min(times), "ms_max": max(times), "n": len(times), "gb_s": bw / 1e9,
            "pct_of_spec_peak": 100 * bw / peak if peak else None,
            "pct_of_device_copy": 100 * bw / copy_bw if copy_bw else None}


def main() -> None:
    from kvtool.kernels import rerotate, rerotate_reference, triton_available
    from kvtool.models.loading import pick_device, pick_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--theta", type=float, default=1e6)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--delta", type=int, default=3000)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    shape = (args.layers, args.kv_heads, args.tokens, args.head_dim)
    keys = torch.randn(shape, device=device).to(dtype)
    inv_freq = (1.0 / (args.theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim))).to(device)
    nbytes = keys.numel() * keys.element_size()
    name = device_name(device)
    peak = peak_bandwidth(name) if device.type == "cuda" else None
    print(f"rerotate {list(shape)} {str(dtype).replace('torch.', '')} ({nbytes / 2**20:.1f} MiB) on {name}",
          file=sys.stderr)

    other = torch.empty_like(keys)
    copy_times = time_ms(lambda: other.copy_(keys), device, args.iters)
    copy_bw = 2 * nbytes / (sorted(copy_times)[len(copy_times) // 2] / 1000.0)
    results = {"device_copy": stats(copy_times, nbytes, peak, copy_bw)}
    out = torch.empty_like(keys)
    results["reference"] = stats(time_ms(lambda: rerotate_reference(keys, args.delta, inv_freq, out=out), device,
                                         max(3, args.iters // 5)), nbytes, peak, copy_bw)
    if device.type == "cuda" and triton_available():
        ref = rerotate_reference(keys, args.delta, inv_freq)
        got = rerotate(keys, args.delta, inv_freq, backend="triton")
        err = (got.float() - ref.float()).abs().max().item()
        work = keys.clone()
        results["triton_in_place"] = stats(time_ms(lambda: rerotate(work, args.delta, inv_freq, out=work,
                                                                    backend="triton"), device, args.iters),
                                           nbytes, peak, copy_bw)
        results["triton_in_place"]["max_abs_err_vs_reference"] = err
        results["triton_out_of_place"] = stats(time_ms(lambda: rerotate(keys, args.delta, inv_freq, out=out,
                                                                        backend="triton"), device, args.iters),
                                               nbytes, peak, copy_bw)
    else:
        print("triton path skipped: needs CUDA and triton", file=sys.stderr)

    print(f"\n{'path':<22}{'ms':>10}{'GB/s':>10}{'% spec':>9}{'% copy':>9}")
    for key, r in results.items():
        spec = f"{r['pct_of_spec_peak']:.1f}" if r["pct_of_spec_peak"] else "-"
        print(f"{key:<22}{r['ms_median']:>10.4f}{r['gb_s']:>10.1f}{spec:>9}{r['pct_of_device_copy']:>9.1f}")
    target = results.get("triton_in_place", {}).get("pct_of_spec_peak")
    emit({"benchmark": "rope_kernel", "device": name, "device_type": device.type,
          "dtype": str(dtype).replace("torch.", ""), "shape": list(shape), "bytes": nbytes,
          "spec_peak_gb_s": peak / 1e9 if peak else None, "results": results,
          "target_pct_of_peak": 70.0, "meets_target": (target >= 70.0) if target else None,
          "versions": versions()}, args.out)


if __name__ == "__main__":
    main()
