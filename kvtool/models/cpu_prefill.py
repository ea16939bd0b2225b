"""fp32 prefill on the CPU: the work between the matmuls through the C++ ops of kvtool/kernels/cpu_prefill.cpp.

The reference forward runs the memory-bound work between a prefill's matmuls as small ATen ops, each a pass
over the activations: RMSNorm as pow/sum/mul, RoPE as rotate_half (neg, cat, mul, add), silu(gate) * up, the
residual adds and the copies of K and V into the cache. Here each layer is: `rms_norm` (rows split over the
threads), the fused qkv product, `rope_qkv` (Qwen3's q/k norms, RoPE of q and k, K and V written straight into
the cache's blocks or buffers, rows split over the threads), `prefill_attention` (kvtool/kernels/cpu_attention.cpp:
causal, each KV head's whole group of query heads scored at once, with no mask; a paged cache's blocks read in
place), the o product with the residual added by oneDNN as a post-op, `rms_norm`, the gate_up product,
`silu_mul` (ATen's silu over blocks of rows, multiplied by up while in cache) and the down product, again with
the residual. Each row is computed by one thread, so the result does not depend on the thread count.
docs/benchmarks.md ("kvtool.models.cpu_prefill", "Where the time goes on a CPU") has the profiles behind this.

Numerics: RoPE, silu * up and the K/V copies give the reference's bits; RMSNorm sums its squares in another
order (SmolLM2 logits within 1.5e-3 of the reference forward's over 700 tokens, greedy tokens the same).

ModelRunner.run takes this path for every forward without a tap that the decode step does not, once
`use_cpu_decode()` (or `use_cpu_prefill()`) turned it on; kvtool.load does, for fp32 CPU models whose ops
built. Taps, other dtypes and devices run the reference forward.
"""

from __future__ import annotations

import torch

from kvtool.models.cpu_step import DecodeStep, _product, _weight


class PrefillPass:
    """New tokens of n sequences (any count each, packed back to back) through the layers, each sequence over its
    own KVCache. Reads the runner's modules on every call, so fuse(), packing or a move need no rebuild."""

    takes = staticmethod(DecodeStep.takes)  # the same cache layout: contiguous fp32 or bf16 CPU [1, H, capacity, D]

    def __init__(self, runner):
        self.runner = runner
        self.ops = torch.ops.kvtool_cpu

    def attention(self, qkv: torch.Tensor, layer: int, caches: list, lengths: list[int], slots: list[int],
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention output [N, hq d] of one layer for qkv [N, (hq + 2 hkv) d]; K and V go into the caches."""
        s, attn = self.runner.spec, self.runner.model.layers[layer].self_attn
        hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        eps = attn.q_norm.eps if attn.qk_norm else 0.0
        outs, start = [], 0
        for cache, t, slot in zip(caches, lengths, slots):
            kv = cache.layers[layer]
            keys, values = kv.buffers
            rows = slice(start, start + t)
            q = self.ops.rope_qkv(qkv[rows], keys, values, slot, cos[rows], sin[rows], qn, kn, eps, hq, hkv, kv.blocks,
                                  layer, kv.base)
            kv.offset = slot + t
            outs.append(self.ops.prefill_attention(q, kv.blocks, layer, keys, values, kv.base, slot).reshape(t, hq * d))
            start += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def __call__(self, x: torch.Tensor, caches: list, lengths: list[int], cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] after the last layer for the embedded tokens x [N, hidden] (lengths sum to N),
        at the RoPE angles cos/sin [N, head_dim]; each sequence's K/V go to the slots after its cache's offset."""
        ops = self.ops
        slots = [cache.offset for cache in caches]
        for cache, t, slot in zip(caches, lengths, slots):
            cache.reserve(slot + t)
        for i, layer in enumerate(self.runner.model.layers):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            qkv = _product(ops.rms_norm(x, norm.weight, norm.eps), attn._wqkv, attn._bqkv)
            out = self.attention(qkv, i, caches, lengths, slots, cos, sin)
            x = _product(out, _weight(attn.o_proj), residual=x)
            norm = layer.post_attention_layernorm
            gate_up = _product(ops.rms_norm(x, norm.weight, norm.eps), mlp._wgu)
            x = _product(ops.silu_mul(gate_up), _weight(mlp.down_proj), residual=x)
        return x

