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
GEMV_MAX_ROWS rows the matmuls and the dense head take it, over the dense values the packed copies were
made from: a step then takes ~28 ms (35.4 against 21.7 tok/s, same tokens). The math is the
reference's; only summation order differs (logits within ~5e-5 on SmolLM2).

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

ModelRunner.forward and forward_batch take this path for one new token of each sequence, without a tap,
once `use_cpu_decode()` turned it on (kvtool.load does, for fp32 CPU models). Prefill, taps and every
other dtype or device run the reference forward. For n sequences the matmuls run once over n rows and
`attend` takes every sequence's own buffers, so continuous batching's decode steps use it too.

Int4 weights (`weights="int4"`, kvtool.kernels.quant) have two more ops here, which kvtool.kernels.quant
uses wherever it multiplies few rows once the library is loaded (loaded()), in this path and the reference
forward alike: `gemv_q4` (4-bit codes and bf16 scales and zeros per group of 32 against x at 16 bits per
group, integer dots, sums in fp32) for up to quant.MAX_ROWS rows, and `gemv` over bf16 weights (widened
exactly) for the bf16 copy of the head. A SmolLM2 int4 step then reads ~123 MB and took 18.7 ms against
27.1 with torch's int4 kernel and bf16 head (medians of 5 interleaved runs of 64 tokens, 1.45x; before
`layers`), and its next-token KL to the dense model of its grid values went from 0.00038 to 0.00017.

The C++ file is compiled once per machine with the system compiler (`CXX`, default c++) against the
installed torch's headers, into `<kvtool cache>/ext` (KVTOOL_CACHE, default ~/.cache/kvtool), named by a
hash of the source, torch version, flags and CPU, so a new torch or CPU builds anew (~15 s on 2 cores).
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

from kvtool.kernels import cpu_gemm

ENV = "KVTOOL_CPU_DECODE"
SOURCE = Path(__file__).with_name("cpu_decode.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
BUILD_TIMEOUT_S = 600
# Up to this many rows the ops' own gemv beats oneDNN's packed GEMM (30 distinct weights of each SmolLM2
# shape, so they stream from memory: at 1 row 71 vs 126 us for a 960 x 576 qkv, 259 vs 332 for gate_up,
# 4.2 vs 5.5 ms for the head; even at 8 rows; oneDNN ahead from 16).
GEMV_MAX_ROWS = 4


def _cpu_id() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for); the machine name elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def library_path(compiler: str) -> Path:
    from kvtool.models.gguf import cache_root

    key = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, compiler, *FLAGS, _cpu_id()]).encode())
    return cache_root() / "ext" / f"kvtool_cpu_decode-{key.hexdigest()[:16]}.so"


def build(compiler: str, target: Path) -> None:
    """Compile SOURCE into `target` (written beside it first, then renamed, so readers never see half a file)."""
    torch_dir = Path(torch.__file__).parent
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}.so")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd = [compiler, *FLAGS, *includes, str(SOURCE), "-o", str(tmp), f"-L{torch_dir / 'lib'}", "-lc10",
           "-ltorch_cpu"]
    print(f"kvtool: compiling the CPU decode ops ({SOURCE.name}, once for this machine and torch)", file=sys.stderr)
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


def unsupported(runner) -> str | None:
    """None when `runner` can decode through these ops, else why not."""
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return f"the ops take fp32 on the CPU; the model is {runner.dtype} on {runner.device.type}"
    if any(layer.self_attn._wqkv is None or layer.mlp._wgu is None for layer in runner.model.layers):
        return "the projections are not fused (call fuse() first)"
    if runner.spec.head_dim % 2 or runner.spec.head_dim > 1024:
        return f"head_dim {runner.spec.head_dim} is odd or above 1024"
    return unavailable()


def _dense(w) -> torch.Tensor | None:
    """The contiguous fp32 [N, K] values `gemv` reads for a oneDNN-packed or plain weight; None for int4."""
    dense = w.dense if isinstance(w, cpu_gemm.PackedWeight) else w
    return dense if isinstance(dense, torch.Tensor) and dense.is_contiguous() else None


def _product(x: torch.Tensor, w, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None):
    """x @ W.T (+ bias) (+ residual) for any of the runner's weights: `gemv` over the dense values for up to
    GEMV_MAX_ROWS rows, else the runner's own product (oneDNN-packed, int4 or F.linear)."""
    dense = _dense(w)
    if dense is not None and x.shape[0] <= GEMV_MAX_ROWS:
        return torch.ops.kvtool_cpu.gemv(x, dense, bias, residual)
    if isinstance(w, cpu_gemm.PackedWeight):
        if residual is not None:  # one oneDNN call: the residual as a binary post-op
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w.packed, None, "add")
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")
    from kvtool.models.runner import linear

    y = linear(x, w, bias)
    return y if residual is None else y + residual


def _weight(linear_module):
    """The weight a projection module multiplies by: its packed copy (oneDNN or int4) or the plain one."""
    return getattr(linear_module, "packed", linear_module.weight)


