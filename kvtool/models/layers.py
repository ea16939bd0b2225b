"""The decoder layers of the lean forward pass (Qwen3, Qwen2/Qwen2.5, Llama): RMSNorm, attention over an explicit
KV cache, the gated MLP, and the tap that lets callers see what attention saw.

Module and parameter names match the Hugging Face checkpoints, so weights load by name. kvtool.models.runner
puts them together into a model; kvtool.models.cpu_step and kvtool.models.cpu_prefill run the same layers'
weights through C++ ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.cache.kv import KVCache
from kvtool.kernels import cpu_gemm, quant
from kvtool.kernels.linear import linear
from kvtool.models.rope import apply_rope
from kvtool.models.spec import ModelSpec


@dataclass
class AttentionTap:
    """What one layer's attention saw; passed to a tap callback (viz, skill relocation)."""

    layer: int
    positions: torch.Tensor  # [T]
    q: torch.Tensor  # [1, Hq, T, D] after q_norm, before RoPE
    k: torch.Tensor  # [1, Hkv, T, D] after k_norm, before RoPE
    q_rot: torch.Tensor
    k_rot: torch.Tensor
    v: torch.Tensor
    cache: KVCache  # holds this layer's keys/values including the current chunk


Tap = Callable[[AttentionTap], None]


@dataclass
class ForwardPlan:
    """One step's forward (ModelRunner.run): each sequence's new token ids and KVCache, their positions (by default
    the slots after each cache's tokens), the logits wanted, an attention tap, and the path (EngineConfig.forward:
    "auto" or "cpu-ops" take the C++ CPU ops where the runner has them, "reference" the reference layers)."""
    seqs: list[tuple[torch.Tensor, KVCache]]
    positions: torch.Tensor | None = None
    logits: str | list = "last"
    tap: Tap | None = None
    path: str = "auto"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one op; the same bits as the steps below, whose casts are no-ops in fp32
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in fp32 and scale after casting back, as HF does (matters in bf16).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def causal_mask(q_len: int, kv_len: int, device, window: int | None = None) -> torch.Tensor | None:
    """Boolean [T, S] mask for q_len new tokens appended after kv_len - q_len cached ones; with a window,
    each token sees only itself and the window - 1 slots before it (a sliding-window layer)."""
    if window is not None and kv_len > window:
        return window_mask(torch.arange(kv_len - q_len, kv_len, device=device), kv_len, window)
    if q_len == 1:
        return None
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)


def window_mask(rows: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """Boolean [R, S]: slot s is visible to the query at slot r when s <= r (and r - s < window)."""
    slots = torch.arange(kv_len, device=rows.device)[None, :]
    mask = slots <= rows[:, None]
    return mask if window is None else mask & (slots > rows[:, None] - window)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, hq, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, hq, hkv
        self.q_proj = nn.Linear(spec.hidden_size, hq * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(spec.hidden_size, hkv * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(spec.hidden_size, hkv * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(hq * d, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.window: int | None = None  # a sliding-window layer's window (Gemma 3's local layers)
        self.scale: float | None = None  # the query scale; None: 1/sqrt(head_dim)
        self._wqkv: torch.Tensor | quant.Int4Weight | cpu_gemm.PackedWeight | None = None
        self._bqkv: torch.Tensor | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v; the HF-named weights become views into it."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).contiguous()
        splits = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), w.split(splits)):
            proj.weight = nn.Parameter(part, requires_grad=False)
        self._wqkv = w
        if self.q_proj.bias is not None:
            b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).contiguous()
            for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), b.split(splits)):
                proj.bias = nn.Parameter(part, requires_grad=False)
            self._bqkv = b

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [1, Hq, T, D], k and v [1, Hkv, T, D] of x [1, T, hidden]; q/k normed (Qwen3), before RoPE."""
        b, n, _ = x.shape
        d = self.head_dim
        if self._wqkv is not None:
            q, k, v = linear(x, self._wqkv, self._bqkv).split(
                [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, n, self.num_heads, d).transpose(1, 2)
        k = k.view(b, n, self.num_kv_heads, d).transpose(1, 2)
        v = v.view(b, n, self.num_kv_heads, d).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """RoPE for this layer; cos/sin as the runner's rope_cos_sin() gives them."""
        return apply_rope(x, cos, sin)

    def forward(self, x, cos, sin, layer_idx: int, caches: list[KVCache], positions, lengths: list[int],
                tap: Tap | None):
        """x [1, N, hidden] holds the new tokens of len(caches) sequences back to back (lengths sum to N).

        Projections run once over all N tokens; RoPE, cache append and attention run per sequence.
        """
        b, n, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x)
        q_rot, k_rot = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        outs, start = [], 0
        for cache, t in zip(caches, lengths):
            sl = slice(start, start + t)
            keys, values = cache[layer_idx].append(k_rot[:, :, sl], v[:, :, sl])
            if keys.dtype != q_rot.dtype:  # a bf16 KV cache of an fp32 model (EngineConfig.kv_dtype): widened exactly
                keys, values = keys.to(q_rot.dtype), values.to(q_rot.dtype)
            if tap is not None:
                tap(AttentionTap(layer_idx, positions[sl], q[:, :, sl], k[:, :, sl], q_rot[:, :, sl],
                                 k_rot[:, :, sl], v[:, :, sl], cache))
            # A chunk that starts the sequence can use the kernel's own causal path (no mask tensor).
            first = t > 1 and keys.shape[2] == t and (self.window is None or t <= self.window)
            mask = None if first else causal_mask(t, keys.shape[2], x.device, self.window)
            outs.append(F.scaled_dot_product_attention(q_rot[:, :, sl], keys, values, attn_mask=mask,
                                                       is_causal=first, enable_gqa=True, scale=self.scale))
            start += t
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * d))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self._wgu: torch.Tensor | quant.Int4Weight | cpu_gemm.PackedWeight | None = None

    def fuse(self) -> None:
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).contiguous()
        gate, up = w.split(self.gate_proj.out_features)
        self.gate_proj.weight = nn.Parameter(gate, requires_grad=False)
        self.up_proj.weight = nn.Parameter(up, requires_grad=False)
        self._wgu = w

    def forward(self, x):
        if self._wgu is not None:
            gate, up = linear(x, self._wgu).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, layer_idx, caches, positions, lengths, tap):
        return self.finish(x, self.self_attn(self.input_layernorm(x), cos, sin, layer_idx, caches, positions,
                                             lengths, tap))

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: residual, then the MLP block (attn_out is o_proj's output)."""
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
