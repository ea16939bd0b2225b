"""The roofline of `kvtool bench peers`: the machine measured at the pass's thread count, what each engine reads a
decoded token and multiplies a prompt token, and how close each row of the record comes to the limit they set.

Decode, R rows a step at a mean context of c tokens: a step reads every weight once for all its rows, and each row
its own KV, so

    bytes per token = weight_bytes(R) / R + row_bytes + kv_bytes(c)
    limit (tok/s)   = bandwidth / bytes per token;   fraction = measured tok/s / limit

kv_bytes(c) = 2 * layers * kv_heads * head_dim * KV element bytes * c (a sliding-window layer reads at most its
window). Prefill of n tokens (a cold TTFT):

    FLOPs = 2 * projection params * n + 2 * head params + 2 * layers * heads * head_dim * n^2

(the head runs for the last token only; attention is QK^T and PV, 4 * head_dim FLOPs per head and pair of tokens,
n^2 / 2 pairs), and fraction = FLOPs / TTFT / the GEMM peak at the dtype the engine multiplies in. The formulas
leave out norms and embedding rows (under 0.1% of the bytes); llama.cpp's weights are its GGUF tensors' bytes.
The TTFT includes the HTTP round trip and the first token's sampling, and the streams' rate their prefills, so
those fractions are lower bounds.

    python -m kvtool.bench.peers.roofline --threads 1   # the machine alone, JSON as the last line
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvtool.bench.peers.engines import DTYPE_PRECISION
from kvtool.bench.peers.rounds import figure

WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of one element
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_machine(threads: int, buffer_mib: int = 512, gemm_size: int = 2048, passes: int = 5) -> dict:
    """At `threads` torch threads: the bandwidth of a streaming read (sum over a buffer_mib fp32 buffer, far past the
    last-level cache) and the GEMM peak in fp32 and bf16, the faster of torch.matmul and oneDNN's packed linear
    (kvtool.kernels.cpu_gemm, where it runs) on gemm_size square matrices; each figure from the fastest of `passes`
    passes after a warm-up (a ceiling, as STREAM reports its best rate: a neighbour's load only slows a pass), the
    bandwidth's median beside it; the 1-minute load average when it ran."""
    before, t0 = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(threads)

    def times_s(fn) -> list[float]:
        fn()
        times = []
        for _ in range(passes):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times

    try:
        buf = torch.ones(buffer_mib << 18)  # fp32: 2^18 elements a MiB
        reads = times_s(buf.sum)
        nbytes = buf.nbytes
        del buf
        flops = 2 * gemm_size ** 3
        kernels = {name: {k: round(flops / min(times_s(fn)) / 1e9, 2) for k, fn in _gemms(gemm_size, dtype)}
                   for name, dtype in TORCH_DTYPES.items()}
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "bandwidth_gb_s": round(nbytes / min(reads) / 1e9, 2),
            "bandwidth_median_gb_s": round(nbytes / statistics.median(reads) / 1e9, 2),
            "gemm_gflop_s": {name: max(by.values()) for name, by in kernels.items()}, "gemm_kernels": kernels,
            "buffer_mib": buffer_mib, "gemm_size": gemm_size, "passes": passes,
            "load_1min": round(os.getloadavg()[0], 2), "seconds": round(time.perf_counter() - t0, 2)}


def best_of(probes: list[dict]) -> dict:
    """The machine's ceiling over its probes (before the first engine of a pass and after the last): each figure the
    highest any probe measured; the probes kept under "probes"."""
    gemm = {k: max(p["gemm_gflop_s"][k] for p in probes) for k in probes[0]["gemm_gflop_s"]}
    return {**probes[0], "bandwidth_gb_s": max(p["bandwidth_gb_s"] for p in probes), "gemm_gflop_s": gemm,
            "probes": probes}


def probe_again(roof: dict, threads: int) -> dict:
    """`roof` with the machine probed once more (after the pass's last engine) and its ceiling the best of all
    probes; unchanged where the first probe failed."""
    if "machine" not in roof:
        return roof
    return {**roof, "machine": best_of([*roof["machine"]["probes"], measure_machine(threads)])}


def _gemms(n: int, dtype: torch.dtype):
    """(kernel, one n x n x n product) for each GEMM kvtool's prefill may run in `dtype`."""
    from kvtool.kernels import cpu_gemm

    a, b = torch.randn(n, n), torch.randn(n, n)
    lo, hi = a.to(dtype), b.to(dtype)
    yield "matmul", lambda: lo @ hi
    if cpu_gemm.unsupported(b, dtype) is None:
        packed = cpu_gemm.pack(b, dtype)
        yield "onednn", lambda: cpu_gemm.packed_linear(a, packed)