class DecodeStep:
    """One new token for each of n sequences through the model, each over its own KVCache. The arguments of
    the `layers` op are gathered from the runner once per kind of step (gathering them took ~0.5 ms, 30 layers
    of module attribute lookups); load_state_dict() copies new values into those same tensors, and the runner
    starts a new DecodeStep whenever it swaps weight objects (fuse, packing, int4, a move)."""

    def __init__(self, runner):
        self.runner = runner
        self.ops = torch.ops.kvtool_cpu
        s = runner.spec
        self.hq, self.hkv = s.num_heads, s.num_kv_heads
        self._layer_args: dict[tuple[bool, bool], tuple | None] = {}

    @staticmethod
    def takes(caches) -> bool:
        """True when every layer's buffers are the contiguous fp32 CPU [1, H, capacity, D] the ops index into
        (a runner moved to another dtype or device after use_cpu_decode() makes caches that are not)."""
        return all(k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32
                   and k.device.type == "cpu" for cache in caches for k, v in (layer.buffers for layer in cache.layers))

    def layer_args(self, rows: int) -> tuple | None:
        """(norms, mats, qkv_bias, qk_norms, eps, qk_eps, q4) for ops.layers, which runs every layer in one call,
        when each product of `rows` rows runs in C++ (every weight dense and rows <= GEMV_MAX_ROWS, or every
        weight int4 and rows <= quant.MAX_ROWS) and the layers share their RMSNorm eps; else None."""
        from kvtool.kernels import quant  # which imports this module

        kind = (rows <= GEMV_MAX_ROWS, rows <= quant.MAX_ROWS)
        if kind not in self._layer_args:
            self._layer_args[kind] = self._gather_layer_args(rows)
        return self._layer_args[kind]

    def _gather_layer_args(self, rows: int) -> tuple | None:
        from kvtool.kernels import quant  # which imports this module

        norms, mats, biases, qk_norms, eps, qk_eps, kinds = [], [], [], [], set(), set(), set()
        for layer in self.runner.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = (attn._wqkv, _weight(attn.o_proj), mlp._wgu, _weight(mlp.down_proj))
            if all(isinstance(w, quant.Int4Weight) for w in weights) and rows <= quant.MAX_ROWS:
                kinds.add("q4")
                mats += [t for w in weights for t in (w.codes, w.scale_zero)]
            else:
                dense = [_dense(w) for w in weights]
                if rows > GEMV_MAX_ROWS or any(w is None for w in dense):
                    return None
                kinds.add("dense")
                mats += dense
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
            biases.append(attn._bqkv)
            qk_norms += [attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else [None, None]
            qk_eps.add(attn.q_norm.eps if attn.qk_norm else 0.0)
        if len(kinds) != 1 or len(eps) != 1 or len(qk_eps) != 1:
            return None
        return norms, mats, biases, qk_norms, eps.pop(), qk_eps.pop(), kinds.pop() == "q4"

    def each_layer(self, x: torch.Tensor, caches: list, slots: list[int], cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """The layers one by one, eight op calls each, the products through _product (oneDNN past GEMV_MAX_ROWS
        rows): x after the last layer."""
        ops, hq, hkv = self.ops, self.hq, self.hkv
        for i, layer in enumerate(self.runner.model.layers):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            kv = [cache.layers[i] for cache in caches]
            qkv = _product(ops.rms_norm(x, norm.weight, norm.eps), attn._wqkv, attn._bqkv)
            qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
            eps = attn.q_norm.eps if attn.qk_norm else 0.0
            out = ops.attend(qkv, [layer_kv.buffers[0] for layer_kv in kv], [layer_kv.buffers[1] for layer_kv in kv],
                             slots, cos, sin, qn, kn, eps, hq, hkv)
            for layer_kv, slot in zip(kv, slots):
                layer_kv.offset = slot + 1
            x = _product(out, _weight(attn.o_proj), residual=x)
            norm = layer.post_attention_layernorm
            gate_up = _product(ops.rms_norm(x, norm.weight, norm.eps), mlp._wgu)
            x = _product(ops.silu_mul(gate_up), _weight(mlp.down_proj), residual=x)
        return x

    def __call__(self, tokens: torch.Tensor, caches: list, positions: list[int]) -> torch.Tensor:
        """Logits [n, V] (fp32) of tokens [n], token i at RoPE position positions[i]; its K/V go to the next
        slot of caches[i]."""
        r, ops, hq, hkv = self.runner, self.ops, self.hq, self.hkv
        slots = [cache.offset for cache in caches]
        for cache, slot in zip(caches, slots):
            cache.reserve(slot + 1)
        cos, sin = r.rope_cos_sin(torch.tensor(positions, device=r.device))  # [n, D] each
        x = r.model.embed_tokens(tokens)  # [n, hidden]
        fused = self.layer_args(len(caches))
        if fused is not None:  # every layer in one call
            norms, mats, biases, qk_norms, eps, qk_eps, q4 = fused
            count = len(r.model.layers)
            keys = [cache.layers[i].buffers[0] for i in range(count) for cache in caches]
            values = [cache.layers[i].buffers[1] for i in range(count) for cache in caches]
            x = ops.layers(x, norms, mats, biases, qk_norms, keys, values, slots, cos, sin, eps, qk_eps, hq, hkv, q4)
            for cache, slot in zip(caches, slots):
                for layer_kv in cache.layers:
                    layer_kv.offset = slot + 1
        else:
            x = self.each_layer(x, caches, slots, cos, sin)
        norm = r.model.norm
        h = ops.rms_norm(x, norm.weight, norm.eps)
        if r.weights == "dense" and h.shape[0] <= GEMV_MAX_ROWS and r.output_weight.is_contiguous():
            return ops.gemv(h, r.output_weight, None, None)
        return r.head(h)
