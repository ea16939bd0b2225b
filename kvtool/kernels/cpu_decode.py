"""fp32 decode steps on the CPU: the work between the matmuls, and the matmuls of few rows, in C++.

A SmolLM2 decode step on the 2-core x86_64 machine kvtool is built on took ~42 ms with the projections
packed (kvtool.kernels.cpu_gemm), of which the 121 matmuls take ~30 ms when run alone. Most of the other
~11 ms are small ops run one by one: F.rms_norm decomposes into ~7 ATen ops on the CPU and takes 27 us
for one 576-wide row (61 a step), RoPE, the KV write, a GQA SDPA call of ~30 us, silu and the residual
adds. Here each layer is eight calls: three C++ ops from cpu_decode.cpp (an RMSNorm, `attend`: Qwen3's
q/k norms, RoPE, the KV write and the attention of the one query, and silu(gate) * up) and the four
matmuls, which add the residual themselves. That took a step to ~37 ms (27 against 22 tok/s for the
reference forward, medians of 5 interleaved runs of 64 tokens).

The matmuls of a decode step read every weight once, so they are bound by memory. oneDNN's packed GEMM
moves ~16 GB/s at one row here; `gemv`, which streams each thread's share of the weight rows front to
back with AVX2 FMAs and a prefetch a few rows ahead, moves 24-28 GB/s (a `sum` reaches ~30). Up to
GEMV_MAX_ROWS rows the matmuls and the dense head take it: a step then took ~28 ms (35.4 against 21.7 tok/s,
same tokens). The math is the reference's; only summation order differs (logits within ~5e-5 on SmolLM2).
gemv reads the bytes of oneDNN's packed copies where they are laid out as [N / 64, K, 64] (each output
sums four quarters of K, each in one FMA chain, four weight streams side by side for one row), so the
dense copies can go (kvtool.kernels.cpu_gemm); whole Qwen2.5 steps at one row took 118-121 against
137-141 ms over the dense rows, and SmolLM2's 34 against 44.

Called one by one from Python, those ops cost ~3 us each to dispatch, and a step makes ~240 of them
plus the Python around them. When every product of a step runs in C++ (up to GEMV_MAX_ROWS rows, or
quant.MAX_ROWS with int4 weights), one more op, `layers`, runs all the layers' ops in turn from one
call: SmolLM2 steps took 25.5 against 28.7 ms (dense) and 15.3 against 18.0 ms (int4), medians of 5
interleaved runs of 64 tokens, the same tokens. More rows go layer by layer, their products through
the runner's own (oneDNN).

Attention reads each sequence's whole cache, so at long contexts it rivals the matmuls: at 2,048 keys
(SmolLM2's 9 query and 3 KV heads of 64) one layer's `attend` took 321 us, ~9.6 ms a step. Its softmax
now takes eight exps at a time (Cephes' expf in AVX2, ~1 ulp) and the weighted sum of values keeps
each head's output in registers across the keys: 138 us at 2,048 keys (the 3 MB of K and V at 25 GB/s
is ~120), 475 against 1,170 at 8,192. silu(gate) * up goes through ATen's silu, which is the reference
forward's own and vectorized: a scalar loop of exps took 13 ms of a 64-stream step. A 64-stream step
(~150 keys each) went from ~260 to ~200 ms with both.

ModelRunner.run (forward, forward_batch) takes this path for one new token of each sequence, without a tap,
once `use_cpu_decode()` turned it on (kvtool.load does, for fp32 CPU models). Prefill chunks take
kvtool.models.cpu_prefill; taps and every other dtype or device run the reference forward. For n
sequences the matmuls run once over n rows and `attend` takes every sequence's own buffers, so continuous
batching's decode steps use it too.

Int4 weights (`weights="int4"`, kvtool.kernels.quant) have two more ops here, which kvtool.kernels.quant
uses wherever it multiplies few rows once the library is loaded (loaded()), in this path and the reference
forward alike: `gemv_q4` (4-bit codes and bf16 scales and zeros per group of 32 against x at 16 bits per
group, integer dots, sums in fp32) for up to quant.MAX_ROWS rows, and `gemv` over bf16 weights (widened
exactly) for the bf16 copy of the head. A SmolLM2 int4 step then reads ~123 MB and took 18.7 ms against
27.1 with torch's int4 kernel and bf16 head (medians of 5 interleaved runs of 64 tokens, 1.45x; before
`layers`), and its next-token KL to the dense model of its grid values went from 0.00038 to 0.00017.

The same library holds the prefill ops of cpu_prefill.cpp and cpu_attention.cpp (kvtool.models.cpu_prefill
documents them), and the
many-row paths of `rms_norm` and `silu_mul` that prefill uses: rows split over the threads, each row by one
thread, so the same bits at any thread count.

The C++ files are compiled once per machine with the system compiler (`CXX`, default c++) against the
installed torch's headers, into `<kvtool cache>/ext` (KVTOOL_CACHE, default ~/.cache/kvtool), named by a
hash of the sources, torch version, flags and CPU, so a new torch or CPU builds anew (~15 s on 2 cores).
When no compiler is found or the build fails, the runner keeps the reference forward and one line on
stderr says why. FLAGS are gcc's, as built and measured on x86_64 Linux; Apple's clang has no -fopenmp
and is expected to take that fallback. `KVTOOL_CPU_DECODE=0` keeps the reference forward.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

from kvtool.paths import cache_root

ENV = "KVTOOL_CPU_DECODE"
SOURCE = Path(__file__).with_name("cpu_decode.cpp")
SOURCES = (SOURCE, *(SOURCE.with_name(f"cpu_{name}.cpp") for name in ("prefill", "attention")))  # one library: the
# prefill ops (kvtool.models.cpu_prefill) too; they include HEADER
HEADER = SOURCE.with_name("cpu_simd.h")
FLAGS = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
BUILD_TIMEOUT_S = 600
# Up to this many rows the ops' own gemv beats oneDNN's packed GEMM (30 distinct weights of each SmolLM2
# shape, so they stream from memory: at 1 row 71 vs 126 us for a 960 x 576 qkv, 259 vs 332 for gate_up,
# 4.2 vs 5.5 ms for the head; even at 8 rows; oneDNN ahead from 16).
GEMV_MAX_ROWS = 4
# Three or four rows take gemv only while they hold at most this many bytes: whole 4-row decode steps of Qwen2.5
# (896-wide x, 14 KiB) took 124 ms with every product in oneDNN against 131 with gemv taking the 896-wide ones
# (~1,100-token contexts, one thread; 104 against 121 at 3 rows, 10.5 KiB); SmolLM2's 4 rows (9 KiB) tied.
MANY_X_BYTES = 12288


def gemv_takes(rows: int, k: int) -> bool:
    """Whether `gemv` is the faster product for `rows` fp32 x rows of length k (else oneDNN's packed GEMM)."""
    return rows <= GEMV_MAX_ROWS and (rows <= 2 or rows * k * 4 <= MANY_X_BYTES)


def _cpu_id() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for); the machine name elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def library_path(compiler: str) -> Path:
    texts = [source.read_text() for source in (*SOURCES, HEADER)]
    key = hashlib.sha256("\0".join([*texts, torch.__version__, compiler, *FLAGS, _cpu_id()]).encode())
    return cache_root() / "ext" / f"kvtool_cpu_decode-{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path) -> None:
    """Compile SOURCES into `target` (written beside it first, then renamed, so readers never see half a file)."""
    torch_dir = Path(torch.__file__).parent
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}.so")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd = [compiler, *FLAGS, *includes, *map(str, SOURCES), "-o", str(tmp), f"-L{torch_dir / 'lib'}", "-lc10",
           "-ltorch_cpu"]
    names = ", ".join(source.name for source in SOURCES)
    print(f"kvtool: compiling the CPU decode and prefill ops ({names}, once for this machine and torch)",
          file=sys.stderr)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {SOURCE.name} took over {BUILD_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"compiling {SOURCE.name} with {compiler} failed: {tail}")
    tmp.replace(target)
    for stale in target.parent.glob("kvtool_cpu_decode-*.so"):  # builds for an older source, torch or CPU
        if stale != target and ".tmp" not in stale.name:  # not another process's build in progress
            stale.unlink(missing_ok=True)