@dataclass(frozen=True)
class Shape:
    """What the formulas need of a model."""
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    projection_params: int  # every weight the layers multiply by: attention, MLP, their biases
    head_params: int  # vocab x hidden (the embedding itself when tied)
    window_layers: int = 0  # layers of sliding-window attention
    window: int | None = None

    @classmethod
    def from_spec(cls, spec) -> "Shape":
        h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * spec.intermediate_size + (q + 2 * kv) * spec.attention_bias
        return cls(spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, h, spec.num_layers * per_layer,
                   spec.vocab_size * h, len(spec.sliding_layers), spec.sliding_window)

    def kv_bytes(self, context: float, element: int) -> float:
        """KV bytes one row reads at `context` tokens."""
        seen = (self.layers - self.window_layers) * context + self.window_layers * min(context, self.window or context)
        return 2 * seen * self.kv_heads * self.head_dim * element

    def prefill_flops(self, n: int) -> float:
        attention = 2 * self.layers * self.heads * self.head_dim * n * n
        return 2 * self.projection_params * n + 2 * self.head_params + attention


def dense_reads(shape: Shape, width: int) -> tuple[int, int]:
    """(bytes a step reads for all its rows, bytes per row) of projections and head in `width`-byte elements."""
    return (shape.projection_params + shape.head_params) * width, 0


def int4_reads(shape: Shape, rows: int, wide: str) -> tuple[int, int]:
    """kvtool --weights int4 (kvtool.kernels.quant): up to its few rows, 4-bit codes with a bf16 scale and zero per
    group and the head's 8-bit copy (an fp32 scale per group) plus EXACT_TOP fp32 head rows per row; more rows read
    the oneDNN copy in `wide` (bf16 where its bf16 GEMM runs, else fp32)."""
    from kvtool.kernels.cpu_decode import GEMV_MAX_ROWS
    from kvtool.kernels.quant import BF16_WIDE_MAX_ROWS, EXACT_TOP, GROUP, MAX_ROWS

    few = BF16_WIDE_MAX_ROWS if wide == "bf16" else MAX_ROWS
    proj = shape.projection_params * (4 + 2 * 16 / GROUP) / 8 if rows <= few else shape.projection_params * WIDTH[wide]
    if rows > GEMV_MAX_ROWS:
        return int(proj) + shape.head_params * WIDTH[wide], 0
    return int(proj + shape.head_params * (8 + 32 / GROUP) / 8), EXACT_TOP * shape.hidden * 4


def gguf_reads(path) -> tuple[int, str]:
    """The bytes of every tensor a llama.cpp decode step reads from the GGUF (the token embedding only where it is
    the head too), and their types."""
    from gguf import GGUFReader

    tensors = {t.name: (int(t.n_bytes), t.tensor_type.name) for t in GGUFReader(str(path)).tensors}
    read = {n: v for n, v in tensors.items() if n != "token_embd.weight" or "output.weight" not in tensors}
    types = sorted({t for _, t in read.values()})
    head = read.get("output.weight", read.get("token_embd.weight", (0, "none")))[1]
    return sum(b for b, _ in read.values()), f"GGUF tensors ({', '.join(types)}; head {head})"


def _dense(weights: str | None, kv: int | None = None):
    """An engine that reads its projections and head in `weights` (None: --vllm-dtype), its KV in `kv` bytes (None:
    the weights' width)."""
    def reads(shape: Shape, rows: list[int], files, vllm: str) -> dict:
        dtype = weights or vllm
        return {"reads": {str(r): list(dense_reads(shape, WIDTH[dtype])) for r in rows},
                "kv_element": kv or WIDTH[dtype], "gemm": dtype, "source": f"{dtype} projections and head"}

    return reads


def _int4(shape: Shape, rows: list[int], files, vllm: str) -> dict:
    from kvtool.kernels import cpu_gemm

    wide = "bf16" if cpu_gemm.unsupported(torch.zeros(32, 32), torch.bfloat16) is None else "fp32"
    return {"reads": {str(r): list(int4_reads(shape, r, wide)) for r in rows}, "kv_element": 4, "gemm": wide,
            "source": f"4-bit projections, 8-bit head up to its few rows; {wide} beyond"}


def _llama(shape: Shape, rows: list[int], files, vllm: str) -> dict:
    total, source = gguf_reads(files.gguf)  # its KV: llama-server's default f16 cache
    return {"reads": {str(r): [total, 0] for r in rows}, "kv_element": 2, "gemm": "fp32", "source": source}


