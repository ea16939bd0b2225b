"""The decode step of a runner through the C++ ops of kvtool.kernels.cpu_decode: the ops take plain tensors; this
module gathers their arguments from the runner's layers and weights, and runs one new token of each of n sequences
(ModelRunner.use_cpu_decode)."""

from __future__ import annotations

import torch

from kvtool.kernels import cpu_gemm, quant
from kvtool.kernels.cpu_decode import GEMV_MAX_ROWS, gemv_takes, unavailable
from kvtool.kernels.linear import linear

KV_DTYPES = (torch.float32, torch.bfloat16)  # the KV caches the ops read and write (widened to fp32 as read)


def unsupported(runner) -> str | None:
    """None when `runner` can decode through these ops, else why not."""
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return f"the ops take fp32 on the CPU; the model is {runner.dtype} on {runner.device.type}"
    if any(layer.self_attn._wqkv is None or layer.mlp._wgu is None for layer in runner.model.layers):
        return "the projections are not fused (call fuse() first)"
    if runner.spec.layer_types:
        return f"{runner.spec.model_type}'s layers (sliding windows, extra norms) run through the reference forward"
    if runner.spec.head_dim % 8 or runner.spec.head_dim > 1024:
        return f"head_dim {runner.spec.head_dim} is not a multiple of 8 or above 1024"
    return unavailable()


def _dense(w) -> torch.Tensor | None:
    """The fp32 values `gemv` reads for a oneDNN-packed weight (its blocked bytes, else its dense copy) or a plain one;
    None for int4 and bf16."""
    if isinstance(w, cpu_gemm.PackedWeight) and w.half:
        return None  # oneDNN's bf16 GEMM at any row count (the head: ModelRunner.head)
    dense = (w.held if w.blocked is None else w.blocked) if isinstance(w, cpu_gemm.PackedWeight) else w
    return dense if isinstance(dense, torch.Tensor) and dense.is_contiguous() else None


def _product(x: torch.Tensor, w, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
             norm=None, half_out: bool = False):
    """x (or `norm`(x), the C++ RMSNorm) @ W.T (+ bias) (+ residual) for any of the runner's weights: `gemv` over
    the dense values for up to GEMV_MAX_ROWS rows (where gemv_takes them), else the runner's own product (oneDNN,
    int4 or F.linear). A bf16 weight takes the norm in bf16, and with half_out gives a bare product in bf16."""
    half = isinstance(w, cpu_gemm.PackedWeight) and w.half
    x = x if norm is None else torch.ops.kvtool_cpu.rms_norm(x, norm.weight, norm.eps, half)
    if half:
        return cpu_gemm.packed_linear(x, w, bias, residual, half_out=half_out)
    dense = _dense(w)
    if dense is not None and gemv_takes(x.shape[0], x.shape[1]):
        return torch.ops.kvtool_cpu.gemv(x, dense, bias, residual)
    if isinstance(w, cpu_gemm.PackedWeight):
        return cpu_gemm.packed_linear(x, w, bias, residual)
    y = linear(x, w, bias)
    return y if residual is None else y + residual


def _weight(linear_module):
    """The weight a projection module multiplies by: its packed copy (oneDNN or int4) or the plain one."""
    return getattr(linear_module, "packed", linear_module.weight)


def attend_layout(caches: list) -> tuple[list[int], tuple[list, list[int]]]:
    """`attend`'s slots (each cache's next token, reserved, after its blocks) and prefix, prefix_count (its blocks)."""
    blocks = [c.layers[0].blocks for c in caches]
    return [c.offset - c.layers[0].base for c in caches], ([b for bl in blocks for b in bl], [len(bl) for bl in blocks])


