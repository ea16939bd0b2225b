"""The static decoders' forward: the runner's layer math over static K/V rows, in few kernels.

On a GPU at batch 1 the number of kernels, not the bytes read, sets the speed, and the reference
layer (kvtool.models.runner) spends many on casts and small elementwise ops. Here, per layer:
RMSNorm with its weight in one op; one QKV matmul; Qwen3's q and k norms as one normalisation
over all q and k heads times a per-head weight table; RoPE for q and k at once
(x * cos + roll(x, D/2) * sin_signed, the rotate_half identity); the new K/V written in place;
one attention call: about half the ops the reference dispatches per layer in bf16 (docs/benchmarks.md,
"kvtool.engine.decode_step"). The math is the reference's; only rounding order differs (fp32 agrees to
~1e-6; tests hold both paths to the same tokens).

Two shapes use it. step(): one token for each of n rows, attention as one SDPA call whose
"query length" is the GQA group (K/V never repeated), an additive mask hiding each row's
window slots after its position. extend(): T tokens of one row (a prompt, or the part of it
after a prefix-cache hit): causal SDPA when the row starts empty, else a mask over the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.kernels.linear import linear


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], module.weight, module.eps)


class DecodeStep:
    def __init__(self, runner):
        s = runner.spec
        self.runner, self.model = runner, runner.model
        self.hq, self.hkv, self.d = s.num_heads, s.num_kv_heads, s.head_dim
        self.group = self.hq // self.hkv
        half = self.d // 2
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(runner.device, runner.dtype)
        self.qk_weight = None
        if s.qk_norm:  # [Hq + Hkv, D]: q_norm's weight for every q head, then k_norm's for every kv head
            self.qk_weight = [torch.cat([layer.self_attn.q_norm.weight.expand(self.hq, self.d),
                                         layer.self_attn.k_norm.weight.expand(self.hkv, self.d)]).detach()
                              for layer in self.model.layers]

    def signed_sin(self, sin: torch.Tensor) -> torch.Tensor:
        """The sin table with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin."""
        return sin * self.sign

    @staticmethod
    def mask(window: torch.Tensor, pos: torch.Tensor, dtype) -> torch.Tensor:
        """Additive mask [n, bucket]: 0 at slots <= the position of query n, -inf after."""
        bias = torch.zeros(pos.shape[0], window.shape[0], dtype=dtype, device=pos.device)
        return bias.masked_fill_(window[None] > pos[:, None], float("-inf"))

    def _qkv(self, i: int, layer, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor):
        """q [n, Hq, D] and k [n, Hkv, D] (normed, rotated), v [n, Hkv, D] for x [n, hidden]."""
        attn, n, hq, hkv, d = layer.self_attn, x.shape[0], self.hq, self.hkv, self.d
        h = _norm(layer.input_layernorm, x)
        if attn._wqkv is not None:
            qkv = linear(h, attn._wqkv, attn._bqkv).view(n, hq + 2 * hkv, d)
        else:
            qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], -1).view(n, hq + 2 * hkv, d)
        qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
        if self.qk_weight is not None:
            qk = F.rms_norm(qk, (d,), eps=attn.q_norm.eps) * self.qk_weight[i]
        qk = torch.addcmul(qk * c, qk.roll(d // 2, -1), s)
        return qk[:, :hq], qk[:, hq:], v

    def _finish(self, layer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Attention output [n, Hq * D] -> the layer's output: o_proj, residual, MLP, residual."""
        x = x + layer.self_attn.o_proj(out)
        return x + layer.mlp(_norm(layer.post_attention_layernorm, x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner.head(_norm(self.model.norm, x))

    def __call__(self, tokens, pos, rows, keys, values, bucket: int, cos, sin_signed, window) -> torch.Tensor:
        """One token per row. tokens, pos, rows [n]; keys/values per layer [slots, Hkv, max_len + 1, D];
        cos, sin_signed [max_len + 1, D]; window = arange(max_len + 1). Returns logits [n, V] (fp32)."""
        n, hkv, d = tokens.shape[0], self.hkv, self.d
        x = self.model.embed_tokens(tokens)  # [n, hidden]
        c, s = cos[pos][:, None], sin_signed[pos][:, None]  # [n, 1, D]
        bias = self.mask(window[:bucket], pos, x.dtype)[:, None, None]  # [n, 1, 1, bucket]
        for i, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(i, layer, x, c, s)
            keys[i][rows, :, pos] = k
            values[i][rows, :, pos] = v
            q = q.reshape(n, hkv, self.group, d)  # a kv head's q heads as its query rows
            out = F.scaled_dot_product_attention(q, keys[i][:n, :, :bucket], values[i][:n, :, :bucket],
                                                 attn_mask=bias)
            x = self._finish(layer, x, out.reshape(n, self.hq * d))
        return self._logits(x)

    def extend(self, tokens, pos, last, slot: int, keys, values, window_len: int, causal: bool, cos, sin_signed,
               window) -> torch.Tensor:
        """T tokens of one row at positions pos [T] (padding included); logits [1, V] of token `last` [1].

        causal: the row starts empty and pos = arange(T), window_len = T (one causal SDPA call);
        otherwise query j attends to window slots <= pos[j] (K/V repeated to the q heads, so the
        masked call runs a fused kernel on CUDA rather than the math path)."""
        t, d = tokens.shape[0], self.d
        x = self.model.embed_tokens(tokens)  # [T, hidden]
        c, s = cos[pos][:, None], sin_signed[pos][:, None]
        bias = None if causal else self.mask(window[:window_len], pos, x.dtype)
        for i, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(i, layer, x, c, s)
            keys[i][slot, :, pos] = k.transpose(0, 1)
            values[i][slot, :, pos] = v.transpose(0, 1)
            kw, vw = keys[i][slot : slot + 1, :, :window_len], values[i][slot : slot + 1, :, :window_len]
            q = q.transpose(0, 1)[None]  # [1, Hq, T, D]
            if causal:
                out = F.scaled_dot_product_attention(q, kw, vw, is_causal=True, enable_gqa=True)
            else:
                kw, vw = kw.repeat_interleave(self.group, 1), vw.repeat_interleave(self.group, 1)
                out = F.scaled_dot_product_attention(q, kw, vw, attn_mask=bias)
            x = self._finish(layer, x, out[0].transpose(0, 1).reshape(t, self.hq * d))
        return self._logits(x.index_select(0, last))
