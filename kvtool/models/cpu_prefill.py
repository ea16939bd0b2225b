"""fp32 prefill on the CPU: the work between the matmuls through the C++ ops (kvtool/kernels/cpu_prefill.cpp).

Each layer is `rms_norm`, the fused qkv product, `rope_qkv` (Qwen3's q/k norms, RoPE of q and k, K and V written
straight into the cache's blocks or buffers), `prefill_attention` (kvtool/kernels/cpu_attention.cpp: causal, each KV
head's group of query heads scored at once, a paged cache's blocks read in place; sequences of one new token in the
same forward, decode rows beside a prompt's chunk, go through the decode step's `attend` together, which pads no lone
query row), the o product with the residual added by oneDNN as a post-op, `rms_norm`, the gate_up product,
`silu_mul` and the down product with the residual: each a pass over the activations where the reference forward
runs several small ATen ops. Each row is computed by one thread, so the result does not depend on the thread count.
Numerics: RoPE, silu * up and the K/V copies give the reference's bits; RMSNorm sums its squares in another order
(SmolLM2 logits within 1.5e-3 of the reference forward's over 700 tokens, greedy tokens the same).

ModelRunner.run takes this path for every forward without a tap that the decode step does not, once
`use_cpu_decode()` (or `use_cpu_prefill()`) turned it on; kvtool.load does, for fp32 CPU models whose ops
built. Taps, other dtypes and devices run the reference forward. docs/benchmarks.md has the profiles behind it.
"""

from __future__ import annotations

import torch

from kvtool.models.cpu_step import DecodeStep, _product, _weight, attend_layout


class PrefillPass:
    """New tokens of n sequences (any count each, packed back to back) through the layers, each sequence over its
    own KVCache. Reads the runner's modules on every call, so fuse(), packing or a move need no rebuild."""

    takes = staticmethod(DecodeStep.takes)  # the same cache layout: contiguous fp32 or bf16 CPU [1, H, capacity, D]

    def __init__(self, runner):
        self.runner = runner
        self.ops = torch.ops.kvtool_cpu

    def attention(self, qkv: torch.Tensor, layer: int, caches: list, lengths: list[int], slots: list[int],
                  cos: torch.Tensor, sin: torch.Tensor, ones: tuple | None = None) -> torch.Tensor:
        """The attention output [N, hq d] of one layer for qkv [N, (hq + 2 hkv) d]; K and V go into the caches. The
        sequences of one new token (`ones`, from singles()) go through one call of `attend`, the decode step's op."""
        s, attn = self.runner.spec, self.runner.model.layers[layer].self_attn
        hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        eps = attn.q_norm.eps if attn.qk_norm else 0.0
        out, start = qkv.new_empty(qkv.shape[0], hq * d), 0
        for j, (cache, t, slot) in enumerate(zip(caches, lengths, slots)):
            kv, rows, start = cache.layers[layer], slice(start, start + t), start + t
            if ones is None or j not in ones[0]:
                keys, values = kv.buffers
                q = self.ops.rope_qkv(qkv[rows], keys, values, slot, cos[rows], sin[rows], qn, kn, eps, hq, hkv,
                                      kv.blocks, layer, kv.base)
                out[rows] = self.ops.prefill_attention(q, kv.blocks, layer, keys, values, kv.base, slot).flatten(1)
            kv.offset = slot + t
        if ones is not None:
            buffers = [caches[j].layers[layer].buffers for j in ones[0]]
            out[ones[1]] = self.ops.attend(qkv[ones[1]], [k for k, _ in buffers], [v for _, v in buffers], *ones[2:5],
                                           qn, kn, eps, hq, hkv, *ones[5:], layer)
        return out

    @staticmethod
    def singles(caches: list, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """attention()'s `ones` for the sequences of one new token (decode rows beside a prompt's chunk): which, their
        rows, then attend's slots, cos, sin, prefix and prefix_count."""
        which = [j for j, t in enumerate(lengths) if t == 1]
        rows = (torch.tensor(lengths).cumsum(0)[which] - 1).to(cos.device)
        slots, shared = attend_layout([caches[j] for j in which])  # (reserved: the page holds the slot)
        return which, rows, slots, cos[rows].contiguous(), sin[rows].contiguous(), *shared

    def __call__(self, x: torch.Tensor, caches: list, lengths: list[int], cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] after the last layer for the embedded tokens x [N, hidden] (lengths sum to N),
        at the RoPE angles cos/sin [N, head_dim]; each sequence's K/V go to the slots after its cache's offset."""
        slots = [cache.offset for cache in caches]
        for cache, t, slot in zip(caches, lengths, slots):
            cache.reserve(slot + t)
        ones = self.singles(caches, lengths, cos, sin) if 1 in lengths else None
        for i, layer in enumerate(self.runner.model.layers):
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            qkv = _product(x, attn._wqkv, attn._bqkv, norm=norm)
            x = _product(self.attention(qkv, i, caches, lengths, slots, cos, sin, ones), _weight(attn.o_proj),
                         residual=x)
            norm = layer.post_attention_layernorm
            gate_up = _product(x, mlp._wgu, norm=norm, half_out=True)
            x = _product(self.ops.silu_mul(gate_up), _weight(mlp.down_proj), residual=x)
        return x