class DecodeStep:
    """One new token for each of n sequences through the model, each over its own KVCache. The `layers` op's
    arguments are gathered once per kind of step: load_state_dict() copies into those same tensors, and the runner
    starts a new DecodeStep whenever it swaps weight objects (fuse, packing, int4, a move)."""

    def __init__(self, runner):
        self.runner = runner
        self.ops = torch.ops.kvtool_cpu
        self.hq, self.hkv = runner.spec.num_heads, runner.spec.num_kv_heads
        self._layer_args: dict[tuple[int, bool], tuple | None] = {}

    @staticmethod
    def takes(caches) -> bool:
        """True when every layer's buffers and shared blocks are the contiguous CPU tensors the ops index into, all
        fp32 or all bf16 (KV_DTYPES; a runner moved to another dtype or device after use_cpu_decode() makes caches
        that are not)."""
        tensors = [t for cache in caches if cache.layers  # whose layers share one list of blocks
                   for t in (*cache.layers[0].blocks[:1], *(b for layer in cache.layers for b in layer.buffers))]
        return (len({t.dtype for t in tensors}) <= 1 and all(
            t.is_contiguous() and t.dtype in KV_DTYPES and t.device.type == "cpu" for t in tensors))

    def layer_args(self, rows: int) -> tuple | None:
        """(norms, mats, qkv_bias, qk_norms, eps, qk_eps, q4) for ops.layers, which runs every layer in one call,
        when each product of `rows` rows runs in C++ (every weight dense and taken by gemv_takes, or every
        weight int4 and quant.kernel_takes it) and the layers share their RMSNorm eps; else None."""
        kind = (min(rows, GEMV_MAX_ROWS + 1), rows <= quant.MAX_ROWS)
        if kind not in self._layer_args:
            self._layer_args[kind] = self._gather_layer_args(rows)
        return self._layer_args[kind]

    def _gather_layer_args(self, rows: int) -> tuple | None:
        norms, mats, biases, qk_norms, eps, qk_eps, kinds = [], [], [], [], set(), set(), set()
        for layer in self.runner.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = (attn._wqkv, _weight(attn.o_proj), mlp._wgu, _weight(mlp.down_proj))
            if all(isinstance(w, quant.Int4Weight) and quant.kernel_takes(w, rows) for w in weights):
                kinds.add("q4")
                mats += [t for w in weights for t in (w.codes, w.scale_zero)]
            else:
                dense = [_dense(w) for w in weights]
                if any(w is None or not gemv_takes(rows, w.shape[1]) for w in dense):
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

    def each_layer(self, x: torch.Tensor, caches: list, slots: list[int], cos: torch.Tensor, sin: torch.Tensor,
                   shared: tuple) -> torch.Tensor:
        """The layers one by one, eight op calls each, the products through _product (oneDNN past GEMV_MAX_ROWS
        rows): x after the last layer. shared: attend's prefix and prefix_count (the caches' shared blocks)."""
        ops, hq, hkv = self.ops, self.hq, self.hkv
        for i, layer in enumerate(self.runner.model.layers):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            kv = [cache.layers[i] for cache in caches]
            qkv = _product(x, attn._wqkv, attn._bqkv, norm=norm)
            qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
            eps = attn.q_norm.eps if attn.qk_norm else 0.0
            out = ops.attend(qkv, [layer_kv.buffers[0] for layer_kv in kv], [layer_kv.buffers[1] for layer_kv in kv],
                             slots, cos, sin, qn, kn, eps, hq, hkv, *shared, i)
            for layer_kv in kv:
                layer_kv.offset += 1
            x = _product(out, _weight(attn.o_proj), residual=x)
            norm = layer.post_attention_layernorm
            gate_up = _product(x, mlp._wgu, norm=norm, half_out=True)
            x = _product(ops.silu_mul(gate_up), _weight(mlp.down_proj), residual=x)
        return x

    def __call__(self, tokens: torch.Tensor, caches: list, positions: list[int]) -> torch.Tensor:
        """Logits [n, V] (fp32) of tokens [n], token i at RoPE position positions[i]; its K/V go to the next
        slot of caches[i]."""
        r, ops, hq, hkv = self.runner, self.ops, self.hq, self.hkv
        for cache in caches:
            cache.reserve(cache.offset + 1)
        slots, shared = attend_layout(caches)
        cos, sin = r.rope_cos_sin(torch.tensor(positions, device=r.device))  # [n, D] each
        x = r.model.embed_tokens(tokens)  # [n, hidden]
        fused = self.layer_args(len(caches))
        if fused is not None:  # every layer in one call
            norms, mats, biases, qk_norms, eps, qk_eps, q4 = fused
            count = len(r.model.layers)
            keys = [cache.layers[i].buffers[0] for i in range(count) for cache in caches]
            values = [cache.layers[i].buffers[1] for i in range(count) for cache in caches]
            x = ops.layers(x, norms, mats, biases, qk_norms, keys, values, slots, cos, sin, eps, qk_eps, hq, hkv, q4,
                           *shared)
            for cache in caches:
                for layer_kv in cache.layers:
                    layer_kv.offset += 1
        else:
            x = self.each_layer(x, caches, slots, cos, sin, shared)
        norm = r.model.norm
        h = ops.rms_norm(x, norm.weight, norm.eps)
        head = None
        if r.weights != "int4" and gemv_takes(*h.shape):
            head = _dense(r._head_packed if r._head_packed is not None else r.output_weight)
        return r.head(h) if head is None else ops.gemv(h, head, None, None)
