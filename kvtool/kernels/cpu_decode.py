"""fp32 decode steps on the CPU: the work between the matmuls, and the matmuls of few rows, in C++.

Each decoder layer of a decode step is eight calls: three ops of cpu_decode.cpp (`rms_norm`; `attend`: Qwen3's
q/k norms, RoPE, the KV write and the attention of the one new query; `silu_mul`, silu(gate) * up) and the
four matmuls, which add the residual themselves. On the CPU the reference forward runs the same work as many
small ATen ops (RMSNorm alone decomposes into ~7), each dispatched on its own.

The matmuls of a decode step read every weight once, so memory bandwidth bounds them. `gemv` streams each
thread's share of the weight rows front to back with FMAs and a prefetch a few rows ahead. It takes the
products gemv_takes() gives it, up to GEMV_MAX_ROWS rows (three or four only while their x rows fit in
MANY_X_BYTES: longer ones no longer stay in L1 beside the weight stream), and the dense head; the runner's
own products (oneDNN) take the rest. gemv reads the bytes of oneDNN's packed copies where they are laid out
as [N / 64, K, 64] (each output sums four quarters of K, each in one FMA chain), so the dense copies can go
(kvtool.kernels.cpu_gemm). The math is the reference's; only summation order differs (logits within ~5e-5
on SmolLM2).

When every product of a step runs in C++ (each taken by gemv_takes(), or up to quant.MAX_ROWS rows with
int4 weights), one more op, `layers`, runs all the layers' ops in turn from one call, so a step pays one
dispatch from Python instead of ~240. Other steps go layer by layer.

`attend` reads each sequence's whole cache, so at long contexts it rivals the matmuls: its softmax takes eight
exps at a time (Cephes' expf, ~1 ulp; cpu_simd.h) and the weighted sum of values keeps each head's output in
registers across the keys. The ops that write or read the KV cache (`attend`, `rope_qkv`, `prefill_attention`)
take it in fp32 or in bf16 (EngineConfig.kv_dtype), the blocks and buffers of one call alike: K and V are
computed in fp32 and rounded to nearest even as written, widened exactly as read, every sum in fp32; bf16
halves the bytes a step's attention reads. `silu_mul` goes through ATen's silu, vectorized and the reference
forward's own; for bf16 weights, `rms_norm` and `silu_mul` write bf16 (fp32 math, rounded to nearest even).

ModelRunner.run (forward, forward_batch) takes this path for one new token of each sequence, without a tap,
once `use_cpu_decode()` turned it on (kvtool.load does, for fp32 CPU models). Prefill chunks take
kvtool.models.cpu_prefill; taps and every other dtype or device run the reference forward. For n
sequences the matmuls run once over n rows and `attend` takes every sequence's own buffers, so continuous
batching's decode steps use it too.

Int4 weights (`weights="int4"`, kvtool.kernels.quant) have two more ops here, which kvtool.kernels.quant
uses wherever it multiplies few rows once the library is loaded (loaded()), in this path and the reference
forward alike: `gemv_q4` (4-bit codes and bf16 scales and zeros per group of 32 against x at 16 bits per
group, integer dots, sums in fp32) for up to quant.MAX_ROWS rows, and `gemv` over bf16 weights (widened
exactly) for the bf16 copy of the head.

The same library holds the prefill ops of cpu_prefill.cpp and cpu_attention.cpp (kvtool.models.cpu_prefill
documents them), and the many-row paths of `rms_norm` and `silu_mul` that prefill uses: rows split over the
threads, each row by one thread, so the same bits at any thread count.

The C++ files are compiled once per machine with the system compiler (`CXX`, default c++) against the
installed torch's headers, into `<kvtool cache>/ext` (KVTOOL_CACHE, default ~/.cache/kvtool), named by a
hash of the sources, torch version, flags and CPU, so a new torch or CPU builds anew. When no compiler is
found or the build fails, the runner keeps the reference forward and one line on stderr says why. FLAGS are
gcc's, for x86_64 Linux; Apple's clang has no -fopenmp and is expected to take that fallback.
`KVTOOL_CPU_DECODE=0` keeps the reference forward. docs/benchmarks.md ("Why the CPU kernels are shaped as
they are") has the measurements behind these choices.
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
# Up to this many rows the ops' own gemv beats oneDNN's packed GEMM on weights streaming from memory
# (docs/benchmarks.md, "kvtool.kernels.cpu_decode").
GEMV_MAX_ROWS = 4
# Three or four rows take gemv only while they hold at most this many bytes: Qwen2.5's 896-wide rows (10.5 KiB
# at 3, 14 KiB at 4) ran faster whole in oneDNN, SmolLM2's 4 rows (9 KiB) tied.
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
    then used for the int4 products and the head of few rows too (kvtool.kernels.quant)."""
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