# engine -> its reads a step at each row count, its KV element bytes and the dtype its prefill multiplies in
READS = {"kvtool": _dense("fp32", 4), "kvtool-bf16": _dense("bf16"), "kvtool-int4": _int4, "llama.cpp": _llama,
         "vllm": _dense(None), "vllm-bf16": _dense("bf16"), "kvtool-vllm": _dense(None),
         "transformers": _dense("fp32", 4)}


def roofline_rows(record: dict) -> list[dict] | None:
    """Each decode, streams and cold-TTFT figure of the record against its limit; None where the record has no
    machine measurement."""
    roof = record.get("roofline")
    if not roof or "machine" not in roof:
        return None
    c, shape, machine, rows = record["config"], Shape(**roof["shape"]), roof["machine"], []
    decode = [("decode_tok_s", "decode bs=1", 1, c["prompt_tokens"] + c["decode_tokens"] / 2)]
    # a stream's prompt is drawn between half and all of stream_prompt_tokens (batching.random_prompts)
    decode += [(f"streams_{n}.tok_s", f"{n} streams", n, 0.75 * c["stream_prompt_tokens"] + c["stream_tokens"] / 2)
               for n in c["streams"]]
    for name, e in record["engines"].items():
        v = roof["engines"].get(name)
        if e.get("status") != "ok" or v is None:
            continue
        for path, label, n, context in decode:
            got, reads = figure(e, path), v["reads"].get(str(n))
            if got is not None and reads:
                per_token = reads[0] / n + reads[1] + shape.kv_bytes(context, v["kv_element"])
                limit = machine["bandwidth_gb_s"] * 1e9 / per_token
                rows.append({"engine": name, "row": label, "bytes_per_token": round(per_token),
                             "limit_tok_s": round(limit, 2), "tok_s": got[0], "fraction": round(got[0] / limit, 3)})
        for n in c["ttft_lengths"]:
            got, peak = figure(e, f"ttft_ms_{n}"), machine["gemm_gflop_s"].get(v["gemm"])
            if got is not None and peak:
                achieved = shape.prefill_flops(n) / (got[0] / 1000.0) / 1e9
                rows.append({"engine": name, "row": f"cold TTFT @{n}", "gflop": round(shape.prefill_flops(n) / 1e9, 3),
                             "gflop_s": round(achieved, 2), "gemm": v["gemm"], "peak_gflop_s": peak,
                             "fraction": round(achieved / peak, 3)})
    return rows


def measure(files, cfg, probe: dict | None = None) -> dict:
    """The record's `roofline`: the machine at the pass's thread count (measure_machine, given `probe`'s sizes),
    the model's shape and each engine's reads."""
    from kvtool.models.spec import ModelSpec

    shape = Shape.from_spec(ModelSpec.from_hf_config(json.loads((files.folder / "config.json").read_text())))
    rows, vllm = sorted({1, *cfg.streams}), DTYPE_PRECISION[cfg.vllm_dtype]
    engines = {n: READS[n](shape, rows, files, vllm) for n in cfg.engines if n != "llama.cpp" or files.gguf is not None}
    machine = best_of([measure_machine(cfg.pass_threads(), **(probe or {}))])
    return {"machine": machine, "shape": asdict(shape), "engines": engines}


def not_measured(record: dict) -> str:
    why = (record.get("roofline") or {}).get("error")
    return f"not measured ({why})" if why else "not measured (the record has no machine measurement)"


def summary(record: dict) -> str:
    """One line: every row's fraction of its limit, engine by engine, or "not measured"."""
    rows = roofline_rows(record)
    if rows is None:
        return not_measured(record)
    m, parts = record["roofline"]["machine"], {}
    for r in rows:
        parts.setdefault(r["engine"], []).append(f"{r['row']} {100 * r['fraction']:.0f}% of " + (
            f"{r['limit_tok_s']:,.0f} tok/s" if "limit_tok_s" in r else f"the {r['gemm']} peak"))
    parts = [f"{name}: {', '.join(p)}" for name, p in parts.items()]
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in m["gemm_gflop_s"].items())
    return (f"{m['bandwidth_gb_s']:.1f} GB/s read, GEMM peak {peaks} GFLOP/s at {m['threads']} thread"
            f"{'s' if m['threads'] != 1 else ''}: " + "; ".join(parts or ["no decode or TTFT rows"]))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvtool.bench.peers.roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--buffer-mib", type=int, default=512)
    p.add_argument("--gemm-size", type=int, default=2048)
    args = p.parse_args(argv)
    print(json.dumps(measure_machine(args.threads, args.buffer_mib, args.gemm_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