_loaded = False  # whether _load() has loaded the ops into this process


def loaded() -> bool:
    """True once the ops are loaded into this process (some unavailable() call returned None); they are
    then used for the int4 products and bf16 head of few rows too (kvtool.kernels.quant)."""
    return _loaded


@functools.cache
def _load(compiler: str) -> str | None:
    """Build (once per machine) and load the ops; None when torch.ops.kvtool_cpu is ready, else why not."""
    reason = None
    if shutil.which(compiler) is None:
        reason = f"no C++ compiler {compiler!r} on PATH (set CXX)"
    else:
        target = library_path(compiler)
        try:
            if not target.is_file():
                build(compiler, target)
            try:
                torch.ops.load_library(str(target))
            except OSError:  # a damaged file (a full disk, a copied cache): build it again, once
                target.unlink(missing_ok=True)
                build(compiler, target)
                torch.ops.load_library(str(target))
        except (RuntimeError, OSError) as exc:
            reason = str(exc).splitlines()[0]
    if reason:
        print(f"kvtool: decode steps run the reference forward: {reason}", file=sys.stderr)
    else:
        global _loaded
        _loaded = True
    return reason


def unavailable() -> str | None:
    """None when the C++ decode ops are loaded (building them if needed), else why not; ValueError for a
    malformed KVTOOL_CPU_DECODE."""
    mode = os.environ.get(ENV, "1")
    if mode not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1; got {mode!r}")
    if mode == "0":
        return f"{ENV}=0"
    return _load(os.environ.get("CXX", "c++"))
